"""Convergence on real text with compressed moments (See Note [Compressed moments] in
optim/state_codec.h): a byte-level transformer trained for 300 steps on the Python standard
library's own sources (on every machine; nothing is downloaded) with strata.optim.AdamW under
layer_prefetch, its moments stored as float32, bfloat16 and int8. The held-out loss of each
compressed run ends within 2% of the float32 run's. Its GPU counterpart is strata-train --text_dir
(tools/gpu/run_compressed.sh OUT convergence)."""

import math
import os

import strata
import torch

from models import example

STEPS = 300
SEQ = 64
BATCH = 16


def corpus(max_bytes=4 << 20) -> torch.Tensor:
    """The bytes of the standard library's top-level *.py files, in name order."""
    root = os.path.dirname(os.__file__)
    data = bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and len(data) < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
    return torch.tensor(list(data[:max_bytes]), dtype=torch.long)


def gpt_example():
    """examples/train_gpt.py, whose Gpt is the model trained here."""
    return example("train_gpt")


def batches(data, step, count=BATCH):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, data.numel() - SEQ - 1, (count,), generator=g)
    x = torch.stack([data[s : s + SEQ] for s in starts])
    y = torch.stack([data[s + 1 : s + SEQ + 1] for s in starts])
    return x, y


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def train(state_dtype, train_data, held_out):
    torch.manual_seed(0)
    model = gpt_example().Gpt(vocab=256, d=64, heads=4, layers=2, seq=SEQ)
    opt = strata.optim.AdamW(
        model.parameters(),
        lr=3e-3,
        weight_decay=0.1,
        policy="layer_prefetch",
        model=model,
        state_dtype=state_dtype,
    )
    for step in range(STEPS):
        x, y = batches(train_data, step)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        held = [loss_of(model, *batches(held_out, 10_000 + k, 64)).item() for k in range(4)]
    assert opt.close() == []
    return sum(held) / len(held)


def test_compressed_moments_converge_like_float32_on_real_text(capsys):
    torch.set_num_threads(2)
    data = corpus()
    split = data.numel() * 9 // 10
    train_data, held_out = data[:split], data[split:]
    losses = {t: train(t, train_data, held_out) for t in ("float32", "bfloat16", "int8")}
    with capsys.disabled():
        print(
            f"\nheld-out loss after {STEPS} steps on {data.numel() / 2**20:.1f} MiB of the standard "
            "library: " + ", ".join(f"{t} {v:.4f}" for t, v in losses.items())
        )
    # It learned: far below a uniform guess over the bytes.
    assert losses["float32"] < 0.6 * math.log(256)
    for t in ("bfloat16", "int8"):
        assert abs(losses[t] - losses["float32"]) <= 0.02 * losses["float32"], losses
