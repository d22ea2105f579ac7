"""Celery mode: a job's targets, each built by any worker, and the step that reports them.

A run of a job is three steps (``quant.pipeline``): one worker prepares it (``jobs.claim``:
load, fold, export), then each target builds on whichever worker takes it, then one worker
assembles the report. When the first step ends, it records one :class:`~service.db.JobTarget`
per target (:func:`fan_out`); each is claimed, beaten and ended like a job, by conditional
UPDATEs (two deliveries of one target never both build it, a stale writer changes nothing), and
a target whose worker died is taken over after the lease and built again alone, or failed after
``max_attempts``. The job's progress is the sum of its targets' (``quant.pipeline.job_fraction``).
When the last target ends, the job moves to its report (:func:`claim_report`, once).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import ColumnElement, Exists, and_, exists, func, select, update
from sqlalchemy.orm import Session

from converters.progress import ProgressEvent

from .db import Job, JobTarget
from .db.models import utcnow
from .jobs import Busy, Claim, Gone, aware, stale_before

TARGETS = "targets"  # Job.phase while its targets build
REPORT = "report"  # Job.phase while one worker assembles its report
QUEUED, RUNNING, ENDED = "queued", "running", "ended"
Step = tuple[str, int, str]  # a target's job id, run and name: what its task carries


@dataclass(frozen=True)
class TargetClaim:
    """A target a worker took to build: its job's run, and this build's attempt."""

    job_id: str
    run: int
    name: str
    attempt: int

    @property
    def job(self) -> Claim:
        return Claim(self.job_id, self.run)


def _job_running(claim: Claim) -> list:
    return [Job.id == claim.job_id, Job.state == "running", Job.attempts == claim.attempt]


def _job_still_runs(job_id: str, run: int):
    return exists().where(Job.id == job_id, Job.state == "running", Job.attempts == run)


def _this_build(claim: TargetClaim) -> list:
    return [
        JobTarget.job_id == claim.job_id,
        JobTarget.run == claim.run,
        JobTarget.name == claim.name,
        JobTarget.attempts == claim.attempt,
        JobTarget.state == RUNNING,
        _job_still_runs(claim.job_id, claim.run),
    ]


def fan_out(session: Session, claim: Claim, names: list[str]) -> bool:
    """The run's first step ended: one queued record per target, and the job in its targets
    phase (its ``dispatched_at`` from here on: when its report's task was sent). False (and
    nothing recorded) if the job no longer runs this attempt."""
    moved = session.execute(
        update(Job)
        .where(*_job_running(claim))
        .values(phase=TARGETS, dispatched_at=None, updated_at=utcnow())
    )
    if moved.rowcount != 1:
        return False
    now = utcnow()
    session.add_all(
        JobTarget(job_id=claim.job_id, run=claim.attempt, name=name, state=QUEUED, attempts=0,
                  fraction=0.0, updated_at=now)
        for name in names
    )  # fmt: skip
    return True


def claim_target(
    session: Session, job_id: str, run: int, name: str, lease_s: float, max_attempts: int
) -> TargetClaim | Busy | Gone:
    """Take target ``name`` of run ``run`` to build it: queued, or running but silent for
    longer than ``lease_s`` (its worker died: the next attempt; after ``max_attempts`` it ends
    without a result, and "gone"). Each branch is one conditional UPDATE."""
    now = utcnow()
    mine = [JobTarget.job_id == job_id, JobTarget.run == run, JobTarget.name == name,
            _job_still_runs(job_id, run)]  # fmt: skip
    start = {"state": RUNNING, "attempts": JobTarget.attempts + 1, "started_at": now,
             "heartbeat_at": now, "updated_at": now, "stage": None, "stage_detail": None,
             "fraction": 0.0, "pid": None}  # fmt: skip
    silent = func.coalesce(JobTarget.heartbeat_at, JobTarget.started_at) < stale_before(lease_s)
    again = and_(JobTarget.state == RUNNING, silent, JobTarget.attempts < max_attempts)
    for state_is in (JobTarget.state == QUEUED, again):
        taken = session.execute(
            update(JobTarget).where(*mine, state_is).values(**start).returning(JobTarget.attempts)
        ).first()
        if taken is not None:
            _count_attempt(session, job_id, taken[0])
            return TargetClaim(job_id, run, name, taken[0])
    row = session.execute(
        select(JobTarget.state, JobTarget.attempts, JobTarget.heartbeat_at).where(*mine)
    ).first()
    if row is None or row[0] != RUNNING:
        return "gone"
    if row[2] is not None and aware(row[2]) >= stale_before(lease_s):
        return "busy"
    if row[1] >= max_attempts:  # silent, and it had all its runs
        lost = TargetClaim(job_id, run, name, row[1])
        message = (
            f"its worker was lost while it built, {row[1]} time(s) (the limit is "
            f"{max_attempts}, EDGE_UN_MAX_ATTEMPTS)"
        )
        end_target(session, lost, message)
        return "gone"
    return "busy"  # another claimer took it over just now


def _count_attempt(session: Session, job_id: str, attempt: int) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.target_attempts < attempt)
        .values(target_attempts=attempt)
    )


def set_target_pid(session: Session, claim: TargetClaim, pid: int) -> None:
    """The process that builds it, also as its job's (the one a cancel or test looks at)."""
    session.execute(update(JobTarget).where(*_this_build(claim)).values(pid=pid))
    session.execute(update(Job).where(*_job_running(claim.job)).values(pid=pid))


def target_progress(session: Session, claim: TargetClaim, event: ProgressEvent) -> bool:
    """Record where a target's build is (``event.fraction``: of its own build), and the job's
    progress as the sum of its targets'; False if it no longer builds this attempt."""
    from quant.pipeline import job_fraction

    now = utcnow()
    moved = session.execute(
        update(JobTarget)
        .where(*_this_build(claim))
        .values(
            stage=event.stage[:200],
            stage_detail=None if event.detail is None else event.detail[:200],
            fraction=min(max(event.fraction, 0.0), 1.0),
            heartbeat_at=now,
            updated_at=now,
        )
    )
    if moved.rowcount != 1:
        return False
    fractions = session.scalars(
        select(JobTarget.fraction).where(
            JobTarget.job_id == claim.job_id, JobTarget.run == claim.run
        )
    ).all()
    session.execute(
        update(Job)
        .where(*_job_running(claim.job), Job.phase == TARGETS)
        .values(
            stage=event.stage[:200],
            target=claim.name,
            stage_detail=None if event.detail is None else event.detail[:200],
            percent=round(100 * job_fraction(list(fractions)), 1),
            updated_at=now,
        )
    )
    return True


def target_heartbeat(session: Session, claim: TargetClaim) -> bool:
    """A target's build proves it is alive; False if it no longer builds this attempt (its job
    was cancelled, failed or taken over, or its build was)."""
    moved = session.execute(
        update(JobTarget).where(*_this_build(claim)).values(heartbeat_at=utcnow())
    )
    return moved.rowcount == 1


def end_target(session: Session, claim: TargetClaim, error: str | None = None) -> bool:
    """A target's build ended: with its part written (``error`` None), or without one, and
    why. False if it no longer builds this attempt."""
    values = {"state": ENDED, "error": None if error is None else error[:2000], "pid": None}
    moved = session.execute(
        update(JobTarget)
        .where(*_this_build(claim))
        .values(**values, fraction=1.0, updated_at=utcnow())
    )
    return moved.rowcount == 1


def ended_itself(session: Session, claim: TargetClaim) -> bool:
    """Whether this build recorded its own end (between two heartbeats)."""
    state = session.execute(
        select(JobTarget.state).where(
            JobTarget.job_id == claim.job_id, JobTarget.run == claim.run,
            JobTarget.name == claim.name, JobTarget.attempts == claim.attempt,
        )
    ).scalar()  # fmt: skip
    return state == ENDED


def stage_label_of(session: Session, claim: TargetClaim) -> str | None:
    """Where the target's build last was, as a job's stage reads (``cpu: fallback (...)``)."""
    row = session.execute(
        select(JobTarget.stage, JobTarget.fraction, JobTarget.stage_detail).where(
            JobTarget.job_id == claim.job_id, JobTarget.run == claim.run,
            JobTarget.name == claim.name,
        )
    ).first()  # fmt: skip
    if row is None or row[0] is None:
        return None
    return ProgressEvent(row[0], row[1], claim.name, row[2]).label


def steps_of_job(session: Session, job_id: str) -> list[Step]:
    """The targets of the job's current run (none before its first step ended)."""
    rows = session.execute(
        select(JobTarget.job_id, JobTarget.run, JobTarget.name)
        .join(Job, and_(Job.id == JobTarget.job_id, Job.attempts == JobTarget.run))
        .where(JobTarget.job_id == job_id)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def queued_of_run(session: Session, claim: Claim) -> list[Step]:
    """The run's targets still to be sent (just after its first step recorded them)."""
    names = session.scalars(
        select(JobTarget.name)
        .where(JobTarget.job_id == claim.job_id, JobTarget.run == claim.attempt,
               JobTarget.state == QUEUED)
        .order_by(JobTarget.id)
    )  # fmt: skip
    return [(claim.job_id, claim.attempt, name) for name in names]


def all_ended(session: Session, job_id: str, run: int) -> bool:
    """Whether every target of the run ended (then its report is due)."""
    left = select(func.count()).where(
        JobTarget.job_id == job_id, JobTarget.run == run, JobTarget.state != ENDED
    )
    return session.scalar(left) == 0


def failures(session: Session, job_id: str, run: int) -> dict[str, str]:
    """The targets of the run that ended without a part, and why (for the report)."""
    rows = session.execute(
        select(JobTarget.name, JobTarget.error).where(
            JobTarget.job_id == job_id, JobTarget.run == run, JobTarget.error.is_not(None)
        )
    )
    return {name: error for name, error in rows}


def claim_report(session: Session, claim: Claim, lease_s: float) -> bool:
    """Take the run's last step, assembling its report: once every target ended, or again when
    the worker that had it went silent for longer than ``lease_s``. One conditional UPDATE."""
    unended = exists().where(
        JobTarget.job_id == claim.job_id, JobTarget.run == claim.attempt, JobTarget.state != ENDED
    )
    stale = and_(Job.phase == REPORT, Job.heartbeat_at < stale_before(lease_s))
    now = utcnow()
    taken = session.execute(
        update(Job)
        .where(*_job_running(claim), (Job.phase == TARGETS) | stale, ~unended)
        .values(
            phase=REPORT,
            heartbeat_at=now,
            updated_at=now,
            stage=REPORT,
            target=None,
            stage_detail=None,
        )
    )
    return taken.rowcount == 1


# -- what the reconciler recovers (``service.worker.celery_queue``) ------------------------------


def lost_targets(session: Session, lease_s: float, max_attempts: int) -> tuple[list[Step], int]:
    """Running targets silent for longer than the lease (their worker died, and no redelivery
    took them over): queued again to be sent (the steps returned), or ended without a result
    once they used ``max_attempts`` (how many)."""
    silent = session.execute(
        select(JobTarget.job_id, JobTarget.run, JobTarget.name, JobTarget.attempts).where(
            JobTarget.state == RUNNING,
            func.coalesce(JobTarget.heartbeat_at, JobTarget.started_at) < stale_before(lease_s),
        )
    ).all()
    requeued, ended = [], 0
    for job_id, run, name, attempts in silent:
        if attempts >= max_attempts:
            outcome = claim_target(session, job_id, run, name, lease_s, max_attempts)
            ended += outcome == "gone"
            continue
        moved = session.execute(
            update(JobTarget)
            .where(JobTarget.job_id == job_id, JobTarget.run == run, JobTarget.name == name,
                   JobTarget.attempts == attempts, JobTarget.state == RUNNING,
                   _job_still_runs(job_id, run))
            .values(state=QUEUED, dispatched_at=None, pid=None, updated_at=utcnow())
        )  # fmt: skip
        if moved.rowcount == 1:
            requeued.append((job_id, run, name))
    return requeued, ended


def unsent_targets(session: Session, quiet_s: float) -> list[Step]:
    """Queued targets with no task at the broker (sending failed, or they were queued again),
    untouched for ``quiet_s``."""
    rows = session.execute(
        select(JobTarget.job_id, JobTarget.run, JobTarget.name)
        .where(
            JobTarget.state == QUEUED,
            JobTarget.dispatched_at.is_(None),
            JobTarget.updated_at < utcnow() - timedelta(seconds=quiet_s),
            _job_still_runs(JobTarget.job_id, JobTarget.run),
        )
        .order_by(JobTarget.id)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def queued_targets(session: Session) -> list[Step]:
    """Every queued target of a running job (sent again when the API starts)."""
    rows = session.execute(
        select(JobTarget.job_id, JobTarget.run, JobTarget.name)
        .where(JobTarget.state == QUEUED, _job_still_runs(JobTarget.job_id, JobTarget.run))
        .order_by(JobTarget.id)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def mark_sent(session: Session, steps: list[Step]) -> None:
    for job_id, run, name in steps:
        session.execute(
            update(JobTarget)
            .where(JobTarget.job_id == job_id, JobTarget.run == run, JobTarget.name == name,
                   JobTarget.state == QUEUED)
            .values(dispatched_at=utcnow())
        )  # fmt: skip


def mark_report_sent(session: Session, claim: Claim) -> None:
    session.execute(update(Job).where(*_job_running(claim)).values(dispatched_at=utcnow()))


def reports_due(session: Session, lease_s: float, resend_s: float) -> list[Claim]:
    """Runs whose targets all ended and whose report nobody is assembling, to be sent again:
    their last target's worker died before it sent the report's task (it has a lease to), or
    the report's worker died (sent again once its heartbeat is past the lease, a copy at most
    once a lease). A report sent (``mark_report_sent``) may be waiting behind other steps at
    the broker: it is sent again only ``resend_s`` later (each copy is a task for a worker, and
    copies sent faster than the workers dismiss them would pile up), or sooner when a worker
    idles meanwhile or its worker died holding it (``service.lost_steps``)."""
    just_ended = exists().where(_of_run(), JobTarget.updated_at >= stale_before(lease_s))
    unsent = Job.dispatched_at.is_(None) | (Job.dispatched_at < stale_before(resend_s))
    # a report whose worker went silent: sent again at once (its copy, if any, a lease later)
    stale = and_(
        Job.phase == REPORT,
        Job.heartbeat_at < stale_before(lease_s),
        Job.dispatched_at.is_(None) | (Job.dispatched_at < stale_before(lease_s)),
    )
    rows = session.execute(
        select(Job.id, Job.attempts).where(
            Job.state == "running", and_(Job.phase == TARGETS, unsent) | stale,
            ~run_unended(), ~just_ended,
        )
    )  # fmt: skip
    return [Claim(job_id, run) for job_id, run in rows]


def overdue(session: Session, timeout_s: float, grace_s: float) -> list[Claim]:
    """Runs past their time limit by more than ``grace_s`` in a phase whose workers would have
    stopped them (their targets wait at the broker with no worker free, or every worker died)."""
    rows = session.execute(
        select(Job.id, Job.attempts).where(
            Job.state == "running",
            Job.phase.in_((TARGETS, REPORT)),
            Job.started_at < utcnow() - timedelta(seconds=timeout_s + grace_s),
        )
    )
    return [Claim(job_id, run) for job_id, run in rows]


def run_unended() -> Exists:
    """SQL: the job's current run has a target that has not ended (its report is not due)."""
    return exists().where(_of_run(), JobTarget.state != ENDED)


def _of_run() -> ColumnElement[bool]:
    return and_(JobTarget.job_id == Job.id, JobTarget.run == Job.attempts)
