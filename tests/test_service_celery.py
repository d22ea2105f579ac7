"""Celery mode at scale, against real servers on 127.0.0.1: PostgreSQL, Redis, the API and two
``edge-un worker`` processes. Many clients, a worker killed in the middle of a target (that
target alone is built again), Redis restarted mid-queue and down at submit time: every job
completes exactly once, nothing is lost. (One job's targets spread over the workers:
tests/test_service_fanout.py.)

(The rest of the service suite runs in this mode too, through the ``service_mode`` fixture.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from sqlalchemy import select

from edge_un import examples
from service import jobs as job_records
from service.db import JobTarget, session_scope
from testbed.live import (
    ROOT,
    LiveServer,
    fast_job_files,
    upload,
    upload_fast,
    wait_for,
)

from .service_live import hold_hook, job_processes

MODEL = examples.path("vit-mnist-un")
CLIENTS, JOBS_EACH = 5, 2


PREPARED = re.compile(r"edge_un\.convert\[[\w-]+\] succeeded .*'job (\w+) attempt (\d+) prepared")
BUILT = re.compile(
    r"edge_un\.build_target\[[\w-]+\] succeeded .*'job (\w+) attempt \d+ target (\w+) build (\d+)"
)


def runs_by_worker(
    server: LiveServer, expected: int, pattern: re.Pattern[str] = PREPARED
) -> dict[str, list[tuple]]:
    """What each worker ran to its end, from its log, once ``expected`` of them are there (a
    worker logs a task's end just after the step recorded it): by default each run of a job
    it prepared (job id, attempt); with BUILT, each target it built (job id, target, build)."""
    deadline = time.monotonic() + 30
    while True:
        runs = {
            w.name: [tuple(int(g) if g.isdigit() else g for g in m.groups())
                     for m in pattern.finditer(w.log())]
            for w in server.workers
        }  # fmt: skip
        if sum(map(len, runs.values())) >= expected or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def worker_running(server: LiveServer, job_id: str) -> int:
    """Index (in server.workers) of the worker whose pool process runs ``job_id``."""
    (pid,) = job_processes(server, job_id)
    parent = psutil.Process(pid).ppid()
    return next(i for i, w in enumerate(server.workers) if w.process.pid == parent)


@pytest.fixture
def held_cluster(tmp_path, celery_mode):
    """The API and two workers whose job processes wait, once started, while the returned
    file exists."""
    fast_job_files()
    env, hold = hold_hook(tmp_path / "hook")
    server = celery_mode.server(tmp_path / "data", EDGE_UN_WORKERS="2", **env).start()
    yield server, hold
    hold.unlink(missing_ok=True)
    server.stop()


def running_on(server: LiveServer, count: int, timeout: float = 120) -> set[int]:
    """The workers (indices) of the jobs running once ``count`` of them run at once."""
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(server.settings) as session:
            running = [(job.id, job.pid) for job in job_records.running(session)]
        if len(running) >= count and all(pid for _, pid in running):
            return {worker_running(server, job_id) for job_id, _ in running}
        assert time.monotonic() < deadline, f"not {count} jobs running at once: {running}"
        time.sleep(0.2)


# 2.5 min of the default suite's 23 on 2 cores: slow, and `.ci/run` runs it besides the suite
@pytest.mark.slow
def test_ten_conversions_from_five_clients_on_two_workers(held_cluster):
    cluster, hold = held_cluster
    secrets = [cluster.token(f"client-{i}") for i in range(CLIENTS)]

    def client_run(secret: str) -> list[dict]:
        with cluster.client(secret) as client:
            ids = [upload_fast(client).json()["id"] for _ in range(JOBS_EACH)]
            done = [wait_for(client, i, ("succeeded",), timeout=600) for i in ids]
            for job in done:  # artifacts come from the API, whichever worker made them
                artifact = client.get(f"/v1/conversions/{job['id']}/artifacts/cpu/model_int8.onnx")
                assert artifact.status_code == 200 and len(artifact.content) > 10_000
            return done

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = pool.map(client_run, secrets)
        # Every job waits once it started: a worker runs one at a time, so two running at once
        # are one on each worker, whatever order the broker hands them out in. Then all go on.
        try:
            assert running_on(cluster, 2) == {0, 1}
        finally:
            hold.unlink()
        jobs = [job for done in results for job in done]
    ids = {job["id"] for job in jobs}
    assert len(ids) == CLIENTS * JOBS_EACH
    assert all(job["attempts"] == 1 for job in jobs)
    runs = runs_by_worker(cluster, len(ids))
    every_run = [run for worker_runs in runs.values() for run in worker_runs]
    assert sorted(every_run) == sorted((i, 1) for i in ids), "a job ran twice, or never"
    assert all(runs.values()), f"one worker ran nothing: {runs}"


def building(server: LiveServer, job_id: str, target: str, timeout: float = 300) -> JobTarget:
    """The job's target record once its build is under way (a stage recorded, a pid)."""
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(server.settings) as session:
            build = session.scalar(
                select(JobTarget).where(JobTarget.job_id == job_id, JobTarget.name == target)
            )
        if build is not None and build.state == "running" and build.stage and build.pid:
            return build
        assert time.monotonic() < deadline, f"{target} of {job_id} not building"
        time.sleep(0.1)


def test_worker_killed_mid_target_the_other_builds_that_target_again(cluster):
    """A worker killed (kill -9, its pool with it) in the middle of a target: that target is
    built again on the other worker (its message comes back: acks_late), alone: the job is
    not prepared again, and the other jobs complete once each."""
    with cluster.client(cluster.token()) as client:
        # its cpu target runs long enough (the int8 ladder on a checkpoint's own data)
        victim = upload(client, MODEL).json()["id"]
        others = [upload_fast(client).json()["id"] for _ in range(3)]
        build = building(cluster, victim, "cpu")
        killed = next(
            i for i, w in enumerate(cluster.workers)
            if w.process.pid == psutil.Process(build.pid).ppid()
        )  # fmt: skip
        cluster.workers[killed].kill()
        survivor = cluster.workers[1 - killed]
        again = wait_for(client, victim, ("succeeded",), timeout=600)
        assert again["attempts"] == 2, again  # its cpu target ran twice
        finished = [wait_for(client, i, ("succeeded",), timeout=600) for i in others]
        assert all(job["attempts"] == 1 for job in finished)
        listing = client.get("/v1/conversions", params={"limit": 100}).json()
        assert sorted(j["id"] for j in listing["items"]) == sorted([victim, *others])
    with session_scope(cluster.settings) as session:
        assert job_records.state_of(session, victim) == ("succeeded", 1)  # prepared once
    built = runs_by_worker(cluster, 1 + len(others), BUILT)
    assert (victim, "cpu", 2) in built[survivor.name], built  # built again, on the other
    assert [b for b in built[cluster.workers[killed].name] if b[0] == victim] == []
    every_build = sorted(b for runs in built.values() for b in runs)
    assert every_build == sorted([(victim, "cpu", 2), *((i, "cpu", 1) for i in others)])
    prepared = [run for runs in runs_by_worker(cluster, 1 + len(others)).values() for run in runs]
    assert sorted(prepared) == sorted((i, 1) for i in [victim, *others])
    leftovers = list((cluster.data_dir / "artifacts" / ".staging").glob(f"{victim}-*"))
    assert leftovers == [], "the killed run's staging or work directory was left behind"


def test_redis_restarted_mid_queue_and_down_at_submit(cluster, redis_server):
    with cluster.client(cluster.token()) as client:
        queued = [upload_fast(client).json()["id"] for _ in range(4)]
        wait_for(client, queued[0], ("running",))
        redis_server.restart()  # with jobs queued in it and one running
        redis_server.stop()
        try:
            # the broker is down: the upload is still accepted, recorded, and sent later
            late = upload_fast(client)
            assert late.status_code == 202, late.text
            assert client.get(f"/v1/conversions/{late.json()['id']}").status_code == 200
            unready = _readyz_within(client, 503, timeout=10)
            assert "broker" in unready["detail"] and "EDGE_UN_BROKER_URL" in unready["detail"]
        finally:
            redis_server.start()
        _readyz_within(client, 200, timeout=10)
        ids = [*queued, late.json()["id"]]
        done = [wait_for(client, i, ("succeeded",), timeout=600) for i in ids]
        assert all(job["attempts"] == 1 for job in done)
    every_run = [run for runs in runs_by_worker(cluster, len(ids)).values() for run in runs]
    assert sorted(every_run) == sorted((i, 1) for i in ids)
    assert "could not send job" in cluster.log()  # the late job really met a dead broker


def _readyz_within(client, status: int, timeout: float) -> dict:
    """/readyz's body once it answers ``status`` (the broker is checked every heartbeat)."""
    deadline = time.monotonic() + timeout
    while (response := client.get("/readyz")).status_code != status:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.2)
    return response.json()


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_UN_")}
    environ.update(env)
    command = [sys.executable, "-m", "service.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True)


def test_worker_needs_the_celery_settings_and_answers_its_health_check(cluster, tmp_path):
    local = _cli("worker", EDGE_UN_DATA_DIR=str(tmp_path / "x"))
    assert local.returncode == 1
    assert local.stderr.strip().count("\n") == 0 and "EDGE_UN_QUEUE=celery" in local.stderr
    no_broker = _cli("worker", EDGE_UN_QUEUE="celery")
    assert no_broker.returncode == 1 and "EDGE_UN_BROKER_URL" in no_broker.stderr
    assert "Traceback" not in local.stderr + no_broker.stderr

    env = {k: v for k, v in cluster.env.items() if k.startswith("EDGE_UN_")}
    name = f"{cluster.workers[0].name}@{os.uname().nodename}"
    assert _cli("worker", "--check", "--hostname", name, **env).returncode == 0
    absent = _cli("worker", "--check", "--hostname", "nobody@nowhere", **env)
    assert absent.returncode == 1 and "did not answer" in absent.stderr
