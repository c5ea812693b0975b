"""strata.attach: a model bound to a strata.Runtime, one strata layer per block, with the hooks
that tell the runtime where forward and backward are.

    rt = strata.Runtime(policy="layer_prefetch", gpu_budget="8GiB", roles="all")
    strata.attach(model, rt)    # the blocks found in the module tree are the layers; or name
                                # them: strata.attach(model, rt, layers=list(model.blocks))

The hooks see positional and keyword arguments alike; a layer's backward is known to be done once
autograd has the gradient of its input, and about to begin once an output's gradient is complete.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from .distributed import is_dtensor
from .layers import discover_layers
from .runtime import Runtime

_log = logging.getLogger("strata")


def _named_layers(model: torch.nn.Module, layers, prefetch_depth: int) -> list:
    if layers is None:
        return discover_layers(model, prefetch_depth)
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for m in layers:
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"strata.attach: layers must be modules, got {type(m).__name__}")
        if id(m) not in names:
            raise ValueError("strata.attach: a layer given is not a submodule of the model")
        out.append((names[id(m)], m))
    return out


def attach(model: torch.nn.Module, runtime: Runtime, layers: Optional[Iterable] = None) -> list:
    """Binds `model`'s parameters and gradients to `runtime`, one strata layer per module of
    `layers` (default: the blocks found in the module tree; See Note [Finding the blocks] in
    strata/layers.py), and installs the hooks that tell the runtime where forward and backward are,
    so a policy with roles="all" streams parameters and gradients through them. The hooks
    see positional and keyword arguments alike. A module without parameters of its own is no
    layer; parameters in no layer go to one last layer of their own. Returns the modules that
    became layers.

    One forward and one backward per optimizer step: no gradient accumulation over several
    backward passes while gradients stream. A forward that no step follows (an evaluation) keeps
    its layers held until the next optimizer step or close()."""
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "strata.attach: the model's parameters are DTensors (FSDP2); FSDP2 moves them itself. "
            "Pass them to strata.optim.AdamW, whose layers follow the fully_shard units"
        )
    named = _named_layers(model, layers, runtime.prefetch_depth)
    if not named:
        raise ValueError("strata.attach: the model has no layers (no child modules given or found)")
    seen, attached = set(), []
    for name, module in named:
        params = [(f"{name}.{n}" if n else name, p) for n, p in module.named_parameters()]
        params = [(n, p) for n, p in params if id(p) not in seen]
        if not params:  # an activation, or parameters another layer holds: nothing to stream
            continue
        seen.update(id(p) for _, p in params)
        layer = runtime.add_layer(params)
        runtime._hooks.append(
            module.register_forward_pre_hook(_pre_hook(runtime, layer), with_kwargs=True)
        )
        runtime._hooks.append(
            module.register_forward_hook(_post_hook(runtime, layer), with_kwargs=True)
        )
        attached.append(module)
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in seen]
    if rest:
        runtime.add_layer(rest)
    sizes = [sum(p.numel() for p in m.parameters()) for m in attached]
    _log.info(
        "strata.attach: %d layers from %s (largest %d parameters, %s)",
        len(attached) + (1 if rest else 0),
        "the layers given" if layers is not None else "the module tree",
        max(sizes) if sizes else 0,
        ", ".join(n for n, _ in named[:3]) + (", ..." if len(named) > 3 else ""),
    )
    return attached


def _pre_hook(runtime: Runtime, layer: int):
    def hook(module, args, kwargs):
        runtime._before_forward(layer)
        # Once autograd has the gradient of this layer's input, the layer's own gradients are in
        # (autograd runs AccumulateGrad first among ready nodes): its backward is done. The input
        # may come by keyword (hidden_states=... in Hugging Face's models).
        for a in _output_tensors((args, kwargs)):
            if a.requires_grad:
                a.register_hook(lambda g: runtime._after_backward(layer))
                break
        return None

    return hook


def _output_tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _output_tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _output_tensors(o)


def _post_hook(runtime: Runtime, layer: int):
    def hook(module, args, kwargs, output):
        # Once the gradient of an output is complete, autograd is about to run the layer's
        # backward: the runtime holds the layer first, so autograd never writes into a layer whose
        # data is still arriving. Layers whose backward does not follow the reverse order of
        # forward (two embeddings summed, parallel branches) need it; the first output to get its
        # gradient tells (See Note [Backward out of order] in policies/parameter_streaming.cpp).
        for t in _output_tensors(output):
            if t.requires_grad:
                t.register_hook(lambda g: runtime._before_backward(layer))
        return None

    return hook
