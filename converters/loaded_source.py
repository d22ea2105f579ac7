"""A model read from its source, not yet folded: the one place each source format is read.

Sources: an edge_un checkpoint (``.safetensors``, or ``.pt``/``.pth`` with a config), a Hugging
Face directory, a ``torch.export`` program (``.pt2``) or an fp32 ONNX model (``.onnx``). Each is
read without running code from it, with its example inputs and its input names, which the fold's
graph and every export keep: a conversion reads its data by them before the fold
(``converters.fold_and_export.fold_loaded``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from torch import Tensor, nn
from torch.export import ExportedProgram

import edge_un
import edge_un.hf
from edge_un import data as edge_data

from .errors import ConversionError
from .onnx_load import load_onnx, onnx_input_names
from .program import load_program, program_example_inputs, program_input_names
from .source import ModelSource
from .trace import default_example_inputs, forward_input_names


@dataclass(frozen=True)
class LoadedSource:
    """A model read from its source and not yet folded: what may change before the one fold
    (``edge-un convert --recalibrate`` recomputes its norms' statistics in ``model``).

    ``model`` is the torch model or program, or the ONNX proto; ``input_names`` its inputs in
    order, as its fold and every export will name them; the rest as in :class:`FoldedSource`."""

    source: ModelSource
    model: Any
    example: tuple[Tensor, ...]
    test_split: tuple[tuple[Tensor, ...], Tensor] | None
    info: edge_un.CheckpointInfo | None
    input_names: tuple[str, ...]
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_onnx(self) -> bool:
        return isinstance(self.model, onnx.ModelProto)


def load_source(
    source: ModelSource | str | Path,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> LoadedSource:
    """Read ``source`` (never running code from it) in the format its name says
    (:meth:`ModelSource.from_path`). ``input_shapes``, one sample of each input as the user's
    data has it, shapes what is left open: a Hugging Face directory is traced at that sequence
    length or image size, a program or ONNX file's dynamic dimensions take those sizes."""
    if not isinstance(source, ModelSource):
        source = ModelSource.from_path(source)
    path, shapes = source.path, {k: tuple(v) for k, v in (input_shapes or {}).items()}
    if source.format == "hf":
        model, example, test_split, info, names = _load_pretrained_source(path, shapes)
        return LoadedSource(source, model, example, test_split, info, names, shapes)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file or directory")
    if source.format == "onnx":
        proto = load_onnx(path)
        names = onnx_input_names(proto)
        return LoadedSource(source, proto, (), None, None, names, by_input_name(names, shapes))
    model, example, test_split, info, names = _load_torch_source(source, config, shapes)
    return LoadedSource(source, model, example, test_split, info, names, shapes)


def by_input_name(
    names: Sequence[str], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """``shapes`` keyed by the model's input names: a one-input model's data may call its one
    array anything (``inputs``)."""
    if len(names) == 1 and len(shapes) == 1 and names[0] not in shapes:
        return {names[0]: next(iter(shapes.values()))}
    return dict(shapes)


def _load_torch_source(
    source: ModelSource,
    config: str | Path | Mapping[str, Any] | None,
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[
    nn.Module | ExportedProgram,
    tuple[Tensor, ...],
    tuple[tuple[Tensor, ...], Tensor] | None,
    edge_un.CheckpointInfo | None,
    tuple[str, ...],
]:
    """The model, example inputs to trace it with, (inputs, labels) of the test split that the
    checkpoint records, if it records one (loaded once: it also supplies the examples), the
    checkpoint's info (None for a program) and the model's input names."""
    if source.format == "pt2":
        program = load_program(source.path)
        names = program_input_names(program)
        example = program_example_inputs(program, by_input_name(names, shapes))
        if not example:
            raise ConversionError(f"{source.path.name}: the program carries no example inputs")
        return program, example, None, None, tuple(names)
    model, info = edge_un.load_checkpoint(source.path, config=config, format=source.format)
    if "dataset" in info.metadata:
        inputs, labels = edge_data.checkpoint_split(info, "test")
        example: tuple[Tensor, ...] = (inputs[:2],)
        return model, example, ((inputs,), labels), info, forward_input_names(model, example)
    example = default_example_inputs(model)
    return model, example, None, info, forward_input_names(model, example)


def _load_pretrained_source(
    directory: Path, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[
    nn.Module,
    tuple[Tensor, ...],
    tuple[tuple[Tensor, ...], Tensor] | None,
    edge_un.CheckpointInfo,
    tuple[str, ...],
]:
    """A Hugging Face model as users call it: its own forward arguments (``pixel_values``;
    ``input_ids``, ``attention_mask``) by name, its key/value cache off, traced on inputs
    shaped as the user's data (``shapes``), else from the test split it records, else shaped
    by its config (its output's ``logits`` are the model output); and those names."""
    model, info = edge_un.load_pretrained(directory)
    names = list(edge_un.hf.example_inputs(model))
    shaped = edge_un.hf.example_inputs(model, shapes=by_input_name(names, shapes))
    edge_un.hf.call_with_names(model, names)
    test_split = None
    if "dataset" in info.metadata:
        inputs, labels = edge_data.checkpoint_split(info, "test")
        test_split = (tuple(edge_un.hf.named_inputs(model, inputs).values()), labels)
    if shapes or test_split is None:
        return model, tuple(shaped.values()), test_split, info, tuple(names)
    return model, tuple(t[:2] for t in test_split[0]), test_split, info, tuple(names)
