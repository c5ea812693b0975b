"""What the GPU tells the host about the steps it finished, read without a host wait: whether
clipping fired at the newest step whose coefficient reached the host (ClipRecord), and how long
each iteration took on the GPU (StepClock). strata.optim's overlap decides from them where the
next steps run (See Note [When to step in backward] in strata/_overlap.py).

    clips = ClipRecord()
    clips.note(coef)       # each step: queued copy to pinned memory, no wait
    clips.fired()          # True / False from the newest copy done, None before any is
    clock = StepClock()
    clock.mark("backward")  # at each step's end, on the current stream
    clock.done()           # [("backward", ms), ...] for iterations whose events completed
"""

from __future__ import annotations

import collections

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


class StepClock:
    """Iteration times on the GPU: mark(label) records an event on the current stream at a step's
    end; done() returns (label, ms) for each iteration, from the mark before to that step's mark,
    whose events are complete (queried, never waited on), oldest first. A label of None is not
    returned (See Note [When to step in backward])."""

    def __init__(self) -> None:
        self._last = None
        self._pending: list = []  # (label, start event, end event)
        self._free: list = []  # events read and done with, recorded again rather than made anew

    def mark(self, label: str | None) -> None:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        if self._last is not None and label is not None:
            self._pending.append((label, self._last, event))
        self._last = event

    def done(self) -> list:
        out = []
        while self._pending and self._pending[0][2].query():
            label, start, end = self._pending.pop(0)
            out.append((label, start.elapsed_time(end)))
            self._free.append(start)  # no later iteration starts or ends with it
        return out
