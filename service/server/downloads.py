"""A finished job's files as HTTP responses, the same for the API and the web page: one
artifact (ETag, Repr-Digest, byte ranges), every file in one zip, the report as one page.

Each takes the caller's token and finds the job through ``job_actions``, so another token's
job is "not found" here too. The web page then replaces the caching headers with its own.
"""

from __future__ import annotations

import base64
from pathlib import Path

import anyio
from fastapi import Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from starlette.background import BackgroundTask

from ..errors import Refusal, Refused
from . import job_actions
from .ranges import BAD_REQUEST, range_status
from .services import Services

IMMUTABLE = "private, max-age=31536000, immutable"  # an artifact never changes under its name


def artifact(
    request: Request, services: Services, token_id: int | None, job_id: str, name: str
) -> Response:
    """One artifact, streamed, with ETag and Repr-Digest (RFC 9530: sha-256 of the file); a
    304 for a matching If-None-Match; a Range that does not fit the file is refused."""
    info, path = job_actions.artifact(services, token_id, job_id, name)
    digest = base64.b64encode(bytes.fromhex(info.sha256)).decode()
    headers = {
        "ETag": f'"{info.sha256}"',
        "Repr-Digest": f"sha-256=:{digest}:",
        "Cache-Control": IMMUTABLE,
    }
    if_none_match = request.headers.get("if-none-match", "")
    if headers["ETag"] in {t.strip() for t in if_none_match.split(",")} or if_none_match == "*":
        return Response(status_code=304, headers=headers)
    header = request.headers.get("range")
    refused = None if header is None else range_status(header, info.bytes)
    if header is not None and refused is not None:
        malformed = refused == BAD_REQUEST
        raise Refused(
            Refusal.MALFORMED if malformed else Refusal.NOT_SATISFIABLE,
            "Bad request" if malformed else "Range not satisfiable",
            f"the Range header {header[:60]!r} does not fit the file of {info.bytes} bytes; "
            "send bytes=START-END, or no Range for the whole file",
        )
    return FileResponse(
        path, filename=Path(name).name, headers=headers, media_type="application/octet-stream"
    )


async def bundle(services: Services, token_id: int | None, job_id: str) -> FileResponse:
    """Every artifact and the reports in one new zip, removed once sent."""
    path = await anyio.to_thread.run_sync(job_actions.bundle, services, token_id, job_id)
    return FileResponse(
        path,
        media_type="application/zip",
        filename=f"edge-un-{job_id}.zip",
        background=BackgroundTask(path.unlink, missing_ok=True),
    )


async def report_page(services: Services, token_id: int | None, job_id: str) -> HTMLResponse:
    """report.html: tables and plots in one self-contained page, no external requests."""
    from ..report_html import CSP, report_page

    path = await anyio.to_thread.run_sync(job_actions.report_path, services, token_id, job_id)
    html = await anyio.to_thread.run_sync(report_page, path)
    # the page's own policy, as a header too (a <meta> policy only acts once it is parsed)
    return HTMLResponse(html, headers={"Content-Security-Policy": CSP})
