"""Job and token records (SQLAlchemy 2) and their Alembic migrations."""

from .migrate import upgrade
from .models import Base, Job, JobStage, JobTarget, Token, Worker
from .session import get_engine, ping, session_factory, session_scope

__all__ = [
    "Base",
    "Job",
    "JobStage",
    "JobTarget",
    "Token",
    "Worker",
    "get_engine",
    "ping",
    "session_factory",
    "session_scope",
    "upgrade",
]
