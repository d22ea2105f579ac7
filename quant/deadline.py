"""A target's time budget: when its build must be done, and when a search step must stop.

Why: a job has a timeout (the service's EDGE_UN_JOB_TIMEOUT_S). A target whose int8 ladder or
drift fallback takes one more step than the time left allows would run the whole job into that
timeout, and the user would get nothing. So a search step runs :func:`watching` a deadline: the
job's, less what follows the search (the shipped file's checks, its error profile, its latency,
as long as the builder estimates from what it measured) and less the longest stretch the step
runs between two :func:`check` calls (its loops check: bias correction between two biases;
ORT's calibration, the fp32 passes and a drift pass between two batches; the end of ORT's
pre-processing ends a stretch too). Past it, the step stops at its next check, and the build
still ends in time. A step starts when that watched deadline is still ahead
(:meth:`Deadline.allows`).

Not by predicting the step's length: a step's last duration says little about the next one's
when targets build at once and share the cores. BERT-base, 3 targets at once on 2 cores: the
cpu ladder's second recipe took 201 s while two other builds ran; the third, predicted from it,
did not start with 415 s left, though it took 66 s alone (measured once) and the other
builds were ending.
A search stopped so ships the best file measured so far, over the bar, with a warning that says
why (:func:`stop_note`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

# How every warning of a search stopped for time begins, and why it stopped.
STOPPED = "the search for a file within the drift bars stopped"
WHY = "(the service's EDGE_UN_JOB_TIMEOUT_S); the file shipped is the best measured so far"


class SearchStopped(Exception):
    """The deadline passed during a search step (raised by :func:`check`)."""


@dataclass(frozen=True)
class Deadline:
    """``at``: the moment (``time.time()``, so that it means the same in every process and on
    every machine of a job) by which a target's build must be done; None: no limit."""

    at: float | None = None

    def left(self) -> float:
        return math.inf if self.at is None else self.at - time.time()

    def allows(self, step_s: float, finish_s: float | None = None) -> bool:
        """Whether ``step_s`` seconds of work can start now and the build, which takes
        ``finish_s`` after it (None: as long as the step), still end in time."""
        return self.left() >= step_s + (step_s if finish_s is None else finish_s)

    def less(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` earlier (what must still run after a step)."""
        return self if self.at is None else Deadline(self.at - seconds)


NO_DEADLINE = Deadline()


@dataclass
class Watch:
    """A watched step: its deadline, and the longest it ran between two checks (from its start
    to the first, from the last to its end): how long after its deadline it can still run."""

    deadline: Deadline
    last_check: float = field(default_factory=time.monotonic)
    longest_gap_s: float = 0.0

    def mark(self) -> None:
        now = time.monotonic()
        self.longest_gap_s = max(self.longest_gap_s, now - self.last_check)
        self.last_check = now


_WATCHED: ContextVar[Watch | None] = ContextVar("quant_watch", default=None)


@contextlib.contextmanager
def watching(deadline: Deadline) -> Iterator[Watch]:
    """Within this block, :func:`check` raises SearchStopped once ``deadline`` has passed (with
    NO_DEADLINE it never does, and the watch only measures the step). A context variable, so
    that a step's inner loops check it without every function between the search and them
    passing it on."""
    watch = Watch(deadline)
    token = _WATCHED.set(watch)
    try:
        yield watch
    finally:
        watch.mark()
        _WATCHED.reset(token)


def check() -> None:
    """Raise SearchStopped if the deadline being watched has passed (none watched: never)."""
    watch = _WATCHED.get()
    if watch is None:
        return
    watch.mark()
    if watch.deadline.left() <= 0:
        raise SearchStopped


def stop_note(
    done: str,
    next_step: str,
    step_s: float,
    left_s: float,
    finish_s: float | None = None,
    *,
    watched: bool = False,
) -> str:
    """The warning of a search stopped for time before ``next_step``, for the target's report.
    ``watched``: ``step_s`` is how long that step runs before its first check, not all of it."""
    left = max(left_s, 0.0)
    after = "the checks after it" if finish_s is None else f"~{finish_s:.0f} s of checks after it"
    run = "would run about" if watched else "would take about"
    until = " before it could be stopped" if watched else ""
    return (
        f"{STOPPED} after {done}: {left:.0f} s of the job's time were left, and {next_step} "
        f"{run} {step_s:.0f} s{until} plus {after} {WHY}"
    )


def cut_note(done: str, step: str, finish_s: float) -> str:
    """The warning of a search whose ``step`` was stopped part way, for the target's report."""
    return (
        f"{STOPPED} after {done}: {step} was stopped part way, to leave ~{finish_s:.0f} s for "
        f"the checks after it {WHY}"
    )
