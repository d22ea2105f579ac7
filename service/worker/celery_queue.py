"""Celery mode, API side: ``CeleryQueue`` sends a task per job, revokes on cancel, reconciles.

The API process never converts. ``submit`` publishes a task carrying the job id (and records
when: ``dispatched_at``); a publish that fails leaves the job queued and undispatched, and the
reconciler thread sends it again. Every ``heartbeat_s`` the reconciler also queues again (or
fails, after ``max_attempts``) running jobs whose heartbeat stopped: their worker died, and the
message it held may not come back before the broker's visibility timeout. At start-up every
queued job is sent again, whatever the broker kept: an API that died between recording a job
and sending it, or a broker that lost its data, loses nothing. Duplicate messages are harmless
(``jobs.claim`` lets one delivery win).
"""

from __future__ import annotations

import logging
import threading
import time

from kombu.utils.url import maybe_sanitize_url

from .. import jobs
from ..db import session_scope
from ..settings import Settings
from ..storage import make_store
from .celery_app import QUEUE_NAME, TASK_NAME, make_celery
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
        for job_id in waiting:
            self._send(job_id)
        if waiting:
            log.info("sent the %d queued job(s) to the broker again", len(waiting))
        self._thread = threading.Thread(target=self._loop, name="edge-un-reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, job_id: str) -> None:
        self._send(job_id)

    def cancel(self, job_id: str) -> None:
        try:  # a queued message is dropped when it arrives; a running conversion is killed
            self.app.control.revoke(job_id, terminate=True, signal="SIGKILL")
        except Exception as error:  # the job's watchdog stops it anyway, from the database
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
            self.app.send_task(TASK_NAME, args=[job_id], task_id=job_id, queue=QUEUE_NAME)
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

    def _reconcile(self) -> None:
        self._check_broker()
        with session_scope(self.settings) as session:
            requeued, failed = jobs.recover_lost(
                session, self.settings.lease_s, self.settings.max_attempts
            )
            undispatched = jobs.undispatched(session, quiet_s=self.settings.heartbeat_s)
        if requeued or failed:
            log.warning(
                "jobs whose worker was lost: %d queued again, %d failed", len(requeued), len(failed)
            )
        for job_id in [*requeued, *undispatched]:
            if not self._send(job_id):
                break  # the broker is away: try the rest next time
        self._clean_cancelled()

    def _clean_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [job_id for job_id, when in self._cleanups.items() if when <= now]
            for job_id in due:
                del self._cleanups[job_id]
        for job_id in due:
            clean_leftovers(self.settings, self.store, job_id)
