"""Measurements -> report records (the pydantic models of :mod:`quant.report`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from ..digest import sha256_file
from ..measure.bars import Bars
from ..measure.drift import Drift
from ..measure.latency import Timing
from . import schema

WORST_LAYERS = 5  # how many of the lowest-SQNR tensors a target's report names
Runtime = Literal["onnxruntime", "litert"]
ArtifactFormat = Literal["onnx", "tflite", "vela_tflite", "text"]


def finite(value: float | None) -> float | None:
    """A figure as the report holds it: JSON has no infinities, so a non-finite one is None."""
    return value if value is not None and math.isfinite(value) else None


def artifact_record(
    path: Path, out_dir: Path, kind: ArtifactFormat, description: str
) -> schema.Artifact:
    return schema.Artifact(
        name=path.relative_to(out_dir).as_posix(),
        format=kind,
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
        description=description,
    )


def drift_record(
    drift: Drift,
    artifact: str,
    worst: list[schema.LayerError],
    bars: Bars,
    arithmetic: schema.Arithmetic,
) -> schema.Drift:
    return schema.Drift(
        **asdict(drift),  # every measured figure, as the report names it
        artifact=artifact,
        arithmetic=arithmetic,
        worst_layers=worst,
        within_bar=drift.within(bars),
    )


def latency_record(
    timing: Timing,
    runtime: Runtime,
    artifact: str,
    xnnpack_ops: dict[str, tuple[int, int]] | None = None,
) -> schema.Latency:
    return schema.Latency(
        **asdict(timing), runtime=runtime, artifact=artifact, batch=1, xnnpack_ops=xnnpack_ops
    )
