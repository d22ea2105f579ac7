"""Which converter makes a TFLite target's files, once per job, and what it leaves behind.

Two routes (``schema.TfliteRoute``):
- **litert-torch** (``quant.tflite.direct``), the default wherever prepare saved the folded torch
  program: no TensorFlow, a per-op precision mix, 4x faster on the bundled ViT;
- **onnx2tf** (``quant.tflite.onnx2tf``): the fp32 ONNX file through TensorFlow. The only route
  for an ONNX upload, and the fallback when the direct route fails (the reason is kept).

Targets of one job may build at once (on Celery workers sharing the job's directory): the first
takes a lock on the file system and converts, the others wait for it and copy its files; a build
killed while converting releases the lock and leaves no record, so the next one converts again.

A route that fails leaves its tool logs in ``<target>/logs/`` (published with the target's
files, not in a temporary directory), and its error names that path.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..report import schema
from ..targets.builder import TargetJob
from . import toolenv
from .direct import DirectArtifacts, convert_direct
from .flatbuffer import NotFullIntegerError, check_full_integer, inspect_tflite
from .onnx2tf import SAVED_MODEL_NAME, TfliteArtifacts, convert_tflite
from .tool_sandbox import TfliteConversionError

LOGS_DIR = "logs"
DIRECT = "litert-torch"
ONNX2TF = "onnx2tf"
# auto (the default: direct where there is a program, onnx2tf otherwise or after it fails), or
# one route alone, without the other as its fallback (benchmarks.conversion.tflite_routes
# compares them)
ROUTE_VAR = "EDGE_UN_TFLITE_ROUTE"
ROUTES = ("auto", DIRECT, ONNX2TF)


@dataclass(frozen=True)
class Converted:
    """A TFLite target's conversion: the route that made it and that route's files. Exactly one
    of ``direct`` and ``onnx2tf`` is set."""

    route: schema.TfliteRoute
    direct: DirectArtifacts | None = None
    onnx2tf: TfliteArtifacts | None = None

    @property
    def int8(self) -> Path:
        return self.direct.int8 if self.direct else self.onnx2tf.int8

    @property
    def float32(self) -> Path:
        return self.direct.float32 if self.direct else self.onnx2tf.float32

    @property
    def quantize_s(self) -> float:
        return self.direct.quantize_s if self.direct else self.onnx2tf.quantize_s

    @property
    def tensor_map(self) -> Path | None:
        """onnx2tf's map of TFLite to ONNX names; the direct route's names are module paths."""
        return None if self.direct else self.onnx2tf.tensor_map

    @property
    def module_paths(self) -> dict[str, str]:
        """The direct route's {scope chain: module path} (quant.sources.scoped_sources)."""
        return self.direct.module_paths if self.direct else {}

    @property
    def matmul_operands(self) -> tuple:
        return self.direct.matmul_operands if self.direct else self.onnx2tf.matmul_operands


def convert_for_target(job: TargetJob, work: Path) -> Converted:
    """The job's TFLite conversion, by the direct route where the job has a torch program and
    the onnx2tf route otherwise or when the direct one fails. Raises TfliteConversionError
    naming the logs kept in ``<target>/logs/`` when no route converts."""
    logs = job.target_dir / LOGS_DIR
    chosen = chosen_route()
    direct_failed = None
    if chosen == DIRECT and job.program is None:
        raise TfliteConversionError(f"{ROUTE_VAR}={DIRECT}, but {job.no_program or 'no program'}")
    if job.program is not None and chosen != ONNX2TF:
        try:
            direct = _cached(job, work, DIRECT, _direct(job), DirectArtifacts.from_json)
            # e.g. an embedding table the quantizer leaves in float (EMBEDDING_LOOKUP)
            check_full_integer(inspect_tflite(direct.int8), io_dtype="int8")
        except (TfliteConversionError, toolenv.ToolEnvMissingError) as error:
            direct_failed = keep_logs(str(error), work / DIRECT, logs)
        except NotFullIntegerError as error:
            direct_failed = str(error)
        else:
            reason = "the default for a torch source: its folded program, straight to LiteRT"
            route = schema.TfliteRoute(name=DIRECT, reason=reason, convert_s=direct.convert_s,
                                       quantize_s=direct.quantize_s)  # fmt: skip
            return Converted(route, direct=direct)
    if direct_failed and chosen == DIRECT:
        raise TfliteConversionError(f"litert-torch: {direct_failed}")
    if direct_failed:
        why = direct_failed
    elif chosen == ONNX2TF:
        why = f"{ROUTE_VAR}={ONNX2TF}"
    else:
        why = job.no_program or "no torch program"
    try:
        onnx2tf = _cached(job, work, ONNX2TF, _onnx2tf(job), _onnx2tf_record)
    except (TfliteConversionError, toolenv.ToolEnvMissingError) as error:
        failed = keep_logs(str(error), work / ONNX2TF, logs)
        if direct_failed:
            failed = f"litert-torch: {direct_failed}; then onnx2tf: {failed}"
        raise TfliteConversionError(failed) from None
    reason = f"the direct route was not taken: {why}"
    route = schema.TfliteRoute(name=ONNX2TF, reason=reason, convert_s=onnx2tf.onnx2tf_s,
                               quantize_s=onnx2tf.quantize_s)  # fmt: skip
    return Converted(route, onnx2tf=onnx2tf)


def chosen_route() -> str:
    """The route ``$EDGE_UN_TFLITE_ROUTE`` asks for (``auto`` when unset)."""
    chosen = os.environ.get(ROUTE_VAR, "auto").strip() or "auto"
    if chosen not in ROUTES:
        raise TfliteConversionError(f"{ROUTE_VAR}={chosen!r}: choose one of {', '.join(ROUTES)}")
    return chosen


def _direct(job: TargetJob) -> Callable[[Path], DirectArtifacts]:
    return lambda into: convert_direct(job.program, job.calibration, into)


def _onnx2tf(job: TargetJob) -> Callable[[Path], TfliteArtifacts]:
    return lambda into: convert_tflite(job.fp32_path, job.calibration.feeds, into)


def _onnx2tf_record(text: str, directory: Path) -> TfliteArtifacts:
    return TfliteArtifacts.from_json(text, directory)


def _cached(job: TargetJob, work: Path, route: str, convert: Callable, read: Callable):
    """``convert(directory)`` once per job and route: into ``work/route`` for a job of its own,
    else into the job's shared directory (locked), copied to ``work/route``."""
    mine = work / route
    if job.shared_dir is None:
        return convert(mine)
    cached = job.shared_dir / "tflite" / route / job.fp32_path.stem
    record = cached / "artifacts.json"
    with _locked(cached):
        if not record.is_file():
            shutil.rmtree(cached, ignore_errors=True)  # what a killed conversion left
            try:
                converted = convert(cached)
            except (TfliteConversionError, toolenv.ToolEnvMissingError):
                _copy(cached, mine)  # its logs, for this target's error
                raise
            record.write_text(converted.to_json())
    _copy(cached, mine)
    found = read(record.read_text(), mine)
    if route == ONNX2TF:  # the saved_model (hundreds of MB) is only read, for a 16x8 file
        found = dataclasses.replace(found, saved_model=cached / SAVED_MODEL_NAME)
    return found


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / f"{directory.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _copy(source: Path, destination: Path) -> None:
    if source.is_dir():
        ignore = shutil.ignore_patterns(SAVED_MODEL_NAME)
        shutil.copytree(source, destination, dirs_exist_ok=True, ignore=ignore)


def keep_logs(error: str, route_dir: Path, logs: Path) -> str:
    """Copy the route's logs into ``logs`` and name them there in ``error`` (one line)."""
    found = sorted(route_dir.rglob("*.log")) if route_dir.is_dir() else []
    if not found:
        return error
    logs.mkdir(parents=True, exist_ok=True)
    for log in found:
        shutil.copy(log, logs / log.name)
    return re.sub(r"\(full log: [^)]*/([^/)]+)\)", lambda m: f"(log: {logs / m.group(1)})", error)
