"""Alembic environment: runs on the connection service.db.upgrade hands over (online only)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from service.db.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:  # run by the alembic command itself: open the configured URL
        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.begin() as connection:
            _migrate(connection)
        return
    _migrate(connection)


def _migrate(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER TABLE support on SQLite
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run service.db.upgrade")
run()
