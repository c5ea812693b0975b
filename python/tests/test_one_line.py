"""The README's one line, strata.optim.AdamW(model.parameters()), on models shaped like users'
(issue 37): strata finds its layers without being told (See Note [Layers without being told] in
strata/layers.py), says what it chose in one INFO line, and trains equal to torch.optim.AdamW,
also when the states exceed what the GPU budget leaves beside the parameters."""

import logging

import pytest
import torch
import torch.nn.functional as F

import strata
from models import assert_close, params_of
from strata.layers import block_of, plan_layers, split_runs, state_bytes


class Blocks(torch.nn.Module):
    """n MLP blocks in a ModuleList between an input and an output projection."""

    def __init__(self, n=12, d=512, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, d), torch.nn.GELU())
            for _ in range(n)
        )
        self.out = torch.nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(model, opt, steps=4):
    for step in range(steps):
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def reference(steps=4):
    model = Blocks()
    return train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), steps)


@pytest.mark.parametrize("how", ["parameters", "named_parameters", "model"])
def test_the_one_line_trains_equal_to_torch_with_states_over_the_budget(how, caplog):
    model = Blocks()
    params = sum(p.numel() for p in model.parameters()) * 4
    budget = 40 << 20
    # The states (8 bytes a parameter) exceed what the budget leaves beside the parameters and
    # gradients strata keeps on the GPU: they must stream.
    assert 2 * params > budget - 2 * params
    args = {
        "parameters": (model.parameters(),),
        "named_parameters": (model.named_parameters(),),
        "model": (model.parameters(),),
    }[how]
    kw = {"model": model} if how == "model" else {}
    with caplog.at_level(logging.INFO, logger="strata"):
        opt = strata.optim.AdamW(*args, lr=1e-3, gpu_budget=budget, **kw)
    line = [r.getMessage() for r in caplog.records if "strata.optim.AdamW: policy" in r.message]
    assert len(line) == 1, caplog.text
    assert "policy layer_prefetch (default)" in line[0] and "GPU budget 0.04 GiB" in line[0]
    want = {
        "parameters": "runs of parameters",
        "named_parameters": "the parameters' names",
        "model": "the module tree",
    }[how]
    assert want in line[0]
    assert opt.runtime.num_layers >= 4  # never one layer of the whole model
    assert_close(train(model, opt), reference(), rel=1e-5)
    assert opt.close() == []


@pytest.mark.parametrize("state_dtype, depth", [("float32", 3), ("bfloat16", 7), ("int8", 14)])
def test_the_ring_holds_the_bytes_of_float32_moments_at_depth_3(state_dtype, depth):
    # Without a budget the prefetch depth is as many layers as a ring of depth 3 holds with float32
    # moments (See _plan.auto_depth); never more than the layers; with a budget, what fits.
    model = Blocks(n=20, d=256)
    opt = strata.optim.AdamW(model.parameters(), model=model, state_dtype=state_dtype)
    assert opt.runtime.num_layers > 14
    assert opt.runtime.prefetch_depth == depth
    train(model, opt, steps=2)
    assert opt.close() == []
    few = Blocks(n=4, d=256)
    opt = strata.optim.AdamW(few.parameters(), model=few, state_dtype=state_dtype)
    assert opt.runtime.prefetch_depth == max(3, min(depth, opt.runtime.num_layers))
    assert opt.close() == []


@pytest.mark.parametrize("given", ["parameters", "model"])
def test_the_states_the_step_takes_first_are_staged_before_step(given):
    # Without overlap, the step begins with the first gradient (with the model's forward when the
    # model is given), and the states it takes first are on their way to the GPU before step()
    # (See Note [States staged ahead] in policies/state_streaming.cpp); an evaluation under no_grad
    # begins nothing; the step trains as torch's.
    model = Blocks()
    kw = {"model": model} if given == "model" else {}
    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    rt = opt.runtime
    for step in range(3):
        with torch.no_grad():
            model(data(step)[0])
        assert not rt._rt.in_step()
        x, y = data(step)
        before = rt.stats()["migrated_bytes_h2d"]
        loss = F.mse_loss(model(x), y)
        assert rt._rt.in_step() == (given == "model")
        loss.backward()
        assert rt._rt.in_step()
        assert rt.stats()["migrated_bytes_h2d"] > before
        opt.step()
        opt.zero_grad()
    assert_close(params_of(model), reference(3), rel=1e-5)
    assert opt.close() == []


def test_layers_follow_the_blocks_by_name_and_by_module():
    model = Blocks(n=6)  # each block under 1 / (depth + 1) of the whole: not opened
    named = list(model.named_parameters())
    layers, how = plan_layers(named, True)
    assert how == "the parameters' names"
    assert [sorted({block_of(n) for n, _ in layer}) for layer in layers] == [
        ["inp"],
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
        ["blocks.4"],
        ["blocks.5"],
        ["out"],
    ]
    by_module, how = plan_layers(named, False, model=model)
    assert how == "the module tree"
    assert [[n for n, _ in layer] for layer in by_module] == [
        [n for n, _ in layer] for layer in layers
    ]
    assert block_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert block_of("lm_head.weight") == "lm_head"


def test_runs_of_parameters_are_sized_from_the_budget_and_never_split_a_parameter():
    params = [
        (f"p{i}", torch.nn.Parameter(torch.zeros(1 << 20))) for i in range(24)
    ]  # 8 MiB states each
    total = sum(state_bytes(p) for _, p in params)
    layers, how = plan_layers(params, False, budget=128 << 20, prefetch_depth=3)
    assert "MiB of states each" in how
    assert [p for layer in layers for _, p in layer] == [p for _, p in params]
    assert max(sum(state_bytes(p) for _, p in layer) for layer in layers) <= total / 4
    assert len(layers) >= 8


def test_blocks_past_the_chunk_are_cut_in_runs_never_merged():
    # A block holding more states than a layer should is cut into runs of its parameters in order,
    # each within the chunk; no run takes parameters of two blocks (See Note [Layers without being
    # told]).
    model = Blocks(n=4)
    named = list(model.named_parameters())
    block = 2 * 4 * (512 * 512 + 3 * 512)  # a block's Adam states
    weight = 2 * 4 * 512 * 512
    vector = 2 * 4 * 512  # a LayerNorm weight's or a bias's
    layers, how = plan_layers(named, True, chunk=weight + 2 * vector)
    assert "cut in runs of parameters" in how
    assert [p for layer in layers for _, p in layer] == [p for _, p in named]
    for layer in layers:
        assert len({block_of(n) for n, _ in layer}) == 1, [n for n, _ in layer]
        assert sum(state_bytes(p) for _, p in layer) <= weight + 2 * vector
    assert [sorted(n for n, _ in layer) for layer in layers[1:3]] == [
        ["blocks.0.0.bias", "blocks.0.0.weight", "blocks.0.1.weight"],
        ["blocks.0.1.bias"],
    ]
    whole, _ = plan_layers(named, True, chunk=block)
    assert len(whole) == 6 and len(layers) == 10
    # A parameter past the limit is a run alone; the rest fill runs up to it.
    sizes = [3, 1, 1, 9, 2, 2, 1]
    runs = split_runs([(str(i), n) for i, n in enumerate(sizes)], 4, lambda n: n)
    assert [[n for _, n in run] for run in runs] == [[3, 1], [1], [9], [2, 2], [1]]


def test_a_layer_with_most_of_the_states_is_warned_about():
    big = [torch.nn.Parameter(torch.zeros(12 << 20))] + [
        torch.nn.Parameter(torch.zeros(1 << 20)) for _ in range(4)
    ]
    with pytest.warns(UserWarning, match="one layer holds"):
        opt = strata.optim.AdamW(big, layer_bytes=1 << 30)
    opt.close()


# See Note [The automatic budget] in strata/budget.py. The simulated device has no driver to ask, so
# the memory after the first step comes from a stand-in for device_memory.
@pytest.mark.parametrize("free_layers", [100, 3, 0])
def test_an_automatic_budget_keeps_what_fits_on_the_gpu_after_the_first_step(
    free_layers, monkeypatch, caplog
):
    from strata import budget as strata_budget

    model = Blocks()
    per_layer = 2 * 4 * (512 * 512 + 3 * 512)  # a block's moments
    margin = 1 << 30
    torch_growth = 5 << 20
    mem = strata_budget.DeviceMemory(
        free=margin + torch_growth + free_layers * per_layer + (1 << 16),
        total=20 << 30,
        torch_reserved=10 << 20,
        torch_peak=(10 << 20) + torch_growth,
        torch_allocated=10 << 20,
        torch_peak_allocated=(10 << 20) + torch_growth,
    )
    asked = []

    def device_memory(rt):
        asked.append(rt)
        return mem

    monkeypatch.setattr(strata_budget, "device_memory", device_memory)
    with caplog.at_level(logging.INFO, logger="strata"):
        opt = strata.optim.AdamW(model.parameters(), lr=1e-3, model=model, gpu_budget="auto")
        assert opt.runtime.stats()["gpu_budget_bytes"] is None  # nothing resident in step 1
        x, y = data(0)
        F.mse_loss(model(x), y).backward()
        held = opt.runtime.stats()["gpu_reserved_bytes"]
        opt.step()
        opt.zero_grad()
    stats = opt.runtime.stats()
    assert stats["gpu_budget_from"] == "auto"
    assert stats["gpu_budget_bytes"] == held + mem.free - margin - torch_growth
    on_gpu: dict = {}  # layer -> whether all its states are on the GPU
    for t in opt.runtime._rt.tensors():
        if t["state"] in ("exp_avg", "exp_avg_sq"):
            on_gpu[t["layer"]] = on_gpu.get(t["layer"], True) and t["tier"] == "gpu"
    resident = {layer for layer, yes in on_gpu.items() if yes}
    line = [r.getMessage() for r in caplog.records if "gpu_budget auto" in r.getMessage()]
    assert len(line) == 1, caplog.text
    assert f"{len(resident)} of {opt.runtime.num_layers} layers' states" in line[0]
    if free_layers == 100:
        assert len(resident) == opt.runtime.num_layers
    elif free_layers == 3:  # three blocks, the small input and output layers beside them
        assert {1, 2, 3} <= resident and not resident & set(range(4, 13)), resident
    else:  # no block; the small output layer may fit what the margin leaves
        assert not resident & set(range(1, 13)), resident
    # Steps 2 to 4 with those layers resident: still torch's numbers.
    for step in range(1, 4):
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert_close(params_of(model), reference(), rel=1e-5)
    assert len(asked) == 2  # checked at construction, measured once after the first step
    assert opt.close() == []


def test_an_automatic_budget_on_the_simulated_device_names_the_fix():
    with pytest.raises(ValueError, match="give a budget in bytes"):
        strata.optim.AdamW(Blocks().parameters(), gpu_budget="auto")
