"""Symmetric right-hand operands for int8 BATCH_MATMUL, so that LiteRT's XNNPACK delegate runs it.

Why: XNNPACK's delegate refuses an int8 BATCH_MATMUL whose right-hand input has a zero point
other than 0 (LiteRT >= 2.1.3: LiteRT commit 3d79631 / XNNPACK ecb6799, in
``VisitBatchMatMulNode``), and TFLite's own int8 kernel for it is the reference one. TensorFlow's
converter quantizes activations asymmetrically, per tensor, so attention's K and V come out
with zero points such as -8 or 10: none of the products was delegated, and in a ViT-Tiny they
took ~47 of ~50 ms (``benchmarks/studies/litert_attention``).

How: an int8 tensor's scale and zero point are set where it is computed. The right operand is
usually not computed by an op that could take any output quantization: K is the qkv
FULLY_CONNECTED's output after SPLIT, RESHAPE and TRANSPOSE, ops whose int8 kernels copy bytes
and so need their input's and output's quantization equal. Those tensors form one group
(``PASS_THROUGH`` joins them); the group's real producers are the ops writing into it that
requantize (``REQUANTIZING``: their kernels derive the output rescale from the output tensor's
scale and zero point when the interpreter prepares them). The whole group gets the symmetric
quantization of the same float range, ``scale' = max(|min|, |max|) / 127`` and zero point 0,
so the producer itself writes the symmetric values; nothing is inserted, nothing is float, and
every other reader of the group (Q's MUL, the other BATCH_MATMUL) takes the new scale as given.
The cost is resolution: the step grows by ``max(|min|, |max|) / ((max - min) / 2) - 1``, a
few percent for the zero points the converter chooses here. A group that cannot be requantized
so (it holds a graph input or a constant, or an op writes or reads it that needs a fixed
quantization) is left as it is and recorded with the reason.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from .flatbuffer import op_type, read_model, tensor_indices, tensor_name, write_model

# op -> the inputs whose int8 quantization its kernel requires equal to its output's (None: all)
PASS_THROUGH: dict[str, tuple[int, ...] | None] = {
    "RESHAPE": (0,),
    "TRANSPOSE": (0,),
    "SQUEEZE": (0,),
    "EXPAND_DIMS": (0,),
    "SPLIT": (1,),  # (axis, input)
    "SPLIT_V": (0,),
    "STRIDED_SLICE": (0,),
    "SLICE": (0,),
    "GATHER": (0,),
    "UNPACK": (0,),
    "BROADCAST_TO": (0,),
    "TILE": (0,),
    "PACK": None,
    "CONCATENATION": None,
}
# int8 kernels that rescale to whatever output scale and zero point the output tensor holds
REQUANTIZING = frozenset(
    {
        "FULLY_CONNECTED",
        "CONV_2D",
        "DEPTHWISE_CONV_2D",
        "BATCH_MATMUL",
        "ADD",
        "SUB",
        "MUL",
        "MEAN",
        "SUM",
        "QUANTIZE",
    }
)
# int8 kernels that read any input scale and zero point (besides the requantizing ones)
READS_ANY = REQUANTIZING | {"SOFTMAX", "GELU", "LOGISTIC", "TANH", "DEQUANTIZE"}
INT8_MAX = 127


@dataclass(frozen=True)
class SymmetricOperand:
    """One group of tensors that share a quantization and feed BATCH_MATMUL right operands.

    ``tensor`` is the group's first tensor written by a real producer (``producer``, its op
    type), ``tensors`` how many tensors the group holds, ``matmuls`` how many BATCH_MATMULs take
    one of them as their right operand; ``scale`` and ``zero_point`` are the converter's,
    ``new_scale`` the symmetric one (zero point 0), or None with ``reason`` when the group was
    left as it was."""

    tensor: str
    producer: str
    tensors: int
    matmuls: int
    scale: float
    zero_point: int
    new_scale: float | None
    reason: str | None = None


def symmetric_scale(scale: float, zero_point: int) -> float:
    """The symmetric int8 scale of the float range that (scale, zero point) covers."""
    low, high = (-INT8_MAX - 1 - zero_point) * scale, (INT8_MAX - zero_point) * scale
    return max(-low, high) / INT8_MAX


def make_matmul_operands_symmetric(
    source: str | Path, destination: str | Path
) -> tuple[SymmetricOperand, ...]:
    """Write ``source`` to ``destination`` (the same path is fine) with every int8
    BATCH_MATMUL's right operand at zero point 0 where its producer can be requantized; what
    changed, or why not, one record per group (none when every right operand was symmetric)."""
    source, destination = Path(source), Path(destination)
    model = read_model(source)
    graph = model.subgraphs[0]
    groups = _groups(model, graph)
    matmuls: dict[int, int] = {}  # group root -> right operands it feeds, in graph order
    for op in graph.operators or []:
        right = int(op.inputs[1]) if op_type(model, op) == "BATCH_MATMUL" else -1
        if right >= 0 and _is_int8(graph.tensors[right]):
            root = groups.find(right)
            matmuls[root] = matmuls.get(root, 0) + 1
    records = []
    for root, count in matmuls.items():
        members = groups.members(root)
        scale, zero_point = _quantization(graph.tensors[root])
        if zero_point == 0 and all(_quantization(graph.tensors[t]) == (scale, 0) for t in members):
            continue
        producers = _producers(model, graph, members)
        head = producers[0] if producers else (root, "none")
        reason = _why_not(model, graph, members, producers, (scale, zero_point))
        new_scale = None if reason else symmetric_scale(scale, zero_point)
        if new_scale is not None:
            for index in members:
                _set_quantization(graph.tensors[index], new_scale)
        records.append(
            SymmetricOperand(
                tensor=tensor_name(graph.tensors[head[0]]),
                producer=head[1],
                tensors=len(members),
                matmuls=count,
                scale=scale,
                zero_point=zero_point,
                new_scale=new_scale,
                reason=reason,
            )
        )
    if any(r.new_scale is not None for r in records):
        write_model(model, destination)
    elif source.resolve() != destination.resolve():
        shutil.copyfile(source, destination)
    return tuple(records)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, item: int) -> int:
        self.parent.setdefault(item, item)
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(b)] = self.find(a)

    def members(self, root: int) -> list[int]:
        return sorted(item for item in self.parent if self.find(item) == root)


def _groups(model: schema.ModelT, graph: schema.SubGraphT) -> _UnionFind:
    """Tensors joined by pass-through ops: each group must share one quantization."""
    groups = _UnionFind()
    for op in graph.operators or []:
        kind = op_type(model, op)
        if kind not in PASS_THROUGH:
            continue
        inputs, outputs = tensor_indices(op.inputs), tensor_indices(op.outputs)
        linked = PASS_THROUGH[kind]
        data = inputs if linked is None else [inputs[i] for i in linked if i < len(inputs)]
        for tensor in data + outputs[1:]:
            groups.union(outputs[0], tensor)
    return groups


def _producers(
    model: schema.ModelT, graph: schema.SubGraphT, members: list[int]
) -> list[tuple[int, str]]:
    """(tensor, op type) of each op that writes a group tensor and is not a pass-through op."""
    found = []
    for op in graph.operators or []:
        kind = op_type(model, op)
        if kind in PASS_THROUGH:
            continue
        found += [(t, kind) for t in tensor_indices(op.outputs) if t in members]
    return found


def _why_not(
    model: schema.ModelT,
    graph: schema.SubGraphT,
    members: list[int],
    producers: list[tuple[int, str]],
    quantization: tuple[float, int],
) -> str | None:
    """Why the group cannot take another quantization (None: it can)."""
    inputs = set(tensor_indices(graph.inputs))
    if any(t in inputs for t in members):
        return "it holds a graph input (its quantization is the caller's)"
    if any(not _is_int8(graph.tensors[t]) for t in members):
        return "not every tensor of it is per-tensor int8"
    if any(_quantization(graph.tensors[t]) != quantization for t in members):
        return "its tensors disagree on their quantization"
    written = {t for op in graph.operators or [] for t in tensor_indices(op.outputs)}
    if any(t not in written for t in members):
        return "it holds a constant"
    fixed = sorted({kind for _, kind in producers if kind not in REQUANTIZING})
    if fixed:
        return f"{', '.join(fixed)} writes it with a quantization of its own"
    readers = {
        op_type(model, op)
        for op in graph.operators or []
        if any(t in members for t in tensor_indices(op.inputs))
    }
    strict = sorted(readers - READS_ANY - PASS_THROUGH.keys())
    if strict:
        return f"{', '.join(strict)} reads it and may need its quantization as it is"
    return None


def _is_int8(tensor: schema.TensorT) -> bool:
    q = tensor.quantization
    return (
        tensor.type == schema.TensorType.INT8
        and q is not None
        and q.scale is not None
        and len(q.scale) == 1
    )


def _quantization(tensor: schema.TensorT) -> tuple[float, int]:
    q = tensor.quantization
    if q is None or q.scale is None or len(q.scale) != 1:
        return (0.0, 0)
    return float(q.scale[0]), int(q.zeroPoint[0])


def _set_quantization(tensor: schema.TensorT, scale: float) -> None:
    tensor.quantization.scale = np.array([scale], dtype=np.float32)
    tensor.quantization.zeroPoint = np.array([0], dtype=np.int64)
