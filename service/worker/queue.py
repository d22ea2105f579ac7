"""The job queue: an interface, and a local queue that runs each job in its own process.

``JobQueue`` is all the routes see (submit after the job row is committed, cancel after it is
marked cancelled); a distributed queue (Celery) can replace ``LocalProcessQueue`` behind it.
The queue itself is the database: a dispatcher thread claims the oldest queued job whenever a
slot is free (at most ``workers`` at once), so an accepted job survives any crash of this
process. Each job runs in its own process, forked from a multiprocessing fork server that has
imported the pipeline once (a job starts in milliseconds, not after seconds of imports), in
its own session (process group): a timeout or a cancel kills the whole group; a job process
that dies without recording an outcome (killed, crashed, out of memory) fails its job with a
message saying which, from the evidence (``failures.exit_message``: its peak address space,
sampled at every tick while it runs, and its log), and nothing else is affected. The fork
server is killed when this process dies (``fork_server``), and job processes die with it (both
by PR_SET_PDEATHSIG);
on start-up, jobs a dead server left running are queued again or, after ``max_attempts``,
failed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

import psutil

from .. import jobs
from ..db import session_scope
from ..jobs import Claim
from ..settings import Settings, get_settings
from ..storage import make_store
from . import steps
from .failures import exit_message, peak_address_space_mb, timeout_message
from .job_process import PRELOAD, clean_leftovers, enter, job_log_path, limit_threads

log = logging.getLogger("edge_un.queue")
# Imported first by the fork server: it dies with the dispatcher thread that starts it.
FORK_SERVER_LIFETIME = "service.worker.fork_server"


def child_main(job_id: str, attempt: int, environ: dict[str, str], log_path: str) -> None:
    """The job process as the local queue starts it: a fork of the (preloaded) fork server,
    handed its settings as EDGE_UN_* variables; it runs the whole conversion."""
    parent = os.getppid()
    os.setsid()  # its own process group: a timeout or cancel kills all it started
    os.environ.update(environ)
    settings = get_settings()
    step = functools.partial(steps.run, settings, Claim(job_id, attempt))
    sys.exit(enter(settings, Path(log_path), parent, step))


class JobQueue(Protocol):
    def start(self) -> None:
        """Recover what a previous run left and begin running queued jobs."""

    def stop(self) -> None:
        """Stop running jobs (they are queued again) and the dispatcher."""

    def submit(self, job_id: str) -> None:
        """A job row was committed as queued: run it when its turn comes."""

    def cancel(self, job_id: str) -> None:
        """A job was marked cancelled: stop its process if it has one."""

    def problem(self) -> str | None:
        """Why jobs would not run now (for /readyz), or None when they would."""


def make_queue(settings: Settings) -> JobQueue:
    """The queue the settings ask for (EDGE_UN_QUEUE): this process's own job processes, or
    Celery workers elsewhere (imported only then: the local mode needs no Celery)."""
    if settings.queue == "celery":
        from .celery_queue import CeleryQueue

        return CeleryQueue(settings)
    return LocalProcessQueue(settings)


@dataclass
class _Running:
    claim: jobs.Claim
    process: BaseProcess
    started: float
    reason: str | None = field(default=None)  # why we killed it, when we did
    peak_mb: float = 0.0  # its peak address space, as last sampled (gone once it died)


def _kill_group(pid: int) -> None:
    """SIGKILL a job process and everything it started (it leads its own process group; before
    it got there, the process alone)."""
    if pid <= 0:  # 0 or -1 would mean our own group, or every process we may signal
        return
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


class LocalProcessQueue:
    """FIFO, bounded concurrency, one process per job, the database as the queue."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._running: dict[str, _Running] = {}
        self.logs = settings.data_dir.resolve() / "logs"
        self.store = make_store(settings)
        self._context: ForkServerContext | None = None

    # -- the interface -------------------------------------------------------------------
    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._recover()
        self._thread = threading.Thread(target=self._loop, name="edge-un-dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, job_id: str) -> None:
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        self._wake.set()

    def problem(self) -> str | None:
        if self._thread is None or not self._thread.is_alive():
            return "the job dispatcher is not running; jobs would wait forever"
        return None

    # -- the dispatcher thread -----------------------------------------------------------
    def _recover(self) -> None:
        with session_scope(self.settings) as session:
            for job in jobs.running(session):
                if job.pid and job.started_at:
                    self._kill_orphan(job.pid, job.started_at)
            requeued, failed = jobs.recover(session, self.settings.max_attempts)
        if requeued or failed:
            log.warning(
                "recovered jobs a stopped server left running: %d queued again, %d "
                "failed after %d attempts",
                len(requeued),
                len(failed),
                self.settings.max_attempts,
            )

    @staticmethod
    def _kill_orphan(pid: int, started_at: datetime) -> None:
        """A job process of a server that died (and outlived it): stop it before re-running.
        The pid is only trusted if that process was created when the job started."""
        try:
            created = psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        if abs(created - started_at.timestamp()) < 30:
            _kill_group(pid)

    def _loop(self) -> None:
        # Start the fork server now: it imports the pipeline while the first upload arrives.
        self._forkserver()
        multiprocessing.forkserver.ensure_running()
        while not self._stopping.is_set():
            try:
                self._tick()
            except Exception:  # a database hiccup must not end dispatching
                log.exception("dispatcher tick failed; retrying")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()
        self._shutdown()

    def _tick(self) -> None:
        self._reap()
        self._enforce()
        while len(self._running) < self.settings.workers and not self._stopping.is_set():
            with session_scope(self.settings) as session:
                claim = jobs.claim_next(session)
            if claim is None:
                break
            self._spawn(claim)

    def _forkserver(self) -> ForkServerContext:
        if self._context is None:
            limit_threads(self.settings)  # before the fork server loads torch
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([FORK_SERVER_LIFETIME, __name__, *PRELOAD])
            self._context = context
        return self._context

    def _spawn(self, claim: jobs.Claim) -> None:
        log_path = job_log_path(self.settings, claim.job_id, claim.attempt)
        process = self._forkserver().Process(
            target=child_main,
            args=(claim.job_id, claim.attempt, self.settings.as_environ(), str(log_path)),
            name=f"edge-un-job-{claim.job_id}",
            daemon=True,  # never outlive this process, even on an unclean exit
        )
        started = time.monotonic()  # the time limit counts from here
        try:
            process.start()
        except OSError as error:
            with session_scope(self.settings) as session:
                jobs.fail(session, claim, f"the server could not start a job process ({error})")
            return
        assert process.pid is not None
        with session_scope(self.settings) as session:
            jobs.set_pid(session, claim, process.pid)
        self._running[claim.job_id] = _Running(claim, process, started)
        log.info("job %s attempt %d started (pid %d)", claim.job_id, claim.attempt, process.pid)

    def _enforce(self) -> None:
        """Kill what ran too long, and what was cancelled (or taken over) meanwhile; note each
        job process's peak address space (evidence if it crashes later)."""
        if not self._running:
            return
        for run in self._running.values():
            if run.process.pid is not None:
                run.peak_mb = max(run.peak_mb, peak_address_space_mb(run.process.pid))
        with session_scope(self.settings) as session:
            states = {job_id: jobs.state_of(session, job_id) for job_id in self._running}
        now = time.monotonic()
        for job_id, run in self._running.items():
            if run.reason is not None:
                continue
            state = states[job_id]
            if (
                state is None
                or state[0] in ("cancelled", "queued")
                or state[1] != run.claim.attempt
            ):
                # cancelled, deleted or taken over; a job that recorded its own outcome is
                # left to exit by itself
                run.reason = "cancelled"
                _kill_group(run.process.pid or 0)
            elif now - run.started > self.settings.job_timeout_s:
                run.reason = timeout_message(self.settings)
                _kill_group(run.process.pid or 0)

    def _reap(self) -> None:
        for job_id, run in list(self._running.items()):
            code = run.process.exitcode
            if code is None:
                continue
            assert run.process.pid is not None
            _kill_group(run.process.pid)  # anything it started and left behind
            run.process.close()
            del self._running[job_id]
            message = run.reason if run.reason != "cancelled" else None
            if message is None and code != 0:
                message = self._exit_message(code, run)
            if message is not None:
                with session_scope(self.settings) as session:
                    # no-op if the job process recorded its own outcome before exiting
                    if jobs.fail(session, run.claim, message):
                        log.warning("job %s failed: %s", job_id, message)
            self.store.discard_run(run.claim.job_id, run.claim.attempt)
            clean_leftovers(self.settings, self.store, job_id)
            log.info("job %s attempt %d ended (exit %s)", job_id, run.claim.attempt, code)
            self._wake.set()  # a slot is free

    def _exit_message(self, code: int, run: _Running) -> str:
        with session_scope(self.settings) as session:
            stage = jobs.stage_of(session, run.claim.job_id)
        return exit_message(
            code,
            stage=stage,
            peak_mb=run.peak_mb,
            log_path=job_log_path(self.settings, run.claim.job_id, run.claim.attempt),
            limit_mb=self.settings.job_memory_mb,
        )

    def _shutdown(self) -> None:
        """Graceful stop: running jobs go back to the queue without using up an attempt."""
        for run in self._running.values():
            _kill_group(run.process.pid or 0)
            run.process.join(timeout=10)
            with session_scope(self.settings) as session:
                jobs.requeue(session, run.claim, count_attempt=False)
        self._running.clear()
