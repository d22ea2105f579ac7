"""A real edge-un service on this machine, for the tests and the benchmarks: the API server as
a uvicorn subprocess on a free 127.0.0.1 port with its own data directory and real job
processes, in either queue mode, and what a client does with it (upload, wait).

Two queue modes: ``local`` (the server's own job processes, SQLite) and ``celery`` (the API
only records and sends; ``edge-un worker`` processes convert; PostgreSQL and Redis from
:mod:`testbed.servers`). A celery-mode server's database, broker and workers belong to its
data directory, so a server started again on the same directory (after a kill -9) finds its
workers still running and its jobs where they were.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from service import tokens
from service.job_states import FINISHED
from service.settings import Settings

from .servers import PostgresServer, RedisServer, free_port

ROOT = Path(__file__).resolve().parents[1]  # the checkout: servers run its code

# Fast conversions on a shared 2-core machine: few latency runs, one thread per job.
FAST = {
    "EDGE_UN_LATENCY_RUNS": "3",
    "EDGE_UN_JOB_THREADS": "1",
    "EDGE_UN_POLL_INTERVAL_S": "0.2",
    "EDGE_UN_PROGRESS_INTERVAL_S": "0.2",
}
QUEUE_MODES = ("local", "celery")
# Celery mode: a lost worker's job is taken over after 3 missed beats (3 s, not 30).
CELERY_FAST = {"EDGE_UN_HEARTBEAT_S": "1"}


_BACKENDS: dict[Path, CeleryBackend] = {}
_REDIS_DBS = iter(range(1, 10_000))


class CeleryWorker:
    """``edge-un worker --concurrency 1`` in its own session (a kill takes its pool along)."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        command = [sys.executable, "-m", "service.cli", "worker", "--concurrency", "1",
                   "--hostname", f"{name}@%h"]  # fmt: skip
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log()}")
            if " ready." in self.log():
                return
            time.sleep(0.2)
        raise RuntimeError(f"worker {self.name} not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """kill -9 of the worker and its pool processes: a crashed machine, as far as it goes."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)  # warm shutdown
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        with contextlib.suppress(ProcessLookupError):  # a pool process left behind
            os.killpg(self.process.pid, signal.SIGKILL)


class CeleryBackend:
    """One data directory's PostgreSQL database, Redis database and workers."""

    def __init__(self, postgres: PostgresServer, redis: RedisServer) -> None:
        self.database_url = postgres.new_database()
        self.redis = redis
        self.redis_db = next(_REDIS_DBS) % 16  # Redis has 16; one server per test at once
        self.workers: list[CeleryWorker] = []
        import redis as redis_client

        redis_client.Redis.from_url(self.broker_url).flushdb()

    @property
    def broker_url(self) -> str:
        return self.redis.url.rsplit("/", 1)[0] + f"/{self.redis_db}"

    @classmethod
    def of(cls, data_dir: Path, postgres: PostgresServer, redis: RedisServer) -> CeleryBackend:
        key = data_dir.resolve()
        if key not in _BACKENDS:
            _BACKENDS[key] = cls(postgres, redis)
        return _BACKENDS[key]

    def env(self) -> dict[str, str]:
        return {
            **CELERY_FAST,
            "EDGE_UN_QUEUE": "celery",
            "EDGE_UN_BROKER_URL": self.broker_url,
            "EDGE_UN_DATABASE_URL": self.database_url,
        }

    def ensure_workers(self, count: int, env: dict[str, str], logs: Path) -> None:
        """At least ``count`` live workers (a server started again keeps the running ones)."""
        self.workers = [w for w in self.workers if w.alive()]
        while len(self.workers) < count:
            name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}"
            self.workers.append(CeleryWorker(name, env, logs / f"worker-{name}.log"))
        for worker in self.workers:
            worker.wait_ready()

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


class LiveServer:
    """``python -m service.server`` with settings from EDGE_UN_* variables; in celery mode,
    with its workers (one per EDGE_UN_WORKERS, each running one conversion at a time)."""

    def __init__(
        self,
        data_dir: Path,
        mode: str = "local",
        postgres: PostgresServer | None = None,
        redis: RedisServer | None = None,
        **env: str,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.mode = mode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**FAST, **env}
        self.backend: CeleryBackend | None = None
        if mode == "celery":
            if postgres is None or redis is None:
                raise ValueError("celery mode needs the postgres_server and redis_server")
            self.backend = CeleryBackend.of(self.data_dir, postgres, redis)
            self.env = {**self.backend.env(), **self.env}
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"

    @property
    def settings(self) -> Settings:
        values = {k[len("EDGE_UN_") :].lower(): v for k, v in self.env.items()}
        return Settings(data_dir=self.data_dir, **values)

    @property
    def workers(self) -> list[CeleryWorker]:
        return self.backend.workers if self.backend else []

    def _environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_UN_")}
        env.update(self.env, EDGE_UN_DATA_DIR=str(self.data_dir), PYTHONUNBUFFERED="1")
        return env

    def start(self, timeout: float = 90) -> LiveServer:
        command = [sys.executable, "-m", "service.server", "--host", "127.0.0.1",
                   "--port", str(self.port)]  # fmt: skip
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=self._environ(), stdout=log, stderr=log
        )
        log.close()
        if self.backend is not None:
            count = int(self.env.get("EDGE_UN_WORKERS", "1"))
            self.backend.ensure_workers(count, self._environ(), self.data_dir.parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        for worker in self.workers:
            text += f"\n--- worker {worker.name} ---\n" + worker.log()
        return text

    def kill(self) -> None:
        """kill -9 of the API process: no shutdown of any kind (celery workers carry on)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop the API, and in celery mode its workers."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.backend is not None:
            self.backend.stop()

    def token(self, name: str = "test") -> str:
        return tokens.create_token(self.settings, name)[1]

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # an idle connection is dropped after 2 s, before the server's 5 s (uvicorn's
        # keep-alive timeout; httpx's own is also 5 s, so a reused connection could be closed
        # by the server as a request went out on it)
        kwargs.setdefault("limits", httpx.Limits(keepalive_expiry=2.0))
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)


class ServiceMode:
    """A queue mode for the service tests: ``mode.server(data_dir, **env)`` makes the server."""

    def __init__(
        self, name: str, postgres: PostgresServer | None = None, redis: RedisServer | None = None
    ) -> None:
        self.name = name
        self.postgres = postgres
        self.redis = redis

    def server(self, data_dir: Path, **env: str) -> LiveServer:
        return LiveServer(data_dir, self.name, self.postgres, self.redis, **env)

    def __repr__(self) -> str:
        return self.name


def upload(
    client: httpx.Client, model: Path, *, targets: str = "cpu", **extra: Any
) -> httpx.Response:
    data = {"targets": targets, **{k: str(v) for k, v in extra.items()}}
    with model.open("rb") as stream:
        return client.post("/v1/conversions", files={"model": (model.name, stream)}, data=data)


def wait_for(
    client: httpx.Client,
    job_id: str,
    states: tuple[str, ...] = FINISHED,
    timeout: float = 240,
    stage_not_in: tuple[str | None, ...] = (),
) -> dict[str, Any]:
    """Poll a job until its state is one of ``states`` (and, if asked, its stage is past)."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            job = client.get(f"/v1/conversions/{job_id}").json()
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # the server closed an idle keep-alive connection as this GET reused it (uvicorn
            # closes them after 5 s; a poller starved of CPU for longer meets it): ask again
            time.sleep(0.3)
            continue
        if job["state"] in states and job["stage"] not in stage_not_in:
            return job
        if job["state"] in FINISHED and job["state"] not in states:
            raise AssertionError(f"job ended {job['state']}, waited for {states}: {job}")
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not {states} after {timeout} s: {job}")


@functools.cache
def fast_job_files() -> dict[str, Path]:
    """A quick conversion's inputs: the UN ViT example as a folded fp32 ONNX file (no torch
    export in the job), 32 calibration and 100 evaluation samples of its own data set."""
    import numpy as np
    import torch

    from converters.fold_and_export import export_folded, load_and_fold
    from edge_un import examples, load_checkpoint
    from quant.samples import checkpoint_samples

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="edge-un-fast-job-"))
    atexit.register(shutil.rmtree, folder, True)
    source = examples.path("vit-mnist-un")
    export_folded(load_and_fold(source), folder / "vit.onnx", opset=21, dynamic_batch=True)
    _, info = load_checkpoint(source)
    train, test = checkpoint_samples(info, "train", 32), checkpoint_samples(info, "test")
    np.savez(folder / "calib.npz", inputs=train.inputs, labels=train.labels)
    np.savez(folder / "eval.npz", inputs=test.inputs[:100], labels=test.labels[:100])
    return {
        "model": folder / "vit.onnx",
        "calib": folder / "calib.npz",
        "eval": folder / "eval.npz",
    }


def upload_fast(client: httpx.Client, *, targets: str = "cpu") -> httpx.Response:
    files = fast_job_files()
    with contextlib.ExitStack() as stack:
        parts = {k: (p.name, stack.enter_context(p.open("rb"))) for k, p in files.items()}
        return client.post("/v1/conversions", files=parts, data={"targets": targets})
