"""/v1/conversions: create, list, read, cancel, delete a job; its report, artifacts and bundle.

Thin: each route checks who asks, calls one function of ``service.server.intake``,
``job_actions`` or ``downloads``, and shapes the answer. Another token's job is a 404, exactly
like a job that does not exist (``job_actions.find``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse

from quant.measure.bars import DEFAULT_MAX_DRIFT

from ...schemas import ArtifactOut, JobOut, JobPage
from .. import downloads, intake, job_actions
from ..deps import ServicesDep, base_url
from ..intake import MAX_DRIFT_LIMIT
from ..uploads.files import MAX_DATA_FILES
from .auth import PrincipalDep

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
            "maximum": MAX_DRIFT_LIMIT,
            "description": f"top-1 points an int8 file may lose (default {DEFAULT_MAX_DRIFT:g})",
        },
    },
}


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={**ERRORS, 429: {"description": "a problem (RFC 9457), with Retry-After"}},
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
    job = await intake.submit(services, request.stream(), request.headers, principal.token_id)
    out = JobOut.of(job, base_url(request))
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
    rows, total = job_actions.page(services, principal.token_id, limit, offset)
    base = base_url(request)
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
    return JobOut.of(job, base_url(request))


@router.delete(
    "/{job_id}", response_model=JobOut, responses={**ERRORS, 204: {"description": "deleted"}}
)
def delete_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut | Response:
    """Cancel a queued or running conversion (200, the job); delete a finished one and its
    files (204). To cancel only, never delete: POST /v1/conversions/{id}/cancel."""
    cancelled = job_actions.cancel_or_delete(services, principal.token_id, job_id)
    if cancelled is None:
        return Response(status_code=204)
    return JobOut.of(cancelled, base_url(request))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_conversion(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> JobOut:
    """Cancel a queued or running conversion (the job, now cancelled); a finished one is left
    as it is, with its files (409)."""
    cancelled = job_actions.cancel(services, principal.token_id, job_id)
    return JobOut.of(cancelled, base_url(request))


@router.get(
    "/{job_id}/report",
    responses=ERRORS,
    response_description="the report.json the conversion wrote",
)
def get_report(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> FileResponse:
    """The conversion's report.json (schema: quant/report/report.schema.json)."""
    path = job_actions.report_path(services, principal.token_id, job_id)
    return FileResponse(path, media_type="application/json")


@router.get("/{job_id}/report.html", response_class=HTMLResponse, responses=ERRORS)
async def get_report_html(
    job_id: JobId, services: ServicesDep, principal: PrincipalDep
) -> HTMLResponse:
    """The report as one self-contained page: tables and plots, no external requests."""
    return await downloads.report_page(services, principal.token_id, job_id)


@router.get("/{job_id}/artifacts", response_model=list[ArtifactOut], responses=ERRORS)
def list_artifacts(
    job_id: JobId, request: Request, services: ServicesDep, principal: PrincipalDep
) -> list[ArtifactOut]:
    """Every file the conversion wrote: name, size, sha256."""
    job, files = job_actions.finished_with_files(services, principal.token_id, job_id)
    return [ArtifactOut.of(info, job.id, base_url(request)) for info in files]


@router.get(
    "/{job_id}/artifacts/{name:path}",
    responses={**ERRORS, 304: {"description": "not modified"}, 416: ERRORS[400]},
)
def get_artifact(
    job_id: JobId, name: str, request: Request, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """One artifact, streamed, with ETag and Repr-Digest (RFC 9530: sha-256 of the file)."""
    return downloads.artifact(request, services, principal.token_id, job_id, name)


@router.get("/{job_id}/bundle.zip", response_class=FileResponse, responses=ERRORS)
async def get_bundle(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Every artifact and the reports in one zip."""
    return await downloads.bundle(services, principal.token_id, job_id)
