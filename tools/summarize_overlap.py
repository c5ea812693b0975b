#!/usr/bin/env python3
"""tools/summarize_overlap.py: the step times of strata-train JSON files written by
tools/gpu/run_overlap.sh, per run name over every repetition, steps 3 on (the first two warm up, and
with clipping at 1.0 they are the ones clipped and redone): median, min and max, each against the
PyTorch resident run's median; and each strata run's bytes per step with the time the link needs
for them at the speed it reached.

  python3 tools/summarize_overlap.py FILE.json...
"""

import json
import statistics
import sys


def main():
    for path in sys.argv[1:]:
        runs = json.load(open(path))["runs"]
        by_name = {}
        for r in runs:
            by_name.setdefault(r["name"], []).extend(s for s in r["steps"] if s["step"] >= 3)
        base = statistics.median(s["step_ms"] for s in by_name.get("torch_adamw_resident", []))
        print(f"{path}: steps 3 on of every repetition; ratio to torch_adamw_resident's median")
        for name, steps in by_name.items():
            ms = [s["step_ms"] for s in steps]
            med = statistics.median(ms)
            line = (
                f"  {name:24s} median {med:7.1f} ms (min {min(ms):7.1f}, max {max(ms):7.1f}, "
                f"n={len(ms)})  x{med / base:.2f}"
            )
            if steps[0].get("h2d_bytes") and steps[0].get("h2d_gbps"):
                h2d = statistics.median(s["h2d_bytes"] for s in steps) / 1e9
                d2h = statistics.median(s["d2h_bytes"] for s in steps) / 1e9
                rate = statistics.median(min(s["h2d_gbps"], s["d2h_gbps"]) for s in steps)
                line += (
                    f"  H2D {h2d:.2f} GB, D2H {d2h:.2f} GB: {1e3 * max(h2d, d2h) / rate:.0f} ms "
                    f"of link at {rate:.1f} GB/s"
                )
            redone = sum(
                1 for r in runs if r["name"] == name for s in r["steps"] if s.get("redone")
            )
            if redone:
                line += f"  ({redone} steps redone in all)"
            drains = [r.get("drain_ms", 0) for r in runs if r["name"] == name]
            if max(drains) >= 0.1:
                line += f"  (copies drained after the last step: {max(drains):.1f} ms at most)"
            print(line)


if __name__ == "__main__":
    main()
