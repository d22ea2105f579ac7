"""Engines and sessions for the database the settings name (SQLite in WAL mode by default).

Engines are cached per URL: the API, the dispatcher thread and the token commands of one
process share a pool. SQLite gets WAL (readers never wait for the job process writing its
progress), a busy timeout (writers queue instead of failing) and enforced foreign keys.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from ..settings import Settings

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _sqlite_pragmas(connection: Any, record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def get_engine(settings: Settings) -> Engine:
    url = settings.resolved_database_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            if url.startswith("sqlite"):
                settings.data_dir.mkdir(parents=True, exist_ok=True)
                engine = create_engine(
                    url, connect_args={"timeout": 30, "check_same_thread": False}
                )
                event.listen(engine, "connect", _sqlite_pragmas)
            else:
                engine = create_engine(url, pool_pre_ping=True)
            _engines[url] = engine
        return engine


def session_factory(settings: Settings) -> sessionmaker[Session]:
    return sessionmaker(get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A session committed on success, rolled back on error, always closed."""
    with session_factory(settings)() as session, session.begin():
        yield session


def ping(settings: Settings) -> None:
    """Raise unless the database answers a query."""
    with session_scope(settings) as session:
        session.execute(text("SELECT 1"))


def dispose_engines(close: bool = True) -> None:
    """Drop every pooled connection: closed (at shutdown), or only forgotten (``close=False``,
    in a forked child, whose parent still uses them: closing would end them for the parent)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=close)
        _engines.clear()
