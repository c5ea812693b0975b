#!/usr/bin/env python3
"""Short table from strata_optim_bench's JSON (medians of the repetitions when present) and the
pass/fail of issue 4's targets ("Must show"):
  - layer_prefetch step <= 1.03 x its floor (8 bytes per parameter each way over the pinned
    bandwidth per direction measured with both directions at once, by raw passes right before
    each step), for K = 1 and K = 2;
  - layer_prefetch faster than the per-layer pipeline written with LibTorch streams, K = 1 and 2;
  - strata's resident fused Adam <= 1.00 x PyTorch's fused AdamW (step time ratio);
  - peak extra GPU memory of layer_prefetch <= (K + 1) x the largest layer's moments + 1%
    (extra_over_bound <= 1.01), K = 1 and 2.
Every approach's median step time, ratio to its floor where it has one and peak extra GPU memory
are listed, with the bulk and CPU peers for reference (no target here).
Exit status 0 when every target passes, 1 otherwise (a missing or skipped benchmark fails)."""
import sys

DEPTHS = [1, 2]
MAX_PREFETCH_RATIO_TO_FLOOR = 1.03
MAX_RESIDENT_OVER_TORCH = 1.00
MAX_EXTRA_OVER_BOUND = 1.01

# (family, label) in table order.
APPROACHES = [
    ("BM_StrataResident", "strata resident (keep_on_gpu)"),
    ("BM_TorchFusedAdamW", "torch fused AdamW, resident"),
    ("BM_StrataLayerPrefetch/1", "strata layer_prefetch K=1"),
    ("BM_StrataLayerPrefetch/2", "strata layer_prefetch K=2"),
    ("BM_TorchPerLayerPipeline", "torch per-layer pipeline"),
    ("BM_StrataBulk", "strata bulk"),
    ("BM_TorchBulkTo", "torch bulk .to() round trip"),
    ("BM_TorchCpuAdamW", "torch CPU AdamW (scaled x8)"),
]


from bench_json import Verdicts, find, fmt, load, why_missing  # noqa: E402  (beside this script)


def fmt_bytes(v):
    """Decimal units, as PERF.md writes GPU memory."""
    if v is None:
        return "-"
    if v == 0:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def step_ms(g):
    """A group's median step time; the CPU peer's is scaled to the whole model."""
    if g is None or not g.usable():
        return None
    if g.value("ms_scaled") is not None:
        return g.value("ms_scaled")
    return g.value("step_ms")


def main(path):
    ctx, groups = load(path)
    print(f"gpu: {ctx.get('gpu')}  torch: {ctx.get('torch')}"
          f"  cpu threads: {ctx.get('cpu_threads')}")
    print(f"model: {ctx.get('model')} = {ctx.get('params')} params, {ctx.get('layers')} layers,"
          f" moments {fmt_bytes(float(ctx['moment_bytes'])) if 'moment_bytes' in ctx else '-'}"
          f"; {ctx.get('hyper')}")
    if "bandwidth_error" in ctx:
        print(f"bandwidths: NOT MEASURED: {ctx['bandwidth_error']}")
    else:
        def ctx_gbps(key):
            return fmt(float(ctx[key])) if key in ctx else "-"
        print(f"bandwidths at the start (decimal GB/s): HBM {ctx_gbps('hbm_gbps')}; "
              f"pinned alone h2d "
              f"{ctx_gbps('pinned_h2d_gbps')} d2h {ctx_gbps('pinned_d2h_gbps')}; both at once "
              f"{ctx_gbps('pinned_both_per_direction_gbps')} per direction (h2d "
              f"{ctx_gbps('pinned_both_h2d_gbps')}, d2h {ctx_gbps('pinned_both_d2h_gbps')})")
    print(f"timing: {ctx.get('timing')}")
    verdicts = Verdicts()
    verdict = verdicts.add

    print("\noptimizer step, median over repetitions")
    print(f"  {'approach':<34}{'step ms':>10}{'floor ms':>10}{'ratio_to_floor':>16}"
          f"{'peak extra GPU':>16}")
    for fam, label in APPROACHES:
        g = find(groups, fam)
        if g is None or not g.usable():
            print(f"  {label:<34}{why_missing((fam, g))}")
            continue
        ratio = g.value("ratio_to_floor")
        print(f"  {label:<34}{fmt(step_ms(g), '.1f'):>10}{fmt(g.value('floor_ms'), '.1f'):>10}"
              f"{fmt(ratio if ratio else None, '.3f'):>16}"
              f"{fmt_bytes(g.value('peak_extra_gpu_bytes')):>16}")
    cpu = find(groups, "BM_TorchCpuAdamW")
    if cpu and cpu.usable():
        print(f"  (CPU AdamW: {fmt(cpu.value('step_ms'), '.1f')} ms on 1/"
              f"{fmt(cpu.value('scale'), 'g')} of the model with {fmt(cpu.value('threads'), 'g')}"
              " threads, scaled; transfers not counted)")

    res = find(groups, "BM_StrataResident")
    torch_fused = find(groups, "BM_TorchFusedAdamW")
    print("\nresident: strata fused Adam vs PyTorch fused AdamW")
    missing = why_missing(("BM_StrataResident", res), ("BM_TorchFusedAdamW", torch_fused))
    if missing:
        verdict(f"strata / torch <= {MAX_RESIDENT_OVER_TORCH:.2f}", None, missing)
    else:
        ours, theirs = res.value("step_ms"), torch_fused.value("step_ms")
        ratio = ours / theirs if ours is not None and theirs else None
        hbm = res.value("hbm_fraction")
        print(f"  strata {fmt(ours, '.2f')} ms ({fmt(res.value('achieved_gbps'), '.0f')} GB/s, "
              f"{fmt(None if hbm is None else 100 * hbm, '.1f')}% of HBM); "
              f"torch {fmt(theirs, '.2f')} ms "
              f"({fmt(torch_fused.value('achieved_gbps'), '.0f')} GB/s); host syncs per step "
              f"{fmt(res.value('host_syncs'), 'g')}")
        verdict(f"strata / torch {fmt(ratio, '.3f')} <= {MAX_RESIDENT_OVER_TORCH:.2f}",
                None if ratio is None else ratio <= MAX_RESIDENT_OVER_TORCH, "no step time")

    pipeline = find(groups, "BM_TorchPerLayerPipeline")
    pipeline_ms = step_ms(pipeline)
    for k in DEPTHS:
        fam = f"BM_StrataLayerPrefetch/{k}"
        g = find(groups, fam)
        print(f"\nlayer_prefetch K={k} ({fam})")
        missing = why_missing((fam, g))
        if missing:
            verdict(f"K={k}: ratio_to_floor <= {MAX_PREFETCH_RATIO_TO_FLOOR}", None, missing)
            verdict(f"K={k}: faster than the LibTorch per-layer pipeline", None, missing)
            verdict(f"K={k}: extra_over_bound <= {MAX_EXTRA_OVER_BOUND}", None, missing)
            continue
        print(f"  step {fmt(g.value('step_ms'), '.1f')} ms, floor "
              f"{fmt(g.value('floor_ms'), '.1f')} ms, "
              f"{fmt(g.value('achieved_gbps_per_direction'))} GB/s per direction (raw link "
              f"next to the steps {fmt(g.value('link_per_direction_gbps'))}); engine "
              f"h2d/d2h {fmt(g.value('engine_h2d_gbps'))}/{fmt(g.value('engine_d2h_gbps'))} GB/s")
        print(f"  staging ring {fmt_bytes(g.value('peak_extra_gpu_bytes'))}, staged peak "
              f"{fmt_bytes(g.value('staged_peak_bytes'))}, largest layer's moments "
              f"{fmt_bytes(g.value('largest_layer_moment_bytes'))}, device memory growth "
              f"{fmt_bytes(g.value('device_used_growth_bytes'))}")
        print(f"  per step: host syncs {fmt(g.value('host_syncs'), 'g')}, prefetch hits/waits "
              f"{fmt(g.value('prefetch_hits'), 'g')}/{fmt(g.value('prefetch_waits'), 'g')}, stall "
              f"{fmt(g.value('prefetch_stall_ms'), '.2f')} ms; after warm-up gpu/pinned segment "
              f"allocs {fmt(g.worst('gpu_segment_allocs'), 'g')}/"
              f"{fmt(g.worst('pinned_segment_allocs'), 'g')}")
        if g.value("trace_span_ms") is not None:
            print(f"  one traced step {fmt(g.value('trace_span_ms'), '.1f')} ms: both directions "
                  f"{fmt(g.value('trace_both_ms'), '.1f')} ms (h2d/d2h "
                  f"{fmt(g.value('trace_h2d_gbps_both'))}/{fmt(g.value('trace_d2h_gbps_both'))}"
                  f" GB/s), h2d alone {fmt(g.value('trace_h2d_alone_ms'), '.1f')} ms ("
                  f"{fmt(g.value('trace_h2d_gbps_alone'))} GB/s), d2h alone "
                  f"{fmt(g.value('trace_d2h_alone_ms'), '.1f')} ms ("
                  f"{fmt(g.value('trace_d2h_gbps_alone'))} GB/s), neither "
                  f"{fmt(g.value('trace_neither_ms'), '.1f')} ms")
        r = g.value("ratio_to_floor")
        verdict(f"K={k}: ratio_to_floor {fmt(r, '.4f')} <= {MAX_PREFETCH_RATIO_TO_FLOOR}",
                None if not r else r <= MAX_PREFETCH_RATIO_TO_FLOOR, "no floor measured")
        ours = g.value("step_ms")
        missing = why_missing(("BM_TorchPerLayerPipeline", pipeline))
        verdict(f"K={k}: {fmt(ours, '.1f')} ms < LibTorch per-layer pipeline "
                f"{fmt(pipeline_ms, '.1f')} ms",
                None if missing or ours is None or pipeline_ms is None else ours < pipeline_ms,
                missing or "no step time")
        e = g.value("extra_over_bound")
        verdict(f"K={k}: extra_over_bound {fmt(e, '.4f')} <= {MAX_EXTRA_OVER_BOUND}",
                None if not e else e <= MAX_EXTRA_OVER_BOUND, "no staging ring reported")

    bulk = find(groups, "BM_StrataBulk")
    print("\nbulk (no target in issue 4; PERF.md's bulk target is runtime_bench's offload+reload)")
    if bulk and bulk.usable():
        print(f"  strata: reload {fmt(bulk.value('reload_ms'), '.1f')} ms + step and offload "
              f"{fmt(bulk.value('step_and_offload_ms'), '.1f')} ms; host syncs per step "
              f"{fmt(bulk.value('host_syncs'), 'g')}; segment allocs after warm-up gpu/pinned "
              f"{fmt(bulk.worst('gpu_segment_allocs'), 'g')}/"
              f"{fmt(bulk.worst('pinned_segment_allocs'), 'g')}")
    else:
        print(f"  {why_missing(('BM_StrataBulk', bulk))}")

    fam = "BM_SimulatedLayerPrefetch"
    g = find(groups, fam)
    print(f"\nsimulated device, host memcpy, not PCIe ({fam}; no target)")
    if g and g.usable():
        print(f"  step {fmt(g.value('step_ms'), '.3f')} ms, staging ring "
              f"{fmt_bytes(g.value('peak_extra_gpu_bytes'))}, extra_over_bound "
              f"{fmt(g.value('extra_over_bound'), '.3f')}, host syncs per step "
              f"{fmt(g.value('host_syncs'), 'g')}")
    else:
        print(f"  {why_missing((fam, g))}")

    ok = verdicts.all_pass()
    print(f"\noptimizer targets: {'ALL PASS' if ok else 'SOME FAIL OR MISSING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} strata_optim_bench.json")
    sys.exit(main(sys.argv[1]))
