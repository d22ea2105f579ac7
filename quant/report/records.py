"""Measurements -> report records (the pydantic models of :mod:`quant.report`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Literal

from ..digest import sha256_file
from ..measure.bars import Bars
from ..measure.drift import Drift, TensorError
from ..measure.latency import Timing
from ..sources import Source, label_of
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


def worst_layers(
    errors: Iterable[TensorError], sources: Mapping[str, Source]
) -> list[schema.LayerError]:
    """The tensors a target's report names (``errors`` worst first; the first WORST_LAYERS),
    each with the module that computes it (``sources``: the file's tensors by name)."""
    return [
        schema.LayerError(
            name=error.name,
            op=error.op,
            sqnr_db=finite(error.sqnr_db),
            own_sqnr_db=finite(error.own_sqnr_db),
            module=label_of(sources, error.name),
        )
        for error in islice(errors, WORST_LAYERS)
    ]


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
