#!/usr/bin/env python3
"""Judges strata-train --compare runs repeated in rounds (--runs=A,B,A,B or A,B,B,A ...): the k-th
run of each name belongs to round k, so each ratio is taken round by round, and a verdict is given
only where every round agrees (PASS when every round's ratio is below the goal, FAIL when every
one is above it, WITHIN NOISE otherwise), as tools/gpu/summarize_compare.py does for the
optimizer benchmarks. A run's time is its median step time (the first step left out).

Example:
    strata-train --compare ... --runs=layer_prefetch,torch_adamw_resident,torch_adamw_resident,\
layer_prefetch --json=train.json
    python3 tools/summarize_train_rounds.py train.json --pair layer_prefetch/torch_adamw_resident
"""

import argparse
import json
import statistics
import sys


def rounds(data):
    """{name: [median step ms of its 1st, 2nd, ... run]}, failed runs left out."""
    out = {}
    for run in data["runs"]:
        if run.get("ok"):
            out.setdefault(run["name"], []).append(run["median_step_ms"])
    return out


def verdict(values, goal):
    if not values:
        return "NOT RUN"
    return "PASS" if max(values) < goal else "FAIL" if min(values) > goal else "WITHIN NOISE"


def judge(by_name, a, b, goal=1.0):
    """(per-round ratios a / b, verdict) over the rounds both have."""
    ratios = [x / y for x, y in zip(by_name.get(a, []), by_name.get(b, [])) if y > 0]
    return ratios, verdict(ratios, goal)


def summarize(data, pairs):
    by_name = rounds(data)
    lines = [f"device: {data.get('device', '?')}"]
    for name, ms in by_name.items():
        lines.append(
            f"  {name:24} {statistics.median(ms):9.1f} ms  [{min(ms):.1f}, {max(ms):.1f}]"
            f"  over {len(ms)} rounds"
        )
    identical = data.get("losses_identical_across_policies")
    lines.append(f"losses identical across strata runs: {identical}")
    lines.append(f"largest loss difference from PyTorch: {data.get('max_loss_diff_vs_torch')}")
    for pair in pairs:
        a, b = pair.split("/")
        ratios, v = judge(by_name, a, b)
        if ratios:
            lines.append(
                f"  {v:12} {a} / {b}: {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} rounds (goal < 1)"
            )
        else:
            lines.append(f"  {v:12} {a} / {b}")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--pair", action="append", default=[], help="A/B: judge A's time over B's")
    args = p.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    print("\n".join(summarize(data, args.pair)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
