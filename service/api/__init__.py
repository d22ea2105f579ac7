"""The HTTP API (FastAPI): ``create_app(settings)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app


def __getattr__(name: str) -> Any:
    # Imported on first use: service.client and the CLI's remote commands read the API's
    # schemas (service.api.schemas) without loading FastAPI, the database and the queue.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'service.api' has no attribute {name!r}")


__all__ = ["create_app"]
