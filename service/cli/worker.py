"""``edge-un worker``: a Celery worker for the HTTP service's conversions (EDGE_UN_QUEUE=celery)."""

from __future__ import annotations

from typing import Annotated

import typer

from service.errors import UsageError

from .app import command
from .tokens import settings


@command(rich_help_panel="Service")
def worker(
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", "-c", min=1, help="Conversions at once (default: EDGE_UN_WORKERS)."
        ),
    ] = None,
    hostname: Annotated[
        str | None,
        typer.Option(help="This worker's name (default: celery@ followed by this host's name)."),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Do not run a worker: exit 0 if the worker of this name answers a ping through "
            "the broker, 1 if not (a container health check).",
        ),
    ] = False,
) -> int:
    """Run conversions sent by `edge-un serve` in Celery mode, until stopped.

    Reads the same EDGE_UN_* settings as the server: EDGE_UN_QUEUE=celery, EDGE_UN_BROKER_URL,
    EDGE_UN_DATABASE_URL, and EDGE_UN_DATA_DIR on a volume every worker and the API share.
    """
    service_settings = settings()
    try:
        from service.worker.celery_app import ping_worker, run_worker
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the Celery worker needs {error.name}: pip install 'edge-un[service]'"
        ) from None
    if check:
        if not ping_worker(service_settings, hostname):
            raise UsageError(f"worker {hostname or 'celery@<this host>'} did not answer a ping")
        return 0
    run_worker(service_settings, concurrency, hostname)
    return 0
