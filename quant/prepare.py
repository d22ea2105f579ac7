"""A conversion's first step: load and fold the model once, export it once per opset and batch
its targets need, and leave everything the targets' builds read in the job's directories.

``prepare`` checks what was asked (targets, bars, data), loads and folds the model once (asked
to recalibrate its norms, it reads the data by the model's input names and recalibrates first),
reads the calibration and evaluation data, writes them as the .npy files every build
memory-maps, exports the folded model at each distinct opset/batch of its targets, runs the
first export on the evaluation data (the fp32 reference every target's drift is measured
against), and records all of it as a :class:`~quant.job_files.Prepared` in the work directory.
An export that fails fails the targets that need it, each with its reason, not the conversion.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
from pathlib import Path

import numpy as np
import onnx
import torch

from converters.attention_masks import bound_attention_masks
from converters.fold_and_export import FoldedSource, export_folded, fold_loaded
from converters.fx_attention_masks import bound_program_masks
from converters.fx_constants import fold_constant_subgraphs
from converters.fx_integer_argmax import integer_argmax_as_top1
from converters.loaded_source import LoadedSource, load_source
from converters.progress import Progress, ProgressEvent

from .errors import DataFileError, one_line
from .isolation import save_samples
from .job_files import FP32_OUTPUTS_FILE, ExportedModel, Prepared, export_key
from .measure.drift import onnx_runner
from .measure.graph_walk import static_batch
from .recalibration import check_recalibratable, recalibrate, recalibration_note
from .report import schema
from .request import ConversionRequest
from .samples import (
    CALIBRATION_SAMPLES,
    MIN_CALIBRATION_SAMPLES,
    MIN_EVALUATION_SAMPLES,
    InputSpec,
    Samples,
    checkpoint_samples,
    load_npz,
    sample_shapes,
)
from .sources import program_module_paths
from .targets.profiles import TargetProfile
from .tflite.direct import module_paths_file

# The opset and batch of the export that gives the fp32 reference when no target's could.
REFERENCE_EXPORT = (18, False)


def prepare(request: ConversionRequest, out_dir: Path, work_dir: Path, say: Progress) -> Prepared:
    """Everything before the targets' builds (``quant.pipeline.convert`` says what each part
    of the request means); the record is also saved in ``work_dir``."""
    calib, batches = request.calib, request.recalibrate_batches
    say(ProgressEvent("load", 0.01))
    # A model that leaves shapes open (a directory; a dynamic axis) takes the calibration
    # data's: its sequence length, its image size.
    shapes = sample_shapes(calib) if calib is not None else {}
    loaded = load_source(request.model, config=request.config, input_shapes=shapes)
    # folded before the data is read (a model that cannot fold is refused first), except when
    # its norms are recalibrated on that data: then once, after
    folded = None if batches else fold_loaded(loaded, allow_online=request.allow_online)
    if batches:
        check_recalibratable(loaded)
    specs = input_specs(loaded)
    calibration = _samples(calib, loaded, specs, "calibration")
    evaluation = _samples(request.eval, loaded, specs, "evaluation")
    recalibration = None
    if folded is None:
        say(ProgressEvent("recalibrate", 0.03))
        data = calibration if calib is not None else None  # None: the checkpoint's train split
        recalibration = recalibrate(loaded, data, evaluation, batches)
        folded = fold_loaded(loaded, allow_online=request.allow_online)
    del loaded  # an ONNX source's unfolded proto: the fold is what the rest reads
    profiles = request.targets
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    for part, samples in (("calibration", calibration), ("evaluation", evaluation)):
        save_samples(samples, work_dir / part)
    # before the exports: exporting to ONNX decomposes the folded graph in place (its SDPA
    # becomes MatMul/Softmax with the mask filled with float32-min, which nothing bounds then)
    program, no_program = tflite_program(folded, profiles, work_dir)
    exports, errors = _exports(folded, profiles, out_dir, say)
    reference, reference_note = _reference(folded, exports, out_dir, evaluation)
    fp32_outputs = None
    if reference is not None:
        fp32_outputs = work_dir / FP32_OUTPUTS_FILE
        np.save(fp32_outputs, reference)
    notes = (
        list(folded.fold.notes)
        + [export.note() for export in exports.values()]
        + list(dict.fromkeys(line for e in exports.values() for line in e.rewrites))
        + ([recalibration_note(recalibration, batches)] if recalibration else [])
        + ([reference_note] if reference_note else [])
    )
    prepared = Prepared(
        out_dir=out_dir,
        work_dir=work_dir,
        profiles=list(profiles),
        bars=request.bars,
        latency_runs=request.latency_runs,
        model=_model_info(folded, specs),
        fold=folded.fold.as_dict(),
        reference=schema.Reference(
            top1_fp32=_top1(reference, evaluation.labels),
            samples=len(evaluation),
            eval_source=evaluation.source,
            calibration_source=calibration.source,
            calibration_samples=len(calibration),
        ),
        recalibration=recalibration,
        notes=notes,
        exports=exports,
        export_errors=errors,
        fp32_outputs=fp32_outputs,
        program=program,
        no_program=no_program,
    )
    prepared.save()
    del folded, reference  # the model, its fold and its outputs: the builds read files
    release_freed_memory()
    return prepared


def release_freed_memory() -> None:
    """Hand the heap memory Python and torch have freed back to the system (glibc keeps it in
    the process otherwise): the process that prepared a conversion lives on beside the builds.
    BERT-base: the preparing process 2.2 -> 1.0 GB while its builds and their tools run."""
    gc.collect()  # a module's reference cycles, so that its tensors are freed now
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library this process runs
    if trim is not None:  # glibc's; another C library has no such call
        trim(0)


def _exports(
    folded: FoldedSource, profiles: tuple[TargetProfile, ...], out_dir: Path, say: Progress
) -> tuple[dict[str, ExportedModel], dict[str, str]]:
    """One fp32 export per opset and batch, in the order the targets first need them (the
    progress names that target); a failed one's one-line reason instead."""
    exports: dict[str, ExportedModel] = {}
    errors: dict[str, str] = {}
    for profile in profiles:
        key = export_key(profile.opset, profile.static_batch)
        if key in exports or key in errors:
            continue
        say(ProgressEvent("export", 0.04, target=profile.name))
        try:
            exports[key] = _export(folded, out_dir, profile.opset, profile.static_batch)
        except (ValueError, RuntimeError, OSError) as error:  # ConversionError is a ValueError
            errors[key] = one_line(error)
    return exports, errors


def _reference(
    folded: FoldedSource, exports: dict[str, ExportedModel], out_dir: Path, evaluation: Samples
) -> tuple[np.ndarray | None, str | None]:
    """fp32 outputs on the evaluation data, from the first export, and a note when there is
    none: every export failed, and exporting once more for the reference fails too (each
    target's own reason is in its report). Once, not once per export: the exports compute the
    same function at another opset or batch (BERT-base's opset 17, 20 and 21 files give the same
    outputs bit for bit), and each run was ~14 s of BERT-base's preparation, before any build."""
    if not exports:
        opset, static = REFERENCE_EXPORT
        try:
            exported = _export(folded, out_dir, opset, static)
        except (ValueError, RuntimeError, OSError) as error:
            return None, f"no fp32 reference: the fp32 export failed ({one_line(error)})"
        exports[export_key(opset, static)] = exported
    return onnx_runner(next(iter(exports.values())).path)(evaluation.feeds), None


def _export(folded: FoldedSource, out_dir: Path, opset: int, static: bool) -> ExportedModel:
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
    return ExportedModel(
        path=path,
        opset=opset,
        static_batch=static,
        batch=batch,
        rewrites=list(rewrites.lines()),
    )


class _Logits(torch.nn.Module):
    """The model returning its logits alone: a program that returns a library's output class
    (transformers' ImageClassifierOutput) cannot be loaded where that class is not registered,
    and the targets measure the logits only (the ONNX export's output, the same rule as
    converters.program_outputs: ``logits``, else the first tensor)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(*inputs)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else torch.utils._pytree.tree_leaves(out)[0]


def tflite_program(
    folded: FoldedSource, profiles: tuple[TargetProfile, ...], work_dir: Path
) -> tuple[Path | None, str | None]:
    """The folded program at batch 1 as a .pt2 for the TFLite targets' direct route
    (quant.tflite.direct), or None and why not (those targets then take the onnx2tf route)."""
    if not any("tflite" in profile.artifacts for profile in profiles):
        return None, None
    if folded.is_onnx:
        return None, "an ONNX source has no torch program"
    if folded.fixed_batch not in (None, 1):
        return None, f"the program was exported at batch {folded.fixed_batch}, not 1"
    path = work_dir / "program.pt2"
    try:
        example = tuple(a[:1] for a in folded.example)
        folded_copy = copy.deepcopy(folded.folded)
        bound_program_masks(folded_copy)  # as bound_attention_masks does to the ONNX export
        integer_argmax_as_top1(folded_copy)  # Vela compiles no model with an int32 ARG_MAX
        fold_constant_subgraphs(folded_copy)  # as the ONNX exporter folds them
        with torch.no_grad():
            plain = isinstance(folded_copy(*example), torch.Tensor)
        # a wrapper's program names every op after it: only where the output needs one
        module = folded_copy if plain else _Logits(folded_copy)
        program = torch.export.export(module, example)
        torch.export.save(program, str(path))
        drop = "" if plain else "model."  # the wrapper's attribute is not the user's
        paths = program_module_paths(program.graph.nodes, drop)
        module_paths_file(path).write_text(json.dumps(paths, indent=1) + "\n")
    except Exception as error:
        return None, f"the folded program could not be saved for LiteRT: {one_line(error)}"
    return path, None


def input_specs(source: LoadedSource | FoldedSource) -> tuple[InputSpec, ...]:
    """Each model input: its name, one sample's shape (-1 where the file leaves it open), dtype."""
    if source.is_onnx:  # the fold keeps an ONNX model's inputs as they are
        proto = source.folded if isinstance(source, FoldedSource) else source.model
        values = {v.name: v.type.tensor_type for v in proto.graph.input}
        specs = []
        for name in source.input_names:
            dims = [d.dim_value if d.dim_value > 0 else -1 for d in values[name].shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(values[name].elem_type)
            specs.append(InputSpec(name, tuple(dims[1:]), np.dtype(dtype).name))
        return tuple(specs)
    return tuple(
        InputSpec(name, tuple(example.shape[1:]), str(example.numpy().dtype))
        for name, example in zip(source.input_names, source.example, strict=True)
    )


def _samples(
    path: str | Path | None, loaded: LoadedSource, specs: tuple[InputSpec, ...], purpose: str
) -> Samples:
    calibrating = purpose == "calibration"
    if path is not None:
        minimum = MIN_CALIBRATION_SAMPLES if calibrating else MIN_EVALUATION_SAMPLES
        return load_npz(path, specs, purpose=purpose, minimum=minimum)
    if loaded.info is None or "dataset" not in loaded.info.metadata:
        flag = "--calib" if calibrating else "--eval"
        arrays = ", ".join(f"'{spec.name}'" for spec in specs)
        raise DataFileError(
            f"{loaded.source.path.name} records no data set: give {purpose} data as an .npz "
            f"({flag} F.npz with {arrays} and optional 'labels')"
        )
    if calibrating:
        return checkpoint_samples(loaded.info, "train", CALIBRATION_SAMPLES, specs)
    return checkpoint_samples(loaded.info, "test", specs=specs)


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
