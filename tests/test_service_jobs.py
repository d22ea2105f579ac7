"""The job records, the queue's claims, restart recovery, tokens, migrations and the artifact
store, on real databases and a real file system (no HTTP server).

Every database test runs twice: on SQLite (the default, one file) and on a real PostgreSQL 15
(the Celery mode's database, a fresh database per test from testbed). The claims are
conditional UPDATEs whose safety under concurrency is each engine's own locking: that is
tested on both, not assumed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text, update
from sqlalchemy.orm import Session

from converters.progress import ProgressEvent
from service import jobs, tokens
from service.db import Base, Job, Token, get_engine, session_scope, upgrade
from service.db.migrate import alembic_config, downgrade
from service.settings import Settings
from service.storage import LocalArtifactStore

Won = TypeVar("Won")


def _queue(settings: Settings, count: int, token_id: int | None = None) -> list[str]:
    ids = []
    with session_scope(settings) as session:
        for _ in range(count):
            job_id = jobs.new_job_id()
            request = jobs.NewJob(token_id, ("cpu",), 0.5, "safetensors", "m.safetensors")
            jobs.create(session, job_id, request)
            ids.append(job_id)
    return ids


def _claim(settings: Settings) -> jobs.Claim | None:
    with session_scope(settings) as session:
        return jobs.claim_next(session)


def _head_revision(settings: Settings) -> str:
    return ScriptDirectory.from_config(alembic_config(settings)).get_current_head()


def test_migrations_build_exactly_the_models(settings):
    upgrade(settings)  # idempotent
    with get_engine(settings).connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert set(inspect(connection).get_table_names()) >= {"tokens", "jobs", "job_stages"}
        version = "SELECT version_num FROM alembic_version"
        assert connection.exec_driver_sql(version).scalar() == _head_revision(settings)
        if connection.dialect.name == "sqlite":
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_migration_0003_turns_stored_target_lists_into_json_and_back(settings):
    """Jobs recorded before 0003 kept their targets as "cpu,imx93" ("" for every target): the
    migration turns each into a list of names (and its downgrade back), the progress columns
    come and go, and a queued job's uploads move to the names the job process reads now (a
    finished job's are not touched)."""
    downgrade(settings, "0002")
    row = (
        "INSERT INTO jobs (id, state, percent, attempts, targets, max_drift, model_format, "
        "model_label, upload_bytes, created_at, updated_at) VALUES (:id, :state, 0, 1, "
        ":targets, 0.5, 'onnx', 'm.onnx', 1, :now, :now)"
    )
    now = datetime(2026, 11, 20, 12, 0)
    jobs_before = (
        ("a1", "cpu,imx93", "succeeded"),
        ("b2", "", "queued"),
        ("c3", "tda4vm", "failed"),
    )
    with get_engine(settings).begin() as connection:
        for job_id, targets, state in jobs_before:
            values = {"id": job_id, "targets": targets, "state": state, "now": now}
            connection.execute(text(row), values)
    old_names = ["calib.npz", "model.onnx", "model.onnx.data"]
    for job_id in ("a1", "b2"):
        folder = settings.data_dir / "uploads" / job_id
        folder.mkdir(parents=True)
        for name in old_names:
            (folder / name).write_text(name)
    upgrade(settings)
    with session_scope(settings) as session:
        stored = {job.id: (job.targets, job.target, job.stage_detail) for job in
                  session.scalars(select(Job))}  # fmt: skip
    assert stored == {
        "a1": (["cpu", "imx93"], None, None),
        "b2": (["cpu", "imx93", "imx8mp", "tda4vm"], None, None),
        "c3": (["tda4vm"], None, None),
    }
    queued = settings.data_dir / "uploads" / "b2"
    assert sorted(p.name for p in queued.iterdir()) == ["calib", "model", "model.onnx.data"]
    assert (queued / "model").read_text() == "model.onnx"  # the model itself, moved
    finished = settings.data_dir / "uploads" / "a1"
    assert sorted(p.name for p in finished.iterdir()) == old_names
    downgrade(settings, "0002")
    with get_engine(settings).connect() as connection:
        back = dict(connection.execute(text("SELECT id, targets FROM jobs")).all())
        columns = {c["name"] for c in inspect(connection).get_columns("jobs")}
    assert back == {"a1": "cpu,imx93", "b2": "cpu,imx93,imx8mp,tda4vm", "c3": "tda4vm"}
    assert not {"target", "stage_detail"} & columns
    assert sorted(p.name for p in queued.iterdir()) == old_names
    upgrade(settings)


def test_claims_are_fifo_and_never_shared(settings):
    ids = _queue(settings, 12)
    claims: list[jobs.Claim] = []
    lock = threading.Lock()

    def claimer() -> None:
        while (claim := _claim(settings)) is not None:
            with lock:
                claims.append(claim)

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(c.job_id for c in claims) == sorted(ids)  # each once, none lost
    assert all(c.attempt == 1 for c in claims)
    with session_scope(settings) as session:
        assert jobs.counts_by_state(session)["running"] == 12


def test_claim_order_is_submission_order(settings):
    ids = _queue(settings, 3)
    assert [_claim(settings).job_id for _ in ids] == ids
    assert _claim(settings) is None


def test_a_stale_run_cannot_write(settings):
    (job_id,) = _queue(settings, 1)
    first = _claim(settings)
    with session_scope(settings) as session:
        jobs.recover(session, max_attempts=2)  # the server died: queued again
    second = _claim(settings)
    assert second == jobs.Claim(job_id, 2)
    with session_scope(settings) as session:
        assert not jobs.progress(session, first, ProgressEvent("load", 0.1))
        assert not jobs.succeed(session, first)
        assert jobs.progress(session, second, ProgressEvent("load", 0.1))
        assert jobs.succeed(session, second)
        assert not jobs.fail(session, second, "too late")  # finished is final
        assert jobs.state_of(session, job_id) == ("succeeded", 2)


def test_recovery_requeues_then_fails_after_max_attempts(settings):
    ids = _queue(settings, 2)
    for _ in range(2):
        assert _claim(settings) is not None
    with session_scope(settings) as session:
        assert jobs.recover(session, max_attempts=2) == (ids, [])
        states = [jobs.state_of(session, i) for i in ids]
    assert states == [("queued", 1), ("queued", 1)]
    assert [_claim(settings).job_id for _ in ids] == ids  # the old order is kept
    with session_scope(settings) as session:
        assert jobs.recover(session, max_attempts=2) == ([], ids)
        job = jobs.get(session, ids[0], None)
    assert job.state == "failed" and "the server stopped while this job ran" in job.error
    assert job.finished_at is not None


def test_timestamps_read_back_as_the_utc_moments_written(settings):
    """Written as aware UTC, read back aware and equal, whatever the database server's own
    time zone (the PostgreSQL of testbed runs at UTC+12:45)."""
    before = datetime.now(UTC).replace(microsecond=0)
    (job_id,) = _queue(settings, 1)
    _claim(settings)
    after = datetime.now(UTC) + timedelta(seconds=1)
    with session_scope(settings) as session:
        job = jobs.get(session, job_id, None)
    for moment in (job.created_at, job.started_at, job.updated_at):
        assert moment.utcoffset() == timedelta(0)
        assert before <= moment <= after


@pytest.mark.parametrize("size", [0, 2**31 - 1, 3 * 2**30])
def test_upload_bytes_holds_four_files_of_a_large_upload_limit(settings, size):
    """A job's upload_bytes is the sum of up to 4 files of ``max_upload_mb`` each, and that
    limit has no upper bound: 4 files of 768 MiB are 3 GiB, past a 32-bit INTEGER."""
    new = jobs.NewJob(None, ("cpu",), 0.5, "safetensors", "m.safetensors", upload_bytes=size)
    with session_scope(settings) as session:
        job_id = jobs.create(session, jobs.new_job_id(), new).id
    with session_scope(settings) as session:
        assert jobs.get(session, job_id, None).upload_bytes == size


def test_cancel_and_remove(settings):
    running, done, queued = _queue(settings, 3)
    running_claim, done_claim = _claim(settings), _claim(settings)
    with session_scope(settings) as session:
        assert jobs.succeed(session, done_claim)
        assert not jobs.remove(session, queued)  # not finished: only cancelling applies
        assert jobs.cancel(session, queued)
        assert jobs.cancel(session, running)
        assert not jobs.cancel(session, queued)  # already cancelled
        assert not jobs.cancel(session, done)  # finished is final
        # its process stops
        assert not jobs.progress(session, running_claim, ProgressEvent("load", 0.01))
        assert jobs.remove(session, done) and jobs.remove(session, queued)
        assert jobs.state_of(session, done) is None
        assert jobs.state_of(session, running) == ("cancelled", 1)


def test_jobs_belong_to_their_token(settings):
    alice, _ = tokens.create_token(settings, "alice")
    bob, _ = tokens.create_token(settings, "bob")
    (job_id,) = _queue(settings, 1, alice.id)
    with session_scope(settings) as session:
        assert jobs.get(session, job_id, alice.id) is not None
        assert jobs.get(session, job_id, bob.id) is None
        assert jobs.get(session, job_id, None) is None
        assert jobs.page(session, bob.id, 10, 0) == ([], 0)


def test_tokens_are_stored_hashed_and_revocable(settings):
    info, secret = tokens.create_token(settings, "ci")
    assert secret.startswith("eun_") and len(secret) > 40
    with session_scope(settings) as session:
        row = session.execute(select(Token.__table__)).one()
        assert secret not in " ".join(map(str, row)) and tokens.hash_secret(secret) in row
    if settings.database_url is None:  # SQLite: not in the files either (WAL included)
        files = sorted(settings.data_dir.glob("edge-un.db*"))
        assert files and all(secret.encode() not in f.read_bytes() for f in files)
    with session_scope(settings) as session:
        assert tokens.verify_token(session, secret) == info.id
        assert tokens.verify_token(session, secret + "x") is None
    revoked = tokens.revoke_token(settings, info.id)
    assert revoked.revoked_at is not None
    with session_scope(settings) as session:
        assert tokens.verify_token(session, secret) is None
    assert [t.name for t in tokens.list_tokens(settings)] == ["ci"]
    with pytest.raises(KeyError):
        tokens.revoke_token(settings, 999)


# -- Celery mode: runs prove they are alive; silent ones are taken back --------------------
LEASE_S = 60.0


def _claim_by_id(settings: Settings, job_id: str, max_attempts: int = 2):
    with session_scope(settings) as session:
        return jobs.claim(session, job_id, LEASE_S, max_attempts)


def _silence(settings: Settings, job_id: str) -> None:
    """Make a running job's last sign of life (heartbeat and start) an hour old, as if its
    worker had died then: no waiting out a real lease."""
    then = datetime.now(UTC) - timedelta(hours=1)
    with session_scope(settings) as session:
        session.execute(
            update(Job).where(Job.id == job_id).values(heartbeat_at=then, started_at=then)
        )


def _lost_message(attempts: int, limit: int) -> str:
    return (
        f"its worker was lost while this job ran, {attempts} time(s) (the limit is {limit}); "
        "submit it again"
    )


def test_a_heartbeat_keeps_a_run_alive_and_only_its_own_attempt_beats(settings):
    (job_id,) = _queue(settings, 1)
    first = _claim_by_id(settings, job_id)
    assert first == jobs.Claim(job_id, 1)
    _silence(settings, job_id)
    with session_scope(settings) as session:
        assert jobs.heartbeat(session, first)  # it beats again: alive
    with session_scope(settings) as session:
        assert jobs.recover_lost(session, LEASE_S, max_attempts=2) == ([], [])
        assert jobs.claim(session, job_id, LEASE_S, 2) == "busy"  # a second delivery waits
    _silence(settings, job_id)  # then it goes silent for good
    second = _claim_by_id(settings, job_id)  # a redelivery takes it over
    assert second == jobs.Claim(job_id, 2)
    with session_scope(settings) as session:
        assert not jobs.heartbeat(session, first)  # the old run learns it lost the job
        assert jobs.heartbeat(session, second)
        assert jobs.succeed(session, second)
        assert not jobs.heartbeat(session, second)  # finished: nothing to keep alive


def test_recover_lost_queues_silent_runs_again_then_fails_them(settings):
    silent, alive = _queue(settings, 2)
    for job_id in (silent, alive):
        _claim_by_id(settings, job_id)
    _silence(settings, silent)
    with session_scope(settings) as session:
        assert jobs.recover_lost(session, LEASE_S, max_attempts=2) == ([silent], [])
        assert jobs.state_of(session, silent) == ("queued", 1)
        assert jobs.state_of(session, alive) == ("running", 1)  # within its lease: left alone
    assert _claim_by_id(settings, silent) == jobs.Claim(silent, 2)
    _silence(settings, silent)
    with session_scope(settings) as session:
        assert jobs.recover_lost(session, LEASE_S, max_attempts=2) == ([], [silent])
        job = jobs.get(session, silent, None)
    assert (job.state, job.attempts) == ("failed", 2) and job.finished_at is not None
    assert job.error == _lost_message(2, 2)


def test_a_claim_of_a_silent_run_that_used_its_attempts_fails_it(settings):
    (job_id,) = _queue(settings, 1)
    assert _claim_by_id(settings, job_id, max_attempts=1) == jobs.Claim(job_id, 1)
    _silence(settings, job_id)
    assert _claim_by_id(settings, job_id, max_attempts=1) == "gone"  # nothing left to run
    with session_scope(settings) as session:
        job = jobs.get(session, job_id, None)
    assert (job.state, job.attempts, job.error) == ("failed", 1, _lost_message(1, 1))
    assert _claim_by_id(settings, job_id, max_attempts=1) == "gone"  # and it stays failed


def _wait_for_lock_waiters(settings: Settings, count: int, timeout_s: float = 20.0) -> None:
    """Block until ``count`` sessions of this database wait on a row lock (so a race is
    really staged, not merely hoped for)."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope(settings) as session:
            if session.scalar(waiting) >= count:
                return
        time.sleep(0.02)
    raise AssertionError(f"no {count} session(s) waited on a lock within {timeout_s} s")


def _staged_race(settings: Settings, claim: Callable[[Session], Won]) -> tuple[Won, Won]:
    """Run ``claim`` in session A and keep A's transaction open; run it again in session B
    on another thread until B waits on A's row lock; then commit A and let B finish.
    Returns (A's result, B's result)."""
    second: list[Won] = []

    def in_b() -> None:
        with session_scope(settings) as session_b:
            second.append(claim(session_b))

    with session_scope(settings) as session_a:
        first = claim(session_a)
        racer = threading.Thread(target=in_b)
        racer.start()
        _wait_for_lock_waiters(settings, 1)
    racer.join(30)
    assert not racer.is_alive() and len(second) == 1
    return first, second[0]


def test_postgresql_claimer_blocked_on_a_claimed_row_takes_the_next_job(postgres_settings):
    """B's UPDATE waits on the row A claimed, then re-checks ``state = 'queued'`` after A
    commits: it must not take that job a second time, and must take the next one (a Celery
    start message whose claim came back empty while a job waited left that job queued for
    good: nothing else was sent to start it)."""
    first_id, second_id = _queue(postgres_settings, 2)
    first, second = _staged_race(postgres_settings, jobs.claim_next)
    assert first == jobs.Claim(first_id, 1)
    assert second == jobs.Claim(second_id, 1)
    with session_scope(postgres_settings) as session:
        assert jobs.state_of(session, first_id) == ("running", 1)  # claimed once, not twice


@pytest.mark.parametrize("lost", [False, True], ids=["queued", "lost-worker"])
def test_postgresql_two_deliveries_of_one_job_run_it_once(postgres_settings, lost):
    """Celery may deliver a job's task twice (a re-send, a redelivery after a lost worker):
    both claims by id race, one wins, the other is told the job is busy. With ``lost``, the
    job already ran once and its heartbeat is stale, so both try to take it over."""
    (job_id,) = _queue(postgres_settings, 1)
    lease_s = 0.0 if lost else 60.0  # a zero lease makes every heartbeat stale at once
    if lost:
        with session_scope(postgres_settings) as session:
            assert jobs.claim(session, job_id, lease_s, max_attempts=3) == jobs.Claim(job_id, 1)
    first, second = _staged_race(
        postgres_settings, lambda session: jobs.claim(session, job_id, lease_s, max_attempts=3)
    )
    attempt = 2 if lost else 1
    assert (first, second) == (jobs.Claim(job_id, attempt), "busy")
    with session_scope(postgres_settings) as session:
        assert jobs.state_of(session, job_id) == ("running", attempt)


def test_postgresql_two_racing_claimers_never_get_the_same_job(postgres_settings):
    """Two threads, each with its own session, claim in lockstep rounds until the queue is
    empty: every job is claimed exactly once, at its first attempt."""
    settings = postgres_settings
    ids = _queue(settings, 16)
    claims: list[list[jobs.Claim]] = [[], []]
    barrier = threading.Barrier(2, timeout=30)

    def claimer(mine: list[jobs.Claim]) -> None:
        for _ in range(2 * len(ids)):  # each round claims at least one job
            barrier.wait()  # both UPDATEs start together
            if (claim := _claim(settings)) is not None:
                mine.append(claim)
            barrier.wait()  # both committed: both see the same total
            if len(claims[0]) + len(claims[1]) == len(ids):
                return

    threads = [threading.Thread(target=claimer, args=(mine,)) for mine in claims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    every = claims[0] + claims[1]
    assert sorted(c.job_id for c in every) == sorted(ids)  # each once, none lost
    assert all(c.attempt == 1 for c in every)
    with session_scope(settings) as session:
        assert jobs.counts_by_state(session)["running"] == len(ids)


def test_store_publishes_atomically_and_serves_only_listed_names(tmp_path):
    store = LocalArtifactStore(tmp_path)
    staging = store.staging_dir("abc123", 1)
    (staging / "cpu").mkdir()
    (staging / "cpu" / "model.onnx").write_bytes(b"int8")
    (staging / "report.json").write_text("{}")
    assert store.list("abc123") is None  # nothing is visible before the commit
    infos = store.commit("abc123", staging)
    assert [i.name for i in infos] == ["cpu/model.onnx", "report.json"]
    assert not staging.exists()
    assert store.path("abc123", "cpu/model.onnx").read_bytes() == b"int8"
    for name in ("../abc123/report.json", "/etc/passwd", ".manifest.json", "cpu"):
        assert store.path("abc123", name) is None
    with pytest.raises(ValueError):
        store.upload_dir("../x")
    store.delete("abc123")
    assert store.list("abc123") is None
