"""The fixtures ``settings`` (a migrated database of each kind: SQLite, and PostgreSQL on the
session's server) and ``postgres_settings`` (PostgreSQL only), for the tests of the job records
(tests/test_service_jobs.py, tests/test_service_steps.py). Not a test module (no test_ prefix);
tests/conftest.py registers the fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.db import get_engine, upgrade
from service.settings import Settings
from testbed.servers import PostgresServer


def _postgres_settings(tmp_path, server: PostgresServer) -> Iterator[Settings]:
    """A migrated fresh database on the session's server, dropped after the test (its pooled
    connections first, so the drop does not wait on them)."""
    settings = Settings(data_dir=tmp_path / "data", database_url=server.new_database())
    upgrade(settings)
    yield settings
    get_engine(settings).dispose()
    server.drop_database(settings.resolved_database_url)


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path) -> Iterator[Settings]:
    """A migrated database of each kind; the server is started only for the PostgreSQL run."""
    if request.param == "sqlite":
        settings = Settings(data_dir=tmp_path / "data")
        upgrade(settings)
        yield settings
        return
    yield from _postgres_settings(tmp_path, request.getfixturevalue("postgres_server"))


@pytest.fixture
def postgres_settings(tmp_path, postgres_server: PostgresServer) -> Iterator[Settings]:
    """PostgreSQL only: tests of its row locking, which SQLite (one writer) never exercises."""
    yield from _postgres_settings(tmp_path, postgres_server)
