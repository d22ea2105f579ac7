"""The OpenAPI document as the API behaves: every error is application/problem+json.

FastAPI documents its validation errors (422) as its own JSON shape and knows nothing of the
problem+json handlers; this rewrites each error response of each operation to the ProblemDetails
schema, and adds the 401 every /v1 route can answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ...schemas import ProblemDetails

PROBLEM_REF = {"$ref": "#/components/schemas/ProblemDetails"}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _problem_errors(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    description=app.description,
                    routes=app.routes,
                )
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _problem_errors(spec: dict[str, Any]) -> dict[str, Any]:
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components["ProblemDetails"] = ProblemDetails.model_json_schema()
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in spec.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            if path.startswith("/v1"):
                responses.setdefault("401", {})
            for code, response in responses.items():
                if code.isdigit() and int(code) >= 400:
                    response["description"] = response.get("description") or "a problem"
                    response["content"] = {"application/problem+json": {"schema": PROBLEM_REF}}
    return spec
