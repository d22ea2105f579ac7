"""The conversion job: a model file in; a folded fp32 ONNX file and its report out.

Sources (read by ``converters.loaded_source``): an edge_un checkpoint (``.safetensors``, or
``.pt``/``.pth`` with a config), a Hugging Face directory, a ``torch.export`` program (``.pt2``)
or an fp32 ONNX model (``.onnx``). An edge_un checkpoint that
records its data set is also checked on its held-out test split: the folded ONNX model must
classify like the original torch model, and the report says how closely it did.

Progress goes to an optional ``progress`` callback as :class:`~converters.progress.ProgressEvent`
values (a terminal bar in the CLI, a stage and percentage over HTTP).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn

import edge_un
from edge_un.training.inputs import logits_of

from .errors import ConversionError
from .export import ExportInfo, export_onnx, op_histogram
from .fold import fold_norms
from .fold_report import FoldReport
from .loaded_source import LoadedSource, load_source
from .onnx_fold import fold_onnx
from .onnx_load import load_onnx, onnx_input_names
from .opset import convert_opset, with_static_batch
from .progress import Progress, ProgressEvent, ignore_progress
from .source import ModelSource

ONNX_NAME = "model.onnx"
REPORT_NAME = "report.json"
SUMMARY_NAME = "report.md"
EVAL_BATCH = 256


@dataclass(frozen=True)
class TestSplitCheck:
    """The folded ONNX model against the original torch model on the checkpoint's test split."""

    samples: int
    torch_accuracy: float
    onnx_accuracy: float
    top1_agreement: float
    max_abs_diff: float


@dataclass(frozen=True)
class ConversionResult:
    source: Path
    onnx_path: Path
    report_path: Path
    summary_path: Path
    fold: FoldReport
    export: ExportInfo | None  # None for an ONNX source (folded at graph level, not exported)
    test_split: TestSplitCheck | None
    op_histogram: dict[str, int]
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        exported = None
        if self.export is not None:
            exported = {**asdict(self.export), "path": str(self.export.path)}
        return {
            "source": str(self.source),
            "edge_un_version": edge_un.__version__,
            "onnx": str(self.onnx_path),
            "fold": self.fold.as_dict(),
            "export": exported,
            "op_histogram": self.op_histogram,
            "test_split": None if self.test_split is None else asdict(self.test_split),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class FoldedSource:
    """A loaded and folded model, ready to be exported at any opset/batch (one load, one fold).

    ``model`` is the original torch model (or program) the folded one is checked against;
    ``folded`` is the folded GraphModule, or the folded ONNX proto for an ONNX source;
    ``test_split`` is (inputs, labels) when the checkpoint records its data set, the inputs one
    tensor per model input in the model's order.
    """

    source: ModelSource
    fold: FoldReport
    folded: Any
    model: Any
    example: tuple[Tensor, ...]
    test_split: tuple[tuple[Tensor, ...], Tensor] | None
    info: edge_un.CheckpointInfo | None
    # one sample of each input (no batch axis) as the user's data has it: what an ONNX
    # source's open dimensions are fixed to for a target that needs static shapes
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_onnx(self) -> bool:
        return isinstance(self.folded, onnx.ModelProto)

    @property
    def fixed_batch(self) -> int | None:
        """The batch size a torch program was exported with static shapes for (its graph bakes
        it into reshapes, so no export can make it dynamic); None when the batch is dynamic."""
        if self.is_onnx:
            return None
        for node in self.folded.graph.nodes:
            value = node.meta.get("val") if node.op == "placeholder" else None
            if value is not None and getattr(value, "ndim", 0) and isinstance(value.shape[0], int):
                return int(value.shape[0])
        return None

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's inputs, in order, as every export of it names them (a torch model's
        forward arguments: ``images``; ``input_ids``, ``attention_mask``)."""
        if self.is_onnx:
            return onnx_input_names(self.folded)
        return tuple(n.name for n in self.folded.graph.nodes if n.op == "placeholder")


def fold_loaded(loaded: LoadedSource, *, allow_online: bool = False) -> FoldedSource:
    """Fold every offline norm of ``loaded``'s model (its statistics as they are now)."""
    if loaded.is_onnx:
        folded, fold_report = fold_onnx(loaded.model, allow_online=allow_online)
        fold_report = replace(fold_report, source=loaded.source.path.name)
    else:
        folded, fold_report = fold_norms(loaded.model, loaded.example, allow_online=allow_online)
    result = FoldedSource(
        loaded.source, fold_report, folded, None if loaded.is_onnx else loaded.model,
        loaded.example, loaded.test_split, loaded.info, loaded.input_shapes,
    )  # fmt: skip
    if result.input_names != loaded.input_names:  # what the data was read by must be the graph's
        raise ConversionError(
            f"{loaded.source.path.name}: the folded graph takes {list(result.input_names)}, "
            f"not the inputs {list(loaded.input_names)} its source names"
        )
    return result


def load_and_fold(
    source: ModelSource | str | Path,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    allow_online: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> FoldedSource:
    """:func:`load_source` then :func:`fold_loaded`: read ``source`` and fold every offline
    norm."""
    loaded = load_source(source, config=config, input_shapes=input_shapes)
    return fold_loaded(loaded, allow_online=allow_online)


def export_folded(
    folded: FoldedSource, path: Path, *, opset: int = 18, dynamic_batch: bool = True
) -> ExportInfo | None:
    """Write the folded model to ``path`` as one ONNX file at ``opset``, with a dynamic batch or
    batch 1. A torch model is exported (and checked against torch: the ExportInfo); an ONNX
    source is converted in place (opset via onnx's version converter, batch fixed by shape
    inference) and checked with onnx.checker (returns None: nothing was exported)."""
    if folded.is_onnx:
        shapes = folded.input_shapes
        proto = folded.folded if dynamic_batch else with_static_batch(folded.folded, 1, shapes)
        proto = convert_opset(proto, opset)
        onnx.save_model(proto, str(path), save_as_external_data=False)
        onnx.checker.check_model(str(path), full_check=True)
        return None
    fixed = folded.fixed_batch
    if fixed is not None:  # a program exported with static shapes keeps them (batch `fixed`)
        dynamic_batch = False
    example = folded.example if dynamic_batch else tuple(a[: fixed or 1] for a in folded.example)
    return export_onnx(folded.folded, example, path, opset=opset, dynamic_batch=dynamic_batch)


def convert(
    source: ModelSource | str | Path,
    out_dir: str | Path,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    opset: int = 18,
    dynamic_batch: bool = True,
    allow_online: bool = False,
    progress: Progress | None = None,
) -> ConversionResult:
    """Fold every offline norm of ``source`` and write ``model.onnx``, ``report.json`` and
    ``report.md`` into ``out_dir``. Raises a ConversionError / CheckpointError (one line)."""
    out_dir = Path(out_dir)
    report = progress or ignore_progress
    report(ProgressEvent("load", 0.05))
    folded = load_and_fold(source, config=config, allow_online=allow_online)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / ONNX_NAME
    report(ProgressEvent("export", 0.4))
    exported = export_folded(folded, onnx_path, opset=opset, dynamic_batch=dynamic_batch)
    report(ProgressEvent("verify", 0.7))
    if folded.is_onnx:
        diff = _onnx_vs_onnx(folded.source.path, onnx_path)
        notes: tuple[str, ...] = (
            f"ONNX Runtime, folded vs original on random inputs: max abs diff {diff:.3g}",
        )
        check = None
    else:
        check = (
            None
            if folded.test_split is None
            else _check_test_split(folded.model, onnx_path, *folded.test_split)
        )
        notes = () if check else ("no data set recorded in the checkpoint: test split not checked",)
    report(ProgressEvent("write report", 0.95))
    result = ConversionResult(
        source=folded.source.path,
        onnx_path=onnx_path,
        report_path=out_dir / REPORT_NAME,
        summary_path=out_dir / SUMMARY_NAME,
        fold=folded.fold,
        export=exported,
        test_split=check,
        op_histogram=op_histogram(onnx.load(str(onnx_path))),
        notes=notes,
    )
    result.report_path.write_text(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
    result.summary_path.write_text(summary_markdown(result))
    report(ProgressEvent("done", 1.0))
    return result


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # its graph clean-up notes are not the user's concern
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def _check_test_split(
    model: nn.Module, onnx_path: Path, inputs: tuple[Tensor, ...], labels: Tensor
) -> TestSplitCheck:
    session = _session(onnx_path)
    names = [value.name for value in session.get_inputs()]
    static_batch = session.get_inputs()[0].shape[0]
    batch = static_batch if isinstance(static_batch, int) else EVAL_BATCH
    reference, converted = [], []
    for start in range(0, len(labels), batch):
        chunk = tuple(tensor[start : start + batch] for tensor in inputs)
        reference.append(logits_of(model(*chunk)).numpy())
        feed = {name: tensor.numpy() for name, tensor in zip(names, chunk, strict=True)}
        converted.append(session.run(None, feed)[0])
    expected, actual = np.concatenate(reference), np.concatenate(converted)
    truth = labels.numpy()
    return TestSplitCheck(
        samples=len(truth),
        torch_accuracy=float((expected.argmax(-1) == truth).mean()),
        onnx_accuracy=float((actual.argmax(-1) == truth).mean()),
        top1_agreement=float((expected.argmax(-1) == actual.argmax(-1)).mean()),
        max_abs_diff=float(np.abs(expected - actual).max()),
    )


def _onnx_vs_onnx(original: Path, folded: Path) -> float:
    """Max abs output difference of two ONNX files on the same random inputs (shaped as the
    folded file takes them: it may have a static batch the original does not)."""
    rng = np.random.default_rng(0)
    before, after = _session(original), _session(folded)
    feeds = {}
    for value in load_onnx(folded).graph.input:
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.dim_value > 0 else 2 for d in tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        feeds[value.name] = (
            rng.standard_normal(dims).astype(dtype)
            if np.issubdtype(dtype, np.floating)
            else np.ones(dims, dtype=dtype)  # ids/indices: 1 is valid for any vocabulary
        )
    outputs = zip(before.run(None, feeds), after.run(None, feeds), strict=True)
    return max(float(np.abs(a - b).max()) for a, b in outputs)


def summary_markdown(result: ConversionResult) -> str:
    """The report for a person: what happened to each norm, the graph, the test-split check."""
    fold = result.fold
    lines = [
        f"# edge-un conversion: {result.source.name}",
        "",
        f"- folded fp32 model: `{result.onnx_path.name}`",
        f"- offline norms: {len(fold.norms)}, folded {len(fold.folded)}, "
        f"kept as one Mul+Add {len(fold.kept)}",
        f"- fully integer-ready (no online norm left): {'yes' if fold.fully_integer else 'NO'}"
        + ("" if fold.fully_integer else f" (online: {', '.join(fold.online_norms)})"),
    ]
    if result.export is not None:
        exported = result.export
        lines += [
            f"- opset {exported.opset}, batch {'dynamic' if exported.dynamic_batch else 'static'}, "
            f"ONNX Runtime vs torch on the example inputs: max abs diff "
            f"{exported.max_abs_diff:.3g}",
        ]
    if result.test_split is not None:
        check = result.test_split
        lines += [
            f"- test split ({check.samples} samples): torch accuracy {check.torch_accuracy:.4f}, "
            f"folded ONNX {check.onnx_accuracy:.4f}, top-1 agreement {check.top1_agreement:.4f}, "
            f"max abs logit diff {check.max_abs_diff:.3g}",
        ]
    lines += [f"- **warning**: {warning}" for warning in fold.warnings]
    lines += [f"- note: {note}" for note in fold.notes]
    lines += [f"- note: {note}" for note in result.notes]
    lines += [
        "",
        "## Norms",
        "",
        "| norm | kind | what happened | into / why |",
        "|---|---|---|---|",
    ]
    for norm in fold.norms:
        detail = ", ".join(norm.into) if norm.into else norm.reason
        lines.append(f"| {norm.name} | {norm.kind} | {norm.action} | {detail} |")
    histogram = sorted(result.op_histogram.items(), key=lambda item: -item[1])
    lines += ["", "## Operators in the folded graph", "", "| op | count |", "|---|---|"]
    lines += [f"| {op} | {count} |" for op, count in histogram]
    return "\n".join(lines) + "\n"
