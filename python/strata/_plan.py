"""What a strata.optim optimizer chooses when it makes its own layout: the layers its parameters
are bound in, the prefetch depth from the budget, and the INFO line that says what was chosen.

    names, named = param_names(param_groups, model)
    plan, how = find_layers(params, names, named, layer_bytes, model, budget, moments, state_dtype)
    depth = auto_depth(plan, budget, moments, state_dtype, overlap=True)

`moments` counts the states a parameter keeps besides a master copy (Adam 2, 3 with amsgrad; Lion
1: See Note [Step rules] in optim/step_rule.h).

A plan is a list of layers, each a list of (name, parameter) in order, as Runtime.add_layer takes
them.
"""

from __future__ import annotations

import logging
import os
import warnings

from .distributed import fsdp_units, is_dtensor, local
from .layers import plan_layers, split_runs, state_bytes, state_chunk_bytes

_log = logging.getLogger("strata")


# Each parameter's name, by id: the user's (param_groups' "param_names", as named_parameters() gives
# them, else `model`'s), else "group{g}.param{i}"; and whether any was the user's
# (See Note [Layers without being told] in strata/layers.py).
def param_names(param_groups: list, model) -> tuple:
    names_by_id = {}
    named = False
    model_names = {}
    if model is not None:
        model_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for gi, g in enumerate(param_groups):
        names = g.get("param_names")
        for i, p in enumerate(g["params"]):
            name = names[i] if names is not None else model_names.get(id(p))
            named = named or name is not None
            names_by_id[id(p)] = name or f"group{gi}.param{i}"
    return names_by_id, named


# The layers of the parameters not bound yet (not attached; See Note [Layers without being told]
# in strata/layers.py). FSDP2 parameters (DTensors): one layer per fully_shard unit, cut in runs
# where a unit holds more states than a layer should, or more parameter bytes than layer_bytes;
# other parameters with layer_bytes given: runs of at most that many parameter bytes in order; else
# plan_layers. `names` maps id(p) to each parameter's name, `named` says whether they are the
# user's. Returns (layers, how they were found).
def find_layers(
    params: list,
    names: dict,
    named: bool,
    layer_bytes: int | None,
    model,
    budget: int | None,
    moments: int,
    state_dtype: str,
) -> tuple:
    def states(p):
        return state_bytes(p, state_dtype=state_dtype, moments=moments)

    def param_bytes(p):
        return local(p).numel() * local(p).element_size()

    units = fsdp_units()
    by_unit, rest = {}, []
    for p in params:
        pair = (names[id(p)], p)
        if is_dtensor(p) and id(p) in units:
            by_unit.setdefault(units[id(p)], []).append(pair)
        else:
            rest.append(pair)
    chunk = state_chunk_bytes(sum(states(p) for p in params), budget, 3)
    plan, how = [], []
    if by_unit:
        limit, size_of = (chunk, states) if layer_bytes is None else (layer_bytes, param_bytes)
        plan = [run for unit in by_unit.values() for run in split_runs(unit, limit, size_of)]
        how.append("FSDP2's fully_shard units")
        if len(plan) > len(by_unit):
            what = "layer_bytes" if layer_bytes else f"{chunk / 2**20:.0f} MiB of states"
            how[-1] += f", those past {what} cut in runs of parameters"
    if rest and layer_bytes is not None:
        plan += split_runs(rest, layer_bytes, param_bytes)
        how.append("layer_bytes")
    elif rest:
        more, found = plan_layers(
            rest, named, model, budget, 3, state_dtype=state_dtype, moments=moments, chunk=chunk
        )
        plan += more
        how.append(found)
    return plan, " and ".join(how)


def layer_state_bytes(layer: list, moments: int, state_dtype: str) -> int:
    return sum(state_bytes(p, state_dtype=state_dtype, moments=moments) for _, p in layer)


# Prefetch depth: the ring takes as many slots of the largest layer's states as a ring of depth 3
# would with float32 moments (four slots), so that compressed moments (a quarter or half the bytes)
# get more layers ahead for the same GPU memory (float32 parameters: depth 3 with float32 moments, 7
# bfloat16, 14 int8; a master counts too); past four slots, at most one a layer. Under overlap one
# of the slots drains (See Note [Draining slot] in policies/ring_plan.cpp), so the depth is one less
# for the same memory (2 with float32 moments), which the users' script measured as fast as depth 3
# with a slot draining (bench/results/2026-11-27-H200-f7e51cb-draining-slot/). With a budget, no
# more than fit beside the parameters (and FSDP2's gradients) strata keeps on the GPU, less the
# slot in use and the one draining, and at least 1. Other gradients stay torch's (See Note
# [Gradients given at each step] in optim/adam.h).
def auto_depth(
    plan: list, budget: int | None, moments: int, state_dtype: str, overlap: bool
) -> int:
    drain = 1 if overlap else 0
    if not plan:
        return 3 - drain
    slot = max(max(layer_state_bytes(layer, moments, state_dtype) for layer in plan), 1)
    float32 = max(layer_state_bytes(layer, moments, "float32") for layer in plan)
    slots = max(4, min(len(plan) + 1, 4 * float32 // slot))
    depth = slots - 1 - drain
    if budget is None:
        return depth
    resident = sum(
        (2 if is_dtensor(p) else 1) * local(p).numel() * local(p).element_size()
        for layer in plan
        for _, p in layer
    )
    return max(1, min(depth, (budget - resident) // slot - 1 - drain))


# The overlap and, under it, where a step in backward keeps its undo
# (See Note [The undo on the GPU when there is room] in strata/budget.py).
def overlap_line(runtime) -> str:
    chosen = [] if runtime.overlap_from == "argument" else [runtime.overlap_from]
    if runtime.overlap != "backward":
        return f"{runtime.overlap} ({chosen[0]})" if chosen else runtime.overlap
    if runtime.undo_from == "undecided":
        undo = "undo on the GPU or the host: decided after the first step"
    else:
        undo = f"undo on the {'GPU' if runtime._rt.undo_on_gpu() else 'host'}"
    return f"backward ({'; '.join(chosen + [undo])})"


# The INFO line of what was chosen, the step placement's line when the policy places steps, and a
# warning when one layer holds most of the states. `name` is the optimizer's ("AdamW"), `adam` its
# _strata.Adam, `budget` bytes, "auto" or None; called from the optimizer's constructor (the
# warning points at its caller).
def log_choice(
    name: str,
    runtime,
    adam,
    plan: list,
    how: str,
    policy: str | None,
    budget: int | str | None,
    depth_from: str,
    moments: int,
    state_dtype: str,
) -> None:
    if budget is None:
        budget = "none"
    elif not isinstance(budget, str):
        budget = f"{budget / 2**30:.2f} GiB"
    sizes = [layer_state_bytes(layer, moments, state_dtype) for layer in plan]
    total = max(sum(sizes), 1)
    largest = max(sizes) if sizes else 0
    source = (
        "argument" if policy else "STRATA_POLICY" if os.environ.get("STRATA_POLICY") else "default"
    )
    _log.info(
        "strata.optim.%s: policy %s (%s), %d layers from %s, largest layer's states %.1f MiB "
        "(%.0f%% of %.1f MiB, moments in %s), prefetch depth %d (%s), GPU budget %s, "
        "overlap %s",
        name,
        runtime.policy,
        source,
        len(plan),
        how or "the runtime's binding",
        largest / 2**20,
        100 * largest / total,
        total / 2**20,
        state_dtype,
        runtime.prefetch_depth,
        depth_from,
        budget,
        overlap_line(runtime),
    )
    if adam.placement():  # See Note [Step placement] in runtime/policy.h
        log_placement(name, adam.placement())
    if len(plan) and largest > total / 4 and total > (64 << 20):
        warnings.warn(
            f"strata.optim.{name}: one layer holds {100 * largest / total:.0f}% of the "
            "optimizer states, and the staging ring keeps that much of them on the GPU; pass "
            "model= or named_parameters() so that strata finds the blocks, or layer_bytes=",
            stacklevel=3,
        )


def log_placement(name: str, line: str) -> None:
    """The policy's line on where the optimizer steps: at construction, and again when measured
    steps move them (See Note [Measured split] in policies/split_search.h)."""
    _log.info("strata.optim.%s: %s", name, line)
