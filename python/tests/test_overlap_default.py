"""Stepping in backward in the loops users write, against the same loop stepped after backward and
torch.optim.AdamW (CPU, simulated device): gradient accumulation with no accumulate(), a step with
more backward passes than the last, a step the loop skips with zero_grad(), an evaluation forward
between backward and step(), activation checkpointing; and overlap="auto", the default, chosen by
the policy and the device (See Note [Overlap by default] and Note [Backward passes before a step]
in strata/_overlap.py)."""

import logging

import pytest
import strata
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from models import POLICIES, Mlp, assert_bitwise, assert_close, batch, params_of
from strata._overlap import choose_overlap

HYPER = {"lr": 1e-2, "weight_decay": 0.1}
LOOP_POLICIES = POLICIES + ["hybrid"]


def make_opt(model, policy, overlap):
    extra = {"hybrid_fraction": 0.5} if policy == "hybrid" else {}
    if policy is None:  # torch's own, the reference
        return torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    return strata.optim.AdamW(
        model.parameters(), policy=policy, overlap=overlap, layer_bytes="1KiB", **HYPER, **extra
    )


def accumulation_loop(passes_of_step):
    """nanoGPT's loop: passes_of_step(step) micro-batches a step, each loss divided by their
    number, then step() and zero_grad(); no accumulate(). Returns the losses and, for strata, each
    step's last_step_outcome."""

    def loop(model, opt, steps):
        losses, outcomes = [], []
        for step in range(steps):
            x, y = batch(step)
            n = passes_of_step(step)
            for xs, ys in zip(x.chunk(n), y.chunk(n)):
                loss = F.mse_loss(model(xs), ys) / n
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            outcomes.append(getattr(opt, "last_step_outcome", None))
        return losses, outcomes

    return loop


def run(policy, overlap, loop, steps=10, model_cls=Mlp):
    model = model_cls()
    opt = make_opt(model, policy, overlap)
    losses, outcomes = loop(model, opt, steps)
    params = params_of(model)
    if policy is not None:
        assert opt.close() == []
    return losses, params, outcomes


@pytest.mark.parametrize("policy", LOOP_POLICIES)
@pytest.mark.parametrize(
    "passes",
    [lambda s: 2, lambda s: 4, lambda s: 3 if s in (4, 7) else 1, lambda s: 1 if s == 5 else 2],
    ids=["2", "4", "more_at_4_and_7", "fewer_at_5"],
)
def test_gradient_accumulation_with_no_accumulate_is_exact(policy, passes):
    loop = accumulation_loop(passes)
    _, want_params, _ = run(None, None, loop)
    _, seq_params, seq_outcomes = run(policy, "none", loop)
    assert set(seq_outcomes) == {"sequential"}
    _, params, outcomes = run(policy, "backward", loop)
    assert_close(params, want_params, rel=1e-5)
    assert_bitwise(params, seq_params)
    # The layers step in backward in the last pass once the count is known; a step with more
    # passes than the last was taken back at its next forward (redone), and the steps after it
    # went back to backward.
    assert outcomes[-1] == "speculation"
    assert "speculation" in outcomes[1:4]
    more = [s for s in range(1, 10) if passes(s) > passes(s - 1)]
    for s in more:
        assert outcomes[s] in ("redone", "sequential")


def test_the_number_of_passes_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="strata"):
        run("layer_prefetch", "backward", accumulation_loop(lambda s: 3))
    said = [r.getMessage() for r in caplog.records if "backward passes before step()" in r.message]
    assert len(said) == 1 and "3 backward passes" in said[0]


SKIP = object()  # what a plain_loop's after_backward returns to skip the step


def plain_loop(after_backward):
    """The plain loop: forward, backward, after_backward(model, opt, step) (the loop's own work
    between backward and step(); SKIP skips the step), step(), zero_grad(). Returns the losses
    and, for each step taken, (strata's last_step_outcome, what after_backward returned)."""

    def loop(model, opt, steps):
        losses, outcomes = [], []
        for step in range(steps):
            x, y = batch(step)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            said = after_backward(model, opt, step)
            if said is SKIP:
                continue
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            outcomes.append((getattr(opt, "last_step_outcome", None), said))
        return losses, outcomes

    return loop


@pytest.mark.parametrize("policy", LOOP_POLICIES)
@pytest.mark.parametrize("how", ["zero_grad", "model_zero_grad"])
def test_a_step_the_loop_skips_after_backward_changes_nothing(policy, how):
    """A loop that drops a step's gradients after backward (a loss it will not step on) and goes
    on: torch's parameters stay as they were, so strata's must too."""

    def skip(model, opt, step):
        if step in (3, 6):
            (opt if how == "zero_grad" else model).zero_grad()
            return SKIP
        return None

    loop = plain_loop(skip)
    want_losses, want_params, _ = run(None, None, loop)
    losses, params, outcomes = run(policy, "backward", loop)
    assert_close(params, want_params, rel=1e-5)
    assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
    _, seq_params, _ = run(policy, "none", loop)
    assert_bitwise(params, seq_params)
    assert outcomes[-1][0] == "speculation"


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_an_evaluation_between_backward_and_step_sees_the_parameters_before_the_step(policy):
    def loop(model, opt, steps):
        evals, outcomes = [], []
        for step in range(steps):
            x, y = batch(step)
            F.mse_loss(model(x), y).backward()
            with torch.no_grad():
                evals.append(model(batch(99)[0]).clone())
            opt.step()
            opt.zero_grad()
            outcomes.append(getattr(opt, "last_step_outcome", None))
        return evals, outcomes

    want_evals, want_params, _ = run(None, None, loop, steps=6)
    evals, params, outcomes = run(policy, "backward", loop, steps=6)
    assert_close(evals, want_evals, rel=1e-5)
    assert_close(params, want_params, rel=1e-5)
    assert "redone" in outcomes  # each try in backward was taken back at the evaluation


class Checkpointed(torch.nn.Module):
    """Mlp's layers, each run under activation checkpointing: backward runs each layer's forward
    again just before its own backward, after the layers behind it have stepped."""

    def __init__(self):
        super().__init__()
        self.inner = Mlp()

    def forward(self, x):
        m = self.inner
        for layer in (m.inp, m.mid):
            x = torch.utils.checkpoint.checkpoint(
                lambda t, f=layer: m.act(f(t)), x, use_reentrant=False
            )
        return torch.utils.checkpoint.checkpoint(m.out, x, use_reentrant=False)


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_activation_checkpointing_keeps_the_step_in_backward(policy):
    loop = accumulation_loop(lambda s: 1)
    _, want_params, _ = run(None, None, loop, model_cls=Checkpointed)
    _, params, outcomes = run(policy, "backward", loop, model_cls=Checkpointed)
    assert_close(params, want_params, rel=1e-5)
    assert set(outcomes) == {"speculation"}  # the recomputed forwards took nothing back


def test_auto_steps_in_backward_on_a_gpu_under_a_policy_that_streams_states(monkeypatch):
    monkeypatch.delenv("STRATA_POLICY", raising=False)
    assert choose_overlap(None, None, True) == ("backward", "auto")  # layer_prefetch
    assert choose_overlap("auto", "hybrid", True) == ("backward", "auto")
    assert choose_overlap(None, "keep_on_gpu", True)[0] == "none"
    assert choose_overlap(None, "bulk", True)[0] == "none"
    assert choose_overlap(None, "layer_prefetch", False)[0] == "none"  # the simulated device
    assert choose_overlap("none", "layer_prefetch", True) == ("none", "argument")
    assert choose_overlap("backward", "bulk", False) == ("backward", "argument")
    monkeypatch.setenv("STRATA_POLICY", "keep_on_gpu")
    assert choose_overlap(None, None, True)[0] == "none"


def test_the_info_line_says_where_overlap_came_from(caplog):
    with caplog.at_level(logging.INFO, logger="strata"):
        strata.optim.AdamW(Mlp().parameters(), policy="layer_prefetch").close()
        strata.optim.AdamW(Mlp().parameters(), policy="layer_prefetch", overlap="backward").close()
    lines = [r.getMessage() for r in caplog.records if "prefetch depth" in r.message]
    assert "overlap none (auto: no GPU to step in backward on)" in lines[0]
    assert "overlap backward (undo on" in lines[1]
    with pytest.raises(ValueError, match="'auto'.*'backward'.*'none'"):
        strata.optim.AdamW(Mlp().parameters(), overlap="sideways")


def own_clip_loop(max_norm):
    """Hugging Face Trainer's and nanoGPT's clipping: the loop's own clip_grad_norm_ before
    step(), at every step; whether it clipped."""

    def clip(model, _opt, step):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm(step))
        return float(norm) > max_norm(step)

    return plain_loop(clip)


@pytest.mark.parametrize("policy", LOOP_POLICIES)
def test_the_loops_own_clip_keeps_the_step_in_backward_while_it_does_not_clip(policy):
    # Clipping fires at steps 3 and 6 only (a tiny max_norm there).
    loop = own_clip_loop(lambda s: 1e-3 if s in (3, 6) else 1e3)
    _, want_params, _ = run(None, None, loop, steps=12)
    _, seq_params, _ = run(policy, "none", loop, steps=12)
    _, params, outcomes = run(policy, "backward", loop, steps=12)
    assert_close(params, want_params, rel=1e-5)
    assert_bitwise(params, seq_params)
    # The first step in backward sees the loop write the gradients and is redone; from then on the
    # fingerprints show that a clip by 1.0 changed nothing, and the steps stand, but where the clip
    # clipped.
    for step, (outcome, clipped) in enumerate(outcomes):
        if clipped:
            assert outcome in ("redone", "sequential"), step
    assert [o for o, _ in outcomes[-3:]] == ["speculation"] * 3


def test_fingerprints_tell_any_scaling_and_not_a_rewrite_with_the_same_values():
    from strata import _strata

    g = torch.randn(4097) * 1e-3
    before = _strata.fingerprints([g, g.to(torch.bfloat16)])
    assert before.shape == (2, 2) and before.dtype == torch.int64
    g.mul_(1.0)
    assert torch.equal(_strata.fingerprints([g, g.to(torch.bfloat16)]), before)
    for c in (1 - 2**-24, 1 - 2**-20, 0.999, 0.5, 1e-30, 0.0, 1 + 2**-23, 2.0):
        assert not torch.equal(_strata.fingerprints([g * c]), before[:1]), c
    swapped = g.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(_strata.fingerprints([swapped]), before[:1])
    with pytest.raises(ValueError, match="contiguous"):
        _strata.fingerprints([torch.zeros(4, 4).t()])


class SometimesHead(torch.nn.Module):
    """One strata layer (layer_bytes large) whose second Linear is used only in the last of a
    step's passes: its hooks end fewer passes than the first's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra=False):
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def test_a_parameter_used_only_in_the_last_pass_is_stepped_with_its_gradient():
    def loop(model, opt, steps):
        for step in range(steps):
            x, y = batch(step)
            passes = 4 if step >= 2 else 2
            for i, (xs, ys) in enumerate(zip(x.chunk(passes), y.chunk(passes))):
                F.mse_loss(model(xs, use_extra=i == passes - 1), ys).backward()
            opt.step()
            opt.zero_grad()
        return [], []

    ref = SometimesHead()
    loop(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER), 6)
    for overlap in ("none", "backward"):
        model = SometimesHead()
        opt = strata.optim.AdamW(
            model.parameters(), policy="layer_prefetch", overlap=overlap, **HYPER
        )
        loop(model, opt, 6)
        assert_close(params_of(model), params_of(ref), rel=1e-5)
        assert opt.close() == []


def test_a_backward_run_twice_raises_once_and_the_next_steps_step_in_the_last_pass():
    model = Mlp()
    opt = make_opt(model, "layer_prefetch", "backward")
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="accumulated again"):
        loss.backward()
    opt.zero_grad()
    outcomes = []
    for step in range(1, 6):  # the same loop, now stepping in its second pass
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        outcomes.append(opt.last_step_outcome)
    assert outcomes[-1] == "speculation"
    assert opt.close() == []


def test_closing_between_backward_and_step_takes_the_step_back():
    model = Mlp()
    before = params_of(model)
    opt = make_opt(model, "layer_prefetch", "backward")
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    assert opt._adam.overlapped_step_open()
    assert opt.close() == []
    assert_bitwise(params_of(model), before)


def test_an_evaluation_then_a_skipped_step_leaves_the_next_step_clean():
    model = Mlp()
    opt = make_opt(model, "layer_prefetch", "backward")
    outcomes = []
    for step in range(6):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        if step == 3:
            with torch.no_grad():
                model(x)  # takes the step back
            opt.zero_grad()  # and the loop skips it
            continue
        opt.step()
        opt.zero_grad()
        outcomes.append(opt.last_step_outcome)
    assert outcomes[-2:] == ["speculation", "speculation"]  # the step after is not "redone"
    assert opt.close() == []


def test_ddp_steps_after_backward_by_default():
    assert choose_overlap(None, "layer_prefetch", True, replicated=True)[0] == "none"
    assert choose_overlap("backward", "layer_prefetch", True, replicated=True)[0] == "backward"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_step_skipped_with_zero_grad_under_attach_changes_nothing(policy):
    def skip(model, opt, step):
        if step in (3, 6):
            opt.zero_grad()
            return SKIP
        return None

    loop = plain_loop(skip)
    _, want_params, _ = run(None, None, loop)
    model = Mlp()
    rt = strata.Runtime(policy=policy, roles="all", device="simulated", overlap="backward")
    strata.attach(model, rt)
    opt = strata.optim.AdamW(model.parameters(), runtime=rt, **HYPER)
    loop(model, opt, 10)
    assert_close(params_of(model), want_params, rel=1e-5)
    assert opt.close() == []
    assert rt.close() == []


def test_close_closes_the_runtime_even_when_the_take_back_fails(monkeypatch):
    model = Mlp()
    opt = make_opt(model, "layer_prefetch", "backward")
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()

    def fail():
        raise RuntimeError("the take-back failed")

    closed = []
    real_close = opt.runtime.close
    monkeypatch.setattr(opt._overlap, "_abandon_backward", fail)
    monkeypatch.setattr(opt.runtime, "close", lambda: closed.append(1) or real_close())
    # The first failure is the one raised, and the runtime was asked to close all the same.
    with pytest.raises(RuntimeError, match="the take-back failed"):
        opt.close()
    assert closed == [1]
