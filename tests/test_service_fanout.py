"""One job spread over the Celery workers, against real servers on 127.0.0.1 (PostgreSQL,
Redis, the API and two ``edge-un worker`` processes): one worker prepares the job, its two
targets build at the same time on the two workers, and the report is what one process makes
(every artifact's sha256, every drift figure); a cancel stops every target; a target whose
process crashes fails that target only (the job is partial).

(A worker killed in the middle of a target: tests/test_service_celery.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from quant.report import Report
from service.db import JobTarget, session_scope
from service.worker.job_process import THREAD_VARIABLES
from testbed.live import ROOT, LiveServer, fast_job_files, upload_fast, wait_for

from .service_live import abort_hook, is_problem

TARGETS = "cpu,tda4vm"  # two QDQ ONNX targets: the fastest pair to build


def builds(server: LiveServer, job_id: str) -> list[JobTarget]:
    with session_scope(server.settings) as session:
        return list(session.scalars(select(JobTarget).where(JobTarget.job_id == job_id)))


def worker_of(server: LiveServer, pid: int) -> str:
    """The worker whose pool process ``pid`` is."""
    parent = psutil.Process(pid).ppid()
    return next(w.name for w in server.workers if w.process.pid == parent)


def both_building(server: LiveServer, job_id: str, timeout: float = 180) -> dict[str, str]:
    """{target: worker} once both targets build at the same moment."""
    deadline = time.monotonic() + timeout
    while True:
        running = [b for b in builds(server, job_id) if b.state == "running" and b.pid]
        if len(running) == 2:
            try:
                return {b.name: worker_of(server, b.pid) for b in running}
            except (psutil.NoSuchProcess, StopIteration):
                pass  # it ended between the two looks
        assert time.monotonic() < deadline, [(b.name, b.state) for b in builds(server, job_id)]
        time.sleep(0.1)


def one_process_conversion(out: Path) -> Report:
    """``edge-un convert`` of the same files, one thread for the math libraries as the
    service's job processes here (EDGE_UN_JOB_THREADS=1: float sums in another order differ
    in their last bits)."""
    files = fast_job_files()
    command = [sys.executable, "-m", "service.cli", "convert", str(files["model"]),
               "--target", TARGETS, "--calib", str(files["calib"]), "--eval", str(files["eval"]),
               "-o", str(out)]  # fmt: skip
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, "1")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return Report.read(out / "report.json")


# 1-2.5 min on 2 cores; benchmarks/service/celery_fanout.py checks the same on 4 targets
@pytest.mark.slow
def test_a_jobs_targets_build_at_once_on_two_workers_as_one_process_builds_them(
    shared_cluster, tmp_path
):
    """Both targets build at the same moment, each on a worker of its own, and the report and
    artifacts are a one-process conversion's."""
    cluster = shared_cluster
    with cluster.client(cluster.token()) as client:
        job_id = upload_fast(client, targets=TARGETS).json()["id"]
        where = both_building(cluster, job_id)
        assert sorted(where) == ["cpu", "tda4vm"] and len(set(where.values())) == 2, where
        done = wait_for(client, job_id, ("succeeded",), timeout=600)
        assert done["percent"] == 100 and done["attempts"] == 1
        served = Report.model_validate(client.get(f"/v1/conversions/{job_id}/report").json())
        listed = {a["name"]: a["sha256"] for a in client.get(
            f"/v1/conversions/{job_id}/artifacts").json()}  # fmt: skip
    assert [(b.state, b.attempts, b.fraction, b.error) for b in builds(cluster, job_id)] == [
        ("ended", 1, 1.0, None)
    ] * 2
    single = one_process_conversion(tmp_path / "single")
    for name, target in single.targets.items():
        spread = served.targets[name]
        assert spread.status == target.status != "failed"
        assert [(a.name, a.sha256) for a in spread.artifacts] == [
            (a.name, a.sha256) for a in target.artifacts
        ]  # fmt: skip
        for artifact in target.artifacts:
            assert listed[artifact.name] == artifact.sha256
        same = ("drift", "host_drift", "recipes_tried", "excluded", "int16_tensors", "inputs")
        assert {k: getattr(spread, k) for k in same} == {k: getattr(target, k) for k in same}
    assert served.notes == single.notes
    paths = {"eval_source", "calibration_source"}  # the data's paths: uploads, or the files
    assert served.reference.model_dump(exclude=paths) == single.reference.model_dump(exclude=paths)


def test_a_cancel_stops_every_target(shared_cluster):
    cluster = shared_cluster
    with cluster.client(cluster.token()) as client:
        job_id = upload_fast(client, targets=TARGETS).json()["id"]
        both_building(cluster, job_id)
        pids = [b.pid for b in builds(cluster, job_id)]
        assert client.post(f"/v1/conversions/{job_id}/cancel").json()["state"] == "cancelled"
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if psutil.pid_exists(pid)], "a target still builds"
        job = client.get(f"/v1/conversions/{job_id}").json()
        assert job["state"] == "cancelled" and job["error"] == "cancelled by the client"
        is_problem(client.get(f"/v1/conversions/{job_id}/report"), 409)
        staging = cluster.data_dir / "artifacts" / ".staging"
        deadline = time.monotonic() + 30  # the API cleans up after a lease
        while list(staging.glob(f"{job_id}-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(staging.glob(f"{job_id}-*")) == []  # its staging and work directories
        # the workers are free again: the next job runs
        wait_for(client, upload_fast(client).json()["id"], ("succeeded",), timeout=300)


def test_a_target_whose_process_crashes_fails_that_target_only(tmp_path, celery_mode):
    """The tda4vm target's job process aborts (a test hook, as a native library's failed
    assertion would) as it starts timing: the job is partial, cpu ships, tda4vm says where it
    crashed, and it is not built again (running it again would only crash again)."""
    fast_job_files()
    hook = abort_hook(tmp_path / "hook", "tda4vm: latency")
    server = celery_mode.server(tmp_path / "data", EDGE_UN_WORKERS="2", **hook).start()
    try:
        with server.client(server.token()) as client:
            job_id = upload_fast(client, targets=TARGETS).json()["id"]
            job = wait_for(client, job_id, ("partial",), timeout=600)
            report = client.get(f"/v1/conversions/{job_id}/report").json()
            names = {a["name"] for a in client.get(f"/v1/conversions/{job_id}/artifacts").json()}
    finally:
        server.stop()
    crashed = "crashed with SIGABRT during its stage 'tda4vm: latency"
    assert job["error"].startswith("1 of 2 targets failed: tda4vm: the conversion process ")
    assert crashed in job["error"]
    assert report["targets"]["cpu"]["status"] == "ok" and "cpu/model_int8.onnx" in names
    assert report["targets"]["tda4vm"]["status"] == "failed"
    assert job["attempts"] == 1
    tda4vm = next(b for b in builds(server, job_id) if b.name == "tda4vm")
    assert (tda4vm.state, tda4vm.attempts) == ("ended", 1)
