"""strata.optim's arguments: the checks made before anything is built (torch.optim.Adam's of the
hyperparameters, with its messages; strata's of its own arguments, each naming the fix), and each
parameter group's hyperparameters as strata's kernels read them (plain floats and flags).

    check_hyper(lr, betas, eps, weight_decay)   # torch's ValueError for a bad one
    hyper_of(group, decoupled)                  # {"lr", "beta1", "beta2", "eps", ...}
"""

from __future__ import annotations

import math

import torch


def check_hyper(lr, betas, eps, weight_decay) -> None:
    # torch.optim.Adam's checks and messages.
    if isinstance(lr, torch.Tensor):
        lr = lr.item()
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_arguments(
    name: str,
    amsgrad: bool,
    state_dtype: str,
    capturable: bool,
    differentiable: bool,
    max_grad_norm,
    runtime,
    overlap: str | None,
) -> None:
    """strata's checks of the optimizer's other arguments; `name` is the optimizer's ("AdamW")."""
    if state_dtype not in ("float32", "bfloat16", "int8"):
        raise ValueError(
            f"strata.optim.{name}: state_dtype={state_dtype!r} is not one strata stores "
            "moments in; use 'float32', 'bfloat16' or 'int8'"
        )
    if amsgrad and state_dtype != "float32":
        raise ValueError(
            f"strata.optim.{name}: amsgrad needs float32 moments; state_dtype is "
            f"{state_dtype!r}: use state_dtype='float32' or amsgrad=False"
        )
    for flag, value in (("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(
                f"strata.optim.{name}: {flag}=True is not supported: strata's step "
                "runs its own kernels outside autograd and CUDA graphs; leave it False"
            )
    if max_grad_norm is not None and not (
        float(max_grad_norm) > 0 and math.isfinite(max_grad_norm)
    ):
        raise ValueError(
            f"max_grad_norm: expected a positive number (None: no clipping), got {max_grad_norm!r}"
        )
    if overlap not in (None, "auto", "none", "backward"):
        raise ValueError(
            f"overlap={overlap!r}: use 'auto' (the default: see Note [Overlap by default] in "
            "strata/_overlap.py), 'backward' (each layer steps as soon as its backward is done) "
            "or 'none' (the optimizer steps after backward)"
        )
    if runtime is not None and overlap not in (None, "auto") and overlap != runtime.overlap:
        raise ValueError(
            f"overlap={overlap!r}, but the runtime given was made with overlap="
            f"{runtime.overlap!r}; make the runtime with the overlap wanted"
        )


def as_float(x) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def hyper_of(g: dict, decoupled: bool) -> dict:
    """A group's hyperparameters as the kernels read them; `decoupled` when the group does not
    say (AdamW's weight decay)."""
    return {
        "lr": as_float(g["lr"]),
        "beta1": as_float(g["betas"][0]),
        "beta2": as_float(g["betas"][1]),
        "eps": float(g["eps"]),
        "weight_decay": float(g["weight_decay"]),
        "decoupled": bool(g.get("decoupled_weight_decay", decoupled)),
        "amsgrad": bool(g["amsgrad"]),
        "maximize": bool(g["maximize"]),
    }
