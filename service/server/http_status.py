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
}


def status_of(refused: Refused) -> int:
    return REFUSAL_STATUS[refused.kind]
