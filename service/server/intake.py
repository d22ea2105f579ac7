"""Accepting a conversion: stream the form's files to disk, check everything, queue the job.

Nothing is queued until every check passed: the form's fields, the targets (by name, against
``quant.targets``), the drift bar, and the files' contents (``service.server.uploads.checks``, by
content). A refused request raises :class:`~service.errors.UploadRejected` and leaves nothing
behind. Files get server-chosen names, their form fields' (the client's names are labels); the
model's format is what its content showed, recorded with the job (``upload_layout.stored_model``).
The one exception is ``model_data`` (repeatable): an ONNX model's external data files, which the
model refers to by name, so each is stored beside it under exactly the name it references.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from sqlalchemy.orm import Session

from quant.targets import TargetProfile

from .. import jobs
from ..db import Job, session_scope
from ..errors import Refusal, UploadRejected, malformed
from ..settings import DEFAULT_MAX_PARAMETERS, Settings
from ..storage import ArtifactStore
from ..upload_layout import FILE_FIELDS, HF_DIRECTORY
from .metrics import Metrics
from .services import Services
from .uploads.checks import ModelUpload, inspect_config, inspect_model, inspect_npz
from .uploads.files import (
    DATA_FIELD,
    MAX_DATA_FILES,
    data_file_name,
    safe_label,
    save_upload,
)
from .uploads.multipart import MultipartReader, boundary_of

log = logging.getLogger("edge_un.intake")
TEXT_FIELDS = ("targets", "max_drift")
# What the other files are stored under in a job's upload directory: a model_data file may not
# take one of these names.
STORED_NAMES = frozenset([*FILE_FIELDS, HF_DIRECTORY])
# All files of one request together: at most this many of EDGE_UN_MAX_UPLOAD_MB (4: a model, a
# config and two data files at the limit each; the model's external data counts in this too).
MAX_REQUEST_FILES = 4
DRAIN_BYTES = 256 * 1024 * 1024  # after refusing, read this much more so the client sees why
# A token over its queue (EDGE_UN_MAX_QUEUED) may ask again after this long: a minute frees a
# place in the queue of a busy service, and polling sooner would only load it.
RETRY_AFTER_S = 60
MAX_DRIFT_LIMIT = 100  # top-1 points: all of them


@dataclass
class Form:
    labels: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    data_files: dict[str, int] = field(default_factory=dict)  # model_data: stored name -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values()) + sum(self.data_files.values())


def form_targets(text: str | None) -> tuple[TargetProfile, ...]:
    """ "cpu, imx93" -> those profiles; blank or "all" -> every target this installation can
    build (the job then names what it builds); refused if unknown or not buildable here."""
    from quant.availability import TargetUnavailableError, targets_to_build
    from quant.errors import UnknownTargetError

    try:
        profiles, _ = targets_to_build(text)
    except UnknownTargetError as error:
        raise UploadRejected(
            Refusal.UNUSABLE, "Unknown target", f"{error} (GET /v1/targets describes each)"
        ) from None
    except TargetUnavailableError as error:
        raise UploadRejected(Refusal.UNUSABLE, "Target not available", str(error)) from None
    return profiles


def parse_max_drift(text: str | None) -> float:
    from quant.measure.bars import DEFAULT_MAX_DRIFT

    if text is None or not text.strip():
        return DEFAULT_MAX_DRIFT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_DRIFT_LIMIT:
        raise UploadRejected(
            Refusal.UNUSABLE,
            "Bad max_drift",
            f"max_drift must be a number of top-1 points from 0 to {MAX_DRIFT_LIMIT:g} (the "
            f"accuracy an int8 file may lose), e.g. {DEFAULT_MAX_DRIFT:g}; got {text[:40]!r}",
        )
    return value


async def _counted(chunks: AsyncIterator[bytes], metrics: Metrics, name: str):
    counter = metrics.upload_bytes.labels(name)
    async for chunk in chunks:
        counter.inc(len(chunk))
        yield chunk


async def receive(
    reader: MultipartReader, dest: Path, max_bytes: int, metrics: Metrics, browser: bool = False
) -> Form:
    """Read every part of the form: files to ``dest/<field>`` (model_data files to
    ``dest/<their name>``), small fields as text. ``browser``: the web page's form, as a
    browser sends it: a file input left empty is a part with an empty file name (skipped),
    and each ticked target checkbox is a ``targets`` part of its own (joined)."""
    form = Form()
    total_limit = MAX_REQUEST_FILES * max_bytes
    async for part in reader.parts():
        if browser and part.filename == "":
            continue  # parts() skips its (empty) data
        if browser and part.name == "targets" and "targets" in form.texts:
            form.texts["targets"] += "," + await reader.text(part.name)
            continue
        if part.name in form.labels or part.name in form.texts:
            raise malformed(f"the form field {part.name!r} is given twice; send it once")
        if part.name in FILE_FIELDS:
            form.labels[part.name] = safe_label(part.filename, part.name)
            chunks = _counted(reader.data(), metrics, part.name)
            form.sizes[part.name] = await _save(
                chunks, dest / part.name, part.name, max_bytes, total_limit - form.total_bytes
            )
        elif part.name == DATA_FIELD:
            name = data_file_name(part.filename, DATA_FIELD, STORED_NAMES)
            if name in form.data_files:
                raise malformed(
                    f"the {DATA_FIELD!r} file {name[:80]!r} is given twice; send it once"
                )
            if len(form.data_files) == MAX_DATA_FILES:
                raise malformed(
                    f"more than {MAX_DATA_FILES} {DATA_FIELD!r} files; save the model's external "
                    "data as one file (onnx.save_model(model, path, save_as_external_data=True, "
                    "all_tensors_to_one_file=True, location='model.onnx.data'))",
                )
            chunks = _counted(reader.data(), metrics, DATA_FIELD)
            form.data_files[name] = await _save(
                chunks, dest / name, DATA_FIELD, max_bytes, total_limit - form.total_bytes
            )
        elif part.name in TEXT_FIELDS:
            form.texts[part.name] = await reader.text(part.name)
        else:
            raise malformed(
                f"unknown form field {part.name[:40]!r}; the fields are "
                f"{', '.join((*FILE_FIELDS, DATA_FIELD, *TEXT_FIELDS))}",
            )
    if "model" not in form.labels:
        raise UploadRejected(
            Refusal.UNUSABLE,
            "Missing model",
            "the form has no 'model' file: send the checkpoint as the 'model' "
            "field (curl -F model=@model.safetensors ...)",
        )
    return form


async def _save(
    chunks: AsyncIterator[bytes], path: Path, name: str, max_bytes: int, left: int
) -> int:
    """One file under the per-file limit and what is left of the request's total."""
    limit = max(min(max_bytes, left), 0)
    try:
        return await save_upload(chunks, path, limit, name)
    except UploadRejected as error:
        if error.kind != Refusal.TOO_LARGE or limit == max_bytes:
            raise
        raise UploadRejected(
            Refusal.TOO_LARGE,
            "Upload too large",
            f"the request's files together are larger than {MAX_REQUEST_FILES} times the "
            f"{max_bytes / (1 << 20):.6g} MB limit of one file (EDGE_UN_MAX_UPLOAD_MB); send "
            "smaller files, or raise the limit",
        ) from None


def check_files(
    form: Form, dest: Path, max_parameters: int = DEFAULT_MAX_PARAMETERS
) -> ModelUpload:
    """Content checks (blocking: run in a thread): what the model is. A check that fails
    unexpectedly still refuses the upload (logged): nothing a client sends may become a 5xx."""
    try:
        return _check_files(form, dest, max_parameters)
    except UploadRejected:
        raise
    except Exception as error:
        log.exception("a content check failed unexpectedly")
        raise UploadRejected(
            Refusal.UNUSABLE,
            "Unreadable upload",
            f"the uploaded files could not be checked ({type(error).__name__}); send a model "
            "in one of the supported formats (.safetensors, .pt/.pth with config, .pt2, .onnx)",
        ) from None


def _check_files(form: Form, dest: Path, max_parameters: int) -> ModelUpload:
    config = inspect_config(dest / "config") if "config" in form.labels else None
    # model_data files stay where they are: beside the model, under the names it references
    external = {name: dest / name for name in form.data_files}
    model = inspect_model(dest / "model", config, external=external, max_parameters=max_parameters)
    for name in ("calib", "eval"):
        if name in form.labels:
            inspect_npz(dest / name, name, model.inputs)  # type: ignore[arg-type]
    if model.format == "hf":  # extracted into its directory by the check; the archive is done
        (dest / "model").unlink()
    return model


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
    *,
    browser: bool = False,
) -> Job:
    """A queued job for this request, or UploadRejected (and nothing kept). ``browser``: the
    web page's form (see ``receive``)."""
    boundary = boundary_of(content_type)
    limit = settings.max_upload_bytes
    too_long = MAX_REQUEST_FILES * limit + (1 << 20)  # with room for the multipart framing
    if content_length and content_length.isdigit() and int(content_length) > too_long:
        metrics.uploads.labels("rejected").inc()
        raise UploadRejected(
            Refusal.TOO_LARGE,
            "Upload too large",
            f"the request is {int(content_length):,} "
            f"bytes, more than {MAX_REQUEST_FILES} files of the {settings.max_upload_mb:g} MB "
            "limit (EDGE_UN_MAX_UPLOAD_MB); send smaller files",
        )
    job_id = jobs.new_job_id()
    dest = store.upload_dir(job_id)
    try:
        await anyio.to_thread.run_sync(_check_queue, settings, token_id)  # before the upload
        form = await receive(MultipartReader(body, boundary), dest, limit, metrics, browser)
        targets = form_targets(form.texts.get("targets"))
        max_drift = parse_max_drift(form.texts.get("max_drift"))
        model = await anyio.to_thread.run_sync(check_files, form, dest, settings.max_parameters)
        request = jobs.NewJob(
            token_id=token_id,
            targets=tuple(profile.name for profile in targets),
            max_drift=max_drift,
            model_format=model.format,
            model_label=form.labels["model"],
            config_label=form.labels.get("config"),
            calib_label=form.labels.get("calib"),
            eval_label=form.labels.get("eval"),
            upload_bytes=form.total_bytes,
        )
        job = await anyio.to_thread.run_sync(_create, settings, job_id, request)
    except BaseException as error:
        store.delete_uploads(job_id)
        if isinstance(error, UploadRejected):
            metrics.uploads.labels("rejected").inc()
            await _drain(body)
        raise
    metrics.uploads.labels("accepted").inc()
    return job


async def submit(
    services: Services,
    body: AsyncIterator[bytes],
    headers: Mapping[str, str],
    token_id: int | None,
    *,
    browser: bool = False,
) -> Job:
    """Accept the request of this body and these headers (:func:`accept`) and hand its job to
    the queue: the API's upload route and the web page's upload form both submit this way."""
    job = await accept(
        body,
        headers.get("content-type"),
        headers.get("content-length"),
        token_id,
        services.settings,
        services.store,
        services.metrics,
        browser=browser,
    )
    # in a thread: a Celery publish is network I/O (and waits out a broker that is away)
    await anyio.to_thread.run_sync(services.queue.submit, job.id)
    return job


def _check_queue(settings: Settings, token_id: int | None) -> None:
    """Refuse a token whose queue is full (EDGE_UN_MAX_QUEUED): checked before a request's
    files are read, and again as its job is recorded."""
    with session_scope(settings) as session:
        _refuse_if_full(session, settings, token_id)


def _refuse_if_full(session: Session, settings: Settings, token_id: int | None) -> None:
    waiting = jobs.queued_count(session, token_id)
    if waiting >= settings.max_queued:
        raise UploadRejected(
            Refusal.TOO_MANY,
            "Too many queued jobs",
            f"this token has {waiting} conversions waiting to start, the most it may have "
            f"(EDGE_UN_MAX_QUEUED={settings.max_queued}); send this one again once one of them "
            f"has started (in about {RETRY_AFTER_S} s, Retry-After), or cancel one",
            retry_after=RETRY_AFTER_S,
        )


def _create(settings: Settings, job_id: str, request: jobs.NewJob) -> Job:
    with session_scope(settings) as session:
        _refuse_if_full(session, settings, request.token_id)
        return jobs.create(session, job_id, request)
