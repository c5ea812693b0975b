"""Reads a torch.profiler chrome trace of the users' script (bench/users_script.py --profile) and
says where the stream that computes waited and for which copies: each stream's busy time, the
compute stream's gaps by the operation that ended them, and for the longest gaps the copies of
other streams that ran before it with the host time they were queued at. A copy engine runs the
copies in the order they were queued, across streams, so a small copy torch queues on the compute
stream waits for every copy of strata's queued before it.

    python3 bench/trace_copies.py profile-fsdp2_strata-d3-b32.json.gz [--gaps 3]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=3, help="longest gaps to show in detail")
    ap.add_argument("--min_gap_ms", type=float, default=0.3)
    args = ap.parse_args()
    events = load(args.trace)
    gpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    launch = {
        e["args"].get("correlation"): e["ts"]
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
    }
    gpu.sort(key=lambda e: e["ts"])
    t0 = gpu[0]["ts"]
    span = (max(e["ts"] + e["dur"] for e in gpu) - t0) / 1e3
    busy = collections.Counter()
    for e in gpu:
        busy[e["args"]["stream"]] += e["dur"]
    compute = max(
        busy,
        key=lambda s: sum(
            e["dur"] for e in gpu if e["args"]["stream"] == s and e["cat"] == "kernel"
        ),
    )
    print(f"{args.trace}: {span:.1f} ms of GPU time; the compute stream is {compute}")
    for s, us in busy.most_common():
        print(f"  stream {s:>3}: busy {us / 1e3:8.1f} ms")
    ops = [e for e in gpu if e["args"]["stream"] == compute]
    gaps = []
    for a, b in zip(ops, ops[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > args.min_gap_ms * 1e3:
            gaps.append((g, b))
    by_next = collections.Counter()
    for g, b in gaps:
        by_next[b["name"][:50]] += g
    print(
        f"compute stream gaps over {args.min_gap_ms} ms: {len(gaps)}, "
        f"{sum(g for g, _ in gaps) / 1e3:.1f} ms, by the operation that ended them:"
    )
    for name, us in by_next.most_common(6):
        print(f"  {us / 1e3:8.1f} ms  {name}")
    for g, b in sorted(gaps, key=lambda x: -x[0])[: args.gaps]:
        queued = launch.get(b["args"].get("correlation"), b["ts"])
        print(
            f"\ngap of {g / 1e3:.2f} ms before '{b['name'][:40]}' "
            f"({b['args'].get('bytes', '')} bytes), queued at {(queued - t0) / 1e3:.2f}, "
            f"ran at {(b['ts'] - t0) / 1e3:.2f}; copies of other streams in the gap:"
        )
        for e in gpu:
            if (
                e["cat"] == "gpu_memcpy"
                and e["args"]["stream"] != compute
                and b["ts"] - g <= e["ts"] + e["dur"]
                and e["ts"] <= b["ts"]
            ):
                q = launch.get(e["args"].get("correlation"))
                print(
                    f"  stream {e['args']['stream']:>3} {(e['ts'] - t0) / 1e3:8.2f}-"
                    f"{(e['ts'] + e['dur'] - t0) / 1e3:8.2f} {e['args'].get('bytes', 0):>10} B "
                    f"{e['name'][:24]:<24} queued at "
                    f"{'?' if q is None else f'{(q - t0) / 1e3:.2f}'}"
                )


if __name__ == "__main__":
    main()
