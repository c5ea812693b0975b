"""How a strata.optim optimizer makes its runtime: the overlap, the budget, where the undo of a
step in backward lives, the layers, the prefetch depth, the device, and the Runtime itself.

strata.optim.Adam's constructor calls make_runtime once, after torch.optim.Optimizer has built its
param_groups; what it decides is logged in one INFO line (strata/_plan.py's log_choice):

    setup = _setup.make_runtime("AdamW", trainable, names, named, moments=2, policy=None, ...)
    setup.runtime        # strata.Runtime, the layers added, the tensors not yet bound
    setup.plan, setup.how  # the layers found and how (See Note [Layers without being told] in strata/layers.py)

A runtime given by the caller is used as it is: only its layers are added.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import torch

from . import _plan
from . import budget as _budget
from ._overlap import choose_overlap
from .distributed import is_dtensor, local
from .runtime import Runtime, parse_bytes


@dataclasses.dataclass
class Setup:
    runtime: Runtime
    owns_runtime: bool  # made here, so closed with the optimizer
    plan: list  # the layers added, each a list of (name, parameter) pairs
    how: str  # how they were found, for the INFO line
    budget: Optional[int]  # the GPU budget in bytes, None without one (or "auto")
    # Decided after the first step (See Note [The automatic budget] and Note [The undo on the GPU
    # when there is room] in strata/budget.py).
    auto_budget: bool
    auto_undo: bool
    depth_from: str  # "argument" or "the budget"


def device_for(name: str, first: torch.Tensor, device: Optional[str]) -> str:
    """The runtime's device for parameters like `first`: `device` when given, else the current CUDA
    device (which must be the parameters'), else the simulated device where no GPU exists."""
    if device is not None:
        return device
    if first.device.type == "cuda":
        # See Note [One CUDA device a runtime] in runtime/runtime.h.
        index = first.device.index
        current = torch.cuda.current_device()
        if index is not None and index != current:
            raise ValueError(
                f"strata.optim.{name}: the parameters are on cuda:{index} but the "
                f"current CUDA device is cuda:{current}; strata steps where torch computes: "
                f"call torch.cuda.set_device({index}) first (in a distributed script, "
                "torch.cuda.set_device(local_rank) before the model is made)"
            )
        return f"cuda:{current}"
    if torch.cuda.is_available() and os.environ.get("STRATA_DEVICE") != "simulated":
        raise ValueError(
            f"strata.optim.{name}: the parameters are on the CPU, but this machine has "
            "a GPU: move the model there first (model.cuda()), or pass device='simulated' "
            "(or set STRATA_DEVICE=simulated) to step in host memory that stands in for the "
            "GPU (for tests)"
        )
    return "simulated"


def make_runtime(
    name: str,
    trainable: list,
    param_name: dict,
    named: bool,
    *,
    moments: int,
    state_dtype: str,
    model: Optional[torch.nn.Module],
    policy: Optional[str],
    gpu_budget: Union[int, str, None],
    prefetch_depth: Optional[int],
    layer_bytes: Union[int, str, None],
    runtime: Optional[Runtime],
    overlap: Optional[str],
    undo_on_gpu: Optional[bool],
    hybrid_fraction: Optional[float],
    device: Optional[str],
) -> Setup:
    """The runtime for the optimizer `name` over `trainable` (every parameter on one device), with
    its layers added. `moments`: the states a parameter keeps besides a master (Lion 1, Adam 2,
    amsgrad 3)."""
    first = trainable[0]
    owns_runtime = runtime is None
    overlap_from = None
    if runtime is None:  # See Note [Overlap by default] in strata/_overlap.py
        replicated = (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
            and not any(is_dtensor(p) for p in trainable)
        )
        overlap, overlap_from = choose_overlap(
            overlap, policy, local(first).is_cuda and device != "simulated", replicated
        )
    # None until the first step has run (See Note [The automatic budget] in strata/budget.py).
    auto_budget = isinstance(gpu_budget, str) and gpu_budget.strip().lower() == "auto"
    budget = None if auto_budget else parse_bytes(gpu_budget, "gpu_budget")
    # Without a budget in bytes, where a step in backward keeps its undo is decided after the
    # first one (See Note [The undo on the GPU when there is room] in strata/budget.py).
    auto_undo = undo_on_gpu is None and budget is None and runtime is None and overlap == "backward"
    undo_on_gpu_given = undo_on_gpu
    if undo_on_gpu is None:
        undo_on_gpu = budget is not None
    unbound = [p for p in trainable if runtime is None or not runtime.is_bound(p)]
    plan, how = _plan.find_layers(
        unbound,
        param_name,
        named,
        parse_bytes(layer_bytes, "layer_bytes"),
        model,
        budget,
        moments,
        state_dtype,
    )
    depth_from = "argument"
    if runtime is None:
        if prefetch_depth is None:
            prefetch_depth = _plan.auto_depth(
                plan, budget, moments, state_dtype, overlap=overlap == "backward"
            )
            depth_from = "the budget"
        runtime = Runtime(
            policy=policy,
            gpu_budget=budget,
            prefetch_depth=prefetch_depth,
            device=device_for(name, first, device),
            overlap=overlap or "none",
            undo_on_gpu=undo_on_gpu,
            hybrid_fraction=hybrid_fraction,
        )
        runtime.undo_from = "default" if undo_on_gpu_given is None else "argument"
        runtime.overlap_from = overlap_from
    elif prefetch_depth is not None:
        raise ValueError(
            f"strata.optim.{name}: prefetch_depth comes from the runtime given; make "
            "the runtime with the depth wanted"
        )
    no_driver = None  # why the GPU's memory cannot be asked for, if it cannot
    if auto_undo or auto_budget:
        try:
            _budget.device_memory(runtime)
        except RuntimeError as e:
            no_driver = e
    if auto_undo:  # with no driver to ask, the undo stays off the GPU
        auto_undo = no_driver is None
        if auto_undo:
            runtime.undo_from = "undecided"
    if auto_budget:
        if no_driver is not None:
            raise ValueError(f"strata.optim.{name}: {no_driver}") from None
        runtime.budget_from = "auto"
    for layer in plan:
        runtime.add_layer(layer)
    return Setup(runtime, owns_runtime, plan, how, budget, auto_budget, auto_undo, depth_from)
