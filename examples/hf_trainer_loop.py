"""A training loop shaped like Hugging Face Trainer's, with strata's optimizer dropped in.

What the Trainer does, and this loop does too: the parameters split into a decay group and a
no-decay group by name (biases and norm weights get no weight decay), a linear warmup then linear
decay of the learning rate, float16 autocast on a GPU, torch.amp.GradScaler (unscale_, then
clip_grad_norm_, then scaler.step; one step overflows and is skipped), and model.zero_grad()
after every step. The model is shaped
like a Hugging Face causal LM: blocks in model.model.layers, called with keyword arguments.

The one line that changes from the Trainer's own optimizer:

    opt = strata.optim.AdamW(groups, lr=lr, policy="layer_prefetch")   # was torch.optim.AdamW

    python examples/hf_trainer_loop.py --steps 20 --compare             # CPU (simulated device)
    python examples/hf_trainer_loop.py --device cuda --steps 50 --compare --overlap backward

--compare runs torch.optim.AdamW on the same loop and data (fused on a GPU) and checks that the
losses and parameters agree: bitwise on a GPU (strata's kernel computes torch's fused AdamW's
expression), within float32 rounding on the CPU (torch's CPU AdamW takes another order).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

import strata


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(d)
        self.up_proj = torch.nn.Linear(d, 4 * d)
        self.down_proj = torch.nn.Linear(4 * d, d)

    def forward(self, hidden_states, attention_mask=None):
        h = self.down_proj(F.gelu(self.up_proj(self.input_layernorm(hidden_states))))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        return hidden_states + h


class Decoder(torch.nn.Module):
    def __init__(self, vocab, d, n):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(hidden_states=h, attention_mask=attention_mask)
        return self.norm(h)


class CausalLm(torch.nn.Module):
    def __init__(self, vocab=256, d=64, n=6):
        super().__init__()
        self.model = Decoder(vocab, d, n)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.lm_head(self.model(input_ids=input_ids, attention_mask=attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def decay_groups(model, weight_decay):
    """The Trainer's split: no weight decay for biases and norm weights."""
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or name in norms else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def linear_warmup(opt, warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def batches(steps, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (8, 32), generator=g)
        mask = torch.ones(8, 32)
        mask[:2, -8:] = 0  # padding in two rows
        yield {
            "input_ids": ids.to(device),
            "labels": ids.roll(-1, 1).to(device),
            "attention_mask": mask.to(device),
        }


def train(args, use_strata):
    torch.manual_seed(args.seed)
    model = CausalLm(vocab=args.vocab, d=args.d_model, n=args.layers).to(args.device)
    groups = decay_groups(model, weight_decay=0.01)
    if use_strata:
        opt = strata.optim.AdamW(
            groups,
            lr=args.lr,
            policy=args.policy,
            overlap=args.overlap,
            prefetch_depth=args.prefetch_depth,
            device=None if args.device == "cuda" else "simulated",
        )
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, **torch_flags(args.device))
    sched = linear_warmup(opt, warmup=max(1, args.steps // 10), total=args.steps)
    cuda = args.device == "cuda"
    scaler = torch.amp.GradScaler(args.device)  # on the CPU too: its skipped step is checked
    losses = []
    model.zero_grad()
    for step, batch in enumerate(batches(args.steps, args.vocab, args.device, args.seed)):
        with torch.autocast(args.device, dtype=torch.float16, enabled=cuda):
            loss = model(**batch)["loss"]
        if step == args.overflow_at:
            loss = loss * float("inf")  # an overflow: GradScaler skips this step
        scaler.scale(loss).backward()
        if args.max_grad_norm > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        sched.step()
        model.zero_grad()
        # A copy: a float32 loss's .float() is the loss itself, which may share the storage of
        # the loss function's elementwise buffer and keep it alive.
        losses.append(loss.detach().float().clone())
    losses = [float(x) for x in losses]  # read once, after the loop
    params = [p.detach().cpu().clone() for p in model.parameters()]
    if use_strata:
        leaks = opt.close()
        if leaks:
            raise RuntimeError(f"strata leaked: {leaks}")
    return losses, params


def torch_flags(device):
    return {"fused": True} if device == "cuda" else {"foreach": False}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d_model", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--policy", default="layer_prefetch")
    ap.add_argument("--overlap", default="auto", choices=["auto", "none", "backward"])
    ap.add_argument("--prefetch_depth", type=int, default=1)
    ap.add_argument("--overflow_at", type=int, default=3, help="step whose loss overflows")
    ap.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true", help="also run torch.optim.AdamW; check")
    args = ap.parse_args(argv)

    losses, params = train(args, use_strata=True)
    print(
        f"strata ({args.policy}, overlap={args.overlap}): losses {losses[0]:.4f} .. {losses[-1]:.4f}"
    )
    if not args.compare:
        return 0
    want_losses, want_params = train(args, use_strata=False)
    flags = ", ".join(f"{k}={v}" for k, v in torch_flags(args.device).items())
    print(f"torch.optim.AdamW ({flags}): losses {want_losses[0]:.4f} .. {want_losses[-1]:.4f}")
    worst = max(
        ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()
        for a, b in zip(params, want_params)
    )
    finite = [(a, b) for a, b in zip(losses, want_losses) if math.isfinite(b)]
    worst_loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in finite)
    bitwise = all(torch.equal(a, b) for a, b in zip(params, want_params))
    print(
        f"parameters: worst relative difference {worst:.3g} (bitwise equal: {bitwise}); "
        f"losses: {worst_loss:.3g}"
    )
    ok = bitwise if args.device == "cuda" else worst <= 1e-5 and worst_loss <= 1e-5
    print("match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
