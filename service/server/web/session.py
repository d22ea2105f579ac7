"""Who is signed in to the web page, and why a form post can be trusted.

The session cookie holds the API token the person signed in with (HttpOnly: no script reads it;
SameSite=Strict: no other site's page or link sends it; Path=/ui: the API never sees it;
Secure over HTTPS, which behind a TLS proxy only EDGE_UN_PUBLIC_URL can tell). Each request
checks the token as the API does, so a revoked token signs its holder out at once, and a token
sees only its own jobs, exactly as over the API.

Forms are CSRF-safe three ways: the SameSite=Strict cookie; a double-submit token (a random
value in its own cookie that every form repeats, which another site can neither read nor set);
and the Origin (else Referer) of a POST, which must be this server's own when the browser sends
one: EDGE_UN_PUBLIC_URL's when it is set (behind a proxy, uvicorn sees the proxy's address, not
the one in the browser), else the scheme and Host the request arrived with.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from fastapi import Request, Response

from ...errors import Refusal, Refused
from ..deps import Principal, principal_of, services

PREFIX = "/ui"
SESSION_COOKIE = "edge_un_session"
CSRF_COOKIE = "edge_un_csrf"
CSRF_FIELD = "csrf"
SESSION_MAX_AGE_S = 12 * 3600  # a working day; signing in again takes one paste


def signed_in(request: Request) -> Principal | None:
    """The principal of the session cookie, or None when nobody (valid) is signed in; with
    EDGE_UN_AUTH=none everybody is the one local user."""
    settings = services(request).settings
    if settings.auth == "none":
        return Principal(None)
    secret = request.cookies.get(SESSION_COOKIE)
    if not secret:
        return None
    return principal_of(settings, secret.strip())


def _cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=_own_origin(request)[0] == "https",
    )


def start_session(request: Request, response: Response, secret: str) -> None:
    _cookie(request, response, SESSION_COOKIE, secret.strip(), SESSION_MAX_AGE_S)
    # a new session, a new form token: one planted before signing in is worth nothing after
    _cookie(request, response, CSRF_COOKIE, secrets.token_urlsafe(32), SESSION_MAX_AGE_S)


def end_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path=PREFIX)


def csrf_token(request: Request) -> str:
    """The form token of this browser (the cookie's value; a fresh one when it has none, set
    on the response by ``keep_csrf``)."""
    token = request.cookies.get(CSRF_COOKIE) or getattr(request.state, "new_csrf", None)
    if not token:
        token = request.state.new_csrf = secrets.token_urlsafe(32)
    return token


def keep_csrf(request: Request, response: Response) -> None:
    """Set the form-token cookie if this request made a new one."""
    new = getattr(request.state, "new_csrf", None)
    if new:
        _cookie(request, response, CSRF_COOKIE, new, SESSION_MAX_AGE_S)


def _own_origin(request: Request) -> tuple[str, str]:
    """Where people reach this server (scheme, host[:port]): EDGE_UN_PUBLIC_URL's origin, else
    the scheme and Host this request arrived with."""
    public = services(request).settings.public_origin
    if public is not None:
        url = urlsplit(public)
        return url.scheme, url.netloc
    return request.url.scheme, request.url.netloc


def _same_origin(request: Request) -> bool:
    """A POST's Origin, else its Referer, names this server (when the browser sends either)."""
    claimed = request.headers.get("origin") or request.headers.get("referer")
    if not claimed:
        return True  # not a browser's cross-site post: those always carry an Origin
    if claimed == "null":
        return False  # an opaque origin: a sandboxed frame, a data: URL
    origin = urlsplit(claimed)
    return (origin.scheme, origin.netloc) == _own_origin(request)


def check_form(request: Request, submitted: str | None) -> None:
    """Refuse a form post (403) that does not come from this server's own page."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    if not _same_origin(request):
        raise Refused(
            Refusal.FORBIDDEN,
            "Forbidden",
            "this form was posted from another site; use the page itself",
        )
    if not cookie or not submitted or not hmac.compare_digest(cookie, submitted):
        raise Refused(
            Refusal.FORBIDDEN,
            "Forbidden",
            "the form is out of date (its security token does not match this browser's); "
            "reload the page and send it again",
        )
