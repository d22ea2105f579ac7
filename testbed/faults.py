"""Faults at chosen moments of a Celery-mode job's run, for the tests and
``benchmarks.service.fault_recovery``: a worker whose process group is killed while it holds a step
of the run in one of its windows (:data:`WINDOWS`).

A window is reached by a test-only hook, never part of the service: Python imports
``sitecustomize`` from PYTHONPATH at start-up, so every worker process of a server started with
:func:`pause_env` carries it. An armed pause (:meth:`Pauses.arm`) stops the first worker
process that gets there, once: before it claims a step whose message it received ("sent"
windows: the step's record is still queued, nothing of it started), or right after a job
process recorded a stage ("running" windows: the step runs, under its heartbeat). The test then
kills that worker's whole process group, as a crashed machine would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from .live import CeleryWorker, LiveServer

# window -> (where the pause is, what it matches): a claim's step, or a stage's label prefix
WINDOWS: dict[str, tuple[str, str]] = {
    "prepare sent": ("claim", "start"),
    "prepare running": ("stage", "load"),
    "target sent": ("claim", "target"),
    "target running": ("stage", "cpu: quantize"),
    "report sent": ("claim", "report"),
    "report running": ("stage", "report"),
}

_HOOK = """\
import os
import sys
import time

_DIR = os.environ.get("EDGE_UN_TEST_PAUSE_DIR")


def _pause(kind, what):
    if sys.argv[1:2] != ["worker"]:  # the workers' processes only, never the API's
        return
    armed = os.path.join(_DIR, kind)
    try:
        with open(armed) as stream:
            match = stream.read()
    except OSError:
        return
    if not what.startswith(match):
        return
    mine = f"{armed}.paused.{os.getpid()}"
    try:
        os.rename(armed, mine)  # one process takes the pause, once
    except OSError:
        return
    deadline = time.monotonic() + 600
    while os.path.exists(mine) and time.monotonic() < deadline:
        time.sleep(0.05)


def _before(module, name, what):
    real = getattr(module, name)

    def paused(*args, **kwargs):
        _pause("claim", what)
        return real(*args, **kwargs)

    setattr(module, name, paused)


if _DIR:
    try:
        from service import job_targets as _targets
        from service import jobs as _jobs
        from service.worker import steps as _job_steps
    except Exception:  # another interpreter (a tool's own environment): nothing to hook
        _jobs = None
    if _jobs is not None:
        _before(_jobs, "claim_next", "start")
        _before(_targets, "claim_target", "target")
        _before(_targets, "claim_report", "report")
        _record = _job_steps.ProgressRecorder.__call__

        def _call(self, event):
            _record(self, event)
            _pause("stage", event.label)

        _job_steps.ProgressRecorder.__call__ = _call
"""


def pause_env(folder: Path) -> dict[str, str]:
    """The environment of a server whose workers carry the pause hook (in ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_HOOK)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), "EDGE_UN_TEST_PAUSE_DIR": str(folder)}


class Pauses:
    """The pauses of a server started with :func:`pause_env` (``folder``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def arm(self, window: str) -> None:
        kind, match = WINDOWS[window]
        (self.folder / kind).write_text(match)

    def disarm(self) -> None:
        for kind in ("claim", "stage"):
            (self.folder / kind).unlink(missing_ok=True)

    def paused(self, timeout: float = 300) -> int:
        """The pid of the process that took the armed pause, once one did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for marker in self.folder.glob("*.paused.*"):
                return int(marker.name.rsplit(".", 1)[1])
            time.sleep(0.05)
        raise AssertionError(f"no worker reached the pause within {timeout} s")

    def release(self) -> None:
        """Let every paused process go on."""
        for marker in self.folder.glob("*.paused.*"):
            marker.unlink(missing_ok=True)


def worker_of(server: LiveServer, pid: int) -> CeleryWorker:
    """The worker whose process ``pid`` is (itself, its pool process or a job process)."""
    mains = {worker.process.pid: worker for worker in server.workers}
    process: psutil.Process | None = psutil.Process(pid)
    while process is not None:
        if process.pid in mains:
            return mains[process.pid]
        process = process.parent()
    raise LookupError(f"process {pid} belongs to no worker of the server")


def kill_in(
    server: LiveServer, pauses: Pauses, window: str, submit: Callable[[], str], timeout: float = 300
) -> tuple[str, float]:
    """Arm ``window``, ``submit`` a job (its id), wait until a worker holds its run there, kill
    that worker's process group (kill -9) and let the pause go: the job's id and when the kill
    was (``time.time()``). Armed before the job exists: a step sent is received at once."""
    pauses.arm(window)
    job_id = submit()
    pid = pauses.paused(timeout)
    worker = worker_of(server, pid)
    worker.kill()
    killed = time.time()
    pauses.release()
    return job_id, killed
