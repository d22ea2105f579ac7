"""Database tables: API tokens, conversion jobs, their targets and the workers (Celery mode) and
the time each job spent in each stage.

These are storage records, kept apart from the API's pydantic schemas (service.schemas):
the wire format can change without a migration and the reverse.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware (SQLite drops the zone)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: object) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Token(Base):
    """An API token: only the sha256 of its secret is stored, never the secret itself."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Job(Base):
    """One conversion request. ``seq`` orders the queue (FIFO) and the listings (newest first);
    ``id`` is the unguessable public name. ``attempts`` counts the runs started: a job process
    writes only while the job is ``running`` at the attempt it was started for, so a stale
    process (its server restarted) can never overwrite a newer run."""

    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("tokens.id", ondelete="SET NULL"), nullable=True
    )
    state: Mapped[str] = mapped_column(String(16), default="queued")
    # Progress as the pipeline reports it (converters.ProgressEvent): the stage's name, the
    # edge target it works for (None: the whole run) and its detail ("8 tensors to int16").
    stage: Mapped[str | None] = mapped_column(String(200), nullable=True)
    target: Mapped[str | None] = mapped_column(String(32), nullable=True)
    stage_detail: Mapped[str | None] = mapped_column(String(200), nullable=True)
    percent: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # What was asked: the targets by name, the drift bar, the uploaded files (the model's format
    # is what the upload checks found in its content).
    targets: Mapped[list[str]] = mapped_column(JSON, default=list)
    max_drift: Mapped[float] = mapped_column(Float)
    model_format: Mapped[str] = mapped_column(String(16))
    model_label: Mapped[str] = mapped_column(String(255))
    config_label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    calib_label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    eval_label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    upload_bytes: Mapped[int] = mapped_column(BigInteger, default=0)  # 4 files, no cap
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Celery mode: when a task for the job was last handed to the broker (None: not yet, so
    # the API sends one), and when its run last proved alive (a stale beat means a lost worker).
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Celery mode: which step of its run a running job is at: "prepare" (one worker loads,
    # folds and exports), "targets" (its targets build on any workers, each beating its own
    # JobTarget record) or "report" (one worker assembles it); None outside Celery mode.
    phase: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # The most runs one of its targets took (a target is run again alone when its worker was
    # lost): the API's ``attempts`` is the larger of this and ``attempts``.
    target_attempts: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (
        Index("ix_jobs_state_seq", "state", "seq"),
        Index("ix_jobs_token_seq", "token_id", "seq"),
    )


class JobTarget(Base):
    """Celery mode: one target of one run of a job, built by any worker. Like a job, it is
    queued, claimed by one conditional UPDATE, running under a heartbeat (taken over after the
    lease when its worker died) and ended; its result is a file in the job's work directory
    (``quant.job_files``), the record only says how far it got. Every write is conditional on
    its job still running the run (``run``, the job's ``attempts``) it belongs to."""

    __tablename__ = "job_targets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    run: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), default="queued")  # queued running ended
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    stage: Mapped[str | None] = mapped_column(String(200), nullable=True)
    stage_detail: Mapped[str | None] = mapped_column(String(200), nullable=True)
    fraction: Mapped[float] = mapped_column(Float, default=0.0)  # of its own build, 0 to 1
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # it ended without a result
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (
        UniqueConstraint("job_id", "run", "name", name="uq_job_targets_job_run_name"),
        Index("ix_job_targets_state", "state"),
    )


class Worker(Base):
    """Celery mode: one ``edge-un worker`` process, as it last said (every ``heartbeat_s``, and
    at once when a message reaches it): what it holds (its tasks received, waiting or running,
    as ``[task name, args]``) and since when it holds nothing. A worker whose record went stale
    for longer than the lease is dead: the API sends again each step it held that had not
    started (a step that started has its own heartbeat), without waiting for the broker to
    give its unacknowledged message back (``service.lost_steps``)."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)  # hostname:pid
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    idle_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    held: Mapped[list] = mapped_column(JSON, default=list)


class JobStage(Base):
    """Seconds a stage of a job took (the /metrics stage durations read these)."""

    __tablename__ = "job_stages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # no foreign key: the durations outlive a deleted job (the metrics are cumulative)
    job_id: Mapped[str] = mapped_column(String(32), index=True)
    stage: Mapped[str] = mapped_column(String(64))
    seconds: Mapped[float] = mapped_column(Float)
