"""On the GPU (mark gpu): examples/train_gpt.py's model under layer_prefetch with every role
streamed against torch.optim.AdamW(fused=True), offloaded parameters read through pinned memory,
and a forward over parameters that are away (in pageable memory) raising instead of crashing.
(A torch op outside the hooks on such a CUDA tensor is an illegal address: torch has no reversible
"no data here" state; see Note [Where a bound tensor's data pointer points].)"""

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
