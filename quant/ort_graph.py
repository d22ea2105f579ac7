"""Graph rewrites that let ONNX Runtime's CPU kernels run a QDQ model fast.

Measured on ViT-Tiny (batch 1, one thread; ``benchmarks/results/latency.md``), two costs
dominate the straight QDQ file besides the matrix products themselves:

* a Linear on a (batch, tokens, features) tensor exports as MatMul + Add, which ORT runs as
  QLinearMatMul and then a separate QLinearAdd for the bias (a second pass over the output and
  a second rounding). As Gemm on the flattened tokens, the bias becomes QGemm's int32 bias:
  ``linear_as_gemm``, on the fp32 graph before quantization.
* ORT's integer Softmax (QLinearSoftmax, a table per element) is several times slower than its
  float one, and GELU has no integer kernel at all, so its input is dequantized anyway. Letting
  the MatMul/Gemm that feeds them write float (MatMulIntegerToFloat, QGemm without an output
  scale) skips a requantize-dequantize round trip: ``float_inputs``, on the QDQ graph.

Both keep every matrix product integer; only the inputs of those float ops stay float.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

# ops that only move data: a Q/DQ pair around them may be skipped when walking up the graph
SHAPE_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})
MATRIX_OPS = frozenset({"MatMul", "Gemm"})


def linear_as_gemm(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each ``Add(MatMul(x, W), b)`` with constant 2-D ``W`` and 1-D ``b`` on an
    input of rank >= 3 as ``Reshape(Gemm(Reshape(x, [-1, K]), W, b), shape)``; returns how many.

    Needs the output shape with at most one unknown dimension (a dynamic batch), so the shape
    comes back with one -1. The Add's output name is kept: nothing downstream changes.
    """
    shapes = _shapes(model)
    constants = {init.name: init for init in model.graph.initializer}
    consumers = _consumers(model.graph.node)
    nodes, dropped, count = [], set(), 0
    for node in model.graph.node:
        if id(node) in dropped:
            continue
        linear = _linear(node, consumers, constants, shapes)
        if linear is None:
            nodes.append(node)
            continue
        add, bias, out_shape = linear
        k = constants[node.input[1]].dims[0]
        flat, back = f"{node.name}_as_2d", f"{node.name}_back_to_nd"
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(np.array([-1, k], np.int64), flat),
                numpy_helper.from_array(np.array(out_shape, np.int64), back),
            ]
        )
        x2d, y2d, name = f"{node.name}_x_2d", f"{node.name}_y_2d", node.name
        nodes += [
            helper.make_node("Reshape", [node.input[0], flat], [x2d], name=f"{name}_flatten"),
            helper.make_node("Gemm", [x2d, node.input[1], bias], [y2d], name=f"{name}_gemm"),
            helper.make_node("Reshape", [y2d, back], [add.output[0]], name=f"{name}_unflatten"),
        ]
        dropped.add(id(add))
        count += 1
    _replace_nodes(model, nodes)
    return count


def _linear(
    matmul: onnx.NodeProto,
    consumers: dict[str, list[onnx.NodeProto]],
    constants: dict[str, onnx.TensorProto],
    shapes: dict[str, list[int]],
) -> tuple[onnx.NodeProto, str, list[int]] | None:
    """(the bias Add, the bias name, the output shape) when ``matmul`` is a Linear to rewrite."""
    if matmul.op_type != "MatMul" or matmul.input[1] not in constants:
        return None
    if len(constants[matmul.input[1]].dims) != 2:
        return None
    users = consumers.get(matmul.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    add = users[0]
    bias = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    if bias not in constants or len(constants[bias].dims) != 1:
        return None
    in_shape, out_shape = shapes.get(matmul.input[0]), shapes.get(add.output[0])
    if not in_shape or len(in_shape) < 3 or not out_shape or out_shape.count(-1) > 1:
        return None
    return add, bias, out_shape


def float_inputs(model: onnx.ModelProto, op_types: Iterable[str]) -> int:
    """In a QDQ model, feed each ``op_types`` node straight from the MatMul/Gemm that computes
    its input, in float: drop the QuantizeLinear/DequantizeLinear pairs between them (through
    shape-only ops). In place; returns how many nodes were rewired.

    ORT then fuses the producer with its dequantized inputs into a kernel with a float output
    (MatMulIntegerToFloat, QGemm), instead of requantizing a tensor only to dequantize it again.
    A pair is dropped only when nothing else reads it.
    """
    wanted = frozenset(op_types)
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers = _consumers(model.graph.node)
    dropped: set[int] = set()
    count = 0
    for node in model.graph.node:
        if node.op_type not in wanted:
            continue
        pairs = _qdq_chain(node, producers, consumers)
        if not pairs:
            continue
        for reader, quantize, dequantize in pairs:
            reader.input[0] = quantize.input[0]
            dropped |= {id(quantize), id(dequantize)}
        count += 1
    _replace_nodes(model, [n for n in model.graph.node if id(n) not in dropped])
    _drop_unused_initializers(model)  # the dropped pairs' scales and zero points
    return count


def _qdq_chain(
    node: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """The (reader, Q, DQ) pairs on the path from ``node``'s first input up to a MatMul/Gemm,
    or [] when that path holds anything else or a tensor with another reader."""
    pairs, reader = [], node
    while True:
        dequantize = producers.get(reader.input[0])
        if dequantize is None or dequantize.op_type != "DequantizeLinear":
            return []
        quantize = producers.get(dequantize.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear":
            return []
        if len(consumers[dequantize.output[0]]) != 1 or len(consumers[quantize.output[0]]) != 1:
            return []
        pairs.append((reader, quantize, dequantize))
        source = producers.get(quantize.input[0])
        if source is not None and source.op_type in MATRIX_OPS:
            return pairs
        if source is None or source.op_type not in SHAPE_OPS:
            return []
        reader = source


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Tensor name -> dims (-1 where unknown), from ONNX shape inference."""
    inferred = shape_inference.infer_shapes(model)
    graph = inferred.graph
    return {
        value.name: [
            d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim
        ]
        for value in [*graph.value_info, *graph.input, *graph.output]
        if value.type.tensor_type.HasField("shape")
    }


def _consumers(nodes: Iterable[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _replace_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    kept = list(nodes)  # may alias model.graph.node's elements: copy before clearing
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    read = {name for node in model.graph.node for name in node.input}
    read |= {value.name for value in model.graph.output}
    kept = [init for init in model.graph.initializer if init.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
