"""Read an ONNX file, and the external data files its weights may live in, with path checks.

``torch.onnx.export`` writes weights to ``model.onnx.data`` beside ``model.onnx`` by default; each
such tensor names its file (``location``), ``offset`` and ``length``. A location is data from the
file, so it is checked before anything is opened: a plain file name in the data directory (no
directory part, no ``..``, not absolute, no symlink out of the directory), an existing regular
file, and a byte range inside it that is exactly the tensor's size. The data is then read into
the model, which is self-contained from there on (whatever is written from it is one file).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, GraphProto, TensorProto

from .errors import NotAnOnnxModelError

# Element types whose byte size is not numel * itemsize (packed, or variable length).
UNSIZED_TYPES = {
    TensorProto.STRING, TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1,
    TensorProto.UNDEFINED,
}  # fmt: skip


def onnx_input_names(model: onnx.ModelProto) -> tuple[str, ...]:
    """The model's inputs in order, not its initializers (an old exporter lists those too)."""
    constants = {init.name for init in model.graph.initializer}
    return tuple(v.name for v in model.graph.input if v.name not in constants)


def load_onnx(path: str | Path, *, data_dir: str | Path | None = None) -> onnx.ModelProto:
    """Read and check an ONNX file, its external data (if any) read from ``data_dir`` (default:
    the file's own directory); anything wrong is a NotAnOnnxModelError (one line)."""
    path = Path(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError, RuntimeError) as error:
        raise NotAnOnnxModelError(f"{path.name} is not a readable ONNX model: {error}") from None
    if not proto.graph.node or not proto.opset_import:
        raise NotAnOnnxModelError(f"{path.name} is not an ONNX model (no graph or no opset)")
    directory = path.parent if data_dir is None else Path(data_dir)
    for tensor in all_tensors(proto):
        if tensor.data_location == TensorProto.EXTERNAL:
            read_external(tensor, directory, path.name)
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as error:
        first = str(error).strip().splitlines()[0]
        raise NotAnOnnxModelError(f"{path.name} is not a valid ONNX model: {first}") from None
    return proto


def all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every tensor a model stores: initializers (dense and sparse) and node attributes, in the
    main graph, its subgraphs and the model's functions."""
    yield from graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            for attribute in node.attribute:
                yield from attribute_tensors(attribute)


def graph_tensors(graph: GraphProto) -> Iterator[TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attribute in node.attribute:
            yield from attribute_tensors(attribute)


def attribute_tensors(attribute: AttributeProto) -> Iterator[TensorProto]:
    if attribute.HasField("t"):
        yield attribute.t
    yield from attribute.tensors
    if attribute.HasField("sparse_tensor"):
        yield from (attribute.sparse_tensor.values, attribute.sparse_tensor.indices)
    for sparse in attribute.sparse_tensors:
        yield from (sparse.values, sparse.indices)
    if attribute.HasField("g"):
        yield from graph_tensors(attribute.g)
    for graph in attribute.graphs:
        yield from graph_tensors(graph)


def external_fields(tensor: TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def read_external(tensor: TensorProto, directory: Path, model_name: str) -> None:
    """Check one tensor's external reference and read its bytes into the tensor."""
    fields = external_fields(tensor)
    location = fields.get("location", "")

    def refuse(problem: str) -> NotAnOnnxModelError:
        return NotAnOnnxModelError(
            f"{model_name}: external data {location!r} of tensor {tensor.name!r} {problem}"
        )

    file = data_file(location, directory, refuse)
    size = file.stat().st_size
    try:
        offset = int(fields.get("offset", "0"))
        length = int(fields["length"]) if "length" in fields else size - offset
    except ValueError:
        raise refuse("has an offset or length that is not an integer") from None
    if offset < 0 or length < 0 or offset + length > size:
        raise refuse(f"asks for bytes {offset}..{offset + length} of a {size}-byte file")
    expected = tensor_bytes(tensor)
    if expected is not None and expected != length:
        raise refuse(f"holds {length} bytes, the tensor needs {expected}")
    with file.open("rb") as handle:
        handle.seek(offset)
        tensor.raw_data = handle.read(length)
    tensor.data_location = TensorProto.DEFAULT
    del tensor.external_data[:]


def data_file(location: str, directory: Path, refuse: Callable[[str], NotAnOnnxModelError]) -> Path:
    """The file a location names, if it is a plain name of a regular file in ``directory``."""
    plain = (
        location not in ("", ".", "..")
        and "/" not in location
        and "\\" not in location
        and "\0" not in location
        and not os.path.isabs(location)
        and Path(location).name == location
    )
    if not plain:
        raise refuse("is not a plain file name beside the model (no directories, no '..')")
    file = directory / location
    if not file.is_file():
        raise refuse(f"does not exist in {directory}")
    if file.resolve().parent != directory.resolve():
        raise refuse(f"is a link that leads out of {directory}")
    return file


def tensor_bytes(tensor: TensorProto) -> int | None:
    """The byte size of a tensor's raw data, when it is numel * itemsize."""
    if tensor.data_type in UNSIZED_TYPES:
        return None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
