"""A burst of uploads: N clients, each with its own token, upload one conversion at the same
moment and wait for it. The slow test (tests/test_service_load.py) asserts that nothing was lost
or duplicated; ``benchmarks.service.service_load --burst N`` records how long the burst took."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .live import LiveServer, fast_job_files, upload_fast, wait_for


@dataclass(frozen=True)
class ClientRun:
    """One client's view: its upload's status, its job once finished, the ids it lists."""

    status: int
    job: dict[str, Any]
    listed: list[str]


@dataclass(frozen=True)
class Burst:
    clients: list[ClientRun]
    seconds: float  # from the first upload to the last client's job finished
    metrics: str  # GET /metrics once every client is done

    @property
    def job_ids(self) -> list[str]:
        return [run.job.get("id", "") for run in self.clients]


def concurrent_uploads(server: LiveServer, clients: int, timeout: float = 900) -> Burst:
    """``clients`` threads, each with its own token, upload ``upload_fast`` at once and wait
    until their job has succeeded (or ended otherwise: recorded, not raised)."""
    fast_job_files()  # build the inputs before the clock starts
    secrets = [server.token(f"client-{i}") for i in range(clients)]

    def client_run(secret: str) -> ClientRun:
        with server.client(secret) as client:
            response = upload_fast(client)
            if response.status_code != 202:
                return ClientRun(response.status_code, {}, [])
            job = wait_for(client, response.json()["id"], ("succeeded",), timeout=timeout)
            listed = [j["id"] for j in client.get("/v1/conversions").json()["items"]]
            return ClientRun(response.status_code, job, listed)

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(client_run, secrets))
    seconds = time.monotonic() - started
    return Burst(runs, seconds, server.client().get("/metrics").text)
