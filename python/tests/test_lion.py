"""strata.optim.Lion, the second step rule (See Note [Step rules] in optim/step_rule.h), on the CPU
(simulated device): against the published update written as torch code, bitwise across policies,
hybrid and the step in backward, its state dict, and its refusals."""

import pytest
import torch

import strata
from models import POLICIES, Mlp, assert_bitwise, assert_close, params_of, train


class ReferenceLion(torch.optim.Optimizer):
    """Lion as its paper's Algorithm 2 and the common PyTorch ports write it."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = (m * beta1 + p.grad * (1 - beta1)).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


KW = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def lion_run(steps=20, **kw):
    model = Mlp()
    opt = strata.optim.Lion(model.parameters(), **KW, **kw)
    losses = train(model, opt, steps)
    sd = opt.state_dict()
    assert opt.close() == []
    return losses, params_of(model), sd


def test_matches_the_reference_and_is_bitwise_alike_under_every_policy():
    model = Mlp()
    want_losses = train(model, ReferenceLion(model.parameters(), **KW), 20)
    want = params_of(model)
    first = None
    runs = [dict(policy=p) for p in POLICIES]
    runs += [
        dict(policy="layer_prefetch", layer_bytes="1KiB", overlap="backward"),
        dict(policy="hybrid", hybrid_fraction=0.5, layer_bytes="1KiB"),
        dict(policy="hybrid", hybrid_fraction=0.5, layer_bytes="1KiB", overlap="backward"),
    ]
    for kw in runs:
        losses, params, sd = lion_run(**kw)
        # The update is the same function; roundings of the interpolations may differ in the
        # last place, and every move is exactly lr.
        assert_close(params, want, rel=1e-5)
        assert_close([torch.tensor(losses)], [torch.tensor(want_losses)], rel=1e-5)
        assert set(sd["state"][0]) == {"step", "exp_avg"}, kw
        if first is None:
            first = (losses, params)
        else:
            assert losses == first[0], kw
            assert_bitwise(params, first[1])


def test_state_dict_resumes_bitwise():
    _, want, _ = lion_run(steps=20, policy="layer_prefetch")
    model = Mlp()
    opt = strata.optim.Lion(model.parameters(), **KW, policy="layer_prefetch")
    train(model, opt, 10)
    sd = opt.state_dict()
    assert opt.close() == []
    again = strata.optim.Lion(model.parameters(), lr=1.0, policy="keep_on_gpu")
    again.load_state_dict(sd)
    assert again.param_groups[0]["lr"] == KW["lr"]
    train(model, again, 10, start=10)
    assert_bitwise(params_of(model), want)
    assert again.close() == []


def test_lion_refuses_what_is_adams():
    model = Mlp()
    with pytest.raises(TypeError, match="eps is Adam's"):
        strata.optim.Lion(model.parameters(), eps=1e-8)
    with pytest.raises(TypeError, match="amsgrad is Adam's"):
        strata.optim.Lion(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="float32"):
        strata.optim.Lion(model.parameters(), state_dtype="int8")
    # An Adam state dict has states Lion does not keep.
    adam = strata.optim.AdamW(model.parameters(), policy="keep_on_gpu")
    train(model, adam, 2)
    sd = adam.state_dict()
    assert adam.close() == []
    lion = strata.optim.Lion(model.parameters(), policy="keep_on_gpu")
    with pytest.raises(ValueError, match="'exp_avg_sq', which Lion does not keep"):
        lion.load_state_dict(sd)
    train(model, lion, 2)
    lion_sd = lion.state_dict()
    assert lion.close() == []
    # And Lion's lacks what Adam keeps.
    adam = strata.optim.AdamW(model.parameters(), policy="keep_on_gpu")
    with pytest.raises(ValueError, match="has no 'exp_avg_sq'"):
        adam.load_state_dict(lion_sd)
    assert adam.close() == []


@pytest.mark.gpu
def test_on_the_gpu_every_policy_hybrid_and_the_step_in_backward_train_bitwise_alike():
    # The CUDA kernel, and for hybrid's host layers the host kernel, give the same bits (See Note
    # [Step rules]); the reference runs torch's own ops on the GPU.
    def run(opt_of):
        model = Mlp().cuda()
        opt = opt_of(model)
        losses = train(model, opt, 12, device="cuda")
        return losses, params_of(model), opt

    want_losses, want, _ = run(lambda m: ReferenceLion(m.parameters(), **KW))
    got = {}
    for name, kw in (
        ("keep_on_gpu", dict(policy="keep_on_gpu")),
        ("layer_prefetch", dict(policy="layer_prefetch", layer_bytes="1KiB")),
        ("hybrid", dict(policy="hybrid", hybrid_fraction=0.5, layer_bytes="1KiB")),
        (
            "hybrid+overlap",
            dict(policy="hybrid", hybrid_fraction=0.5, layer_bytes="1KiB", overlap="backward"),
        ),
        ("clipped", dict(policy="layer_prefetch", layer_bytes="1KiB", max_grad_norm=0.05)),
        (
            "clipped+overlap",
            dict(
                policy="layer_prefetch", layer_bytes="1KiB", max_grad_norm=0.05, overlap="backward"
            ),
        ),
    ):
        losses, params, opt = run(lambda m, kw=kw: strata.optim.Lion(m.parameters(), **KW, **kw))
        got[name] = (losses, params, opt.steps_redone)
        assert opt.close() == []
    for name in ("keep_on_gpu", "layer_prefetch", "hybrid", "hybrid+overlap"):
        assert_close(got[name][1], want, rel=1e-5)
        assert got[name][0] == got["keep_on_gpu"][0], name
        assert_bitwise(got[name][1], got["keep_on_gpu"][1])
    # Clipping inside the step (it triggers: the run differs from the unclipped one), stepped in
    # backward, is bitwise the step after backward (redone or not stepped in backward where it
    # triggered: See Note [When to step in backward] in strata/_when.py).
    assert got["clipped"][0] != got["layer_prefetch"][0]
    assert got["clipped+overlap"][0] == got["clipped"][0]
    assert_bitwise(got["clipped+overlap"][1], got["clipped"][1])


def test_the_layout_counts_lions_one_state(caplog):
    # Lion's layers and prefetch depth are sized from its own state bytes (See Note [Step rules]):
    # one float32 moment a parameter, half of AdamW's for float32 parameters.
    def largest(cls):
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        with caplog.at_level("INFO", logger="strata"):
            caplog.clear()
            opt = cls(model.parameters(), policy="layer_prefetch", model=model)
            assert opt.close() == []
        line = next(
            r.getMessage() for r in caplog.records if "largest layer's states" in r.getMessage()
        )
        return float(line.split("largest layer's states ")[1].split(" MiB")[0])

    assert largest(strata.optim.Lion) == pytest.approx(largest(strata.optim.AdamW) / 2, rel=0.01)
