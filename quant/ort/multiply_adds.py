"""How much arithmetic a graph is: the multiply-adds of its matrix products and convolutions.

A quantize-and-run step's cost grows with the samples it runs times the multiply-adds of one
sample, whatever the host: a budget counted in multiply-adds decides the same on a busy host
as on a quiet one, which a budget in seconds does not (quant.ort.pow2.grid's used to, and a loaded
CI host skipped a search that a quiet one ran).
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import tensor_shapes

COUNTED_OPS = frozenset({"MatMul", "Gemm", "Conv"})


def node_multiply_adds(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Multiply-adds of one MatMul, Gemm or Conv at the shapes given (its whole output, batch
    included), or None when a shape it needs is unknown or the op is none of those."""
    out = shapes.get(node.output[0])
    left, right = shapes.get(node.input[0]), shapes.get(node.input[1])
    if not out or any(d <= 0 for d in out):
        return None
    if node.op_type == "MatMul" and left:
        reduced = left[-1]
    elif node.op_type == "Gemm" and left:
        trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
        reduced = left[0] if trans_a else left[-1]
    elif node.op_type == "Conv" and right:  # weight: out channels, in channels / group, kernel
        reduced = int(np.prod(right[1:]))
    else:
        return None
    return int(np.prod(out)) * reduced if reduced > 0 else None


def multiply_adds_per_sample(model: onnx.ModelProto) -> int:
    """Multiply-adds of one sample through ``model``: every input's and output's first axis
    (the batch) set to 1, shapes inferred. A product whose shapes stay unknown counts as its
    constant operand's size (each weight used once: a lower bound) or 0."""
    single = onnx.ModelProto()
    single.CopyFrom(model)
    for value in [*single.graph.input, *single.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = 1
    constants = {init.name: list(init.dims) for init in model.graph.initializer}
    shapes = {**constants, **tensor_shapes(single)}
    sizes = {name: int(np.prod(dims)) for name, dims in constants.items()}
    total = 0
    for node in single.graph.node:
        if node.op_type not in COUNTED_OPS:
            continue
        counted = node_multiply_adds(node, shapes)
        total += counted if counted is not None else max(sizes.get(n, 0) for n in node.input[:2])
    return total
