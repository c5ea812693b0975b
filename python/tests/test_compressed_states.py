"""strata.optim.AdamW with compressed moments (state_dtype "bfloat16" and "int8"; See Note
[Compressed moments] in optim/state_codec.h) on the simulated device: bitwise alike under every
policy and with the step in backward; state dicts in torch's format (float32 moments shaped like
the parameters) that resume exactly, and torch's own state dicts loaded to the nearest codes; bad
choices refused before anything is made."""

import pytest
import torch

import strata
from models import POLICIES, Mlp, assert_bitwise, batch, params_of, train

COMPRESSED = ["bfloat16", "int8"]


def run(policy, state_dtype, steps=12, **kw):
    model = Mlp()
    opt = strata.optim.AdamW(
        model.parameters(), lr=3e-3, weight_decay=0.05, policy=policy, state_dtype=state_dtype, **kw
    )
    losses = train(model, opt, steps)
    return model, opt, losses


@pytest.mark.parametrize("state_dtype", COMPRESSED)
def test_every_policy_trains_bitwise_alike_and_near_float32_moments(state_dtype):
    _, opt32, want_losses = run("keep_on_gpu", "float32")
    opt32.close()
    first = None
    for policy in POLICIES:
        model, opt, losses = run(policy, state_dtype)
        assert opt.close() == []
        # The moments are rounded, the step is float32: the losses follow float32 moments'.
        for got, want in zip(losses, want_losses):
            assert abs(got - want) <= 0.02 * abs(want) + 1e-3, (policy, losses, want_losses)
        if first is None:
            first = (losses, params_of(model))
        else:
            assert losses == first[0], policy
            assert_bitwise(params_of(model), first[1])


@pytest.mark.parametrize("state_dtype", COMPRESSED)
def test_state_dict_is_torchs_format_and_resumes_exactly(state_dtype):
    model, opt, _ = run("layer_prefetch", state_dtype, steps=5)
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        entry = sd["state"][i]
        for name in ("exp_avg", "exp_avg_sq"):
            assert entry[name].dtype == torch.float32 and entry[name].shape == p.shape
        assert (entry["exp_avg_sq"] >= 0).all()
    # torch.optim.AdamW takes it as its own.
    twin = Mlp()
    twin.load_state_dict(model.state_dict())
    torch.optim.AdamW(twin.parameters(), lr=3e-3).load_state_dict(sd)
    # A new optimizer from the state dict holds the same bytes, and trains on as the first does.
    resumed_model = Mlp()
    resumed_model.load_state_dict(model.state_dict())
    resumed = strata.optim.AdamW(
        resumed_model.parameters(),
        lr=3e-3,
        weight_decay=0.05,
        policy="bulk",
        state_dtype=state_dtype,
    )
    resumed.load_state_dict(sd)
    again = resumed.state_dict()
    for i in sd["state"]:
        for name, value in sd["state"][i].items():
            assert torch.equal(again["state"][i][name], value), (i, name)
    want = train(model, opt, 4, start=5)
    got = train(resumed_model, resumed, 4, start=5)
    assert got == want
    assert_bitwise(params_of(resumed_model), params_of(model))
    assert opt.close() == [] and resumed.close() == []


@pytest.mark.parametrize("state_dtype", COMPRESSED)
def test_torchs_state_dict_loads_to_the_nearest_codes(state_dtype):
    model = Mlp()
    ref = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    train(model, ref, 3)
    opt = strata.optim.AdamW(model.parameters(), lr=3e-3, state_dtype=state_dtype)
    opt.load_state_dict(ref.state_dict())
    got = opt.state_dict()["state"]
    for i, want in ref.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            w, g = want[name], got[i][name]
            # Half a gap: 2^-8 of the value for bfloat16; for int8 1/16 of it, plus half the
            # smallest step below the small-float range of its block.
            slack = (w.abs().max() * 2.0**-17) if state_dtype == "int8" else 0.0
            rel = 2.0**-8 if state_dtype == "bfloat16" else 1.0 / 16
            assert ((g - w).abs() <= w.abs() * rel * 1.001 + slack).all(), (i, name)
    assert opt.close() == []


def test_bad_state_dtypes_and_amsgrad_are_refused_before_anything_is_made():
    model = Mlp()
    for bad in ("fp8", "int4", torch.int8, None):
        with pytest.raises(ValueError, match="float32', 'bfloat16' or 'int8'"):
            strata.optim.AdamW(model.parameters(), state_dtype=bad)
    with pytest.raises(ValueError, match="amsgrad needs float32 moments"):
        strata.optim.AdamW(model.parameters(), amsgrad=True, state_dtype="int8")
    # Nothing was bound: a float32 optimizer over the same parameters is made as usual.
    opt = strata.optim.AdamW(model.parameters())
    assert opt.close() == []


def test_stepping_in_backward_with_int8_moments_is_bitwise_the_step_after_it():
    results = []
    for overlap in ("none", "backward"):
        model = Mlp()
        opt = strata.optim.AdamW(
            model.parameters(),
            lr=3e-3,
            policy="layer_prefetch",
            overlap=overlap,
            max_grad_norm=1.0,
            state_dtype="int8",
            model=model,
        )
        for step in range(6):
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        results.append(params_of(model))
        assert opt.close() == []
    assert_bitwise(results[0], results[1])


def test_placement_reports_the_split_threads_moments_and_rates():
    model = Mlp()
    opt = strata.optim.AdamW(
        model.parameters(), policy="hybrid", hybrid_fraction=0.5, state_dtype="int8", model=model
    )
    train(model, opt, 2)
    got = opt.placement
    assert got["line"].startswith("hybrid: ") and "stepped on the host" in got["line"]
    assert got["host_layers"] and got["host_threads"] >= 1 and got["state_dtype"] == "int8"
    assert got["rates"]["link_both_gbps"] > 0 and got["rates"]["host_params_per_s"] > 0
    assert opt.close() == []
    plain = strata.optim.AdamW(Mlp().parameters(), policy="layer_prefetch")
    assert plain.placement["line"] == "" and plain.placement["rates"] is None
    assert plain.close() == []
