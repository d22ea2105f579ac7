"""The web page's routes (``/ui``): sign in, your jobs, a new conversion, a job, its report
and files. Thin, like the API's: the job, report and file routes call the API's own route
functions (service.api.conversions) with the signed-in principal, so a page shows exactly what
the API answers that token, and another token's job is the same "not found".

Every answer carries report.html's Content-Security-Policy as a header too, and is never cached
(a signed-out browser must not show the jobs from its cache, nor keep their files: the
downloads drop the API's year-long Cache-Control). Not in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from .. import job_actions, jobs
from ..api import conversions
from ..api.deps import Principal, services
from ..api.problems import Problem, status_of
from ..api.schemas import JobOut
from ..db import session_scope
from ..errors import Refused
from ..job_states import ACTIVE
from ..report_html import CSP
from . import pages
from .session import (
    CSRF_FIELD,
    PREFIX,
    check_form,
    csrf_token,
    end_session,
    keep_csrf,
    principal_of,
    signed_in,
    start_session,
)

router = APIRouter(prefix=PREFIX, include_in_schema=False)
root = APIRouter(include_in_schema=False)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",  # frame-ancestors has no effect in a <meta> policy
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
MAX_FORM_BYTES = 16 * 1024  # a sign-in or button form; nobody's token is longer
MAX_FORM_FIELDS = 8  # the page's forms send two (token or action, and csrf)
JOBS_SHOWN = 50


def _html(request: Request, text: str, status: int = 200) -> HTMLResponse:
    response = HTMLResponse(text, status_code=status, headers=HEADERS)
    keep_csrf(request, response)
    return response


def _redirect(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303, headers=HEADERS)


def _message(
    request: Request, problem: Problem | Refused, who: Principal | None
) -> Response:
    status = status_of(problem)
    title = "Not found" if status == 404 else problem.title
    text = pages.message_page(title, problem.detail, csrf_token(request), who is not None)
    return _html(request, text, status)


async def _small_form(request: Request) -> dict[str, str]:
    """An urlencoded form of a few fields, read with a cap (a huge body is refused, not held)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Problem(413, "the form is too large")
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=MAX_FORM_FIELDS)
    except ValueError:  # parse_qs's answer to more fields than max_num_fields
        raise Problem(
            400, f"the form has more than {MAX_FORM_FIELDS} fields; send the page's own form"
        ) from None
    return {name: values[0] for name, values in fields.items()}


async def _in_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Database work off the event loop, as the API's async routes do."""
    return await anyio.to_thread.run_sync(call, *args)


@root.get("/")
def home() -> RedirectResponse:
    return _redirect(f"{PREFIX}/")


@router.get("")
def ui_root() -> RedirectResponse:
    return _redirect(f"{PREFIX}/")


@router.get("/signin")
def signin_form(request: Request) -> Response:
    if services(request).settings.auth == "none" or signed_in(request) is not None:
        return _redirect(f"{PREFIX}/")
    return _html(request, pages.signin_page(csrf_token(request)))


@router.post("/signin")
async def signin(request: Request) -> Response:
    try:
        form = await _small_form(request)
        check_form(request, form.get(CSRF_FIELD))
    except Problem as problem:
        page = pages.signin_page(csrf_token(request), problem.detail)
        return _html(request, page, problem.status)
    secret = form.get("token", "")
    if not secret.strip() or await _in_thread(principal_of, request, secret) is None:
        error = "that token is unknown or revoked; create one with edge-un token create NAME"
        return _html(request, pages.signin_page(csrf_token(request), error), 401)
    response = _redirect(f"{PREFIX}/")
    start_session(request, response, secret)
    return response


@router.post("/signout")
async def signout(request: Request) -> Response:
    try:
        check_form(request, (await _small_form(request)).get(CSRF_FIELD))
    except Problem as problem:
        return _message(request, problem, None)
    response = _redirect(f"{PREFIX}/signin")
    end_session(response)
    return response


@router.get("/")
def jobs_view(request: Request) -> Response:
    who = signed_in(request)
    if who is None:
        return _redirect(f"{PREFIX}/signin")
    with session_scope(services(request).settings) as session:
        rows, total = jobs.page(session, who.token_id, JOBS_SHOWN, 0)
    base = str(request.base_url).rstrip("/")
    listing = [JobOut.of(job, base) for job in rows]
    return _html(request, pages.jobs_page(listing, total, csrf_token(request)))


def _targets() -> list[tuple[str, str]]:
    from quant.targets import PROFILES

    return [(profile.name, profile.board) for profile in PROFILES.values()]


@router.get("/new")
def upload_form(request: Request) -> Response:
    if signed_in(request) is None:
        return _redirect(f"{PREFIX}/signin")
    return _html(request, pages.upload_page(_targets(), csrf_token(request)))


@router.post("/new")
async def upload(request: Request) -> Response:
    """The form's multipart body goes through the API's own upload checks (``browser``: empty
    file inputs and one part per ticked target are how browsers send a form)."""
    who = await _in_thread(signed_in, request)
    if who is None:
        return _redirect(f"{PREFIX}/signin")
    service = services(request)
    try:
        check_form(request, request.query_params.get(CSRF_FIELD))
        job = await conversions.submit_upload(request, service, who.token_id, browser=True)
    except (Problem, Refused) as problem:
        page = pages.upload_page(_targets(), csrf_token(request), problem.detail)
        return _html(request, page, status_of(problem))
    return _redirect(f"{PREFIX}/jobs/{job.id}")


def _signed_in_or_redirect(request: Request) -> Principal | Response:
    who = signed_in(request)
    return _redirect(f"{PREFIX}/signin") if who is None else who


@router.get("/jobs/{job_id}")
def job_view(job_id: str, request: Request) -> Response:
    who = _signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    service = services(request)
    try:
        job = conversions.get_conversion(job_id, request, service, who)
        files = []
        if job.state not in ACTIVE and service.store.list(job.id) is not None:
            files = conversions.list_artifacts(job_id, request, service, who)
    except (Problem, Refused) as problem:
        return _message(request, problem, who)
    return _html(request, pages.job_page(job, files, csrf_token(request)))


async def _no_store(
    request: Request, answer: Callable[[Principal], Awaitable[Response]]
) -> Response:
    """The API's answer for the signed-in person, with the page headers (no-store, not the
    API's "immutable for a year"); the sign-in page for nobody, a message page for a Problem."""
    who = await _in_thread(signed_in, request)
    if who is None:
        return _redirect(f"{PREFIX}/signin")
    try:
        response = await answer(who)
    except (Problem, Refused) as problem:
        return _message(request, problem, who)
    response.headers.update(HEADERS)
    return response


@router.get("/jobs/{job_id}/report")
async def report_view(job_id: str, request: Request) -> Response:
    """The same page as /v1/conversions/{id}/report.html (and as convert's report.html)."""
    return await _no_store(
        request, lambda who: conversions.get_report_html(job_id, services(request), who)
    )


@router.get("/jobs/{job_id}/artifacts/{name:path}")
def artifact(job_id: str, name: str, request: Request) -> Response:
    who = _signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    try:
        response = conversions.get_artifact(job_id, name, request, services(request), who)
    except (Problem, Refused) as problem:
        return _message(request, problem, who)
    response.headers.update(HEADERS)  # no-store, not the API's "immutable for a year"
    return response


@router.get("/jobs/{job_id}/bundle.zip")
async def bundle(job_id: str, request: Request) -> Response:
    return await _no_store(
        request, lambda who: conversions.get_bundle(job_id, services(request), who)
    )


@router.post("/jobs/{job_id}/{action}")
async def job_action(job_id: str, action: str, request: Request) -> Response:
    """``cancel`` (a queued or running job; the API's cancel, which never deletes) or
    ``delete`` (a finished one, with its files)."""
    who = await _in_thread(signed_in, request)
    if who is None:
        return _redirect(f"{PREFIX}/signin")
    service = services(request)
    try:
        check_form(request, (await _small_form(request)).get(CSRF_FIELD))
        if action == "cancel":
            await _in_thread(conversions.cancel_conversion, job_id, request, service, who)
            return _redirect(f"{PREFIX}/jobs/{job_id}")
        if action != "delete":
            raise Problem(404, f"there is no action {action[:40]!r} on a job")
        await _in_thread(job_actions.delete_finished, service, who.token_id, job_id)
    except (Problem, Refused) as problem:
        return _message(request, problem, who)
    return _redirect(f"{PREFIX}/")
