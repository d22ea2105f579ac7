"""A conversion's work in a job process: the whole of it (the local queue, :func:`run`), or one
step of a run on any Celery worker (:func:`prepare_step`, :func:`target_step`,
:func:`report_step`): the steps of ``quant.pipeline``, whose ``convert`` is the three in a row,
so a job's report and artifacts are the same in both modes.

Every step turns what it raised into the job's one-line reason (:func:`failure`). A run ends
in :func:`publish`: its artifacts published and its outcome recorded (``Report.outcome``:
succeeded, partial or failed), or, when it wrote no report, nothing kept and the job failed.
The targets' builds share the job's time limit (EDGE_UN_JOB_TIMEOUT_S, from when its run
started), less a share kept for its report (:func:`build_deadline`): a target's search for a
file within the bars that cannot end in time ships its best file so far (``quant.deadline``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from converters.progress import ProgressEvent
from quant.errors import Blame, blame, one_line
from quant.measure.bars import DEFAULT_MIN_AGREEMENT, Bars
from quant.request import ConversionRequest

from .. import job_targets, jobs
from ..db import Job, session_scope
from ..job_targets import TargetClaim
from ..jobs import Claim
from ..settings import Settings
from ..storage import ArtifactStore, make_store
from ..upload_layout import stored_file, stored_model
from .failures import memory_message, out_of_memory

log = logging.getLogger("edge_un.steps")
# The share of EDGE_UN_JOB_TIMEOUT_S kept for the report after the targets' builds (and, in
# Celery mode, for a target's task to reach a worker): 90 s of the default 30 minutes.
REPORT_RESERVE = 0.05


Record = Callable[[Session, ProgressEvent], bool]  # False: the step no longer runs


class ProgressRecorder:
    """The pipeline's ``progress``: its events into the job's records (throttled) by ``record``
    (the job's, or a target's and its job's), and how long each stage took (for the
    stage-duration metrics)."""

    def __init__(self, settings: Settings, record: Record) -> None:
        self.settings = settings
        self.record = record
        self.interval = settings.progress_interval_s
        self.last_label: str | None = None
        self.last_write = 0.0
        self.stage: str | None = None
        self.stage_started = time.monotonic()
        self.durations: list[tuple[str, float]] = []

    def __call__(self, event: ProgressEvent) -> None:
        now = time.monotonic()
        if event.stage != self.stage:
            if self.stage is not None:
                self.durations.append((self.stage, now - self.stage_started))
            self.stage, self.stage_started = event.stage, now
        if event.label != self.last_label or now - self.last_write >= self.interval:
            self.last_label, self.last_write = event.label, now
            # False when cancelled meanwhile: nothing to do, the queue kills this process.
            # A database away (restarting) loses a progress line, not the conversion: the
            # heartbeat, not this, says whether the step still runs.
            try:
                with session_scope(self.settings) as session:
                    self.record(session, event)
            except (OperationalError, InterfaceError) as error:
                log.warning("progress not recorded (the database is away): %s", error)

    def finish(self) -> list[tuple[str, float]]:
        if self.stage not in (None, "done"):  # "done" is the end marker, not a stage
            self.durations.append((self.stage, time.monotonic() - self.stage_started))
            self.stage = None
        return self.durations


def jobs_state(settings: Settings, job_id: str) -> tuple[str, int] | None:
    with session_scope(settings) as session:
        return jobs.state_of(session, job_id)


def build_deadline(settings: Settings, started_at: datetime | None) -> float:
    """When a run's targets must be built (``time.time()``): its time limit counted from when
    the run started, less :data:`REPORT_RESERVE`."""
    start = started_at.timestamp() if started_at is not None else time.time()
    return start + settings.job_timeout_s * (1 - REPORT_RESERVE)


def failure(caught: Exception, settings: Settings) -> str:
    """The job's one-line reason for what a step raised: memory, bad input, or a bug (its
    traceback kept in the job's log). An ImportError that is not about memory is raised."""
    if isinstance(caught, MemoryError | ImportError):  # an import that cannot map its libraries
        if isinstance(caught, ImportError) and not out_of_memory(caught, settings.job_memory_mb):
            raise caught
        return memory_message(settings)
    if blame(caught) is not Blame.BUG:  # the input, a tool or this host: said as it is
        return one_line(caught)
    traceback.print_exc()
    if out_of_memory(caught, settings.job_memory_mb):  # a native library could not allocate
        return memory_message(settings)
    return (
        f"internal error during the conversion ({type(caught).__name__}: {one_line(caught)}); "
        "the server's job log has the details"
    )


def _running(settings: Settings, claim: Claim) -> Job | None:
    """The job's record while it still runs this attempt."""
    with session_scope(settings) as session:
        row = session.scalar(select(Job).where(Job.id == claim.job_id))
    if row is None or (row.state, row.attempts) != ("running", claim.attempt):
        log.warning("job %s attempt %s is not running it any more", claim.job_id, claim.attempt)
        return None
    return row


def _job_progress(settings: Settings, claim: Claim) -> ProgressRecorder:
    return ProgressRecorder(settings, lambda session, event: jobs.progress(session, claim, event))


def job_request(settings: Settings, store: ArtifactStore, job: Job) -> ConversionRequest:
    """What the job asks for, from its record and its uploads."""
    from quant.targets import get_profile

    uploads = store.upload_dir(job.id)
    return ConversionRequest(
        model=stored_model(uploads, job.model_format, job.model_label),  # type: ignore[arg-type]
        targets=tuple(get_profile(name) for name in job.targets),
        calib=stored_file(uploads, "calib", job.calib_label),
        eval=stored_file(uploads, "eval", job.eval_label),
        config=stored_file(uploads, "config", job.config_label),
        bars=Bars(job.max_drift, DEFAULT_MIN_AGREEMENT),
        latency_runs=settings.latency_runs,
    )


def run(settings: Settings, claim: Claim) -> int:
    """The local queue's job process: the whole conversion into a staging directory, then
    :func:`publish`."""
    job = _running(settings, claim)
    if job is None:
        return 0
    store = make_store(settings)
    staging = store.staging_dir(claim.job_id, claim.attempt)
    progress = _job_progress(settings, claim)
    error = failures = None
    try:
        from quant.pipeline import run_conversion  # heavy (torch, onnx): inside the try

        report = run_conversion(
            job_request(settings, store, job), staging, progress,
            deadline=build_deadline(settings, job.started_at), parallel=settings.job_parallel,
        )  # fmt: skip
        failures = report.failures()
        error = failures if report.outcome() == "failed" else None
    except Exception as caught:
        error = failure(caught, settings)
    return publish(settings, store, claim, staging, error, failures, progress)


def prepare_step(settings: Settings, claim: Claim) -> int:
    """Celery mode, a run's first step: load, fold and export the job's model into its staging
    and work directories, then record its targets, to be built by any worker."""
    job = _running(settings, claim)
    if job is None:
        return 0
    store = make_store(settings)
    staging = store.staging_dir(claim.job_id, claim.attempt)
    work = store.work_dir(claim.job_id, claim.attempt)
    progress = _job_progress(settings, claim)
    try:
        from quant.prepare import prepare

        prepared = prepare(job_request(settings, store, job), staging, work, progress)
    except Exception as caught:
        return publish(settings, store, claim, staging, failure(caught, settings), None, progress)
    with session_scope(settings) as session:
        if job_targets.fan_out(session, claim, prepared.targets):
            jobs.record_stages(session, claim.job_id, progress.finish())
    return 0


def target_step(settings: Settings, claim: TargetClaim) -> int:
    """Celery mode: build one target of a prepared run (its part goes to the run's work
    directory), then record that it ended."""
    job = _running(settings, claim.job)
    if job is None:
        return 0
    progress = ProgressRecorder(
        settings, lambda session, event: job_targets.target_progress(session, claim, event)
    )
    error = None
    try:
        from quant.job_files import Prepared
        from quant.pipeline import build_target

        prepared = Prepared.load(make_store(settings).work_dir(claim.job_id, claim.run))
        build_target(prepared, claim.name, progress, build_deadline(settings, job.started_at))
    except Exception as caught:
        error = failure(caught, settings)
    durations = progress.finish()
    with session_scope(settings) as session:
        if job_targets.end_target(session, claim, error):
            jobs.record_stages(session, claim.job_id, durations)
    return 0 if error is None else 1


def report_step(settings: Settings, claim: Claim) -> int:
    """Celery mode, a run's last step: its report from its targets' parts (a target that ended
    without one failed, with the reason its record holds), then :func:`publish`."""
    store = make_store(settings)
    progress = _job_progress(settings, claim)
    staging, error, failures = None, None, None
    try:
        from quant.job_files import Prepared
        from quant.pipeline import assemble

        prepared = Prepared.load(store.work_dir(claim.job_id, claim.attempt))
        staging = prepared.out_dir
        with session_scope(settings) as session:
            lost = job_targets.failures(session, claim.job_id, claim.attempt)
            started_at = session.scalar(select(Job.started_at).where(Job.id == claim.job_id))
        # a figure timed while other builds ran is timed again only within the builds' time
        report = assemble(prepared, lost, progress, build_deadline(settings, started_at))
        failures = report.failures()
        error = failures if report.outcome() == "failed" else None
    except Exception as caught:
        error = failure(caught, settings)
    return publish(settings, store, claim, staging, error, failures, progress)


def publish(
    settings: Settings,
    store: ArtifactStore,
    claim: Claim,
    staging: Path | None,
    error: str | None,
    failures: str | None,
    progress: ProgressRecorder,
) -> int:
    """End a run: publish its staging directory and record the outcome (``error``: it failed;
    ``failures``: the targets that did), or, when it wrote no report, keep nothing and fail the
    job. Nothing is published for a run that no longer runs (cancelled meanwhile)."""
    from quant.report import REPORT_FILE

    durations = progress.finish()
    if error is not None and (staging is None or not (staging / REPORT_FILE).exists()):
        store.discard_run(claim.job_id, claim.attempt)
        with session_scope(settings) as session:
            if jobs.fail(session, claim, error):
                jobs.record_stages(session, claim.job_id, durations)
        store.delete_uploads(claim.job_id)
        return 1
    assert staging is not None
    store.commit(claim.job_id, staging)
    store.discard_run(claim.job_id, claim.attempt)  # its work directory
    with session_scope(settings) as session:
        if error is not None:
            done = jobs.fail(session, claim, error)
        else:
            done = jobs.succeed(session, claim, failures)
        if done:
            jobs.record_stages(session, claim.job_id, durations)
    if not done:  # cancelled (or superseded) while it ran: publish nothing
        still = jobs_state(settings, claim.job_id)
        if still is None or still[0] == "cancelled":
            store.delete(claim.job_id)
        return 0
    store.delete_uploads(claim.job_id)
    return 0 if error is None else 1
