"""strata.optim.Adam and strata.optim.AdamW: drop-in torch.optim optimizers stepped by strata.

    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                             policy="layer_prefetch", gpu_budget="8GiB")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for batch in data:
        opt.zero_grad()
        loss_fn(model(batch)).backward()
        opt.step()
        sched.step()
    torch.save(opt.state_dict(), "opt.pt")   # torch.optim.AdamW's own format
    opt.close()                               # the parameters become ordinary tensors again

The math is torch's fused AdamW kernel's, in float32 with float64 hyperparameters; bfloat16 and
float16 parameters are stepped through float32 master weights (saved under "master_param").
state_dtype="bfloat16" or "int8" stores the moments compressed, on every tier and on the link
(See Note [Compressed moments] in optim/state_codec.h); the state dict holds them decoded to
float32, in torch's format, and loads back into the same bytes:

    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, policy="layer_prefetch",
                             state_dtype="int8")

Stepping during backward (overlap="backward"): each layer is stepped as soon as its gradients are
final, while backward goes on, and step() validates it; clipping then belongs to the optimizer
(max_grad_norm), since the norm is known only once backward ends:

    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, policy="layer_prefetch",
                             overlap="backward", max_grad_norm=1.0)
    loss.backward()                 # each layer (fully_shard unit) steps here
    opt.step()                      # validates: redoes the step if clipping triggered
    norm = opt.last_grad_norm       # as clip_grad_norm_ returns it

A user's loop as it is (Hugging Face Trainer's, nanoGPT's, a LoRA script's) trains as under
torch.optim.AdamW: model.zero_grad() and p.grad = ... are seen
(See Note [Gradients the loop replaced] in strata/runtime.py), frozen and unused parameters are
skipped (See Note [Per-parameter steps] in optim/adam.h), and torch.amp.GradScaler hands its scale
and found_inf to the kernel (See Note [GradScaler]):

    scaler = torch.amp.GradScaler()
    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    for batch in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        model.zero_grad()

Note [Stepping in backward under FSDP2]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A fully_shard unit's gradients are final once its reduce-scatter has accumulated into the sharded
gradients, where FSDP2 runs the parameters' post-accumulate-grad hooks, on the reduce-scatter
stream. The optimizer hooks every parameter; the last of a layer's hooks gives the runtime the
layer's after_backward on that stream (its part of the gradient norm), then Adam::step_layer
(See Note [Overlapped step] in optim/adam.h) on a stream of its own that waits for it
(See Note [The step stream] in bridge/model_hooks.cpp), so that the step's wait for the layer's
states holds up no reduce-scatter; step() joins that stream before it validates, and before the next
forward reads the parameters. A forward pre-hook on every unit begins the step, so the states of the
layers backward reaches first are fetched while forward runs. The speculation assumes that clipping
does not trigger; step() takes the norm over every layer and, across ranks, over the mesh, and
redoes the step when the clip coefficient is not 1 (See Note [Clipping in the step]). Steps with and
without overlap are bitwise equal, and equal to clip_grad_norm_ followed by the step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from typing import Optional, Union

import torch

from .distributed import (
    all_reduce_norm,
    clip_coef,
    fsdp_modules,
    fsdp_units,
    grad_norm,
    is_dtensor,
    local,
    sharded_like,
)
from . import budget as _budget
from .layers import plan_layers, state_bytes
from .runtime import Runtime
from .scalars import read_scalars

_log = logging.getLogger("strata")


def _check_hyper(lr, betas, eps, weight_decay):
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


def _as_float(x) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def _scalar_or_none(t) -> Optional[torch.Tensor]:
    # GradScaler's grad_scale / found_inf as the kernels read them: one contiguous float32 value.
    if t is None:
        return None
    return t.detach().reshape(()).to(torch.float32).contiguous()


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam, stepped by strata's runtime (see AdamW for the strata arguments)."""

    _decoupled = False
    _name = "Adam"

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        policy: Optional[str] = None,
        gpu_budget: Union[int, str, None] = None,
        prefetch_depth: Optional[int] = None,
        layer_bytes: Union[int, str, None] = None,
        runtime: Optional[Runtime] = None,
        overlap: Optional[str] = None,
        max_grad_norm: Optional[float] = None,
        undo_on_gpu: Optional[bool] = None,
        hybrid_fraction: Optional[float] = None,
        device: Optional[str] = None,
        model: Optional[torch.nn.Module] = None,
        state_dtype: str = "float32",
    ):
        _check_hyper(lr, betas, eps, weight_decay)
        if state_dtype not in ("float32", "bfloat16", "int8"):
            raise ValueError(
                f"strata.optim.{self._name}: state_dtype={state_dtype!r} is not one strata stores "
                "moments in; use 'float32', 'bfloat16' or 'int8'"
            )
        if amsgrad and state_dtype != "float32":
            raise ValueError(
                f"strata.optim.{self._name}: amsgrad needs float32 moments; state_dtype is "
                f"{state_dtype!r}: use state_dtype='float32' or amsgrad=False"
            )
        self._state_dtype = state_dtype
        for flag, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(
                    f"strata.optim.{self._name}: {flag}=True is not supported: strata's step "
                    "runs its own kernels outside autograd and CUDA graphs; leave it False"
                )
        if max_grad_norm is not None and not (
            float(max_grad_norm) > 0 and math.isfinite(max_grad_norm)
        ):
            raise ValueError(
                "max_grad_norm: expected a positive number (None: no clipping), got "
                f"{max_grad_norm!r}"
            )
        if runtime is not None and overlap is not None and overlap != runtime.overlap:
            raise ValueError(
                f"overlap={overlap!r}, but the runtime given was made with overlap="
                f"{runtime.overlap!r}; make the runtime with the overlap wanted"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=self._decoupled,
        )
        self._constructed = False
        super().__init__(params, defaults)
        self._constructed = True
        from . import _strata
        from .runtime import parse_bytes

        # A frozen parameter gets no state and is never touched (See Note [Per-parameter steps] in
        # optim/adam.h); it keeps its place in param_groups (and in the state dict's numbering).
        self._param_name = {}
        # Whether the user's names are known (See Note [Layers without being told]).
        self._named = False
        model_names = {}
        if model is not None:
            model_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names")
            for i, p in enumerate(g["params"]):
                name = names[i] if names is not None else model_names.get(id(p))
                self._named = self._named or name is not None
                self._param_name[id(p)] = name or f"group{gi}.param{i}"
        self._trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._trainable_ids = {id(p) for p in self._trainable}
        if not self._trainable:
            raise ValueError(
                f"strata.optim.{self._name}: no parameter requires grad, so there is nothing to "
                "step; pass the parameters being trained"
            )
        first = self._trainable[0]
        for p in self._trainable:
            if p.device != first.device:
                raise ValueError(
                    f"strata.optim.{self._name}: every parameter must be on one device; "
                    f"found {first.device} and {p.device}"
                )
        self._owns_runtime = runtime is None
        # None until the first step has run (See Note [The automatic budget] in strata/budget.py).
        self._auto_budget = isinstance(gpu_budget, str) and gpu_budget.strip().lower() == "auto"
        budget = None if self._auto_budget else parse_bytes(gpu_budget, "gpu_budget")
        if undo_on_gpu is None:  # on the GPU when a budget says how much room there is
            undo_on_gpu = budget is not None
        unbound = [p for p in self._trainable if runtime is None or not runtime.is_bound(p)]
        plan, how = self._plan(unbound, parse_bytes(layer_bytes, "layer_bytes"), model, budget)
        if runtime is None:
            depth_from = "argument"
            if prefetch_depth is None:
                prefetch_depth, depth_from = self._auto_depth(plan, budget), "the budget"
            runtime = Runtime(
                policy=policy,
                gpu_budget=budget,
                prefetch_depth=prefetch_depth,
                device=self._device_for(first, device),
                overlap=overlap or "none",
                undo_on_gpu=undo_on_gpu,
                hybrid_fraction=hybrid_fraction,
            )
        elif prefetch_depth is not None:
            raise ValueError(
                f"strata.optim.{self._name}: prefetch_depth comes from the runtime given; make "
                "the runtime with the depth wanted"
            )
        self._runtime = runtime
        if self._auto_budget:
            try:
                _budget.device_memory(runtime)
            except RuntimeError as e:
                raise ValueError(f"strata.optim.{self._name}: {e}") from None
            runtime.budget_from = "auto"
        for layer in plan:
            runtime.add_layer(layer)
        groups = []
        for g in self.param_groups:
            pairs = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                param_t, grad_t = runtime.bound_tensors(p)
                if grad_t is None and id(p) in runtime._given:
                    pairs.append((param_t, None))  # See Note [Gradients given at each step]
                    continue
                if grad_t is None:
                    raise ValueError(
                        f"strata.optim.{self._name}: {self._param_name[id(p)]} requires grad "
                        "but was frozen when it was attached, so strata holds no gradient for "
                        "it; attach the model after setting requires_grad"
                    )
                pairs.append((param_t, grad_t))
            groups.append((pairs, self._hyper(g)))
        self._adam = _strata.Adam(runtime._rt, groups, 0, state_dtype)
        runtime._before_layer_done = self._prepare_layer
        if self._owns_runtime:
            budget_text = (
                "auto"
                if self._auto_budget
                else ("none" if budget is None else f"{budget / 2**30:.2f} GiB")
            )
            self._log_choice(plan, how, policy, budget_text, depth_from)
        self._versions: dict = {}  # See Note [Gradients changed after their layer stepped]
        self._accumulating = False
        self._spec_scale: Optional[torch.Tensor] = None
        self._keep_alive: tuple = ()
        self._hypers = [self._hyper(g) for g in self.param_groups]
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.last_step_outcome: Optional[str] = None
        self.steps_redone = 0
        self._grad_hooks: list = []
        self._closed = False
        self._speculating = False  # See Note [When to step in backward]
        self._spec_wait, self._spec_backoff = 0, 0
        self._coef_host: Optional[torch.Tensor] = None  # See Note [When to step in backward]
        self._coef_ready = None
        if runtime.overlap == "backward":
            self._set_speculating(True)
            if not runtime._hooks:  # strata.attach's hooks tell where backward is otherwise
                self._hook_gradients()

    def _device_for(self, first: torch.Tensor, device: Optional[str]) -> str:
        if device is not None:
            return device
        if first.device.type == "cuda":
            return "cuda"
        if torch.cuda.is_available() and os.environ.get("STRATA_DEVICE") != "simulated":
            raise ValueError(
                f"strata.optim.{self._name}: the parameters are on the CPU, but this machine has "
                "a GPU: move the model there first (model.cuda()), or pass device='simulated' "
                "(or set STRATA_DEVICE=simulated) to step in host memory that stands in for the "
                "GPU (for tests)"
            )
        return "simulated"

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", True):
            raise NotImplementedError(
                f"strata.optim.{self._name}: add_param_group after construction is not "
                "supported (strata lays out every state when the optimizer is made); make a new "
                "optimizer with every group"
            )
        super().add_param_group(param_group)

    # For a layer about to be stepped in backward (or, without overlap, whose backward is done): its
    # gradients are strata's again, and its parameters without one sit the step out
    # (See Note [Gradients the loop replaced] in strata/runtime.py). The version of each gradient
    # the layer's step read is kept (See Note [Gradients changed after their layer stepped]).
    def _prepare_layer(self, layer: int) -> None:
        if self._closed or self._accumulating:
            return
        if not self._adam.overlapped_step_open():
            self._sync_hyper()  # the step begins: with the hyperparameters as they are now
        skipped = []
        for p in self._runtime._layer_users[layer]:
            if id(p) not in self._param_name:
                continue  # another optimizer's
            if self._runtime._take_gradient(p, self._param_name[id(p)]):
                self._versions[id(p)] = (p.grad, local(p.grad)._version)
            else:
                skipped.append(self._runtime.bound_tensors(p)[0])
        if skipped:
            self._adam.skip_parameters(skipped)
        self._give_gradients(self._runtime._layer_users[layer])

    # Each group's hyperparameters as they are now (an LR scheduler's changes included); whether any
    # changed. A step taken in backward read them when it began: one that changed since is taken
    # back and redone, as for a gradient (See Note [Gradients changed after their layer stepped]).
    def _sync_hyper(self) -> bool:
        changed = False
        for i, g in enumerate(self.param_groups):
            h = self._hyper(g)
            if h != self._hypers[i]:
                _check_hyper(h["lr"], (h["beta1"], h["beta2"]), h["eps"], h["weight_decay"])
                self._adam.set_hyper(i, h)
                self._hypers[i] = h
                changed = True
        return changed

    # Note [Gradients changed after their layer stepped]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A layer stepped in backward read its gradients then; a loop that changes them afterwards (its
    # own clip_grad_norm_, unscale_, manual scaling: all in place, each a new version of the tensor,
    # or a new tensor) makes that step stale, and step() takes it back and steps again with the
    # gradients as they are. GradScaler.step (when the loop did not unscale_) checks the gradients
    # for inf by multiplying them by 1.0 in place first: one version each, no value changed,
    # allowed.
    def _gradients_changed(self, scaler_checked: bool) -> bool:
        allowed = 1 if scaler_checked else 0
        for p in self._trainable:
            seen = self._versions.get(id(p))
            if seen is None:
                continue
            grad, version = seen
            if p.grad is not grad or local(p.grad)._version - version > allowed:
                return True
        return False

    # The gradients of every parameter as the loop left them
    # (See Note [Gradients the loop replaced]); returns the bound parameters that have none this
    # step.
    def _take_gradients(self) -> list:
        self._check_frozen()
        skipped = []
        for p in self._trainable:
            if not self._runtime._take_gradient(p, self._param_name[id(p)]):
                skipped.append(self._runtime.bound_tensors(p)[0])
        return skipped

    def _check_frozen(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in self._trainable_ids and p.grad is not None:
                    raise RuntimeError(
                        f"strata.optim.{self._name}: {self._param_name[id(p)]} was frozen "
                        "(requires_grad=False) when the optimizer was made, so it has no state, "
                        "but it has a gradient now; make the optimizer after unfreezing it, or "
                        "set its .grad to None"
                    )

    # The gradients strata does not bind are read where autograd put them; each step is told where
    # (See Note [Gradients given at each step] in optim/adam.h). They stay alive until the kernels
    # have run: they are p.grad until the loop's zero_grad, which comes after step(), and torch
    # reuses their memory only on its stream, where strata's kernels run (or join) first.
    def _give_gradients(self, params) -> None:
        given = self._runtime._given
        pairs = []
        for p in params:
            if id(p) not in given or id(p) not in self._trainable_ids or p.grad is None:
                continue
            g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            self._keep_alive += (g,)
            pairs.append((self._runtime.bound_tensors(p)[0], g))
        if pairs:
            self._adam.set_gradients(pairs)

    @contextlib.contextmanager
    def accumulate(self):
        """Gradient accumulation under overlap="backward": the backward passes run inside this
        context only accumulate; the step is taken in the backward after it, over the summed
        gradients. Without overlap it changes nothing (gradients accumulate anyway).

            for micro in batches[:-1]:
                with opt.accumulate():
                    loss_fn(model(micro)).backward()
            loss_fn(model(batches[-1])).backward()   # each layer steps here
            opt.step()
        """
        if self._runtime.overlap != "backward" or self._accumulating:
            yield
            return
        self._accumulating = True
        speculating = self._speculating
        self._set_speculating(False)
        try:
            yield
        finally:
            self._accumulating = False
            self._set_speculating(speculating)

    def _set_speculating(self, on: bool) -> None:
        self._speculating = on
        self._adam.set_step_in_backward(on)

    # Note [When to step in backward]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A step taken in backward and then redone (clipping fired, inf was found, the loop changed a
    # gradient) costs more than the step after backward: the work in backward, the roll-back, and
    # the whole step again. Early in training, or with a tight max_grad_norm, clipping fires at
    # every step, and stepping in backward would make every step slower. So after a step is redone,
    # the next steps are taken after backward (1, then 2, 4, ... up to 64 after redone tries in a
    # row), then stepping in backward is tried again; a try that holds resets the wait. With
    # max_grad_norm, the try waits further while the last step's clipping fired, or while that is
    # not known yet: its coefficient is copied to the host without a wait (_note_clip) and read once
    # the copy is done, so a run in which clipping fires at every step steps after backward at every
    # step but the first, with no host wait added. last_step_outcome says what each step was.
    def _adapt_speculation(self) -> None:
        if self._spec_wait > 0:  # this step was taken after backward by choice
            self._spec_wait -= 1
            if self._spec_wait == 0:
                if self._max_grad_norm is not None and self._clipping_fired_last() is not False:
                    self._spec_wait = 1  # ask again after the next step
                    return
                self._set_speculating(True)
            return
        if self.last_step_outcome == "redone":
            if self._spec_backoff == 0:
                _log.info(
                    "strata.optim.%s: a step taken in backward was redone (clipping fired, inf "
                    "was found, or the loop changed a gradient); the next steps run after backward "
                    "for a while (Note [When to step in backward])",
                    self._name,
                )
            self._spec_backoff = min(2 * self._spec_backoff, 64) if self._spec_backoff else 1
            self._spec_wait = self._spec_backoff
            self._set_speculating(False)
        elif self.last_step_outcome == "speculation":
            self._spec_backoff = 0

    # The last clip coefficient, on its way to the host (See Note [When to step in backward]).
    def _note_clip(self, coef: torch.Tensor) -> None:
        if self._runtime.overlap != "backward":
            return
        if coef.device.type != "cuda":
            self._coef_host, self._coef_ready = coef.detach().clone(), None
            return
        if self._coef_host is None or self._coef_host.dtype != coef.dtype:
            self._coef_host = torch.empty((), dtype=coef.dtype, pin_memory=True)
            self._coef_ready = torch.cuda.Event()  # made once, recorded again at each step
        self._coef_host.copy_(coef.reshape(()), non_blocking=True)
        self._coef_ready.record()

    # Whether the last step's clipping fired: None while its coefficient is not on the host yet.
    def _clipping_fired_last(self) -> Optional[bool]:
        if self._coef_host is None or (self._coef_ready and not self._coef_ready.query()):
            return None
        return float(self._coef_host) < 1.0

    # A layer is done once every parameter of it has had its post-accumulate-grad hook this step
    # (See Note [Stepping in backward under FSDP2]).
    def _hook_gradients(self) -> None:
        self._layer_size, self._layer_seen = {}, {}
        params = list(self._trainable)
        for p in params:
            layer = self._runtime._layer_of.get(id(p))
            if layer is None:
                continue  # bound by its owner under another name: stepped after backward
            self._layer_size[layer] = self._layer_size.get(layer, 0) + 1
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(layer)))
        units = fsdp_modules()
        modules = {id(units[id(p)]): units[id(p)] for p in params if id(p) in units}
        for m in modules.values():
            self._grad_hooks.append(m.register_forward_pre_hook(self._begin_step))

    def _begin_step(self, *_) -> None:
        # The first unit's forward: the states backward needs first start coming now.
        if not self._closed and not self._runtime._rt.in_step():
            self._runtime._rt.begin_step()

    def _grad_hook(self, layer: int):
        def hook(_param):
            if self._accumulating:
                return
            seen = self._layer_seen.get(layer, 0) + 1
            if seen > self._layer_size[layer]:
                self._abandon_backward()
                raise RuntimeError(
                    f"strata.optim.{self._name}: layer {layer}'s gradients were accumulated "
                    "twice before step(); with overlap='backward' each layer is stepped in its "
                    "backward, so a step has one backward (under FSDP2, micro-batches before the "
                    "last run with set_requires_gradient_sync(False)); run the backward passes "
                    "before the last inside `with opt.accumulate():`, or use overlap='none'. "
                    "The layers stepped in the first backward were rolled back; zero the "
                    "gradients and go on"
                )
            self._layer_seen[layer] = seen
            if seen == self._layer_size[layer]:
                self._begin_step()
                self._runtime._after_backward(layer)

        return hook

    # Takes back what the step's backward stepped and ends the runtime's step with no optimizer
    # step, so that training can go on from the parameters as they were before it.
    def _abandon_backward(self) -> None:
        self._runtime._rt.join_step_stream()  # what is taken back must have been written
        self._adam.cancel_step()
        self._adam.clear_skipped()
        self._adam.set_step_in_backward(False)
        try:
            self._runtime._rt.finish_backward()
            self._runtime._rt.end_step()
        finally:
            self._adam.set_step_in_backward(True)
            self._layer_seen = {}
            self._versions = {}

    # Note [Clipping in the step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With the gradients resting on the GPU (the policy streams the optimizer's states only),
    # clipping is clip_grad_norm_'s: its norm (over the mesh under FSDP2) and the gradients scaled
    # in place before the step, with no host wait. After a step taken in backward, whether the
    # coefficient is below 1 is read on the host (a few bytes, as validating a speculation needs
    # anyway); if it is, that step is taken back (cancel_step) before the scaling, so a clipped step
    # is bitwise torch's clipped step too. Gradients that stream with the parameters are on their
    # way home by now (scaling them there would be lost when the move lands, and slow): their norms
    # were taken in backward, and the kernel divides them by 1 / coefficient (equal to the last bit
    # or so). Returns (the scale finish_step divides by, whether a step taken in backward was taken
    # back); the total norm is kept in last_grad_norm.
    # With GradScaler's scale (grad_scale, not unscaled by the loop), the norm is the unscaled
    # gradients'.
    def _clip(self, grad_scale: Optional[torch.Tensor]) -> tuple:
        params = [p for p in self._trainable if p.grad is not None]
        if not self._runtime._streams_gradients:
            total, grads = grad_norm(params)
            if grad_scale is not None:
                total = total / grad_scale.to(total.device).reshape(())
            self.last_grad_norm = total
            coef = clip_coef(total, self._max_grad_norm)
            self._note_clip(coef)
            taken_back = self._adam.overlapped_step_open()
            if taken_back:
                # Not .item(): that copy would queue behind the write-backs of the layers
                # stepped last (strata.read_scalars).
                if read_scalars(coef)[0] >= 1.0:
                    return None, False  # no clipping: what backward stepped stands
                self._adam.cancel_step()
            torch._foreach_mul_(grads, coef.to(grads[0].device))
            return None, taken_back
        total = all_reduce_norm(self._runtime._rt.total_norm(), params)
        if grad_scale is not None:
            total = total / grad_scale.to(total.device).reshape(())
        self.last_grad_norm = total
        coef = clip_coef(total, self._max_grad_norm)
        self._note_clip(coef)
        return (torch.ones_like(coef, dtype=torch.float32) / coef).contiguous(), False

    # The layers of the parameters not bound yet (not attached; See Note [Layers without being told]
    # in strata/layers.py). FSDP2 parameters (DTensors): one layer per fully_shard unit; layer_bytes
    # given: runs of about that many parameter bytes in order; else plan_layers. Returns (layers,
    # how they were found).
    def _plan(self, params: list, layer_bytes: Optional[int], model, budget) -> tuple:
        units = fsdp_units() if layer_bytes is None else {}
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        by_unit, rest = {}, []
        for p in params:
            named = (self._param_name[id(p)], p)
            if is_dtensor(p) and id(p) in units:
                by_unit.setdefault(units[id(p)], []).append(named)
            else:
                rest.append(named)
        plan, how = list(by_unit.values()), ["FSDP2's fully_shard units"] if by_unit else []
        if rest and layer_bytes is not None:
            pending, size = [], 0
            for named in rest:
                pending.append(named)
                size += named[1].numel() * named[1].element_size()
                if size >= layer_bytes:
                    plan.append(pending)
                    pending, size = [], 0
            if pending:
                plan.append(pending)
            how.append("layer_bytes")
        elif rest:
            more, found = plan_layers(
                rest, self._named, model, budget, 3, amsgrad, self._state_dtype
            )
            plan += more
            how.append(found)
        return plan, " and ".join(how)

    # Sets the budget after the first step (See Note [The automatic budget] in strata/budget.py).
    def _set_auto_budget(self) -> None:
        rt = self._runtime
        mem = _budget.device_memory(rt)
        budget, headroom = _budget.auto_budget(mem, rt.stats()["gpu_reserved_bytes"])
        rt._rt.set_gpu_budget(budget)
        layers = {}
        for t in rt._rt.tensors():
            if t["role"] not in ("parameter", "gradient") and t["bytes"]:
                layers[t["layer"]] = layers.get(t["layer"], True) and t["tier"] == "gpu"
        _log.info(
            "strata.optim.%s: gpu_budget auto: %s",
            self._name,
            _budget.describe(mem, budget, headroom, sum(layers.values()), len(layers)),
        )

    def _layer_state_bytes(self, layer: list) -> int:
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        return sum(state_bytes(p, amsgrad, self._state_dtype) for _, p in layer)

    # Prefetch depth from the budget: 3 without one; with one, as many slots of the largest layer's
    # states as fit beside the parameters (and FSDP2's gradients) strata keeps on the GPU, less one,
    # between 1 and 3. Other gradients stay torch's (See Note [Gradients given at each step]).
    def _auto_depth(self, plan: list, budget: Optional[int]) -> int:
        if budget is None or not plan:
            return 3
        slot = max(self._layer_state_bytes(layer) for layer in plan)
        resident = sum(
            (2 if is_dtensor(p) else 1) * local(p).numel() * local(p).element_size()
            for layer in plan
            for _, p in layer
        )
        return max(1, min(3, (budget - resident) // max(slot, 1) - 1))

    def _log_choice(self, plan: list, how: str, policy, budget: str, depth_from: str) -> None:
        sizes = [self._layer_state_bytes(layer) for layer in plan]
        total = max(sum(sizes), 1)
        largest = max(sizes) if sizes else 0
        source = (
            "argument"
            if policy
            else "STRATA_POLICY"
            if os.environ.get("STRATA_POLICY")
            else "default"
        )
        rt = self._runtime
        _log.info(
            "strata.optim.%s: policy %s (%s), %d layers from %s, largest layer's states %.1f MiB "
            "(%.0f%% of %.1f MiB, moments in %s), prefetch depth %d (%s), GPU budget %s, "
            "overlap %s",
            self._name,
            rt.policy,
            source,
            len(plan),
            how or "the runtime's binding",
            largest / 2**20,
            100 * largest / total,
            total / 2**20,
            self._state_dtype,
            rt.prefetch_depth,
            depth_from,
            budget,
            rt.overlap,
        )
        if self._adam.placement():  # See Note [Step placement] in runtime/policy.h
            _log.info("strata.optim.%s: %s", self._name, self._adam.placement())
        if len(plan) and largest > total / 4 and total > (64 << 20):
            warnings.warn(
                f"strata.optim.{self._name}: one layer holds {100 * largest / total:.0f}% of the "
                "optimizer states, and the staging ring keeps that much of them on the GPU; pass "
                "model= or named_parameters() so that strata finds the blocks, or layer_bytes=",
                stacklevel=3,
            )

    @property
    def placement(self) -> dict:
        """Where the optimizer steps (See Note [Step placement] in runtime/policy.h): the policy's
        line ("" when it places no steps), the layers stepped on the host, the host kernel's
        threads, how the moments are stored, and the rates the placement was made from (None
        without one)."""
        self._check_open()
        return {
            "line": self._adam.placement(),
            "host_layers": list(self._adam.host_layers()),
            "host_threads": self._adam.host_threads(),
            "state_dtype": self._state_dtype,
            "rates": self._adam.step_rates(),
        }

    def _hyper(self, g: dict) -> dict:
        return dict(
            lr=_as_float(g["lr"]),
            beta1=_as_float(g["betas"][0]),
            beta2=_as_float(g["betas"][1]),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            decoupled=bool(g.get("decoupled_weight_decay", self._decoupled)),
            amsgrad=bool(g["amsgrad"]),
            maximize=bool(g["maximize"]),
        )

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"strata.optim.{self._name}: the optimizer was closed")

    # Note [GradScaler]
    # ~~~~~~~~~~~~~~~~~
    # torch.amp.GradScaler sees _step_supports_amp_scaling and, instead of unscaling the gradients
    # and reading found_inf on the host, sets the optimizer's grad_scale (None when the loop called
    # scaler.unscale_ itself) and found_inf, device tensors, for the step to divide by and to skip
    # on, as torch's fused AdamW does: no host wait. A step that found_inf skips changes nothing
    # (parameters, states, step counts), under overlap too: the layers stepped in backward are taken
    # back (See Note [Overlapped step] in optim/adam.h).
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter that has a gradient (torch skips the others, and so does
        strata), with each group's hyperparameters as they are now (an LR scheduler's changes
        included); returns closure()'s loss when given a closure. Under GradScaler.step the scale
        and found_inf come from the scaler (See Note [GradScaler])."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        open_before = self._adam.overlapped_step_open()
        hyper_changed = self._sync_hyper()
        grad_scale = _scalar_or_none(getattr(self, "grad_scale", None))
        found_inf = _scalar_or_none(getattr(self, "found_inf", None))
        rt = self._runtime._rt
        # Before finish_backward, which steps (under overlap) the layers backward left: what they
        # step must be the loop's gradients, and their parameters without one must sit out.
        changed = open_before and (hyper_changed or self._gradients_changed(grad_scale is not None))
        skipped = self._take_gradients()
        if skipped:
            self._adam.skip_parameters(skipped)
        self._give_gradients(self._trainable)
        rt.finish_backward()
        taken_back = False
        if changed:
            self._adam.cancel_step()  # See Note [Gradients changed after their layer stepped]
            taken_back = True
        scale = grad_scale
        if self._max_grad_norm is not None:
            clip_scale, clipped_back = self._clip(grad_scale)
            taken_back = taken_back or clipped_back
            if clip_scale is not None:
                scale = clip_scale if grad_scale is None else (grad_scale * clip_scale).reshape(())
        # What the kernels read stays alive until they have run (the next step).
        self._keep_alive += (grad_scale, found_inf, scale)
        self.last_step_outcome = self._adam.finish_step(scale, found_inf)
        if taken_back:
            self.last_step_outcome = "redone"
        self.steps_redone += self.last_step_outcome == "redone"
        rt.end_step()
        if self._auto_budget:
            self._auto_budget = False
            self._set_auto_budget()
        self._keep_alive = (grad_scale, found_inf, scale)
        self._versions = {}
        if self._grad_hooks:
            self._layer_seen = {}
        if self._runtime.overlap == "backward":
            self._adapt_speculation()
        if self._runtime.overlap == "backward" and grad_scale is not None:
            # The next step's layers stepped in backward divide by this scale; it holds unless
            # GradScaler.update changes it (See Note [GradScaler]).
            self._spec_scale = grad_scale.detach().clone()
            self._adam.set_speculative_scale(self._spec_scale)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: set_to_none drops every gradient (a parameter that then gets none in
        backward sits the next step out, as in torch); autograd accumulates the next gradient into
        strata's memory again (See Note [Gradients the loop replaced] in strata/runtime.py).
        set_to_none=False zeroes them in place, wherever strata keeps them."""
        bound, dtensors = [], []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if self._runtime.is_bound(p.grad) and is_dtensor(p):
                    bound.append(p.grad)
                    dtensors.append(p)  # kept for FSDP2 (See Note [Gradients the loop replaced])
                elif set_to_none:
                    p.grad = None
                elif self._runtime.is_bound(p.grad):
                    bound.append(p.grad)
                else:
                    p.grad.zero_()
        if bound:
            self._runtime.zero_(*bound)
        for p in dtensors:
            if set_to_none:
                self._runtime._zeroed[id(p)] = local(p.grad)._version

    # --- checkpoints in torch.optim.AdamW's format ---
    def _read_state(self, p: torch.Tensor) -> dict:
        """p's states as CPU float32 tensors shaped like p; for a DTensor, this rank's shards as
        DTensors sharded like p (the padding strata binds with them left out)."""
        bound, _ = self._runtime.bound_tensors(p)
        out = self._adam.read_state(bound)
        if not is_dtensor(p):
            return out
        n = local(p).numel()
        return {k: sharded_like(p, v.reshape(-1)[:n]) for k, v in out.items()}

    def _write_state(self, p: torch.Tensor, values: dict) -> None:
        bound, _ = self._runtime.bound_tensors(p)
        if is_dtensor(p):
            padded = {}
            for k, v in values.items():
                flat = torch.zeros(bound.numel(), dtype=torch.float32)
                flat[: v.numel()] = v.reshape(-1)
                padded[k] = flat
            values = padded
        self._adam.write_state(bound, values)

    def state_dict(self) -> dict:
        """torch.optim's state dict: {"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "max_exp_avg_sq"][, "master_param"]}}, "param_groups": [...]}, tensors on the CPU, read
        from whichever tier holds them (one tensor at a time); for DTensor parameters (FSDP2) this
        rank's shards as DTensors sharded like them. Before the first step the states are there
        too, at step 0 and zero."""
        self._check_open()
        self._runtime.wait_all()
        state, groups, index = {}, [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                if id(p) not in self._trainable_ids:  # frozen: no state, as in torch
                    index += 1
                    continue
                # Every trainable parameter has its states from the start, unlike torch's
                # optimizers, and a state dict says so: torch.distributed.checkpoint.load fills
                # in only the entries the state dict it loads into already has. Each has its own
                # step count (See Note [Per-parameter steps] in optim/adam.h).
                steps = self._adam.step_count_of(self._runtime.bound_tensors(p)[0])
                entry = {"step": torch.tensor(float(steps), dtype=torch.float32)}
                entry.update(self._read_state(p))
                state[index] = entry
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of torch.optim.Adam / AdamW (or of this class): hyperparameters of
        every group, step counters and states. Everything is checked before anything changes."""
        self._check_open()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for mine, saved in zip(self.param_groups, saved_groups):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of "
                    "optimizer's group"
                )
            if bool(saved.get("amsgrad", False)) != bool(mine["amsgrad"]):
                raise ValueError(
                    f"strata.optim.{self._name}: the state dict was saved with amsgrad="
                    f"{saved.get('amsgrad')}; this optimizer has amsgrad={mine['amsgrad']}"
                )
        saved_state = state_dict["state"]
        plan = []  # (group, [(param, step, states)])
        for gi, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            entries = []
            for p, key in zip(mine["params"], saved["params"]):
                entry = saved_state.get(key, saved_state.get(str(key)))
                if entry is None or id(p) not in self._trainable_ids:
                    continue
                step = _as_float(entry["step"])
                if step != math.floor(step) or step < 0:
                    raise ValueError(
                        f"strata.optim.{self._name}: step {step} of parameter {key} is not a count"
                    )
                values = {}
                for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                    if name in entry:
                        v = local(entry[name])  # a DTensor's part is this rank's shard
                        want = local(p)
                        if v.numel() != want.numel():
                            raise ValueError(
                                f"strata.optim.{self._name}: state '{name}' of parameter {key} "
                                f"has {v.numel()} elements; the parameter has {want.numel()}"
                                + (" on this rank" if is_dtensor(p) else "")
                            )
                        values[name] = v.detach().to("cpu", torch.float32).reshape(want.shape)
                # A master copy (a low-precision parameter's, or a float32 one stepped on the host:
                # Note [Host-stepped layers]) not in the dict starts as the parameter; a parameter
                # without one ignores the key.
                if "master_param" not in values:
                    values["master_param"] = local(p).detach().to("cpu", torch.float32)
                entries.append((p, int(step), values))
            plan.append((gi, entries, saved))
        for gi, entries, saved in plan:
            for k, v in saved.items():
                if k != "params":
                    self.param_groups[gi][k] = v
            for p, step, values in entries:
                self._adam.set_step_count_of(self._runtime.bound_tensors(p)[0], step)
                self._write_state(p, values)

    def close(self) -> list:
        """Frees the optimizer's states; when it made its own runtime, also unbinds the
        parameters and gradients (their values back in memory torch owns) and returns the
        runtime's leak report, empty when nothing leaked."""
        if self._closed:
            return []
        self._closed = True
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        self._runtime.wait_all()
        self._adam = None
        if self._owns_runtime:
            return self._runtime.close()
        return []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AdamW(Adam):
    """torch.optim.AdamW, stepped by strata's runtime.

    Args (torch's): params (tensors or param-group dicts), lr, betas, eps, weight_decay, amsgrad,
        maximize. Every group's hyperparameters are read at every step, so torch's LR schedulers
        work unchanged. foreach and fused are accepted and change nothing: strata's own fused
        kernel steps either way (its math is torch's fused AdamW's). capturable=True and
        differentiable=True raise ValueError. add_param_group after construction raises.
        As in torch, a parameter with requires_grad=False gets no state and is never touched,
        and one whose .grad is None at a step sits that step out (no decay, its own step count
        unchanged); the loop may drop or replace gradients as it likes (model.zero_grad(),
        p.grad = ...): strata steps what autograd produced. GradScaler passes its scale and
        found_inf straight to the kernel.
    Args (strata's):
        policy: "keep_on_gpu", "bulk", "layer_prefetch" or "hybrid" (some layers stepped on the
            host); None: STRATA_POLICY, else the default.
        gpu_budget: bytes or a size such as "8GiB" that strata may take on the GPU; "auto": set
            after the first step to what the GPU has free less torch's headroom, so that as many
            layers' states as fit stay on the GPU (See Note [The automatic budget] in
            strata/budget.py); None (default): no budget, every layer's states stream.
        prefetch_depth: layers layer_prefetch brings ahead of use; None: from the budget (3
            without one, else as many as fit, 1 to 3).
        layer_bytes: None (default): strata finds its layers (See Note [Layers without being told]
            in strata/layers.py): FSDP2's units, the blocks of `model` when given, the blocks in the
            parameters' names when named_parameters() is passed, else runs of parameters sized from
            the budget; else layers of about this many parameter bytes, in order.
        model: the module the parameters come from, so that layers follow its blocks.
        runtime: a strata.Runtime to use (e.g. with the model attached) instead of one of the
            optimizer's own; policy, gpu_budget, prefetch_depth, overlap and undo_on_gpu then come
            from it.
        overlap: "none" (default): the step runs in step(); "backward": each layer steps during
            backward once its gradients are final, validated by step() (see the module's doc).
        max_grad_norm: clip the gradients by their global 2-norm (over every rank under FSDP2)
            inside the step, as clip_grad_norm_ would before it; the norm is in last_grad_norm.
            None: no clipping. Needed for clipping with overlap="backward".
        undo_on_gpu: with overlap, keep the bytes a redo needs of tensors resting on the GPU
            (parameters, FSDP2's float32 shards) on the GPU while the budget has room, instead
            of copying them to pinned host memory over the link. None (default): on when a
            gpu_budget in bytes is given (without one nothing bounds the copies).
        state_dtype: how the moments (exp_avg, exp_avg_sq) are stored: "float32" (default),
            "bfloat16" (stochastically rounded) or "int8" (a float32 scale per block of 256), on
            every tier and on the link; the step is float32 either way, and the state dict holds
            them decoded to float32 (See Note [Compressed moments] in optim/state_codec.h).
            Compressed moments take no amsgrad.
        hybrid_fraction: with policy="hybrid", the share of parameters whose step runs on the
            GPU (the rest on the host, their states in pinned memory); None: the cost model
            chooses from rates measured at setup, and an INFO line says what it chose.
        device: None (default): the parameters' GPU; CPU parameters on a machine with a GPU
            raise ValueError (move the model first); "simulated" (or the environment variable
            STRATA_DEVICE=simulated) steps CPU parameters in host memory standing in for the GPU.

    With overlap="backward", accumulate() runs micro-batches before the last without stepping,
    and a gradient the loop changes after its layer was stepped (its own clip_grad_norm_,
    scaler.unscale_) is seen, and the step redone with it.
    """

    _decoupled = True
    _name = "AdamW"

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        **kwargs,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


__all__ = ["Adam", "AdamW"]
