"""strata-train JSON files to one table: each run's medians over its last steps (after the
hybrid's search has settled: See Note [Measured split] in policies/split_search.h), its host layers,
the host's medians (queued before its first wait, waited for gradients, in the host kernel) and its
final placement line.

    python3 tools/gpu/summarize_split.py OUT/train-*.json [--last 10]
"""

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--last", type=int, default=10)
    args = ap.parse_args()
    print(
        f"| file | run | host layers | step ms, last {args.last} | optimizer ms "
        "| host queued / waited / kernel ms | placement |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        for run in data["runs"]:
            steps = run.get("steps", [])[-args.last :]
            if not steps:
                continue
            step_ms = statistics.median(s["step_ms"] for s in steps)
            optim_ms = statistics.median(s["optimizer_ms"] for s in steps)
            host = run.get("host_layers", [])
            line = run.get("placement", "")
            times = " / ".join(
                f"{statistics.median(s.get(k, 0.0) for s in steps):.1f}"
                for k in ("host_queued_ms", "host_waited_ms", "host_kernel_ms")
            )
            print(
                f"| {path.rsplit('/', 1)[-1]} | {run['name']} | {len(host)} | {step_ms:.1f} | "
                f"{optim_ms:.1f} | {times} | {line} |"
            )


if __name__ == "__main__":
    main()
