"""Celery mode, worker side: the app, its settings, and the task that runs one conversion.

The database is the truth and the broker only a doorbell: a task carries nothing but a job id,
and everything about the job (state, stage, percent, attempts, outcome) lives in its row. A
task claims its job with a conditional UPDATE (``jobs.claim``), so a duplicate or late message
changes nothing. Reliability comes from Celery's standard settings for long tasks: the message
is acknowledged only after the conversion (``acks_late``), a pool process that dies puts it
back (``task_reject_on_worker_lost``), a worker takes one message at a time (prefetch 1), and
each conversion runs in a fresh pool process (``max_tasks_per_child=1``, forked from a worker
that has already imported the pipeline). The pool process forks the job process itself (what
the local queue's fork server does) and watches it: the conversion runs under the job's memory
limit with its output in the job's log (echoed to the worker's output as it comes), and a job
process killed by a signal fails its job with the reason (``job_process.exit_message``: the
signal, the peak address space sampled while it ran, the log's last words), instead of
being taken for a lost worker and run again into the same crash.

A running job's watchdog thread writes a heartbeat every ``heartbeat_s``; a run whose heartbeat
stops (its worker was killed) is taken over after the lease by the redelivered message or by
the API's reconciler (``service.worker.celery_queue``), whichever comes first. The same thread stops
the conversion when the job was cancelled or ran past ``job_timeout_s`` (Celery's hard time
limit stays as the backstop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from celery import Celery, Task
from celery.signals import worker_process_init

from .. import jobs
from ..db import session_scope, upgrade
from ..db.session import dispose_engines
from ..job_states import ENDED
from ..settings import Settings, get_settings
from ..storage import ArtifactStore, make_store
from .job_process import (
    clean_leftovers,
    enter,
    exit_message,
    job_log_path,
    limit_threads,
    peak_address_space_mb,
    preload,
    timeout_message,
)

TASK_NAME = "edge_un.convert"
QUEUE_NAME = "edge-un"
# Celery's hard time limit comes this long after ours: ours records the reason first.
HARD_LIMIT_GRACE_S = 60
WATCH_INTERVAL_S = 0.25  # how often the pool process samples its job process and echoes its log
# What a Celery pool process may have set for these; the job process wants the defaults.
_RESET_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1)

log = logging.getLogger("edge_un.celery")


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery's settings for conversions: minutes-long, memory-hungry, never to be lost."""
    hard_limit = settings.job_timeout_s + HARD_LIMIT_GRACE_S
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        # A message a dead worker held comes back after this long; no run lasts longer, so a
        # live run's message never comes back (the reconciler recovers sooner anyway).
        "broker_transport_options": {
            "visibility_timeout": int(hard_limit + settings.lease_s),
            "unacked_restore_interval": 10,
        },
        # A publish while the broker is away fails fast: the job stays queued in the database
        # and the API sends it again (jobs.undispatched), instead of hanging the upload.
        "task_publish_retry_policy": {
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 1,
        },
        "task_serializer": "json",
        "accept_content": ["json"],  # never unpickle anything from the broker
        "task_ignore_result": True,  # the job's row is the result
        "task_default_queue": QUEUE_NAME,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_time_limit": hard_limit,
        "worker_prefetch_multiplier": 1,
        "worker_max_tasks_per_child": 1,
        # Broker connection lost: let running conversions finish (their job row records the
        # outcome; the message that comes back finds the job busy or done). Celery 6 flips this.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
    }


def make_celery(settings: Settings) -> Celery:
    app = Celery("edge_un", set_as_current=False)
    app.conf.update(celery_config(settings))
    app.task(
        name=TASK_NAME,
        bind=True,
        # one recheck of a redelivered job (see convert_job); bounded, not a loop
        max_retries=1,
    )(convert_job)
    return app


def convert_job(task: Task, job_id: str, recheck: bool = False) -> str:
    """Run job ``job_id`` if it is this delivery's to run. Returns what happened (for logs)."""
    settings = get_settings()
    store = make_store(settings)
    with session_scope(settings) as session:
        outcome = jobs.claim(session, job_id, settings.lease_s, settings.max_attempts)
    if outcome == "busy":
        # Running under a live heartbeat. A redelivered message means the pool process that
        # ran it may just have died (its last beat is still fresh): look again after a lease.
        redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
        if redelivered and not recheck:
            countdown = settings.lease_s + settings.heartbeat_s
            raise task.retry(kwargs={"recheck": True}, countdown=countdown)
        return "duplicate delivery of a running job: ignored"
    if outcome == "gone":
        clean_leftovers(settings, store, job_id)
        return "nothing to run"
    claim = outcome
    for earlier in range(1, claim.attempt):  # what killed runs of this job left behind
        store.discard_run(job_id, earlier)
    with session_scope(settings) as session:  # this pool process: a kill of it ends the run
        jobs.set_pid(session, claim, os.getpid())
    log_path = job_log_path(settings, job_id, claim.attempt)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    # Fork before the watchdog starts: no other thread may hold a lock the child inherits.
    child = os.fork()
    if child == 0:
        _job_process(settings, claim, log_path, parent)
    watchdog = Watchdog(settings, claim)
    watchdog.start()
    try:
        code, peak_mb = _watch(child, log_path)
    finally:
        watchdog.stop()
    if code != 0:
        _record_exit(settings, store, claim, code, peak_mb, log_path)
    return f"attempt {claim.attempt} ended with exit code {code}"


def _job_process(settings: Settings, claim: jobs.Claim, log_path: Path, parent: int) -> NoReturn:
    """The forked job process: output to the job's log, the conversion, then ``os._exit`` (never
    back into Celery's code, which belongs to the pool process)."""
    code = 1
    try:
        dispose_engines(close=False)  # the pool process's connections stay the pool process's
        for number in _RESET_SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        # dies with this pool process (cancel, timeout, kill -9 end it)
        code = enter(settings, claim, log_path, parent)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _watch(pid: int, log_path: Path) -> tuple[int, float]:
    """Wait for the job process: its exit code (negative: the signal that killed it) and its
    peak address space as last sampled. Its log is echoed to this worker's output meanwhile, so
    a worker's output still shows the jobs it ran (``docker compose logs worker``)."""
    peak_mb, offset = 0.0, 0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            peak_mb = max(peak_mb, peak_address_space_mb(pid))
        offset = _echo(log_path, offset)
        if done:
            return os.waitstatus_to_exitcode(status), peak_mb
        time.sleep(WATCH_INTERVAL_S)


def _echo(path: Path, offset: int) -> int:
    """Copy what the log gained since ``offset`` to this process's stderr; the new offset."""
    with contextlib.suppress(OSError), path.open("rb") as stream:
        stream.seek(offset)
        while chunk := stream.read(1 << 16):
            with contextlib.suppress(OSError):
                os.write(2, chunk)
            offset += len(chunk)
    return offset


def _record_exit(
    settings: Settings,
    store: ArtifactStore,
    claim: jobs.Claim,
    code: int,
    peak_mb: float,
    log_path: Path,
) -> None:
    """A job process that did not end well: fail its job with the reason if it recorded none
    (a no-op if it did), and remove what the run left."""
    with session_scope(settings) as session:
        message = exit_message(
            code,
            stage=jobs.stage_of(session, claim.job_id),
            peak_mb=peak_mb,
            log_path=log_path,
            limit_mb=settings.job_memory_mb,
        )
        if jobs.fail(session, claim, message):
            log.warning("job %s failed: %s", claim.job_id, message)
    store.discard_run(claim.job_id, claim.attempt)
    clean_leftovers(settings, store, claim.job_id)


class Watchdog(threading.Thread):
    """Beside a running conversion: heartbeat, and the end of a cancelled or overdue run.

    Stopping means SIGKILL of this pool process (what the local queue does to a job process):
    Celery then sees a lost worker, puts the message back, and its next delivery finds the job
    finished and only cleans up."""

    def __init__(self, settings: Settings, claim: jobs.Claim) -> None:
        super().__init__(name=f"edge-un-watchdog-{claim.job_id}", daemon=True)
        self.settings = settings
        self.claim = claim
        self.started = time.monotonic()
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)

    def run(self) -> None:
        while not self._done.wait(self.settings.heartbeat_s):
            try:
                self._beat()
            except Exception:  # a database hiccup: the next beat tries again
                log.exception("heartbeat of job %s failed", self.claim.job_id)

    def _beat(self) -> None:
        timeout = self.settings.job_timeout_s
        with session_scope(self.settings) as session:
            if time.monotonic() - self.started > timeout:
                message = timeout_message(self.settings)
                if jobs.fail(session, self.claim, message):
                    log.warning("job %s: %s", self.claim.job_id, message)
                alive = False
            else:
                alive = jobs.heartbeat(session, self.claim) or self._ended_by_itself(session)
        if not alive and not self._done.is_set():  # cancelled, timed out or taken over
            os.kill(os.getpid(), signal.SIGKILL)

    def _ended_by_itself(self, session) -> bool:
        """The run recorded its own outcome (between two beats): let it finish."""
        state = jobs.state_of(session, self.claim.job_id)
        return state is not None and state[0] in ENDED and state[1] == self.claim.attempt


@worker_process_init.connect
def _fresh_connections(**_: Any) -> None:
    """A pool process must not reuse database connections its parent opened."""
    dispose_engines(close=False)


def run_worker(
    settings: Settings, concurrency: int | None = None, hostname: str | None = None
) -> None:
    """``edge-un worker``: a Celery worker running ``concurrency`` conversions at once (default
    EDGE_UN_WORKERS), until it is stopped (SIGTERM: a warm shutdown that finishes or hands back
    what runs)."""
    if settings.queue != "celery":
        raise ValueError(
            "a worker serves the Celery queue: set EDGE_UN_QUEUE=celery and EDGE_UN_BROKER_URL"
        )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    upgrade(settings)  # a worker may start before the API does
    dispose_engines()  # pool processes open their own connections
    limit_threads(settings)  # before torch loads
    preload()
    argv = [
        "worker",
        f"--concurrency={concurrency or settings.workers}",
        "--pool=prefork",
        "--loglevel=INFO",
        f"--queues={QUEUE_NAME}",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    make_celery(settings).worker_main(argv)


def ping_worker(settings: Settings, hostname: str | None = None, timeout: float = 5) -> bool:
    """Whether the worker ``hostname`` (default: this host's, ``celery@<host name>``) answers
    a ping through the broker: alive, connected, and its consumer not stuck."""
    name = (hostname or "celery@%h").replace("%h", socket.gethostname())
    replies = make_celery(settings).control.ping(destination=[name], timeout=timeout)
    return any(name in reply for reply in replies)
