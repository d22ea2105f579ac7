"""Load a ``torch.export.save`` program (.pt2) without unpickling anything, and fold it.

``torch.export.load`` (torch 2.13) is not safe on untrusted files: weights and constants marked
``use_pickle`` go through ``torch.load(weights_only=False)``, custom/opaque objects through
``pickle.loads``, and the sample inputs fall back to ``torch.load(weights_only=False)`` when the
safe load fails; a .pt2 with a crafted sample-inputs pickle runs code on load. This loader reads
the same archive with torch's own reader and deserializer but: raw tensor payloads only (pickled
ones with ``weights_only=True``), no custom or opaque objects, no AOTInductor libraries, sample
inputs with ``weights_only=True`` or dropped. It relies on private torch.export helpers, which is
why torch is pinned.

A program that returns a structure (a Hugging Face ``ModelOutput``, a dict, a tuple) is reduced
to its logits before deserialization (:mod:`.program_outputs`): its classes are never imported.
:func:`program_output_note` says which output was kept; :func:`~converters.fold_norms` puts
that into its FoldReport.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx
from torch._export.serde import schema
from torch._export.serde.serialize import (
    ExportedProgramDeserializer,
    _bytes_to_dataclass,
    _dict_to_dataclass,
    deserialize_size,
    deserialize_storage_offset,
    deserialize_stride,
)
from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument
from torch.export.pt2_archive._package import PT2ArchiveReader, _build_file_map
from torch.export.pt2_archive.constants import (
    AOTINDUCTOR_DIR,
    ARCHIVE_VERSION_PATH,
    ARCHIVE_VERSION_VALUE,
    CONSTANTS_CONFIG_FILENAME_FORMAT,
    CONSTANTS_DIR,
    MODELS_FILENAME_FORMAT,
    SAMPLE_INPUTS_FILENAME_FORMAT,
    TENSOR_CONSTANT_FILENAME_PREFIX,
    WEIGHTS_CONFIG_FILENAME_FORMAT,
    WEIGHTS_DIR,
)
from torch.fx.graph import _PyTreeInfo
from torch.utils import _pytree as pytree

from .errors import NotAProgramError, root_cause
from .program_outputs import reduce_to_logits

MODEL_NAME = "model"  # what torch.export.save names the program in the archive
OUTPUT_NOTE = "edge_un_output_note"  # graph_module.meta key: which output was kept, and why


def load_program(path: str | Path) -> ExportedProgram:
    """The ExportedProgram in a .pt2 file; NotAProgramError (one line) for anything unsafe/bad."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise NotAProgramError(f"{path.name} is not a torch.export program (.pt2 zip archive)")
    try:
        with PT2ArchiveReader(str(path)) as reader:
            return _read(reader, path.name)
    except NotAProgramError:
        raise
    except Exception as error:  # the deserializer raises many types on a damaged archive
        raise NotAProgramError(
            f"{path.name} is not a readable torch.export program: {root_cause(error)}"
        ) from None


def _read(reader: PT2ArchiveReader, name: str) -> ExportedProgram:
    files = set(reader.get_file_names())
    version = reader.read_string(ARCHIVE_VERSION_PATH) if ARCHIVE_VERSION_PATH in files else None
    if version != ARCHIVE_VERSION_VALUE:
        raise NotAProgramError(f"{name}: unsupported .pt2 archive version {version!r}")
    if any(f.startswith(AOTINDUCTOR_DIR) for f in files):
        raise NotAProgramError(f"{name} contains compiled AOTInductor code; refused")
    model_file = MODELS_FILENAME_FORMAT.format(MODEL_NAME)
    if model_file not in files:
        raise NotAProgramError(f"{name} has no program named {MODEL_NAME!r}")
    program = _bytes_to_dataclass(schema.ExportedProgram, reader.read_bytes(model_file))
    note = reduce_to_logits(program, name)
    state_dict = _tensors(reader, WEIGHTS_CONFIG_FILENAME_FORMAT, WEIGHTS_DIR, name)
    constants = _tensors(reader, CONSTANTS_CONFIG_FILENAME_FORMAT, CONSTANTS_DIR, name)
    inputs_file = SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL_NAME)
    example_inputs = _safe_load(reader.read_bytes(inputs_file)) if inputs_file in files else None
    if not (isinstance(example_inputs, tuple) and len(example_inputs) == 2):
        example_inputs = b""  # not plain tensors: dropped, never unpickled unsafely
    result = ExportedProgramDeserializer().deserialize(
        program, state_dict, constants, example_inputs
    )
    if note:
        # What only the dropped outputs computed (hidden states, attentions) is dead now.
        result.graph_module.graph.eliminate_dead_code()
        result.graph_module.recompile()
        result.graph_module.meta[OUTPUT_NOTE] = note
    return result


def program_output_note(program: ExportedProgram) -> str | None:
    """Which output :func:`load_program` kept of a program returning a structure, else None."""
    return program.graph_module.meta.get(OUTPUT_NOTE)


def _safe_load(data: bytes) -> Any:
    """torch.load with weights_only=True (tensors and plain containers only), else None."""
    if not data:
        return None
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return None


def _tensors(reader: PT2ArchiveReader, config_format: str, folder: str, name: str) -> dict:
    config_file = config_format.format(MODEL_NAME)
    if config_file not in set(reader.get_file_names()):
        raise NotAProgramError(f"{name}: {config_file} missing (legacy pickled format refused)")
    config = _dict_to_dataclass(schema.PayloadConfig, json.loads(reader.read_string(config_file)))
    raw = _build_file_map(reader, config, folder)  # raw bytes -> flat tensors, no pickle
    tensors: dict[str, Tensor] = {}
    for fqn, meta in config.config.items():
        if folder == CONSTANTS_DIR and not meta.path_name.startswith(
            TENSOR_CONSTANT_FILENAME_PREFIX
        ):
            raise NotAProgramError(f"{name}: constant {fqn} is a pickled object; refused")
        if meta.use_pickle:
            value = _safe_load(reader.read_bytes(os.path.join(folder, meta.path_name)))
            if not isinstance(value, Tensor):
                raise NotAProgramError(f"{name}: tensor {fqn} needs unsafe unpickling; refused")
            tensors[fqn] = value
            continue
        if meta.tensor_meta is None:
            raise NotAProgramError(f"{name}: tensor {fqn} has no metadata")
        tensor = torch.as_strided(
            raw[meta.path_name],
            size=deserialize_size(meta.tensor_meta.sizes),
            stride=deserialize_stride(meta.tensor_meta.strides),
            storage_offset=deserialize_storage_offset(meta.tensor_meta.storage_offset),
        )
        if meta.is_param:
            tensor = torch.nn.Parameter(tensor, requires_grad=meta.tensor_meta.requires_grad)
        tensors[fqn] = tensor
    return tensors


def program_example_inputs(
    program: ExportedProgram, shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple:
    """The example tensors saved with the program, positional then keyword ones in the order
    its graph takes them (empty if none were safe); constants (``use_cache=False``) are not
    inputs. An input whose shape the program leaves open beyond the batch (a dynamic sequence
    length) is remade at the size ``shapes`` gives it (one sample, no batch axis)."""
    inputs = program.example_inputs
    if not inputs:
        return ()
    args, kwargs = inputs
    tensors = [(None, a) for a in args] + list((kwargs or {}).items())
    tensors = [(name, t) for name, t in tensors if isinstance(t, Tensor)]
    if not shapes:
        return tuple(t for _, t in tensors)
    placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    return tuple(
        _resized(tensor, placeholders.get(name), shapes.get(name))
        for name, (_, tensor) in zip(program_input_names(program), tensors, strict=False)
    )


def program_input_names(program: ExportedProgram) -> list[str]:
    """The program's tensor inputs (not its weights or constants), in the order it takes them."""
    return [
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind.name == "USER_INPUT" and isinstance(spec.arg, TensorArgument)
    ]


def positional_tensor_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """An unlifted program that takes keyword inputs (``model(**inputs)`` as Hugging Face users
    export it), and constants among them (``use_cache=False``), made to take its tensors
    positionally in graph order, as every other source does; the constants, which the trace
    specialized on, are no longer inputs. Edited in place; returned."""
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return gm
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        value = node.meta.get("val")
        if isinstance(value, (bool, int, float, str, type(None))):  # a constant input
            for user in list(node.users):  # torch.export's input guards: given the value
                user.args = fx.node.map_arg(
                    user.args, lambda a, n=node, v=value: v if a is n else a
                )
            if not node.users:
                gm.graph.erase_node(node)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = pytree.tree_flatten((tuple(range(len(names))), {}))[1]
    codegen.pytree_info = _PyTreeInfo(names, in_spec, info.out_spec)
    gm._in_spec = in_spec
    gm.recompile()
    return gm


def _resized(tensor: Tensor, placeholder: Any, sample: Sequence[int] | None) -> Tensor:
    """``tensor`` at ``(batch, *sample)`` when the program leaves every differing dimension
    open (1s for integer ids, so any vocabulary takes them); else as it is."""
    value = placeholder.meta.get("val") if placeholder is not None else None
    if sample is None or value is None or len(sample) != tensor.dim() - 1:
        return tensor
    wanted = (tensor.shape[0], *sample)
    differ = [i for i in range(1, tensor.dim()) if tensor.shape[i] != wanted[i]]
    if not differ or any(isinstance(value.shape[i], int) for i in differ):
        return tensor
    if tensor.is_floating_point():
        return torch.randn(wanted, dtype=tensor.dtype)
    return torch.ones(wanted, dtype=tensor.dtype)
