"""Accepting a conversion: stream the form's files to disk, check everything, queue the job.

Nothing is queued until every check passed: the form's fields, the targets (by name, against
``quant.targets``), the drift bar, and the files' contents (``service.inspect``, by content).
A refused request leaves nothing behind. Files get server-chosen names (the client's names are
labels); the model's suffix is the format its content showed, which is what the pipeline reads.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from . import jobs
from .api.multipart import MultipartReader, boundary_of
from .db import Job, session_scope
from .inspect import inspect_config, inspect_model, inspect_npz
from .metrics import Metrics
from .problems import Problem
from .settings import Settings
from .storage import ArtifactStore
from .uploads import UploadRejected, safe_label, save_upload

log = logging.getLogger("edge_un.intake")
FILE_FIELDS = ("model", "config", "calib", "eval")
TEXT_FIELDS = ("targets", "max_drift")
SUFFIXES = {"config": "json", "calib": "npz", "eval": "npz"}
DRAIN_BYTES = 256 * 1024 * 1024  # after refusing, read this much more so the client sees why
MAX_DRIFT_LIMIT = 100.0


@dataclass
class Form:
    labels: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def parse_targets(text: str | None) -> str:
    """ "cpu, imx93" -> "cpu,imx93"; blank or "all" -> every target, named (the job then says
    what it builds); 422 if unknown."""
    from quant.errors import UnknownTargetError
    from quant.targets import parse_targets as profiles

    try:
        return ",".join(p.name for p in profiles(text))
    except UnknownTargetError as error:
        raise Problem(422, f"{error} (GET /v1/targets describes each)", "Unknown target") from None


def parse_max_drift(text: str | None) -> float:
    from quant.targets import DEFAULT_MAX_DRIFT

    if text is None or not text.strip():
        return DEFAULT_MAX_DRIFT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_DRIFT_LIMIT:
        raise Problem(
            422,
            f"max_drift must be a number of top-1 points from 0 to {MAX_DRIFT_LIMIT:g} (the "
            f"accuracy an int8 file may lose), e.g. 0.5; got {text[:40]!r}",
            "Bad max_drift",
        )
    return value


async def _counted(chunks: AsyncIterator[bytes], metrics: Metrics, name: str):
    counter = metrics.upload_bytes.labels(name)
    async for chunk in chunks:
        counter.inc(len(chunk))
        yield chunk


async def receive(reader: MultipartReader, dest: Path, max_bytes: int, metrics: Metrics) -> Form:
    """Read every part of the form: files to ``dest/<field>``, small fields as text."""
    form = Form()
    async for part in reader.parts():
        if part.name in form.labels or part.name in form.texts:
            raise Problem(400, f"the form field {part.name!r} is given twice; send it once")
        if part.name in FILE_FIELDS:
            form.labels[part.name] = safe_label(part.filename, part.name)
            chunks = _counted(reader.data(), metrics, part.name)
            form.sizes[part.name] = await save_upload(
                chunks, dest / part.name, max_bytes, part.name
            )
        elif part.name in TEXT_FIELDS:
            form.texts[part.name] = await reader.text(part.name)
        else:
            raise Problem(
                400,
                f"unknown form field {part.name[:40]!r}; the fields are "
                f"{', '.join(FILE_FIELDS + TEXT_FIELDS)}",
            )
    if "model" not in form.labels:
        raise Problem(
            422,
            "the form has no 'model' file: send the checkpoint as the 'model' "
            "field (curl -F model=@model.safetensors ...)",
            "Missing model",
        )
    return form


def check_files(form: Form, dest: Path) -> str:
    """Content checks (blocking: run in a thread); the files renamed for the pipeline.
    Returns the model's format. A check that fails unexpectedly still refuses the upload
    (a 422, logged): nothing a client sends may become a 5xx."""
    try:
        return _check_files(form, dest)
    except UploadRejected:
        raise
    except Exception as error:
        log.exception("a content check failed unexpectedly")
        raise UploadRejected(
            422,
            "Unreadable upload",
            f"the uploaded files could not be checked ({type(error).__name__}); send a model "
            "in one of the supported formats (.safetensors, .pt/.pth with config, .pt2, .onnx)",
        ) from None


def _check_files(form: Form, dest: Path) -> str:
    config = inspect_config(dest / "config") if "config" in form.labels else None
    model = inspect_model(dest / "model", config)
    for name in ("calib", "eval"):
        if name in form.labels:
            inspect_npz(dest / name, name)  # type: ignore[arg-type]
    (dest / "model").rename(dest / f"model.{model.format}")
    for name, suffix in SUFFIXES.items():
        if name in form.labels:
            (dest / name).rename(dest / f"{name}.{suffix}")
    return model.format


async def _drain(body: AsyncIterator[bytes]) -> None:
    """Read (and drop) what the client is still sending, so it reads our answer instead of a
    reset connection; bounded, so a huge body is cut off anyway."""
    left = DRAIN_BYTES
    with anyio.move_on_after(30), contextlib.suppress(Exception):
        async for chunk in body:
            left -= len(chunk)
            if left < 0:
                return


async def accept(
    body: AsyncIterator[bytes],
    content_type: str | None,
    content_length: str | None,
    token_id: int | None,
    settings: Settings,
    store: ArtifactStore,
    metrics: Metrics,
) -> Job:
    """A queued job for this request, or a Problem/UploadRejected (and nothing kept)."""
    boundary = boundary_of(content_type)
    limit = settings.max_upload_bytes
    if content_length and content_length.isdigit() and int(content_length) > 4 * limit + (1 << 20):
        metrics.uploads.labels("rejected").inc()
        raise UploadRejected(
            413,
            "Upload too large",
            f"the request is {int(content_length):,} "
            f"bytes, more than 4 files of the {settings.max_upload_mb:g} MB "
            "limit (EDGE_UN_MAX_UPLOAD_MB); send smaller files",
        )
    job_id = jobs.new_job_id()
    dest = store.upload_dir(job_id)
    try:
        form = await receive(MultipartReader(body, boundary), dest, limit, metrics)
        targets = parse_targets(form.texts.get("targets"))
        max_drift = parse_max_drift(form.texts.get("max_drift"))
        model_format = await anyio.to_thread.run_sync(check_files, form, dest)
        request = jobs.NewJob(
            token_id=token_id,
            targets=targets,
            max_drift=max_drift,
            model_format=model_format,
            model_label=form.labels["model"],
            config_label=form.labels.get("config"),
            calib_label=form.labels.get("calib"),
            eval_label=form.labels.get("eval"),
            upload_bytes=sum(form.sizes.values()),
        )
        job = await anyio.to_thread.run_sync(_create, settings, job_id, request)
    except BaseException as error:
        store.delete_uploads(job_id)
        if isinstance(error, Problem | UploadRejected):
            metrics.uploads.labels("rejected").inc()
            await _drain(body)
        raise
    metrics.uploads.labels("accepted").inc()
    return job


def _create(settings: Settings, job_id: str, request: jobs.NewJob) -> Job:
    with session_scope(settings) as session:
        return jobs.create(session, job_id, request)
