"""Users' own training loops, each against torch.optim.AdamW on the same loop and data (CPU,
simulated device, every policy, hybrid with half the parameters stepped on the host): gradients the loop drops or replaces (model.zero_grad(),
p.grad = ...), frozen LoRA base weights, an unused head, mixture-of-experts routing, torch.optim's
keywords, GradScaler, the loop's own clipping and gradient accumulation under overlap, a
torch.compile'd model, and a Hugging Face-shaped model attached with the layers found in its
module tree."""

import copy
import logging

import pytest
import strata
import torch
import torch.nn.functional as F
from models import POLICIES, FakeClock, Mlp, assert_bitwise, assert_close, batch, example, params_of
from users import CausalLm, LoraMlp, Moe, TwoHeads, lm_batch

HYPER = dict(lr=1e-2, weight_decay=0.1)
# And hybrid with half the parameters stepped on the host (See Note [Host-stepped layers]).
LOOP_POLICIES = POLICIES + ["hybrid"]


def policy_kw(policy):
    return {"hybrid_fraction": 0.5} if policy == "hybrid" else {}


def torch_opt(model):
    return torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)


def strata_opt(policy, **kw):
    def make(model):
        return strata.optim.AdamW(
            model.parameters(), policy=policy, **HYPER, **policy_kw(policy), **kw
        )

    return make


def mse_step(model, step):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


# `n` steps of the plain loop; where each step ran (strata.optim's last_step_outcome).
def step_outcomes(model, opt, n):
    outcomes = []
    for step in range(n):
        opt.zero_grad()
        mse_step(model, step)
        opt.step()
        outcomes.append(opt.last_step_outcome)
    return outcomes


def hf_loop(model, opt, steps):
    """Hugging Face Trainer's order: model.zero_grad() (set_to_none) after every step."""
    losses = []
    model.zero_grad()
    for step in range(steps):
        losses.append(mse_step(model, step))
        opt.step()
        model.zero_grad()
    return losses


def replace_loop(model, opt, steps):
    """A loop that hands the optimizer new gradient tensors (as DDP's bucket views do)."""
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(mse_step(model, step))
        for p in model.parameters():
            p.grad = p.grad * 1.0
        opt.step()
    return losses


def run(make_model, make_opt, loop, steps=8):
    model = make_model()
    opt = make_opt(model)
    losses = loop(model, opt, steps)
    state = opt.state_dict()
    params = params_of(model)
    if hasattr(opt, "close"):
        assert opt.close() == []
    return losses, params, state


def steps_of(state):
    return {k: float(v["step"]) for k, v in state["state"].items()}


@pytest.mark.parametrize("loop", [hf_loop, replace_loop], ids=["model_zero_grad", "p_grad_set"])
def test_gradients_the_loop_drops_or_replaces_are_the_ones_stepped(loop):
    want_losses, want_params, _ = run(Mlp, torch_opt, loop)
    first = None
    for policy in POLICIES:
        losses, params, _ = run(Mlp, strata_opt(policy), loop)
        assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
        assert_close(params, want_params, rel=1e-5)
        if first is None:
            first = (losses, params)
        else:
            assert losses == first[0]
            assert_bitwise(params, first[1])


def plain_loop(model, opt, steps):
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(mse_step(model, step))
        opt.step()
    return losses


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_frozen_lora_base_is_never_touched_and_has_no_state(policy):
    before = params_of(LoraMlp())
    want_losses, want_params, want_state = run(LoraMlp, torch_opt, hf_loop)
    losses, params, state = run(LoraMlp, strata_opt(policy), hf_loop)
    frozen = [not p.requires_grad for p in LoraMlp().parameters()]
    for b, p, f in zip(before, params, frozen):
        if f:
            assert torch.equal(b, p)
    assert_close(params, want_params, rel=1e-5)
    assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
    assert sorted(state["state"]) == sorted(want_state["state"])
    assert steps_of(state) == steps_of(want_state)


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_an_unused_head_is_skipped_as_torch_skips_it(policy):
    before = params_of(TwoHeads())
    _, want_params, want_state = run(TwoHeads, torch_opt, plain_loop)
    _, params, state = run(TwoHeads, strata_opt(policy), plain_loop)
    assert_close(params, want_params, rel=1e-5)
    # aux_head (the last two parameters) was never stepped nor decayed.
    assert torch.equal(params[-1], before[-1]) and torch.equal(params[-2], before[-2])
    # strata lists every trainable parameter from the start (at step 0); torch those stepped.
    got = steps_of(state)
    assert {k: v for k, v in got.items() if v > 0} == steps_of(want_state)
    assert got[4] == 0.0 and got[5] == 0.0


def moe_loop(model, opt, steps):
    losses = []
    for step in range(steps):
        model.route = step
        opt.zero_grad()
        losses.append(mse_step(model, step))
        opt.step()
    return losses


@pytest.mark.parametrize("policy", LOOP_POLICIES)
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_experts_not_routed_keep_their_own_step_counts(policy, overlap):
    want_losses, want_params, want_state = run(Moe, torch_opt, moe_loop, steps=7)
    make = strata_opt(policy, overlap=overlap, layer_bytes="4KiB")
    losses, params, state = run(Moe, make, moe_loop, steps=7)
    assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
    assert_close(params, want_params, rel=1e-5)
    assert steps_of(state) == steps_of(want_state)  # 4, 4, 3, 3 ... as each expert was routed
    # The per-parameter counts survive a round trip, into strata and into torch.
    model = Moe()
    opt = strata.optim.AdamW(model.parameters(), policy=policy, **HYPER, **policy_kw(policy))
    opt.load_state_dict(want_state)
    assert steps_of(opt.state_dict()) == steps_of(want_state)
    opt.close()


def test_torch_keywords_foreach_and_fused_accepted_capturable_refused():
    model = Mlp()
    for kw in (dict(fused=True), dict(foreach=True), dict(fused=False, foreach=False)):
        opt = strata.optim.AdamW(model.parameters(), **kw)
        opt.close()
    for kw in (dict(capturable=True), dict(differentiable=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            strata.optim.AdamW(model.parameters(), **kw)
    opt = strata.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    _, want_params, _ = run(Mlp, torch_opt, plain_loop, steps=4)
    _, params, _ = run(Mlp, strata_opt("layer_prefetch", fused=True), plain_loop, steps=4)
    assert_close(params, want_params, rel=1e-5)
    opt.close()


def test_a_frozen_parameter_given_a_gradient_later_raises_and_changes_nothing():
    model = LoraMlp()
    opt = strata.optim.AdamW(model.parameters(), policy="layer_prefetch", **HYPER)
    plain_loop(model, opt, 2)
    before = params_of(model)
    state = opt.state_dict()
    model.inp.base.weight.requires_grad_(True)
    opt.zero_grad()
    mse_step(model, 5)
    with pytest.raises(RuntimeError, match=r"group0\.param0.*frozen"):
        opt.step()
    assert_bitwise(params_of(model), before)
    assert steps_of(opt.state_dict()) == steps_of(state)
    model.inp.base.weight.grad = None
    model.inp.base.weight.requires_grad_(False)
    opt.step()  # the loop goes on once it is fixed
    opt.close()


def test_a_cpu_model_on_a_machine_with_a_gpu_raises_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("STRATA_DEVICE", raising=False)
    with pytest.raises(ValueError, match=r"model\.cuda\(\).*device='simulated'"):
        strata.optim.AdamW(Mlp().parameters())
    strata.optim.AdamW(Mlp().parameters(), device="simulated").close()


def scaler_loop(inf_at=3, clip=False, accumulate=False):
    def loop(model, opt, steps):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step)
            micro = [(x[:4], y[:4]), (x[4:], y[4:])] if accumulate else [(x, y)]
            for i, (xs, ys) in enumerate(micro):
                loss = F.mse_loss(model(xs), ys) / len(micro)
                if step == inf_at:
                    loss = loss * float("inf")  # an overflow: GradScaler skips this step
                last = i == len(micro) - 1
                if last or not hasattr(opt, "accumulate"):
                    scaler.scale(loss).backward()
                else:
                    with opt.accumulate():
                        scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return losses

    return loop


@pytest.mark.parametrize("policy", LOOP_POLICIES)
@pytest.mark.parametrize(
    "clip,accumulate", [(False, False), (True, False), (False, True)], ids=["", "clip", "accum"]
)
def test_grad_scaler_with_a_skipped_step_under_overlap_and_without(policy, clip, accumulate):
    loop = scaler_loop(clip=clip, accumulate=accumulate)
    _, want_params, want_state = run(Mlp, torch_opt, loop, steps=7)
    results = []
    for overlap in ("none", "backward"):
        make = strata_opt(policy, overlap=overlap, layer_bytes="1KiB")
        losses, params, state = run(Mlp, make, loop, steps=7)
        assert_close(params, want_params, rel=1e-5)
        assert steps_of(state) == steps_of(want_state)  # the skipped step did not count
        results.append((losses, params))
    assert results[0][0] == results[1][0]
    assert_bitwise(results[0][1], results[1][1])


def test_a_skipped_step_changes_nothing():
    model = Mlp()
    opt = strata.optim.AdamW(model.parameters(), policy="layer_prefetch", **HYPER)
    plain_loop(model, opt, 2)
    before, state = params_of(model), opt.state_dict()
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(batch(9)[0]), batch(9)[1]) * float("inf")).backward()
    scaler.step(opt)
    assert_bitwise(params_of(model), before)
    after = opt.state_dict()
    assert steps_of(after) == steps_of(state)
    for k in state["state"]:
        assert torch.equal(after["state"][k]["exp_avg"], state["state"][k]["exp_avg"])
    opt.close()


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_the_loops_own_clipping_under_overlap_is_seen_and_the_step_redone(policy):
    outcomes = []

    def loop(model, opt, steps):
        losses = []
        for step in range(steps):
            opt.zero_grad()
            losses.append(mse_step(model, step))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            outcomes.append(getattr(opt, "last_step_outcome", None))
        return losses

    _, want_params, _ = run(Mlp, torch_opt, loop, steps=6)
    seq = run(Mlp, strata_opt(policy, layer_bytes="1KiB"), loop, steps=6)
    model = Mlp()
    opt = strata_opt(policy, overlap="backward", layer_bytes="1KiB")(model)
    outcomes.clear()
    losses = loop(model, opt, 6)
    # Every step's gradients were clipped after backward: a step taken in backward is redone
    # (layer_prefetch steps layers in backward; keep_on_gpu without undo_on_gpu and bulk leave them
    # for step(); See Note [Resting layers] in optim/adam_overlap.cpp), and the steps after a redo
    # run after backward (See Note [When to step in backward] in strata/_when.py): redone, then 1
    # after backward, redone, 2 after.
    if policy == "layer_prefetch":
        assert outcomes == ["redone", "sequential", "redone", "sequential", "sequential", "redone"]
    assert_close(params_of(model), want_params, rel=1e-5)
    assert losses == seq[0]
    assert_bitwise(params_of(model), seq[1])
    assert opt.close() == []


def test_with_max_grad_norm_the_step_stays_after_backward_while_clipping_fires():
    # The gradients are large for four steps (clipping fires) and then small (it does not). One try
    # in backward is redone; then the steps run after backward while the last step's clipping fired,
    # and in backward again once it did not (See Note [When to step in backward] in
    # strata/_when.py).
    def loop(model, opt, steps, clip_in_loop):
        outcomes = []
        for step in range(steps):
            x, y = batch(step)
            loss = F.mse_loss(model(x), y) * (100.0 if step < 4 else 1e-4)
            loss.backward()
            if clip_in_loop:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            outcomes.append(getattr(opt, "last_step_outcome", None))
        return outcomes

    torch_model = Mlp()
    loop(torch_model, torch_opt(torch_model), 8, True)
    model = Mlp()
    opt = strata_opt("layer_prefetch", overlap="backward", max_grad_norm=1.0, layer_bytes="1KiB")(
        model
    )
    outcomes = loop(model, opt, 8, False)
    assert outcomes == ["redone"] + ["sequential"] * 4 + ["speculation"] * 3, outcomes
    assert_close(params_of(model), params_of(torch_model), rel=1e-5)
    assert opt.close() == []


class LateEvents:
    """Events a record late, as a GPU one step behind the host shows them: one is done once another
    has been recorded after it."""

    def __init__(self) -> None:
        self.records = 0

    def make(self):
        events = self

        class Event:
            def record(self) -> None:
                self.at = events.records
                events.records += 1

            def query(self) -> bool:
                return events.records > self.at + 1

        return Event()


def test_a_host_ahead_of_the_gpu_still_learns_that_clipping_stopped():
    # ClipRecord (See Note [When to step in backward] in strata/_when.py) answers from the newest
    # coefficient that reached the host, not only from the step just queued.
    from strata._readback import ClipRecord

    events = LateEvents()
    clips = ClipRecord(make_event=events.make)
    assert clips.fired() is None
    clips.note(torch.tensor(0.5))  # step 0: clipping fired
    assert clips.fired() is None, "not on the host yet"
    clips.note(torch.tensor(1.0))  # step 1: it did not
    assert clips.fired() is True, "step 0's answer, one step late"
    clips.note(torch.tensor(1.0))
    assert clips.fired() is False
    # Steps in backward ask nothing: the copies done are read as the next is noted, so few stay.
    made = []
    steady = ClipRecord(make_event=lambda: made.append(events.make()) or made[-1])
    for _ in range(100):
        steady.note(torch.tensor(1.0))
    assert steady.pending() <= 2 and len(made) <= 3, (steady.pending(), len(made))
    assert ClipRecord().fired() is None
    on_host = ClipRecord()
    on_host.note(torch.tensor(0.25))
    assert on_host.fired() is True, "a coefficient on the host is known at once"

    # The loop of the test above, with the coefficients reaching the host a step late: the steps
    # return to backward a step later, and do return.
    def loop(model, opt, steps):
        outcomes = []
        for step in range(steps):
            x, y = batch(step)
            loss = F.mse_loss(model(x), y) * (100.0 if step < 4 else 1e-4)
            loss.backward()
            opt.step()
            opt.zero_grad()
            outcomes.append(opt.last_step_outcome)
        return outcomes

    model = Mlp()
    opt = strata_opt("layer_prefetch", overlap="backward", max_grad_norm=1.0, layer_bytes="1KiB")(
        model
    )
    opt._overlap._choice.clips = ClipRecord(make_event=LateEvents().make)
    outcomes = loop(model, opt, 10)
    assert outcomes == ["redone"] + ["sequential"] * 5 + ["speculation"] * 4, outcomes
    assert opt.close() == []


@pytest.mark.parametrize("lag", [0, 2], ids=["read-at-once", "read-two-late"])
@pytest.mark.parametrize("faster", ["backward", "after"])
def test_steps_run_where_iterations_were_measured_faster(faster, lag):
    # Four steps in backward (the first ends no timed iteration), three after it to time them,
    # then in backward again if that was faster, else after backward for the next 16 (See Note
    # [When to step in backward] in strata/_when.py). Where the times come back two steps late,
    # two more steps in backward come first, and the two after the three taken after backward
    # wait in backward for their times rather than three more after it. Either way the parameters
    # are the sequential step's, bit for bit.
    seq = run(Mlp, strata_opt("layer_prefetch", layer_bytes="1KiB"), plain_loop, steps=10 + 2 * lag)
    model = Mlp()
    opt = strata_opt("layer_prefetch", overlap="backward", layer_bytes="1KiB")(model)
    opt._overlap._choice.clock = FakeClock(
        {"backward": 50.0, "after": 60.0}
        if faster == "backward"
        else {"backward": 100.0, "after": 60.0},
        lag=lag,
    )
    outcomes = step_outcomes(model, opt, 10 + 2 * lag)
    then = "speculation" if faster == "backward" else "sequential"
    waited = ["speculation"] * lag
    expected = ["speculation"] * (4 + lag) + ["sequential"] * 3 + waited + [then] * 3
    assert outcomes == expected, outcomes
    assert_bitwise(params_of(model), seq[1])
    assert opt.close() == []


@pytest.mark.parametrize(
    "ms,kept,share",
    [
        ({"backward": 100.0, "share": 50.0, "after": 60.0}, "share", 0.5),
        ({"backward": 100.0, "share": 70.0, "after": 60.0}, "after", 0.5),
        ({"backward": 65.0, "share": 70.0, "after": 60.0}, "after", 1.0),
        ({"backward": 55.0, "share": 45.0, "after": 60.0}, "share", 0.5),
        ({"backward": 50.0, "share": 55.0, "after": 60.0}, "backward", 1.0),
    ],
    ids=["share-over-after", "after", "after-then-whole", "share-over-whole", "whole"],
)
def test_a_share_of_the_step_in_backward_is_timed_beside_the_whole_and_after(
    ms, kept, share, caplog
):
    # See Note [When to step in backward] in strata/_when.py. After backward an iteration takes 60
    # ms (its backward 30, its step 40); the undo (the float32 parameters, 4 bytes beside the
    # moments' 8) is in pinned memory, so the share is 30 / (1.5 x 40) = 0.5 of the states. Timed
    # beside the whole in backward and the step after it, the fastest of the three stays; where the
    # steps after backward win, the back-off's tries step the faster of the other two. Either way
    # the parameters are the sequential step's, bit for bit.
    seq = run(Mlp, strata_opt("layer_prefetch", layer_bytes="1KiB"), plain_loop, steps=13)
    model = Mlp()
    opt = strata_opt("layer_prefetch", overlap="backward", layer_bytes="1KiB")(model)
    opt._overlap._choice.clock = FakeClock(ms, parts=(30.0, 40.0))
    with caplog.at_level(logging.INFO, logger="strata"):
        outcomes = step_outcomes(model, opt, 13)
    then = ["sequential" if kept == "after" else "speculation"] * 3
    assert outcomes == ["speculation"] * 4 + ["sequential"] * 3 + ["speculation"] * 3 + then
    assert opt.backward_share == share
    told = [r.getMessage() for r in caplog.records if "wholly in backward" in r.getMessage()]
    assert len(told) == 1 and "the first 50% of the states" in told[0], caplog.text
    if kept == "share":
        # The last step: the layers backward reaches first, half the states to the nearest layer,
        # in backward; the others after it.
        stepped = opt._adam.overlapped_layers()
        state: dict = {}
        for t in opt.runtime._rt.tensors():
            if t["role"] == "optimizer_state":
                state[t["layer"]] = state.get(t["layer"], 0) + t["bytes"]
        order = sorted(state, reverse=True)
        assert 0 < len(stepped) < len(order) and stepped == order[: len(stepped)], (stepped, order)
        half, taken = sum(state.values()) / 2, sum(state[layer] for layer in stepped)
        assert taken - state[stepped[-1]] / 2 <= half < taken + state[order[len(stepped)]] / 2
    elif kept == "after":
        assert "(the first 50% of the states) measured 70.0 ms" in caplog.text
    else:
        assert "every layer steps in backward again" in caplog.text
        assert len(opt._adam.overlapped_layers()) == len(set(opt.runtime._layer_of.values()))
    assert_bitwise(params_of(model), seq[1])
    assert opt.close() == []


# See Note [The undo on the GPU when there is room] in strata/budget.py. The simulated device has no
# driver to ask, so the memory after the first step comes from a stand-in for device_memory.
@pytest.mark.parametrize("memory", ["room", "no_room", "raises_torchs_peak"])
def test_the_undo_goes_on_the_gpu_when_the_first_step_shows_room(memory, monkeypatch, caplog):
    from strata import budget as strata_budget

    margin = 1 << 30  # a twentieth of 20 GiB, and the 1 GiB floor
    # 64 MiB beyond torch's headroom, or 64 bytes; torch's tensors at step() (2 MiB) plus the undo
    # (the parameters, under 1 MiB) under the first step's peak of 4 MiB, or over one of 2 MiB.
    free = margin + (64 if memory == "no_room" else 64 << 20)
    peak = (2 if memory == "raises_torchs_peak" else 4) << 20
    mem = strata_budget.DeviceMemory(
        free=free,
        total=20 << 30,
        torch_reserved=8 << 20,
        torch_peak=8 << 20,
        torch_allocated=2 << 20,
        torch_peak_allocated=peak,
    )
    monkeypatch.setattr(strata_budget, "device_memory", lambda rt: mem)
    seq = run(Mlp, strata_opt("layer_prefetch", layer_bytes="1KiB"), plain_loop, steps=5)
    model = Mlp()
    with caplog.at_level(logging.INFO, logger="strata"):
        opt = strata_opt("layer_prefetch", overlap="backward", layer_bytes="1KiB")(model)
        assert opt.runtime.stats()["undo_on_gpu_from"] == "undecided"
        copied, outcomes = [], []
        for step in range(5):
            opt.zero_grad()
            mse_step(model, step)
            opt.step()
            outcomes.append(opt.last_step_outcome)
            copied.append(opt.runtime.stats()["undo_copied_bytes"])
    room = memory == "room"
    stats = opt.runtime.stats()
    assert (stats["undo_on_gpu"], stats["undo_on_gpu_from"]) == (room, "auto")
    # The first step after backward; then in backward, the undo of the parameters on the GPU, or
    # copied off it (each step the same bytes: every parameter, resting on the GPU).
    assert outcomes == ["sequential"] + ["speculation"] * 4, outcomes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    want = [0] * 5 if room else [params * k for k in range(5)]
    assert copied == want, (copied, want)
    assert strata_budget.undo_need(opt.runtime, set()) == params
    line = [r.getMessage() for r in caplog.records if "undo_on_gpu auto" in r.getMessage()]
    assert len(line) == 1, caplog.text
    assert ("kept on the GPU" if room else "kept in pinned host memory") in line[0]
    assert ("which the undo would pass" in line[0]) == (memory == "raises_torchs_peak"), line[0]
    assert_bitwise(params_of(model), seq[1])
    assert opt.close() == []


def test_where_the_undo_goes_under_an_automatic_budget_a_given_runtime_and_hybrid(
    monkeypatch, caplog
):
    # See Note [The undo on the GPU when there is room] in strata/budget.py, with device_memory
    # stood in for as above.
    from strata import budget as strata_budget

    mem = strata_budget.DeviceMemory(
        free=(1 << 30) + (64 << 20),
        total=20 << 30,
        torch_reserved=8 << 20,
        torch_peak=8 << 20,
        torch_allocated=8 << 20,
        torch_peak_allocated=8 << 20,
    )
    monkeypatch.setattr(strata_budget, "device_memory", lambda rt: mem)

    # gpu_budget="auto": the budget is set after the first step, and it bounds the undo.
    model = Mlp()
    with caplog.at_level(logging.INFO, logger="strata"):
        opt = strata_opt(
            "layer_prefetch", overlap="backward", layer_bytes="1KiB", gpu_budget="auto"
        )(model)
        assert step_outcomes(model, opt, 3) == ["sequential", "speculation", "speculation"]
    stats = opt.runtime.stats()
    assert stats["gpu_budget_from"] == "auto" and stats["gpu_budget_bytes"] is not None
    assert (stats["undo_on_gpu"], stats["undo_on_gpu_from"]) == (True, "auto")
    assert "the GPU budget bounds it" in caplog.text
    assert opt.close() == []

    # A runtime given: its setting stands, and the first step is taken in backward.
    model = Mlp()
    rt = strata.Runtime(policy="layer_prefetch", overlap="backward", device="simulated")
    opt = strata.optim.AdamW(model.parameters(), runtime=rt, layer_bytes="1KiB", **HYPER)
    assert step_outcomes(model, opt, 2) == ["speculation", "speculation"]
    assert (rt.stats()["undo_on_gpu"], rt.stats()["undo_on_gpu_from"]) == (False, "argument")
    assert opt.close() == []
    rt.close()

    # hybrid: the layers stepped on the host keep no undo, so they do not count.
    model = Mlp()
    opt = strata_opt("hybrid", overlap="backward", layer_bytes="1KiB")(model)
    host = set(opt.placement["host_layers"])
    assert host
    want = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if opt.runtime._layer_of[id(p)] not in host
    )
    assert strata_budget.undo_need(opt.runtime, host) == want
    assert want < sum(p.numel() * p.element_size() for p in model.parameters())
    assert opt.close() == []


def test_two_slow_iterations_in_backward_do_not_send_the_step_away():
    # Backward measured faster, then two of its iterations slowed by something else: the median of
    # the last five still says backward (See Note [When to step in backward] in
    # strata/_when.py).
    model = Mlp()
    opt = strata_opt("layer_prefetch", overlap="backward", layer_bytes="1KiB")(model)
    opt._overlap._choice.clock = FakeClock(
        {"backward": [50.0] * 3 + [200.0, 200.0, 50.0], "after": 60.0}
    )
    outcomes = step_outcomes(model, opt, 12)
    assert outcomes == ["speculation"] * 4 + ["sequential"] * 3 + ["speculation"] * 5, outcomes
    assert opt.close() == []


def test_an_lr_schedule_under_overlap_steps_with_the_rate_of_each_step():
    # The scheduler changes the rate after step(); layers stepped in the next backward use the new
    # one (and a rate changed after backward redoes the step).
    def loop(change_after_backward):
        def run_loop(model, opt, steps):
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            losses = []
            for step in range(steps):
                opt.zero_grad()
                losses.append(mse_step(model, step))
                if change_after_backward and step == 3:
                    opt.param_groups[0]["lr"] *= 0.5
                opt.step()
                sched.step()
            return losses

        return run_loop

    for late in (False, True):
        _, want_params, _ = run(Mlp, torch_opt, loop(late), steps=6)
        make = strata_opt("layer_prefetch", overlap="backward", layer_bytes="1KiB")
        _, params, _ = run(Mlp, make, loop(late), steps=6)
        assert_close(params, want_params, rel=1e-5)


def test_module_tree_discovery_finds_the_blocks():
    lm = CausalLm(n=6)
    names = [n for n, _ in strata.layers.discover_layers(lm)]
    assert names == (
        ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(6)] + ["model.norm", "lm_head"]
    )
    # Nested: blocks in a ModuleList inside a ModuleList's entries' parent.
    nested = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([Mlp(), Mlp()]))
    got = [n for n, _ in strata.layers.discover_layers(nested)]
    assert got[0] == "0" and all(n.startswith("1.") for n in got[1:]) and len(got) >= 3
    # Flat: each Linear its own layer.
    flat = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    assert [n for n, _ in strata.layers.discover_layers(flat)] == ["0", "1", "2", "3", "4"]


def lm_loop(model, opt, steps):
    losses = []
    model.zero_grad()
    for step in range(steps):
        out = model(**lm_batch(step))
        out["loss"].backward()
        opt.step()
        model.zero_grad()
        losses.append(out["loss"].item())
    return losses


def wide_lm():
    return CausalLm(d=128)


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_an_hf_shaped_model_attached_with_default_layers_under_a_small_budget(overlap, caplog):
    want_losses, want_params, _ = run(wide_lm, torch_opt, lm_loop, steps=5)
    whole = sum(p.numel() for p in wide_lm().parameters()) * 4
    budget = 8 << 20
    # Parameters, gradients and moments of the whole (as one layer, as attach made it before)
    # are far over the budget; a block's fit twice over.
    assert whole * 4 > 2 * budget
    block = sum(p.numel() for p in wide_lm().model.layers[0].parameters()) * 4
    assert 2 * 4 * block < budget

    def make(model):
        rt = strata.Runtime(
            policy="layer_prefetch",
            roles="all",
            gpu_budget=budget,
            device="simulated",
            overlap=overlap,
        )
        with caplog.at_level("INFO", logger="strata"):
            layers = strata.attach(model, rt)
        assert len(layers) == 13  # embeddings, 10 blocks, final norm, head
        assert "13 layers from the module tree" in caplog.text
        opt = strata.optim.AdamW(model.parameters(), runtime=rt, **HYPER)
        return rt, opt

    model = wide_lm()
    rt, opt = make(model)
    losses = lm_loop(model, opt, 5)
    assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
    assert_close(params_of(model), want_params, rel=1e-5)
    assert opt.close() == []
    assert rt.close() == []


def hf_example():
    return example("hf_trainer_loop")


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_the_hf_trainer_shaped_example_matches_torch_on_the_cpu(overlap, clip, capsys):
    argv = ["--steps", "10", "--layers", "3", "--compare", "--overlap", overlap]
    argv += ["--max_grad_norm", clip]
    assert hf_example().main(argv) == 0, capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_float16_grad_scaler_loop_is_bitwise_torchs_fused_adamw(overlap, clip, capsys):
    # float16 autocast, GradScaler with a skipped step (step 3 overflows), with unscale_ and
    # clip_grad_norm_ or without (the scale then reaches the kernel), model.zero_grad():
    # parameters bitwise torch.optim.AdamW(fused=True)'s.
    argv = ["--device", "cuda", "--steps", "30", "--compare", "--overlap", overlap]
    argv += ["--prefetch_depth", "2", "--max_grad_norm", clip]
    assert hf_example().main(argv) == 0, capsys.readouterr().out


def nano_loop(model, opt, steps):
    losses = []
    for step in range(steps):
        b = lm_batch(step)
        _, loss = model(b["input_ids"], b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("roles,budget", [("optimizer_states", 16 << 20), ("all", 8 << 20)])
def test_a_nanogpt_shaped_model_with_tied_weights_attached_by_default(roles, budget):
    from users import NanoGpt

    names = [n for n, _ in strata.layers.discover_layers(NanoGpt())]
    assert names == (
        ["transformer.wte", "transformer.wpe"]
        + [f"transformer.h.{i}" for i in range(6)]
        + ["transformer.ln_f"]
    )  # lm_head's weight is wte's
    _, want_params, _ = run(NanoGpt, torch_opt, nano_loop, steps=4)
    model = NanoGpt()
    rt = strata.Runtime(policy="layer_prefetch", roles=roles, gpu_budget=budget, device="simulated")
    strata.attach(model, rt)
    opt = strata.optim.AdamW(model.parameters(), runtime=rt, **HYPER)
    nano_loop(model, opt, 4)
    assert_close(params_of(model), want_params, rel=1e-5)
    assert opt.close() == []
    assert rt.close() == []


def compiled_mlp(forward_first):
    """A torch.compile'd Mlp (aot_eager: dynamo and AOTAutograd as inductor sees them, with no C++
    compiler needed); `forward_first`: a forward traces it before the optimizer adds its hooks."""
    torch._dynamo.reset()
    model = torch.compile(Mlp(), backend="aot_eager")
    if forward_first:
        with torch.no_grad():
            model(batch(99)[0])
    return model


@pytest.mark.parametrize("forward_first", [False, True], ids=["hooks_first", "forward_first"])
@pytest.mark.parametrize("how", ["one_line", "model", "hybrid"])
def test_a_compiled_model_trains_as_torchs(forward_first, how):
    _, want_params, _ = run(lambda: compiled_mlp(forward_first), torch_opt, hf_loop, steps=6)
    policy = "hybrid" if how == "hybrid" else None

    def make_opt(model):
        extra = {"model": model} if how == "model" else {}
        return strata.optim.AdamW(
            model.parameters(), policy=policy, **HYPER, **policy_kw(policy), **extra
        )

    _, params, _ = run(lambda: compiled_mlp(forward_first), make_opt, hf_loop, steps=6)
    assert_close(params, want_params, rel=1e-5)


def test_census_of_bad_inputs_from_users_loops(capsys):
    """Each bad input a user's loop can hand strata.optim: a clear error naming the fix, and
    nothing changed (parameters, states, step counts)."""
    model = LoraMlp()
    opt = strata.optim.AdamW(model.parameters(), policy="layer_prefetch", **HYPER)
    plain_loop(model, opt, 2)

    def snapshot():
        state = opt.state_dict()
        return params_of(model), steps_of(state), [v["exp_avg"] for v in state["state"].values()]

    def frozen_with_grad():
        model.inp.base.weight.grad = torch.ones_like(model.inp.base.weight)
        try:
            opt.step()
        finally:
            model.inp.base.weight.grad = None

    def load(step):
        state = opt.state_dict()
        first = next(iter(state["state"]))
        state["state"][first]["step"] = torch.tensor(step)
        opt.load_state_dict(state)

    def short_moments():
        state = opt.state_dict()
        first = next(iter(state["state"]))
        state["state"][first]["exp_avg"] = torch.zeros(3)
        return state

    frozen = LoraMlp()
    cases = [
        (
            "capturable=True",
            lambda: strata.optim.AdamW(Mlp().parameters(), capturable=True),
            ValueError,
            "capturable=True is not supported",
        ),
        (
            "differentiable=True",
            lambda: strata.optim.AdamW(Mlp().parameters(), differentiable=True),
            ValueError,
            "differentiable=True is not supported",
        ),
        (
            "add_param_group after construction",
            lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}),
            NotImplementedError,
            "make a new optimizer with every group",
        ),
        (
            "a frozen parameter given a gradient",
            frozen_with_grad,
            RuntimeError,
            "make the optimizer after unfreezing it",
        ),
        (
            "no parameter requires grad",
            lambda: strata.optim.AdamW([p for p in frozen.parameters() if not p.requires_grad]),
            ValueError,
            "no parameter requires grad",
        ),
        ("a state dict step that is not a count", lambda: load(2.5), ValueError, "not a count"),
        ("a negative state dict step", lambda: load(-1.0), ValueError, "not a count"),
        (
            "max_grad_norm not positive",
            lambda: strata.optim.AdamW(Mlp().parameters(), max_grad_norm=0.0),
            ValueError,
            "max_grad_norm",
        ),
        (
            "a state_dtype strata does not store moments in",
            lambda: strata.optim.AdamW(Mlp().parameters(), state_dtype="fp8"),
            ValueError,
            "'float32', 'bfloat16' or 'int8'",
        ),
        (
            "amsgrad with compressed moments",
            lambda: strata.optim.AdamW(Mlp().parameters(), amsgrad=True, state_dtype="bfloat16"),
            ValueError,
            "amsgrad needs float32 moments",
        ),
        (
            "a state dict whose moments are not the parameter's size",
            lambda: opt.load_state_dict(short_moments()),
            ValueError,
            "has 3 elements",
        ),
    ]
    for name, call, error, message in cases:
        before = snapshot()
        with pytest.raises(error, match=message):
            call()
        after = snapshot()
        assert_bitwise(after[0], before[0]), name
        assert after[1] == before[1], name
        assert_bitwise(after[2], before[2]), name
    opt.step()  # the optimizer goes on after every refusal
    assert opt.close() == []
    with capsys.disabled():
        print(f"\nstrata.optim bad inputs tried: {len(cases)} distinct")


def assert_overlapped_as_torch_and_sequential(policy, loop):
    """`loop` under strata with overlap="backward": torch's results, and bitwise the same loop
    under overlap="none"."""
    want_losses, want_params, _ = run(Mlp, torch_opt, loop)
    seq = run(Mlp, strata_opt(policy, overlap="none"), loop)
    got = run(Mlp, strata_opt(policy, overlap="backward"), loop)
    assert_close([torch.tensor(got[0])], [torch.tensor(want_losses)], rel=1e-5)
    assert_close(got[1], want_params, rel=1e-5)
    assert got[0] == seq[0]
    assert_bitwise(got[1], seq[1])


def resume_loop(model, opt, steps):
    """A checkpoint of step 3 loaded between backward and step() at step 6 (a loop restoring
    after a failed step, or resuming mid-iteration): step() steps the loaded states, as torch's."""
    losses, saved = [], None
    for step in range(steps):
        opt.zero_grad()
        losses.append(mse_step(model, step))
        if step == 6:
            opt.load_state_dict(saved)
        opt.step()
        if step == 3:
            saved = copy.deepcopy(opt.state_dict())
    return losses


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_a_state_dict_loaded_between_backward_and_step_is_the_one_stepped(policy):
    assert_overlapped_as_torch_and_sequential(policy, resume_loop)


def refused_load_loop(model, opt, steps):
    """strata's: a state dict that fails load_state_dict's checks (its last parameter's moments
    short), tried between backward and step() at every step: refused, and training goes on as
    torch's (which does not check, and is not given it)."""
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(mse_step(model, step))
        if isinstance(opt, strata.optim.Adam):
            bad = copy.deepcopy(opt.state_dict())
            bad["state"][list(bad["state"])[-1]]["exp_avg"] = torch.zeros(3)
            before = params_of(model)  # under overlap, what backward stepped
            with pytest.raises(ValueError, match="has 3 elements"):
                opt.load_state_dict(bad)
            assert_bitwise(params_of(model), before)  # nothing taken back, nothing written
        opt.step()
    return losses


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_a_state_dict_refused_between_backward_and_step_leaves_that_step_as_it_was(policy):
    assert_overlapped_as_torch_and_sequential(policy, refused_load_loop)
