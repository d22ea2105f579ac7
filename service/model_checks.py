"""Model checks behind :func:`service.upload_checks.inspect_model`, one per format.

Each reads its format with the project's own safe loader and turns every problem into an
UploadRejected: edge_un checkpoints (.safetensors, or a torch state dict with a config) after
the config's implied size is checked, torch.export programs via ``converters.program``, ONNX
models with or without external data (every reference checked against the uploaded data files
before a byte of them is read). Online norms (LayerNorm and the like) are refused with advice:
the service has no ``allow_online``. Each check also says what the model's inputs are called,
where the file says so without running anything, so data files can be checked against them.
"""

from __future__ import annotations

import inspect as pyinspect  # the standard library's (absolute import)
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np

from converters.source import ModelFormat
from quant.errors import one_line

from . import sniff
from .errors import Refusal, UploadRejected
from .settings import DEFAULT_MAX_PARAMETERS
from .uploads import DATA_FIELD, MIB, name_problem

PARAMETERS_SETTING = "EDGE_UN_MAX_PARAMETERS"
# Protobuf's own limit on one message: a larger .onnx cannot be a model (its weights must then
# be external data, which is not counted here).
MAX_ONNX_BYTES = 2 * 1024 * MIB - 1
# Bytes per element of the tensor types ONNX stores unpacked (4-bit types are not listed: their
# size is only checked against the file).
_ELEMENT_BYTES = {
    "FLOAT": 4, "DOUBLE": 8, "FLOAT16": 2, "BFLOAT16": 2, "INT8": 1, "UINT8": 1, "INT16": 2,
    "UINT16": 2, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8, "BOOL": 1, "COMPLEX64": 8,
    "COMPLEX128": 16, "FLOAT8E4M3FN": 1, "FLOAT8E4M3FNUZ": 1, "FLOAT8E5M2": 1,
    "FLOAT8E5M2FNUZ": 1, "FLOAT8E8M0": 1,
}  # fmt: skip
MIGRATE_ADVICE = (
    "the service converts only models whose norms fold into int8 weights: migrate it to UN "
    "first (edge-un migrate CHECKPOINT --kind un --out MODEL.safetensors) and upload the result, "
    "or convert it on your machine with edge-un convert MODEL --allow-online"
)


@dataclass(frozen=True)
class ModelUpload:
    format: ModelFormat
    parameters: int | None
    norm: str | None
    # The model's input names in order, as the conversion names them (None: not known here).
    inputs: tuple[str, ...] | None = None


def reject(title: str, detail: str, kind: Refusal = Refusal.UNUSABLE) -> UploadRejected:
    return UploadRejected(kind, title, detail)


def check_size(parameters: int, what: str, limit: int = DEFAULT_MAX_PARAMETERS) -> None:
    if parameters > limit:
        count = f"{parameters:,}" if parameters < 10**15 else "more than 10^15"
        raise reject(
            "Model too large",
            f"{what} {count} parameters, over the service limit of {limit:,} "
            f"({PARAMETERS_SETTING}); send a smaller model, or ask for a higher limit",
        )


def implied_parameters(config: Mapping[str, Any]) -> int | None:
    """The weights (Linear, Conv, embeddings; a lower bound) that ``config`` asks to build, from
    its numbers alone; None when they are not numbers (the loader then names the problem)."""
    from edge_un.models import ARCHITECTURES

    name = config.get("architecture")
    cls = ARCHITECTURES.get(name) if isinstance(name, str) else None
    arguments = config.get("arguments") or {}
    if cls is None or not isinstance(arguments, Mapping):
        return None
    defaults = {n: p.default for n, p in pyinspect.signature(cls).parameters.items()}
    values = {**defaults, **arguments}
    needed = ["dim", "depth", "mlp_ratio", "num_classes"]
    needed += ["img_size", "patch_size", "in_chans"] if "img_size" in defaults else []
    needed += ["vocab_size", "max_len"] if "vocab_size" in defaults else []
    if not all(type(values.get(k)) in (int, float) for k in needed):
        return None
    if not all(math.isfinite(values[k]) and values[k] >= 0 for k in needed):
        return None  # not sizes: the constructor refuses them
    # Exact arithmetic on Python's unbounded ints: a forged 1e308 is just a very large count.
    n = {k: Fraction(values[k]) for k in needed}
    dim, hidden = n["dim"], math.floor(n["dim"] * n["mlp_ratio"])
    total = n["depth"] * (4 * dim * dim + 2 * dim * hidden) + dim * n["num_classes"]
    if "img_size" in n:
        patch = max(n["patch_size"], 1)
        total += n["in_chans"] * patch * patch * dim + (n["img_size"] // patch) ** 2 * dim
    if "vocab_size" in n:
        total += (n["vocab_size"] + n["max_len"]) * dim
    return math.floor(total)


def check_checkpoint(
    path: Path,
    fmt: Literal["safetensors", "pt"],
    raw: Any,
    config: dict | None,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> ModelUpload:
    import edge_un
    from converters.graph import ONLINE_NORM_CLASSES

    parsed = _parse_raw_config(raw)
    implied = implied_parameters(parsed) if parsed is not None else None
    if implied is not None:
        check_size(implied, "the config asks for a model of at least", max_parameters)
    try:
        model, info = edge_un.load_checkpoint(path, config=config, format=fmt)
    except edge_un.CheckpointError as error:
        raise _checkpoint_rejection(error, path.name) from None
    except MemoryError:
        raise
    except Exception as error:  # a config's values can break a constructor in many ways
        raise reject(
            "Config does not match the weights",
            f"the config does not build a model ({type(error).__name__}: {one_line(error)})",
        ) from None
    online = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, ONLINE_NORM_CLASSES)
    ]
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the model has {len(online)} online norms "
            f"(kind {info.norm_kind!r}: {', '.join(online[:3])}...), which compute "
            f"statistics at run time and cannot fold; {MIGRATE_ADVICE}",
        )
    parameters = sum(p.numel() for p in model.parameters())
    return ModelUpload(
        fmt, parameters, info.norm_kind or None, architecture_inputs(info.architecture)
    )


def architecture_inputs(architecture: str) -> tuple[str, ...] | None:
    """The forward() argument names of an edge_un architecture (what its export calls its
    inputs), from the class's signature alone: nothing is built."""
    from edge_un.checkpoint import ARCHITECTURES

    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        return None
    parameters = list(pyinspect.signature(cls.forward).parameters.values())[1:]  # not self
    kinds = (pyinspect.Parameter.POSITIONAL_ONLY, pyinspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds) or None


def _parse_raw_config(raw: Any) -> dict | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw, parse_constant=sniff.no_json_constant)
        except (ValueError, RecursionError):
            raise reject(
                "Bad config",
                "the config in the checkpoint's metadata is not valid "
                "JSON (NaN/Infinity are not numbers there either)",
            ) from None
    return raw if isinstance(raw, dict) else None


def _checkpoint_title(error: Exception) -> str:
    """A short title for a checkpoint loader's error, by its class."""
    import edge_un

    titles = (
        (edge_un.NotACheckpointError, "Not a readable checkpoint"),
        (edge_un.UnsafeCheckpointError, "Code-execution payload refused"),
        (edge_un.MissingConfigError, "Missing config"),
        (edge_un.UnknownArchitectureError, "Unknown architecture"),
        (edge_un.ConfigMismatchError, "Config does not match the weights"),
        (edge_un.TensorMismatchError, "Config does not match the weights"),
        (edge_un.NonFiniteTensorError, "Non-finite weights"),
    )
    return next((title for kind, title in titles if isinstance(error, kind)), "Bad checkpoint")


def _checkpoint_rejection(error: Exception, name: str) -> UploadRejected:
    """The loader's one line, without the (server-chosen) file name it starts with."""
    title = _checkpoint_title(error)
    line = one_line(error).removeprefix(f"{name}: ")
    advice = {
        "Config does not match the weights": "; send the config the checkpoint was saved with",
        "Non-finite weights": "; the model diverged in training or the file is damaged",
    }.get(title, "")
    prefix = {
        "Config does not match the weights": "the config does not match the weights: ",
        "Non-finite weights": "the model's ",
    }.get(title, "the model: ")
    return reject(title, f"{prefix}{line}{advice}")


def check_program(path: Path, max_parameters: int = DEFAULT_MAX_PARAMETERS) -> ModelUpload:
    import torch

    from converters.errors import NotAProgramError
    from converters.fold import find_online_norms
    from converters.program import load_program

    try:
        program = load_program(path)
    except NotAProgramError as error:
        raise reject(
            "Not a readable program",
            one_line(error).replace(path.name, "the 'model' upload", 1),
        ) from None
    parameters = sum(p.numel() for p in program.parameters())
    check_size(parameters, "the program stores", max_parameters)
    tensors = {**program.state_dict, **program.constants}
    for name, tensor in tensors.items():
        floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
        if floating and not torch.isfinite(tensor).all():
            raise _nonfinite(name)
    online = find_online_norms(program.graph_module)
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the program has online norms "
            f"({', '.join(online[:3])}), which cannot fold; {MIGRATE_ADVICE}",
        )
    # The user inputs of its graph signature (deserialized from the archive's JSON by
    # converters.program, nothing unpickled): the names its export gives its inputs.
    inputs = tuple(program.graph_signature.user_inputs)
    return ModelUpload("pt2", parameters, None, inputs or None)


def _nonfinite(name: str) -> UploadRejected:
    return reject(
        "Non-finite weights",
        f"the model's tensor {name!r} contains NaN or Inf; the "
        "model diverged in training or the file is damaged",
    )


def read_onnx(path: Path) -> Any:
    """The ModelProto if the file parses as an ONNX model with a graph, else None. External
    data is not read (nor followed): :func:`check_onnx` checks the references first."""
    import onnx
    from google.protobuf.message import DecodeError

    if path.stat().st_size > MAX_ONNX_BYTES:
        return None
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, RecursionError, OSError):
        return None
    if not proto.graph.node or not proto.opset_import or not proto.ir_version:
        return None
    return proto


def check_onnx(
    proto: Any,
    path: Path,
    external: Mapping[str, Path] | None = None,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> ModelUpload:
    """An ONNX model the pipeline can fold. ``path`` is the uploaded file and ``external`` the
    uploaded external data files by name, stored beside it (as the model references them)."""
    import onnx
    from onnx import numpy_helper

    from converters.onnx_fold import ONLINE_NORM_OPS

    external = external or {}
    tensors = list(_onnx_tensors(proto.graph))
    check_external_data(tensors, external)
    initializers = list(proto.graph.initializer)
    check_size(
        sum(math.prod(t.dims) for t in initializers), "the ONNX model stores", max_parameters
    )
    try:  # from the file: the checker finds external data beside it, as the pipeline will
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as error:
        raise reject(
            "Invalid ONNX model", f"the ONNX model is not valid: {one_line(error)}"
        ) from None
    nodes = list(_onnx_nodes(proto))
    online = [f"{n.name or '?'} ({n.op_type})" for n in nodes if n.op_type in ONLINE_NORM_OPS]
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the ONNX model has online norms "
            f"({', '.join(online[:3])}), which cannot fold; {MIGRATE_ADVICE}",
        )
    floating = (
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    )
    for tensor in tensors:
        if tensor.data_type in floating:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                # a copy, so the loaded bytes are freed with it (not kept in the model)
                tensor = _copied(tensor)
            values = numpy_helper.to_array(tensor, base_dir=str(path.parent))
            if not np.isfinite(values.astype(np.float32)).all():
                raise _nonfinite(tensor.name)
    names = {init.name for init in initializers}
    inputs = tuple(v.name for v in proto.graph.input if v.name not in names)
    return ModelUpload("onnx", None, None, inputs or None)


def _copied(tensor: Any) -> Any:
    import onnx

    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    return copy


def check_external_data(tensors: list[Any], uploaded: Mapping[str, Path]) -> None:
    """Every external data reference of the model names an uploaded file (a plain name: nothing
    outside the upload directory is ever opened) and lies inside it; every uploaded file is
    referenced. Reads only the files' sizes."""
    import onnx

    referenced: set[str] = set()
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        what = f"the ONNX model's tensor {tensor.name[:80]!r}"
        location = entries.get("location", "")
        problem = name_problem(location) if location else "is empty"
        if problem:
            raise reject(
                "Bad ONNX external data",
                f"{what} is stored in external data at {_quoted(location)}, which {problem}: "
                "external data must be files beside the model; save it with "
                "onnx.save_model(model, path, save_as_external_data=True, "
                "location='model.onnx.data')",
            )
        if location not in uploaded:
            raise reject(
                "Missing ONNX external data",
                f"{what} is stored in the external data file {_quoted(location)}, which was "
                f"not uploaded; send it too, under that name (curl ... "
                f"-F {DATA_FIELD}=@{location[:80]})",
            )
        referenced.add(location)
        _check_extent(tensor, entries, what, location, uploaded[location].stat().st_size)
    extra = sorted(set(uploaded) - referenced)
    if extra:
        named = ", ".join(_quoted(n) for n in sorted(referenced)) or "none"
        raise reject(
            "Unreferenced ONNX external data",
            f"the {DATA_FIELD!r} file {_quoted(extra[0])} is not referenced by the ONNX model "
            f"(it references: {named}); send only the model's external data files",
        )


def _check_extent(tensor: Any, entries: dict[str, str], what: str, name: str, size: int) -> None:
    import onnx

    try:
        offset = int(entries.get("offset", "0"))
        length = int(entries["length"]) if "length" in entries else None
    except ValueError:
        raise reject(
            "Bad ONNX external data",
            f"{what} has a non-numeric external data offset or length; the model is damaged",
        ) from None
    try:
        type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
    except ValueError:  # not a type at all: the checker names it
        type_name = ""
    itemsize = _ELEMENT_BYTES.get(type_name)
    needed = None if itemsize is None else itemsize * math.prod(tensor.dims)
    if length is not None and needed is not None and length != needed:
        raise reject(
            "Bad ONNX external data",
            f"{what} has {length:,} bytes of external data in {_quoted(name)}, its shape needs "
            f"{needed:,}; the model and its data file do not belong together",
        )
    extent = length if length is not None else needed
    if offset < 0 or (extent is not None and extent < 0) or offset + (extent or 0) > size:
        shown = f"bytes {offset:,} to {offset + (extent or 0):,}"
        raise reject(
            "Truncated ONNX external data",
            f"{what} is stored at {shown} of {_quoted(name)}, beyond the end of the uploaded "
            f"file ({size:,} bytes); upload the complete file",
        )


def _quoted(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def _onnx_nodes(proto: Any) -> Iterator[Any]:
    graphs = [proto.graph]
    for function in proto.functions:
        yield from function.node
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            yield node
            for attribute in node.attribute:
                graphs.extend([attribute.g] if attribute.HasField("g") else [])
                graphs.extend(attribute.graphs)


def _onnx_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _onnx_tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _onnx_tensors(sub)
