"""The one conversion pipeline: load, fold, export per target, quantize, compile, measure, report.

``convert`` is what ``edge-un convert`` and the HTTP service both run. It builds on the fp32
conversion in :mod:`converters.pipeline` (one load and one fold, then one ONNX export per
distinct opset/batch the targets need), writes every artifact plus ``report.json`` and
``report.md`` into ``out_dir``, and reports progress as :class:`~converters.ProgressEvent`
values, each stage of a target's build tagged with the target.
A target that fails (a converter crash, a rule its file breaks) is reported as failed with its
one-line reason; the other targets still complete (``Report.outcome`` says how it ended).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import edge_un
from converters.attention_masks import bound_attention_masks
from converters.pipeline import FoldedSource, export_folded, load_and_fold
from converters.progress import Progress, ProgressEvent, ignore_progress
from converters.source import ModelSource

from . import report as schema
from .data import (
    CALIBRATION_SAMPLES,
    MIN_CALIBRATION_SAMPLES,
    MIN_EVALUATION_SAMPLES,
    InputSpec,
    Samples,
    checkpoint_samples,
    load_npz,
    sample_shapes,
)
from .drift import onnx_runner
from .errors import DataFileError, QuantError, one_line
from .host import describe_host
from .isolation import IsolatedBuilds, builder_for
from .ort_int8 import static_batch
from .recalibration import check_recalibratable, recalibrate_and_fold, recalibration_note
from .records import artifact_record
from .summary import summary_markdown
from .target_job import Bars, StageCallback, TargetJob
from .targets import (
    DEFAULT_MAX_DRIFT,
    DEFAULT_MIN_AGREEMENT,
    TargetProfile,
    resolve_targets,
)


@dataclass(frozen=True)
class Export:
    """One fp32 folded ONNX file and its outputs on the evaluation data."""

    path: Path
    opset: int
    static_batch: bool
    reference: np.ndarray
    rewrites: tuple[str, ...]  # what was changed in the exported graph for int8, one line each
    batch: int | None  # the file's fixed batch size; None: dynamic

    def note(self) -> str:
        batch = "dynamic batch" if self.batch is None else f"static batch {self.batch}"
        return f"fp32 folded model exported at opset {self.opset}, {batch}: {self.path.name}"


def convert(
    model: ModelSource | str | Path,
    targets: str | Sequence[TargetProfile | str] | None = None,
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
    """Convert ``model`` for ``targets`` (profiles or their names, ``["cpu", "imx93"]`` or
    ``"cpu,imx93"``; default: every profile) into ``out_dir``. A path is
    read in the format its name says; the service passes the :class:`ModelSource` its upload
    checks established (its ``name`` is what the report calls the model).

    ``allow_online`` lets a LayerNorm model through (its norms stay: decomposed into int8 ops in
    TFLite, float in ORT), for comparisons; by default such a model is refused with the advice
    to migrate it. ``recalibrate_batches`` > 0 (a checkpoint with offline norms only) first
    recomputes every offline norm's inference statistics over that many batches of the
    calibration data (``calib``, else the checkpoint's training split) with
    :func:`edge_un.recalibrate`, then folds; the report's ``recalibration`` says how it went.
    """
    say = progress or ignore_progress
    profiles = resolve_targets(targets)
    if not profiles:
        raise QuantError("no targets to build: name at least one")
    if max_drift < 0:
        raise QuantError(f"max_drift must be >= 0 points, got {max_drift}")
    if recalibrate_batches < 0:
        raise QuantError(f"recalibrate_batches must be >= 0, got {recalibrate_batches}")
    out_dir = Path(out_dir).resolve()  # artifact names are relative to it, tools return absolute
    say(ProgressEvent("load", 0.01))
    # A model that leaves shapes open (a directory; a dynamic axis) takes the calibration
    # data's: its sequence length, its image size.
    shapes = sample_shapes(calib) if calib is not None else {}
    folded = load_and_fold(model, config=config, allow_online=allow_online, input_shapes=shapes)
    if recalibrate_batches:
        check_recalibratable(folded)
    specs = _input_specs(folded)
    calibration = _samples(calib, folded, specs, "calibration")
    evaluation = _samples(eval, folded, specs, "evaluation")
    recalibration = None
    if recalibrate_batches:
        say(ProgressEvent("recalibrate", 0.03))
        data = calibration if calib is not None else None  # None: the checkpoint's train split
        folded, recalibration = recalibrate_and_fold(
            folded, data, evaluation, recalibrate_batches, allow_online
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    bars = Bars(max_drift, min_agreement)
    exports: dict[tuple[int, bool], Export] = {}
    reports: dict[str, schema.TargetReport] = {}
    with tempfile.TemporaryDirectory(prefix="edge-un-targets-") as scratch:
        builds = IsolatedBuilds(Path(scratch), calibration, evaluation)
        for index, profile in enumerate(profiles):
            span = (0.05 + 0.9 * index / len(profiles), 0.05 + 0.9 * (index + 1) / len(profiles))

            def stage(
                name: str, fraction: float, detail: str | None = None, target=profile, span=span
            ) -> None:
                at = span[0] + (span[1] - span[0]) * fraction
                say(ProgressEvent(name, at, target=target.name, detail=detail))

            reports[profile.name] = _build_target(
                profile, folded, exports, out_dir, builds, bars, stage, latency_runs
            )
    say(ProgressEvent("report", 0.97))
    reference, reference_note = _reference(folded, exports, out_dir, evaluation)
    result = schema.Report(
        edge_un_version=edge_un.__version__,
        model=_model_info(folded, specs),
        fold=folded.fold.as_dict(),
        reference=schema.Reference(
            top1_fp32=_top1(reference, evaluation.labels),
            samples=len(evaluation),
            eval_source=evaluation.source,
            calibration_source=calibration.source,
            calibration_samples=len(calibration),
        ),
        max_drift_pts=bars.max_drop_pts,
        min_agreement=bars.min_agreement,
        targets=reports,
        notes=list(folded.fold.notes)
        + [export.note() for export in exports.values()]
        + list(dict.fromkeys(line for e in exports.values() for line in e.rewrites))
        + ([recalibration_note(recalibration, recalibrate_batches)] if recalibration else [])
        + ([reference_note] if reference_note else []),
        recalibration=recalibration,
        host=describe_host(),
    )
    result.write(out_dir / schema.REPORT_FILE)
    (out_dir / schema.SUMMARY_FILE).write_text(summary_markdown(result))
    say(ProgressEvent("done", 1.0))
    return result


def _build_target(
    profile: TargetProfile,
    folded: FoldedSource,
    exports: dict[tuple[int, bool], Export],
    out_dir: Path,
    builds: IsolatedBuilds,
    bars: Bars,
    stage: StageCallback,
    latency_runs: int,
) -> schema.TargetReport:
    """Export the fp32 file the target needs (once per opset and batch), then build the
    target in a process of its own; any failure, a native crash included, fails this target
    only, with its one-line reason."""
    target_dir = out_dir / profile.name
    target_dir.mkdir(exist_ok=True)
    try:
        stage("export", 0.0)
        key = (profile.opset, profile.static_batch)
        if key not in exports:
            exports[key] = _export(folded, out_dir, *key, builds.samples["evaluation"])
        export = exports[key]
        job = TargetJob(
            profile, export.path, target_dir, out_dir, builds.samples["calibration"],
            builds.samples["evaluation"], export.reference, bars, stage, latency_runs,
        )  # fmt: skip
        result = builds.build(builder_for(profile), job)
    except (ValueError, RuntimeError, OSError) as error:  # Quant/ConversionError are ValueErrors
        return target_report(profile, schema.TargetResult(), error=one_line(error))
    source = artifact_record(export.path, out_dir, "onnx", "folded fp32 ONNX it was quantized from")
    result = result.model_copy(update={"artifacts": [*result.artifacts, source]})
    return target_report(profile, result)


def target_report(
    profile: TargetProfile, result: schema.TargetResult, error: str | None = None
) -> schema.TargetReport:
    """A target's entry in the report: its profile's header, what its builder made and
    measured, and how it ended (failed with ``error``; else ok or over the drift bar)."""
    if error is not None:
        status = "failed"
    else:
        status = "ok" if result.drift is not None and result.drift.within_bar else "over_bar"
    header = {key: getattr(profile, key) for key in ("name", "board", "runtime", "opset")}
    rules = list(profile.rules)
    return schema.TargetReport(**header, rules=rules, status=status, error=error, **dict(result))


def _reference(
    folded: FoldedSource,
    exports: dict[tuple[int, bool], Export],
    out_dir: Path,
    evaluation: Samples,
) -> tuple[np.ndarray | None, str | None]:
    """fp32 outputs on the evaluation data, from any export (all of them agree to ~1e-5), and
    a note when there is none: every target failed before exporting and exporting once more
    fails too (each target's own reason is in its report)."""
    if not exports:
        try:
            exports[(18, False)] = _export(folded, out_dir, 18, False, evaluation)
        except (ValueError, RuntimeError, OSError) as error:
            return None, f"no fp32 reference: the fp32 export failed ({one_line(error)})"
    return next(iter(exports.values())).reference, None


def _export(
    folded: FoldedSource, out_dir: Path, opset: int, static: bool, evaluation: Samples
) -> Export:
    fp32_dir = out_dir / "fp32"
    fp32_dir.mkdir(exist_ok=True)
    exported = fp32_dir / f"model_opset{opset}.onnx"
    export_folded(folded, exported, opset=opset, dynamic_batch=not static)
    proto = onnx.load(str(exported))
    # float32-min attention masks would take all of int8's range (converters.attention_masks);
    # the reference is of the rewritten file, which the fp32 model matches to e^-30
    rewrites = bound_attention_masks(proto)
    batch = static_batch(proto)  # a source with static shapes keeps its batch size
    path = fp32_dir / f"model_opset{opset}_{'dynamic' if batch is None else f'b{batch}'}.onnx"
    onnx.save_model(proto, str(path))
    exported.unlink()
    onnx.checker.check_model(str(path), full_check=True)
    reference = onnx_runner(path)(evaluation.feeds)
    return Export(path, opset, static, reference, tuple(rewrites.lines()), batch)


def _input_specs(folded: FoldedSource) -> tuple[InputSpec, ...]:
    """Each model input: its name, one sample's shape (-1 where the file leaves it open), dtype."""
    if folded.is_onnx:
        values = {v.name: v.type.tensor_type for v in folded.folded.graph.input}
        specs = []
        for name in folded.input_names:
            dims = [d.dim_value if d.dim_value > 0 else -1 for d in values[name].shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(values[name].elem_type)
            specs.append(InputSpec(name, tuple(dims[1:]), np.dtype(dtype).name))
        return tuple(specs)
    return tuple(
        InputSpec(name, tuple(example.shape[1:]), str(example.numpy().dtype))
        for name, example in zip(folded.input_names, folded.example, strict=True)
    )


def _samples(
    path: str | Path | None, folded: FoldedSource, specs: tuple[InputSpec, ...], purpose: str
) -> Samples:
    calibrating = purpose == "calibration"
    if path is not None:
        minimum = MIN_CALIBRATION_SAMPLES if calibrating else MIN_EVALUATION_SAMPLES
        return load_npz(path, specs, purpose=purpose, minimum=minimum)
    if folded.info is None or "dataset" not in folded.info.metadata:
        flag = "--calib" if calibrating else "--eval"
        arrays = ", ".join(f"'{spec.name}'" for spec in specs)
        raise DataFileError(
            f"{folded.source.path.name} records no data set: give {purpose} data as an .npz "
            f"({flag} F.npz with {arrays} and optional 'labels')"
        )
    if calibrating:
        return checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES, specs)
    return checkpoint_samples(folded.info, "test", specs=specs)


def _model_info(folded: FoldedSource, specs: tuple[InputSpec, ...]) -> schema.ModelInfo:
    parameters = None
    if folded.model is not None and hasattr(folded.model, "parameters"):
        parameters = sum(p.numel() for p in folded.model.parameters())
    return schema.ModelInfo(
        name=folded.source.display_name,
        source_format=folded.source.format,
        parameters=parameters,
        input_shape=list(specs[0].shape),
        input_dtype=specs[0].dtype,
        inputs=[
            schema.ModelInput(name=spec.name, shape=list(spec.shape), dtype=spec.dtype)
            for spec in specs
        ],
    )


def _top1(logits: np.ndarray | None, labels: np.ndarray | None) -> float | None:
    if logits is None or labels is None:
        return None
    return float((logits.argmax(-1) == labels).mean())
