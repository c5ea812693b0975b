#!/usr/bin/env python3
"""Short table from strata_runtime_bench's JSON (medians of the repetitions when present) and the
pass/fail of issue 3's targets:
  - migration through the runtime >= 0.95 x raw pinned cudaMemcpyAsync, h2d, d2h and both at once
    (ratio_to_raw = runtime gbps / gbps of raw passes taken right before each timed cycle; JSON
    from before those passes existed falls back to BM_RawPinnedCopy of the same run), with no
    segment allocation (cudaMalloc, pinning) inside the timed region;
  - bulk offload_all + reload_all of 12 GB with the GPU memory kept cached <= 1.03 x its floor
    (2 x bytes / raw pinned bandwidth), no GPU segment allocation after the first cycle; with the
    memory given back to the driver (offload_all's default) <= 1.05 x the floor plus the GPU
    tier's allocation time (issue 13's phase-switch target);
  - no pinned segment allocation after the first cycle;
  - pinned bytes reserved <= 1.02 x bytes held.
With every repetition in the JSON (no --benchmark_report_aggregates_only), each ratio is judged
repetition by repetition: PASS when all meet the target, FAIL when none does, WITHIN NOISE
otherwise, with the median, min and max.
Exit status 0 when every target passes, 1 otherwise (a missing or skipped benchmark fails)."""

import sys

DIRECTIONS = ["h2d", "d2h", "both"]
MIN_RATIO_TO_RAW = 0.95
MAX_RATIO_TO_FLOOR = 1.03
MAX_RATIO_TO_FLOOR_PLUS_ALLOC = 1.05
MAX_RESERVED_OVER_HELD = 1.02


from bench_json import Verdicts, find, fmt, load, why_missing


def ratio_to_raw(raw, ours):
    """(ratio, raw gbps it divides by): the raw passes next to the cycles when the JSON has them."""
    if ours.value("ratio_to_raw") is not None:
        return ours.value("ratio_to_raw"), ours.value("raw_gbps")
    raw_gbps = raw.value("gbps") if raw and raw.usable() else None
    our_gbps = ours.value("gbps")
    return (our_gbps / raw_gbps if raw_gbps and our_gbps is not None else None), raw_gbps


def offload_reload(groups, verdicts, fam, cached):
    """offload_all + reload_all of 12 GB: with the GPU memory kept cached, the migrations alone
    (<= 1.03 x floor, no GPU segment allocation after the first cycle); given back to the driver,
    issue 13's phase-switch target (<= 1.05 x floor plus the GPU tier's allocation time)."""
    verdict = verdicts.add
    g = find(groups, fam)
    what = "GPU memory kept cached" if cached else "GPU memory back to the driver"
    print(f"\nbulk offload_all + reload_all, 12 GB, {what} ({fam})")
    ratio, goal = (
        ("ratio_to_floor", MAX_RATIO_TO_FLOOR)
        if cached
        else ("ratio_to_floor_plus_alloc", MAX_RATIO_TO_FLOOR_PLUS_ALLOC)
    )
    missing = why_missing((fam, g))
    if missing:
        for label in (
            f"{ratio} <= {goal}",
            "pinned allocs after first == 0",
            f"pinned reserved / held <= {MAX_RESERVED_OVER_HELD}",
        ):
            verdict(label, None, missing)
        return
    print(
        f"  seconds {fmt(g.value('seconds'), '.4f')}"
        f" (offload {fmt(g.value('offload_seconds'), '.4f')}"
        f" + reload {fmt(g.value('reload_seconds'), '.4f')}),"
        f" {fmt(g.value('gbps'))} GB/s;"
        f" floor {fmt(g.value('floor_seconds'), '.4f')} s from raw pinned h2d "
        f"{fmt(g.value('raw_h2d_gbps'))} / d2h {fmt(g.value('raw_d2h_gbps'))} GB/s"
    )
    print(
        f"  first cycle {fmt(g.value('first_cycle_seconds'), '.3f')} s (pins host memory);"
        f" host syncs per cycle {fmt(g.value('host_syncs'), '.1f')};"
        f" tensors offloaded to pageable {fmt(g.worst('pageable_tensors'), 'g')};"
        " gpu segment allocs after first"
        f" {fmt(g.worst('gpu_segment_allocs_after_first'), 'g')};"
        f" GPU tier allocation {fmt(g.value('gpu_upstream_alloc_seconds'), '.4f')} s and free"
        f" {fmt(g.value('gpu_upstream_free_seconds'), '.4f')} s a cycle;"
        f" x floor {fmt(g.value('ratio_to_floor'), '.4f')}"
    )
    reps = g.per_repetition(ratio)
    if reps:
        verdicts.judge(ratio, reps, goal, at_least=False)
    else:
        r = g.value(ratio)
        verdict(f"{ratio} {fmt(r, '.4f')} <= {goal}", None if not r else r <= goal, "no floor")
    if cached:
        a = g.worst("gpu_segment_allocs_after_first")
        verdict(
            f"gpu segment allocs after first {fmt(a, 'g')} == 0",
            None if a is None else a == 0,
            "counter absent",
        )
    a = g.worst("pinned_host_allocs_after_first")
    verdict(
        f"pinned allocs after first {fmt(a, 'g')} == 0",
        None if a is None else a == 0,
        "counter absent",
    )
    q = g.value("pinned_reserved_over_held")
    verdict(
        f"pinned reserved / held {fmt(q, '.4f')} <= {MAX_RESERVED_OVER_HELD}",
        None if not q else q <= MAX_RESERVED_OVER_HELD,
        "nothing held in pinned memory",
    )


def main(path):
    ctx, groups = load(path)
    print(f"gpu: {ctx.get('gpu')}  runtime pinned method: {ctx.get('pinned_method')}")
    print(f"raw: {ctx.get('raw_method')}")
    print(f"runtime: {ctx.get('runtime_timing')}")
    verdicts = Verdicts()
    verdict = verdicts.add

    print("\nmigration through the runtime vs raw pinned copies (decimal GB/s)")
    print("  raw: BM_RawPinnedCopy; raw next: the raw passes right before each runtime cycle")
    print(
        f"  {'direction':<10}{'raw':>10}{'raw next':>10}{'runtime':>10}{'ratio_to_raw':>14}"
        f"{'engine h2d/d2h':>18}{'gpu/pinned segment allocs':>28}"
    )
    for d in DIRECTIONS:
        raw = find(groups, f"BM_RawPinnedCopy/{d}")
        ours = find(groups, f"BM_RuntimeMigrate/{d}")
        raw_gbps = raw.value("gbps") if raw and raw.usable() else None
        our_gbps = ours.value("gbps") if ours and ours.usable() else None
        ratio = next_gbps = None
        engine = segs = "-"
        if ours and ours.usable():
            ratio, next_gbps = ratio_to_raw(raw, ours)
            engine = f"{fmt(ours.value('engine_h2d_gbps'))}/{fmt(ours.value('engine_d2h_gbps'))}"
            segs = (
                f"{fmt(ours.worst('gpu_segment_allocs'), 'g')}/"
                f"{fmt(ours.worst('pinned_segment_allocs'), 'g')}"
            )
        extra = ""
        if d == "both" and raw and raw.usable():
            extra = f"   (raw sum of directions {fmt(raw.value('sum_gbps'))})"
        print(
            f"  {d:<10}{fmt(raw_gbps):>10}{fmt(next_gbps):>10}{fmt(our_gbps):>10}"
            f"{fmt(ratio, '.3f'):>14}"
            f"{engine:>18}{segs:>28}{extra}"
        )
    for d in DIRECTIONS:
        raw = find(groups, f"BM_RawPinnedCopy/{d}")
        ours = find(groups, f"BM_RuntimeMigrate/{d}")
        missing = why_missing((f"BM_RuntimeMigrate/{d}", ours))
        if missing:
            verdict(f"{d}: ratio_to_raw >= {MIN_RATIO_TO_RAW}", None, missing)
            verdict(f"{d}: no segment allocation in the timed region", None, missing)
            continue
        ratio, _ = ratio_to_raw(raw, ours)
        reps = ours.per_repetition("ratio_to_raw")
        if reps:
            # Each repetition's cycles ran after raw passes of their own: judged one by one.
            verdicts.judge(f"{d}: ratio_to_raw", reps, MIN_RATIO_TO_RAW, at_least=True)
        else:
            verdict(
                f"{d}: ratio_to_raw {fmt(ratio, '.3f')} >= {MIN_RATIO_TO_RAW}",
                None if ratio is None else ratio >= MIN_RATIO_TO_RAW,
                "raw gbps is 0",
            )
        allocs = [ours.worst("gpu_segment_allocs"), ours.worst("pinned_segment_allocs")]
        verdict(
            f"{d}: segment allocs in the timed region gpu {fmt(allocs[0], 'g')} pinned "
            f"{fmt(allocs[1], 'g')} == 0",
            None if None in allocs else all(a == 0 for a in allocs),
            "counters absent",
        )

    offload_reload(groups, verdicts, "BM_OffloadReload/12GB_cached", cached=True)
    offload_reload(groups, verdicts, "BM_OffloadReload/12GB", cached=False)

    fam = "BM_SimulatedOffloadReload/256MB"
    g = find(groups, fam)
    print(f"\nsimulated device, host memcpy, not PCIe ({fam}; no target)")
    if g and g.usable():
        print(
            f"  seconds {fmt(g.value('seconds'), '.4f')}, {fmt(g.value('gbps'))} GB/s,"
            f" pinned allocs after first {fmt(g.worst('pinned_host_allocs_after_first'), 'g')},"
            f" host syncs per cycle {fmt(g.value('host_syncs'), '.1f')}"
        )
    else:
        print(f"  {why_missing((fam, g))}")

    ok = verdicts.all_pass()
    print(f"\nruntime targets: {'ALL PASS' if ok else 'SOME FAIL OR MISSING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} strata_runtime_bench.json")
    sys.exit(main(sys.argv[1]))
