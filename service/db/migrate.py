"""``upgrade(settings)``: bring the database to the newest schema with Alembic.

The Alembic configuration is built here in code (no alembic.ini), from the migrations package
next to this file, so it works the same from a checkout and from an installed wheel. A file
lock in the data directory keeps two processes (the server and ``edge-un token create``, say)
from migrating the same database at the same moment.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config

from ..settings import Settings
from .session import get_engine

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(settings: Settings) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # "%" is interpolation syntax in Alembic's config parser: a password may hold one.
    config.set_main_option("sqlalchemy.url", settings.resolved_database_url.replace("%", "%%"))
    return config


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Migrate the database the settings name to ``revision`` (default: the newest)."""
    _migrate(settings, command.upgrade, revision)


def downgrade(settings: Settings, revision: str) -> None:
    """Migrate the database the settings name back to ``revision`` (an operator's undo)."""
    _migrate(settings, command.downgrade, revision)


def _migrate(settings: Settings, move: Callable[[Config, str], None], revision: str) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    config = alembic_config(settings)
    with (settings.data_dir / ".migrate.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with get_engine(settings).begin() as connection:
            config.attributes["connection"] = connection
            # a migration that changes how a job's files are laid out moves them too
            config.attributes["data_dir"] = settings.data_dir.resolve()
            move(config, revision)
