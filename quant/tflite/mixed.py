"""A TFLite target's per-op precision mix: the fewest ops given int16 activations that bring the
file within the drift bars, within what its NPU runs in int16.

Which ops may widen (``candidates``): ops that compute (not RESHAPE, TRANSPOSE, SLICE..., which
carry their input's grid), never one whose output is the model's (the file keeps int8 I/O), and
never one of the profile's ``int8_input_ops``: Ethos-U65 runs BATCH_MATMUL and GELU only with
int8 inputs (Vela leaves an int16 one to the Cortex-A55), so those ops stay int8 and so do their
inputs (the quantizer gives an int8 consumer an int8 copy of an int16 tensor).

Which first (``ranked``): each candidate's own quantization error, the float file's tensor on
the calibration samples against itself put on the int8 file's grid (its scale and zero point),
worst first. An accumulated error would rank the last ops first; the own error finds the tensor
whose grid is too coarse (a residual stream's outliers, a softmax's tail).

How many (``quant.targets.fallback_ladder``): the same steps as the cpu target's, 4, all, then the
doubling between; each step a requantization of the same float file with the same ranges, then
a drift pass in LiteRT, watched (``quant.deadline``): LiteRT runs an int16 op on its reference
kernels, so a step that widens more ops can run many times longer than the one before it (the
trained BERT-base's imx93 build ran its job past the service's timeout before steps were
watched). A step the deadline reaches is stopped part way, and the best file so far ships.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..deadline import SearchStopped, cut_note, watching
from ..measure.drift import SQNR_SAMPLES, Drift, Inputs, sqnr_of_sums
from ..report import schema
from ..targets.builder import TargetJob
from ..targets.fallback_ladder import ceiling_note, fallback_sizes, out_of_reach, ships_before
from .direct import DirectArtifacts, requantize
from .flatbuffer import inspect_tflite
from .litert import _AllTensors, _head, op_graph

# Ops whose output grid is their own (computed, not carried from the input).
WIDENED_OPS = frozenset(
    {
        "ADD", "SUB", "MUL", "FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D", "BATCH_MATMUL",
        "SOFTMAX", "GELU", "MEAN", "SUM", "TANH", "LOGISTIC", "SQUARED_DIFFERENCE", "RSQRT",
        "EMBEDDING_LOOKUP", "GATHER",
    }
)  # fmt: skip


def candidates(int8: Path, int8_input_ops: frozenset[str]) -> list[tuple[str, str]]:
    """(op type, output tensor) of every op of the pure int8 file that may take int16
    activations, in graph order."""
    outputs = {spec.name for spec in inspect_tflite(int8).outputs}
    found = []
    for op, _, outs in op_graph(int8):
        widens = op in WIDENED_OPS and op not in int8_input_ops
        if widens and len(outs) == 1 and outs[0] not in outputs:
            found.append((op, outs[0]))
    return found


def ranked(
    float32: Path, int8: Path, tensors: list[str], inputs: Inputs, samples: int = SQNR_SAMPLES
) -> list[tuple[str, float]]:
    """(tensor, own SQNR dB) of each of ``tensors``, worst first: the float file's values
    against the same values rounded to the int8 file's grid."""
    grids = {
        name: _grid(details)
        for name, details in _AllTensors(int8, _head(inputs, 1)).details.items()
    }
    floats = _AllTensors(float32, _head(inputs, samples))
    kept = [t for t in tensors if t in grids and grids[t] is not None and t in floats.details]
    sums = {t: np.zeros(2) for t in kept}
    for sample in range(len(floats)):
        floats.run(sample)
        for tensor in kept:
            values = floats.read(tensor).astype(np.float64)
            scale, zero, low, high = grids[tensor]
            rounded = (np.clip(np.round(values / scale) + zero, low, high) - zero) * scale
            sums[tensor] += [np.sum(values**2), np.sum((values - rounded) ** 2)]
    rows = [(tensor, sqnr_of_sums(*sums[tensor])) for tensor in kept]
    return sorted(rows, key=lambda row: row[1])


def _grid(details: list[Mapping]) -> tuple[float, int, int, int] | None:
    """A per-tensor int8 tensor's scale, zero point and integer range; None otherwise."""
    detail = details[0]
    scales = detail["quantization_parameters"]["scales"]
    if len(details) != 1 or len(scales) != 1 or np.dtype(detail["dtype"]) != np.int8:
        return None
    zero = int(detail["quantization_parameters"]["zero_points"][0])
    return float(scales[0]), zero, -128, 127


def int16_inputs_of(path: Path, ops: frozenset[str]) -> list[str]:
    """The ops among ``ops`` in the file that read an int16 tensor (an NPU's rule broken)."""
    int16 = set(inspect_tflite(path).int16_tensors)
    return [
        f"{op} {outs[0] if outs else ''}".strip()
        for op, ins, outs in op_graph(path)
        if op in ops and any(name in int16 for name in ins)
    ]


MIXED_NAME = "model_mixed.tflite"


@dataclass(frozen=True)
class MixedResult:
    """The file the ladder ships (``MIXED_NAME``, or None when none beat the pure int8 one),
    its drift, every step it measured as the report's exclusions, and whether the deadline
    ended it (then no wider fallback starts either)."""

    file: Path | None
    drift: Drift
    steps: list[schema.Exclusion]
    out_of_time: bool = False


def mixed_ladder(
    converted: DirectArtifacts,
    int8: Path,
    job: TargetJob,
    pure: Drift,
    measure: Callable[[Path], Drift],
    stopped: list[str],
    finish_s: float,
) -> MixedResult:
    """Widen the most sensitive candidates of ``int8`` in the ladder's steps until a file is
    within the bars; the file closest to them ships (``ships_before``), the pure one included.
    Each step is a requantization and a drift pass (``measure``), watched so that ``finish_s``
    (what the build runs after the ladder) is left; the search stops, with a note in
    ``stopped``, before a step that would not end in time, or part way through one."""
    bars, profile = job.bars, job.profile
    ops = candidates(int8, profile.int8_input_ops)
    job.stage("fallback", 0.47, f"ranking {len(ops)} ops by their own int8 error")
    order = [
        t for t, _ in ranked(converted.float32, int8, [t for _, t in ops], job.calibration.feeds)
    ]
    best, best_size, best_file = pure, 0, None
    steps: list[schema.Exclusion] = []
    step_s = 0.0
    out = job.target_dir / MIXED_NAME
    trial = converted.work_dir / f"trial_{MIXED_NAME}"
    out_of_time = False
    for size in fallback_sizes(len(order)):
        if not job.deadline.allows(step_s, finish_s):
            stopped.append(
                f"the per-op int16 fallback stopped after {len(steps)} step(s): the next one "
                f"({size} ops) would not end in the time left"
            )
            out_of_time = True
            break
        started = time.monotonic()
        job.stage("fallback", 0.48, f"{size} ops to int16")
        widened = tuple(order[:size])
        try:
            with watching(job.deadline.less(finish_s)):
                requantize(converted, trial, int16=widened)
                drift = measure(trial)
        except SearchStopped:
            done, step = f"{len(steps)} per-op fallback step(s)", f"the step of {size} ops"
            stopped.append(cut_note(done, step, finish_s))
            out_of_time = True
            break
        step_s = time.monotonic() - started
        steps.append(
            schema.Exclusion(
                step=len(steps) + 1,
                action=f"the {size} most sensitive ops to int16 activations",
                tensors=list(widened),
                top1_drop_pts=drift.top1_drop_pts,
                agreement=drift.agreement,
                est_cost=None,
            )
        )
        if ships_before(drift, size, best, best_size, bars):
            best, best_size = drift, size
            best_file = Path(shutil.copy(trial, out))
        if drift.within(bars) and size < len(order):
            break
        if size == len(order) and out_of_reach(drift, bars):
            stopped.append(ceiling_note(size, drift))
            break
    trial.unlink(missing_ok=True)
    return MixedResult(best_file, best, steps, out_of_time)
