"""The service as real processes on this machine: the API server (``python -m service.server``)
on a free 127.0.0.1 port with its own data directory, and in Celery mode a real PostgreSQL 15
and Redis (each an ordinary process in a temporary directory, on a free port) with ``edge-un
worker`` processes. What the service's tests and the load benchmark (``benchmarks.service_load``)
start and talk to over HTTP; the service itself never imports this module.

Why real servers and not fakes: the Celery mode rests on what only the real ones do (a
conditional UPDATE racing another transaction in PostgreSQL, an append-only file that Redis
replays after a restart). A Celery-mode server's database, broker and workers belong to its data
directory, so a server started again on the same directory (after a kill -9) finds its workers
still running and its jobs where they were.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from . import tokens
from .job_states import FINISHED
from .settings import Settings

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"  # the OS user the server runs as when we are root (postgres refuses root)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
# Fast conversions on a shared 2-core machine: few latency runs, one thread per job (what a
# LiveServer runs with unless its own settings say otherwise).
FAST_SETTINGS = {
    "EDGE_UN_LATENCY_RUNS": "3",
    "EDGE_UN_JOB_THREADS": "1",
    "EDGE_UN_POLL_INTERVAL_S": "0.2",
    "EDGE_UN_PROGRESS_INTERVAL_S": "0.2",
}
# Celery mode: a lost worker's job is taken over after 3 missed beats (3 s, not 30).
FAST_CELERY_SETTINGS = {"EDGE_UN_HEARTBEAT_S": "1"}
QUEUE_MODES = ("local", "celery")
# The directory holding the service package: its processes start there, so that
# ``python -m service...`` runs this same code.
_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later; a clash is unlikely
    and shows as a clear start-up error with the server's log)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as error:
        return f"(no log: {error})"


def _wait_until(ready: Callable[[], bool], process: subprocess.Popen, what: str, log: Path) -> None:
    """Poll ``ready`` until it holds; raise with the server's log if the process exits or the
    time runs out (a bare timeout would hide why the server did not come up)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {process.returncode} while starting; its log:\n"
                + _log_tail(log)
            )
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S} s; its log:\n" + _log_tail(log))


def _terminate(process: subprocess.Popen | None, sig: signal.Signals = signal.SIGTERM) -> None:
    """Send ``sig`` and wait; SIGKILL if the process does not stop in time."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class PostgresServer:
    """A PostgreSQL 15 cluster in a temporary directory: trust auth on loopback, superuser
    ``postgres``, unix socket inside the directory (never /var/run/postgresql)."""

    def __init__(self, bin_dir: Path = PG_BIN) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="edge-un-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, PG_USER, PG_USER)

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the ``postgres`` database."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def _user_args(self) -> dict[str, object]:
        """Run as the postgres OS user when we are root (postgres refuses to run as root)."""
        if not self._as_root:
            return {}
        return {"user": PG_USER, "group": PG_USER, "extra_groups": []}

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            argv, cwd=self.root, capture_output=True, text=True, **self._user_args()
        )
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}):\n{result.stderr}")

    def _initdb(self) -> None:
        argv = [str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres"]
        self._run([*argv, "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-sync"])

    def start(self) -> None:
        """Start the server on its port and data directory (made on the first start)."""
        if self.process is not None and self.process.poll() is None:
            return
        if not self.data.exists():
            self._initdb()
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.root),
            # A throwaway cluster on a shared 2-core machine: durability buys nothing here.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "32MB",
            "max_connections": "60",
            # Not UTC, and an odd offset (+12:45/+13:45): a timestamp that goes through the
            # server's zone anywhere shows up as wrong by hours, not passing by luck.
            "timezone": "Pacific/Chatham",
        }
        argv = [str(self.bin_dir / "postgres"), "-D", str(self.data)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **self._user_args(),
            )
        _wait_until(self._accepts, self.process, "postgres", self.log)

    def connect(self, dbname: str = "postgres"):
        """A psycopg connection (autocommit) to the database ``dbname`` as the superuser: for
        what the service's own connections do not do (statistics, creating databases)."""
        import psycopg  # lazily: importing this module must not need the service extra

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=dbname,
            connect_timeout=2,
            autocommit=True,
        )

    def _accepts(self) -> bool:
        """True once a query runs (the port opens before the server leaves recovery)."""
        try:
            with self.connect() as connection:
                connection.execute("SELECT 1")
            return True
        except Exception:
            return False

    def new_database(self, name: str | None = None) -> str:
        """Create an empty database (a unique name unless given) and return its URL."""
        name = name or f"edge_un_{uuid.uuid4().hex[:12]}"
        with self.connect() as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    def drop_database(self, url: str) -> None:
        """Drop a database made by new_database, closing whatever still holds it open."""
        name = url.rsplit("/", 1)[1]
        with self.connect() as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, close sessions, stop)."""
        _terminate(self.process, signal.SIGINT)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """redis-server in a temporary directory, append-only file on (fsync every second) and no
    RDB snapshots: what survives a restart is what the AOF holds, as in production."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="edge-un-redis-"))
        self.log = self.root / "redis.log"
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on the same port and directory as before, so it replays the same AOF."""
        if self.process is not None and self.process.poll() is None:
            return
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.root), "--appendonly", "yes", "--appendfsync", "everysec"]
        argv += ["--save", "", "--protected-mode", "no", "--daemonize", "no"]
        argv += ["--logfile", str(self.log)]
        self.process = subprocess.Popen(
            argv, cwd=self.root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        _wait_until(self._pong, self.process, "redis-server", self.log)

    def _pong(self) -> bool:
        """True once PING answers PONG (while replaying the AOF, redis answers -LOADING)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM: redis fsyncs the AOF, then exits)."""
        _terminate(self.process, signal.SIGTERM)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash: writes of the last second may be lost (appendfsync everysec).
        ``start()`` brings it back."""
        _terminate(self.process, signal.SIGKILL)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


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
                command, cwd=_SOURCE_ROOT, env=env, stdout=log, stderr=log, start_new_session=True
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
            **FAST_CELERY_SETTINGS,
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
    """``python -m service.server`` with settings from EDGE_UN_* variables (``FAST_SETTINGS``
    unless ``env`` says otherwise); in celery mode, with its workers (one per EDGE_UN_WORKERS,
    each running one conversion at a time)."""

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
        self.env = {**FAST_SETTINGS, **env}
        self.backend: CeleryBackend | None = None
        if mode == "celery":
            if postgres is None or redis is None:
                raise ValueError("celery mode needs a PostgresServer and a RedisServer")
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
            command, cwd=_SOURCE_ROOT, env=self._environ(), stdout=log, stderr=log
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
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)


class ServiceMode:
    """A queue mode: ``mode.server(data_dir, **env)`` makes the server (``celery`` needs the
    PostgreSQL and Redis servers its backends use)."""

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


class JobWaitError(AssertionError):
    """A job did not reach the state waited for: it ended in another, or time ran out. An
    AssertionError, so a test that waits fails as a failed assertion does."""


def upload(
    client: httpx.Client, model: Path, *, targets: str = "cpu", **extra: Any
) -> httpx.Response:
    """POST /v1/conversions with ``model`` as the upload, as a user's client does."""
    data = {"targets": targets, **{k: str(v) for k, v in extra.items()}}
    with model.open("rb") as stream:
        return client.post("/v1/conversions", files={"model": (model.name, stream)}, data=data)


def wait_for(
    client: httpx.Client,
    job_id: str,
    states: tuple[str, ...] = tuple(sorted(FINISHED)),
    timeout: float = 240,
    stage_not_in: tuple[str | None, ...] = (),
) -> dict[str, Any]:
    """Poll a job until its state is one of ``states`` (and, if asked, its stage is past);
    JobWaitError if it finishes in another state or ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/conversions/{job_id}").json()
        if job["state"] in states and job["stage"] not in stage_not_in:
            return job
        if job["state"] in FINISHED and job["state"] not in states:
            raise JobWaitError(f"job ended {job['state']}, waited for {states}: {job}")
        time.sleep(0.3)
    raise JobWaitError(f"job {job_id} not {states} after {timeout} s: {job}")


@functools.cache
def fast_job_files() -> dict[str, Path]:
    """A quick conversion's inputs: the UN ViT example as a folded fp32 ONNX file (no torch
    export in the job), 32 calibration and 100 evaluation samples of its own data set."""
    import numpy as np
    import torch

    from converters.pipeline import export_folded, load_and_fold
    from edge_un import examples, load_checkpoint
    from quant.data import checkpoint_samples

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
    """POST /v1/conversions with ``fast_job_files``: a quick conversion of the UN ViT."""
    files = fast_job_files()
    with contextlib.ExitStack() as stack:
        parts = {k: (p.name, stack.enter_context(p.open("rb"))) for k, p in files.items()}
        return client.post("/v1/conversions", files=parts, data={"targets": targets})
