"""``edge-un serve``: the HTTP conversion service (service.server does the work)."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import command
from .tokens import settings


@command(rich_help_panel="Service")
def serve(
    host: Annotated[
        str, typer.Option(envvar="EDGE_UN_HOST", help="Address to listen on (0.0.0.0: all).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="EDGE_UN_PORT", help="TCP port.")] = 8000,
) -> int:
    """Serve conversions over HTTP (settings from EDGE_UN_* variables, e.g. EDGE_UN_DATA_DIR).

    Migrates the database, re-queues interrupted jobs, then runs until interrupted.
    """
    service_settings = settings()
    try:
        from service.server.serve import serve as run_server
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the HTTP service needs {error.name}: pip install 'edge-un[service]'"
        ) from None
    run_server(service_settings, host=host, port=port)
    return 0
