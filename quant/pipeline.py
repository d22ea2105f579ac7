"""The one conversion pipeline: load, fold, export per target, quantize, compile, measure, report.

``convert`` is what ``edge-un convert`` and the HTTP service both run. It builds on the fp32
conversion in :mod:`converters.pipeline` (one load and one fold, then one ONNX export per
distinct opset/batch the targets need), writes every artifact plus ``report.json`` and
``report.md`` into ``out_dir``, and reports progress as ``progress(stage, fraction)``.
A target that fails (a converter crash, a rule its file breaks) is reported as failed with its
one-line reason; the other targets still complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import edge_un
from converters.pipeline import FoldedSource, export_folded, load_and_fold

from . import report as schema
from .data import (
    CALIBRATION_SAMPLES,
    MIN_CALIBRATION_SAMPLES,
    MIN_EVALUATION_SAMPLES,
    InputSpec,
    Samples,
    checkpoint_samples,
    load_npz,
)
from .drift import onnx_runner
from .errors import DataFileError, QuantError
from .host import describe_host
from .job import Bars, TargetJob
from .onnx_target import build_onnx_target
from .recalibration import check_recalibratable, recalibrate_and_fold, recalibration_note
from .records import artifact_record
from .summary import summary_markdown
from .targets import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT, TargetProfile, parse_targets
from .tflite_target import build_tflite_target

Progress = Callable[[str, float], None]
REPORT_NAME = "report.json"
SUMMARY_NAME = "report.md"


@dataclass(frozen=True)
class Export:
    """One fp32 folded ONNX file and its outputs on the evaluation data."""

    path: Path
    opset: int
    static_batch: bool
    reference: np.ndarray


def convert(
    model: str | Path,
    targets: str | Sequence[str] | None = None,
    calib: str | Path | None = None,
    eval: str | Path | None = None,  # the name for the evaluation data
    out_dir: str | Path = "edge-un-out",
    max_drift: float = DEFAULT_MAX_DRIFT,
    progress: Progress | None = None,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    allow_online: bool = False,
    latency_runs: int = 100,
    recalibrate_batches: int = 0,
) -> schema.Report:
    """Convert ``model`` for ``targets`` (names or "cpu,imx93"; default all) into ``out_dir``.

    ``allow_online`` lets a LayerNorm model through (its norms stay: decomposed into int8 ops in
    TFLite, float in ORT), for comparisons; by default such a model is refused with the advice
    to migrate it. ``recalibrate_batches`` > 0 (a checkpoint with offline norms only) first
    recomputes every offline norm's inference statistics over that many batches of the
    calibration data (``calib``, else the checkpoint's training split) with
    :func:`edge_un.recalibrate`, then folds; the report's ``recalibration`` says how it went.
    """
    say = progress or (lambda stage, fraction: None)
    profiles = parse_targets(",".join(targets) if isinstance(targets, list | tuple) else targets)
    if max_drift < 0:
        raise QuantError(f"max_drift must be >= 0 points, got {max_drift}")
    if recalibrate_batches < 0:
        raise QuantError(f"recalibrate_batches must be >= 0, got {recalibrate_batches}")
    out_dir = Path(out_dir).resolve()  # artifact names are relative to it, tools return absolute
    say("load", 0.01)
    folded = load_and_fold(model, config=config, allow_online=allow_online)
    if recalibrate_batches:
        check_recalibratable(folded)
    spec = _input_spec(folded)
    calibration = _samples(calib, folded, spec, "calibration")
    evaluation = _samples(eval, folded, spec, "evaluation")
    recalibration = None
    if recalibrate_batches:
        say("recalibrate", 0.03)
        data = calibration if calib is not None else None  # None: the checkpoint's train split
        folded, recalibration = recalibrate_and_fold(
            folded, data, evaluation, recalibrate_batches, allow_online
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    bars = Bars(max_drift, min_agreement)
    exports: dict[tuple[int, bool], Export] = {}
    reports: dict[str, schema.TargetReport] = {}
    for index, profile in enumerate(profiles):
        span = (0.05 + 0.9 * index / len(profiles), 0.05 + 0.9 * (index + 1) / len(profiles))

        def stage(name: str, fraction: float, profile: TargetProfile = profile, span=span) -> None:
            say(f"{profile.name}: {name}", span[0] + (span[1] - span[0]) * fraction)

        reports[profile.name] = _build_target(
            profile, folded, exports, out_dir, calibration, evaluation, bars, stage, latency_runs
        )
    say("report", 0.97)
    result = schema.Report(
        edge_un_version=edge_un.__version__,
        model=_model_info(folded, spec),
        fold=folded.fold.as_dict(),
        reference=schema.Reference(
            top1_fp32=_top1(_reference(folded, exports, out_dir, evaluation), evaluation.labels),
            samples=len(evaluation),
            eval_source=evaluation.source,
            calibration_source=calibration.source,
            calibration_samples=len(calibration),
        ),
        max_drift_pts=max_drift,
        min_agreement=min_agreement,
        targets=reports,
        notes=[
            f"fp32 folded model exported at opset {e.opset}, "
            f"{'static batch 1' if e.static_batch else 'dynamic batch'}: {e.path.name}"
            for e in exports.values()
        ]
        + ([recalibration_note(recalibration, recalibrate_batches)] if recalibration else []),
        recalibration=recalibration,
        host=describe_host(),
    )
    result.write(out_dir / REPORT_NAME)
    (out_dir / SUMMARY_NAME).write_text(summary_markdown(result))
    say("done", 1.0)
    return result


def _build_target(
    profile: TargetProfile,
    folded: FoldedSource,
    exports: dict[tuple[int, bool], Export],
    out_dir: Path,
    calibration: Samples,
    evaluation: Samples,
    bars: Bars,
    stage: Callable[[str, float], None],
    latency_runs: int,
) -> schema.TargetReport:
    target_dir = out_dir / profile.name
    target_dir.mkdir(exist_ok=True)
    base = {
        "name": profile.name,
        "board": profile.board,
        "runtime": profile.runtime,
        "opset": profile.opset,
        "rules": list(profile.rules),
    }
    build = build_onnx_target if "onnx_qdq" in profile.artifacts else build_tflite_target
    try:
        stage("export", 0.0)
        key = (profile.opset, profile.static_batch)
        if key not in exports:
            exports[key] = _export(folded, out_dir, *key, evaluation)
        export = exports[key]
        job = TargetJob(
            profile, export.path, target_dir, out_dir, calibration, evaluation,
            export.reference, bars, stage, latency_runs,
        )  # fmt: skip
        fields = build(job)
    except (ValueError, RuntimeError, OSError) as error:  # Quant/ConversionError are ValueErrors
        return schema.TargetReport(**base, status="failed", error=_one_line(error))
    fields["artifacts"].append(
        artifact_record(export.path, out_dir, "onnx", "folded fp32 ONNX it was quantized from")
    )
    status = "ok" if fields["drift"].within_bar else "over_bar"
    return schema.TargetReport(**base, status=status, **fields)


def _reference(
    folded: FoldedSource,
    exports: dict[tuple[int, bool], Export],
    out_dir: Path,
    evaluation: Samples,
) -> np.ndarray:
    """fp32 outputs on the evaluation data, from any export (all of them agree to ~1e-5)."""
    if not exports:  # every target failed before exporting: export once for the reference
        exports[(18, False)] = _export(folded, out_dir, 18, False, evaluation)
    return next(iter(exports.values())).reference


def _export(
    folded: FoldedSource, out_dir: Path, opset: int, static: bool, evaluation: Samples
) -> Export:
    fp32_dir = out_dir / "fp32"
    fp32_dir.mkdir(exist_ok=True)
    path = fp32_dir / f"model_opset{opset}_{'b1' if static else 'dynamic'}.onnx"
    export_folded(folded, path, opset=opset, dynamic_batch=not static)
    return Export(path, opset, static, onnx_runner(path)(evaluation.inputs))


def _input_spec(folded: FoldedSource) -> InputSpec:
    if folded.is_onnx:
        value = folded.folded.graph.input[0]
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        return InputSpec(tuple(dims[1:]), np.dtype(dtype).name)
    example = folded.example[0]
    return InputSpec(tuple(example.shape[1:]), str(example.numpy().dtype))


def _samples(
    path: str | Path | None, folded: FoldedSource, spec: InputSpec, purpose: str
) -> Samples:
    calibrating = purpose == "calibration"
    if path is not None:
        minimum = MIN_CALIBRATION_SAMPLES if calibrating else MIN_EVALUATION_SAMPLES
        return load_npz(path, spec, purpose=purpose, minimum=minimum)
    if folded.info is None or "dataset" not in folded.info.metadata:
        flag = "--calib" if calibrating else "--eval"
        raise DataFileError(
            f"{folded.source.name} records no data set: give {purpose} data as an .npz "
            f"({flag} F.npz with 'inputs' and optional 'labels')"
        )
    if calibrating:
        return checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES)
    return checkpoint_samples(folded.info, "test")


def _model_info(folded: FoldedSource, spec: InputSpec) -> schema.ModelInfo:
    suffix = folded.source.suffix.lstrip(".")
    parameters = None
    if folded.model is not None and hasattr(folded.model, "parameters"):
        parameters = sum(p.numel() for p in folded.model.parameters())
    return schema.ModelInfo(
        name=folded.source.stem,
        source_format="pt" if suffix == "pth" else suffix,
        parameters=parameters,
        input_shape=list(spec.shape),
        input_dtype=spec.dtype,
    )


def _top1(logits: np.ndarray, labels: np.ndarray | None) -> float | None:
    return None if labels is None else float((logits.argmax(-1) == labels).mean())


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
