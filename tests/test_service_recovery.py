"""Celery mode: a worker that dies at any point of a fanned-out job's run is recovered within
the lease, never by waiting on the broker's visibility timeout (half an hour), against real
servers on 127.0.0.1 (PostgreSQL, Redis, the API, two ``edge-un worker`` processes).

Each window of the run (``testbed.faults.WINDOWS``: its prepare, target or report step sent or
running) is reached by a test-only pause, and the worker holding the run there is killed with
its whole process group: the job ends ``succeeded`` with the same artifacts (sha256) as an
undisturbed run, each target built by one worker at a time. Also: Redis crashed between a
step's dispatch and its receipt, PostgreSQL restarted while a target builds. (The local queue's
own recovery, a server killed mid-queue: tests/test_service_faults.py, in both modes.)
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from service.db import Job, JobTarget, Worker, session_scope
from testbed.faults import WINDOWS, Pauses, kill_in, pause_env
from testbed.live import LiveServer, ServiceMode, fast_job_files, upload_fast, wait_for

# the window first: the one the default suite runs
DEFAULT_WINDOW = "target sent"
SLOW_WINDOWS = [w for w in WINDOWS if w != DEFAULT_WINDOW]


@pytest.fixture(scope="module")
def paused_cluster(
    tmp_path_factory: pytest.TempPathFactory, celery_mode: ServiceMode
) -> Iterator[tuple[LiveServer, Pauses]]:
    fast_job_files()
    folder = tmp_path_factory.mktemp("pause")
    data = tmp_path_factory.mktemp("cluster") / "data"
    server = celery_mode.server(data, EDGE_UN_WORKERS="2", **pause_env(folder)).start()
    yield server, Pauses(folder)
    Pauses(folder).disarm()
    Pauses(folder).release()
    server.stop()


def artifacts(server: LiveServer, client, job_id: str) -> dict[str, str]:
    """The built files (name -> sha256) as the job's report lists them (the report's own files
    hold timings, which differ from run to run)."""
    report = client.get(f"/v1/conversions/{job_id}/report").json()
    return {a["name"]: a["sha256"] for t in report["targets"].values() for a in t["artifacts"]}


@pytest.fixture(scope="module")
def undisturbed(paused_cluster) -> tuple[dict[str, str], float]:
    """An undisturbed job's artifacts (name -> sha256) and how long it took."""
    server, _ = paused_cluster
    with server.client(server.token()) as client:
        job_id = upload_fast(client).json()["id"]
        wait_for(client, job_id, ("succeeded",), timeout=300)
        return artifacts(server, client, job_id), _seconds(server, job_id)


def _seconds(server: LiveServer, job_id: str) -> float:
    with session_scope(server.settings) as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
    return (job.finished_at - job.created_at).total_seconds()


def _finished_at(server: LiveServer, job_id: str) -> float:
    with session_scope(server.settings) as session:
        return session.scalar(select(Job.finished_at).where(Job.id == job_id)).timestamp()


def _two_workers(server: LiveServer) -> None:
    assert server.backend is not None
    server.backend.ensure_workers(2, server._environ(), server.data_dir.parent)


def test_a_worker_keeps_a_record_of_what_it_holds(paused_cluster):
    """Each live worker has its record (liveness beyond a task's), fresh within a lease."""
    server, _ = paused_cluster
    _two_workers(server)
    deadline = time.monotonic() + 30
    while True:
        with session_scope(server.settings) as session:
            rows = session.scalars(select(Worker)).all()
        names = {row.name.split("@")[0] for row in rows}
        if {w.name for w in server.workers} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {w.name for w in server.workers} <= names


def killed_in_window(server: LiveServer, pauses: Pauses, window: str, undisturbed) -> None:
    """A job whose worker is killed in ``window``: it ends succeeded, as the undisturbed run,
    within 2 leases of the undisturbed job's own time after the kill."""
    shas, alone_s = undisturbed
    _two_workers(server)
    with server.client(server.token()) as client:
        job_id, killed = kill_in(server, pauses, window, lambda: upload_fast(client).json()["id"])
        done = wait_for(client, job_id, ("succeeded",), timeout=300)
        assert artifacts(server, client, job_id) == shas, done
    recovery = _finished_at(server, job_id) - killed
    # the run starts again from its lost step at worst: its whole time, plus the leases
    lease = server.settings.lease_s
    assert recovery <= alone_s + 2 * lease + 30, (window, recovery, alone_s)
    with session_scope(server.settings) as session:
        builds = session.scalars(select(JobTarget).where(JobTarget.job_id == job_id)).all()
    assert [(b.state, b.error) for b in builds] == [("ended", None)]


def test_a_worker_killed_holding_a_target_it_had_not_started(paused_cluster, undisturbed):
    """The issue's case: the worker had received the target's message (its record queued,
    dispatched, no heartbeat) and died; the target is sent again after the lease."""
    server, pauses = paused_cluster
    killed_in_window(server, pauses, DEFAULT_WINDOW, undisturbed)
    assert "worker(s) lost" in server.log()


@pytest.mark.slow  # 1-2 min each on 2 cores (a worker starts again after each kill)
@pytest.mark.parametrize("window", SLOW_WINDOWS)
def test_a_worker_killed_in_each_window_of_the_run(paused_cluster, undisturbed, window):
    server, pauses = paused_cluster
    killed_in_window(server, pauses, window, undisturbed)


@pytest.mark.slow
def test_redis_crashed_between_a_steps_dispatch_and_its_receipt(
    paused_cluster, undisturbed, redis_server
):
    """The workers stopped (SIGSTOP) and cut off from Redis (restarted: no worker waits on
    it, so a message stays in it), the job's start is sent, then Redis is killed and started
    again without its append-only file (a broker that lost its data: the start is gone), and
    the workers go on. One idles for a lease, and the start is sent again."""
    server, _ = paused_cluster
    _two_workers(server)
    groups = [worker.process.pid for worker in server.workers]
    token, resent = server.token(), server.log().count("sending again 1 start(s)")
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        redis_server.restart()
        with server.client(token) as client:
            job_id = upload_fast(client).json()["id"]
        with session_scope(server.settings) as session:  # sent: at the broker
            assert session.scalar(select(Job.dispatched_at).where(Job.id == job_id))
        redis_server.kill()
        for path in redis_server.root.glob("appendonly*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        redis_server.start()
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)
    with server.client(token) as client:
        wait_for(client, job_id, ("succeeded",), timeout=300)
        assert artifacts(server, client, job_id) == undisturbed[0]
    assert server.log().count("sending again 1 start(s)") > resent


@pytest.mark.slow
def test_postgres_restarted_while_a_target_builds(paused_cluster, undisturbed, postgres_server):
    server, pauses = paused_cluster
    _two_workers(server)
    with server.client(server.token()) as client:
        pauses.arm("target running")
        job_id = upload_fast(client).json()["id"]
        pauses.paused()
        postgres_server.restart()
        pauses.release()
        wait_for(client, job_id, ("succeeded",), timeout=300)
        assert artifacts(server, client, job_id) == undisturbed[0]
