"""The web page's routes (``/ui``): sign in, your jobs, a new conversion, a job, its report
and files. Thin, like the API's, and beside them: each calls the plain functions the API's
routes call too (``job_actions``, ``intake``, ``downloads``) with the signed-in principal, so a
page shows exactly what the API answers that token, and another token's job is the same "not
found".

Errors are mapped once, by the routes' class (``PageRoute``): a refusal becomes a message page
with its status (``http_status``), nobody signed in a redirect to the sign-in page. Every answer
carries report.html's Content-Security-Policy as a header too, and is never cached (a
signed-out browser must not show the jobs from its cache, nor keep their files: the downloads
drop the API's year-long Cache-Control). Not in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any
from urllib.parse import parse_qs

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute

from ...errors import Refusal, Refused
from ...job_states import ACTIVE
from ...report_html import CSP
from ...schemas import JobOut
from .. import downloads, intake, job_actions
from ..deps import Principal, ServicesDep, base_url, principal_of, services
from ..http_status import headers_of, status_of
from . import pages
from .session import (
    CSRF_FIELD,
    PREFIX,
    check_form,
    csrf_token,
    end_session,
    keep_csrf,
    signed_in,
    start_session,
)

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


class SignInFirst(Exception):
    """Nobody (valid) is signed in: the page answers with the way to the sign-in page."""


class PageRoute(APIRoute):
    """A page's route: its answer gets the page headers (and a new form-token cookie), a
    refusal becomes a message page, nobody signed in a redirect to the sign-in page."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def page(request: Request) -> Response:
            try:
                response = await handle(request)
            except SignInFirst:
                response = _redirect(f"{PREFIX}/signin")
            except Refused as refused:
                signed = getattr(request.state, "who", None) is not None
                text = pages.message_page(
                    refused.title, refused.detail, csrf_token(request), signed
                )
                response = HTMLResponse(
                    text, status_code=status_of(refused), headers=headers_of(refused)
                )
            response.headers.update(HEADERS)  # downloads: no-store, not "immutable for a year"
            keep_csrf(request, response)
            return response

        return page


router = APIRouter(prefix=PREFIX, include_in_schema=False, route_class=PageRoute)
root = APIRouter(include_in_schema=False, route_class=PageRoute)


def who(request: Request) -> Principal:
    """The signed-in principal, or SignInFirst (a dependency: FastAPI runs it in a thread, off
    the event loop, as it reads the database)."""
    principal = signed_in(request)
    if principal is None:
        raise SignInFirst
    request.state.who = principal
    return principal


SignedIn = Annotated[Principal, Depends(who)]


def _redirect(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303)


async def _small_form(request: Request) -> dict[str, str]:
    """An urlencoded form of a few fields, read with a cap (a huge body is refused, not held)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Refused(Refusal.TOO_LARGE, "Content too large", "the form is too large")
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=MAX_FORM_FIELDS)
    except ValueError:  # parse_qs's answer to more fields than max_num_fields
        raise Refused(
            Refusal.MALFORMED,
            "Bad request",
            f"the form has more than {MAX_FORM_FIELDS} fields; send the page's own form",
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
    return HTMLResponse(pages.signin_page(csrf_token(request)))


@router.post("/signin")
async def signin(request: Request, services: ServicesDep) -> Response:
    try:
        form = await _small_form(request)
        check_form(request, form.get(CSRF_FIELD))
    except Refused as refused:
        page = pages.signin_page(csrf_token(request), refused.detail)
        return HTMLResponse(page, status_code=status_of(refused))
    secret = form.get("token", "")
    secret = secret.strip()  # pasted with the line's end, as often as not
    if not secret or await _in_thread(principal_of, services.settings, secret) is None:
        error = "that token is unknown or revoked; create one with edge-un token create NAME"
        return HTMLResponse(pages.signin_page(csrf_token(request), error), status_code=401)
    response = _redirect(f"{PREFIX}/")
    start_session(request, response, secret)
    return response


@router.post("/signout")
async def signout(request: Request) -> Response:
    check_form(request, (await _small_form(request)).get(CSRF_FIELD))
    response = _redirect(f"{PREFIX}/signin")
    end_session(response)
    return response


@router.get("/")
def jobs_view(request: Request, services: ServicesDep, who: SignedIn) -> Response:
    rows, total = job_actions.page(services, who.token_id, JOBS_SHOWN, 0)
    listing = [
        (JobOut.of(job, base_url(request)), job_actions.verdicts_of(services, job)) for job in rows
    ]
    return HTMLResponse(pages.jobs_page(listing, total, csrf_token(request)))


def _targets() -> list[tuple[str, str]]:
    from quant.targets import PROFILES

    return [(profile.name, profile.board) for profile in PROFILES.values()]


@router.get("/new")
def upload_form(request: Request, who: SignedIn) -> Response:
    return HTMLResponse(pages.upload_page(_targets(), csrf_token(request)))


@router.post("/new")
async def upload(request: Request, services: ServicesDep, who: SignedIn) -> Response:
    """The form's multipart body goes through the same intake as an API upload (``browser``: empty
    file inputs and one part per ticked target are how browsers send a form)."""
    try:
        check_form(request, request.query_params.get(CSRF_FIELD))
        job = await intake.submit(
            services, request.stream(), request.headers, who.token_id, browser=True
        )
    except Refused as refused:
        page = pages.upload_page(_targets(), csrf_token(request), refused.detail)
        return HTMLResponse(page, status_code=status_of(refused), headers=headers_of(refused))
    return _redirect(f"{PREFIX}/jobs/{job.id}")


@router.get("/jobs/{job_id}")
def job_view(job_id: str, request: Request, services: ServicesDep, who: SignedIn) -> Response:
    job = job_actions.find(services, who.token_id, job_id)
    files = []
    if job.state not in ACTIVE and services.store.list(job.id) is not None:
        _, files = job_actions.finished_with_files(services, who.token_id, job_id)
    shown = JobOut.of(job, base_url(request))
    verdicts = job_actions.verdicts_of(services, job)
    return HTMLResponse(pages.job_page(shown, verdicts, files, csrf_token(request)))


@router.get("/jobs/{job_id}/report")
async def report_view(job_id: str, services: ServicesDep, who: SignedIn) -> Response:
    """The same page as /v1/conversions/{id}/report.html (and as convert's report.html)."""
    return await downloads.report_page(services, who.token_id, job_id)


@router.get("/jobs/{job_id}/artifacts/{name:path}")
def artifact(
    job_id: str, name: str, request: Request, services: ServicesDep, who: SignedIn
) -> Response:
    return downloads.artifact(request, services, who.token_id, job_id, name)


@router.get("/jobs/{job_id}/bundle.zip")
async def bundle(job_id: str, services: ServicesDep, who: SignedIn) -> Response:
    return await downloads.bundle(services, who.token_id, job_id)


@router.post("/jobs/{job_id}/{action}")
async def job_action(
    job_id: str, action: str, request: Request, services: ServicesDep, who: SignedIn
) -> Response:
    """``cancel`` (a queued or running job; the API's cancel, which never deletes) or
    ``delete`` (a finished one, with its files)."""
    check_form(request, (await _small_form(request)).get(CSRF_FIELD))
    if action == "cancel":
        await _in_thread(job_actions.cancel, services, who.token_id, job_id)
        return _redirect(f"{PREFIX}/jobs/{job_id}")
    if action != "delete":
        raise Refused(
            Refusal.NOT_FOUND, "Not found", f"there is no action {action[:40]!r} on a job"
        )
    await _in_thread(job_actions.delete_finished, services, who.token_id, job_id)
    return _redirect(f"{PREFIX}/")
