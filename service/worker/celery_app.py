"""Celery mode, worker side: the app and its settings (the tasks: ``celery_tasks``), and
``edge-un worker``.

The database is the truth and the broker only a doorbell: a task carries ids only, and
everything about a job (state, step, stage, percent, attempts, outcome) lives in its records.
Reliability comes from Celery's standard settings for long tasks: a message is acknowledged
only after its step (``acks_late``), a pool process that dies puts it back
(``task_reject_on_worker_lost``), a worker takes one message at a time (prefetch 1), and each
step runs in a fresh pool process (``max_tasks_per_child=1``, forked from a worker that has
already imported the pipeline).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

from ..db import upgrade
from ..db.session import dispose_engines
from ..settings import Settings
from .celery_dispatch import QUEUE_NAME
from .celery_presence import install as keep_worker_record
from .celery_tasks import register
from .job_process import limit_threads, preload

# Celery's hard time limit comes this long after ours: ours records the reason first.
HARD_LIMIT_GRACE_S = 60

log = logging.getLogger("edge_un.celery")


def redelivery_s(settings: Settings) -> float:
    """How long a message a dead worker held waits before it comes back (past the longest run)."""
    return settings.job_timeout_s + HARD_LIMIT_GRACE_S + settings.lease_s


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery's settings for conversions: minutes-long, memory-hungry, never to be lost."""
    hard_limit = settings.job_timeout_s + HARD_LIMIT_GRACE_S
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        # A message a dead worker held comes back after this long; no run lasts longer, so a
        # live run's message never comes back (the reconciler recovers sooner anyway).
        "broker_transport_options": {
            "visibility_timeout": int(redelivery_s(settings)),
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
    register(app)
    return app


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
    keep_worker_record(settings)  # its liveness, beyond each task's (service.workers)
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
