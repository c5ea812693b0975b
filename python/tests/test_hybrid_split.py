"""The hybrid's measured split from Python (See Note [Measured split] in policies/split_search.h),
on the simulated device: a model of eight blocks in a ModuleList, in bfloat16 or in float32 under
bfloat16 autocast (a float32 layer takes a master on the host and gives it up when it leaves: See
Note [Float32 masters follow the split] in optim/adam_placement.cpp), trained with
strata.optim.AdamW(policy="hybrid"), moves layers between the host and the GPU over its first steps,
logs what it chose on the "strata" logger, reports it in opt.placement, and trains bitwise as
layer_prefetch does, with the step after backward and in backward; its state dict is
layer_prefetch's; a forced fraction keeps its split."""

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


def run(policy, steps, dtype=torch.bfloat16, **kw):
    model = Blocks().to(dtype)
    opt = strata.optim.AdamW(model.parameters(), lr=1e-2, policy=policy, model=model, **kw)
    host_sets, losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=g).to(dtype)
        y = torch.randn(8, 4, generator=g).to(dtype)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        host_sets.append(tuple(opt.placement["host_layers"]))
    placement = opt.placement
    params = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    assert opt.close() == []
    return losses, params, host_sets, placement, state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_the_measured_split_moves_layers_logs_its_choice_and_trains_bitwise(overlap, dtype, caplog):
    steps = 40  # 9 layers, one at a time: every split it walks to is measured and the search done
    want_losses, want_params, _, _, want_state = run(
        "layer_prefetch", steps, dtype, overlap=overlap
    )
    with caplog.at_level(logging.INFO, logger="strata"):
        losses, params, host_sets, placement, state = run("hybrid", steps, dtype, overlap=overlap)
    assert losses == want_losses
    for p, q in zip(params, want_params):
        assert torch.equal(p, q)
    assert len(set(host_sets)) > 1, "the search moved no layer"
    assert "measured steps refine it" in caplog.text
    assert "hybrid: measured steps chose" in caplog.text
    assert placement["line"].startswith("hybrid: measured steps chose")
    # After the search the split stays.
    assert host_sets[-1] == host_sets[-5]
    # The state dict does not depend on where each layer stepped: a float32 parameter's master,
    # which exists only on the host, is its value, and is left out.
    assert state["state"].keys() == want_state["state"].keys()
    for key, entry in state["state"].items():
        assert entry.keys() == want_state["state"][key].keys()
        for name, value in entry.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(want_state["state"][key][name])
            )


def test_a_forced_fraction_keeps_its_split():
    _, _, host_sets, placement, _ = run("hybrid", 12, hybrid_fraction=0.5)
    assert len(set(host_sets)) == 1 and host_sets[0]
    assert "forced" in placement["line"] and "measured" not in placement["line"]


def test_the_search_compares_steps_taken_one_way_and_timing_starts_after_it(caplog):
    # See Note [Measured split] in policies/split_search.h and Note [When to step in backward] in
    # strata/_when.py. Iterations after backward are timed faster here, which would send the steps
    # there after the first few; while the search runs, the steps stay in backward (only a redone
    # step would move them), so its splits are compared by steps taken one way. Once it has chosen,
    # the iterations are timed afresh with its split, and the steps go after backward.
    from models import FakeClock

    model = Blocks().to(torch.bfloat16)
    opt = strata.optim.AdamW(
        model.parameters(), lr=1e-2, policy="hybrid", model=model, overlap="backward"
    )
    opt._overlap._choice.clock = FakeClock({"backward": 100.0, "after": 60.0})
    searching, outcomes = [], []
    with caplog.at_level(logging.INFO, logger="strata"):
        step = 0
        # Until 20 steps after the search ended (it walks at most every split a layer at a time).
        while step < 200 and (all(searching) or len(searching) - searching.index(False) < 20):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
            y = torch.randn(8, 4, generator=g).to(torch.bfloat16)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
            outcomes.append(opt.last_step_outcome)
            searching.append(opt.runtime._rt.wants_step_times())
            step += 1
    assert False in searching, "the search did not end"
    ended = searching.index(False)  # the step the search ended at
    assert outcomes[: ended + 1] == ["speculation"] * (ended + 1), outcomes
    assert "over steps taken in backward" in opt.placement["line"], opt.placement["line"]
    after = outcomes[ended + 1 :]
    # Timed afresh: iterations in backward first (the one the search ended at among them), then
    # after it, and then after it for a while.
    assert after[:2] == ["speculation"] * 2 and after[-8:] == ["sequential"] * 8, outcomes
    assert "after backward 60.0 ms" in caplog.text
    assert opt.close() == []
