"""The API's wire format (pydantic): what the server answers and the client (``service.client``)
reads, kept apart from the database records."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from converters.source import ModelFormat

from .job_states import ENDED, State, stage_label

if TYPE_CHECKING:  # the records only feed the .of()s: clients import these without a database
    from .db import Job
    from .storage import ArtifactInfo


class Inputs(BaseModel):
    """The uploaded files by their client-side names (labels only) and the model's format."""

    model: str
    model_format: ModelFormat
    config: str | None
    calib: str | None
    eval: str | None
    bytes: int


class JobOut(BaseModel):
    id: str
    state: State
    stage: str | None = Field(description="what the job is doing now (running) or did last")
    target: str | None = Field(
        default=None, description="the edge target that stage works for (none: the whole run)"
    )
    percent: float = Field(ge=0, le=100)
    error: str | None = Field(
        description="why it failed or was cancelled, or which targets failed and why when it "
        "is partial (one line)"
    )
    targets: list[str] = Field(description="the targets it builds (every one unless named)")
    max_drift: float
    inputs: Inputs
    attempts: int = Field(description="runs started (a server crash may interrupt a run)")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    links: dict[str, str]

    @classmethod
    def of(cls, job: Job, base: str) -> JobOut:
        url = f"{base}/v1/conversions/{job.id}"
        links = {"self": url}
        if job.state in ENDED:
            links |= {
                "report": f"{url}/report",
                "report_html": f"{url}/report.html",
                "artifacts": f"{url}/artifacts",
                "bundle": f"{url}/bundle.zip",
            }
        return cls(
            id=job.id,
            state=job.state,  # type: ignore[arg-type]
            stage=stage_label(job),
            target=job.target,
            percent=job.percent,
            error=job.error,
            targets=list(job.targets),
            max_drift=job.max_drift,
            inputs=Inputs(
                model=job.model_label,
                model_format=job.model_format,  # type: ignore[arg-type]
                config=job.config_label,
                calib=job.calib_label,
                eval=job.eval_label,
                bytes=job.upload_bytes,
            ),
            attempts=job.attempts,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            updated_at=job.updated_at,
            links=links,
        )


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(description="the next page, newest first; None on the last")


class ArtifactOut(BaseModel):
    name: str = Field(description="path relative to the job's output, e.g. cpu/model_int8.onnx")
    bytes: int
    sha256: str
    url: str

    @classmethod
    def of(cls, info: ArtifactInfo, job_id: str, base: str) -> ArtifactOut:
        url = f"{base}/v1/conversions/{job_id}/artifacts/{info.name}"
        return cls(name=info.name, bytes=info.bytes, sha256=info.sha256, url=url)


class TargetOut(BaseModel):
    name: str
    board: str
    runtime: str
    opset: int
    static_batch: bool
    rules: list[str]
    notes: str


class Health(BaseModel):
    status: Literal["ok"]


class ProblemDetails(BaseModel):
    """RFC 9457 problem details: every error this API returns."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
