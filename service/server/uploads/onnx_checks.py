"""ONNX models, with or without external data: every external data reference is checked
against the uploaded data files before a byte of them is read, then ONNX's checker, online
norms and non-finite weights."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from quant.errors import one_line

from ...settings import DEFAULT_MAX_PARAMETERS
from .files import DATA_FIELD, MIB, name_problem
from .model_upload import MIGRATE_ADVICE, ModelUpload, check_size, nonfinite, reject

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
                raise nonfinite(tensor.name)
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
