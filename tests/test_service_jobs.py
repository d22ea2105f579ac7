"""The job records, the queue's claims, restart recovery, tokens, migrations and the artifact
store, on a real SQLite database and file system (no server)."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service import jobs, tokens
from service.db import Base, get_engine, session_scope, upgrade
from service.settings import Settings
from service.storage import LocalArtifactStore


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(data_dir=tmp_path / "data")
    upgrade(settings)
    return settings


def _queue(settings: Settings, count: int, token_id: int | None = None) -> list[str]:
    ids = []
    with session_scope(settings) as session:
        for _ in range(count):
            job_id = jobs.new_job_id()
            request = jobs.NewJob(token_id, "cpu", 0.5, "safetensors", "m.safetensors")
            jobs.create(session, job_id, request)
            ids.append(job_id)
    return ids


def _claim(settings: Settings) -> jobs.Claim | None:
    with session_scope(settings) as session:
        return jobs.claim_next(session)


def test_migrations_build_exactly_the_models(settings):
    upgrade(settings)  # idempotent
    with get_engine(settings).connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


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
        assert not jobs.progress(session, first, "load", 10)
        assert not jobs.succeed(session, first)
        assert jobs.progress(session, second, "load", 10)
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
        assert not jobs.progress(session, running_claim, "load", 1)  # its process stops
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
    assert secret.encode() not in (settings.data_dir / "edge-un.db").read_bytes()
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
