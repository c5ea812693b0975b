"""A small GPT in plain PyTorch trained with strata: strata.attach streams its blocks' parameters
and gradients layer by layer, strata.optim.AdamW steps them, a progress bar shows the loss, and the
runtime's memory summary closes the run.

    python3 examples/train_gpt.py                         # a few steps on the CPU (simulated GPU)
    python3 examples/train_gpt.py --device cuda --steps 200 --layers 12 --d_model 768 \
        --policy layer_prefetch --gpu_budget 2GiB
    python3 examples/train_gpt.py --compare               # also torch.optim.AdamW, same start
"""

import argparse
import math

import torch

import strata

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety, not a requirement
    tqdm = None


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Gpt(torch.nn.Module):
    """Embeddings, blocks and head as top-level children: strata.attach makes each a layer."""

    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab))

    def layers(self):
        return [self.embed, self.pos, *self.blocks, self.head]

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batches(args, device):
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        tokens = tokens.to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def run(args, use_strata):
    torch.manual_seed(args.seed)
    model = Gpt(args.vocab, args.d_model, args.heads, args.layers, args.seq).to(args.device)
    rt = None
    if use_strata:
        rt = strata.Runtime(
            policy=args.policy,
            gpu_budget=args.gpu_budget,
            roles=args.roles,
            device="cuda" if args.device == "cuda" else "simulated",
        )
        strata.attach(model, rt, layers=model.layers())
        opt = strata.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, runtime=rt)
    else:
        kw = {"fused": True} if args.device == "cuda" else {"foreach": False}
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, **kw)
    losses = []
    steps = batches(args, args.device)
    bar = tqdm(steps, total=args.steps, desc="strata" if use_strata else "torch") if tqdm else steps
    for inputs, targets in bar:
        opt.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        # Not loss.item(): that copy would wait behind strata's write-backs (strata.read_scalars).
        losses.extend(strata.read_scalars(loss))
        if tqdm:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        elif len(losses) % max(1, args.steps // 10) == 0:
            print(f"step {len(losses)}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    params = [p.detach().cpu().clone() for p in model.parameters()]
    if rt is not None:
        print(rt.memory_summary())
        s = rt.stats()
        print(
            f"moved {s['migrated_bytes_h2d'] / 1e6:.1f} MB to the GPU and "
            f"{s['migrated_bytes_d2h'] / 1e6:.1f} MB back"
        )
        opt.close()
        leaks = rt.close()
        print("leak report:", "empty" if not leaks else leaks)
    return losses, params


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--policy", default="layer_prefetch")
    p.add_argument("--roles", default="all")
    p.add_argument("--gpu_budget", default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true", help="also train with torch.optim.AdamW")
    args = p.parse_args()
    # With --compare, attention runs on torch's math backend: flash and memory-efficient attention
    # accumulate their backward with atomics, so even two torch runs would differ.
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH) if args.compare else nullcontext():
        losses, params = run(args, use_strata=True)
        print(f"strata: final loss {losses[-1]:.6f}")
        if args.compare:
            ref_losses, ref_params = run(args, use_strata=False)
    if args.compare:
        # Each tensor's difference relative to its norm: single elements near zero say little.
        # The largest is attention's key bias (in_proj_bias[d:2d]), whose gradient is zero but for
        # rounding: Adam scales that noise to about lr * g / eps, so two runs 1.7e-7 apart after
        # one step (the optimizers' last digits) are about 2e-3 apart there after two.
        worst = max(
            ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()
            for a, b in zip(params, ref_params)
        )
        print(
            f"torch:  final loss {ref_losses[-1]:.6f}; largest relative parameter difference "
            f"{worst:.3g}"
        )
        if not math.isfinite(worst):
            raise SystemExit("the runs diverged")


if __name__ == "__main__":
    main()
