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

* ``q * head_dim**-0.5`` before Q.K^T is an integer Mul (QLinearMul, its own pass and its own
  rounding). A constant positive factor on an activation between its DequantizeLinear and the
  next QuantizeLinear/DequantizeLinear pair is that factor in the scale of one
  DequantizeLinear: ``fold_constant_factors`` (exact, one rounding fewer).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

# ops that only move data: a Q/DQ pair around them may be skipped when walking up the graph
SHAPE_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})
MATRIX_OPS = frozenset({"MatMul", "Gemm"})
# an op between a product and the float op it feeds that adds a second tensor to it, as a text
# model adds its attention mask to the scores before the Softmax: fed in float too (the mask
# stays dequantized), so that the scores are not requantized to the mask's range for an
# integer Add and an integer Softmax
MASK_OPS = frozenset({"Add"})


def linear_as_gemm(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each ``Add(MatMul(x, W), b)`` with constant 2-D ``W`` and 1-D ``b`` on an
    input of rank >= 3 as ``Reshape(Gemm(Reshape(x, [-1, K]), W, b), shape)``; returns how many.

    Needs the output shape with at most one unknown dimension (a dynamic batch), so the shape
    comes back with one -1. The Add's output name is kept: nothing downstream changes.
    """
    shapes = tensor_shapes(model)
    constants = {init.name: init for init in model.graph.initializer}
    consumers = consumers_of(model.graph.node)
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
    replace_nodes(model, nodes)
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


def float_inputs(
    model: onnx.ModelProto, op_types: Iterable[str], names: Collection[str] | None = None
) -> int:
    """In a QDQ model, feed each ``op_types`` node (of those ``names``, if given) straight from
    the MatMul/Gemm that computes its input, in float: drop the QuantizeLinear/DequantizeLinear
    pairs between them (through shape-only ops). In place; returns how many nodes were rewired.

    ORT then fuses the producer with its dequantized inputs into a kernel with a float output
    (MatMulIntegerToFloat, QGemm), instead of requantizing a tensor only to dequantize it again.
    A pair is dropped only when nothing else reads it.

    A pair whose DequantizeLinear scale differs from its QuantizeLinear's carries a factor
    (``fold_constant_factors`` put timm's ``(q @ k^T) * scale`` there): the factor moves into
    the scale of the producer's left operand (and a Gemm's bias), so the float output is
    already scaled. Where it cannot move (the product's output read elsewhere, an operand not
    dequantized), the pairs stay.
    """
    wanted = frozenset(op_types)
    constants = constant_values(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers = consumers_of(model.graph.node)
    dropped: set[int] = set()
    operands: dict[int, list[onnx.NodeProto]] = {}  # id(product) -> its rescaled operands
    count = 0
    for node in model.graph.node:
        if node.op_type not in wanted or (names is not None and node.name not in names):
            continue
        pairs = _qdq_chain(node, producers, consumers)
        factor = _chain_factor(pairs, constants)
        if not pairs or factor is None:
            continue
        if factor != 1.0:
            product = producers[pairs[-1][1].input[0]]
            rescaled = _rescaled_operands(product, factor, producers, consumers, constants)
            if rescaled is None:
                continue
            initializers, operands[id(product)] = rescaled
            model.graph.initializer.extend(initializers)
        for reader, quantize, dequantize in pairs:
            reader.input[0] = quantize.input[0]
            dropped |= {id(quantize), id(dequantize)}
        count += 1
    nodes = []
    for node in model.graph.node:  # a rescaled operand just before its product
        nodes += operands.get(id(node), [])
        if id(node) not in dropped:
            nodes.append(node)
    replace_nodes(model, _without_unread_dequantize(model, nodes))
    drop_unused_initializers(model)  # the dropped pairs' scales and zero points
    return count


def pair_factor(
    quantize: onnx.NodeProto, dequantize: onnx.NodeProto, constants: dict[str, np.ndarray]
) -> float | None:
    """The factor a QuantizeLinear -> DequantizeLinear pair applies besides its rounding: the
    DequantizeLinear's scale over the QuantizeLinear's (1 unless a factor was folded into it),
    or None unless both are per tensor, constant, with the same constant zero point."""
    scales = [quantize.input[1], dequantize.input[1]]
    zeros = [n.input[2] if len(n.input) > 2 else "" for n in (quantize, dequantize)]
    if not all(name in constants and constants[name].size == 1 for name in scales):
        return None
    if zeros[0] != zeros[1]:
        if not all(name in constants and constants[name].size == 1 for name in zeros):
            return None
        first, second = constants[zeros[0]], constants[zeros[1]]
        if first.dtype != second.dtype or first != second:
            return None
    dequantize_scale, quantize_scale = (float(constants[n].reshape(())) for n in scales[::-1])
    return dequantize_scale / quantize_scale


def _chain_factor(
    pairs: list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]],
    constants: dict[str, np.ndarray],
) -> float | None:
    """The product of the pairs' factors (``pair_factor``), None if one has none, or if a pair
    above an Add (``MASK_OPS``) has one: moved into the product, it would miss the mask."""
    factor = 1.0
    for index, (_, quantize, dequantize) in enumerate(pairs):
        one = pair_factor(quantize, dequantize, constants)
        if one is None:
            return None
        if one != 1.0 and any(reader.op_type in MASK_OPS for reader, _, _ in pairs[index + 1 :]):
            return None
        factor *= one
    return factor


def _rescaled_operands(
    product: onnx.NodeProto,
    factor: float,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    constants: dict[str, np.ndarray],
) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]] | None:
    """A MatMul/Gemm whose output comes out ``factor`` times larger: a DequantizeLinear of its
    left operand (and of a Gemm's bias) of its own, with its scale times ``factor``; the
    product is rewired to them. None (nothing changed) where the product's output has another
    reader, which would see the factor too, or an operand is not a per-tensor dequantization."""
    if len(consumers.get(product.output[0], [])) != 1:
        return None
    slots = [0, 2] if product.op_type == "Gemm" and len(product.input) > 2 else [0]
    sources = [producers.get(product.input[slot]) for slot in slots]
    if any(
        source is None
        or source.op_type != "DequantizeLinear"
        or source.input[1] not in constants
        or constants[source.input[1]].size != 1
        for source in sources
    ):
        return None
    initializers, nodes = [], []
    for slot, source in zip(slots, sources, strict=True):
        name = f"{product.name or product.output[0]}_input{slot}_rescaled"
        scale = constants[source.input[1]].astype(np.float64) * factor
        initializers.append(numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale"))
        node = helper.make_node(
            "DequantizeLinear", [source.input[0], f"{name}_scale", *source.input[2:]], [name],
            name=name,
        )  # fmt: skip
        node.attribute.extend(source.attribute)
        nodes.append(node)
        product.input[slot] = name
    return initializers, nodes


def _qdq_chain(
    node: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """The (reader, Q, DQ) pairs on the path from ``node``'s first input up to a MatMul/Gemm
    (through shape ops and the first input of an Add: ``MASK_OPS``), or [] when that path holds
    anything else or a tensor with another reader."""
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
        if source is None or source.op_type not in SHAPE_OPS | MASK_OPS:
            return []
        reader = source


def product_operands(model: onnx.ModelProto) -> set[str]:
    """The tensors a matrix product (MatMul, Gemm, Conv) reads, directly or through shape-only
    ops: in int16, each would take that product off ONNX Runtime's integer kernels."""
    producers = {out: node for node in model.graph.node for out in node.output}
    operands: set[str] = set()
    for node in model.graph.node:
        if node.op_type not in MATRIX_OPS | {"Conv"}:
            continue
        for tensor in node.input:
            while tensor and tensor not in operands:  # up the data input of shape ops
                operands.add(tensor)
                producer = producers.get(tensor)
                if producer is None or producer.op_type not in SHAPE_OPS:
                    break
                tensor = producer.input[0]
    constants = {init.name for init in model.graph.initializer}
    return operands - constants  # activations only, not the weights


def tensor_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
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


def consumers_of(nodes: Iterable[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def replace_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    kept = list(nodes)  # may alias model.graph.node's elements: copy before clearing
    del model.graph.node[:]
    model.graph.node.extend(kept)


def drop_unused_initializers(model: onnx.ModelProto) -> None:
    read = {name for node in model.graph.node for name in node.input}
    read |= {value.name for value in model.graph.output}
    kept = [init for init in model.graph.initializer if init.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def fold_constant_factors(model: onnx.ModelProto) -> int:
    """Each ``Mul(DequantizeLinear(x), c)`` -> QuantizeLinear -> DequantizeLinear, with ``c`` one
    positive constant, becomes one DequantizeLinear of ``x`` with its scale times ``c``. In
    place; returns how many. Only where nothing else reads the Mul's pair."""
    constants = constant_values(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers = consumers_of(model.graph.node)
    dropped: set[int] = set()
    added: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []  # (new DequantizeLinear, before)
    for mul in model.graph.node:
        if mul.op_type != "Mul":
            continue
        fold = _foldable(mul, producers, consumers, constants)
        if fold is None:
            continue
        source, factor, quantize, dequantize = fold
        scale_name = f"{dequantize.output[0]}_scale_folded"
        scale = constants[source.input[1]] * factor
        model.graph.initializer.append(
            numpy_helper.from_array(scale.astype(np.float32), scale_name)
        )
        inputs = [source.input[0], scale_name, *source.input[2:]]
        node = helper.make_node(
            "DequantizeLinear", inputs, [dequantize.output[0]], name=f"{mul.name}_folded"
        )
        node.attribute.extend(source.attribute)
        added.append((node, dequantize))
        dropped |= {id(mul), id(quantize), id(dequantize)}
        if len(consumers[source.output[0]]) == 1:
            dropped.add(id(source))
    replacement = {id(before): node for node, before in added}  # in the place of the pair's DQ
    nodes = [
        replacement.get(id(n), n)
        for n in model.graph.node
        if id(n) not in dropped or id(n) in replacement
    ]
    replace_nodes(model, _without_unread_dequantize(model, nodes))
    drop_unused_initializers(model)
    return len(added)


def shapes_of_quantized(model: onnx.ModelProto) -> int:
    """Each Shape that reads a DequantizeLinear's output reads its quantized input instead (the
    same shape), and a DequantizeLinear left with no reader goes. In place; returns how many.
    The exported ViT takes the batch size for its class token from the input image: ORT
    dequantized the whole batch of images (one thread, 3 ms at batch 8) only for its shape."""
    producers = {out: node for node in model.graph.node for out in node.output}
    count = 0
    for node in model.graph.node:
        source = producers.get(node.input[0]) if node.op_type == "Shape" else None
        if source is not None and source.op_type == "DequantizeLinear":
            node.input[0] = source.input[0]
            count += 1
    replace_nodes(model, _without_unread_dequantize(model, list(model.graph.node)))
    drop_unused_initializers(model)
    return count


def _foldable(
    mul: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    constants: dict[str, np.ndarray],
) -> tuple[onnx.NodeProto, float, onnx.NodeProto, onnx.NodeProto] | None:
    """(the activation's DequantizeLinear, the factor, the Mul's Q and DQ) or None."""
    for data, other in ((0, 1), (1, 0)):
        source = producers.get(mul.input[data])
        factor = _constant_factor(mul.input[other], producers, constants)
        if source is None or source.op_type != "DequantizeLinear" or factor is None:
            continue
        if source.input[0] in constants or source.input[1] not in constants:
            continue  # a weight, or a scale computed at run time
        readers = consumers.get(mul.output[0], [])
        if len(readers) != 1 or readers[0].op_type != "QuantizeLinear":
            return None
        quantize = readers[0]
        after = consumers.get(quantize.output[0], [])
        if len(after) != 1 or after[0].op_type != "DequantizeLinear":
            return None
        return source, factor, quantize, after[0]
    return None


def _constant_factor(
    name: str, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]
) -> float | None:
    """The one positive value of a constant, or of a DequantizeLinear of constants."""
    if name in constants:
        value = constants[name].astype(np.float64)
    else:
        node = producers.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return None
        if not all(i in constants for i in node.input if i):
            return None
        data = constants[node.input[0]].astype(np.float64)
        zero = constants[node.input[2]].astype(np.float64) if len(node.input) > 2 else 0.0
        value = (data - zero) * constants[node.input[1]].astype(np.float64)
    if value.size != 1 or not value.reshape(()) > 0:
        return None
    return float(value.reshape(()))


def _without_unread_dequantize(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto]
) -> list[onnx.NodeProto]:
    """``nodes`` less the DequantizeLinear nodes whose output nothing reads any more (the
    folded factors')."""
    read = {name for node in nodes for name in node.input}
    read |= {value.name for value in model.graph.output}
    return [n for n in nodes if n.op_type != "DequantizeLinear" or n.output[0] in read]


def constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
