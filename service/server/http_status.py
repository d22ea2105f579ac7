"""The HTTP status of each kind of refusal (:class:`~service.errors.Refusal`): one table,
which the API (a problem+json body) and the web page (a message page) both answer with."""

from __future__ import annotations

from ..errors import Refusal, Refused

REFUSAL_STATUS = {
    Refusal.MALFORMED: 400,
    Refusal.FORBIDDEN: 403,
    Refusal.NOT_FOUND: 404,
    Refusal.CONFLICT: 409,
    Refusal.TOO_LARGE: 413,
    Refusal.NOT_A_FORM: 415,
    Refusal.NOT_SATISFIABLE: 416,
    Refusal.UNUSABLE: 422,
    Refusal.TOO_MANY: 429,
}


def status_of(refused: Refused) -> int:
    return REFUSAL_STATUS[refused.kind]


def headers_of(refused: Refused) -> dict[str, str]:
    """The headers a refusal's answer carries: when to ask again, if time lifts it."""
    return {} if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
