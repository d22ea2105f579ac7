"""Celery mode, worker side: the worker's own record (``service.workers``), written by a thread
of the worker's main process every ``heartbeat_s``, and at once when a message reaches it.

The main process outlives each task (a pool process runs one step and is replaced), so its
record says whether the worker is alive, whatever step it is at or between: a message it
received but whose step has not started yet has no heartbeat of its own. When the whole worker
dies, its record goes stale and the API sends again what it held (``service.lost_steps``).

The thread has an engine of its own, never the process's cached ones
(``service.db.session``): pool processes are forked from this process while the thread runs,
and must not inherit a lock it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from datetime import datetime
from typing import Any

from celery.signals import task_received, worker_ready, worker_shutdown
from celery.worker import state
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from .. import workers
from ..db.models import utcnow
from ..settings import Settings
from ..workers import Held

log = logging.getLogger("edge_un.celery")


class Presence(threading.Thread):
    """The worker ``name``'s record, kept up to date until :meth:`stop`."""

    def __init__(self, settings: Settings, name: str) -> None:
        super().__init__(name="edge-un-presence", daemon=True)
        self.settings = settings
        self.worker_name = name
        self._engine: Engine = create_engine(settings.resolved_database_url, pool_pre_ping=True)
        self._wake = threading.Event()
        self._done = threading.Event()
        self._idle_since: datetime | None = utcnow()
        self._arrived: list[Held] = []  # received, maybe not yet in Celery's own state

    def wake(self, arrived: Held) -> None:
        """A message arrived: say so now, not a heartbeat later."""
        self._arrived.append(arrived)
        self._wake.set()

    def stop(self) -> None:
        """A warm shutdown: drop the record (what it held goes back to the broker)."""
        self._done.set()
        self._wake.set()
        self.join(timeout=5)
        with contextlib.suppress(Exception), Session(self._engine) as session, session.begin():
            workers.forget(session, self.worker_name)
        self._engine.dispose()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self._beat()
            except Exception as error:  # the database away: the next beat tries again
                log.warning("worker record of %s not written: %s", self.worker_name, error)
            self._wake.wait(self.settings.heartbeat_s)
            self._wake.clear()

    def _beat(self) -> None:
        arrived, self._arrived = self._arrived, []
        held = list(dict.fromkeys([*_held(), *arrived]))
        if held:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = utcnow()
        with Session(self._engine) as session, session.begin():
            workers.beat(session, self.worker_name, held, self._idle_since)


def _held() -> list[Held]:
    """The tasks this worker holds: received, waiting for a pool process, or running."""
    for _ in range(10):  # the consumer's thread changes the dict while this one reads it
        try:
            requests = list(state.requests.values())
        except RuntimeError:
            continue
        return [(request.name, tuple(request.args or ())) for request in requests]
    return []


_presence: list[Presence] = []


def install(settings: Settings) -> None:
    """Keep this worker's record from when it is ready until it shuts down."""

    def ready(sender: Any = None, **_: Any) -> None:
        name = f"{getattr(sender, 'hostname', None) or 'celery'}:{os.getpid()}"
        presence = Presence(settings, name)
        _presence.append(presence)
        presence.start()

    def received(request: Any = None, **_: Any) -> None:
        for presence in _presence:
            presence.wake((request.name, tuple(request.args or ())))

    def shutdown(**_: Any) -> None:
        while _presence:
            _presence.pop().stop()

    worker_ready.connect(ready, weak=False)
    task_received.connect(received, weak=False)
    worker_shutdown.connect(shutdown, weak=False)
