"""Reads a torch.profiler chrome trace of the users' script (bench/users_script.py --profile) and
says where the stream that computes waited and for which copies: each stream's busy time, the
compute stream's gaps by the operation that ended them, and for the longest gaps the copies of
other streams that ran before it with the host time they were queued at, and what the host was
doing in the gap (the CPU operations and CUDA calls that overlap it, longest first), and the
host's CUDA calls over the whole trace by time spent in them. A copy engine runs the
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
    ap.add_argument("--host_ops", type=int, default=8, help="host operations shown per gap")
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
    host = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat")
        in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
    ]
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
        host_in_gap(host, b["ts"] - g, b["ts"], t0, args.host_ops)
        if b["ts"] - queued > args.min_gap_ms * 1e3:
            # Queued well before it ran: the stream waited on the GPU. The waits the host queued
            # from 5 ms before the gap began, with the Python function or operation that queued
            # each.
            waits_queued(host, b["ts"] - g - 5e3, queued, t0, args.host_ops)
    host_calls(host)


def host_in_gap(host, start, end, t0, limit):
    """The host's operations that overlap [start, end], by the time they overlap it."""
    over = []
    for e in host:
        o = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
        if o > 0:
            over.append((o, e))
    print(f"  the host in the gap ({len(over)} operations overlap it), longest overlap first:")
    for o, e in sorted(over, key=lambda x: -x[0])[:limit]:
        print(
            f"    {o / 1e3:7.2f} ms of {e['dur'] / 1e3:7.2f}  {e['cat']:<12} {e['name'][:60]}"
            f"  ({(e['ts'] - t0) / 1e3:.2f}-{(e['ts'] + e['dur'] - t0) / 1e3:.2f})"
        )


def waits_queued(host, start, end, t0, limit):
    """The host's cudaStreamWaitEvent calls in [start, end], each with what it ran inside."""
    waits = [e for e in host if e["name"] == "cudaStreamWaitEvent" and start <= e["ts"] <= end]
    print(f"  {len(waits)} waits queued from {(start - t0) / 1e3:.2f}, the last {limit}:")
    for w in waits[-limit:]:
        inside = [
            e
            for e in host
            if e["cat"] in ("python_function", "cpu_op", "user_annotation")
            and e["ts"] <= w["ts"] <= e["ts"] + e["dur"]
        ]
        inner = sorted(inside, key=lambda e: e["dur"])[:3]
        names = " < ".join(e["name"][:50] for e in inner) or "?"
        print(f"    {(w['ts'] - t0) / 1e3:8.2f}  {names}")


def host_calls(host):
    """The host's CUDA calls over the trace: count and time, the most time first."""
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in host:
        if e["cat"] in ("cuda_runtime", "cuda_driver"):
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e["dur"]
    print("\nthe host's CUDA calls over the trace (count, ms):")
    for name, (n, us) in sorted(calls.items(), key=lambda x: -x[1][1])[:12]:
        print(f"  {n:>7} {us / 1e3:9.1f} ms  {name}")


if __name__ == "__main__":
    main()
