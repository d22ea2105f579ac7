"""Celery mode: the workers' own records (``service.db.Worker``), written by each worker's
presence thread (``service.worker.celery_presence``) and read by the API's reconciler.

A worker's liveness is its record's, not a task's: a message a worker received but whose step
never started has no heartbeat of its own, and the broker gives it back only after its
visibility timeout (half an hour). A record that went stale for longer than the lease says the
worker died, and what it held says which steps to send again (``service.lost_steps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from .db import Worker
from .db.models import utcnow
from .jobs import stale_before

Held = tuple[str, tuple]  # a task's name and its arguments (ids only: celery_dispatch)


def beat(session: Session, name: str, held: Sequence[Held], idle_since: datetime | None) -> None:
    """The worker ``name`` is alive and holds ``held`` (nothing since ``idle_since``). Only
    the worker itself writes its record: no two writers race on it."""
    values = {"heartbeat_at": utcnow(), "idle_since": idle_since,
              "held": [[task, list(args)] for task, args in held]}  # fmt: skip
    moved = session.execute(update(Worker).where(Worker.name == name).values(**values))
    if moved.rowcount == 0:
        session.add(Worker(name=name, started_at=utcnow(), **values))


def forget(session: Session, name: str) -> None:
    session.execute(delete(Worker).where(Worker.name == name))


def dead(session: Session, lease_s: float) -> list[Worker]:
    """Workers silent for longer than the lease."""
    return list(session.scalars(select(Worker).where(Worker.heartbeat_at < stale_before(lease_s))))


def held_by_live(session: Session, lease_s: float) -> set[Held]:
    """What the live workers hold."""
    rows = session.scalars(select(Worker.held).where(Worker.heartbeat_at >= stale_before(lease_s)))
    return {(task, tuple(args)) for held in rows for task, args in held}


def one_idle_for(session: Session, lease_s: float) -> bool:
    """Whether a live worker has held nothing for longer than the lease: a step sent before
    then and held by no live worker is not at the broker any more (a worker died with it
    before it could say so, or the broker lost it)."""
    idle = select(Worker.name).where(
        Worker.heartbeat_at >= stale_before(lease_s), Worker.idle_since < stale_before(lease_s)
    )
    return session.scalar(idle.limit(1)) is not None
