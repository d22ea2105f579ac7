"""What routes depend on: the app's services and the caller's identity (bearer tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..db import session_scope
from ..services import Services
from ..settings import Settings
from ..tokens import verify_token
from .problems import Problem

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="edge-un"'}
HOW_TO = "create one with `edge-un token create NAME` on the server host"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's id, or None in the unauthenticated local mode."""

    token_id: int | None


def services(request: Request) -> Services:
    return request.app.state.services


_bearer = HTTPBearer(auto_error=False, description="an API token from `edge-un token create`")


def principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller's token; 401 (problem+json) without a valid one, unless auth is "none"."""
    settings: Settings = services(request).settings
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
    with session_scope(settings) as session:
        token_id = verify_token(session, credentials.credentials)
    if token_id is None:
        raise Problem(401, f"the API token is unknown or revoked; {HOW_TO}", headers=CHALLENGE)
    return Principal(token_id)


ServicesDep = Annotated[Services, Depends(services)]
PrincipalDep = Annotated[Principal, Depends(principal)]
