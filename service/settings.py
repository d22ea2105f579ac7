"""Settings of the HTTP service and its job processes, from the environment (prefix EDGE_UN_).

``edge-un serve`` and ``edge-un token ...`` read the same settings, so a token created with the
same ``EDGE_UN_DATA_DIR`` (or ``EDGE_UN_DATABASE_URL``) is valid against that server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Room for the boards' real Transformers: BERT-base is 110 M parameters, ViT-B/16 86 M.
DEFAULT_MAX_PARAMETERS = 200_000_000
# A 110 M-parameter fp32 model is ~440 MB as safetensors or ONNX: twice that, with room.
DEFAULT_MAX_UPLOAD_MB = 1024


class Settings(BaseSettings):
    """Everything the service reads from its environment; every field is ``EDGE_UN_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="EDGE_UN_", extra="ignore")

    data_dir: Path = Path("./edge-un-data")
    database_url: str | None = None  # default sqlite:///{data_dir}/edge-un.db
    max_upload_mb: float = Field(DEFAULT_MAX_UPLOAD_MB, gt=0)  # each uploaded file
    max_parameters: int = Field(DEFAULT_MAX_PARAMETERS, ge=1)  # of an uploaded model
    workers: int = Field(1, ge=1)  # concurrent conversion processes
    # Local queue: a job's targets built at once, each in a process of its own (their memory adds
    # up: benchmarks/results/celery_scale.md); Celery mode spreads them over its workers instead.
    job_parallel: int = Field(1, ge=1)
    job_timeout_s: float = Field(1800, gt=0)
    # Address-space limit of a job process (0 = none). Address space, not resident memory: torch,
    # ONNX Runtime and TensorFlow reserve far more than they touch. BERT-base (110 M parameters)
    # ran out at 6144 MB while writing its opset-17 copy; its largest process peaks at 8.5 GB of
    # address space, ViT-B/16's at 7.7 GB (benchmarks/results/hf_scale.md): 12288 leaves 44 %.
    job_memory_mb: int = Field(12288, ge=0)
    max_attempts: int = Field(2, ge=1)  # runs of a job interrupted by a server crash
    # Jobs one token may have waiting to start; one more is answered 429 with Retry-After.
    max_queued: int = Field(50, ge=1)
    auth: Literal["tokens", "none"] = "tokens"
    # The address people reach the service at, e.g. https://edge-un.example.com behind a TLS
    # proxy: uvicorn sees the proxy's plain-HTTP request, so the web page's Origin check and
    # its cookies' Secure flag need to be told. None: the address of each request as it arrives.
    public_url: str | None = None
    # "local": the embedded queue (job processes of the API server, nothing else to run);
    # "celery": the API only records and sends; `edge-un worker` processes convert.
    queue: Literal["local", "celery"] = "local"
    broker_url: str | None = None  # Celery's broker, e.g. redis://redis:6379/0
    heartbeat_s: float = Field(10, gt=0)  # a running Celery job proves it is alive this often
    latency_runs: int = Field(100, ge=1)  # passed to quant.convert
    # Beyond the shared design: knobs the tests and small machines need.
    job_threads: int | None = Field(None, ge=1)  # torch/ORT threads per job; None = default
    progress_interval_s: float = Field(0.5, ge=0)  # least time between progress writes
    poll_interval_s: float = Field(0.5, gt=0)  # dispatcher tick when nothing wakes it

    @field_validator("public_url")
    @classmethod
    def _an_origin(cls, value: str | None) -> str | None:
        if not value:
            return None
        url = urlsplit(value.strip())
        try:
            url.port  # noqa: B018 (read to check it: urlsplit parses the port lazily)
        except ValueError:
            url = url._replace(scheme="")  # refused just below
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(
                f"EDGE_UN_PUBLIC_URL {value[:80]!r} is not an address people open: give "
                "https://HOST (or http://HOST:PORT)"
            )
        return value.strip()

    @property
    def public_origin(self) -> str | None:
        """EDGE_UN_PUBLIC_URL as a browser's Origin header names it (scheme://host[:port],
        lower case, no default port, no path), or None when it is not set."""
        if self.public_url is None:
            return None
        url = urlsplit(self.public_url)
        port = url.port
        default = {"http": 80, "https": 443}[url.scheme]
        host = url.hostname or ""
        host = f"[{host}]" if ":" in host else host  # an IPv6 address, as Origin writes it
        return f"{url.scheme}://{host}" + ("" if port in (None, default) else f":{port}")

    @model_validator(mode="after")
    def _celery_needs_a_broker(self) -> Settings:
        if self.queue == "celery" and not self.broker_url:
            raise ValueError(
                "EDGE_UN_QUEUE=celery needs EDGE_UN_BROKER_URL (e.g. redis://localhost:6379/0)"
            )
        return self

    @property
    def lease_s(self) -> float:
        """How long a running Celery job may go without a heartbeat before it counts as lost
        (its worker died): three missed beats, so one slow database write is not enough."""
        return 3 * self.heartbeat_s

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir.resolve() / 'edge-un.db'}"

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def as_environ(self) -> dict[str, str]:
        """These settings as EDGE_UN_* variables, for a job process to read back exactly."""
        environ = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if name == "data_dir":
                value = Path(value).resolve()
            environ[f"EDGE_UN_{name.upper()}"] = str(value)
        return environ


def get_settings() -> Settings:
    """The settings the environment gives (read anew each call: tests change the environment)."""
    return Settings()
