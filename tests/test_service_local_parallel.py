"""The local queue builds one job's targets at once when ``EDGE_UN_JOB_PARALLEL`` says so (Celery
mode spreads them over its workers instead: tests/test_service_fanout.py)."""

from __future__ import annotations

import contextlib
import time

import psutil
from sqlalchemy import select

from service.db import Job, session_scope
from service.job_states import FINISHED
from testbed.live import LiveServer, upload_fast, wait_for

from .service_live import job_processes


def builds_under(pid: int) -> list[int]:
    """The target builds (``python -m quant.isolation``) running under process ``pid``."""
    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "quant.isolation" in child.cmdline():
                    found.append(child.pid)
    return found


def most_builds_at_once(
    server: LiveServer, job_id: str, until_both: bool = False, timeout: float = 600
) -> list[int]:
    """Watch the job until it finished (or, ``until_both``, until two targets build): the pids
    of the most target builds its process ran at one moment."""
    most: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in job_processes(server, job_id):
            most = max(most, builds_under(pid), key=len)
        if until_both and len(most) == 2:
            return most
        with session_scope(server.settings) as session:
            if session.scalar(select(Job.state).where(Job.id == job_id)) in FINISHED:
                return most
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not finished after {timeout} s")


def test_the_local_queue_builds_a_jobs_targets_at_once_when_told(tmp_path):
    """Two QDQ ONNX targets (the fastest pair), ``EDGE_UN_JOB_PARALLEL=2``: both build at one
    moment and the job succeeds with both; a second such job cancelled while both build stops
    both builds."""
    server = LiveServer(tmp_path / "data", EDGE_UN_JOB_PARALLEL="2").start()
    try:
        with server.client(server.token()) as client:
            job_id = upload_fast(client, targets="cpu,tda4vm").json()["id"]
            assert len(most_builds_at_once(server, job_id)) == 2
            wait_for(client, job_id, ("succeeded",), timeout=60)
            report = client.get(f"/v1/conversions/{job_id}/report").json()
            assert sorted(report["targets"]) == ["cpu", "tda4vm"]
            assert all(t["status"] != "failed" for t in report["targets"].values())

            job_id = upload_fast(client, targets="cpu,tda4vm").json()["id"]
            building = most_builds_at_once(server, job_id, until_both=True)
            assert len(building) == 2
            assert client.post(f"/v1/conversions/{job_id}/cancel").json()["state"] == "cancelled"
            deadline = time.monotonic() + 30
            while any(psutil.pid_exists(p) for p in building) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [p for p in building if psutil.pid_exists(p)], "a target still builds"
    finally:
        server.stop()
