"""Who calls the API: the bearer token of the request (RFC 6750), 401 (problem+json) without
a valid one, unless the service runs without authentication (EDGE_UN_AUTH=none)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..deps import Principal, principal_of, services
from .problems import Problem

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="edge-un"'}
HOW_TO = "create one with `edge-un token create NAME` on the server host"

_bearer = HTTPBearer(auto_error=False, description="an API token from `edge-un token create`")


def principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller's token; 401 (problem+json) without a valid one, unless auth is "none"."""
    settings = services(request).settings
    if settings.auth == "none":
        return Principal(None)
    if credentials is None:
        header = request.headers.get("authorization")
        detail = (
            f"this route needs an API token: send `Authorization: Bearer <token>` ({HOW_TO})"
            if header is None
            else "the Authorization header must be `Bearer <token>`"
        )
        raise Problem(401, detail, headers=CHALLENGE)
    caller = principal_of(settings, credentials.credentials)
    if caller is None:
        raise Problem(401, f"the API token is unknown or revoked; {HOW_TO}", headers=CHALLENGE)
    return caller


PrincipalDep = Annotated[Principal, Depends(principal)]
