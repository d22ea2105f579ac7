"""API tokens: created once (the secret is shown to its owner once), stored only as a sha256.

Each function opens the database the settings name and migrates it to the newest schema
first, so ``edge-un token create`` works before the server ever ran. A token sees only the
jobs created with it; a revoked token is refused like an unknown one.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import UsageError

from .db import Token, session_scope, upgrade
from .db.models import utcnow
from .settings import Settings

PREFIX = "eun_"  # says what a leaked string is (secret scanners key on prefixes)


@dataclass(frozen=True)
class TokenInfo:
    id: int
    name: str
    created_at: datetime
    revoked_at: datetime | None


def _info(token: Token) -> TokenInfo:
    return TokenInfo(token.id, token.name, token.created_at, token.revoked_at)


def hash_secret(secret: str) -> str:
    # A plain sha256 is enough here: the secret is 256 random bits, not a guessable password.
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(settings: Settings, name: str) -> tuple[TokenInfo, str]:
    """A new token named ``name``: its record and the secret (only its hash is stored)."""
    name = name.strip()
    if not name or len(name) > 200:
        raise UsageError("a token name must be 1 to 200 characters")
    upgrade(settings)
    secret = PREFIX + secrets.token_urlsafe(32)
    with session_scope(settings) as session:
        token = Token(name=name, secret_sha256=hash_secret(secret), created_at=utcnow())
        session.add(token)
        session.flush()
        return _info(token), secret


def list_tokens(settings: Settings) -> list[TokenInfo]:
    upgrade(settings)
    with session_scope(settings) as session:
        return [_info(t) for t in session.scalars(select(Token).order_by(Token.id))]


def revoke_token(settings: Settings, token_id: int) -> TokenInfo:
    """Revoke a token (its jobs stay, unreachable through the API); KeyError if unknown."""
    upgrade(settings)
    with session_scope(settings) as session:
        token = session.get(Token, token_id)
        if token is None:
            raise KeyError(f"no token with id {token_id}")
        if token.revoked_at is None:
            token.revoked_at = utcnow()
        return _info(token)


def verify_token(session: Session, secret: str) -> int | None:
    """The id of the live token whose secret this is, else None."""
    if not secret.startswith(PREFIX) or len(secret) > 200:
        return None
    token = session.scalar(select(Token).where(Token.secret_sha256 == hash_secret(secret)))
    if token is None or token.revoked_at is not None:
        return None
    return token.id
