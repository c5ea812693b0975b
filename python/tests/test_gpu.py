"""On the GPU (mark gpu): examples/train_gpt.py's model under layer_prefetch with every role
streamed against torch.optim.AdamW(fused=True), offloaded parameters read through pinned memory,
and a forward over parameters that are away (in pageable memory) raising instead of crashing.
(A torch op outside the hooks on such a CUDA tensor is an illegal address: torch has no reversible
"no data here" state; See Note [Where a bound tensor's data pointer points].)"""

import importlib.util
import pathlib

import pytest
import torch

import strata

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Args:
    device = "cuda"
    policy = "layer_prefetch"
    roles = "all"
    gpu_budget = None
    steps = 20
    layers = 4
    d_model = 128
    heads = 4
    vocab = 512
    seq = 64
    batch = 8
    lr = 1e-3
    seed = 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["layer_prefetch", "bulk", "keep_on_gpu"])
def test_train_gpt_matches_torch_fused_adamw(policy):
    ex = load_example()
    args = Args()
    args.policy = policy
    # Flash and memory-efficient attention accumulate their backward with atomics, so two runs of
    # torch alone differ; the math backend is deterministic, and then only the optimizers differ.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        losses, params = ex.run(args, use_strata=True)
        ref_losses, ref_params = ex.run(args, use_strata=False)
    for a, b in zip(params, ref_params):
        rel = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()
        assert rel <= 1e-6, rel
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-6 * abs(b)


def small_attached_mlp(**runtime_args):
    """A CUDA MLP attached to a runtime made with runtime_args, an input, and its output now."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    model.cuda()
    x = torch.randn(4, 64, device="cuda")
    want = model(x).detach()
    rt = strata.Runtime(roles="all", **runtime_args)
    strata.attach(model, rt)
    return model, rt, x, want


@pytest.mark.gpu
def test_offloaded_parameters_read_as_before_and_leak_nothing():
    model, rt, x, want = small_attached_mlp(policy="layer_prefetch")
    opt = strata.optim.AdamW(model.parameters(), runtime=rt)
    torch.cuda.synchronize()
    rt.offload_all()
    assert rt.stats()["gpu_reserved_bytes"] == 0
    for p in model.parameters():
        assert rt.is_accessible(p)  # pinned host memory, which CUDA tensors address
    rt.reload_all()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    opt.close()
    assert rt.close() == []


@pytest.mark.gpu
def test_a_forward_over_parameters_away_raises_instead_of_crashing():
    # No room in pinned memory: offload_all puts the parameters in pageable memory, which a CUDA
    # tensor cannot address.
    model, rt, x, want = small_attached_mlp(policy="bulk", pinned_budget="4KiB")
    torch.cuda.synchronize()
    rt.offload_all()
    w = model[0].weight
    assert not rt.is_accessible(w)
    with pytest.raises(RuntimeError, match=r"'0\.weight' \(.*\) is away in pageable.* memory"):
        rt.check_accessible(w)
    # The hooks refuse a step while offloaded, before any layer reads a null pointer.
    with pytest.raises(RuntimeError, match=r"offloaded.*call reload_all first"):
        model(x)
    rt.reload_all()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert rt.close() == []


class DeepMlp(torch.nn.Module):
    """Eight CUDA blocks of 1 MiB weights: large enough that a layer's copies take a while."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(8)
        )
        self.head = torch.nn.Linear(512, 8)
        self.cuda()

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)  # the add outside the blocks: their hooks sit on different tensors
        return self.head(x)


def gpu_overlap_run(policy, attach, overlap, max_grad_norm, steps=10):
    """Trains DeepMlp on CUDA with clipping inside strata's AdamW; returns losses, norms,
    parameters and steps redone."""
    model = DeepMlp()
    if attach:  # every role streams
        rt = strata.Runtime(policy=policy, roles="all", overlap=overlap, undo_on_gpu=True)
        strata.attach(model, rt, layers=[*model.blocks, model.head])
        kw = dict(runtime=rt)
    else:  # the parameters' post-accumulate-grad hooks say where backward is
        kw = dict(policy=policy, overlap=overlap, layer_bytes="1MiB")
    opt = strata.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.05, max_grad_norm=max_grad_norm, **kw
    )
    # See Note [One CUDA device a runtime] in runtime/runtime.h.
    assert opt.runtime.cuda_device == torch.cuda.current_device()
    g = torch.Generator(device="cuda").manual_seed(1)
    losses, norms = [], []
    for step in range(steps):
        x = torch.randn(64, 512, device="cuda", generator=g) * (10.0 if step % 3 == 0 else 1.0)
        y = torch.randn(64, 8, device="cuda", generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        norms.append(float(opt.last_grad_norm))
    params = [p.detach().cpu().clone() for p in model.parameters()]
    redone = opt.steps_redone
    assert opt.close() == []
    if attach:
        assert rt.close() == []
    return losses, norms, params, redone


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["layer_prefetch", "bulk", "keep_on_gpu"])
@pytest.mark.parametrize("attach", [False, True], ids=["params", "attached"])
def test_stepping_in_backward_on_the_gpu_is_bitwise_the_step_after_it(policy, attach):
    # Each layer's step runs on a stream of its own (See Note [The step stream]); what backward
    # needs next must still wait for its copies, and the step for its gradients.
    _, norms, _, _ = gpu_overlap_run(policy, attach, "none", 1e9)
    clip = sorted(norms)[len(norms) // 2]  # clipping triggers on some steps and not on others
    want_losses, want_norms, want_params, redone = gpu_overlap_run(policy, attach, "none", clip)
    assert redone == 0
    losses, got_norms, params, redone = gpu_overlap_run(policy, attach, "backward", clip)
    assert losses == want_losses and got_norms == want_norms
    for a, b in zip(params, want_params):
        assert torch.equal(a, b)
    assert 0 < redone < len(norms)


def compiled_run(make_opt, forward_first, clip, steps=10):
    """Trains a torch.compile'd DeepMlp (inductor, as users compile) with the loop's own
    clip_grad_norm_(clip); `forward_first`: one forward runs (and compiles) before the optimizer
    is made, so that hooks strata adds come after the graph was traced. Returns losses, norms,
    parameters and the steps' outcomes (None for torch's)."""
    torch._dynamo.reset()
    model = DeepMlp()
    compiled = torch.compile(model)
    g = torch.Generator(device="cuda").manual_seed(2)
    if forward_first:
        with torch.no_grad():
            compiled(torch.randn(64, 512, device="cuda", generator=g))
    opt = make_opt(compiled)
    losses, norms, outcomes = [], [], []
    for step in range(steps):
        x = torch.randn(64, 512, device="cuda", generator=g) * (10.0 if step == 4 else 1.0)
        y = torch.randn(64, 8, device="cuda", generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(compiled.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
        outcomes.append(getattr(opt, "last_step_outcome", None))
    params = [p.detach().cpu().clone() for p in model.parameters()]
    if hasattr(opt, "close"):
        assert opt.close() == []
    return losses, norms, params, outcomes


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layers,forward_first", [("params", False), ("model", True)], ids=["one_line", "model_later"]
)
def test_a_compiled_model_steps_in_backward_bitwise_the_step_after_it(layers, forward_first):
    # torch.compile traces the blocks' forward; strata's hooks on the parameters (the one line) or
    # on the modules (model=, added after a first compiled forward) must still say where backward
    # is, and the loop's clipping be seen.
    hyper = dict(lr=1e-3, weight_decay=0.05)

    def torch_opt(compiled):
        return torch.optim.AdamW(compiled.parameters(), fused=True, **hyper)

    def strata_opt(overlap):
        def make(compiled):
            kw = dict(model=compiled) if layers == "model" else dict(layer_bytes="1MiB")
            return strata.optim.AdamW(compiled.parameters(), overlap=overlap, **hyper, **kw)

        return make

    _, norms, _, _ = compiled_run(torch_opt, forward_first, 1e9)
    # The loop's clipping fires at most on step 4, whose inputs are ten times as large: the steps
    # tried in backward before it hold.
    clip = max(n for step, n in enumerate(norms) if step != 4) * 1.01
    _, _, ref_params, _ = compiled_run(torch_opt, forward_first, clip)
    want_losses, _, want_params, outcomes = compiled_run(strata_opt("none"), forward_first, clip)
    assert set(outcomes) == {"sequential"}
    losses, _, params, outcomes = compiled_run(strata_opt("backward"), forward_first, clip)
    assert losses == want_losses
    for a, b in zip(params, want_params):
        assert torch.equal(a, b)
    assert "speculation" in outcomes, outcomes
    for a, b in zip(params, ref_params):
        rel = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()
        assert rel <= 1e-6, rel


@pytest.mark.gpu
def test_the_step_clock_times_each_labelled_iteration_and_reuses_its_events():
    # strata._readback.StepClock (See Note [When to step in backward]): an iteration is timed from
    # the mark before it to its own, a None label is not returned, and events are recorded again;
    # one split at its backward's first gradient and at step() gives those two parts, within it.
    from strata._readback import StepClock

    clock = StepClock()
    x = torch.randn(2048, 2048, device="cuda")

    def work(n):
        nonlocal x
        for _ in range(n):
            x = x @ x
            x = x / x.norm()

    labels = [None, "backward", "after", None, "after", "backward", "after", "after"]
    got = []
    for i, label in enumerate(labels):
        work(10)
        if i == 4:
            clock.begin_backward()
        work(10)
        if i == 4:
            clock.end_backward()
        work(10)
        clock.mark(label)
        got += clock.done()
    torch.cuda.synchronize()
    got += clock.done()
    assert [it.label for it in got] == [label for label in labels[1:] if label is not None]
    assert all(it.ms > 0 for it in got)
    split = [it for it in got if it.backward_ms is not None]
    assert len(split) == 1 and split[0] is got[2], got
    assert 0 < split[0].backward_ms and 0 < split[0].step_ms
    assert split[0].backward_ms + split[0].step_ms < split[0].ms
    assert all(it.step_ms is None for it in got if it is not split[0])
    free = len(clock._free)  # the events of iterations read
    assert free >= 1
    clock.mark("after")
    assert len(clock._free) == free - 1


@pytest.mark.gpu
def test_the_undo_kept_on_the_gpu_is_torchs_memory_and_goes_back_at_the_step():
    # See Note [The undo in the framework's memory]: a step in backward keeps its parameters' old
    # bytes in blocks of torch's caching allocator (the ones backward frees), not in strata's pool,
    # and step() gives them back to torch.
    model = DeepMlp()
    opt = strata.optim.AdamW(
        model.parameters(),
        lr=1e-3,
        policy="layer_prefetch",
        overlap="backward",
        undo_on_gpu=True,
        layer_bytes="1MiB",
    )
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        x = torch.randn(4096, 512, device="cuda", generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.zeros(4096, 8, device="cuda")).backward()
        if step < 3:
            opt.step()
            continue
        torch.cuda.synchronize()
        kept = opt.runtime.stats()["undo_bytes"]
        assert kept >= sum(p.numel() * 4 for p in model.blocks.parameters())
        strata_gpu = opt.runtime.memory_stats()["gpu.allocated_bytes.current"]
        torch_before = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        assert opt.last_step_outcome == "speculation"
        # The parameters rest on the GPU: their copies were torch's; the states' undo is their
        # old home blocks on the host (See Note [Undo log]).
        resting = sum(p.numel() * 4 for p in model.parameters())
        assert torch_before - torch.cuda.memory_allocated() >= resting
        assert opt.runtime.memory_stats()["gpu.allocated_bytes.current"] <= strata_gpu
        assert opt.runtime.stats()["undo_bytes"] == 0
    assert opt.close() == []


@pytest.mark.gpu
def test_the_runtime_runs_on_the_current_or_the_named_cuda_device():
    # See Note [One CUDA device a runtime] in runtime/runtime.h: "cuda" is the current device,
    # "cuda:N" device N (the current device stays as it was), and a device that is not there is
    # refused, naming how many are.
    current = torch.cuda.current_device()
    last = torch.cuda.device_count() - 1
    assert strata.Runtime(device="cuda").cuda_device == current
    assert strata.Runtime(device=f"cuda:{last}").cuda_device == last
    assert torch.cuda.current_device() == current
    with pytest.raises(ValueError, match=f"CUDA device {last + 1} does not exist; {last + 1} vis"):
        strata.Runtime(device=f"cuda:{last + 1}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_the_second_gpu_trains_there_as_on_the_first():
    # A distributed script's rank 1 (torch.cuda.set_device(local_rank)): strata's streams, events
    # and memory on cuda:1, the results bitwise those of cuda:0. A model on cuda:1 while cuda:0 is
    # current is refused, naming the fix.
    want_losses, want_norms, want_params, _ = gpu_overlap_run(
        "layer_prefetch", False, "backward", 1.0
    )
    with torch.cuda.device(1):
        model = DeepMlp()
    with pytest.raises(ValueError, match=r"call torch.cuda.set_device\(1\) first"):
        strata.optim.AdamW(model.parameters())
    del model
    torch.cuda.set_device(1)
    try:
        free_first = torch.cuda.mem_get_info(0)[0]
        losses, norms, params, _ = gpu_overlap_run("layer_prefetch", False, "backward", 1.0)
        assert torch.cuda.mem_get_info(0)[0] >= free_first  # nothing of it on cuda:0
    finally:
        torch.cuda.set_device(0)
    assert losses == want_losses and norms == want_norms
    for a, b in zip(params, want_params):
        assert torch.equal(a, b)
