"""The session fixtures ``postgres_server`` and ``redis_server``: real servers
(:mod:`testbed.servers`), started once for the session and stopped after it. Not a test module
(no test_ prefix); tests/conftest.py registers the fixtures.

A missing binary skips the tests that need it, except under CI=true, where it fails them
(the project rule: CI must not go green by skipping what it was meant to test).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import NoReturn

import pytest

from testbed.servers import PG_BIN, PG_USER, PostgresServer, RedisServer, Server


def missing(reason: str) -> NoReturn:
    """Skip the test for a missing system package, or fail it under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def _started(server: Server) -> Iterator[Server]:
    """Start a server, stop it and remove its directory after (also at exit if pytest dies)."""
    atexit.register(server.cleanup)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
        with contextlib.suppress(ValueError):
            atexit.unregister(server.cleanup)


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL 15 server for the session; tests take a fresh database each."""
    needed = [PG_BIN / "initdb", PG_BIN / "postgres"]
    if not all(os.access(p, os.X_OK) for p in needed):
        missing(f"{PG_BIN}/initdb or postgres missing: apt-get install postgresql")
    if os.geteuid() == 0 and not _user_exists(PG_USER):
        missing(f"running as root and no {PG_USER!r} user to run postgres as: "
                "apt-get install postgresql (it creates the user)")  # fmt: skip
    yield from _started(PostgresServer())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session. A test that kills or stops it must ``start()`` it
    again before it ends: later tests share it."""
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server missing: apt-get install redis-server")
    yield from _started(RedisServer(binary))
