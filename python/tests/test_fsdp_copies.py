"""strata's kernels for FSDP2's copy-in and copy-out (See Note [FSDP2's copies and the link] in
strata/_fsdp_copies.py): bitwise torch's kernels on every shape FSDP2 gives them (padded chunks,
casts, several ranks), on the CPU and on the GPU (mark gpu); registered in place of torch's, a
one-rank FSDP2 model trains bitwise as with torch's; STRATA_FSDP_COPIES=torch keeps torch's. And an
FSDP2 model alive in the process changes nothing for another model's optimizer."""

import pytest
import torch

import strata
from strata import _fsdp_copies

# Rows fewer than the chunks, rows not a multiple of them, 1-D to 3-D.
SHAPES = [(7,), (1, 5), (3, 4), (16, 8), (5, 2, 3), (9,), (2,)]
CASTS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),  # FSDP2's bfloat16 gradients reduced in float32
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def padded_numel(tensors, chunks):
    return chunks * sum(-(-t.size(0) // chunks) * t[0].numel() for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("src,dst", CASTS)
def test_chunk_cat_is_bitwise_torchs(device, chunks, src, dst):
    g = torch.Generator().manual_seed(chunks)
    tensors = [torch.randn(s, generator=g).to(src).to(device) for s in SHAPES]
    expected = torch.full((padded_numel(tensors, chunks),), 7.0, dtype=dst, device=device)
    got = expected.clone()  # the padding must be written as zeros, not left
    torch._chunk_cat(tensors, 0, chunks, out=expected.view(chunks, -1))
    _fsdp_copies.chunk_cat(tensors, 0, chunks, out=got.view(chunks, -1))
    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_cat_cases_it_does_not_cover_go_to_torch(device):
    g = torch.Generator().manual_seed(1)
    strided = torch.randn(6, 8, generator=g).to(device).t()  # not contiguous
    tensors = [torch.randn(4, 3, generator=g).to(device), strided]
    for dim, ts in ((0, tensors), (1, [torch.randn(4, 6, generator=g).to(device)] * 2)):
        expected = torch._chunk_cat(ts, dim, 2)
        got = torch.full_like(expected, 7.0)
        _fsdp_copies.chunk_cat(ts, dim, 2, out=got)
        assert torch.equal(got, expected)
    empty = [torch.randn(3, 4, generator=g).to(device), torch.empty(0, 4, device=device)]
    with pytest.raises(RuntimeError, match="non-empty"):  # torch's own error
        _fsdp_copies.chunk_cat(empty, 0, 2, out=torch.empty(2, 6, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_split_with_sizes_copy_is_bitwise_torchs(device, ranks, dtype):
    g = torch.Generator().manual_seed(ranks)
    sizes = [3, 17, 1, 20]
    gathered = (torch.randn(ranks, sum(sizes), generator=g) * 50).to(dtype).to(device)
    expected = [torch.empty(ranks, s, dtype=dtype, device=device) for s in sizes]
    got = [torch.empty(ranks, s, dtype=dtype, device=device) for s in sizes]
    torch.split_with_sizes_copy(gathered, sizes, dim=1, out=expected)
    _fsdp_copies.split_with_sizes_copy(gathered, sizes, 1, out=got)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def train_one_rank_fsdp2(steps=4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 12))
            for _ in range(3)
        ]
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(s))
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor().clone() for p in model.parameters()]


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch without distributed")
    monkeypatch.delenv("STRATA_FSDP_COPIES", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    _fsdp_copies.uninstall()
    yield
    _fsdp_copies.uninstall()
    dist.destroy_process_group()


def test_registered_for_fsdp2_it_trains_bitwise_as_torchs_kernels(one_rank, monkeypatch):
    losses, params = train_one_rank_fsdp2()
    calls = []
    torch_copy = _fsdp_copies.chunk_cat

    def counted(*args, **kwargs):
        calls.append(1)
        return torch_copy(*args, **kwargs)

    monkeypatch.setattr(_fsdp_copies, "chunk_cat", counted)
    assert _fsdp_copies.install("CPU")
    assert _fsdp_copies.install("CPU")  # once a process
    got_losses, got_params = train_one_rank_fsdp2()
    assert len(calls) == 4 * 3  # one gradient copy-in a unit with parameters, a step
    assert got_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(got_params, params))
    _fsdp_copies.uninstall()  # torch's kernel again
    calls.clear()
    assert train_one_rank_fsdp2()[0] == losses and not calls


def test_strata_fsdp_copies_torch_keeps_torchs_kernels(one_rank, monkeypatch):
    monkeypatch.setenv("STRATA_FSDP_COPIES", "torch")
    assert not _fsdp_copies.install("CPU")
    assert _fsdp_copies._library is None


def test_an_fsdp2_model_alive_elsewhere_leaves_another_models_step_as_it_was(one_rank):
    # A model given to the optimizer begins its step with its forward, unless its own parameters
    # are FSDP2's (their units begin it): an FSDP2 model alive in the process, not this optimizer's,
    # changes nothing.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(other, mesh=init_device_mesh("cpu", (1,)))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, model=model)
    model(torch.randn(2, 8)).sum()
    assert opt.runtime._rt.in_step()
    opt.close()
