"""The one error of service.client: a request the service refused or could not answer."""

from __future__ import annotations

import contextlib

import httpx
from pydantic import ValidationError

from ..schemas import ProblemDetails


class ServiceError(Exception):
    """A request the service refused or could not answer, in one line: the problem's
    ``detail`` when the server sent one (``problem``), else what went wrong on the way."""

    def __init__(
        self, message: str, *, status: int | None = None, problem: ProblemDetails | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem

    @property
    def detail(self) -> str:
        return self.problem.detail if self.problem is not None else str(self)


def problem_error(response: httpx.Response) -> ServiceError:
    """The ServiceError for an error response: its problem+json, or a summary of the body."""
    problem = None
    with contextlib.suppress(ValueError, ValidationError):
        problem = ProblemDetails.model_validate(response.json())
    if problem is not None:
        message = f"{problem.detail} (HTTP {response.status_code} {problem.title})"
    else:
        text = " ".join(response.text.split())[:200] or response.reason_phrase
        message = f"HTTP {response.status_code} from {response.request.url}: {text}"
    return ServiceError(message, status=response.status_code, problem=problem)


def reason(error: httpx.TransportError) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
