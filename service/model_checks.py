"""Model checks behind :func:`service.inspect.inspect_model`, one per format.

Each reads its format with the project's own safe loader and turns every problem into an
UploadRejected: edge_un checkpoints (.safetensors, or a torch state dict with a config) after
the config's implied size is checked, torch.export programs via ``converters.program``, ONNX
without external data. Online norms (LayerNorm and the like) are refused with advice: the
service has no ``allow_online``.
"""

from __future__ import annotations

import inspect as pyinspect  # the standard library's (absolute import)
import json
import math
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np

from . import sniff
from .uploads import MIB, UploadRejected

MAX_PARAMETERS = 50_000_000
MAX_ONNX_BYTES = 1024 * MIB
MIGRATE_ADVICE = (
    "the service converts only models whose norms fold into int8 weights: migrate it to UN "
    "first (edge-un migrate CHECKPOINT --kind un --out MODEL.safetensors) and upload the result, "
    "or convert it on your machine with edge-un convert MODEL --allow-online"
)


@dataclass(frozen=True)
class ModelUpload:
    format: Literal["safetensors", "pt", "pt2", "onnx"]
    parameters: int | None
    norm: str | None


def reject(title: str, detail: str, status: int = 422) -> UploadRejected:
    return UploadRejected(status, title, detail)


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def check_size(parameters: int, what: str) -> None:
    if parameters > MAX_PARAMETERS:
        count = f"{parameters:,}" if parameters < 10**15 else "more than 10^15"
        raise reject(
            "Model too large",
            f"{what} {count} parameters, over the service "
            f"limit of {MAX_PARAMETERS:,}; edge-un targets small edge models",
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
    path: Path, fmt: Literal["safetensors", "pt"], raw: Any, config: dict | None
) -> ModelUpload:
    import edge_un
    from converters.graph import ONLINE_NORM_CLASSES

    parsed = _parse_raw_config(raw)
    implied = implied_parameters(parsed) if parsed is not None else None
    if implied is not None:
        check_size(implied, "the config asks for a model of at least")
    with _with_suffix(path, ".safetensors" if fmt == "safetensors" else ".pt") as named:
        try:
            model, info = edge_un.load_checkpoint(named, config=config)
        except edge_un.CheckpointError as error:
            raise _checkpoint_rejection(error, named.name) from None
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
    return ModelUpload(fmt, parameters, info.norm_kind or None)


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


_CHECKPOINT_TITLES = {
    "NotACheckpointError": "Not a readable checkpoint",
    "UnsafeCheckpointError": "Code-execution payload refused",
    "MissingConfigError": "Missing config",
    "UnknownArchitectureError": "Unknown architecture",
    "ConfigMismatchError": "Config does not match the weights",
    "TensorMismatchError": "Config does not match the weights",
    "NonFiniteTensorError": "Non-finite weights",
}


def _checkpoint_rejection(error: Exception, name: str) -> UploadRejected:
    """The loader's one line, without the (server-chosen) file name it starts with."""
    title = _CHECKPOINT_TITLES.get(type(error).__name__, "Bad checkpoint")
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


class _with_suffix:
    """A symlink to ``path`` named with ``suffix``: the loaders choose their reader by suffix,
    while uploads have server-chosen names without one."""

    def __init__(self, path: Path, suffix: str) -> None:
        self.path, self.suffix = path, suffix

    def __enter__(self) -> Path:
        self._dir = tempfile.TemporaryDirectory(prefix="edge-un-inspect-")
        link = Path(self._dir.name) / f"{self.path.name}{self.suffix}"
        link.symlink_to(self.path.resolve())
        return link

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()


def check_program(path: Path) -> ModelUpload:
    import torch

    from converters.errors import NotAProgramError
    from converters.fold import find_online_norms
    from converters.program import load_program

    try:
        with _with_suffix(path, ".pt2") as named:  # torch warns about any other name
            program = load_program(named)
    except NotAProgramError as error:
        raise reject(
            "Not a readable program",
            one_line(error).replace(f"{path.name}.pt2", "the 'model' upload", 1),
        ) from None
    parameters = sum(p.numel() for p in program.parameters())
    check_size(parameters, "the program stores")
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
    return ModelUpload("pt2", parameters, None)


def _nonfinite(name: str) -> UploadRejected:
    return reject(
        "Non-finite weights",
        f"the model's tensor {name!r} contains NaN or Inf; the "
        "model diverged in training or the file is damaged",
    )


def read_onnx(path: Path) -> Any:
    """The ModelProto if the file parses as an ONNX model with a graph, else None."""
    import onnx
    from google.protobuf.message import DecodeError

    if path.stat().st_size > MAX_ONNX_BYTES:
        return None
    try:
        proto = onnx.load_model_from_string(path.read_bytes())
    except (DecodeError, ValueError, RuntimeError, RecursionError):
        return None
    if not proto.graph.node or not proto.opset_import or not proto.ir_version:
        return None
    return proto


def check_onnx(proto: Any) -> ModelUpload:
    import onnx
    from onnx import numpy_helper

    from converters.onnx_fold import ONLINE_NORM_OPS

    tensors = list(_onnx_tensors(proto.graph))
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in tensors):
        raise reject(
            "ONNX external data refused",
            "the ONNX model keeps weights in external "
            "files, which the service does not read; save it as one file "
            "(onnx.save_model(model, path, save_as_external_data=False))",
        )
    try:
        onnx.checker.check_model(proto)
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
    for tensor in tensors:
        if tensor.data_type in (
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.DOUBLE,
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.BFLOAT16,
        ):
            values = numpy_helper.to_array(tensor)
            if not np.isfinite(values.astype(np.float32)).all():
                raise _nonfinite(tensor.name)
    return ModelUpload("onnx", None, None)


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
