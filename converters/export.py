"""Export a (folded) model to one self-contained ONNX file, checked and compared with ORT."""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from .edge_rewrites import for_edge_runtimes
from .errors import ConversionError, OpsetError, root_cause
from .log_levels import loggers_at
from .onnx_rewrites import rewrite_model
from .opset import downgrade_to_opset17
from .reexport import prepare_for_reexport

MIN_OPSET = 17  # what TIDL wants; the dynamo exporter itself starts at 18
# Highest opset that torch 2.13's exporter writes and ORT 1.31 runs (measured: 26 silently
# stays 18 in the exporter; the file-opset check below would catch it anyway).
MAX_OPSET = 25


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]  # a str is a dynamic dimension
    dtype: str


@dataclass(frozen=True)
class ExportInfo:
    """What is in the file: opset read back from it, ops, I/O, and ORT vs torch agreement."""

    path: Path
    opset: int
    op_histogram: dict[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_abs_diff: float
    dynamic_batch: bool


def export_onnx(
    model: nn.Module | ExportedProgram,
    example_inputs: Any,
    path: str | Path,
    opset: int = 18,
    dynamic_batch: bool = True,
) -> ExportInfo:
    """Export with the dynamo exporter to one file (no external data), opset ``opset`` (17 via
    a checked downgrade), static shapes when ``dynamic_batch`` is False (NPU targets). An
    ExportedProgram keeps the dynamic dimensions it was exported with. ``max_abs_diff`` in the
    result is ONNX Runtime vs ``model`` itself on ``example_inputs``."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise OpsetError(f"opset {opset} not supported: choose {MIN_OPSET}..{MAX_OPSET}")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    path = Path(path)
    proto = trace_to_onnx(model, args, max(opset, 18), dynamic_batch)
    # x[:, 0, :] (cls pooling) exports as a Gather: a slice instead, for NPUs without GATHER;
    # a zero-width pad (Swin's) goes.
    proto = rewrite_model(proto, for_edge_runtimes, shapes=True)
    if opset == 17:
        proto = downgrade_to_opset17(proto)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    written = file_opset(proto)
    if written != opset:  # never report an opset the file does not have
        raise OpsetError(f"asked for opset {opset} but the exporter produced {written}")
    onnx.save_model(proto, str(path), save_as_external_data=False)
    onnx.checker.check_model(str(path), full_check=True)
    expected = run_torch(model, args)
    actual = run_onnx(path, args)
    return ExportInfo(
        path=path,
        opset=file_opset(onnx.load(str(path), load_external_data=False)),
        op_histogram=op_histogram(proto),
        inputs=tuple(_spec(v) for v in proto.graph.input),
        outputs=tuple(_spec(v) for v in proto.graph.output),
        max_abs_diff=max_abs_diff(expected, actual),
        dynamic_batch=dynamic_batch,
    )


def trace_to_onnx(
    model: nn.Module | ExportedProgram, args: tuple, opset: int, dynamic_batch: bool
) -> onnx.ModelProto:
    dynamic_shapes = None
    if dynamic_batch and not isinstance(model, ExportedProgram):
        # A batch of 1 would be specialised (0/1 rule): trace with 2, the file stays dynamic.
        args = tuple(torch.cat([a, a]) if _is_batch_one(a) else a for a in args)
        dynamic_shapes = tuple(
            {0: torch.export.Dim("batch")} if isinstance(a, Tensor) and a.dim() else None
            for a in args
        )
    # Norms must be traced in eval mode (a frozen affine); an unlifted program is always eval.
    was_training = (
        isinstance(model, nn.Module) and not isinstance(model, GraphModule) and model.training
    )
    if was_training:
        model.eval()  # type: ignore[union-attr]
    if isinstance(model, GraphModule):
        prepare_for_reexport(model)
    quiet = io.StringIO()  # the exporter prints progress lines; keep the caller's output clean
    try:
        with (
            contextlib.redirect_stdout(quiet),
            loggers_at(logging.ERROR),
            warnings.catch_warnings(),  # its notes on axis names are not the user's concern
        ):
            warnings.simplefilter("ignore", UserWarning)
            program = torch.onnx.export(
                model,
                args,
                dynamo=True,
                opset_version=opset,
                external_data=False,
                dynamic_shapes=dynamic_shapes,
                optimize=True,
            )
    except Exception as error:
        raise ConversionError(f"ONNX export failed: {root_cause(error)}") from error
    finally:
        if was_training:
            model.train()  # type: ignore[union-attr]
    assert program is not None
    return program.model_proto


def _is_batch_one(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == 1


def file_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset the file declares."""
    versions = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise OpsetError("the ONNX file declares no default-domain opset")
    return versions[0]


def op_histogram(proto: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type over the main graph and its subgraphs, most frequent first."""
    counts: collections.Counter[str] = collections.Counter()
    pending = [proto.graph]
    while pending:
        graph = pending.pop()
        for node in graph.node:
            counts[node.op_type] += 1
            pending += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    return dict(counts.most_common())


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim)
    return TensorSpec(value.name, dims, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name)


def run_torch(model: nn.Module | ExportedProgram, args: tuple) -> list[np.ndarray]:
    module = model.module() if isinstance(model, ExportedProgram) else model
    with torch.no_grad():
        out = module(*args)
    flat = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]  # ModelOutput, dict
    return [t.detach().cpu().numpy() for t in flat]


def run_onnx(path: Path, args: tuple) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # its graph clean-up notes are not the user's concern
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    tensors = [a for a in args if isinstance(a, Tensor)]
    feeds = {i.name: t.cpu().numpy() for i, t in zip(session.get_inputs(), tensors, strict=True)}
    return session.run(None, feeds)


def max_abs_diff(expected: list[np.ndarray], actual: list[np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(e.astype(np.float64) - a.astype(np.float64)), initial=0.0))
        for e, a in zip(expected, actual, strict=True)
    )
