"""The FastAPI application: the API (/v1, problem+json errors) and the web page (/ui) side by
side over the same services, and the job queue's lifetime."""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from ..db import upgrade
from ..settings import Settings
from ..storage import make_store
from ..worker.queue import JobQueue, make_queue
from .api import conversions, openapi, problems, system
from .metrics import Metrics
from .services import Services
from .web import routes as pages

log = logging.getLogger("edge_un.api")


def create_app(settings: Settings, queue: JobQueue | None = None) -> FastAPI:
    """The service for these settings. The queue starts with the app (after the database is
    migrated and jobs a dead server left running are recovered) and stops with it."""
    services = Services(
        settings=settings,
        store=make_store(settings),
        queue=queue or make_queue(settings),
        metrics=Metrics(settings),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(upgrade, settings)
        if settings.auth == "none":
            log.warning(
                "AUTHENTICATION IS OFF (EDGE_UN_AUTH=none): anyone who reaches this "
                "server can upload, read and delete jobs; use it only locally"
            )
        await anyio.to_thread.run_sync(services.queue.start)
        # Upload checks build the uploaded model with torch (service.server.uploads): import
        # it now, beside serving, so the first upload does not wait seconds for it.
        threading.Thread(target=importlib.import_module, args=("edge_un",), daemon=True).start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(services.queue.stop)

    app = FastAPI(
        title="edge-un conversion service",
        # from the package metadata: importing edge_un would load torch into the API process
        version=importlib.metadata.version("edge-un"),
        description="Upload a Transformer checkpoint; get int8 artifacts for edge targets, "
        "with a report of the accuracy they cost and how fast they run.",
        lifespan=lifespan,
    )
    app.state.services = services
    problems.install(app)  # the app's handlers: errors outside the page's routes are the API's
    openapi.install(app)
    routers = [conversions.router, system.router, pages.router, pages.root]  # /ui: no OpenAPI
    for router in routers:
        app.include_router(router)
    # every route, flat, for the Allow header of a 405 (FastAPI nests included routers)
    app.state.flat_routes = [*app.router.routes, *(r for router in routers for r in router.routes)]
    return app
