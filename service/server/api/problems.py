"""Errors as RFC 9457 problem details (application/problem+json), for every client error.

Handlers cover the routes' own ``Problem``, the service's ``Refused`` (upload checks, job
actions, downloads: their kind's status is ``service.server.http_status``'s), FastAPI's
request validation (422), Starlette's unknown routes (404) and wrong methods (405), and, as a
last resort, any unexpected exception (a 500 that says so and is logged, never a traceback).
Each ``detail`` says what was wrong and what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ...errors import Refused
from ..http_status import status_of

log = logging.getLogger("edge_un.api")
MEDIA_TYPE = "application/problem+json"
TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Content too large",
    415: "Unsupported media type",
    416: "Range not satisfiable",
    422: "Unprocessable content",
    500: "Internal server error",
    503: "Service unavailable",
}


class Problem(Exception):
    """A client (or availability) error with everything its problem+json body needs."""

    def __init__(
        self,
        status: int,
        detail: str,
        title: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.title = title or TITLES.get(status, "Error")
        self.headers = dict(headers or {})
        self.extensions = extensions


def problem_response(
    status: int,
    detail: str,
    title: str | None = None,
    *,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extensions: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": title or TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    body.update(extensions)
    return JSONResponse(
        body, status_code=status, headers=dict(headers or {}), media_type=MEDIA_TYPE
    )


def _where(location: Sequence[Any]) -> str:
    parts = [str(p) for p in location]
    if not parts:
        return "the request"
    kind = {
        "query": "query parameter",
        "path": "path parameter",
        "header": "header",
        "body": "body field",
        "cookie": "cookie",
    }.get(parts[0])
    rest = ".".join(parts[1:])
    if kind is None:
        return ".".join(parts)
    return f"{kind} {rest!r}" if rest else f"the {parts[0]}"


def validation_detail(errors: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One readable sentence for FastAPI's validation errors, and a JSON-safe list of them."""
    items = [
        {"location": [str(p) for p in e.get("loc", ())], "message": str(e.get("msg", ""))}
        for e in errors
    ]
    said = "; ".join(f"{_where(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    detail = f"{said or 'the request is not valid'}{more}; see /docs for what this route takes"
    return detail, items


def _allowed_methods(request: Request) -> str:
    """Every method some route takes at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    routes = getattr(request.app.state, "flat_routes", None) or request.app.router.routes
    for route in routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def install(app: FastAPI) -> None:
    """Register the problem+json handlers on ``app``."""

    @app.exception_handler(Problem)
    async def _problem(request: Request, error: Problem) -> JSONResponse:
        return problem_response(
            error.status,
            error.detail,
            error.title,
            headers=error.headers,
            instance=request.url.path,
            **error.extensions,
        )

    @app.exception_handler(Refused)
    async def _refused(request: Request, error: Refused) -> JSONResponse:
        return problem_response(
            status_of(error), error.detail, error.title, instance=request.url.path
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        detail, items = validation_detail(error.errors())
        return problem_response(
            422, detail, "Invalid request", instance=request.url.path, errors=items
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        status = error.status_code
        detail = error.detail if isinstance(error.detail, str) else TITLES.get(status, "Error")
        if status == 404 and detail == "Not Found":
            detail = (
                f"there is no {request.url.path!r}; the routes are listed at /docs "
                "(and /openapi.json)"
            )
        elif status == 405:
            allowed = _allowed_methods(request) or (error.headers or {}).get("Allow", "")
            error.headers = {**(error.headers or {}), "Allow": allowed}
            detail = (
                f"{request.method} is not allowed on {request.url.path!r}; allowed: "
                f"{allowed or 'see /docs'}"
            )
        return problem_response(status, detail, instance=request.url.path, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return problem_response(
            500,
            "the server failed on this request (a bug, logged with its details); try again, and "
            "report it if it persists",
            instance=request.url.path,
        )
