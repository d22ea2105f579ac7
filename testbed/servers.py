"""Real PostgreSQL and Redis servers on this machine, each an ordinary process in its own
temporary directory on a free 127.0.0.1 port.

Why real servers and not fakes: the Celery mode rests on what only the real ones do (a
conditional UPDATE racing another transaction in PostgreSQL, an append-only file that Redis
replays after a restart). The tests start them as session fixtures (tests/servers.py), the
service-load benchmark for its run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"  # the OS user the server runs as when we are root (postgres refuses root)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


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


class Server:
    """A server process in its own temporary directory, on a free port: ``start`` (in each
    subclass) on the same port and directory every time, ``stop`` with the subclass's
    ``STOP_SIGNAL``, ``cleanup`` that also removes the directory."""

    STOP_SIGNAL = signal.SIGTERM

    def __init__(self, prefix: str, log: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.log = self.root / log
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        _terminate(self.process, self.STOP_SIGNAL)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PostgresServer(Server):
    """A PostgreSQL 15 cluster in a temporary directory: trust auth on loopback, superuser
    ``postgres``, unix socket inside the directory (never /var/run/postgresql)."""

    # Fast shutdown (SIGINT: roll back open transactions, close sessions, stop).
    STOP_SIGNAL = signal.SIGINT

    def __init__(self, bin_dir: Path = PG_BIN) -> None:
        super().__init__("edge-un-pg-", "postgres.log")
        self.bin_dir = bin_dir
        self.data = self.root / "data"
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
        if self.running:
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


class RedisServer(Server):
    """redis-server in a temporary directory, append-only file on (fsync every second) and no
    RDB snapshots: what survives a restart is what the AOF holds, as in production."""

    # Graceful shutdown (SIGTERM: redis fsyncs the AOF, then exits).
    STOP_SIGNAL = signal.SIGTERM

    def __init__(self, binary: str) -> None:
        super().__init__("edge-un-redis-", "redis.log")
        self.binary = binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on the same port and directory as before, so it replays the same AOF."""
        if self.running:
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

    def kill(self) -> None:
        """SIGKILL, as a crash: writes of the last second may be lost (appendfsync everysec).
        ``start()`` brings it back."""
        _terminate(self.process, signal.SIGKILL)
        self.process = None
