"""What the layers stepped in backward read of their gradients, kept until step() checks that the
loop left those gradients as they were (See Note [Gradients changed after their layer stepped]).

strata/_overlap.py's Overlap owns one:

    read = ReadGradients(trainable, runtime)
    read.keep(params, absent)           # as a layer's step in backward reads params' gradients
    ...the loop's clip_grad_norm_, unscale_, zero_grad()...
    if read.changed(scaler_checked):    # in step(): the step is taken back and taken again
        ...
    read.forget()                       # the step is over
"""

from __future__ import annotations

import torch

from . import _strata
from .distributed import local
from .scalars import read_scalars


def fingerprintable(g: torch.Tensor) -> bool:
    """Whether strata can take g's fingerprint (See Note [Gradient fingerprints] in
    optim/fingerprint.h): contiguous, 2- or 4-byte elements, fewer than 2^32 of them."""
    return g.is_contiguous() and g.element_size() in (2, 4) and g.numel() < 2**32


# Note [Gradients changed after their layer stepped]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A layer stepped in backward read its gradients then; a loop that changes them afterwards (its
# own clip_grad_norm_, unscale_, manual scaling: all in place, each a new version of the tensor,
# or a new tensor) makes that step stale, and step() takes it back and steps again with the
# gradients as they are. GradScaler.step (when the loop did not unscale_) checks the gradients
# for inf by multiplying them by 1.0 in place first: one version each, no value changed,
# allowed. A new version need not be a new value, though: clip_grad_norm_ multiplies every
# gradient in place by its coefficient even when that is exactly 1.0 (the norm below
# max_norm, as it is for most of a run), and Hugging Face's Trainer and nanoGPT clip so at
# every step. So once a step has seen the loop write a gradient its layer's step read, each
# layer stepped in backward keeps its gradients' fingerprints too, taken where the step reads
# them (See Note [Gradient fingerprints] in optim/fingerprint.h); when versions changed,
# step() takes them again and compares them on the GPU (a few bytes read on the host, as
# validating clipping reads), and only a changed value takes the step back. A fingerprint
# tells a scaling of finite values by any other factor (a clip that clipped) every time, and
# another change but by a rare accident of the sums. The price is two more reads of the
# gradients a step (one in backward, one in step()), against a redo of the whole step. A
# gradient that comes after its layer stepped without one, or one the loop set to None,
# changed too. Streamed gradients (roles="all") are gone from the GPU by step(): no
# fingerprints, and any version change redoes the step.
class ReadGradients:
    """The gradients the steps in backward read: `trainable` the optimizer's parameters that
    require grad, `runtime` its strata.Runtime."""

    def __init__(self, trainable: list, runtime) -> None:
        self._trainable = trainable
        self._runtime = runtime
        # The versions of the gradients read; once the loop was seen to write gradients
        # (_fingerprint), their fingerprints, a (parameters, fingerprints) pair a layer, and the
        # parameters they cover.
        self._versions: dict = {}
        self._fingerprint = False
        self._prints: list = []
        self._printed: set = set()

    def keep(self, params: list, absent: list = ()) -> None:
        """The version of each gradient of `params` that their layer's step reads, and once the
        loop has written gradients, their fingerprints, kept until forget(). `absent`: the layer's
        parameters that sit its step out, having no gradient."""
        for p in params:
            self._versions[id(p)] = (p.grad, local(p.grad)._version)
        for p in absent:
            self._versions[id(p)] = (None, 0)
        if self._fingerprint and params and not self._runtime._streams_gradients:
            grads = [local(p.grad) for p in params]
            if all(fingerprintable(g) for g in grads):
                self._prints.append((params, _strata.fingerprints(grads)))
                self._printed.update(id(p) for p in params)

    def forget(self) -> None:
        """The step is over: nothing read is kept."""
        self._versions = {}
        self._prints, self._printed = [], set()

    def dropped(self) -> bool:
        """Whether the loop dropped a gradient a step read (set it to None)."""
        return any(
            self._versions.get(id(p), (None, 0))[0] is not None and p.grad is None
            for p in self._trainable
        )

    def changed(self, scaler_checked: bool) -> bool:
        """Whether a gradient a step read changed since; `scaler_checked`: GradScaler.step's
        in-place check of the gradients is one version each, allowed."""
        allowed = 1 if scaler_checked else 0
        written = []
        for p in self._trainable:
            seen = self._versions.get(id(p))
            if seen is None:
                continue
            grad, version = seen
            if grad is None and p.grad is None:
                continue  # sat the step out, and still has no gradient
            if grad is None or p.grad is None:
                return True  # a gradient came after its layer stepped, or the loop dropped one
            if p.grad is not grad or local(p.grad)._version - version > allowed:
                written.append(p)
        if not written:
            return False
        self._fingerprint = True  # the loop writes gradients: fingerprint them from now on
        if not all(id(p) in self._printed for p in written):
            return True
        return not self._same_values()

    # Whether every gradient fingerprinted in backward holds the values it held then.
    def _same_values(self) -> bool:
        before, after = [], []
        for params, prints in self._prints:
            grads = [None if p.grad is None else local(p.grad) for p in params]
            if not all(g is not None and fingerprintable(g) for g in grads):
                return False
            before.append(prints)
            after.append(_strata.fingerprints(grads))
        if before[0].is_cuda:  # made on the hooks' stream (FSDP2's post-reduce), read on this one
            for prints in before:
                prints.record_stream(torch.cuda.current_stream())
        before, after = torch.cat(before), torch.cat(after)
        if before.device != after.device or before.shape != after.shape:
            return False
        differ = (before != after).any().to(torch.float32)
        return read_scalars(differ)[0] == 0.0
