"""Exact ONNX rewrites: GELU per opset, and the graph helpers every rewrite here uses.

* ``Gelu`` exists from opset 20. Below it, it is lowered to the formula torch writes
  (``x * (1 + erf(x / sqrt 2)) * 0.5``; the tanh variant to its own formula), which TIDL fuses.
  From opset 20 on, that Erf pattern (as the legacy exporter and opset <= 18 write it) becomes
  one ``Gelu``: onnx2tf turns Erf into a TensorFlow Flex op that LiteRT and NPUs cannot run,
  while ``Gelu`` becomes the TFLite builtin GELU.

The rewrites for NPUs (Gathers as slices, ...) are in :mod:`.edge_rewrites`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass, ShapeInferencePass

GELU_OPSET = 20  # the first opset with a Gelu op
SQRT_2 = float(np.sqrt(2.0))
TANH_GELU_SCALE = float(np.sqrt(2.0 / np.pi))
TANH_GELU_CUBIC = 0.044715
INT64_MAX = np.iinfo(np.int64).max


def constant(value: ir.Value | None) -> np.ndarray | None:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def is_scalar(value: ir.Value | None, expected: float) -> bool:
    """A constant holding one number close to ``expected`` (float32-exported constants)."""
    array = constant(value)
    return array is not None and array.size == 1 and bool(np.isclose(array.item(), expected))


def is_default_op(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def sole_user(value: ir.Value) -> ir.Node | None:
    """The one node reading ``value`` (not a graph output), else None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0][0]


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other operand of a binary node that reads ``value`` once."""
    inputs = list(node.inputs)
    if len(inputs) != 2 or inputs.count(value) != 1:
        return None
    return inputs[1 - inputs.index(value)]


def scalar_like(graph: ir.Graph, like: ir.Value, number: float, name: str) -> ir.Value:
    """A scalar initializer in ``like``'s element type (float32 when unknown)."""
    dtype = like.dtype.numpy() if like.dtype is not None else np.float32
    value = ir.Value(name=name, const_value=ir.tensor(np.array(number, dtype=dtype)))
    graph.register_initializer(value)
    return value


def fresh_name(graph: ir.Graph, base: str) -> str:
    taken = set(graph.initializers)
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    return name


def replace_output(graph: ir.Graph, old: ir.Node, new: list[ir.Node], result: ir.Value) -> None:
    """Insert ``new`` before ``old``, route ``old``'s output to ``result`` and drop ``old``
    (``result`` takes the output's name when it is a graph output)."""
    graph.insert_before(old, new)
    out = old.outputs[0]
    result.type, result.shape = out.type or result.type, out.shape or result.shape  # same values
    was_output = out.is_graph_output()
    ir.convenience.replace_all_uses_with(out, result, replace_graph_outputs=True)
    if was_output:
        result.name = out.name
    graph.remove(old, safe=True)


def set_constant_input(
    graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, name: str
) -> None:
    """Give input ``index`` of ``node`` a new initializer (the old one is then unused)."""
    value = ir.Value(name=fresh_name(graph, name), const_value=ir.tensor(array))
    graph.register_initializer(value)
    if index >= len(node.inputs):
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)


def constant_lookups(graph: ir.Graph) -> int:
    """Every Gather of a constant table at constant indices (BERT's position rows) as the
    constant it reads; returns how many."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "Gather")]:
        table, indices = constant(node.inputs[0]), constant(node.inputs[1])
        if table is None or indices is None:
            continue
        axis = node.attributes.get("axis")
        rows = np.take(table, indices, axis=axis.value if axis is not None else 0)
        value = ir.Value(name=fresh_name(graph, f"{node.name}_rows"), const_value=ir.tensor(rows))
        graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(node.outputs[0], value, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        count += 1
    return count


def int64_initializer(graph: ir.Graph, values: list[int], name: str) -> ir.Value:
    value = ir.Value(
        name=fresh_name(graph, name), const_value=ir.tensor(np.array(values, dtype=np.int64))
    )
    graph.register_initializer(value)
    return value


# -- GELU below opset 20: the formula ------------------------------------------------------------


def lower_gelu(graph: ir.Graph) -> int:
    """Every Gelu node as its formula (Erf form, or the tanh approximation's); returns how many."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "Gelu")]:
        attr = node.attributes.get("approximate")
        approximate = attr.as_string() if attr is not None else "none"
        build = gelu_tanh_nodes if approximate == "tanh" else gelu_erf_nodes
        nodes, result = build(graph, node.inputs[0], node.name or "gelu")  # type: ignore[arg-type]
        replace_output(graph, node, nodes, result)
        count += 1
    return count


def gelu_erf_nodes(graph: ir.Graph, x: ir.Value, base: str) -> tuple[list[ir.Node], ir.Value]:
    """``x * (1 + erf(x / sqrt 2)) * 0.5``, node for node what the legacy exporter writes."""
    sqrt2 = scalar_like(graph, x, SQRT_2, fresh_name(graph, f"{base}_sqrt2"))
    one = scalar_like(graph, x, 1.0, fresh_name(graph, f"{base}_one"))
    half = scalar_like(graph, x, 0.5, fresh_name(graph, f"{base}_half"))
    div = ir.Node("", "Div", [x, sqrt2])
    erf = ir.Node("", "Erf", [div.outputs[0]])
    add = ir.Node("", "Add", [erf.outputs[0], one])
    mul = ir.Node("", "Mul", [x, add.outputs[0]])
    out = ir.Node("", "Mul", [mul.outputs[0], half])
    return [div, erf, add, mul, out], out.outputs[0]


def gelu_tanh_nodes(graph: ir.Graph, x: ir.Value, base: str) -> tuple[list[ir.Node], ir.Value]:
    """``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``."""
    cubic = scalar_like(graph, x, TANH_GELU_CUBIC, fresh_name(graph, f"{base}_cubic"))
    scale = scalar_like(graph, x, TANH_GELU_SCALE, fresh_name(graph, f"{base}_scale"))
    one = scalar_like(graph, x, 1.0, fresh_name(graph, f"{base}_one"))
    half = scalar_like(graph, x, 0.5, fresh_name(graph, f"{base}_half"))
    square = ir.Node("", "Mul", [x, x])
    cube = ir.Node("", "Mul", [square.outputs[0], x])
    scaled_cube = ir.Node("", "Mul", [cube.outputs[0], cubic])
    inner = ir.Node("", "Add", [x, scaled_cube.outputs[0]])
    argument = ir.Node("", "Mul", [inner.outputs[0], scale])
    tanh = ir.Node("", "Tanh", [argument.outputs[0]])
    plus_one = ir.Node("", "Add", [tanh.outputs[0], one])
    half_x = ir.Node("", "Mul", [x, half])
    out = ir.Node("", "Mul", [half_x.outputs[0], plus_one.outputs[0]])
    nodes = [square, cube, scaled_cube, inner, argument, tanh, plus_one, half_x, out]
    return nodes, out.outputs[0]


# -- GELU from opset 20: one node ----------------------------------------------------------------


def fuse_erf_gelu(graph: ir.Graph) -> int:
    """Every ``x * (1 + erf(x / sqrt 2)) * 0.5`` (Div by sqrt 2 or Mul by 1 / sqrt 2, the three
    factors in any grouping) as one ``Gelu(approximate="none")``; returns how many."""
    count = 0
    for erf in [n for n in graph if is_default_op(n, "Erf")]:
        match = erf_gelu_pattern(erf)
        if match is None:
            continue
        x, nodes = match
        gelu = ir.Node("", "Gelu", [x], attributes=[ir.AttrString("approximate", "none")])
        root = nodes[-1]
        replace_output(graph, root, [gelu], gelu.outputs[0])
        graph.remove(nodes[:-1], safe=True)
        count += 1
    return count


def erf_gelu_pattern(erf: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, the pattern's nodes in graph order, the last one producing GELU(x)) or None."""
    scaled = erf.inputs[0]
    divide = scaled.producer() if scaled is not None else None
    if divide is None or sole_user(scaled) is not erf:  # type: ignore[arg-type]
        return None
    x = erf_argument_source(divide)
    plus = sole_user(erf.outputs[0])
    if x is None or not is_default_op(plus, "Add"):
        return None
    assert plus is not None
    if not is_scalar(other_input(plus, erf.outputs[0]), 1.0):
        return None
    tail = product_tail(plus.outputs[0], x)
    return None if tail is None else (x, [divide, erf, plus, *tail])


def erf_argument_source(node: ir.Node) -> ir.Value | None:
    """x for ``x / sqrt 2`` or ``x * (1 / sqrt 2)``."""
    if is_default_op(node, "Div") and is_scalar(node.inputs[1], SQRT_2):
        return node.inputs[0]
    if is_default_op(node, "Mul"):
        for data, factor in (node.inputs, reversed(node.inputs)):
            if constant(data) is None and is_scalar(factor, 1 / SQRT_2):
                return data
    return None


def product_tail(plus: ir.Value, x: ir.Value) -> list[ir.Node] | None:
    """The Mul nodes that form ``x * plus * 0.5`` from ``plus`` (= 1 + erf), in the three
    groupings exporters write: ``(x * plus) * 0.5``, ``x * (plus * 0.5)``, ``(x * 0.5) * plus``."""
    first = sole_user(plus)
    if not is_default_op(first, "Mul"):
        return None
    assert first is not None
    other = other_input(first, plus)
    if other is x or is_scalar(other, 0.5):
        second = sole_user(first.outputs[0])
        if not is_default_op(second, "Mul"):
            return None
        assert second is not None
        last = other_input(second, first.outputs[0])
        wanted = is_scalar(last, 0.5) if other is x else last is x
        return [first, second] if wanted else None
    half_x = other.producer() if other is not None else None
    if (
        half_x is None
        or not is_default_op(half_x, "Mul")
        or sole_user(other) is not first  # type: ignore[arg-type]
        or not is_scalar(other_input(half_x, x), 0.5)
    ):
        return None
    return [half_x, first]


# -- on a ModelProto -----------------------------------------------------------------------------


def rewrite_model(
    model: onnx.ModelProto, rewrite: Callable[[ir.Graph], int], *, shapes: bool = False
) -> onnx.ModelProto:
    """``rewrite`` applied to the main graph; the same proto back when it changed nothing.
    ``shapes``: infer shapes first (the Gather rewrite needs ranks)."""
    ir_model = ir.from_proto(model)
    if shapes:
        ShapeInferencePass()(ir_model)
    if not rewrite(ir_model.graph):
        return model
    NameFixPass()(ir_model)  # names for the nodes and values added
    return ir.to_proto(ir_model)


def gelu_for_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """GELU as the ``opset`` can hold it: the formula below 20, one Gelu node from 20 on."""
    return rewrite_model(model, lower_gelu if opset < GELU_OPSET else fuse_erf_gelu)
