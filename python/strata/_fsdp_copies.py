"""FSDP2's gradient copy-in and parameter copy-out without a host-to-device copy, so that they never
wait for the link strata keeps busy.

    from strata import _fsdp_copies
    _fsdp_copies.install()        # once strata binds an FSDP2 shard on the GPU (strata.Runtime does)
    _fsdp_copies.chunk_cat(grads, 0, world_size, out=flat)      # what torch.ops.fsdp.chunk_cat does

Note [FSDP2's copies and the link]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At every fully_shard unit FSDP2 packs the unit's gradients into one flat buffer before its
reduce-scatter (torch.ops.fsdp.chunk_cat) and unpacks the all-gathered parameters after the
all-gather (torch.ops.fsdp.split_with_sizes_copy). On CUDA both run torch's fused copy kernels, and
each of those first copies a small block of pointers and sizes from page-locked host memory to the
GPU, on the stream the unit computes on. A copy engine runs host-to-device copies in the order they
were queued, across streams, so under a policy that streams optimizer states each of these small
copies ran only after every state fetch strata had queued before it, and backward waited for the
link at every unit (See design.md, section 10).

strata registers, for the CUDA key of those two operators, kernels that give the same bytes with
copies whose metadata travels in the kernels' arguments: torch._foreach_copy_ (its multi-tensor
launch) where the pieces are contiguous, and strided copy_ of each piece otherwise. Nothing goes
host-to-device, so nothing queues behind strata's fetches. Only copies: the result is bitwise
torch's, a cast (bfloat16 gradients reduced in float32) included, since both convert elements with
the same rounding. A case the copies do not cover (a dimension other than 0, a tensor that is not
contiguous, an empty one) goes to torch's kernel. STRATA_FSDP_COPIES=torch keeps torch's kernels
for the process.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

_log = logging.getLogger("strata")
_library = None  # the registration; kept alive for the process (deleting it restores torch's)


def chunk_cat(tensors: list, dim: int, num_chunks: int, out: torch.Tensor) -> None:
    """torch._chunk_cat(tensors, dim, num_chunks, out=out): each tensor padded with zeros along
    `dim` to a multiple of num_chunks and cut into num_chunks chunks; row i of `out` (viewed as
    (num_chunks, -1)) holds every tensor's chunk i, in order, converted to out's dtype."""
    if (
        dim != 0
        or not tensors
        or not out.is_contiguous()
        or any(t.dim() == 0 or t.numel() == 0 or not t.is_contiguous() for t in tensors)
    ):
        torch._chunk_cat(tensors, dim, num_chunks, out=out)
        return
    per_chunk = [-(-t.size(0) // num_chunks) for t in tensors]  # rows a chunk, padded
    sizes = [rows * (t.numel() // t.size(0)) for rows, t in zip(per_chunk, tensors)]
    if out.numel() != num_chunks * sum(sizes):
        torch._chunk_cat(tensors, dim, num_chunks, out=out)
        return
    grid = out.view(num_chunks, -1)
    if num_chunks == 1:  # no padding: the tensors one after another
        pieces = torch.split(grid.view(-1), sizes)
        torch._foreach_copy_(list(pieces), [t.view(-1) for t in tensors])
        return
    start = 0
    for t, rows, size in zip(tensors, per_chunk, sizes):
        column = grid[:, start : start + size]  # (num_chunks, size), every chunk i of t
        start += size
        full = t.size(0) // rows  # chunks with all their rows
        if full:
            column[:full].copy_(t[: full * rows].reshape(full, size))
        if full < num_chunks:
            left = t[full * rows :].numel()  # the partly filled chunk's elements
            if left:
                column[full, :left].copy_(t[full * rows :].reshape(-1))
            column[full, left:].zero_()
            column[full + 1 :].zero_()


def split_with_sizes_copy(
    all_gather_output: torch.Tensor, split_sizes: list, dim: int = 0, *, out: list
) -> None:
    """torch.split_with_sizes_copy(all_gather_output, split_sizes, dim=dim, out=out): piece i of
    the split along `dim` copied into out[i]."""
    pieces = torch.split(all_gather_output, list(split_sizes), dim=dim)
    if len(pieces) != len(out) or any(p.shape != o.shape for p, o in zip(pieces, out)):
        torch.split_with_sizes_copy(all_gather_output, split_sizes, dim=dim, out=out)
        return
    torch._foreach_copy_(list(out), list(pieces))


def install(dispatch_key: str = "CUDA") -> bool:
    """Registers chunk_cat and split_with_sizes_copy for FSDP2's operators (torch.ops.fsdp.*) on
    `dispatch_key`, once a process (See Note [FSDP2's copies and the link]). Returns whether they
    are strata's now: False where STRATA_FSDP_COPIES=torch or this torch's FSDP2 has no such
    operators."""
    global _library
    if _library is not None:
        return True
    if os.environ.get("STRATA_FSDP_COPIES", "strata") == "torch":
        return False
    try:
        import torch.distributed.fsdp._fully_shard._fsdp_collectives  # defines the operators
    except ImportError:
        return False
    if not all(hasattr(torch.ops.fsdp, op) for op in ("chunk_cat", "split_with_sizes_copy")):
        return False
    library = torch.library.Library("fsdp", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():  # torch warns that a kernel replaces its own: it is meant to
        warnings.simplefilter("ignore")
        library.impl("chunk_cat", chunk_cat, dispatch_key, allow_override=True)
        library.impl(
            "split_with_sizes_copy", split_with_sizes_copy, dispatch_key, allow_override=True
        )
    _library = library
    _log.info(
        "strata: FSDP2's gradient copy-in and parameter copy-out on %s are strata's copies, "
        "with no host-to-device metadata to queue behind the state fetches "
        "(STRATA_FSDP_COPIES=torch keeps torch's)",
        dispatch_key,
    )
    return True


def uninstall() -> None:
    """Gives FSDP2's operators back their torch kernels (tests)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
