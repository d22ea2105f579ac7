"""Opset 17 from the dynamo exporter's opset-18 graph.

torch's dynamo exporter implements opset 18 and up; asked for 17 it silently keeps 18. onnx's
version converter has no 18 -> 17 adapter for Split (and needs constant axes for the Reduce ops),
so the two schema changes of opset 18 that exported Transformers use are undone here on the IR:
``Split(num_outputs=n)`` gets its explicit ``split`` sizes back, and the ``axes`` input of
ReduceMean/ReduceMax/... becomes the attribute it was. Any other op whose schema changed in 18
is an error, never a mislabelled file; onnx.checker then validates the result against opset 17.
:func:`convert_opset` moves a model to any opset 17-25, GELU included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .errors import OpsetError, root_cause
from .onnx_rewrites import GELU_OPSET, gelu_for_opset
from .shape_inference import infer_shapes

# Reduce ops whose ``axes`` moved from attribute to input in opset 18 (ReduceSum moved in 13).
REDUCE_AXES_MOVED = {
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}  # fmt: skip


def changed_in_opset18(op_type: str) -> bool:
    try:
        return onnx.defs.get_schema(op_type, 18, "").since_version == 18
    except onnx.defs.SchemaError:
        return False


def downgrade_to_opset17(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph declared and written as opset 17 (raises OpsetError if it cannot be)."""
    ir_model = ir.from_proto(model)
    if ir_model.opset_imports.get("", 0) != 18:
        raise OpsetError(f"expected an opset-18 graph, got {ir_model.opset_imports.get('')}")
    for node in list(ir_model.graph.all_nodes()):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Split" and "num_outputs" in node.attributes:
            _split_sizes_as_input(node)
        elif node.op_type in REDUCE_AXES_MOVED:
            _reduce_axes_as_attribute(node)
        elif changed_in_opset18(node.op_type):
            raise OpsetError(f"cannot write opset 17: {node.op_type} changed in opset 18")
    ir_model.opset_imports[""] = 17
    RemoveUnusedNodesPass()(ir_model)  # the Reduce ops' axes tensors are attributes now
    proto = ir.to_proto(ir_model)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as error:
        raise OpsetError(
            f"opset 17 conversion failed validation: {str(error).splitlines()[0]}"
        ) from None
    return proto


def _split_sizes_as_input(node: ir.Node) -> None:
    """``Split(num_outputs=n)`` -> ``Split(x, split=[d/n] * n)``: needs the axis size known."""
    count = node.attributes["num_outputs"].as_int()
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    data_shape = node.inputs[0].shape if node.inputs[0] is not None else None
    size = data_shape[axis] if data_shape is not None else None
    if not isinstance(size, int) or size % count:
        raise OpsetError(f"cannot write opset 17: Split {node.name} has no static even split")
    sizes = ir.Value(
        name=f"{node.name}_split_sizes",
        const_value=ir.tensor(np.full(count, size // count, dtype=np.int64)),
    )
    node.graph.register_initializer(sizes)  # type: ignore[union-attr]
    del node.attributes["num_outputs"]
    node.resize_inputs(2)
    node.replace_input_with(1, sizes)


def _reduce_axes_as_attribute(node: ir.Node) -> None:
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return
    axes = ir.convenience.get_const_tensor(node.inputs[1])
    if axes is None:
        raise OpsetError(f"cannot write opset 17: {node.op_type} {node.name} has dynamic axes")
    values = [int(a) for a in axes.numpy().reshape(-1)]
    noop = node.attributes.pop("noop_with_empty_axes", None)  # attribute new in 18
    if noop is not None and noop.as_int() and not values:
        raise OpsetError(f"cannot write opset 17: {node.op_type} {node.name} is a no-op reduce")
    node.attributes["axes"] = ir.AttrInt64s("axes", values)
    node.resize_inputs(1)


def convert_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The graph declared and written at ``opset``: onnx's version converter (up, or down to 18),
    then :func:`downgrade_to_opset17` for 17. GELU follows the opset: lowered to its formula
    below 20 (the converter has no Gelu adapter), one Gelu node from 20 on (an Erf pattern is
    fused). Raises OpsetError when it cannot be done."""
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < GELU_OPSET:
        model = gelu_for_opset(model, opset)
    step = 18 if opset == 17 else opset
    if current not in (opset, step):
        try:
            model = onnx.version_converter.convert_version(model, step)
        except Exception as error:  # the converter raises bare RuntimeErrors with C++ text
            why = f"cannot convert opset {current} to {step}: {root_cause(error)}"
            model = relabelled(model, step, why)
    if opset == 17 and current != 17:
        model = downgrade_to_opset17(model)
    return gelu_for_opset(model, opset) if opset >= GELU_OPSET else model


def relabelled(model: onnx.ModelProto, opset: int, why_not: str) -> onnx.ModelProto:
    """The same graph declared at ``opset`` when every node is valid there as written.

    onnx's converter has no downward adapter for ops whose newer versions only admit more types
    (ConstantOfShape 20, Cast/Reshape/Shape 19 and 21, ...): the node needs no change, only the
    declared version. The full checker then validates each node against ``opset``'s schemas
    (inputs, attributes, type constraints) and shape inference; if it refuses, ``why_not`` (the
    converter's own reason) is the OpsetError."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        raise OpsetError(why_not) from None
    return proto


def with_static_batch(
    model: onnx.ModelProto, batch: int = 1, samples: Mapping[str, Sequence[int]] | None = None
) -> onnx.ModelProto:
    """Every graph input's first (batch) dimension fixed to ``batch``, and its other open
    dimensions to one sample's shape in ``samples`` (the user's data: a dynamic sequence
    length), shapes re-inferred: what NPU compilers need from a model exported with dynamic
    axes."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    initializers = {init.name for init in proto.graph.initializer}
    samples = samples or {}
    for value in [*proto.graph.input, *proto.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.name in initializers or not dims:
            continue
        dims[0].Clear()
        dims[0].dim_value = batch
        sample = samples.get(value.name)
        if sample is not None and len(sample) == len(dims) - 1:
            for dim, size in zip(list(dims)[1:], sample, strict=True):
                if not dim.HasField("dim_value"):
                    dim.Clear()
                    dim.dim_value = int(size)
    del proto.graph.value_info[:]
    return infer_shapes(proto, data_prop=True)
