"""Byte ranges (RFC 9110, section 14): whether a Range header can be served from a file.

Starlette's FileResponse serves ranges itself but answers a bad one in plain text; this check
runs first so that every refusal is problem+json. It reads a header exactly as FileResponse does:
the unit must be ``bytes``; parts that are not ``START-END``, ``START-`` or ``-SUFFIX`` numbers
are passed over; what is left must select bytes inside the file, each range starting before it
ends; and no more than MAX_RANGES parts.
"""

from __future__ import annotations

BAD_REQUEST, NOT_SATISFIABLE = 400, 416
MAX_RANGES = 100  # Starlette's FileResponse.max_ranges


def range_status(header: str, size: int) -> int | None:
    """None when ``header`` selects bytes of a file of ``size`` bytes; else the status of the
    refusal: 400 for a header that is not a byte range at all, 416 for one that does not fit."""
    unit, equals, spec = header.partition("=")
    if not equals or unit.strip().lower() != "bytes":
        return BAD_REQUEST
    if spec.count(",") + 1 > MAX_RANGES:
        return NOT_SATISFIABLE
    ranges = [r for r in (_parsed(part.strip(), size) for part in spec.split(",")) if r]
    if not ranges or not all(0 <= start < size and start < end for start, end in ranges):
        return NOT_SATISFIABLE
    return None


def _parsed(part: str, size: int) -> tuple[int, int] | None:
    """(start, end) of one part, end exclusive, read as FileResponse reads it (Python's int());
    None for a part it passes over."""
    if not part or part == "-" or "-" not in part:
        return None
    first, last = (text.strip() for text in part.split("-", 1))
    try:
        start = int(first) if first else max(size - int(last), 0)
        end = int(last) + 1 if first and last and int(last) < size else size
    except ValueError:
        return None
    return start, end
