"""A job's run as steps in the database, on SQLite and on a real PostgreSQL 15 (as
tests/test_service_jobs.py): the fair order jobs start in between tokens, and Celery mode's
targets of a run (``service.job_targets``): each claimed once, beaten, taken over alone when
its worker went silent (or ended with the reason after its attempts), the job's progress the
sum of its targets', its report claimed once when the last one ended; the migration that adds
them, up and down."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import inspect, select, update

from converters.progress import ProgressEvent
from service import job_targets, jobs, tokens
from service.db import Job, JobTarget, get_engine, session_scope, upgrade
from service.db.migrate import downgrade
from service.job_targets import TargetClaim
from service.schemas import JobOut

from .test_service_jobs import _claim, _claim_by_id, _queue

LEASE_S = 60.0
RESEND_S = 600.0


def test_jobs_start_in_turns_between_tokens(settings):
    """One token's three queued jobs delay another's (and an anonymous one) by one job, not
    by all three: round robin between tokens, each token's own jobs in their order."""
    alice, _ = tokens.create_token(settings, "alice")
    bob, _ = tokens.create_token(settings, "bob")
    mine = _queue(settings, 3, alice.id)
    (theirs,) = _queue(settings, 1, bob.id)
    (anonymous,) = _queue(settings, 1)
    with session_scope(settings) as session:
        assert [jobs.queued_count(session, t) for t in (alice.id, bob.id, None)] == [3, 1, 1]
    order = [_claim(settings).job_id for _ in range(5)]
    assert order == [mine[0], theirs, anonymous, mine[1], mine[2]]
    assert _claim(settings) is None


def _target(settings, job_id: str, name: str, max_attempts: int = 2):
    with session_scope(settings) as session:
        return job_targets.claim_target(session, job_id, 1, name, LEASE_S, max_attempts)


def _silence_target(settings, job_id: str, name: str) -> None:
    """As if the worker building it had died an hour ago (no waiting out a real lease)."""
    then = datetime.now(UTC) - timedelta(hours=1)
    with session_scope(settings) as session:
        session.execute(
            update(JobTarget)
            .where(JobTarget.job_id == job_id, JobTarget.name == name)
            .values(heartbeat_at=then, started_at=then)
        )


def _end_long_ago(settings, job_id: str) -> None:
    """As if the job's targets had all ended an hour ago."""
    then = datetime.now(UTC) - timedelta(hours=1)
    with session_scope(settings) as session:
        session.execute(update(JobTarget).where(JobTarget.job_id == job_id).values(updated_at=then))


def _prepared_run(settings, names: list[str]) -> jobs.Claim:
    """A job whose first step ended: its targets recorded, queued."""
    (job_id,) = _queue(settings, 1)
    run = _claim_by_id(settings, job_id)
    with session_scope(settings) as session:
        assert job_targets.fan_out(session, run, names)
        assert job_targets.queued_of_run(session, run) == [(job_id, 1, n) for n in names]
    return run


def test_a_target_is_built_once_and_taken_over_alone_when_its_worker_goes_silent(settings):
    run = _prepared_run(settings, ["cpu", "tda4vm"])
    job_id = run.job_id
    cpu = _target(settings, job_id, "cpu")
    assert cpu == TargetClaim(job_id, 1, "cpu", 1)
    assert _target(settings, job_id, "cpu") == "busy"  # a second delivery waits
    with session_scope(settings) as session:
        assert job_targets.target_progress(session, cpu, ProgressEvent("quantize", 0.5))
        job = jobs.get(session, job_id, None)
    # the job's progress is the sum of its targets': (0.5 + 0) of 90 points after 5
    assert (job.percent, job.stage, job.target) == (27.5, "quantize", "cpu")
    _silence_target(settings, job_id, "cpu")  # its worker died
    again = _target(settings, job_id, "cpu")
    assert again == TargetClaim(job_id, 1, "cpu", 2)
    tda4vm = _target(settings, job_id, "tda4vm")
    with session_scope(settings) as session:
        assert not job_targets.target_heartbeat(session, cpu)  # the lost build learns it
        assert not job_targets.end_target(session, cpu)  # and cannot write
        assert job_targets.end_target(session, tda4vm)
        assert not job_targets.claim_report(session, run, LEASE_S)  # cpu still builds
        assert job_targets.target_progress(session, again, ProgressEvent("latency", 0.8))
        assert jobs.get(session, job_id, None).percent == 86.0  # (0.8 + 1) of 90, after 5
        assert job_targets.end_target(session, again)
        assert job_targets.all_ended(session, job_id, 1)
        assert job_targets.failures(session, job_id, 1) == {}
        assert job_targets.claim_report(session, run, LEASE_S)  # the report: once
        assert not job_targets.claim_report(session, run, LEASE_S)
        job = jobs.get(session, job_id, None)
    assert (job.state, job.phase, job.attempts) == ("running", "report", 1)
    assert JobOut.of(job, "").attempts == 2  # the cpu target ran twice


def test_a_target_silent_after_its_attempts_ends_with_the_reason(settings):
    run = _prepared_run(settings, ["cpu", "tda4vm"])
    job_id = run.job_id
    assert _target(settings, job_id, "cpu", max_attempts=1) != "busy"
    _silence_target(settings, job_id, "cpu")
    assert _target(settings, job_id, "cpu", max_attempts=1) == "gone"
    assert _target(settings, job_id, "tda4vm") != "busy"
    _silence_target(settings, job_id, "tda4vm")
    with session_scope(settings) as session:  # the reconciler: queued again, to be sent
        assert job_targets.lost_targets(session, LEASE_S, 2) == ([(job_id, 1, "tda4vm")], 0)
        assert job_targets.unsent_targets(session, quiet_s=-1) == [(job_id, 1, "tda4vm")]
        job_targets.mark_sent(session, [(job_id, 1, "tda4vm")])
        assert job_targets.unsent_targets(session, quiet_s=-1) == []
        assert job_targets.failures(session, job_id, 1) == {
            "cpu": "its worker was lost while it built, 1 time(s) (the limit is 1, "
            "EDGE_UN_MAX_ATTEMPTS)"
        }
        assert job_targets.reports_due(session, LEASE_S, RESEND_S) == []
    tda4vm = _target(settings, job_id, "tda4vm")
    with session_scope(settings) as session:
        assert job_targets.end_target(session, tda4vm)
        # just ended: the worker that ended it sends the report itself (it has a lease to)
        assert job_targets.reports_due(session, LEASE_S, RESEND_S) == []
    _end_long_ago(settings, job_id)  # and nothing was sent since
    with session_scope(settings) as session:
        assert job_targets.reports_due(session, LEASE_S, RESEND_S) == [run]
        job_targets.mark_report_sent(session, run)
        # sent: it may wait behind other steps at the broker; no second copy until RESEND_S
        assert job_targets.reports_due(session, LEASE_S, RESEND_S) == []
        assert job_targets.reports_due(session, LEASE_S, resend_s=-1) == [run]


def test_a_cancelled_run_stops_its_targets_and_sends_no_report(settings):
    run = _prepared_run(settings, ["cpu"])
    cpu = _target(settings, run.job_id, "cpu")
    with session_scope(settings) as session:
        assert jobs.cancel(session, run.job_id)
        assert not job_targets.target_heartbeat(session, cpu)  # its watchdog stops it
        assert not job_targets.target_progress(session, cpu, ProgressEvent("latency", 0.9))
        assert not job_targets.end_target(session, cpu)
        assert job_targets.steps_of_job(session, run.job_id) == [(run.job_id, 1, "cpu")]
    assert _target(settings, run.job_id, "cpu") == "gone"
    with session_scope(settings) as session:
        assert job_targets.reports_due(session, LEASE_S, resend_s=-1) == []
        assert job_targets.queued_targets(session) == []


def test_migration_0004_adds_the_targets_and_takes_them_away(settings):
    run = _prepared_run(settings, ["cpu"])
    downgrade(settings, "0003")
    with get_engine(settings).connect() as connection:
        schema = inspect(connection)
        assert "job_targets" not in schema.get_table_names()
        columns = {c["name"] for c in schema.get_columns("jobs")}
    assert not {"phase", "target_attempts"} & columns
    upgrade(settings)
    with session_scope(settings) as session:
        job = session.scalar(select(Job).where(Job.id == run.job_id))
        assert (job.state, job.phase, job.target_attempts) == ("running", None, 0)
        assert session.scalars(select(JobTarget)).all() == []
