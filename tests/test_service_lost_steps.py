"""What the Celery-mode reconciler sends again that no heartbeat covers (``service.lost_steps``):
steps sent to a worker that died before it started them, and steps sent while a live worker
had nothing to do for longer than the lease. On real databases (SQLite and PostgreSQL), from
the records the workers and the steps write; no server, no broker."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from service import job_targets, jobs, lost_steps, workers
from service.db import Job, JobTarget, Worker, session_scope
from service.db.models import utcnow
from service.worker.celery_dispatch import REPORT_TASK, START_TASK, TARGET_TASK

LEASE = 6.0
LONG_AGO = timedelta(seconds=3 * LEASE)


def _job(session, targets=("cpu",)) -> str:
    job_id = jobs.new_job_id()
    request = jobs.NewJob(None, targets, 0.5, "onnx", "m.onnx")
    jobs.create(session, job_id, request)
    jobs.mark_dispatched(session, job_id)
    return job_id


def _prepared(session, targets=("cpu", "tda4vm")) -> jobs.Claim:
    """A job whose first step ended: its targets queued and sent."""
    job_id = _job(session, targets)
    claim = jobs.claim(session, job_id, LEASE, 2)
    assert isinstance(claim, jobs.Claim)
    assert job_targets.fan_out(session, claim, list(targets))
    job_targets.mark_sent(session, job_targets.queued_of_run(session, claim))
    return claim


def _age(session, model, seconds_ago: timedelta, *columns: str) -> None:
    session.execute(update(model).values({c: utcnow() - seconds_ago for c in columns}))


def test_what_a_dead_worker_held_and_nobody_started_is_sent_again(settings):
    with session_scope(settings) as session:
        waiting = _job(session)  # its start was received, the job never claimed
        run = _prepared(session)  # cpu received, not started; tda4vm building
        build = job_targets.claim_target(session, run.job_id, run.attempt, "tda4vm", LEASE, 2)
        assert isinstance(build, job_targets.TargetClaim)
        held = [(START_TASK, (waiting,)), (TARGET_TASK, (run.job_id, run.attempt, "cpu")),
                (TARGET_TASK, (run.job_id, run.attempt, "tda4vm")),
                (REPORT_TASK, (run.job_id, run.attempt))]  # fmt: skip
        workers.beat(session, "dead@host:1", held, None)
        workers.beat(session, "alive@host:2", [(START_TASK, ("other",))], None)
        session.execute(
            update(Worker).where(Worker.name == "dead@host:1").values(
                heartbeat_at=utcnow() - LONG_AGO)
        )  # fmt: skip
    with session_scope(settings) as session:
        resend, dead = lost_steps.of_dead_workers(session, LEASE)
    assert dead == ["dead@host:1"]
    assert resend.starts == [waiting]
    assert resend.targets == [(run.job_id, run.attempt, "cpu")]  # tda4vm beats: its own lease
    assert resend.reports == []  # not due: its targets have not ended
    with session_scope(settings) as session:  # acted on once: the dead worker's record is gone
        assert session.scalars(select(Worker.name)).all() == ["alive@host:2"]
        assert not lost_steps.of_dead_workers(session, LEASE)[0]


def test_a_held_report_is_sent_again_once_every_target_ended(settings):
    with session_scope(settings) as session:
        run = _prepared(session, ("cpu",))
        build = job_targets.claim_target(session, run.job_id, run.attempt, "cpu", LEASE, 2)
        assert job_targets.end_target(session, build)
        job_targets.mark_report_sent(session, run)
        workers.beat(session, "dead@host:1", [(REPORT_TASK, (run.job_id, run.attempt))], None)
        _age(session, Worker, LONG_AGO, "heartbeat_at")
    with session_scope(settings) as session:
        resend, _ = lost_steps.of_dead_workers(session, LEASE)
    assert resend.reports == [run]


def test_steps_sent_long_ago_are_sent_again_only_while_a_worker_idles(settings):
    with session_scope(settings) as session:
        queued = _job(session)
        run = _prepared(session, ("cpu", "tda4vm"))
        _age(session, Job, LONG_AGO, "dispatched_at")
        _age(session, JobTarget, LONG_AGO, "dispatched_at")
        # busy workers: the steps may only be waiting their turn at the broker
        workers.beat(session, "busy@host:1", [(START_TASK, ("x",))], None)
    with session_scope(settings) as session:
        assert not lost_steps.stranded(session, LEASE)
        # one idle for longer than the lease, another holding tda4vm: the rest is not coming
        workers.beat(session, "idle@host:2", [], utcnow() - LONG_AGO)
        tda4vm = (TARGET_TASK, (run.job_id, run.attempt, "tda4vm"))
        workers.beat(session, "busy@host:1", [tda4vm], None)
    with session_scope(settings) as session:
        resend = lost_steps.stranded(session, LEASE)
    assert resend.starts == [queued]
    assert resend.targets == [(run.job_id, run.attempt, "cpu")]
    with session_scope(settings) as session:  # sent again now: not again before a lease
        jobs.mark_dispatched(session, queued)
        job_targets.mark_sent(session, resend.targets)
        assert not lost_steps.stranded(session, LEASE)


def test_a_report_whose_worker_went_silent_is_sent_again_at_once(settings):
    """Its first copy was sent when the targets ended; the report's own heartbeat going stale
    sends it again, not the broker's visibility timeout later."""
    with session_scope(settings) as session:
        run = _prepared(session, ("cpu",))
        build = job_targets.claim_target(session, run.job_id, run.attempt, "cpu", LEASE, 2)
        assert job_targets.end_target(session, build)
        job_targets.mark_report_sent(session, run)
        assert job_targets.claim_report(session, run, LEASE)
        _age(session, Job, LONG_AGO, "heartbeat_at", "dispatched_at")
        _age(session, JobTarget, LONG_AGO, "updated_at")
    with session_scope(settings) as session:
        assert job_targets.reports_due(session, LEASE, resend_s=3600) == [run]
        job_targets.mark_report_sent(session, run)
        assert job_targets.reports_due(session, LEASE, resend_s=3600) == []
