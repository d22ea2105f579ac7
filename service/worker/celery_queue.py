"""Celery mode, API side: ``CeleryQueue`` rings the workers' doorbell per job, revokes on
cancel, reconciles.

The API process never converts. ``submit`` publishes a start task (``celery_dispatch``) and
records when (``dispatched_at``); a publish that fails leaves the job queued and undispatched,
and the reconciler thread sends it again. Every ``heartbeat_s`` the reconciler also queues
again (or fails, after ``max_attempts``) what a dead worker left: a run's first step or a
target whose heartbeat stopped, sends what could not be sent (targets, reports whose last
target's worker died), sends again what was sent but will not start (``service.lost_steps``: a
step a dead worker had received, one the broker lost while a worker idled), and fails a run
past its time limit that no worker is there to stop. Nothing waits on the broker's visibility
timeout (``celery_app.redelivery_s``, half an hour): a late original message finds its step
claimed or done and exits. At
start-up every queued job and target is sent again, whatever the broker kept: an API that died
between recording a job and sending it, or a broker that lost its data, loses nothing.
Duplicate messages are harmless (each step is claimed by one conditional UPDATE).
"""

from __future__ import annotations

import logging
import threading
import time

from kombu.utils.url import maybe_sanitize_url

from .. import job_targets, jobs, lost_steps
from ..db import session_scope
from ..jobs import Claim
from ..settings import Settings
from ..storage import make_store
from .celery_app import HARD_LIMIT_GRACE_S, make_celery, redelivery_s
from .celery_dispatch import report_task_id, send_report, send_start, send_targets, target_task_id
from .failures import timeout_message
from .job_process import clean_leftovers

log = logging.getLogger("edge_un.celery_queue")


class CeleryQueue:
    """``JobQueue`` over a Celery broker; the database stays the single truth."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = make_celery(settings)
        self.store = make_store(settings)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._cleanups: dict[str, float] = {}  # cancelled job -> when its worker surely stopped
        self._lock = threading.Lock()
        self._broker_error: str | None = None  # from the last check, every heartbeat_s

    # -- the interface -------------------------------------------------------------------
    def start(self) -> None:
        self._check_broker()
        with session_scope(self.settings) as session:
            waiting = jobs.queued_ids(session)
            targets = job_targets.queued_targets(session)
        for job_id in waiting:
            self._send(job_id)
        self._send_targets(targets)
        if waiting or targets:
            log.info(
                "sent the %d queued job(s) and %d target(s) to the broker again",
                len(waiting), len(targets),
            )  # fmt: skip
        self._thread = threading.Thread(target=self._loop, name="edge-un-reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, job_id: str) -> None:
        self._send(job_id)

    def cancel(self, job_id: str) -> None:
        """Stop every step of the job's run now: its targets' and report's tasks are revoked
        (a queued one is dropped when it arrives, a running one killed). Its first step's
        watchdog stops it from the database within a heartbeat."""
        with session_scope(self.settings) as session:
            state = jobs.state_of(session, job_id)
            steps = job_targets.steps_of_job(session, job_id)
        run = state[1] if state else 0
        task_ids = [target_task_id(*step) for step in steps]
        task_ids += [report_task_id(job_id, run)] if steps else []
        try:
            if task_ids:
                self.app.control.revoke(task_ids, terminate=True, signal="SIGKILL")
        except Exception as error:  # each step's watchdog stops it anyway, from the database
            log.warning("could not revoke job %s at the broker: %s", job_id, error)
        with self._lock:
            self._cleanups[job_id] = time.monotonic() + self.settings.lease_s

    def problem(self) -> str | None:
        if self._thread is None or not self._thread.is_alive():
            return "the job reconciler is not running; lost jobs would not be recovered"
        return self._broker_error

    def _check_broker(self) -> None:
        try:
            with self.app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, interval_start=0, timeout=2)
        except Exception as error:
            url = maybe_sanitize_url(self.settings.broker_url)
            self._broker_error = (
                f"the broker at {url} (EDGE_UN_BROKER_URL) does not answer "
                f"({type(error).__name__}); jobs are accepted but wait until it does"
            )
        else:
            self._broker_error = None

    # -- the reconciler ------------------------------------------------------------------
    def _send(self, job_id: str) -> bool:
        try:
            send_start(self.app, job_id)
        except Exception as error:  # the broker is away: the reconciler sends it later
            log.warning("could not send job %s to the broker (will retry): %s", job_id, error)
            return False
        with session_scope(self.settings) as session:
            jobs.mark_dispatched(session, job_id)
        return True

    def _loop(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            try:
                self._reconcile()
            except Exception:  # a database or broker hiccup must not end reconciling
                log.exception("reconciling jobs with the broker failed; retrying")

    def _send_targets(self, steps: list[job_targets.Step]) -> bool:
        try:
            send_targets(self.app, steps)
        except Exception as error:  # the broker is away: the reconciler sends them later
            log.warning("could not send %d target(s) to the broker: %s", len(steps), error)
            return False
        with session_scope(self.settings) as session:
            job_targets.mark_sent(session, steps)
        return True

    def _reconcile(self) -> None:
        self._check_broker()
        settings = self.settings
        lease, quiet = settings.lease_s, settings.heartbeat_s
        with session_scope(settings) as session:
            requeued, failed = jobs.recover_lost(session, lease, settings.max_attempts)
            undispatched = jobs.undispatched(session, quiet_s=quiet)
            lost, ended = job_targets.lost_targets(session, lease, settings.max_attempts)
            unsent = job_targets.unsent_targets(session, quiet_s=quiet)
            for claim in job_targets.overdue(session, settings.job_timeout_s, HARD_LIMIT_GRACE_S):
                jobs.fail(session, claim, timeout_message(settings))
            # a report sent waits at the broker as a dead worker's message would, no longer
            due = job_targets.reports_due(session, lease, redelivery_s(settings))
            # sent but never to start: a dead worker held them, or no worker will get them
            resend, dead = lost_steps.of_dead_workers(session, lease)
            resend.add(lost_steps.stranded(session, lease))
        if dead or resend:
            log.warning(
                "worker(s) lost: %s; sending again %d start(s), %d target(s), %d report(s) "
                "that no worker will start", ", ".join(dead) or "none", len(resend.starts),
                len(resend.targets), len(resend.reports),
            )  # fmt: skip
        if requeued or failed or lost or ended:
            log.warning(
                "steps whose worker was lost: %d job(s) queued again, %d failed; %d target(s) "
                "queued again, %d failed", len(requeued), len(failed), len(lost), ended,
            )  # fmt: skip
        for job_id in dict.fromkeys([*requeued, *undispatched, *resend.starts]):
            if not self._send(job_id):
                break  # the broker is away: try the rest next time
        targets = list(dict.fromkeys([*lost, *unsent, *resend.targets]))
        if targets:
            self._send_targets(targets)
        for claim in dict.fromkeys([*due, *resend.reports]):
            self._send_report(claim)
        self._clean_cancelled()

    def _send_report(self, claim: Claim) -> None:
        try:
            send_report(self.app, claim)
        except Exception as error:
            log.warning("could not send the report of job %s: %s", claim.job_id, error)
            return
        with session_scope(self.settings) as session:
            job_targets.mark_report_sent(session, claim)

    def _clean_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [job_id for job_id, when in self._cleanups.items() if when <= now]
            for job_id in due:
                del self._cleanups[job_id]
        for job_id in due:
            clean_leftovers(self.settings, self.store, job_id)
