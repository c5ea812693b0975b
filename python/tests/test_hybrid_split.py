"""The hybrid's measured split from Python (See Note [Measured split] in policies/split_search.h),
on the simulated device: a bfloat16 model of eight blocks in a ModuleList, trained with
strata.optim.AdamW(policy="hybrid"), moves layers between the host and the GPU over its first steps,
logs what it chose on the "strata" logger, reports it in opt.placement, and trains bitwise as
layer_prefetch does, with the step after backward and in backward; a forced fraction keeps its
split."""

import logging

import pytest
import torch

import strata


class Blocks(torch.nn.Module):
    def __init__(self, blocks=8, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def run(policy, steps, **kw):
    model = Blocks().to(torch.bfloat16)
    opt = strata.optim.AdamW(model.parameters(), lr=1e-2, policy=policy, model=model, **kw)
    host_sets, losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 4, generator=g).to(torch.bfloat16)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        host_sets.append(tuple(opt.placement["host_layers"]))
    placement = opt.placement
    params = [p.detach().clone() for p in model.parameters()]
    assert opt.close() == []
    return losses, params, host_sets, placement


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_the_measured_split_moves_layers_logs_its_choice_and_trains_bitwise(overlap, caplog):
    steps = 40  # 9 layers, one at a time: every split it walks to is measured and the search done
    want_losses, want_params, _, _ = run("layer_prefetch", steps, overlap=overlap)
    with caplog.at_level(logging.INFO, logger="strata"):
        losses, params, host_sets, placement = run("hybrid", steps, overlap=overlap)
    assert losses == want_losses
    for p, q in zip(params, want_params):
        assert torch.equal(p, q)
    assert len(set(host_sets)) > 1, "the search moved no layer"
    assert "measured steps refine it" in caplog.text
    assert "hybrid: measured steps chose" in caplog.text
    assert placement["line"].startswith("hybrid: measured steps chose")
    # After the search the split stays.
    assert host_sets[-1] == host_sets[-5]


def test_a_forced_fraction_keeps_its_split():
    _, _, host_sets, placement = run("hybrid", 12, hybrid_fraction=0.5)
    assert len(set(host_sets)) == 1 and host_sets[0]
    assert "forced" in placement["line"] and "measured" not in placement["line"]
