"""The states of a conversion job and the moves between them: the vocabulary that the job
records (``service.jobs``), the API's schemas and the client share (no database needed).

``partial``: the conversion ended with some of its targets failed and the others built (their
files are published); ``failed``: nothing was built (every target failed, or the run did not
finish). Which of the three a finished run is, is ``quant.report.Report.outcome``, the rule
the CLI's exit code follows too.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

from converters.progress import ProgressEvent

State = Literal["queued", "running", "succeeded", "partial", "failed", "cancelled"]
STATES: tuple[State, ...] = get_args(State)
ACTIVE: frozenset[State] = frozenset({"queued", "running"})
FINISHED: frozenset[State] = frozenset(STATES) - ACTIVE
# A run that ended by itself: it may have published a report (a failed one, if it got that far).
ENDED: frozenset[State] = frozenset({"succeeded", "partial", "failed"})
# Every move a job can make; anything else is a bug (or a stale writer, which is refused).
TRANSITIONS: dict[State, frozenset[State]] = {
    "queued": frozenset({"running", "cancelled"}),
    "running": frozenset({"succeeded", "partial", "failed", "cancelled", "queued"}),
    "succeeded": frozenset(),
    "partial": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}


class Staged(Protocol):
    """A job record's progress columns (``service.db.Job``)."""

    stage: str | None
    target: str | None
    stage_detail: str | None
    percent: float


def stage_label(job: Staged) -> str | None:
    """Where a job is (or was last), in one line: ``cpu: fallback (8 tensors to int16)``."""
    if job.stage is None:
        return None
    return ProgressEvent(job.stage, job.percent / 100, job.target, job.stage_detail).label
