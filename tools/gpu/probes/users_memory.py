"""Where the GPU memory of bench/users_script.py's strata run goes, phase by phase (issue 37):
torch's allocated and reserved bytes, strata's pool, the driver's view, and whether each
parameter's .grad is the gradient strata binds, after construction, forward, backward, clipping,
the step and zero_grad, for two steps.

    python3 tools/gpu/probes/users_memory.py [--approach strata|torchao|resident] [--batch 8]
"""

import argparse
import sys

import torch

sys.path.insert(0, "bench")
import users_script  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--approach", default="strata")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=28)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    gib = 2**30

    def show(what, opt=None):
        free, total = torch.cuda.mem_get_info()
        line = (
            f"{args.approach:>8} {what:<22} torch alloc {torch.cuda.memory_allocated() / gib:6.2f} "
            f"(peak {torch.cuda.max_memory_allocated() / gib:6.2f}) reserved "
            f"{torch.cuda.memory_reserved() / gib:6.2f} (peak {torch.cuda.max_memory_reserved() / gib:6.2f})"
            f" driver used {(total - free) / gib:6.2f}"
        )
        if opt is not None and hasattr(opt, "runtime"):
            s = opt.runtime.memory_stats()
            line += f" strata gpu reserved {s.get('gpu.reserved_bytes.current', 0) / gib:5.2f}"
            rt = opt.runtime
            bound = sum(
                1 for p in model.parameters() if p.grad is not None and p.grad is rt._grad_obj.get(id(p))
            )
            other = sum(
                1
                for p in model.parameters()
                if p.grad is not None and p.grad is not rt._grad_obj.get(id(p))
            )
            line += f" grads bound {bound} other {other}"
        print(line, flush=True)

    model = users_script.build_model(args, torch)
    show("model")
    if args.approach == "strata":
        import strata

        opt = strata.optim.AdamW(model.parameters(), lr=1e-4)
    elif args.approach == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    show("optimizer made", opt)
    x = torch.randn(args.batch, args.seq, args.d_model, device="cuda")
    y = torch.randn_like(x)
    for step in range(2):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        show(f"step {step} forward", opt)
        loss.backward()
        show(f"step {step} backward", opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        show(f"step {step} clipped", opt)
        opt.step()
        torch.cuda.synchronize()
        show(f"step {step} stepped", opt)
        opt.zero_grad(set_to_none=True)
        show(f"step {step} zero_grad", opt)


if __name__ == "__main__":
    main()
