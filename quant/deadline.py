"""A target's time budget: when its build must be done, and whether the next search step fits.

Why: a job has a timeout (the service's EDGE_UN_JOB_TIMEOUT_S). A target whose int8 ladder or
drift fallback takes one more step than the time left allows would run the whole job into that
timeout, and the user would get nothing. Instead the search loops ask before each step whether
it still fits (:meth:`Deadline.allows`: the step, as long as the last one took, and what
follows the search: the shipped file's checks, its error profile, its latency, as long as the
builder estimates from what it measured, else as long as the step again),
and a step with a loop of its own (bias correction: one bias after another, in graph order)
checks between two of them (:func:`check`, within :func:`watching`). A search stopped so ships
the best file measured so far, over the bar, with a warning that says why (:func:`stop_note`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


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
        """Whether a step that took ``step_s`` last time can start now and the build, which
        takes ``finish_s`` after its search (None: as long as the step), still end in time."""
        return self.left() >= step_s + (step_s if finish_s is None else finish_s)

    def less(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` earlier (what must still run after a step)."""
        return self if self.at is None else Deadline(self.at - seconds)


NO_DEADLINE = Deadline()
_WATCHED: ContextVar[Deadline] = ContextVar("quant_deadline", default=NO_DEADLINE)


@contextlib.contextmanager
def watching(deadline: Deadline) -> Iterator[None]:
    """Within this block, :func:`check` raises SearchStopped once ``deadline`` has passed. A
    context variable, so that a step's inner loop (bias correction) checks it without every
    function between the search and that loop passing it on."""
    token = _WATCHED.set(deadline)
    try:
        yield
    finally:
        _WATCHED.reset(token)


def check() -> None:
    """Raise SearchStopped if the deadline being watched has passed (none watched: never)."""
    if _WATCHED.get().left() <= 0:
        raise SearchStopped


def stop_note(
    done: str, next_step: str, step_s: float, left_s: float, finish_s: float | None = None
) -> str:
    """The warning of a search stopped for time, for the target's report."""
    left = max(left_s, 0.0)
    after = "the checks after it" if finish_s is None else f"~{finish_s:.0f} s of checks after it"
    return (
        f"the search for a file within the drift bars stopped after {done}: {left:.0f} s of the "
        f"job's time were left, and {next_step} would take about {step_s:.0f} s plus {after} "
        "(the service's EDGE_UN_JOB_TIMEOUT_S); the file shipped is the best measured so far"
    )
