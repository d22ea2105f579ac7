"""Test helpers over the live service of :mod:`testbed.live`: uploads that must be accepted,
the job processes of a server, problem+json answers, and the test-only hooks that make a job
process abort or wait. Not a test module (no test_ prefix)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from testbed.live import LiveServer, fast_job_files, wait_for


def submit_parts(client: httpx.Client, parts: Any, targets: str = "cpu") -> dict[str, Any]:
    """POST multipart ``parts`` (httpx ``files``) as a conversion; assert it was accepted and
    return the job as the answer gives it."""
    response = client.post("/v1/conversions", files=parts, data={"targets": targets})
    assert response.status_code == 202, response.text
    return response.json()


def converted(
    client: httpx.Client, parts: Any, targets: str = "cpu", timeout: float = 240
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``submit_parts``, then wait until the job succeeded: (the job as accepted, its report)."""
    job = submit_parts(client, parts, targets)
    done = wait_for(client, job["id"], ("succeeded",), timeout=timeout)
    return job, client.get(f"/v1/conversions/{done['id']}/report").json()


def job_processes(server: LiveServer, job_id: str) -> list[int]:
    """The live job process running ``job_id`` (its pid as the queue recorded it), if any."""
    import psutil
    from sqlalchemy import select

    from service.db import Job, session_scope

    with session_scope(server.settings) as session:
        pid = session.scalar(select(Job.pid).where(Job.id == job_id))
    try:
        alive = pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    return [pid] if alive else []


def is_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    """Assert an RFC 9457 problem with this status; return its body."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body = response.json()
    assert body["status"] == status and body["title"] and body["detail"], body
    return body


# Test-only hooks, never part of the service: Python imports ``sitecustomize`` from PYTHONPATH
# at start-up, so every process of a server started with a hook's environment (the API, its
# fork server or Celery workers, and so the job processes forked from them) carries it. Right
# after recording a stage, a job process
# - aborts (SIGABRT, as a failed assertion in a native library does) if the stage is the one
#   EDGE_UN_TEST_ABORT_AFTER_STAGE names, alone ("export") or with its target ("tda4vm:
#   latency") (``abort_hook``);
# - waits while the file EDGE_UN_TEST_HOLD_WHILE names exists, 10 minutes at most (``hold_hook``):
#   a test then knows a job is running, and stays running, until it removes the file.
_HOOK = """\
import os
import time

_STAGE = os.environ.get("EDGE_UN_TEST_ABORT_AFTER_STAGE")
_HOLD = os.environ.get("EDGE_UN_TEST_HOLD_WHILE")
if _STAGE or _HOLD:
    try:
        from service.worker import steps as _job_steps
    except Exception:  # another interpreter (a tool's own environment): nothing to hook
        _job_steps = None
    if _job_steps is not None:
        _record = _job_steps.ProgressRecorder.__call__

        def _call(self, event):
            _record(self, event)
            if _STAGE and _STAGE in (event.stage, f"{event.target}: {event.stage}"):
                os.abort()
            deadline = time.monotonic() + 600
            while _HOLD and os.path.exists(_HOLD) and time.monotonic() < deadline:
                time.sleep(0.05)

        _job_steps.ProgressRecorder.__call__ = _call
"""


def _hooked(folder: Path, **variables: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_HOOK)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), **variables}


def abort_hook(folder: Path, stage: str) -> dict[str, str]:
    """The environment of a server whose job processes abort after recording ``stage`` (a
    stage's name, e.g. "export", or one target's, e.g. "tda4vm: latency")."""
    return _hooked(folder, EDGE_UN_TEST_ABORT_AFTER_STAGE=stage)


def fast_data_parts() -> list[tuple[str, tuple[str, bytes]]]:
    """The quick conversion's calibration and evaluation files as the upload parts ``calib``
    and ``eval`` (samples of the example's data set, for any model of its one input)."""
    files = fast_job_files()
    return [(part, (files[part].name, files[part].read_bytes())) for part in ("calib", "eval")]


def hold_hook(folder: Path) -> tuple[dict[str, str], Path]:
    """The environment of a server whose job processes wait while the returned file exists
    (it is created here; remove it to let them go on)."""
    env = _hooked(folder, EDGE_UN_TEST_HOLD_WHILE=str(folder / "hold"))
    (folder / "hold").touch()
    return env, folder / "hold"
