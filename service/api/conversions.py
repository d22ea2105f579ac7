"""/v1/conversions: create, list, read, cancel, delete a job; its report, artifacts and bundle.

Thin: each route checks who asks, calls service.intake / service.jobs / the artifact store,
and shapes the answer. Another token's job is a 404, exactly like a job that does not exist.
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from starlette.background import BackgroundTask

from .. import intake, jobs
from ..db import Job, session_scope
from ..problems import Problem
from ..storage import REPORT_JSON
from ..uploads import MAX_DATA_FILES
from .deps import Principal, PrincipalDep, Services, ServicesDep
from .schemas import ArtifactOut, JobOut, JobPage

router = APIRouter(prefix="/v1/conversions", tags=["conversions"])
JobId = Annotated[str, "a job id"]
ERRORS: dict[int | str, dict] = {
    status: {"description": "a problem (RFC 9457)"} for status in (400, 404, 409, 413, 415, 422)
}
UPLOAD_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "additionalProperties": False,
    "properties": {
        "model": {
            "type": "string",
            "format": "binary",
            "description": ".safetensors, .pt/.pth (with config), .pt2, .onnx, or a Hugging "
            "Face save_pretrained directory as one .zip (config.json + *.safetensors)",
        },
        "model_data": {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "maxItems": MAX_DATA_FILES,
            "description": "an ONNX model's external data files (repeat the field, one part per "
            "file), each under the file name the .onnx references, e.g. model.onnx.data",
        },
        "config": {"type": "string", "format": "binary", "description": "the model's JSON config"},
        "calib": {"type": "string", "format": "binary", "description": "calibration .npz"},
        "eval": {"type": "string", "format": "binary", "description": "evaluation .npz"},
        "targets": {
            "type": "string",
            "description": "comma-separated target names; empty: all",
            "example": "cpu,imx93",
        },
        "max_drift": {
            "type": "number",
            "minimum": 0,
            "maximum": 100,
            "description": "top-1 points an int8 file may lose (default 0.5)",
        },
    },
}


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _job(services: Services, principal: Principal, job_id: str) -> Job:
    with session_scope(services.settings) as session:
        job = jobs.get(session, job_id, principal.token_id)
    if job is None:
        raise Problem(
            404, f"no conversion {job_id[:40]!r} for this token; GET /v1/conversions lists yours"
        )
    return job


def _finished_with_files(services: Services, principal: Principal, job_id: str) -> Job:
    job = _job(services, principal, job_id)
    if job.state in ("queued", "running"):
        raise Problem(
            409,
            f"the conversion is {job.state} ({job.stage or 'waiting'}, "
            f"{job.percent:g} %); poll it until its state is succeeded",
            "Not finished",
        )
    if services.store.list(job.id) is None:
        reason = f": {job.error}" if job.error else ""
        raise Problem(
            409,
            f"the conversion {job.state}{reason}; it has no report or artifacts",
            "No artifacts",
        )
    return job


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses=ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": UPLOAD_SCHEMA}},
        }
    },
)
async def create_conversion(
    request: Request, response: Response, services: ServicesDep, principal: PrincipalDep
) -> JobOut:
    """Upload a model (and optional config, calib, eval; an ONNX model's external data as
    model_data) and queue its conversion."""
    job = await intake.accept(
        request.stream(),
        request.headers.get("content-type"),
        request.headers.get("content-length"),
        principal.token_id,
        services.settings,
        services.store,
        services.metrics,
    )
    # in a thread: a Celery publish is network I/O (and waits out a broker that is away)
    await anyio.to_thread.run_sync(services.queue.submit, job.id)
    out = JobOut.of(job, _base(request))
    response.headers["Location"] = out.links["self"]
    return out


@router.get("", response_model=JobPage, responses=ERRORS)
def list_conversions(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JobPage:
    """Your conversions, newest first."""
    with session_scope(services.settings) as session:
        rows, total = jobs.page(session, principal.token_id, limit, offset)
    base = _base(request)
    more = offset + len(rows) < total
    next_url = f"{base}/v1/conversions?limit={limit}&offset={offset + limit}" if more else None
    return JobPage(
        items=[JobOut.of(j, base) for j in rows],
        total=total,
        limit=limit,
        offset=offset,
        next=next_url,
    )


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
def get_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut:
    """One conversion: state, stage, percent, timestamps, error."""
    return JobOut.of(_job(services, principal, job_id), _base(request))


@router.delete(
    "/{job_id}", response_model=JobOut, responses={**ERRORS, 204: {"description": "deleted"}}
)
def delete_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut | Response:
    """Cancel a queued or running conversion (200, the job); delete a finished one and its
    files (204). To cancel only, never delete: POST /v1/conversions/{id}/cancel."""
    job = _job(services, principal, job_id)
    cancelled = _cancel(services, principal, job)
    if cancelled is not None:
        return JobOut.of(cancelled, _base(request))
    with session_scope(services.settings) as session:
        jobs.remove(session, job.id)
    services.store.delete(job.id)
    return Response(status_code=204)


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut:
    """Cancel a queued or running conversion (the job, now cancelled); a finished one is left
    as it is, with its files (409)."""
    return JobOut.of(cancel(services, principal, job_id), _base(request))


def cancel(services: Services, principal: Principal, job_id: str) -> Job:
    """Cancel this principal's queued or running job; the cancelled job. A job that already
    finished (also one that finished a moment ago, after the caller last looked) is a 409 and
    stays as it is: a cancel never deletes anything."""
    job = _job(services, principal, job_id)
    cancelled = _cancel(services, principal, job)
    if cancelled is None:
        state = _job(services, principal, job_id).state
        raise Problem(
            409,
            f"the conversion {job.id} already {state}: nothing to cancel",
            "Already finished",
        )
    return cancelled


def _cancel(services: Services, principal: Principal, job: Job) -> Job | None:
    """Cancel ``job`` if it is still queued or running (the move is one conditional update, so
    a job finishing meanwhile is not cancelled): the cancelled job, else None."""
    with session_scope(services.settings) as session:
        if job.state not in ("queued", "running") or not jobs.cancel(session, job.id):
            return None
        cancelled = jobs.get(session, job.id, principal.token_id)
    services.queue.cancel(job.id)
    if job.state == "queued":  # no process will clean up after it
        services.store.delete_uploads(job.id)
    return cancelled


@router.get(
    "/{job_id}/report",
    responses=ERRORS,
    response_description="the report.json the conversion wrote",
)
def get_report(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> FileResponse:
    """The conversion's report.json (schema: quant/report.schema.json)."""
    job = _finished_with_files(services, principal, job_id)
    path = services.store.path(job.id, REPORT_JSON)
    if path is None:
        raise Problem(409, "the conversion wrote no report", "No report")
    return FileResponse(path, media_type="application/json")


@router.get("/{job_id}/report.html", response_class=HTMLResponse, responses=ERRORS)
async def get_report_html(
    job_id: JobId, services: ServicesDep, principal: PrincipalDep
) -> HTMLResponse:
    """The report as one self-contained page: tables and plots, no external requests."""
    from ..report_html import CSP

    job = await anyio.to_thread.run_sync(_finished_with_files, services, principal, job_id)
    html = await anyio.to_thread.run_sync(_render_html, services, job.id)
    # the page's own policy, as a header too (a <meta> policy only acts once it is parsed)
    return HTMLResponse(html, headers={"Content-Security-Policy": CSP})


def _render_html(services: Services, job_id: str) -> str:
    from quant.report import Report

    from ..report_html import render_report_html

    path = services.store.path(job_id, REPORT_JSON)
    if path is None:
        raise Problem(409, "the conversion wrote no report", "No report")
    return render_report_html(Report.read(path))


@router.get("/{job_id}/artifacts", response_model=list[ArtifactOut], responses=ERRORS)
def list_artifacts(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> list[ArtifactOut]:
    """Every file the conversion wrote: name, size, sha256."""
    job = _finished_with_files(services, principal, job_id)
    base = f"{_base(request)}/v1/conversions/{job.id}/artifacts"
    return [
        ArtifactOut(name=a.name, bytes=a.bytes, sha256=a.sha256, url=f"{base}/{a.name}")
        for a in services.store.list(job.id) or []
    ]


@router.get(
    "/{job_id}/artifacts/{name:path}",
    responses={**ERRORS, 304: {"description": "not modified"}, 416: ERRORS[400]},
)
def get_artifact(
    job_id: JobId, name: str, request: Request, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """One artifact, streamed, with ETag and Repr-Digest (RFC 9530: sha-256 of the file)."""
    job = _finished_with_files(services, principal, job_id)
    info = next((a for a in services.store.list(job.id) or [] if a.name == name), None)
    path = services.store.path(job.id, name)
    if info is None or path is None:
        raise Problem(
            404,
            f"the conversion has no artifact {name[:80]!r}; GET "
            f"/v1/conversions/{job.id}/artifacts lists them",
        )
    digest = base64.b64encode(bytes.fromhex(info.sha256)).decode()
    headers = {
        "ETag": f'"{info.sha256}"',
        "Repr-Digest": f"sha-256=:{digest}:",
        "Cache-Control": "private, max-age=31536000, immutable",
    }
    if_none_match = request.headers.get("if-none-match", "")
    if headers["ETag"] in {t.strip() for t in if_none_match.split(",")} or if_none_match == "*":
        return Response(status_code=304, headers=headers)
    _check_range(request.headers.get("range"), info.bytes)
    return FileResponse(
        path, filename=Path(name).name, headers=headers, media_type="application/octet-stream"
    )


def _check_range(header: str | None, size: int) -> None:
    """Refuse a bad Range header as problem+json (Starlette would answer in plain text)."""
    if header is None:
        return
    try:
        ranges = FileResponse._parse_range_header(header, size)
    except Exception:
        raise Problem(
            416 if header.startswith("bytes=") else 400,
            f"the Range header {header[:60]!r} does not fit the file of {size} bytes; "
            "send bytes=START-END, or no Range for the whole file",
        ) from None
    if not ranges:
        raise Problem(416, f"the Range header {header[:60]!r} selects nothing of {size} bytes")


@router.get("/{job_id}/bundle.zip", response_class=FileResponse, responses=ERRORS)
async def get_bundle(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Every artifact and the reports in one zip."""
    job = await anyio.to_thread.run_sync(_finished_with_files, services, principal, job_id)
    tmp = services.settings.data_dir.resolve() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    dest = tmp / f"bundle-{job.id}-{uuid.uuid4().hex}.zip"
    written = await anyio.to_thread.run_sync(services.store.write_bundle, job.id, dest)
    if not written:
        dest.unlink(missing_ok=True)
        raise Problem(409, "the conversion's artifacts are gone (deleted meanwhile)")
    return FileResponse(
        dest,
        media_type="application/zip",
        filename=f"edge-un-{job.id}.zip",
        background=BackgroundTask(dest.unlink, missing_ok=True),
    )
