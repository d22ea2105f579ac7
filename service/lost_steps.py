"""Celery mode: steps that were sent to the broker but will not start there, found by the API's
reconciler (``service.worker.celery_queue``) within the lease instead of the broker's visibility
timeout.

A step that started has a heartbeat of its own (``jobs.recover_lost``,
``job_targets.lost_targets``, ``job_targets.reports_due``); these are the ones between: sent,
and received by a worker that died before it claimed them (its message waits, unacknowledged,
for half an hour), or sent and lost by the broker. Two signs, both from the workers' records
(``service.workers``):

- a dead worker's record says which steps it held: each one not yet started is sent again;
- a worker idle for longer than the lease means the broker has nothing for it: a step sent
  before then, not started and held by no live worker, is sent again (a worker killed before
  it wrote what it received, a message lost by the broker).

Sending again is always safe: the claim on the step's record decides who runs it, and a late
original message finds it claimed or done and exits (``service.worker.celery_tasks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from . import workers
from .db import Job, JobTarget
from .job_targets import QUEUED, TARGETS, Step, run_unended
from .jobs import Claim, stale_before
from .worker.celery_dispatch import REPORT_TASK, START_TASK, TARGET_TASK
from .workers import Held


@dataclass
class Resend:
    """Steps to send again: jobs to start, targets to build, reports to assemble."""

    starts: list[str] = field(default_factory=list)
    targets: list[Step] = field(default_factory=list)
    reports: list[Claim] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.starts or self.targets or self.reports)

    def add(self, other: Resend) -> None:
        self.starts += [s for s in other.starts if s not in self.starts]
        self.targets += [t for t in other.targets if t not in self.targets]
        self.reports += [r for r in other.reports if r not in self.reports]


def of_dead_workers(session: Session, lease_s: float) -> tuple[Resend, list[str]]:
    """What the workers dead for longer than the lease held and no one started: to send again
    (their records are dropped: each is acted on once). Also the dead workers' names (logs)."""
    resend, names = Resend(), []
    for worker in workers.dead(session, lease_s):
        names.append(worker.name)
        resend.add(_unstarted(session, [(task, tuple(args)) for task, args in worker.held]))
        workers.forget(session, worker.name)
    return resend, names


def stranded(session: Session, lease_s: float) -> Resend:
    """Steps sent longer than a lease ago, not started and held by no live worker, while a
    live worker has been idle for longer than the lease (else they may only be waiting their
    turn at the broker)."""
    if not workers.one_idle_for(session, lease_s):
        return Resend()
    before = stale_before(lease_s)
    starts = session.scalars(
        select(Job.id).where(Job.state == "queued", Job.dispatched_at < before).order_by(Job.seq)
    )
    targets = session.execute(
        select(JobTarget.job_id, JobTarget.run, JobTarget.name)
        .join(Job, and_(Job.id == JobTarget.job_id, Job.attempts == JobTarget.run))
        .where(JobTarget.state == QUEUED, JobTarget.dispatched_at < before,
               Job.state == "running")
        .order_by(JobTarget.id)
    )  # fmt: skip
    reports = session.execute(
        select(Job.id, Job.attempts).where(
            Job.state == "running", Job.phase == TARGETS, Job.dispatched_at < before, ~run_unended()
        )
    )
    held = workers.held_by_live(session, lease_s)
    return Resend(
        starts=[i for i in starts if (START_TASK, (i,)) not in held],
        targets=[tuple(t) for t in targets if (TARGET_TASK, tuple(t)) not in held],
        reports=[Claim(i, r) for i, r in reports if (REPORT_TASK, (i, r)) not in held],
    )  # type: ignore[misc]


def _unstarted(session: Session, held: list[Held]) -> Resend:
    """Of the steps a dead worker held, those still waiting to start (one that started beats,
    and its own lease recovers it)."""
    resend = Resend()
    for task, args in held:
        if task == START_TASK and len(args) == 1:
            state = session.scalar(select(Job.state).where(Job.id == args[0]))
            if state == "queued":
                resend.starts.append(args[0])
        elif task == TARGET_TASK and len(args) == 3:
            job_id, run, name = args
            state = session.scalar(
                select(JobTarget.state)
                .join(Job, and_(Job.id == JobTarget.job_id, Job.attempts == JobTarget.run))
                .where(JobTarget.job_id == job_id, JobTarget.run == run,
                       JobTarget.name == name, Job.state == "running")
            )  # fmt: skip
            if state == QUEUED:
                resend.targets.append((job_id, run, name))
        elif task == REPORT_TASK and len(args) == 2:
            due = session.scalar(
                select(Job.id).where(Job.id == args[0], Job.attempts == args[1],
                                     Job.state == "running", Job.phase == TARGETS, ~run_unended())
            )  # fmt: skip
            if due is not None:
                resend.reports.append(Claim(*args))
    return resend
