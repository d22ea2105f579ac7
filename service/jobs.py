"""Job records and their state machine: queued -> running -> succeeded | partial | failed |
cancelled (``service.job_states``).

The database is the queue: a job is accepted only once its row is committed, a dispatcher
claims the oldest queued row with one conditional UPDATE (two claimers can never both win),
and everything a job process writes is conditional on the job still running the attempt it
was started for. Plain functions over a SQLAlchemy session; no HTTP here.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from sqlalchemy import ColumnElement, ScalarSelect, delete, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from converters.progress import ProgressEvent
from converters.source import ModelFormat

from .db import Job, JobStage, JobTarget
from .db.models import utcnow
from .job_states import FINISHED, STATES, TRANSITIONS, State, stage_label


@dataclass(frozen=True)
class NewJob:
    """What an accepted upload asks for."""

    token_id: int | None
    targets: tuple[str, ...]  # the profiles' names
    max_drift: float
    model_format: ModelFormat
    model_label: str
    config_label: str | None = None
    calib_label: str | None = None
    eval_label: str | None = None
    upload_bytes: int = 0


@dataclass(frozen=True)
class Claim:
    """A job a dispatcher took to run: its id and the attempt number this run is."""

    job_id: str
    attempt: int


def new_job_id() -> str:
    return uuid.uuid4().hex


def create(session: Session, job_id: str, request: NewJob) -> Job:
    now = utcnow()
    job = Job(
        id=job_id,
        state="queued",
        percent=0.0,
        attempts=0,
        created_at=now,
        updated_at=now,
        **{**request.__dict__, "targets": list(request.targets)},
    )
    session.add(job)
    session.flush()
    return job


def _owned_by(token_id: int | None):
    return Job.token_id.is_(None) if token_id is None else Job.token_id == token_id


def get(session: Session, job_id: str, token_id: int | None) -> Job | None:
    """The job if it exists and belongs to this token (anonymous jobs belong to None)."""
    return session.scalar(select(Job).where(Job.id == job_id, _owned_by(token_id)))


def page(session: Session, token_id: int | None, limit: int, offset: int) -> tuple[list[Job], int]:
    """A token's jobs, newest first, and how many it has."""
    mine = _owned_by(token_id)
    rows = session.scalars(
        select(Job).where(mine).order_by(Job.seq.desc()).limit(limit).offset(offset)
    )
    total = session.scalar(select(func.count()).select_from(Job).where(mine)) or 0
    return list(rows), total


def counts_by_state(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.state, func.count()).group_by(Job.state))
    counts = dict.fromkeys(STATES, 0)
    counts.update({state: count for state, count in rows})
    return counts


def _move(
    session: Session, job_id: str, to: State, *, attempt: int | None = None, **values: object
) -> bool:
    """Move a job to ``to`` only from a state that allows it (and, for a job process, only
    while it runs the given attempt). True if this call made the move."""
    allowed = [s for s, targets in TRANSITIONS.items() if to in targets]
    where = [Job.id == job_id, Job.state.in_(allowed)]
    if attempt is not None:
        where += [Job.state == "running", Job.attempts == attempt]
    now = utcnow()
    if to in FINISHED:
        values.setdefault("finished_at", now)
    result = session.execute(update(Job).where(*where).values(state=to, updated_at=now, **values))
    return result.rowcount == 1


def _fair_order() -> tuple[ColumnElement, ...]:
    """The order queued jobs start in: round robin between tokens (the token whose last job
    started longest ago first, one that never started any before all), each token's own jobs
    first come, first served. One token's 50 queued jobs then delay another's one job by at
    most one job, never by all 50."""
    other = aliased(Job)
    last_start = (
        select(func.max(other.started_at))
        .where(other.token_id.is_not_distinct_from(Job.token_id))
        .scalar_subquery()
    )
    return last_start.asc().nulls_first(), Job.seq.asc()


def claim_next(session: Session, phase: str | None = None) -> Claim | None:
    """Take the next queued job in the fair order (``_fair_order``); None only if none is
    queued. ``phase``: Celery mode's first step of the run (``PREPARE``).

    A claimer that loses the fairest job to another (PostgreSQL: its UPDATE waited on that
    row's lock, then found it running) takes the next one: each Celery start message must
    start a job while one waits, or the job it was sent for stays queued with no message
    left to start it (seen once in the ten-job test: a job queued for 10 min). Each pass
    either claims or finds a job another claimer took, so the loop ends."""
    fairest = (
        select(Job.seq).where(Job.state == "queued").order_by(*_fair_order()).limit(1)
    ).scalar_subquery()
    while True:  # the UPDATE first: on SQLite a read would make it a lock upgrade
        claimed = _claim_fairest(session, fairest, phase)
        queued = select(Job.seq).where(Job.state == "queued").limit(1)
        if claimed is not None or session.scalar(queued) is None:
            return claimed


def _claim_fairest(session: Session, fairest: ScalarSelect, phase: str | None) -> Claim | None:
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.seq == fairest, Job.state == "queued")
        .values(
            state="running",
            attempts=Job.attempts + 1,
            started_at=now,
            updated_at=now,
            stage="starting",
            target=None,
            stage_detail=None,
            percent=0.0,
            pid=None,
            heartbeat_at=now,
            phase=phase,
        )
        .returning(Job.id, Job.attempts)
    )
    row = result.first()
    return None if row is None else Claim(row[0], row[1])


def queued_count(session: Session, token_id: int | None) -> int:
    """How many of a token's jobs wait to start (its queue, which EDGE_UN_MAX_QUEUED limits)."""
    mine = select(func.count()).select_from(Job).where(Job.state == "queued", _owned_by(token_id))
    return session.scalar(mine) or 0


def set_pid(session: Session, claim: Claim, pid: int) -> None:
    session.execute(
        update(Job)
        .where(Job.id == claim.job_id, Job.attempts == claim.attempt, Job.state == "running")
        .values(pid=pid)
    )


def progress(session: Session, claim: Claim, event: ProgressEvent) -> bool:
    """Record where a running job is, as the pipeline reported it; False if it no longer runs
    this attempt."""
    result = session.execute(
        update(Job)
        .where(Job.id == claim.job_id, Job.attempts == claim.attempt, Job.state == "running")
        .values(
            stage=event.stage[:200],
            target=event.target,
            stage_detail=None if event.detail is None else event.detail[:200],
            percent=round(min(max(100 * event.fraction, 0.0), 100.0), 1),
            updated_at=utcnow(),
        )
    )
    return result.rowcount == 1


def record_stages(session: Session, job_id: str, stages: Sequence[tuple[str, float]]) -> None:
    session.add_all(JobStage(job_id=job_id, stage=s[:64], seconds=t) for s, t in stages)


def succeed(session: Session, claim: Claim, failures: str | None = None) -> bool:
    """The run published its report and artifacts: ``succeeded``, or ``partial`` when some
    targets failed (``failures``: which, and why)."""
    return _move(
        session,
        claim.job_id,
        "succeeded" if failures is None else "partial",
        attempt=claim.attempt,
        stage="done",
        target=None,
        stage_detail=None,
        percent=100.0,
        error=None if failures is None else failures[:2000],
    )


def fail(session: Session, claim: Claim, error: str) -> bool:
    return _move(session, claim.job_id, "failed", attempt=claim.attempt, error=error[:2000])


def requeue(session: Session, claim: Claim, *, count_attempt: bool = True) -> bool:
    """Put a running job back at its place in the queue (a graceful shutdown does not count
    the interrupted run as an attempt)."""
    attempts = claim.attempt if count_attempt else claim.attempt - 1
    return _move(
        session,
        claim.job_id,
        "queued",
        attempt=claim.attempt,
        attempts=attempts,
        stage=None,
        target=None,
        stage_detail=None,
        percent=0.0,
        pid=None,
        started_at=None,
        heartbeat_at=None,
        dispatched_at=None,
        phase=None,
    )


def cancel(session: Session, job_id: str) -> bool:
    """Cancel a queued or running job (a running job's process is then stopped by the queue)."""
    return _move(session, job_id, "cancelled", error="cancelled by the client")


def remove(session: Session, job_id: str) -> bool:
    """Delete a finished job's record and its targets' (its files are the store's to
    delete)."""
    result = session.execute(delete(Job).where(Job.id == job_id, Job.state.in_(FINISHED)))
    if result.rowcount != 1:
        return False
    session.execute(delete(JobTarget).where(JobTarget.job_id == job_id))
    return True


def cancel_or_remove(session: Session, job_id: str) -> Literal["cancelled", "removed"] | None:
    """A DELETE's move, in one transaction of conditional statements: cancel the job if it is
    queued or running, else remove its record if it finished (also if it finished a moment
    ago); None if it is gone."""
    if cancel(session, job_id):
        return "cancelled"
    return "removed" if remove(session, job_id) else None


def running(session: Session) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.state == "running").order_by(Job.seq)))


def state_of(session: Session, job_id: str) -> tuple[str, int] | None:
    row = session.execute(select(Job.state, Job.attempts).where(Job.id == job_id)).first()
    return None if row is None else (row[0], row[1])


def started_at(session: Session, job_id: str) -> datetime | None:
    """When the job's current run started (its time limit counts from then)."""
    return session.scalar(select(Job.started_at).where(Job.id == job_id))


def stage_of(session: Session, job_id: str) -> str | None:
    """The last stage a job recorded, as :func:`stage_label` (None before its first, or if
    the job is gone)."""
    job = session.scalar(select(Job).where(Job.id == job_id))
    return None if job is None else stage_label(job)


def recover(session: Session, max_attempts: int) -> tuple[list[str], list[str]]:
    """At start-up, before any job runs: every job left running by a dead server is queued
    again at its old place, or failed with the reason once it used its attempts.
    Returns (requeued ids, failed ids)."""
    return _requeue_or_fail(session, running(session), max_attempts, "the server stopped")


def _requeue_or_fail(
    session: Session, lost: Sequence[Job], max_attempts: int, what: str
) -> tuple[list[str], list[str]]:
    requeued, failed = [], []
    for job in lost:
        claim = Claim(job.id, job.attempts)
        if job.attempts >= max_attempts:
            message = (
                f"{what} while this job ran, {job.attempts} time(s) (the limit is "
                f"{max_attempts}); submit it again"
            )
            if fail(session, claim, message):
                failed.append(job.id)
        elif requeue(session, claim):
            requeued.append(job.id)
    return requeued, failed


# -- Celery mode: claims by id, heartbeats, lost runs, dispatch bookkeeping -----------------
PREPARE = "prepare"  # a run's first step (Job.phase): load, fold, export, on one worker
Busy = Literal["busy"]  # running under a live heartbeat: another delivery of the same job
Gone = Literal["gone"]  # finished, cancelled or deleted: nothing to run


def stale_before(lease_s: float) -> datetime:
    return utcnow() - timedelta(seconds=lease_s)


def _last_sign_of_life() -> ColumnElement[datetime]:
    """A running job's last heartbeat, or its start if it has not beaten yet."""
    return func.coalesce(Job.heartbeat_at, Job.started_at)


def claim(session: Session, job_id: str, lease_s: float, max_attempts: int) -> Claim | Busy | Gone:
    """Take job ``job_id`` to run it: a queued job, or a running one whose first step (Celery
    mode's "prepare") went silent for longer than ``lease_s`` (its worker died: take it over as
    the next attempt, or fail it once it used ``max_attempts``); a run whose targets build has
    steps of their own to recover (``service.job_targets``). Every branch is one conditional
    UPDATE: two deliveries of the same job cannot both win."""
    now = utcnow()
    start = {"attempts": Job.attempts + 1, "started_at": now, "heartbeat_at": now,
             "updated_at": now, "stage": "starting", "target": None, "stage_detail": None,
             "percent": 0.0, "pid": None, "phase": PREPARE}  # fmt: skip
    taken = session.execute(
        update(Job).where(Job.id == job_id, Job.state == "queued")
        .values(state="running", **start).returning(Job.attempts)
    ).first()  # fmt: skip
    if taken is not None:
        return Claim(job_id, taken[0])
    row = session.execute(
        select(Job.state, Job.attempts, _last_sign_of_life(), Job.phase).where(Job.id == job_id)
    ).first()
    if row is None or row[0] != "running" or row[3] not in (None, PREPARE):
        return "gone"
    _, attempts, alive_at, _ = row
    if alive_at is not None and aware(alive_at) >= stale_before(lease_s):
        return "busy"
    if attempts >= max_attempts:
        _requeue_or_fail(session, [_job(session, job_id)], max_attempts, "its worker was lost")
        return "gone"
    taken = session.execute(
        update(Job).where(Job.id == job_id, Job.state == "running", Job.attempts == attempts,
                          _last_sign_of_life() < stale_before(lease_s))
        .values(**start).returning(Job.attempts)
    ).first()  # fmt: skip
    return "busy" if taken is None else Claim(job_id, taken[0])


def aware(moment: datetime) -> datetime:
    """A timestamp read through a SQL expression may come back without its (UTC) zone."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _job(session: Session, job_id: str) -> Job:
    return session.scalars(select(Job).where(Job.id == job_id)).one()


def heartbeat(session: Session, claim: Claim) -> bool:
    """A running job proves it is alive; False if it no longer runs this attempt."""
    result = session.execute(
        update(Job)
        .where(Job.id == claim.job_id, Job.attempts == claim.attempt, Job.state == "running")
        .values(heartbeat_at=utcnow())
    )
    return result.rowcount == 1


def recover_lost(
    session: Session, lease_s: float, max_attempts: int
) -> tuple[list[str], list[str]]:
    """Running jobs silent for longer than the lease (their worker died, and no redelivery
    took them over): queue them again, or fail them after ``max_attempts``."""
    silent = session.scalars(
        select(Job).where(
            Job.state == "running",
            _last_sign_of_life() < stale_before(lease_s),
            or_(Job.phase.is_(None), Job.phase == PREPARE),  # later steps beat elsewhere
        )
    )
    return _requeue_or_fail(session, list(silent), max_attempts, "its worker was lost")


def undispatched(session: Session, quiet_s: float) -> list[str]:
    """Queued jobs with no task at the broker (sending failed, or they were queued again),
    untouched for ``quiet_s`` (a job just recorded is being sent by its request right now)."""
    rows = session.scalars(
        select(Job.id)
        .where(
            Job.state == "queued",
            Job.dispatched_at.is_(None),
            Job.updated_at < utcnow() - timedelta(seconds=quiet_s),
        )
        .order_by(Job.seq)
    )
    return list(rows)


def queued_ids(session: Session) -> list[str]:
    return list(session.scalars(select(Job.id).where(Job.state == "queued").order_by(Job.seq)))


def mark_dispatched(session: Session, job_id: str) -> None:
    session.execute(
        update(Job).where(Job.id == job_id, Job.state == "queued").values(dispatched_at=utcnow())
    )


def timestamps(job: Job) -> dict[str, datetime | None]:
    return {
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "updated_at": job.updated_at,
    }
