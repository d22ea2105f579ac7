"""Celery mode: the tasks that go to the broker, by name, and how they are sent. The API and
the workers both send them; a task carries ids only, the database holds the rest.

- ``edge_un.convert`` (:func:`send_start`, one per queued job): start the next job. The
  worker that takes it claims the fairest queued job (``jobs.claim_next``: round robin between
  tokens), not necessarily the one it was sent for: the broker only counts how many jobs wait.
- ``edge_un.build_target`` (:func:`send_targets`, a ``group`` of one per target, when a run's
  first step ended): build that target of that run, on whichever worker takes it.
- ``edge_un.report`` (:func:`send_report`, when a run's last target ended): assemble its
  report. Fan-out with ``group``, join by the database: each target's end is one conditional
  UPDATE, and whoever sees the last one end sends the report (a chord's counter, kept where
  duplicate and redelivered messages count once).

Redis hands out a lower priority number first: the steps of runs already started go before a
new job's start, so a started job's targets never wait behind jobs queued after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery, group

from ..job_targets import Step
from ..jobs import Claim

START_TASK = "edge_un.convert"
TARGET_TASK = "edge_un.build_target"
REPORT_TASK = "edge_un.report"
QUEUE_NAME = "edge-un"
RUN_PRIORITY, START_PRIORITY = 0, 9  # Redis: 0 is taken first


def target_task_id(job_id: str, run: int, name: str) -> str:
    return f"{job_id}-{run}-{name}"


def report_task_id(job_id: str, run: int) -> str:
    return f"{job_id}-{run}-report"


def send_start(app: Celery, job_id: str) -> None:
    app.send_task(START_TASK, args=[job_id], queue=QUEUE_NAME, priority=START_PRIORITY)


def send_targets(app: Celery, steps: Sequence[Step]) -> None:
    """One task per target, sent as one group (task ids that a cancel can revoke)."""
    options = {"queue": QUEUE_NAME, "priority": RUN_PRIORITY}
    tasks = [
        app.signature(
            TARGET_TASK,
            args=[job_id, run, name],
            options={**options, "task_id": target_task_id(job_id, run, name)},
        )
        for job_id, run, name in steps
    ]
    if tasks:
        group(tasks).apply_async()


def send_report(app: Celery, claim: Claim) -> None:
    app.send_task(
        REPORT_TASK,
        args=[claim.job_id, claim.attempt],
        task_id=report_task_id(claim.job_id, claim.attempt),
        queue=QUEUE_NAME,
        priority=RUN_PRIORITY,
    )
