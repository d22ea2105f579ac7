"""Exact ONNX rewrites that spare an NPU ops it cannot run, applied to every exported or folded
graph (:func:`for_edge_runtimes`):

* ``x[:, 0, :]`` (HF ViT's cls pooling) exports as a Gather with a constant scalar index, a
  GATHER in TFLite that Ethos-U cannot run: it becomes Slice (+ Squeeze), a STRIDED_SLICE.
* A Gather of every position of an axis in order (the exporter's ``as_strided`` after Swin's
  average pooling) is a row-major reshape: it becomes one (a RESHAPE, not a GATHER).
* A Reshape of a Reshape that nothing else reads is one Reshape (the exporter's ``as_strided``
  flattens the batch and channel axes together before it gathers them back).
* The position of the last non-pad token, as Hugging Face's sequence classifiers (GPT-2) find
  it, ``ArgMax(arange(L) * mask)`` with a 0/1 mask, is the largest of the same values: they
  are 0 or their own position, so the largest is at its own index, and a row of pads gives 0
  either way. Vela refuses an ARG_MAX of int32 outright ("IFM has to be 8bit"); a TOPK it
  leaves to the CPU.
* A Pad of width 0 on every axis (HF Swin's ``maybe_pad`` when the feature map is a multiple of
  the window) is the identity: it goes (TIDL has no Pad, and opset 17 a different one).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .onnx_rewrites import INT64_MAX, constant, int64_initializer, is_default_op, replace_output


def for_edge_runtimes(graph: ir.Graph) -> int:
    """All the rewrites above; returns how many nodes changed."""
    changed = in_order_gathers_to_reshapes(graph) + gathers_to_slices(graph)
    changed += merge_reshapes(graph)
    return changed + position_argmax_as_max(graph) + drop_noop_pads(graph)


# -- constant-index Gather as Slice (+ Squeeze) ----------------------------------------------


def gathers_to_slices(graph: ir.Graph) -> int:
    """Every Gather with a constant single index on an axis that is not the last (the channel
    axis) of data that is not constant, as Slice (+ Squeeze for a scalar index): exactly the
    same values. Returns how many. Needs opset >= 13 (Squeeze's axes as an input)."""
    if graph.opset_imports.get("", 0) < 13:
        return 0
    count = 0
    for node in [n for n in graph if is_default_op(n, "Gather")]:
        rewrite = gather_as_slice(graph, node)
        if rewrite is not None:
            replace_output(graph, node, *rewrite)
            count += 1
    return count


def gather_as_slice(graph: ir.Graph, node: ir.Node) -> tuple[list[ir.Node], ir.Value] | None:
    data, indices = node.inputs[0], constant(node.inputs[1])
    if data is None or constant(data) is not None or data.shape is None:
        return None
    if indices is None or indices.size != 1 or indices.ndim > 1:
        return None
    if not np.issubdtype(indices.dtype, np.integer):
        return None
    rank = data.shape.rank()
    attr = node.attributes.get("axis")
    axis = (attr.as_int() if attr is not None else 0) % max(rank, 1)
    index = int(indices.item())
    size = data.shape[axis]
    if rank < 2 or axis == rank - 1 or (isinstance(size, int) and not -size <= index < size):
        return None  # the channel axis, or an out-of-range index Gather would reject
    base = node.name or "gather"
    end = INT64_MAX if index == -1 else index + 1  # [-1:0] would be empty
    starts = int64_initializer(graph, [index], f"{base}_start")
    ends = int64_initializer(graph, [end], f"{base}_end")
    axes = int64_initializer(graph, [axis], f"{base}_axes")
    dims = list(data.shape)
    dims[axis] = 1
    sliced = ir.Node("", "Slice", [data, starts, ends, axes])
    sliced.outputs[0].shape, sliced.outputs[0].type = ir.Shape(dims), data.type
    if indices.ndim == 1:
        return [sliced], sliced.outputs[0]
    squeeze = ir.Node("", "Squeeze", [sliced.outputs[0], axes])
    squeeze.outputs[0].shape = ir.Shape(dims[:axis] + dims[axis + 1 :])
    squeeze.outputs[0].type = data.type
    return [sliced, squeeze], squeeze.outputs[0]


def in_order_gathers_to_reshapes(graph: ir.Graph) -> int:
    """Every Gather whose constant indices are 0, 1, ..., n - 1 over a whole axis of size n, as
    the Reshape that splits that axis into the indices' shape (static shapes only)."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "Gather")]:
        data, indices = node.inputs[0], constant(node.inputs[1])
        if data is None or data.shape is None or constant(data) is not None or indices is None:
            continue
        dims = list(data.shape)
        attr = node.attributes.get("axis")
        axis = (attr.as_int() if attr is not None else 0) % max(len(dims), 1)
        in_order = np.array_equal(indices.reshape(-1), np.arange(indices.size))
        if not dims or not in_order or dims[axis] != indices.size:
            continue
        target = dims[:axis] + list(indices.shape) + dims[axis + 1 :]
        if not all(isinstance(d, int) and d > 0 for d in target):
            continue
        shape = int64_initializer(graph, target, f"{node.name or 'gather'}_shape")
        reshape = ir.Node("", "Reshape", [data, shape])
        reshape.outputs[0].shape, reshape.outputs[0].type = ir.Shape(target), data.type
        replace_output(graph, node, [reshape], reshape.outputs[0])
        count += 1
    return count


def position_argmax_as_max(graph: ir.Graph) -> int:
    """Every ``ArgMax(arange(L) * Cast(bool))`` over the positions' axis (first index on ties)
    as the largest value: ``Cast(TopK(..., k=1) values, int64)``, squeezed if ArgMax kept no
    axis; the same index (above). TopK, not ReduceMax: ONNX Runtime's quantizer re-infers
    every shape and loses those of a ReduceMax whose axes are an input. Returns how many."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "ArgMax")]:
        data = node.inputs[0]
        if data is None or data.shape is None or not _is_position_times_flag(data):
            continue
        rank = data.shape.rank()
        axis = _int_attribute(node, "axis", 0) % max(rank, 1)
        if axis != rank - 1 or _int_attribute(node, "select_last_index", 0):
            continue
        base = node.name or "argmax"
        one = int64_initializer(graph, [1], f"{base}_k")
        largest = ir.Node(
            "", "TopK", [data, one], attributes=[ir.AttrInt64("axis", axis)], num_outputs=2
        )
        cast = ir.Node("", "Cast", [largest.outputs[0]], attributes=[ir.AttrInt64("to", 7)])
        nodes = [largest, cast]
        if not _int_attribute(node, "keepdims", 1):
            axes = int64_initializer(graph, [axis], f"{base}_axes")
            nodes.append(ir.Node("", "Squeeze", [cast.outputs[0], axes]))
        replace_output(graph, node, nodes, nodes[-1].outputs[0])
        count += 1
    return count


def _is_position_times_flag(value: ir.Value) -> bool:
    """``arange(L) * Cast(bool)`` (either order), the arange along the last axis."""
    node = value.producer()
    if not is_default_op(node, "Mul") or len(node.inputs) != 2:  # type: ignore[union-attr]
        return False
    for positions, flags in (node.inputs, reversed(node.inputs)):  # type: ignore[union-attr]
        steps = constant(positions)
        cast = flags.producer() if flags is not None else None
        length = value.shape[-1] if value.shape is not None else None
        if (
            steps is not None
            and isinstance(length, int)
            and np.array_equal(steps.reshape(-1), np.arange(length))
            and steps.shape[-1:] == (length,)
            and is_default_op(cast, "Cast")
            and cast.inputs[0] is not None  # type: ignore[union-attr]
            and cast.inputs[0].dtype == ir.DataType.BOOL  # type: ignore[union-attr]
        ):
            return True
    return False


def _int_attribute(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_int()


def merge_reshapes(graph: ir.Graph) -> int:
    """Every Reshape whose input comes from a Reshape that nothing else reads, reading that
    Reshape's input instead (the first is then dropped); returns how many. A Reshape to a
    shape with a 0 (copy that dimension) is left as it is."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "Reshape")]:
        first = node.inputs[0].producer() if node.inputs[0] is not None else None
        shape = constant(node.inputs[1]) if len(node.inputs) > 1 else None
        if not is_default_op(first, "Reshape") or shape is None or not shape.all():
            continue
        assert first is not None
        if len(first.outputs[0].uses()) != 1 or first.outputs[0].is_graph_output():
            continue
        node.replace_input_with(0, first.inputs[0])
        graph.remove(first, safe=True)
        count += 1
    return count


# -- zero-width Pad -------------------------------------------------------------------------------


def drop_noop_pads(graph: ir.Graph) -> int:
    """Every Pad whose constant widths are all 0 replaced by its input; returns how many."""
    count = 0
    for node in [n for n in graph if is_default_op(n, "Pad")]:
        widths = constant(node.inputs[1]) if len(node.inputs) > 1 else None
        if widths is None or widths.any() or node.inputs[0] is None:
            continue
        out, data = node.outputs[0], node.inputs[0]
        if out.is_graph_output():
            continue  # its name is the model's output: keep it
        ir.convenience.replace_all_uses_with(out, data)
        graph.remove(node, safe=True)
        count += 1
    return count
