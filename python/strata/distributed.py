"""strata under PyTorch FSDP2: binding a rank's DTensor shards, layers that follow fully_shard units,
and gradient clipping by global norm across ranks.

strata.optim.AdamW takes the DTensor parameters of a fully_shard model as they are; each rank binds
its local shards to its own runtime and steps them with strata's kernel:

    model = Gpt(...)
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))
    fully_shard(model)
    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, policy="layer_prefetch")
    loss(model(x)).backward()
    norm = strata.distributed.clip_grad_norm_(opt, max_norm=1.0)  # as clip_grad_norm_ on DTensors
    opt.step()

Note [Binding an FSDP2 shard]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FSDP2 keeps each rank's shard of a parameter in a flat buffer padded to the largest rank's shard
(`_sharded_param_data`); the DTensor's local tensor is its leading, unpadded part, and FSDP's
all-gather reads the whole buffer. strata binds that whole storage, so the DTensor, its local tensor
and FSDP's flat buffer all follow the runtime's memory (the binding points the shared storage, not a
tensor object, at it). The gradient is made alike: a zeroed storage of the padded size whose leading
part is the local tensor of a DTensor sharded like the parameter; FSDP's reduce-scatter accumulates
into it in place (it adds to an existing gradient rather than replacing it), and zero_grad zeroes it
in place. The padding of both stays zero: Adam steps a zero gradient from zero moments to a zero
update.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local part of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if is_dtensor(t) else t


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor over the whole storage of `t` (what strata binds;
    See Note [Binding an FSDP2 shard])."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


def check_shardable(p: torch.Tensor, name: str) -> None:
    """Refuses a DTensor parameter strata cannot bind as a whole storage with its shard in front."""
    loc = local(p)
    if not loc.is_contiguous() or loc.storage_offset() != 0:
        raise ValueError(
            f"strata: the local shard of '{name}' ({tuple(loc.shape)}) is not a contiguous tensor at "
            "the start of its storage; strata binds FSDP2's per-rank shards (Shard(0) placements)"
        )
    if loc.numel() == 0:
        raise ValueError(
            f"strata: '{name}' has no elements on this rank (its dimension 0, {p.shape[0]}, is "
            "smaller than the number of ranks); shard it over fewer ranks or leave it unsharded"
        )


def make_grad(p: torch.Tensor) -> torch.Tensor:
    """A zeroed gradient for DTensor `p`, sharded like it, whose storage has the size of the
    parameter's (See Note [Binding an FSDP2 shard]); the existing gradient's values are kept."""
    loc = local(p)
    flat = torch.zeros(whole_storage(loc).numel(), dtype=loc.dtype, device=loc.device)
    grad_local = flat[: loc.numel()].view(loc.shape)
    if p.grad is not None:
        grad_local.copy_(local(p.grad))
    return DTensor(grad_local, p._spec, requires_grad=False)


def sharded_like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`, this rank's part of a state of DTensor `p`, as a DTensor sharded like `p` (kept on
    value's device, which may differ from the mesh's: state dicts hold CPU tensors)."""
    return DTensor(value.reshape(local(p).shape), p._spec, requires_grad=False)


def _fsdp_unit_params():
    """(index, module, sharded parameter) for every parameter of every FSDP2 unit alive, units in
    the order fully_shard made them."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return
    for i, (module, ref) in enumerate(list(_module_state_mapping.items())):
        state = ref() if callable(ref) else ref
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()) or ():
            yield i, module, fp.sharded_param


def fsdp_units() -> dict:
    """id(sharded parameter) -> an index per fully_shard unit, for every FSDP2 unit alive."""
    return {id(p): i for i, _, p in _fsdp_unit_params()}


def fsdp_modules() -> dict:
    """id(sharded parameter) -> the module of its fully_shard unit, for every FSDP2 unit alive."""
    return {id(p): module for _, module, p in _fsdp_unit_params()}


def all_reduce_norm(total: torch.Tensor, params, norm_type: float = 2.0) -> torch.Tensor:
    """A rank's part of a gradient norm made the norm over the mesh of DTensor `params` (p-th
    powers summed by an all-reduce, as clip_grad_norm_ does for DTensors); `total` itself when
    they are not sharded."""
    group = _process_group(params)
    if group is None:
        return total
    total = total**norm_type
    torch.distributed.all_reduce(total, group=group)
    return total ** (1.0 / norm_type)


def _process_group(params: Iterable[torch.Tensor]):
    for p in params:
        if is_dtensor(p):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise NotImplementedError(
                    "strata.distributed.clip_grad_norm_: only 1-D device meshes (FSDP2 without "
                    f"HSDP) are supported; got a {mesh.ndim}-D mesh"
                )
            return mesh.get_group()
    return None


@torch.no_grad()
def grad_norm(params, norm_type: float = 2.0) -> tuple:
    """(the total norm, the local gradients) of `params`' gradients, as clip_grad_norm_ takes it
    for DTensors: each local gradient's norm, their norm on the rank, then the ranks' parts
    reduced over the mesh. The total is a scalar tensor on the gradients' device."""
    if norm_type != 2.0:
        raise NotImplementedError("strata.distributed: only the 2-norm")
    grads = [local(p.grad) for p in params]
    norms = torch._foreach_norm(grads, norm_type)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return all_reduce_norm(total, params, norm_type), grads


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s coefficient: min(1, max_norm / (total + 1e-6))."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a rank's part of sharded gradients (grad_norm), the
    gradients scaled in place by clip_coef. `params` is parameters or a strata optimizer. Returns
    the total norm, a scalar tensor on the gradients' device; no host synchronization besides the
    all-reduce itself."""
    if hasattr(params, "param_groups"):
        params = [p for g in params.param_groups for p in g["params"]]
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    total, grads = grad_norm(params, norm_type)
    torch._foreach_mul_(grads, clip_coef(total, max_norm).to(grads[0].device))
    return total


def world(params) -> Optional[tuple]:
    """(rank, world size) of the mesh the DTensor parameters are sharded over, or None."""
    group = _process_group(params)
    if group is None:
        return None
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
