"""Where strata.optim takes its steps under overlap="backward": in backward, after it, or a share of
each in backward, chosen from the steps redone, the loop's clipping and iteration times measured on
the GPU (See Note [When to step in backward]).

    choice = StepChoice("AdamW", runtime, adam, max_grad_norm=None, cuda=True)
    speculating = True
    ...a step...
    speculating = choice.ended(outcome, speculating)  # after each step: in backward next?
    choice.share                                      # the share of the states stepped there
"""

from __future__ import annotations

import logging
import statistics

import torch

from ._readback import ClipRecord, StepClock

_log = logging.getLogger("strata")

# Iterations timed on each side before the medians decide, and the most kept for them
# (See Note [When to step in backward]).
_TIMED = 3
_KEPT = 5


# Note [When to step in backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step taken in backward and then redone (clipping fired, inf was found, the loop changed a
# gradient) costs more than the step after backward: the work in backward, the roll-back, and the
# whole step again. Early in training, or with a tight max_grad_norm, clipping fires at every step,
# and stepping in backward would make every step slower. So after a step is redone, the next steps
# are taken after backward (1, then 2, 4, ... up to 64 after redone tries in a row), then stepping
# in backward is tried again; a try that holds resets the wait. With max_grad_norm, the try waits
# further while the last step's clipping fired, or while that is not known yet: each step's
# coefficient is copied to the host without a wait (ClipRecord), and the newest copy that is done
# answers, so a run in which clipping fires at every step steps after backward at every step but
# the first, with no host wait added. A host that queues its steps ahead of the GPU learns a step or
# two late, but learns: asking only about the step just queued would find it not done at every
# step, and the steps would never return to backward. last_step_outcome says what each step was.
#
# A step that holds can cost more in backward too: each layer stepped there keeps what a redo would
# need (the bytes its kernel overwrites of tensors resting on the GPU, the parameters, copied off to
# the host unless undo_on_gpu; See Note [The undo on the GPU when there is room] in
# strata/budget.py), and those copies share the link with the states'; after backward, with the
# ring filled while backward ran, little is left to wait for. So the time of each iteration (one
# step's end to the next's, from events on the current stream, read once they are done, with no
# host wait) is kept by where its step ran; once steps in backward have been timed three times and
# steps after backward have not, the next three run after backward to time them; and while the
# median of the last five (or as many as there are) in backward exceeds that of the last five after
# it, the steps run after backward (16 steps, then 32, ... up to 1024 while that stays so), then
# backward is tried again. The times come back a step or two late; steps after backward whose times
# are on their way count toward the three, and the steps wait in backward for them, rather than
# more being taken after it. Medians of several, so that an iteration or two slowed by something
# else (the host, another process) do not decide alone. Without a GPU nothing is timed and only
# redone steps decide. While the hybrid policy searches for its split (See Note [Measured split] in
# policies/split_search.h), only redone steps decide too: the search compares splits by steps
# taken one way, and a change of way in the middle of it would compare the ways, not the splits.
# The iterations it timed were of other splits, so timing starts afresh with the split it chose.
#
# Between the two lies a share of the step in backward (See Note [A share of the step in backward]
# in optim/adam_overlap.cpp): backward hides the link time of the layers stepped while it runs, and
# no more, and what their undo copies off the GPU crosses the link beside their states. The steps
# after backward, split on the GPU by events at the first layer whose gradients are all in (in the
# step's last backward pass) and at step(), give backward's time B and the step's S, in which the
# device-to-host link writes back every state that crosses it (the ring fetched a few layers'
# while forward and backward ran). Stepping in backward the share B / (k S) of those states, the
# ones backward reaches first, where k is what a layer stepped there puts on that link over its
# states' bytes (Adam's backward_bytes: 1 with the undo on the GPU; 1.5 for float32 parameters
# with their undo in pinned memory), fills the link while backward runs and leaves the rest for
# after it; past that share each layer costs more than it hides (with k = 1 nothing more, so the
# share only matches the whole). So once steps wholly in backward and steps after it are timed, a
# share below the whole is tried once, timed the same way, and the three medians decide: the
# share stays while it is at most that of the steps after backward, the whole comes back where it
# was faster than both, and otherwise the back-off above applies, its tries stepping in backward
# the faster of the share and the whole. Each choice is one INFO line. No share is tried where
# backward uses the link itself (parameters or gradients streamed), nor under strata.attach's hooks,
# where the optimizer does not see the gradients arrive and cannot split the step.
class StepChoice:
    """The choice of Note [When to step in backward] for one optimizer: `name` is its ("AdamW"),
    `runtime` its strata.Runtime, `adam` its _strata.Adam, `max_grad_norm` its clipping threshold
    (None without), `cuda` whether its parameters are on a GPU (nothing is timed otherwise)."""

    def __init__(self, name: str, runtime, adam, max_grad_norm, cuda: bool) -> None:
        self._name = name
        self._runtime = runtime
        self._adam = adam
        self._max_grad_norm = max_grad_norm
        self.wait = 0  # steps still to take after backward before trying it again
        self._backoff = 0  # the wait after a redone step; doubles each time
        self.clips = ClipRecord()
        # Iteration times by where the step ran; None where nothing can be timed.
        self.clock: StepClock | None = StepClock() if cuda else None
        self._times: dict = {"backward": [], "share": [], "after": []}
        self._slower_wait = 0  # the wait after speculation measured slower; doubles each time
        # The backward and the step of iterations stepped after backward (ms), the share of the
        # states stepped in backward, and whether a share was tried.
        self._parts: list = []
        self.share = 1.0
        self._share_tried = False
        # The hybrid policy's split search runs (See Note [Measured split] in
        # policies/split_search.h): the iterations it times are its own.
        self._searching = False

    def close(self) -> None:
        """Lets go of the optimizer's kernels (its states go with their last reference)."""
        self._adam = None

    def ended(self, outcome: str | None, speculating: bool) -> bool:
        """After a step whose last_step_outcome is `outcome`, taken in backward if `speculating`:
        whether the next step is taken in backward."""
        speculating = self._adapt(outcome, speculating)
        return self._measured(outcome, speculating)

    def began_backward(self) -> None:
        """The step's backward produced its first gradients (the pass a step is taken in)."""
        if self.clock is not None:
            self.clock.begin_backward()

    def ended_backward(self) -> None:
        """step() was called: backward is over."""
        if self.clock is not None:
            self.clock.end_backward()

    def backward_abandoned(self) -> None:
        """The step's backward was taken back (zero_grad(), a forward before step())."""
        if self.clock is not None:
            self.clock.forget_backward()

    def note_clip(self, coef: torch.Tensor) -> None:
        """The step's clip coefficient, on its way to the host."""
        self.clips.note(coef)

    # Redone steps and the loop's clipping.
    def _adapt(self, outcome: str | None, speculating: bool) -> bool:
        if self.wait > 0:  # this step was taken after backward by choice
            self.wait -= 1
            if self.wait > 0:
                return speculating
            if self._max_grad_norm is not None and self.clips.fired() is not False:
                self.wait = 1  # ask again after the next step
                return speculating
            return True
        if outcome == "redone":
            if self._backoff == 0:
                _log.info(
                    "strata.optim.%s: a step taken in backward was redone (clipping fired, inf "
                    "was found, the loop changed a gradient, or a forward came before step()); the "
                    "next steps run after backward for a while (Note [When to step in backward])",
                    self._name,
                )
            self._backoff = min(2 * self._backoff, 64) if self._backoff else 1
            self.wait = self._backoff
            return False
        if outcome == "speculation":
            self._backoff = 0
        return speculating

    # The measured iteration times.
    def _measured(self, outcome: str | None, speculating: bool) -> bool:
        if self.clock is None:
            return speculating
        mode = "backward" if self.share >= 1.0 else "share"
        where = {"speculation": mode, "sequential": "after"}.get(outcome)
        self.clock.mark(where)  # a redone step's iteration is neither's
        searching = self._runtime._rt.wants_step_times()
        if self._searching and not searching:  # the split is chosen: time it afresh
            self._times = {label: [] for label in self._times}
            self._parts = []
        self._searching = searching
        for it in self.clock.done():
            if searching:
                continue
            self._times[it.label] = (self._times[it.label] + [it.ms])[-_KEPT:]
            if it.label == "after" and it.backward_ms is not None:
                self._parts = (self._parts + [(it.backward_ms, it.step_ms)])[-_KEPT:]
        if not speculating or self.wait > 0 or searching:
            return speculating
        in_backward, after = self._times[mode], self._times["after"]
        if len(in_backward) < _TIMED:
            return True
        if len(after) < _TIMED:  # never timed after backward: time steps there
            # Those already taken there may not be read back yet: they are not asked for again.
            missing = _TIMED - len(after) - self.clock.pending("after")
            if missing <= 0:
                return True
            self.wait = missing
            return False
        here, there = statistics.median(in_backward), statistics.median(after)
        if mode == "backward" and not self._share_tried:
            self._share_tried = True
            share = self._backward_share()
            if share is not None:  # timed next, beside the other two
                self._tell_share(share, here, there)
                self._set_share(share)
                return True
        whole = self._times["backward"]
        if mode == "share" and len(whole) >= _TIMED and statistics.median(whole) < min(here, there):
            _log.info(
                "strata.optim.%s: the first %.0f%% of the states in backward measured %.1f ms an "
                "iteration, all of them %.1f ms; every layer steps in backward again "
                "(Note [When to step in backward])",
                self._name,
                100 * self.share,
                here,
                statistics.median(whole),
            )
            self._set_share(1.0)
            self._slower_wait = 0
            return True
        if here <= there:
            self._slower_wait = 0
            return True
        self._slower_wait = min(2 * self._slower_wait, 1024) if self._slower_wait else 16
        if self._slower_wait == 16:
            _log.info(
                "strata.optim.%s: steps taken in backward%s measured %.1f ms an iteration, after "
                "backward %.1f ms; the next %d steps run after backward "
                "(Note [When to step in backward])",
                self._name,
                "" if mode == "backward" else f" (the first {100 * self.share:.0f}% of the states)",
                statistics.median(in_backward),
                statistics.median(after),
                self._slower_wait,
            )
        self._times[mode] = []
        if mode == "share" and len(whole) >= _TIMED and statistics.median(whole) < here:
            # The back-off's tries step the faster of the two in backward, timed again.
            self._set_share(1.0)
            self._times["backward"] = []
        self.wait = self._slower_wait
        return False

    def _set_share(self, share: float) -> None:
        self.share = share
        self._adam.set_backward_share(share)

    # The share of the states backward hides, from the steps timed after backward; None when they
    # were not split (strata.attach's hooks: the optimizer does not see the gradients arrive),
    # when backward moves parameters or gradients over the link itself, or when it is none or all
    # of them.
    def _backward_share(self) -> float | None:
        if len(self._parts) < _TIMED:
            return None
        if self._runtime._streams_parameters or self._runtime._streams_gradients:
            return None
        backward = statistics.median(b for b, _ in self._parts)
        step = statistics.median(s for _, s in self._parts)
        link, resting = self._adam.backward_bytes()
        if link == 0 or step <= 0:
            return None
        undo = 0 if self._runtime._rt.undo_on_gpu() else resting
        share = backward / ((1 + undo / link) * step)
        return share if 0.0 < share < 1.0 else None

    def _tell_share(self, share: float, in_backward: float, after: float) -> None:
        _log.info(
            "strata.optim.%s: steps taken wholly in backward measured %.1f ms an iteration, after "
            "backward %.1f ms (its backward %.1f ms, its step %.1f ms); the first %.0f%% of the "
            "states backward reaches step in backward next, the rest after it, timed beside both "
            "(Note [When to step in backward])",
            self._name,
            in_backward,
            after,
            statistics.median(b for b, _ in self._parts),
            statistics.median(s for _, s in self._parts),
            100 * share,
        )
