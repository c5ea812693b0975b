"""strata.optim's state dicts, in torch.optim.AdamW's format: reading every parameter's states
from whichever tier holds them, and writing a loaded dict's states back.

    sd = state_dict(adam, runtime, param_groups, trainable_ids)
    load_state_dict(name, adam, runtime, param_groups, trainable_ids, sd)

`adam` is the optimizer's _strata.Adam, `runtime` its strata.Runtime, `trainable_ids` the ids of
its parameters that require grad, `name` its class's name ("AdamW") for the error messages.
"""

from __future__ import annotations

import math

import torch

from ._args import as_float
from .distributed import is_dtensor, local, sharded_like


def _read_state(adam, runtime, p: torch.Tensor) -> dict:
    """p's states as CPU float32 tensors shaped like p; for a DTensor, this rank's shards as
    DTensors sharded like p (the padding strata binds with them left out)."""
    bound, _ = runtime.bound_tensors(p)
    out = adam.read_state(bound)
    if not is_dtensor(p):
        return out
    n = local(p).numel()
    return {k: sharded_like(p, v.reshape(-1)[:n]) for k, v in out.items()}


def _write_state(adam, runtime, p: torch.Tensor, values: dict) -> None:
    bound, _ = runtime.bound_tensors(p)
    if is_dtensor(p):
        padded = {}
        for k, v in values.items():
            flat = torch.zeros(bound.numel(), dtype=torch.float32)
            flat[: v.numel()] = v.reshape(-1)
            padded[k] = flat
        values = padded
    adam.write_state(bound, values)


def state_dict(adam, runtime, param_groups: list, trainable_ids: set) -> dict:
    """strata.optim's state_dict() (its docstring says what it holds)."""
    runtime.wait_all()
    state, groups, index = {}, [], 0
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(index, index + len(g["params"])))
        for p in g["params"]:
            if id(p) not in trainable_ids:  # frozen: no state, as in torch
                index += 1
                continue
            # Every trainable parameter has its states from the start, unlike torch's
            # optimizers, and a state dict says so: torch.distributed.checkpoint.load fills
            # in only the entries the state dict it loads into already has. Each has its own
            # step count (See Note [Per-parameter steps] in optim/adam.h).
            steps = adam.step_count_of(runtime.bound_tensors(p)[0])
            entry = {"step": torch.tensor(float(steps), dtype=torch.float32)}
            entry.update(_read_state(adam, runtime, p))
            state[index] = entry
            index += 1
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def load_state_dict(
    name: str,
    adam,
    runtime,
    param_groups: list,
    trainable_ids: set,
    state_dict: dict,
    states: tuple = ("exp_avg", "exp_avg_sq"),
    before_writes=None,
) -> None:
    """strata.optim's load_state_dict(): everything is checked before anything changes. `states`
    are those the optimizer's step rule keeps for every parameter (max_exp_avg_sq added with
    amsgrad); an entry must have each, and no other optimizer's. `before_writes` runs once the
    checks pass, before any parameter is read or state written (a step taken in backward is taken
    back there, so that masters start from the parameters as they were before it)."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for mine, saved in zip(param_groups, saved_groups):
        if len(mine["params"]) != len(saved["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                "optimizer's group"
            )
        if bool(saved.get("amsgrad", False)) != bool(mine["amsgrad"]):
            raise ValueError(
                f"strata.optim.{name}: the state dict was saved with amsgrad="
                f"{saved.get('amsgrad')}; this optimizer has amsgrad={mine['amsgrad']}"
            )
    saved_state = state_dict["state"]
    plan = []  # (group, [(param, step, states)])
    for gi, (mine, saved) in enumerate(zip(param_groups, saved_groups)):
        entries = []
        for p, key in zip(mine["params"], saved["params"]):
            entry = saved_state.get(key, saved_state.get(str(key)))
            if entry is None or id(p) not in trainable_ids:
                continue
            step = as_float(entry["step"])
            if step != math.floor(step) or step < 0:
                raise ValueError(
                    f"strata.optim.{name}: step {step} of parameter {key} is not a count"
                )
            kept = states + (("max_exp_avg_sq",) if mine["amsgrad"] else ())
            for state in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if state in entry and state not in kept:
                    raise ValueError(
                        f"strata.optim.{name}: parameter {key} has state '{state}', which "
                        f"{name} does not keep: the state dict is another optimizer's"
                    )
                if state in kept and state not in entry:
                    raise ValueError(f"strata.optim.{name}: parameter {key} has no '{state}'")
            values = {}
            for state in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                if state in entry:
                    v = local(entry[state])  # a DTensor's part is this rank's shard
                    want = local(p)
                    if v.numel() != want.numel():
                        raise ValueError(
                            f"strata.optim.{name}: state '{state}' of parameter {key} "
                            f"has {v.numel()} elements; the parameter has {want.numel()}"
                            + (" on this rank" if is_dtensor(p) else "")
                        )
                    values[state] = v.detach().to("cpu", torch.float32).reshape(want.shape)
            entries.append((p, int(step), values))
        plan.append((gi, entries, saved))
    if before_writes is not None:
        before_writes()
    for _, entries, _ in plan:
        for p, _, values in entries:
            # A low-precision parameter's master copy not in the dict starts as the parameter. A
            # float32 parameter's (on the host only) is always the parameter's value: See Note
            # [Float32 masters follow the split] in optim/adam_placement.cpp. A parameter without
            # one ignores the key.
            if "master_param" not in values or p.dtype == torch.float32:
                values["master_param"] = local(p).detach().to("cpu", torch.float32)
    for gi, entries, saved in plan:
        for k, v in saved.items():
            if k != "params":
                param_groups[gi][k] = v
        for p, step, values in entries:
            adam.set_step_count_of(runtime.bound_tensors(p)[0], step)
            _write_state(adam, runtime, p, values)
