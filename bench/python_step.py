"""The Python optimizer step against the same step through the C++ API it wraps, on the GPU.

strata.optim.AdamW.step() reads every param group's hyperparameters (for LR schedulers), then
runs the runtime's finish_backward, Adam's step and end_step in C++; the C++ path makes those
three calls directly. Same runtime, same tensors, alternating, after warm-up: what the Python layer
adds to a step. Float32 parameters on the GPU, Adam states streamed by layer_prefetch.

    python3 bench/python_step.py [--layers 24] [--numel 16000000] [--steps 10] [--json F]
"""

import argparse
import json
import statistics
import time

import torch

import strata


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--numel", type=int, default=16_000_000, help="elements per layer")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", default="layer_prefetch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    params = [
        torch.nn.Parameter(torch.randn(args.numel, device="cuda")) for _ in range(args.layers)
    ]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = strata.optim.AdamW(params, lr=1e-4, policy=args.policy, layer_bytes=args.numel * 4)
    rt = opt.runtime._rt

    def python_step():
        opt.step()

    def cpp_step():
        rt.finish_backward()
        opt._adam.step(None, None)
        rt.end_step()

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):
        timed(python_step)
        timed(cpp_step)
    py, cpp = [], []
    for _ in range(args.steps):
        py.append(timed(python_step))
        cpp.append(timed(cpp_step))
    out = {
        "gpu": torch.cuda.get_device_name(0),
        "params": args.layers * args.numel,
        "policy": args.policy,
        "python_step_ms": sorted(py),
        "cpp_step_ms": sorted(cpp),
        "python_median_ms": statistics.median(py),
        "cpp_median_ms": statistics.median(cpp),
        "ratio_median": statistics.median(py) / statistics.median(cpp),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    opt.close()


if __name__ == "__main__":
    main()
