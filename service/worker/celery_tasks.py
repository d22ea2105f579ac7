"""Celery mode, worker side: the three tasks of a job's run (``celery_dispatch`` says what each
is), each running its step (``service.worker.steps``) in a job process it forks and watches.

The database is the truth and the broker only a doorbell: each task claims its step with a
conditional UPDATE (``jobs.claim_next`` / ``jobs.claim``, ``job_targets.claim_target``,
``job_targets.claim_report``), so a duplicate or late message changes nothing. A message is
acknowledged only once its step ended (``acks_late``), and a pool process that dies puts it
back (``task_reject_on_worker_lost``): a worker killed in the middle of a target builds that
target again on another worker, alone. The pool process forks the job process itself (what the
local queue's fork server does) and watches it: the step runs under the job's memory limit with
its output in its log (echoed to the worker's output as it comes), and a job process killed by
a signal ends its step with the reason (``failures.exit_message``: the signal, the peak
address space sampled while it ran, the log's last words), instead of being taken for a lost
worker and run again into the same crash.

Beside a running step, a watchdog thread writes its heartbeat every ``heartbeat_s``; a step
whose heartbeat stops (its worker was killed) is taken over after the lease by the redelivered
message or by the API's reconciler (``service.worker.celery_queue``), whichever comes first. A
step received but not started has no heartbeat: the worker's own record
(``celery_presence``) says it holds it, and the reconciler sends it again once that record went
stale (``service.lost_steps``). A watchdog that could not write a beat for a lease less one
beat stops its step itself: past the lease another worker may take it over, and a step never
runs twice at once.
The same thread stops the step when its job was cancelled or ran past ``job_timeout_s`` (counted
from when the run started; Celery's hard time limit stays as the backstop).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from celery import Celery, Task
from sqlalchemy.orm import Session

from .. import job_targets, jobs
from ..db import session_scope
from ..db.session import dispose_engines
from ..job_states import ENDED
from ..jobs import Claim
from ..settings import Settings, get_settings
from ..storage import make_store
from .celery_dispatch import REPORT_TASK, START_TASK, TARGET_TASK, send_report, send_targets
from .failures import exit_message, peak_address_space_mb, timeout_message
from .job_process import Step, clean_leftovers, enter, job_log_path
from .steps import prepare_step, report_step, target_step

WATCH_INTERVAL_S = 0.25  # how often the pool process samples its job process and echoes its log
# What a Celery pool process may have set for these; the job process wants the defaults.
_RESET_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1)

log = logging.getLogger("edge_un.celery")


def start_job(task: Task, job_id: str, recheck: bool = False) -> str:
    """``edge_un.convert``: start the fairest queued job (its first step: prepare it), then
    send its targets. With none queued, this message's own job may be a run whose worker just
    died: take it over once its heartbeat is past the lease. Returns what happened (logs)."""
    settings = get_settings()
    with session_scope(settings) as session:
        outcome = jobs.claim_next(session, phase=jobs.PREPARE) or jobs.claim(
            session, job_id, settings.lease_s, settings.max_attempts
        )
    if outcome == "busy":
        return _busy(task, settings, recheck, "a running job")
    if outcome == "gone":
        clean_leftovers(settings, make_store(settings), job_id)
        return "nothing to start"
    claim = outcome
    store = make_store(settings)
    for earlier in range(1, claim.attempt):  # what killed runs of this job left behind
        store.discard_run(claim.job_id, earlier)
    with session_scope(settings) as session:  # this pool process: a kill of it ends the run
        jobs.set_pid(session, claim, os.getpid())
    watchdog = Watchdog(
        settings, claim.job_id,
        beat=lambda session: jobs.heartbeat(session, claim) or _ended_itself(session, claim),
        deadline=time.time() + settings.job_timeout_s,
        on_timeout=lambda session: _time_out(session, claim, settings),
    )  # fmt: skip
    log_path = job_log_path(settings, claim.job_id, claim.attempt)
    code, peak_mb = _run_step(settings, log_path, watchdog, prepare_step, claim)
    if code != 0:
        _fail_run(settings, claim, code, peak_mb, log_path)
    else:
        with session_scope(settings) as session:
            steps = job_targets.queued_of_run(session, claim)
        # marked sent only once the broker took them: unsent, the reconciler sends them
        if _send(send_targets, task, steps):
            with session_scope(settings) as session:
                job_targets.mark_sent(session, steps)
    return f"job {claim.job_id} attempt {claim.attempt} prepared: exit code {code}"


def build_target(task: Task, job_id: str, run: int, name: str, recheck: bool = False) -> str:
    """``edge_un.build_target``: build target ``name`` of run ``run``; the last target of the
    run to end sends its report."""
    settings = get_settings()
    with session_scope(settings) as session:
        outcome = job_targets.claim_target(
            session, job_id, run, name, settings.lease_s, settings.max_attempts
        )
    if outcome == "busy":
        return _busy(task, settings, recheck, "a target being built")
    if outcome == "gone":
        _report_if_due(task, settings, Claim(job_id, run))
        return "nothing to build"
    claim = outcome
    with session_scope(settings) as session:
        job_targets.set_target_pid(session, claim, os.getpid())
        started = jobs.started_at(session, job_id)
    deadline = (started.timestamp() if started else time.time()) + settings.job_timeout_s
    watchdog = Watchdog(
        settings, job_id,
        beat=lambda session: job_targets.target_heartbeat(session, claim)
        or job_targets.ended_itself(session, claim),
        deadline=deadline,
        on_timeout=lambda session: _time_out(session, claim.job, settings),
    )  # fmt: skip
    log_path = job_log_path(settings, job_id, run, f"{name}-{claim.attempt}")
    code, peak_mb = _run_step(settings, log_path, watchdog, target_step, claim)
    if code != 0:
        with session_scope(settings) as session:
            message = exit_message(
                code, stage=job_targets.stage_label_of(session, claim), peak_mb=peak_mb,
                log_path=log_path, limit_mb=settings.job_memory_mb,
            )  # fmt: skip
            if job_targets.end_target(session, claim, message):
                log.warning("job %s: target %s failed: %s", job_id, name, message)
    _report_if_due(task, settings, claim.job)
    return f"job {job_id} attempt {run} target {name} build {claim.attempt}: exit code {code}"


def report(task: Task, job_id: str, run: int) -> str:
    """``edge_un.report``: assemble run ``run``'s report once every target ended, publish it
    and record the job's outcome."""
    settings = get_settings()
    claim = Claim(job_id, run)
    with session_scope(settings) as session:
        if not job_targets.claim_report(session, claim, settings.lease_s):
            return "no report due"
        jobs.set_pid(session, claim, os.getpid())
        started = jobs.started_at(session, job_id)
    deadline = (started.timestamp() if started else time.time()) + settings.job_timeout_s
    watchdog = Watchdog(
        settings, job_id,
        beat=lambda session: jobs.heartbeat(session, claim) or _ended_itself(session, claim),
        deadline=deadline,
        on_timeout=lambda session: _time_out(session, claim, settings),
    )  # fmt: skip
    log_path = job_log_path(settings, job_id, run, "report")
    code, peak_mb = _run_step(settings, log_path, watchdog, report_step, claim)
    if code != 0:
        _fail_run(settings, claim, code, peak_mb, log_path)
    return f"job {job_id} attempt {run} reported: exit code {code}"


def _busy(task: Task, settings: Settings, recheck: bool, what: str) -> str:
    """A step running under a live heartbeat. A redelivered message means the pool process
    that ran it may just have died (its last beat is still fresh): look again after a lease,
    once."""
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    if redelivered and not recheck:
        countdown = settings.lease_s + settings.heartbeat_s
        raise task.retry(kwargs={"recheck": True}, countdown=countdown)
    return f"duplicate delivery of {what}: ignored"


def _report_if_due(task: Task, settings: Settings, claim: Claim) -> None:
    """Send the run's report once its last target ended (a duplicate is harmless: one worker
    claims it)."""
    with session_scope(settings) as session:
        due = jobs.state_of(session, claim.job_id) == ("running", claim.attempt)
        due = due and job_targets.all_ended(session, claim.job_id, claim.attempt)
    if due and _send(send_report, task, claim):
        with session_scope(settings) as session:
            job_targets.mark_report_sent(session, claim)


def _send(send: Callable, task: Task, what: object) -> bool:
    """Send from a worker; a broker away now is the reconciler's to make up for."""
    try:
        send(task.app, what)
    except Exception as error:
        log.warning("could not send to the broker (the API's reconciler will): %s", error)
        return False
    return True


def _ended_itself(session: Session, claim: Claim) -> bool:
    """The run recorded its own outcome (between two beats): let it finish."""
    state = jobs.state_of(session, claim.job_id)
    return state is not None and state[0] in ENDED and state[1] == claim.attempt


def _time_out(session: Session, claim: Claim, settings: Settings) -> None:
    message = timeout_message(settings)
    if jobs.fail(session, claim, message):
        log.warning("job %s: %s", claim.job_id, message)


def _fail_run(settings: Settings, claim: Claim, code: int, peak_mb: float, log_path: Path) -> None:
    """A job process of a run's own step that did not end well: fail its job with the reason
    if it recorded none (a no-op if it did), and remove what the run left."""
    with session_scope(settings) as session:
        message = exit_message(
            code, stage=jobs.stage_of(session, claim.job_id), peak_mb=peak_mb,
            log_path=log_path, limit_mb=settings.job_memory_mb,
        )  # fmt: skip
        if jobs.fail(session, claim, message):
            log.warning("job %s failed: %s", claim.job_id, message)
    store = make_store(settings)
    store.discard_run(claim.job_id, claim.attempt)
    clean_leftovers(settings, store, claim.job_id)


def _run_step(
    settings: Settings, log_path: Path, watchdog: Watchdog, work: Callable, claim: object
) -> tuple[int, float]:
    """``work(settings, claim)`` in a forked job process, watched: its exit code (negative: the
    signal that killed it) and its peak address space as last sampled."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    step = functools.partial(work, settings, claim)
    # Fork before the watchdog starts: no other thread may hold a lock the child inherits.
    child = os.fork()
    if child == 0:
        _job_process(settings, log_path, parent, step)
    watchdog.start()
    try:
        return _watch(child, log_path)
    finally:
        watchdog.stop()


def _job_process(settings: Settings, log_path: Path, parent: int, step: Step) -> NoReturn:
    """The forked job process: output to the job's log, the step, then ``os._exit`` (never
    back into Celery's code, which belongs to the pool process)."""
    code = 1
    try:
        dispose_engines(close=False)  # the pool process's connections stay the pool process's
        for number in _RESET_SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        # dies with this pool process (cancel, timeout, kill -9 end it)
        code = enter(settings, log_path, parent, step)
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


class Watchdog(threading.Thread):
    """Beside a running step: its heartbeat (``beat``: False once the step no longer runs this
    attempt), and the end of a cancelled or overdue run (past ``deadline``, ``time.time()``).

    Stopping means SIGKILL of this pool process (what the local queue does to a job process):
    Celery then sees a lost worker, puts the message back, and its next delivery finds the step
    ended and only cleans up."""

    def __init__(
        self,
        settings: Settings,
        job_id: str,
        beat: Callable[[Session], bool],
        deadline: float,
        on_timeout: Callable[[Session], None],
    ) -> None:
        super().__init__(name=f"edge-un-watchdog-{job_id}", daemon=True)
        self.settings = settings
        self.job_id = job_id
        self.beat = beat
        self.deadline = deadline
        self.on_timeout = on_timeout
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)

    def run(self) -> None:
        beat_s, last_beat = self.settings.heartbeat_s, time.monotonic()
        wait = beat_s
        while not self._done.wait(wait):
            try:
                self._beat()
            except Exception:  # a database hiccup: try again soon
                log.exception("heartbeat of job %s failed", self.job_id)
                wait = beat_s / 4
                self._fence(time.monotonic() - last_beat)
            else:
                last_beat, wait = time.monotonic(), beat_s

    def _fence(self, silent_s: float) -> None:
        """Stop the step before its lease can run out: past the lease, the reconciler or a
        redelivered message takes it over, and it must never run twice at once (a target's
        files, a report's publication). A beat short of the lease is the margin."""
        if silent_s > self.settings.lease_s - self.settings.heartbeat_s:
            log.error(
                "job %s: no heartbeat written for %.1f s; stopping this step before another "
                "worker takes it over", self.job_id, silent_s,
            )  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)

    def _beat(self) -> None:
        with session_scope(self.settings) as session:
            if time.time() > self.deadline:
                self.on_timeout(session)
                alive = False
            else:
                alive = self.beat(session)
        if not alive and not self._done.is_set():  # cancelled, timed out or taken over
            os.kill(os.getpid(), signal.SIGKILL)


def register(app: Celery) -> None:
    """The three tasks on ``app``; a start and a build may retry once (the recheck of a
    redelivered message whose step still beats: bounded, not a loop)."""
    app.task(name=START_TASK, bind=True, max_retries=1)(start_job)
    app.task(name=TARGET_TASK, bind=True, max_retries=1)(build_target)
    app.task(name=REPORT_TASK, bind=True, max_retries=0)(report)
