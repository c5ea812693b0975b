"""DeepSpeed's CPUAdam against torch's fused AdamW on the CPU, in alternating rounds.

This is the CPU-optimizer peer of strata's streamed step (bench/optim_compare.cpp, part "streamed"):
the same model as strata_optim_bench (32 layers of four float32 tensors of 12e6, 4e6, 16e6 and 16e6
elements, 1.536e9 parameters), AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8 and weight decay
0.01, gradients fixed. Each optimizer gets its own copy of the same values. After warm-up steps,
the two step in alternation (the order reversed every other round), each timed alone; at the end
their parameters must agree (both run the same float32 AdamW). Only the optimizer step is timed:
a CPU optimizer would also bring the gradients down and the parameters up each step, which is not
counted here.

DeepSpeed builds its cpu_adam op on first use (a C++ compiler and ninja); the build is reported,
not timed.

Example (the device machine has no registry: tools/gpu/run_deepspeed.sh installs the wheels
carried in .deps/wheels):
    python3 bench/deepspeed_cpu_adam.py --rounds 7 --json out.json
"""

import argparse
import json
import statistics
import sys
import time

import torch

SIZES = (12_000_000, 4_000_000, 16_000_000, 16_000_000)
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def make_model(layers, seed):
    """Parameters (uniform in [-1, 1)) with gradients (uniform in [-0.01, 0.01)) attached."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(layers):
        for n in SIZES:
            p = torch.empty(n).uniform_(-1, 1, generator=g).requires_grad_(True)
            p.grad = torch.empty(n).uniform_(-0.01, 0.01, generator=g)
            params.append(p)
    return params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - say why the peer is missing, whatever it was
        print(f"deepspeed not importable: {type(e).__name__}: {e}")
        return 2

    ds_params = make_model(args.layers, seed=1)
    torch_params = [p.detach().clone().requires_grad_(True) for p in ds_params]
    for p, q in zip(torch_params, ds_params):
        p.grad = q.grad.clone()
    t0 = time.perf_counter()
    ds = DeepSpeedCPUAdam(ds_params, adamw_mode=True, **HYPER)
    built_s = time.perf_counter() - t0
    fused = torch.optim.AdamW(torch_params, fused=True, **HYPER)
    approaches = {"deepspeed_cpu_adam": ds, "torch_adamw_fused_cpu": fused}

    for opt in approaches.values():
        for _ in range(args.warmup):
            opt.step()
    samples = {k: [] for k in approaches}
    names = list(approaches)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        line = []
        for name in order:
            t = time.perf_counter()
            approaches[name].step()
            ms = (time.perf_counter() - t) * 1e3
            samples[name].append(ms)
            line.append(f"{name} {ms:.1f} ms")
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(line), flush=True)

    worst = max(
        (p - q).abs().max().item() for p, q in zip(ds_params, torch_params) if p.numel() > 0
    )
    ratios = [
        a / b for a, b in zip(samples["deepspeed_cpu_adam"], samples["torch_adamw_fused_cpu"])
    ]
    out = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in ds_params),
        "op_build_s": built_s,
        "samples_ms": samples,
        "max_abs_param_difference": worst,
        "ratio_deepspeed_over_torch": ratios,
    }
    for name, ms in samples.items():
        print(f"{name}: median {statistics.median(ms):.1f} ms [{min(ms):.1f}, {max(ms):.1f}]")
    print(
        f"DeepSpeed / torch fused, round by round: {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}]; parameters differ by at most {worst:.3g}; "
        f"op built in {built_s:.1f} s; {out['threads']} threads"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    # Both are float32 AdamW over the same values: far apart means one of them is wrong.
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
