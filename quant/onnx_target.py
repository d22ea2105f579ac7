"""A QDQ ONNX target (cpu, tda4vm): quantize, measure, fall back tensor by tensor, check, time.

The drift fallback widens the most sensitive activations to 16 bits, doubling how many each
step (4, 8, 16, ... then all), until the drift fits the bars or nothing is left. Sensitivity is
each tensor's own quantization SQNR in the pure int8 model (its local rounding error): measured
on the trained examples, ranking by it converges in fewer steps than ranking by the accumulated
error, which blames the softmax outputs for noise that arises upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import report as schema
from .drift import Drift, measure_drift, onnx_runner, tensor_sqnr
from .job import TargetJob
from .latency import onnx_latency, thread_counts
from .ort_int8 import quantize_onnx
from .records import WORST_LAYERS, artifact_record, drift_record, latency_record
from .rules import check_onnx_artifact, onnx_op_histogram, unsupported_ops

FIRST_FALLBACK_STEP = 4


@dataclass(frozen=True)
class FallbackStep:
    tensors: tuple[str, ...]
    drift: Drift


def build_onnx_target(job: TargetJob) -> dict[str, Any]:
    """int8 QDQ ONNX for ``profile`` in ``target_dir/model_int8.onnx``; the TargetReport fields
    (artifacts, drift, fallback steps, latency...) with names relative to ``out_dir``."""
    profile, bars, stage = job.profile, job.bars, job.stage
    target_dir, out_dir, evaluation = job.target_dir, job.out_dir, job.evaluation
    artifact = target_dir / "model_int8.onnx"

    def quantize_and_measure(int16: tuple[str, ...]) -> Drift:
        quantize_onnx(job.fp32_path, artifact, profile, job.calibration, int16_tensors=int16)
        outputs = onnx_runner(artifact)(evaluation.inputs)
        return measure_drift(job.reference, outputs, evaluation.labels)

    stage("quantize (ONNX Runtime)", 0.1)
    pure = drift = quantize_and_measure(())
    stage("per-tensor SQNR", 0.3)
    errors = tensor_sqnr(job.fp32_path, artifact, evaluation)
    int16: tuple[str, ...] = ()
    steps: list[FallbackStep] = []
    if not drift.within(bars.max_drop_pts, bars.min_agreement) and profile.fallback != "none":
        ranked = [e.name for e in sorted(errors, key=lambda e: e.own_sqnr_db)]
        count = FIRST_FALLBACK_STEP
        while True:
            stage(f"fallback: {count} tensors to int16", 0.4)
            int16 = tuple(ranked[:count])
            drift = quantize_and_measure(int16)
            steps.append(FallbackStep(int16, drift))
            if drift.within(bars.max_drop_pts, bars.min_agreement) or count >= len(ranked):
                break
            count = min(2 * count, len(ranked))
        if int16:  # the shipped file's own error profile, for the report
            errors = tensor_sqnr(job.fp32_path, artifact, evaluation)
    check_onnx_artifact(artifact, profile)
    stage("latency (ONNX Runtime)", 0.8)
    name = artifact.relative_to(out_dir).as_posix()
    sample = evaluation.inputs[:1]
    worst = [
        schema.LayerError(name=e.name, op=e.op, sqnr_db=e.sqnr_db, own_sqnr_db=e.own_sqnr_db)
        for e in errors[:WORST_LAYERS]
    ]
    description = "int8 QDQ ONNX" + (f", {len(int16)} activations int16" if int16 else "")
    return {
        "artifacts": [artifact_record(artifact, out_dir, "onnx", description)],
        "drift": drift_record(drift, name, worst, bars.max_drop_pts, bars.min_agreement),
        "pure_int8_drift": (
            drift_record(pure, name, [], bars.max_drop_pts, bars.min_agreement) if int16 else None
        ),
        "latency": [
            latency_record(onnx_latency(artifact, sample, t, job.latency_runs), "onnxruntime", name)
            for t in thread_counts()
        ],
        "fallback_ops": unsupported_ops(onnx_op_histogram(artifact), profile),
        "int16_tensors": list(int16),
        "excluded": [
            schema.Exclusion(
                step=number,
                action=f"the {len(step.tensors)} most sensitive activations to int16",
                tensors=list(step.tensors),
                top1_drop_pts=step.drift.top1_drop_pts,
                agreement=step.drift.agreement,
                est_cost="the latency rows: ORT computes around int16 tensors in float",
            )
            for number, step in enumerate(steps, start=1)
        ],
    }
