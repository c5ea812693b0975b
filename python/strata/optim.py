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

Stepping during backward (on a GPU with streamed states, the default: See Note [Overlap by
default] in strata/_overlap.py): each layer is stepped as soon as its gradients are final, while
backward goes on, and step() validates it. Clipping is cheapest in the optimizer (max_grad_norm),
since the norm is known only once backward ends; a loop's own clip_grad_norm_ makes step() redo the
step, and the optimizer then steps after backward for a while:

    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, max_grad_norm=1.0)
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
redoes the step when the clip coefficient is not 1 (See Note [Clipping in the step] in
strata/_overlap.py). Steps with and without overlap are bitwise equal, and equal to clip_grad_norm_
followed by the step.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _args, _checkpoint, _plan, _setup
from . import budget as _budget
from ._overlap import Overlap
from .distributed import is_dtensor, local
from .runtime import Runtime


def _scalar_or_none(t) -> Optional[torch.Tensor]:
    # GradScaler's grad_scale / found_inf as the kernels read them: one contiguous float32 value.
    if t is None:
        return None
    return t.detach().reshape(()).to(torch.float32).contiguous()


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam, stepped by strata's runtime (see AdamW for the strata arguments)."""

    _decoupled = False
    _name = "Adam"
    _rule = "adam"  # the step rule (See Note [Step rules] in optim/step_rule.h)
    _states = ("exp_avg", "exp_avg_sq")  # the rule's states of every parameter, amsgrad's aside

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
        _args.check_hyper(lr, betas, eps, weight_decay)
        _args.check_arguments(
            self._name,
            amsgrad,
            state_dtype,
            capturable,
            differentiable,
            max_grad_norm,
            runtime,
            overlap,
        )
        self._state_dtype = state_dtype
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

        # A frozen parameter gets no state and is never touched (See Note [Per-parameter steps] in
        # optim/adam.h); it keeps its place in param_groups (and in the state dict's numbering).
        self._param_name, self._named = _plan.param_names(self.param_groups, model)
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
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        # States a parameter keeps besides a master, for the layout (Lion 1, Adam 2, amsgrad 3).
        moments = len(self._states) + (1 if amsgrad else 0)
        setup = _setup.make_runtime(
            self._name,
            self._trainable,
            self._param_name,
            self._named,
            moments=moments,
            state_dtype=state_dtype,
            model=model,
            policy=policy,
            gpu_budget=gpu_budget,
            prefetch_depth=prefetch_depth,
            layer_bytes=layer_bytes,
            runtime=runtime,
            overlap=overlap,
            undo_on_gpu=undo_on_gpu,
            hybrid_fraction=hybrid_fraction,
            device=device,
        )
        runtime = self._runtime = setup.runtime
        self._owns_runtime = setup.owns_runtime
        self._auto_budget = setup.auto_budget
        self._auto_undo = setup.auto_undo
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
            groups.append((pairs, _args.hyper_of(g, self._decoupled)))
        self._adam = _strata.Adam(runtime._rt, groups, 0, state_dtype, self._rule)
        runtime._before_layer_done = self._prepare_layer
        if self._owns_runtime:
            _plan.log_choice(
                self._name,
                runtime,
                self._adam,
                setup.plan,
                setup.how,
                policy,
                "auto" if self._auto_budget else setup.budget,
                setup.depth_from,
                moments,
                state_dtype,
            )
        self._keep_alive: tuple = ()
        self._hypers = [_args.hyper_of(g, self._decoupled) for g in self.param_groups]
        self._placement_line = self._adam.placement()
        self._undo_decided = False  # by _decide_undo, after the first step
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.last_step_outcome: Optional[str] = None
        self.steps_redone = 0
        self._closed = False
        # Stepping in backward (overlap="backward") and clipping (See Note [Clipping in the step]
        # in strata/_overlap.py).
        self._overlap = Overlap(
            self._name,
            runtime,
            self._adam,
            self._trainable,
            self._max_grad_norm,
            model,
            first_after=self._auto_undo,
        )

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
    # (See Note [Gradients the loop replaced] in strata/runtime.py). The version (and, once the loop
    # was seen to write gradients, the fingerprint) of each gradient the layer's step read is kept
    # (See Note [Gradients changed after their layer stepped] in strata/_read_gradients.py).
    def _prepare_layer(self, layer: int) -> None:
        if self._closed or self._overlap.accumulating:
            return
        if not self._adam.overlapped_step_open():
            self._sync_hyper()  # the step begins: with the hyperparameters as they are now
        skipped, read, absent = [], [], []
        for p in self._runtime._layer_users[layer]:
            if id(p) not in self._param_name:
                continue  # another optimizer's
            if self._runtime._take_gradient(p, self._param_name[id(p)]):
                read.append(p)
            else:
                skipped.append(self._runtime.bound_tensors(p)[0])
                absent.append(p)
        self._overlap.keep_versions(read, absent)
        if skipped:
            self._adam.skip_parameters(skipped)
        self._give_gradients(self._runtime._layer_users[layer])

    # Each group's hyperparameters as they are now (an LR scheduler's changes included); whether any
    # changed. A step taken in backward read them when it began: one that changed since is taken
    # back and redone, as for a gradient
    # (See Note [Gradients changed after their layer stepped] in strata/_read_gradients.py).
    def _sync_hyper(self) -> bool:
        changed = False
        for i, g in enumerate(self.param_groups):
            h = _args.hyper_of(g, self._decoupled)
            if h != self._hypers[i]:
                _args.check_hyper(h["lr"], (h["beta1"], h["beta2"]), h["eps"], h["weight_decay"])
                self._adam.set_hyper(i, h)
                self._hypers[i] = h
                changed = True
        return changed

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
        return self._overlap.accumulate()

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

    @property
    def backward_share(self) -> float:
        """The share of the optimizer's states that a step taken in backward steps there: 1 (all of
        them) unless a share of them measured faster (See Note [When to step in backward] in
        strata/_when.py). A step taken after backward steps none there, whatever it says."""
        return self._overlap.share

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
        self._overlap.backward_ended()
        open_before = self._adam.overlapped_step_open()
        hyper_changed = self._sync_hyper()
        grad_scale = _scalar_or_none(getattr(self, "grad_scale", None))
        found_inf = _scalar_or_none(getattr(self, "found_inf", None))
        rt = self._runtime._rt
        # Before finish_backward, which steps (under overlap) the layers backward left: what they
        # step must be the loop's gradients, and their parameters without one must sit out.
        changed = open_before and (
            hyper_changed or self._overlap.gradients_changed(grad_scale is not None)
        )
        skipped = self._take_gradients()
        if skipped:
            self._adam.skip_parameters(skipped)
        self._give_gradients(self._trainable)
        rt.finish_backward()
        taken_back = False
        if changed:
            # See Note [Gradients changed after their layer stepped] in strata/_read_gradients.py.
            self._adam.cancel_step()
            taken_back = True
        scale = grad_scale
        if self._max_grad_norm is not None:
            clip_scale, clipped_back, self.last_grad_norm = self._overlap.clip(grad_scale)
            taken_back = taken_back or clipped_back
            if clip_scale is not None:
                scale = clip_scale if grad_scale is None else (grad_scale * clip_scale).reshape(())
        # What the kernels read stays alive until they have run (the next step).
        self._keep_alive += (grad_scale, found_inf, scale)
        self.last_step_outcome = self._adam.finish_step(scale, found_inf)
        if taken_back or self._overlap.taken_back():
            self.last_step_outcome = "redone"
        self.steps_redone += self.last_step_outcome == "redone"
        rt.end_step()
        if self._adam.placement() != self._placement_line:  # See Note [Measured split]
            self._placement_line = self._adam.placement()
            _plan.log_placement(self._name, self._placement_line)
            if self._undo_decided:  # the layers that keep no undo moved
                self._decide_undo()
        if self._auto_budget:
            self._auto_budget = False
            _budget.set_auto_budget(self._runtime, self._name)
        if self._auto_undo:
            self._decide_undo()
        self._keep_alive = (grad_scale, found_inf, scale)
        self._overlap.step_ended(self.last_step_outcome, grad_scale)
        return loss

    # After the first step (taken after backward), where the steps in backward keep their undo
    # (See Note [The undo on the GPU when there is room] in strata/budget.py).
    def _decide_undo(self) -> None:
        self._auto_undo = False
        self._undo_decided = True
        need = _budget.undo_need(self._runtime, set(self._adam.host_layers()))
        _budget.set_auto_undo(self._runtime, self._name, need)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: set_to_none drops every gradient (a parameter that then gets none in
        backward sits the next step out, as in torch); autograd accumulates the next gradient into
        strata's memory again (See Note [Gradients the loop replaced] in strata/runtime.py).
        set_to_none=False zeroes them in place, wherever strata keeps them. Before step(), what
        a step in backward stepped is taken back first: the loop dropped its gradients (See Note
        [Backward passes before a step] in strata/_overlap.py)."""
        if not self._closed:
            self._overlap.gradients_dropped()
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

    def state_dict(self) -> dict:
        """torch.optim's state dict: {"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "max_exp_avg_sq"][, "master_param" of a bfloat16 or float16 parameter]}},
        "param_groups": [...]}, tensors on the CPU, read
        from whichever tier holds them (one tensor at a time); for DTensor parameters (FSDP2) this
        rank's shards as DTensors sharded like them. Before the first step the states are there
        too, at step 0 and zero."""
        self._check_open()
        return _checkpoint.state_dict(
            self._adam, self._runtime, self.param_groups, self._trainable_ids
        )

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of torch.optim.Adam / AdamW (or of this class): hyperparameters of
        every group, step counters and states. Everything is checked before anything changes.
        Between backward and step() under overlap, once the checks pass, what backward stepped is
        taken back, so that step() steps the loaded states, as torch's would; a dict the checks
        refuse leaves that step as it was."""
        self._check_open()
        _checkpoint.load_state_dict(
            self._name,
            self._adam,
            self._runtime,
            self.param_groups,
            self._trainable_ids,
            state_dict,
            self._states,
            before_writes=self._overlap.checkpoint_restored,
        )

    def close(self) -> list:
        """Frees the optimizer's states; when it made its own runtime, also unbinds the
        parameters and gradients (their values back in memory torch owns) and returns the
        runtime's leak report, empty when nothing leaked."""
        if self._closed:
            return []
        self._closed = True
        error = None
        try:
            self._overlap.close()  # takes back a step left open in backward
        except Exception as e:  # noqa: BLE001: the runtime closes all the same; this one is raised
            error = e
        try:
            self._runtime.wait_all()
            self._adam = None
            report = self._runtime.close() if self._owns_runtime else []
        except Exception:
            if error is not None:
                raise error from None
            raise
        if error is not None:
            raise error
        return report

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
        prefetch_depth: layers layer_prefetch brings ahead of use; None: as many as the bytes of
            a ring of depth 3 with float32 moments hold (3 for float32 moments, more for
            compressed ones; one less under overlap, where a slot of the ring drains), fewer where
            a budget leaves less room.
        layer_bytes: None (default): strata finds its layers (See Note [Layers without being told]
            in strata/layers.py): FSDP2's units, the blocks of `model` when given, the blocks in the
            parameters' names when named_parameters() is passed, else runs of parameters; none
            with more than a 32nd of the states (a larger unit or block is cut in runs of its
            parameters); else layers of at most this many parameter bytes, in order (under
            FSDP2, each unit cut in such runs).
        model: the module the parameters come from, so that layers follow its blocks.
        runtime: a strata.Runtime to use (e.g. with the model attached) instead of one of the
            optimizer's own; policy, gpu_budget, prefetch_depth, overlap and undo_on_gpu then come
            from it.
        overlap: "backward": each layer steps during backward once its gradients are final (in
            the last backward pass before step()), validated by step() (see the module's doc);
            "none": the step runs in step(); "auto" (default): "backward" on a GPU under
            layer_prefetch or hybrid, else "none" (See Note [Overlap by default] in
            strata/_overlap.py). Between backward and step() the parameters of layers stepped in
            backward hold the step's result; a module's forward or zero_grad() there takes the
            step back first, but a read outside a forward (p.norm()) sees the new values: pass
            overlap="none" for a loop that reads parameters there.
        max_grad_norm: clip the gradients by their global 2-norm (over every rank under FSDP2)
            inside the step, as clip_grad_norm_ would before it; the norm is in last_grad_norm.
            None: no clipping. Clipping here rather than in the loop keeps the step in
            backward (a loop's clip_grad_norm_ changes the gradients after it, and step() redoes
            it).
        undo_on_gpu: with overlap, keep the bytes a redo needs of tensors resting on the GPU
            (parameters, FSDP2's float32 shards, the states of layers resident on the GPU) on the
            GPU while the budget has room, instead of copying them to pinned host memory over the
            link. None (default): on under a gpu_budget (in bytes, or "auto" once set); without
            one, the first step runs after backward, and then it goes on the GPU if the driver
            has room for it and it adds nothing to torch's peak (See Note [The undo on the GPU
            when there is room] in strata/budget.py).
            With runtime= given, the runtime's setting.
        state_dtype: how the moments (exp_avg, exp_avg_sq) are stored: "float32" (default),
            "bfloat16" (stochastically rounded) or "int8" (a float32 scale per block of 256), on
            every tier and on the link; the step is float32 either way, and the state dict holds
            them decoded to float32 (See Note [Compressed moments] in optim/state_codec.h).
            Compressed moments take no amsgrad.
        hybrid_fraction: with policy="hybrid", the share of parameters whose step runs on the
            GPU (the rest on the host, their states in pinned memory); None: the cost model
            chooses from rates measured at setup, and an INFO line says what it chose. With
            overlap="backward" the host's layers step during backward too, on a host thread (See
            Note [Host steps in backward] in optim/adam_host_speculation.cpp).
        device: None (default): the parameters' GPU; CPU parameters on a machine with a GPU
            raise ValueError (move the model first); "simulated" (or the environment variable
            STRATA_DEVICE=simulated) steps CPU parameters in host memory standing in for the GPU.

    Under overlap, a loop's gradient accumulation works as it is: layers step in backward in the
    last of as many backward passes as the last step had, and a step with more is taken back at
    the next forward (See Note [Backward passes before a step] in strata/_overlap.py);
    accumulate() says which passes only accumulate. A gradient the loop changes after its layer
    was stepped (its own clip_grad_norm_, scaler.unscale_) is seen, and the step redone with it.
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


class Lion(Adam):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), stepped by
    strata's runtime: the second rule of strata's optimizer interface (See Note [Step rules] in
    optim/step_rule.h), with everything AdamW's strata arguments give (policies, hybrid, steps in
    backward, clipping, GradScaler, state dicts).

        opt = strata.optim.Lion(model.parameters(), lr=1e-4, weight_decay=0.1,
                                policy="layer_prefetch")

    Each element moves by lr times the sign of beta1 * exp_avg + (1 - beta1) * grad, after a
    decoupled weight decay (p -= lr * weight_decay * p); then exp_avg = beta2 * exp_avg +
    (1 - beta2) * grad (optim/lion_math.h gives the exact arithmetic, fused multiply-adds). One
    float32 state a parameter, exp_avg: a streamed step moves 4 bytes a float32 parameter each way
    against AdamW's 8; bfloat16 and float16 parameters keep a float32 master_param, as under AdamW
    (8 bytes against 12). The state dict has "step",
    "exp_avg" (and "master_param") per parameter.

    Args: params, lr (default 1e-4), betas (default (0.9, 0.99)), weight_decay (default 0),
        maximize, and AdamW's strata arguments but state_dtype (Lion's momentum is float32).
    """

    _decoupled = True
    _name = "Lion"
    _rule = "lion"
    _states = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **kwargs):
        for adam_only in ("eps", "amsgrad"):
            if adam_only in kwargs:
                raise TypeError(f"strata.optim.Lion: {adam_only} is Adam's; Lion does not take it")
        if kwargs.get("state_dtype", "float32") != "float32":
            raise ValueError(
                f"strata.optim.Lion: state_dtype={kwargs['state_dtype']!r}: Lion keeps its "
                "momentum in float32; leave state_dtype out"
            )
        super().__init__(params, lr, betas, 1e-8, weight_decay, False, **kwargs)


__all__ = ["Adam", "AdamW", "Lion"]
