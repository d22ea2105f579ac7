"""What a caller may do to a conversion job, over HTTP or from the web page: find it, read
what it published, cancel it, delete it. Plain functions; refusals are
:class:`~service.errors.Refused` (``service.server.http_status`` gives their HTTP status; the
API answers problem+json, the web page a message page).

Each takes the process's :class:`~service.server.services.Services` and the caller's token. A
caller only ever sees its own jobs: another token's job is "not found", exactly like a job that
does not exist.
"""

from __future__ import annotations

import functools
from pathlib import Path

from quant.report import REPORT_FILE, Report
from quant.report.verdict import Verdict, verdicts

from .. import jobs
from ..db import Job, session_scope
from ..errors import Refusal, Refused
from ..job_states import ACTIVE, stage_label
from ..storage import ArtifactInfo
from .services import Services


def find(services: Services, token_id: int | None, job_id: str) -> Job:
    with session_scope(services.settings) as session:
        job = jobs.get(session, job_id, token_id)
    if job is None:
        raise _not_found(job_id)
    return job


def page(
    services: Services, token_id: int | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    """The caller's jobs, newest first, and how many it has."""
    with session_scope(services.settings) as session:
        return jobs.page(session, token_id, limit, offset)


def verdicts_of(services: Services, job: Job) -> tuple[Verdict, ...]:
    """Each target's verdict of a finished job, from the report it published (none while it
    runs, or if it published no report)."""
    if job.state in ACTIVE:
        return ()
    path = services.store.path(job.id, REPORT_FILE)
    if path is None:
        return ()
    try:
        return _read_verdicts(path, path.stat().st_mtime_ns)
    except FileNotFoundError:  # deleted meanwhile
        return ()


@functools.lru_cache(maxsize=256)
def _read_verdicts(path: Path, modified_ns: int) -> tuple[Verdict, ...]:
    # A published report never changes (``modified_ns`` keys it all the same): the job list
    # reads each of its jobs' once, not at every reload while another job runs.
    return tuple(verdicts(Report.read(path)))


def _not_found(job_id: str) -> Refused:
    return Refused(
        Refusal.NOT_FOUND,
        "Not found",
        f"no conversion {job_id[:40]!r} for this token; GET /v1/conversions lists yours",
    )


def finished_with_files(
    services: Services, token_id: int | None, job_id: str
) -> tuple[Job, list[ArtifactInfo]]:
    """The job and its published files; refused while it runs, or if it published none."""
    job = find(services, token_id, job_id)
    if job.state in ACTIVE:
        raise Refused(
            Refusal.CONFLICT,
            "Not finished",
            f"the conversion is {job.state} ({stage_label(job) or 'waiting'}, "
            f"{job.percent:g} %); poll it until it has finished",
        )
    files = services.store.list(job.id)
    if files is None:
        reason = f": {job.error}" if job.error else ""
        raise Refused(
            Refusal.CONFLICT,
            "No artifacts",
            f"the conversion {job.state}{reason}; it has no report or artifacts",
        )
    return job, files


def artifact(
    services: Services, token_id: int | None, job_id: str, name: str
) -> tuple[ArtifactInfo, Path]:
    """One published file of a finished job: its record and where it is."""
    job, files = finished_with_files(services, token_id, job_id)
    info = next((a for a in files if a.name == name), None)
    path = services.store.path(job.id, name)
    if info is None or path is None:
        raise Refused(
            Refusal.NOT_FOUND,
            "Not found",
            f"the conversion has no artifact {name[:80]!r}; GET "
            f"/v1/conversions/{job.id}/artifacts lists them",
        )
    return info, path


def report_path(services: Services, token_id: int | None, job_id: str) -> Path:
    job, _ = finished_with_files(services, token_id, job_id)
    path = services.store.path(job.id, REPORT_FILE)
    if path is None:
        raise Refused(Refusal.CONFLICT, "No report", "the conversion wrote no report")
    return path


def bundle(services: Services, token_id: int | None, job_id: str) -> Path:
    """Every file of a finished job in one new zip, which the caller removes once sent."""
    job, _ = finished_with_files(services, token_id, job_id)
    path = services.store.bundle(job.id)
    if path is None:
        gone = "the conversion's artifacts are gone (deleted meanwhile)"
        raise Refused(Refusal.CONFLICT, "No artifacts", gone)
    return path


def cancel(services: Services, token_id: int | None, job_id: str) -> Job:
    """Cancel a queued or running job: the cancelled job. A job that already finished (also
    one that finished a moment ago, after the caller last looked) is refused and stays as it
    is: a cancel never deletes anything."""
    job = find(services, token_id, job_id)
    cancelled = _cancel_if_active(services, job, token_id)
    if cancelled is None:
        state = find(services, token_id, job_id).state
        raise Refused(
            Refusal.CONFLICT,
            "Already finished",
            f"the conversion {job.id} already {state}: nothing to cancel",
        )
    return cancelled


def cancel_or_delete(services: Services, token_id: int | None, job_id: str) -> Job | None:
    """Cancel a queued or running job (the cancelled job); delete a finished one, its record
    and its files (None). Which of the two is decided in one transaction (``jobs.
    cancel_or_remove``), never on a state read before it."""
    job = find(services, token_id, job_id)
    with session_scope(services.settings) as session:
        moved = jobs.cancel_or_remove(session, job.id)
        cancelled = jobs.get(session, job.id, token_id) if moved == "cancelled" else None
    if moved is None:  # deleted meanwhile
        raise _not_found(job_id)
    if cancelled is not None:
        _stop(services, job)
        return cancelled
    services.store.delete(job.id)
    return None


def delete_finished(services: Services, token_id: int | None, job_id: str) -> None:
    """Delete a finished job, its record and its files; one still queued or running is
    refused (cancel it first: a delete never stops a run)."""
    job = find(services, token_id, job_id)
    with session_scope(services.settings) as session:
        removed = jobs.remove(session, job.id)
    if not removed:
        state = find(services, token_id, job_id).state
        raise Refused(
            Refusal.CONFLICT, "Not finished", f"the conversion is {state}; cancel it first"
        )
    services.store.delete(job.id)


def _cancel_if_active(services: Services, job: Job, token_id: int | None) -> Job | None:
    """Cancel ``job`` if it is still queued or running (one conditional update, so a job that
    finishes meanwhile is not cancelled): the cancelled job, else None."""
    with session_scope(services.settings) as session:
        if not jobs.cancel(session, job.id):
            return None
        cancelled = jobs.get(session, job.id, token_id)
    _stop(services, job)
    return cancelled


def _stop(services: Services, job: Job) -> None:
    """After ``job`` was cancelled: stop its run, if it has one; a queued one's uploads go now
    (no process will clean up after it)."""
    services.queue.cancel(job.id)
    if job.state == "queued":
        services.store.delete_uploads(job.id)
