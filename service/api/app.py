"""The FastAPI application: routes, problem+json errors, and the job queue's lifetime."""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from ..db import upgrade
from ..metrics import Metrics
from ..queue import JobQueue, make_queue
from ..services import Services
from ..settings import Settings
from ..storage import make_store
from ..web import routes as web
from . import conversions, openapi, problems, system

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
        # Upload checks build the uploaded model with torch (service.model_checks): import it
        # now, beside serving, so the first upload does not wait seconds for it.
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
    problems.install(app)
    openapi.install(app)
    app.include_router(conversions.router)
    app.include_router(system.router)
    app.include_router(web.router)  # the web page for people (/ui), outside the OpenAPI document
    app.include_router(web.root)
    # every route, flat, for the Allow header of a 405 (FastAPI nests included routers)
    app.state.flat_routes = [
        *app.router.routes,
        *conversions.router.routes,
        *system.router.routes,
        *web.router.routes,
        *web.root.routes,
    ]
    return app
