"""Byte ranges (RFC 9110, section 14): whether a Range header can be served from a file.

Starlette's FileResponse serves ranges itself but answers a bad one in plain text; this check
runs first so that every refusal is problem+json. It accepts exactly what FileResponse serves:
``bytes=`` followed by ranges ``START-END``, ``START-`` or ``-SUFFIX``, each inside the file.
"""

from __future__ import annotations

BAD_REQUEST, NOT_SATISFIABLE = 400, 416


def range_status(header: str, size: int) -> int | None:
    """None when ``header`` selects bytes of a file of ``size`` bytes; else the status of the
    refusal: 400 for a header that is not a byte range at all, 416 for one that does not fit."""
    unit, equals, spec = header.partition("=")
    if not equals or unit.strip().lower() != "bytes":
        return BAD_REQUEST
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts or not all(_fits(part, size) for part in parts):
        return NOT_SATISFIABLE
    return None


def _fits(part: str, size: int) -> bool:
    first, dash, last = (text.strip() for text in part.partition("-"))
    if not dash or not (_number(first) or _number(last)):
        return False
    if not all(text == "" or _number(text) for text in (first, last)):
        return False
    if not first:  # the last SUFFIX bytes
        return int(last) > 0 and size > 0
    start = int(first)
    end = min(int(last) + 1, size) if last else size
    return 0 <= start < size and start < end


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()
