"""strata.optim's step during backward (overlap="backward"), and step()'s check of it.

Each strata.optim optimizer owns one Overlap. Under overlap="backward" it hooks the gradients so
that each layer is stepped once they are final (See Note [Stepping in backward under FSDP2] in
strata/optim.py), asks a StepChoice when to step in backward at all (See Note [When to step in
backward] in strata/_when.py), keeps what each layer's step read of its gradients (a
ReadGradients: See Note [Gradients changed after their layer stepped] in
strata/_read_gradients.py), and takes the step of a backward back when one cannot go on.
Clipping lives here too, under either overlap: its coefficient decides whether the step taken in
backward stands (See Note [Clipping in the step]). Without overlap it begins the runtime's step
before step(), at the model's forward or the first gradient, so that the states come in while
they run (See Note [States staged ahead] in policies/state_streaming.cpp).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from . import _strata
from ._read_gradients import ReadGradients
from ._when import StepChoice
from .distributed import all_reduce_norm, clip_coef, fsdp_modules, fsdp_units, grad_norm, local
from .scalars import read_scalars

_log = logging.getLogger("strata")


# Note [Overlap by default]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Stepping in backward hides the optimizer's step, and the link time of streamed states, under
# backward; after backward only what backward did not hide is left. It is exact in the loops users
# write (the holes are in Note [Backward passes before a step]):
# what it cannot know in time (clipping, GradScaler's inf, a gradient or hyperparameter the loop
# changed, another backward pass before step()) it takes back and steps again (See Note [Gradients
# changed after their layer stepped] and Note [Backward passes before a step]), and where it
# measures slower than the step after backward it steps there (See Note [When to step in
# backward]). So strata.optim's own runtime steps in backward unless told not to (overlap="auto",
# the default), where it can gain: on a GPU, under a policy that streams the optimizer's states
# (layer_prefetch, hybrid). keep_on_gpu and bulk keep the states in place for the step, so a step
# in backward would save little and keep an undo; the simulated device has no clock to measure
# the choice by; under DDP (torch.distributed without FSDP2's DTensors) the gradients a layer's hook
# sees are the rank's own, averaged in place only at the end of backward, so every step would be
# redone. The INFO line at construction says what was chosen and why.
def choose_overlap(
    given: str | None, policy: str | None, cuda: bool, replicated: bool = False
) -> tuple:
    """(overlap, why) for strata.optim's own runtime: `given` unless it is "auto" or None, else
    by Note [Overlap by default] from the policy a runtime made with `policy` would run, whether
    the parameters are on a GPU, and whether they are replicated across ranks by
    torch.distributed without FSDP2 (DDP)."""
    if given not in (None, "auto"):
        return given, "argument"
    name, _ = _strata.choose_policy(policy)
    if not cuda:
        return "none", "auto: no GPU to step in backward on"
    if replicated:
        return "none", "auto: DDP averages the gradients after their hooks"
    if name not in ("layer_prefetch", "hybrid"):
        return "none", f"auto: {name} streams no optimizer states"
    return "backward", "auto"


class Overlap:
    """The optimizer's part in stepping during backward: gradient hooks, the choice to speculate,
    the gradients a step read, clipping. `name` is the optimizer's ("AdamW"), `adam` its
    _strata.Adam, `trainable` its parameters that require grad; `first_after`: the first step
    runs after backward."""

    def __init__(
        self,
        name: str,
        runtime,
        adam,
        trainable: list,
        max_grad_norm: float | None,
        model: torch.nn.Module | None = None,
        first_after: bool = False,
    ) -> None:
        self._name = name
        self._runtime = runtime
        self._adam = adam
        self._trainable = trainable
        self._max_grad_norm = max_grad_norm
        self.accumulating = False  # inside accumulate(): backward only accumulates
        self._read = ReadGradients(trainable, runtime)  # what the steps in backward read
        self._spec_scale: torch.Tensor | None = None
        self._hooks: list = []
        self._layer_params: dict = {}  # layer -> its parameters this optimizer hooks
        # This step's gradient hooks (See Note [Backward passes before a step]): per parameter
        # (by id), and per layer the passes it has ended and how many of its parameters have had
        # no more hooks than that.
        self._param_seen: dict = {}
        self._layer_low: dict = {}
        self._layer_left: dict = {}
        # Backward passes a step (See Note [Backward passes before a step]): learned from the last
        # step; this step's so far; the layers stepped in this step's backward, and the forward
        # guard that takes them back.
        self._passes = 1
        self._passes_now = 0
        self._passes_before = 0  # passes counted before a take-back restarted the count
        self._after_only = False  # this step's backward passes only accumulate now
        self._stepped: set = set()
        self._guard = None
        self._taken_back = False
        self._told_taken_back = self._told_passes = False  # each said once at INFO, then DEBUG
        self._closed = False
        # Where the steps run (See Note [When to step in backward] in strata/_when.py), timed
        # only with the parameters on a GPU.
        self._speculating = False
        cuda = any(local(p).is_cuda for p in trainable[:1])
        self._choice = StepChoice(name, runtime, adam, max_grad_norm, cuda)
        if runtime.overlap == "backward":
            # The first step after backward, while the optimizer learns where the undo goes
            # (See Note [The undo on the GPU when there is room] in strata/budget.py).
            self._choice.wait = 1 if first_after else 0
            self._set_speculating(not first_after)
            if not runtime._hooks:  # strata.attach's hooks tell where backward is otherwise
                self._hook_gradients()
        elif runtime.policy == "layer_prefetch" and not runtime._hooks:
            # The step begins with the first gradient, so that the states the step takes first
            # are staged while backward runs (See Note [States staged ahead] in
            # policies/state_streaming.cpp); strata.attach's hooks begin it before forward.
            for p in trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._begin_step))
        units = fsdp_units()
        if model is not None and not runtime._hooks and not any(id(p) in units for p in trainable):
            # Given the model, the step begins with its forward: the states come in while forward
            # runs too (FSDP2's units begin it so under overlap).
            self._hooks.append(model.register_forward_pre_hook(self._begin_from_forward))

    def close(self) -> None:
        """Removes the hooks and lets go of the optimizer's kernels (their states are freed with
        the optimizer's last reference)."""
        self._closed = True
        self._remove_guard()
        try:
            if self._adam is not None and self._adam.overlapped_step_open():
                # The loop ended between backward and step(): torch would have stepped nothing.
                self._abandon_backward()
            if self._adam is not None:
                self._adam.set_step_in_backward(False)
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._adam = None
            self._choice.close()

    @contextlib.contextmanager
    def accumulate(self):
        """strata.optim's accumulate(): backward passes that only accumulate."""
        if self._runtime.overlap != "backward" or self.accumulating:
            yield
            return
        self.accumulating = True
        speculating = self._speculating
        self._set_speculating(False)
        try:
            yield
        finally:
            self.accumulating = False
            self._set_speculating(speculating)

    def _set_speculating(self, on: bool) -> None:
        self._speculating = on
        self._adam.set_step_in_backward(on)

    def keep_versions(self, params: list, absent: list = ()) -> None:
        """What a layer's step in backward read of `params`' gradients (`absent`: the layer's
        parameters that sit its step out, having no gradient)."""
        self._read.keep(params, absent)

    def gradients_changed(self, scaler_checked: bool) -> bool:
        """Whether the loop changed a gradient a step in backward read (See Note [Gradients
        changed after their layer stepped] in strata/_read_gradients.py)."""
        return self._read.changed(scaler_checked)

    # After step(): what the next step's backward starts from. `outcome` is the step's
    # last_step_outcome, `grad_scale` GradScaler's scale (None without one).
    def step_ended(self, outcome: str | None, grad_scale: torch.Tensor | None) -> None:
        self._forget_backward()
        self._learn_passes()
        if self._runtime.overlap == "backward":
            on = self._choice.ended(outcome, self._speculating)
            if on != self._speculating:
                self._set_speculating(on)
        if self._runtime.overlap == "backward" and grad_scale is not None:
            # The next step's layers stepped in backward divide by this scale; it holds unless
            # GradScaler.update changes it (See Note [GradScaler] in strata/optim.py).
            self._spec_scale = grad_scale.detach().clone()
            self._adam.set_speculative_scale(self._spec_scale)

    @property
    def share(self) -> float:
        """The share of the states stepped in backward (See Note [When to step in backward] in
        strata/_when.py)."""
        return self._choice.share

    # step() was called: backward is over (See Note [When to step in backward]).
    def backward_ended(self) -> None:
        if self._runtime.overlap == "backward":
            self._choice.ended_backward()

    # The step's clip coefficient, on its way to the host (See Note [When to step in backward]).
    def _note_clip(self, coef: torch.Tensor) -> None:
        if self._runtime.overlap == "backward":
            self._choice.note_clip(coef)

    # A layer is done once every parameter of it has had its post-accumulate-grad hook this step
    # (See Note [Stepping in backward under FSDP2] in strata/optim.py).
    def _hook_gradients(self) -> None:
        self._layer_params = {}
        self._reset_counts()
        params = list(self._trainable)
        for p in params:
            layer = self._runtime._layer_of.get(id(p))
            if layer is None:
                continue  # bound by its owner under another name: stepped after backward
            self._layer_params.setdefault(layer, []).append(p)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(layer)))
        units = fsdp_modules()
        modules = {id(units[id(p)]): units[id(p)] for p in params if id(p) in units}
        for m in modules.values():
            self._hooks.append(m.register_forward_pre_hook(self._begin_step))

    # The model's forward, where a step follows: one with autograd recording, while the runtime's
    # tensors are in place (an evaluation under no_grad, or one between offload_all and
    # reload_all, begins nothing).
    def _begin_from_forward(self, *_) -> None:
        if torch.is_grad_enabled() and not self._runtime.offloaded:
            self._begin_step()

    def _begin_step(self, *_) -> None:
        # The runtime's step begins where the states it stages first should start coming: the
        # first unit's forward, the model's, or the first gradient.
        if not self._closed and not self._runtime._rt.in_step():
            self._runtime._rt.begin_step()

    # Note [Backward passes before a step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A loop may run several backward passes before step() (gradient accumulation: nanoGPT, HF
    # Trainer's gradient_accumulation_steps), and nothing tells strata which is the last. A layer
    # may be stepped in backward only in the last: the next forward must read the parameters as
    # they were. So the optimizer counts the passes of each step (a layer has ended k passes when
    # each of its parameters has had its gradient hook k times; a parameter no pass uses keeps its
    # layer for step()) and steps a layer in backward only in the pass whose number is the last
    # step's count; in the other passes, and in steps run after backward, the hooks only begin the
    # runtime's step, and step() runs it as without overlap. When a step has more passes than the
    # last, the forward of the next one shows it before it reads a parameter: while layers stepped
    # in backward wait for step(), a forward pre-hook on every module (registered only then, so
    # that forwards at other times pay nothing) looks at each module called; one that holds a
    # parameter of a stepped layer takes the step back (the parameters and states as they were)
    # before its forward runs, and the rest of that step's passes only accumulate; the step counts
    # as redone (See Note [When to step in backward]), and the next steps step in backward in their
    # last pass. zero_grad() before step() takes it back too, and so does such a forward once the
    # loop set a gradient the step read to None (model.zero_grad()): torch would have changed
    # nothing, and the count starts again. A forward during backward of layers not yet stepped
    # (activation checkpointing recomputes the layer about to run backward) changes nothing, and
    # close() between backward and step() takes the step back. What the hook cannot see: a
    # backward with no forward before it (backward(retain_graph=True) twice) reaches a stepped
    # layer too late, and raises (the next steps step in the last of as many passes); and a
    # parameter read or written outside a module's call between backward and step() (p.norm(),
    # model.forward(x) called directly, a TorchScript module, FSDP2's explicit unshard() ahead of
    # the next forward, a manual clamp) sees the step's result: such loops pass overlap="none".
    # A parameter of a layer used only in some passes can end the layer's pass before another
    # parameter's gradient of that pass has come; the other's new version then redoes the step.
    def _grad_hook(self, layer: int):
        def hook(param):
            if self.accumulating:
                return
            passes = self._count_hook(layer, param)
            if passes is None:
                return  # the pass goes on: a parameter of the layer has not had its hook
            self._passes_now = max(self._passes_now, self._passes_before + passes)
            self._begin_step()
            if self._passes_before + passes == self._passes:
                self._choice.began_backward()  # See Note [When to step in backward]
            if layer in self._stepped:
                # The next step steps in backward in the last of as many passes.
                self._passes = max(self._passes, self._passes_now)
                self._abandon_backward()
                raise RuntimeError(
                    f"strata.optim.{self._name}: layer {layer}'s gradients were accumulated "
                    "again after it was stepped in backward, with no forward between that strata "
                    "could take the step back at (a backward with retain_graph=True run twice?); "
                    "run the backward passes before the last inside `with opt.accumulate():`, or "
                    "use overlap='none'. The layers stepped in the first backward were rolled "
                    "back; zero the gradients and go on"
                )
            if not self._speculating or self._after_only:
                return  # step() steps it (See Note [Backward passes before a step])
            if self._passes_before + passes != self._passes:
                return
            self._runtime._after_backward(layer)
            self._stepped.add(layer)
            if self._guard is None:
                self._guard = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._forward_guard
                )

        return hook

    # Counts param's gradient hook; the passes `layer` has now ended if this hook ended one, else
    # None. A layer has ended as many passes as the hooks of its parameter that had the fewest
    # (See Note [Backward passes before a step]); the layer's parameters are read only when that
    # number may have grown, so a pass costs a look at each parameter once.
    def _count_hook(self, layer: int, param) -> int | None:
        had = self._param_seen.get(id(param), 0)
        self._param_seen[id(param)] = had + 1
        params = self._layer_params[layer]
        low = self._layer_low.get(layer, 0)
        if had != low:
            return None
        left = self._layer_left.get(layer, len(params)) - 1
        self._layer_left[layer] = left
        if left > 0:
            return None
        counts = [self._param_seen.get(id(p), 0) for p in params]
        low = min(counts)
        self._layer_low[layer], self._layer_left[layer] = low, counts.count(low)
        return low

    def _reset_counts(self) -> None:
        self._param_seen, self._layer_low, self._layer_left = {}, {}, {}

    # What a step kept of its backward: the hooks counted, the gradients' versions and
    # fingerprints.
    def _forget_backward(self) -> None:
        self._reset_counts()
        self._read.forget()

    # A module's forward while layers stepped in backward wait for step(): one that holds their
    # parameters takes the step back first (See Note [Backward passes before a step]).
    def _forward_guard(self, module, _args) -> None:
        if not self._stepped:
            return
        layer_of = self._runtime._layer_of
        if any(layer_of.get(id(p)) in self._stepped for p in module.parameters()):
            if self._read.dropped():  # model.zero_grad(): a step begins anew
                self.gradients_dropped("a forward after the gradients were dropped ran")
            else:  # another backward pass of this step comes
                self.take_back("a forward ran")

    def _remove_guard(self) -> None:
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def take_back(self, why: str) -> None:
        """A forward before step(): takes back the layers this step stepped in backward, their
        parameters and states as they were; the rest of the step's backward passes only accumulate
        and step() steps them all (See Note [Backward passes before a step])."""
        if not self._stepped:
            return
        passes = self._passes_now
        self._abandon_backward()
        self._passes_before = passes
        self._after_only = True
        self._taken_back = True
        self._tell_taken_back(why)

    def gradients_dropped(self, why: str = "zero_grad() ran") -> None:
        """zero_grad() before step(), or a forward after the loop dropped or changed the
        gradients: what this step's backward stepped is taken back, and the count of its backward
        passes starts again (See Note [Backward passes before a step])."""
        if self._adam is not None and self._adam.overlapped_step_open():
            self._abandon_backward()
            self._tell_taken_back(why)
        self._choice.backward_abandoned()  # See Note [When to step in backward]
        self._forget_backward()
        self._passes_now = self._passes_before = 0
        self._after_only = self._taken_back = False

    def _tell_taken_back(self, why: str) -> None:
        level = logging.DEBUG if self._told_taken_back else logging.INFO
        self._told_taken_back = True
        _log.log(
            level,
            "strata.optim.%s: %s while layers stepped in backward waited for step(); they were "
            "taken back (Note [Backward passes before a step])",
            self._name,
            why,
        )

    def taken_back(self) -> bool:
        """Whether this step's backward stepped layers that take_back took back."""
        return self._taken_back

    # After a step: its count of backward passes is the next step's (See Note [Backward passes
    # before a step]).
    def _learn_passes(self) -> None:
        self._remove_guard()
        self._stepped = set()
        if self._passes_now and self._passes_now != self._passes:
            _log.log(
                logging.DEBUG if self._told_passes else logging.INFO,
                "strata.optim.%s: %d backward passes before step(); layers step in backward in "
                "the last of them (Note [Backward passes before a step])",
                self._name,
                self._passes_now,
            )
            self._passes = self._passes_now
            self._told_passes = True
        self._passes_now = self._passes_before = 0
        self._after_only = self._taken_back = False

    def checkpoint_restored(self) -> None:
        """load_state_dict() with a step taken in backward open: taken back, as before a forward
        (so that step() steps the loaded states), or forgotten where a failed step() had committed
        it (Adam::drop_committed_step)."""
        if self._adam is not None and self._adam.overlapped_step_open():
            self._abandon_backward(restored=True)

    # Takes back what the step's backward stepped and ends the runtime's step with no optimizer
    # step, so that training can go on from the parameters as they were before it.
    def _abandon_backward(self, restored: bool = False) -> None:
        self._runtime._rt.join_step_stream()  # what is taken back must have been written
        if restored:
            self._adam.drop_committed_step()  # nothing to do unless it was committed
        self._adam.cancel_step()
        self._adam.clear_skipped()
        self._adam.set_step_in_backward(False)
        try:
            self._runtime._rt.finish_backward()
            self._runtime._rt.end_step()
        finally:
            self._adam.set_step_in_backward(self._speculating)
            self._choice.backward_abandoned()
            self._forget_backward()
            self._stepped = set()
            self._remove_guard()

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
    # back, the total norm, which the optimizer keeps in last_grad_norm).
    # With GradScaler's scale (grad_scale, not unscaled by the loop), the norm is the unscaled
    # gradients'.
    def clip(self, grad_scale: torch.Tensor | None) -> tuple:
        params = [p for p in self._trainable if p.grad is not None]
        if not self._runtime._streams_gradients:
            total, grads = grad_norm(params)
            if grad_scale is not None:
                total = total / grad_scale.to(total.device).reshape(())
            coef = clip_coef(total, self._max_grad_norm)
            self._note_clip(coef)
            taken_back = self._adam.overlapped_step_open()
            if taken_back:
                # Not .item(): that copy would queue behind the write-backs of the layers
                # stepped last (strata.read_scalars).
                if read_scalars(coef)[0] >= 1.0:
                    return None, False, total  # no clipping: what backward stepped stands
                self._adam.cancel_step()
            torch._foreach_mul_(grads, coef.to(grads[0].device))
            return None, taken_back, total
        total = all_reduce_norm(self._runtime._rt.total_norm(), params)
        if grad_scale is not None:
            total = total / grad_scale.to(total.device).reshape(())
        coef = clip_coef(total, self._max_grad_norm)
        self._note_clip(coef)
        return (torch.ones_like(coef, dtype=torch.float32) / coef).contiguous(), False, total
