#!/usr/bin/env python3
"""Short table from strata_allocator_bench's JSON (medians of the repetitions) and the pass/fail of
issue targets: pooled alloc+free median <= 200 ns and faster than PyTorch's caching allocator;
reserved / peak allocated <= 1.05 on the training-step replay."""
import json
import sys

UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def main(path):
    with open(path) as f:
        data = json.load(f)
    ctx = data.get("context", {})
    rows = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        rows[name] = b
    print(f"gpu: {ctx.get('gpu')}  torch: {ctx.get('torch')}  pinned default: {ctx.get('pinned_default')}")

    def ns(b):
        return b["real_time"] * UNIT_NS[b.get("time_unit", "ns")]

    families = ["BM_StrataAllocFree/gpu", "BM_StrataAllocFree/pinned_host",
                "BM_StrataAllocFree/pageable_host", "BM_StrataAllocFree/simulated_gpu",
                "BM_TorchCachingAllocator", "BM_TorchEmptyTensor", "BM_CudaMallocAsync",
                "BM_CudaMallocFree", "BM_CudaHostAlloc"]
    sizes = ["512", "65536", "1048576", "16777216", "268435456"]
    print("\nalloc+free median ns          " + "".join(f"{s:>12}" for s in sizes))
    table = {}
    for fam in families:
        cells = []
        for s in sizes:
            hit = [b for n, b in rows.items() if n.startswith(fam + "/" + s) and "error_occurred" not in b]
            if hit:
                table[(fam, s)] = ns(hit[0])
                cells.append(f"{ns(hit[0]):12.0f}")
            else:
                cells.append(f"{'-':>12}")
        print(f"{fam.replace("BM_", ""):<30}" + "".join(cells))
    ok = True
    for s in sizes:
        ours, torch = table.get(("BM_StrataAllocFree/gpu", s)), table.get(("BM_TorchCachingAllocator", s))
        if ours is None:
            continue
        verdict = ours <= 200 and (torch is None or ours < torch)
        ok &= verdict
        print(f"  target size {s}: strata gpu {ours:.0f} ns <= 200 and < torch {torch and round(torch)}: {'PASS' if verdict else 'FAIL'}")

    print("\npinned upstream")
    for n, b in sorted(rows.items()):
        if n.startswith("BM_PinnedUpstream") or n.startswith("BM_PinnedH2D"):
            counters = {k: v for k, v in b.items() if k.endswith("GBps") or k.endswith("_ms")}
            print(f"  {n:<58} " + " ".join(f"{k}={v:.2f}" for k, v in counters.items()))

    print("\ntraining-step replay (reserved / peak allocated)")
    for n, b in sorted(rows.items()):
        if n.startswith("BM_Replay") and "error_occurred" not in b:
            r = b.get("reserved_over_peak_allocated")
            print(f"  {n:<40} reserved/peak_allocated={r:.4f} reserved/trace_peak="
                  f"{b.get('reserved_over_trace_peak', 0):.4f} steady_step_ms={b.get('steady_step_ms', 0):.3f}"
                  f" upstream_allocs={b.get('upstream_allocs', 0):.0f}")
            if n.startswith("BM_ReplayStrata/gpu"):
                verdict = r <= 1.05
                ok &= verdict
                print(f"  target strata gpu replay <= 1.05: {'PASS' if verdict else 'FAIL'}")
    print(f"\nallocator targets: {'ALL PASS' if ok else 'SOME FAIL'}")


if __name__ == "__main__":
    main(sys.argv[1])
