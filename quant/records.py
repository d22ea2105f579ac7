"""Measurements -> report records (the pydantic models of :mod:`quant.report`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from . import report as schema
from .digest import sha256_file
from .drift import Drift
from .latency import Timing
from .litert import input_name as _input_name
from .targets import Bars
from .tflite_flatbuffer import TfliteInfo

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
        artifact=artifact,
        arithmetic=arithmetic,
        top1_fp32=drift.top1_fp32,
        top1_int8=drift.top1_int8,
        top1_drop_pts=drift.top1_drop_pts,
        agreement=drift.agreement,
        cosine=drift.cosine,
        max_abs_err=drift.max_abs_err,
        samples=drift.samples,
        worst_layers=worst,
        within_bar=drift.within(bars),
    )


def onnx_inputs(path: Path) -> list[schema.ModelInput]:
    """An ONNX file's inputs, batch axis dropped (-1 where the file leaves a size open)."""
    model = onnx.load(str(path), load_external_data=False)
    constants = {init.name for init in model.graph.initializer}
    inputs = []
    for value in (v for v in model.graph.input if v.name not in constants):
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.dim_value > 0 else -1 for d in tensor_type.shape.dim]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).name
        inputs.append(schema.ModelInput(name=value.name, shape=dims[1:], dtype=dtype))
    return inputs


def tflite_inputs(info: TfliteInfo) -> list[schema.ModelInput]:
    """A TFLite file's inputs as its runtime takes them (quantization of int8 ones)."""
    inputs = []
    for tensor in info.inputs:
        quantized = tensor.dtype in ("int8", "uint8", "int16")
        inputs.append(
            schema.ModelInput(
                name=_input_name(tensor.name),
                shape=list(tensor.shape[1:]),
                dtype=tensor.dtype,
                scale=tensor.scale if quantized else None,
                zero_point=tensor.zero_point if quantized else None,
            )
        )
    return inputs


def latency_record(
    timing: Timing,
    runtime: Runtime,
    artifact: str,
    xnnpack_ops: dict[str, tuple[int, int]] | None = None,
) -> schema.Latency:
    return schema.Latency(
        runtime=runtime,
        artifact=artifact,
        threads=timing.threads,
        batch=1,
        runs=timing.runs,
        p50_ms=timing.p50_ms,
        p90_ms=timing.p90_ms,
        p99_ms=timing.p99_ms,
        xnnpack_ops=xnnpack_ops,
        others_busy_cores=timing.others_busy_cores,
    )
