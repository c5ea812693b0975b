"""What the GPU tells the host about the steps it finished, read without a host wait: whether
clipping fired at the newest step whose coefficient reached the host (ClipRecord), and how long
each iteration took on the GPU (StepClock). strata.optim's overlap decides from them where the
next steps run (See Note [When to step in backward] in strata/_when.py).

    clips = ClipRecord()
    clips.note(coef)       # each step: queued copy to pinned memory, no wait
    clips.fired()          # True / False from the newest copy done, None before any is
    clock = StepClock()
    clock.begin_backward()  # optional: at the first gradient of the step's backward
    clock.end_backward()    # optional: at step()
    clock.mark("after")     # at each step's end, on the current stream
    clock.done()            # [Iteration("after", ms, backward_ms, step_ms), ...] once complete
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch


class ClipRecord:
    """Whether clipping fired at the newest step whose clip coefficient has reached the host:
    note(coef) copies each step's coefficient to pinned memory behind an event, without a wait;
    fired() reads the copies that are done, oldest first (queried, never waited on), and answers
    from the newest of them, None before any is done (See Note [When to step in backward]). A
    coefficient already on the host is known at once. `make_event` makes the events (CUDA's)."""

    def __init__(self, make_event=None) -> None:
        self._make_event = make_event
        self._fired: bool | None = None
        self._pending: collections.deque = collections.deque()  # (host tensor, event), oldest first
        self._free: list = []  # read and done with, used again rather than made anew

    def note(self, coef: torch.Tensor) -> None:
        if coef.device.type != "cuda" and self._make_event is None:
            self._fired = float(coef) < 1.0
            return
        self.fired()  # the copies done since, read and free: at most a few stay pending
        if self._free:
            host, event = self._free.pop()
        else:
            host = torch.empty((), dtype=torch.float32, pin_memory=coef.device.type == "cuda")
            event = (self._make_event or torch.cuda.Event)()
        host.copy_(coef.reshape(()).to(torch.float32), non_blocking=True)
        event.record()
        self._pending.append((host, event))

    def fired(self) -> bool | None:
        while self._pending and self._pending[0][1].query():
            host, event = self._pending.popleft()
            self._fired = float(host) < 1.0
            self._free.append((host, event))
        return self._fired

    def pending(self) -> int:
        """Copies not yet known to be done."""
        return len(self._pending)


class Iteration(NamedTuple):
    """One iteration as StepClock times it: where its step ran, its milliseconds, and, where both
    were marked, those of its backward (first gradient to step()) and of its step (step() to the
    step's end)."""

    label: str
    ms: float
    backward_ms: float | None = None
    step_ms: float | None = None


class StepClock:
    """Iteration times on the GPU: mark(label) records an event on the current stream at a step's
    end; done() returns an Iteration for each, from the mark before to that step's mark, whose
    events are complete (queried, never waited on), oldest first. A label of None is not returned
    (See Note [When to step in backward]). begin_backward() and end_backward(), each once between
    two marks, split an iteration at its backward's first gradients and at step(), on the stream
    of the last mark (a gradient hook may run on another: FSDP2's reduce-scatter stream; a loop
    whose step() runs on another stream than its backward gets a wrong split); forget_backward()
    drops them. pending(label) counts the iterations marked and not yet done."""

    def __init__(self) -> None:
        self._last = None
        self._pending: list = []  # (label, start, end, backward begun, backward ended): events
        self._free: list = []  # events read and done with, recorded again rather than made anew
        self._begun = self._ended = None  # this iteration's, when marked
        self._stream = None  # the stream the last mark was recorded on

    def _record(self):
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def begin_backward(self) -> None:
        if self._begun is None:
            self._begun = self._record()

    def end_backward(self) -> None:
        if self._ended is None:
            self._ended = self._record()

    def forget_backward(self) -> None:
        """The backward begun was abandoned (its step taken back): its split is dropped."""
        self._free.extend(e for e in (self._begun, self._ended) if e is not None)
        self._begun = self._ended = None

    def mark(self, label: str | None) -> None:
        # Each mark, and the splits until the next, on the stream the step ends on: a gradient
        # hook may run on another (FSDP2's reduce-scatter stream).
        self._stream = torch.cuda.current_stream()
        event = self._record()
        begun, ended = self._begun, self._ended
        self._begun = self._ended = None
        if self._last is not None and label is not None:
            self._pending.append((label, self._last, event, begun, ended))
        else:
            self._free.extend(e for e in (begun, ended) if e is not None)
        self._last = event

    def pending(self, label: str) -> int:
        """Iterations marked `label` whose events are not read yet (on their way to done())."""
        return sum(1 for it in self._pending if it[0] == label)

    def done(self) -> list:
        out = []
        while self._pending and all(e.query() for e in self._pending[0][1:] if e is not None):
            label, start, end, begun, ended = self._pending.pop(0)
            split = begun is not None and ended is not None
            out.append(
                Iteration(
                    label,
                    start.elapsed_time(end),
                    begun.elapsed_time(ended) if split else None,
                    ended.elapsed_time(end) if split else None,
                )
            )
            # No later iteration starts or ends with these.
            self._free.extend(e for e in (start, begun, ended) if e is not None)
        return out
