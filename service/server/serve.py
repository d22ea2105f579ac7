"""``serve(settings, host, port)``: migrate the database, then run the API with uvicorn
(the app recovers interrupted jobs and starts the queue as it starts).

``python -m service.server --host 127.0.0.1 --port 8000`` runs it with settings from the
environment (EDGE_UN_*), which is also what ``edge-un serve`` does.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from ..db import upgrade
from ..settings import Settings, get_settings
from .app import create_app

log = logging.getLogger("edge_un.server")


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    upgrade(settings)
    if settings.auth == "none":
        log.warning("EDGE_UN_AUTH=none: the API accepts requests WITHOUT a token")
    log.info(
        "edge-un service on http://%s:%d (data in %s, %d worker(s))",
        host,
        port,
        settings.data_dir.resolve(),
        settings.workers,
    )
    uvicorn.run(
        create_app(settings), host=host, port=port, log_level="info", timeout_graceful_shutdown=20
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m service.server", description="Run the edge-un HTTP conversion service."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    serve(get_settings(), args.host, args.port)


if __name__ == "__main__":
    main()
