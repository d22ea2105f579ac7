"""What the API's and the web page's routes both take from a request: the app's services, the
base URL of the links they answer with, and the caller an API token names (the API reads the
token from a bearer header, the web page from its session cookie)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from ..db import session_scope
from ..settings import Settings
from ..tokens import verify_token
from .services import Services


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's id, or None in the unauthenticated local mode."""

    token_id: int | None


def services(request: Request) -> Services:
    return request.app.state.services


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def principal_of(settings: Settings, secret: str) -> Principal | None:
    """The caller whose API token ``secret`` is; None for a token unknown or revoked."""
    with session_scope(settings) as session:
        token_id = verify_token(session, secret)
    return None if token_id is None else Principal(token_id)


ServicesDep = Annotated[Services, Depends(services)]
