"""What int8 cost: the quantized model's outputs against the fp32 model's, on held-out data.

``measure_drift`` compares two sets of logits (top-1 with labels, agreement, cosine, max abs
error); ``tensor_sqnr`` finds WHERE the error arises: every activation of the int8 ONNX model
against the same tensor of the fp32 model (ONNX Runtime's ``qdq_loss_debug``), as SQNR in dB.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.qdq_loss_debug import (
    collect_activations,
    create_activation_matching,
    modify_model_output_intermediate_tensors,
)

from .data import Samples
from .ort_int8 import SamplesReader

EVAL_BATCH = 256
SQNR_SAMPLES = 64  # enough to rank tensors; every activation of every sample is kept in memory
Runner = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Drift:
    top1_fp32: float | None
    top1_int8: float | None
    top1_drop_pts: float | None
    agreement: float
    cosine: float
    max_abs_err: float
    samples: int

    def within(self, max_drop_pts: float, min_agreement: float) -> bool:
        drop_ok = self.top1_drop_pts is None or self.top1_drop_pts <= max_drop_pts
        return drop_ok and self.agreement >= min_agreement


@dataclass(frozen=True)
class TensorError:
    """One activation: SQNR of the int8 model's value vs fp32 (accumulated error, ``sqnr_db``)
    and of its own quantize-dequantize step alone (``own_sqnr_db``, the local rounding)."""

    name: str
    op: str
    sqnr_db: float
    own_sqnr_db: float


def measure_drift(reference: np.ndarray, quantized: np.ndarray, labels: np.ndarray | None) -> Drift:
    ref_top1, q_top1 = reference.argmax(-1), quantized.argmax(-1)
    flat_ref, flat_q = reference.ravel().astype(np.float64), quantized.ravel().astype(np.float64)
    norm = np.linalg.norm(flat_ref) * np.linalg.norm(flat_q)
    top1_fp32 = top1_int8 = drop = None
    if labels is not None:
        top1_fp32 = float((ref_top1 == labels).mean())
        top1_int8 = float((q_top1 == labels).mean())
        drop = round(100.0 * (top1_fp32 - top1_int8), 4)
    return Drift(
        top1_fp32=top1_fp32,
        top1_int8=top1_int8,
        top1_drop_pts=drop,
        agreement=float((ref_top1 == q_top1).mean()),
        cosine=float(flat_ref @ flat_q / norm) if norm > 0 else 1.0,
        max_abs_err=float(np.abs(flat_ref - flat_q).max()),
        samples=len(reference),
    )


def onnx_runner(path: Path, threads: int = 0) -> Runner:
    """inputs -> first output of an ONNX model, batched to its static batch if it has one."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    batch = first.shape[0] if isinstance(first.shape[0], int) else EVAL_BATCH

    def run(inputs: np.ndarray) -> np.ndarray:
        chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
        return np.concatenate([session.run(None, {first.name: chunk})[0] for chunk in chunks])

    return run


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    signal = float(np.linalg.norm(reference))
    noise = float(np.linalg.norm(reference - actual))
    if noise == 0.0:
        return math.inf
    return 20.0 * math.log10(max(signal, 1e-30) / noise)


def tensor_sqnr(fp32_path: Path, int8_path: Path, samples: Samples) -> list[TensorError]:
    """Every quantized activation of an int8 QDQ ONNX model, worst (lowest SQNR) first."""
    subset = samples.inputs[:SQNR_SAMPLES]
    ops = {
        out: node.op_type for node in onnx.load(str(fp32_path)).graph.node for out in node.output
    }
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
        activations = {}
        for tag, path in (("fp32", fp32_path), ("int8", int8_path)):
            augmented = Path(scratch) / f"{tag}.onnx"
            modify_model_output_intermediate_tensors(str(path), str(augmented))
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            first = session.get_inputs()[0]
            batch = first.shape[0] if isinstance(first.shape[0], int) else len(subset)
            reader = SamplesReader(first.name, subset, batch)
            activations[tag] = collect_activations(str(augmented), reader)
        matching = create_activation_matching(activations["int8"], activations["fp32"])
    found = [
        TensorError(
            name,
            ops[name],
            _sqnr_of_lists(match["float"], match["post_qdq"]),
            _sqnr_of_lists(match["pre_qdq"], match["post_qdq"]),
        )
        for name, match in matching.items()
        # graph inputs have no producing op (not a layer); tensors the int8 graph renamed or
        # fused away have no fp32 twin
        if name in ops and match.get("float")
    ]
    return sorted(found, key=lambda e: e.sqnr_db)


def _sqnr_of_lists(reference: list[np.ndarray], actual: list[np.ndarray]) -> float:
    flat = [np.concatenate([t.ravel() for t in tensors]) for tensors in (reference, actual)]
    return sqnr_db(*flat)
