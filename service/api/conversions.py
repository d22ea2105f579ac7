"""/v1/conversions: create, list, read, cancel, delete a job; its report, artifacts and bundle.

Thin: each route checks who asks, calls one function of service.intake, service.job_actions or
service.jobs, and shapes the answer. Another token's job is a 404, exactly like a job that does
not exist (``job_actions.find``).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from starlette.background import BackgroundTask

from .. import intake, job_actions
from ..db import Job
from ..services import Services
from ..uploads import MAX_DATA_FILES
from .deps import PrincipalDep, ServicesDep
from .problems import Problem
from .ranges import range_status
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
    job = await submit_upload(request, services, principal.token_id)
    out = JobOut.of(job, _base(request))
    response.headers["Location"] = out.links["self"]
    return out


async def submit_upload(
    request: Request, services: Services, token_id: int | None, *, browser: bool = False
) -> Job:
    """The request's multipart body through the upload checks, queued as a job (the API's
    route and the web page's form both upload this way)."""
    return await intake.submit(
        services,
        request.stream(),
        request.headers.get("content-type"),
        request.headers.get("content-length"),
        token_id,
        browser=browser,
    )


@router.get("", response_model=JobPage, responses=ERRORS)
def list_conversions(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JobPage:
    """Your conversions, newest first."""
    rows, total = job_actions.page(services, principal.token_id, limit, offset)
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
    job = job_actions.find(services, principal.token_id, job_id)
    return JobOut.of(job, _base(request))


@router.delete(
    "/{job_id}", response_model=JobOut, responses={**ERRORS, 204: {"description": "deleted"}}
)
def delete_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut | Response:
    """Cancel a queued or running conversion (200, the job); delete a finished one and its
    files (204). To cancel only, never delete: POST /v1/conversions/{id}/cancel."""
    cancelled = job_actions.cancel_or_delete(
        services, principal.token_id, job_id
    )
    if cancelled is None:
        return Response(status_code=204)
    return JobOut.of(cancelled, _base(request))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut:
    """Cancel a queued or running conversion (the job, now cancelled); a finished one is left
    as it is, with its files (409)."""
    cancelled = job_actions.cancel(
        services, principal.token_id, job_id
    )
    return JobOut.of(cancelled, _base(request))


@router.get(
    "/{job_id}/report",
    responses=ERRORS,
    response_description="the report.json the conversion wrote",
)
def get_report(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> FileResponse:
    """The conversion's report.json (schema: quant/report.schema.json)."""
    path = job_actions.report_path(services, principal.token_id, job_id)
    return FileResponse(path, media_type="application/json")


@router.get("/{job_id}/report.html", response_class=HTMLResponse, responses=ERRORS)
async def get_report_html(
    job_id: JobId, services: ServicesDep, principal: PrincipalDep
) -> HTMLResponse:
    """The report as one self-contained page: tables and plots, no external requests."""
    from ..report_html import CSP, report_page

    path = await anyio.to_thread.run_sync(
        job_actions.report_path, services, principal.token_id, job_id
    )
    html = await anyio.to_thread.run_sync(report_page, path)
    # the page's own policy, as a header too (a <meta> policy only acts once it is parsed)
    return HTMLResponse(html, headers={"Content-Security-Policy": CSP})


@router.get("/{job_id}/artifacts", response_model=list[ArtifactOut], responses=ERRORS)
def list_artifacts(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> list[ArtifactOut]:
    """Every file the conversion wrote: name, size, sha256."""
    job, files = job_actions.finished_with_files(
        services, principal.token_id, job_id
    )
    base = f"{_base(request)}/v1/conversions/{job.id}/artifacts"
    return [
        ArtifactOut(name=a.name, bytes=a.bytes, sha256=a.sha256, url=f"{base}/{a.name}")
        for a in files
    ]


@router.get(
    "/{job_id}/artifacts/{name:path}",
    responses={**ERRORS, 304: {"description": "not modified"}, 416: ERRORS[400]},
)
def get_artifact(
    job_id: JobId, name: str, request: Request, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """One artifact, streamed, with ETag and Repr-Digest (RFC 9530: sha-256 of the file)."""
    info, path = job_actions.artifact(
        services, principal.token_id, job_id, name
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
    header = request.headers.get("range")
    refused = None if header is None else range_status(header, info.bytes)
    if refused is not None:
        raise Problem(
            refused,
            f"the Range header {header[:60]!r} does not fit the file of {info.bytes} bytes; "
            "send bytes=START-END, or no Range for the whole file",
        )
    return FileResponse(
        path, filename=Path(name).name, headers=headers, media_type="application/octet-stream"
    )


@router.get("/{job_id}/bundle.zip", response_class=FileResponse, responses=ERRORS)
async def get_bundle(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Every artifact and the reports in one zip."""
    path = await anyio.to_thread.run_sync(
        job_actions.bundle, services, principal.token_id, job_id
    )
    return FileResponse(
        path,
        media_type="application/zip",
        filename=f"edge-un-{job_id}.zip",
        background=BackgroundTask(path.unlink, missing_ok=True),
    )
