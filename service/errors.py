"""The service's refusals: what a request asked that the service will not do, and why.

Domain code (the upload checks, the job actions) raises these with a ``Refusal`` kind, a short
title and a detail that says what was wrong and what to do; only the HTTP server turns a kind
into a status code (``service.server.http_status``), and that into a problem+json body (the
API) or a page (the web page).
"""

from __future__ import annotations

from enum import Enum


class UsageError(ValueError):
    """What a command or a client call was given cannot be used (a token id, a directory, an
    option): said in one line, exit 1. ``quant.errors.blame`` counts the conversion's input errors;
    this is the command line's own."""


class Refusal(Enum):
    MALFORMED = "malformed"  # the request itself is broken: a bad form, name or field
    NOT_A_FORM = "not a form"  # an upload's body is not multipart/form-data
    TOO_LARGE = "too large"  # over a size limit
    UNUSABLE = "unusable"  # a well-formed request whose content cannot be converted
    NOT_FOUND = "not found"  # no such job for this caller
    CONFLICT = "conflict"  # the job is not in a state that allows it
    FORBIDDEN = "forbidden"  # a form that does not come from the service's own page
    NOT_SATISFIABLE = "not satisfiable"  # a byte range outside the file asked for
    TOO_MANY = "too many"  # over a limit that time lifts: ask again after ``retry_after``


class Refused(Exception):
    def __init__(
        self, kind: Refusal, title: str, detail: str, retry_after: int | None = None
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.title = title
        self.detail = detail
        self.retry_after = retry_after  # seconds after which asking again may be answered

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind.name}, {self.title!r}, {self.detail!r})"


class UploadRejected(Refused):
    """A refused upload: the one error the upload checks raise; nothing is kept of it."""


def malformed(detail: str) -> UploadRejected:
    """A broken upload request: its form, a field or a file name."""
    return UploadRejected(Refusal.MALFORMED, "Bad request", detail)
