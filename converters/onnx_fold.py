"""Fold per-channel affine chains of an fp32 ONNX model from any framework into its weights.

After constant folding (onnxscript), an offline norm in eval is a chain of Mul/Add/Sub/Div by
constants that broadcast along the last axis. Each chain that scales (a Mul or Div in it; a lone
Add is a bias or an embedding, not a norm):

* folds forward into the MatMul/Gemm with constant weights that consume it (through Reshape,
  Flatten, Slice/Gather/ReduceMean that leave the channel axis alone), when nothing else does;
* else folds backward into the MatMul/Gemm (or Conv, through Transpose/Reshape) that produces
  its input, if nothing else reads that, or into the embedding tables whose lookups it sums
  (:mod:`.onnx_embeddings`);
* else stays, as one Mul + Add (a longer chain is collapsed). The FoldReport says which, and why.

Names and kinds come from the torch exporter's node metadata when present, else node names
(:mod:`.onnx_names`). External data is read with path checks (:mod:`.onnx_load`); ``x[:, 0, :]``
becomes a slice (:mod:`.onnx_rewrites`); Shape/Size readers never block a fold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
import torch
from onnx_ir.passes.common import NameFixPass, RemoveUnusedNodesPass, ShapeInferencePass

from .equations import (
    as_channel_vector,
    compose_affine,
    fold_affine_into_following_linear,
    fold_affine_into_preceding_linear,
)
from .errors import OnlineNormError
from .fold_report import FoldReport, NormFold
from .onnx_embeddings import embedding_terms, fold_into_embeddings
from .onnx_load import load_onnx
from .onnx_names import label, layer_name, norm_name
from .onnx_rewrites import constant, fresh_name, gathers_to_slices, set_constant_input

AFFINE_OPS = {"Mul": "mul", "Add": "add", "Sub": "sub", "Div": "div"}
ONLINE_NORM_OPS = {
    "LayerNormalization", "GroupNormalization", "RMSNormalization", "InstanceNormalization",
    "MeanVarianceNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
}  # fmt: skip
PASS_THROUGH = {"Identity", "Dropout", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}
# Ops that read only a tensor's shape, which a per-channel affine never changes.
SHAPE_ONLY = {"Shape", "Size"}


@dataclass
class Chain:
    nodes: list[ir.Node]
    data: ir.Value  # what the chain's first node reads
    scale: np.ndarray  # float64 (C,)
    shift: np.ndarray

    @property
    def output(self) -> ir.Value:
        return self.nodes[-1].outputs[0]


def fold_onnx(
    model: str | Path | onnx.ModelProto, *, allow_online: bool = False
) -> tuple[onnx.ModelProto, FoldReport]:
    """Fold every per-channel affine chain; returns the new model (checked) and the report."""
    source = Path(model).name if isinstance(model, (str, Path)) else "ONNX model"
    proto = load_onnx(model) if isinstance(model, (str, Path)) else model
    ir_model = ir.from_proto(proto)
    onnxscript.optimizer.fold_constants(ir_model)
    RemoveUnusedNodesPass()(ir_model)
    ShapeInferencePass()(ir_model)
    graph = ir_model.graph
    gathers_to_slices(graph)  # x[:, 0, :] as a slice: no GATHER for the NPU to refuse
    online = [f"{n.name} ({n.op_type})" for n in graph.all_nodes() if n.op_type in ONLINE_NORM_OPS]
    if online and not allow_online:
        raise OnlineNormError(
            f"online norms cannot fold: {', '.join(online)}; keep them with allow_online=True "
            "(CLI: --allow-online)"
        )
    results = [fold_chain(graph, chain) for chain in find_chains(graph)]
    RemoveUnusedNodesPass()(ir_model)
    NameFixPass()(ir_model)  # unique names for the nodes added here
    out = ir.to_proto(ir_model)
    onnx.checker.check_model(out, full_check=True)
    notes = ("online norms kept (allow_online=True): not fully integer",) * bool(online)
    report = FoldReport(tuple(r for r in results if r), source, tuple(online), notes)
    return out, report


def single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def reads_shape_only(node: ir.Node) -> bool:
    return node.op_type in SHAPE_ONLY and node.domain in ("", "ai.onnx")


def single_data_use(value: ir.Value) -> bool:
    """Read by one node for its values (Shape/Size readers aside), and not a graph output."""
    readers = [user for user, _ in value.uses() if not reads_shape_only(user)]
    return len(readers) == 1 and not value.is_graph_output()


def affine_step(node: ir.Node) -> tuple[ir.Value, str, np.ndarray, bool] | None:
    """(data input, op, constant, data_first) if the node is x op constant, per last axis."""
    op = AFFINE_OPS.get(node.op_type)
    if op is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    left, right = (constant(v) for v in node.inputs)
    if (left is None) == (right is None):
        return None
    data_first = right is not None
    value = right if data_first else left
    data = node.inputs[0] if data_first else node.inputs[1]
    assert value is not None and data is not None
    if op == "div" and not data_first:
        return None
    if value.ndim and any(size != 1 for size in value.shape[:-1]):
        return None  # not per channel (e.g. a position embedding)
    rank = data.shape.rank() if data.shape is not None else None
    if rank is None or value.ndim > rank or not np.issubdtype(value.dtype, np.floating):
        return None
    return data, op, value.astype(np.float64), data_first


def find_chains(graph: ir.Graph) -> list[Chain]:
    """Maximal runs of affine steps, each value in between read by the next step only."""
    chains: list[Chain] = []
    used: set[int] = set()
    for node in list(graph):
        step = affine_step(node)
        if step is None or id(node) in used:
            continue
        nodes = [node]
        while single_data_use(nodes[-1].outputs[0]):
            user = next(u for u, _ in nodes[-1].outputs[0].uses() if not reads_shape_only(u))
            next_step = affine_step(user)
            if next_step is None or next_step[0] is not nodes[-1].outputs[0]:
                break
            nodes.append(user)
        used.update(id(n) for n in nodes)
        chain = compose(nodes, step[0])
        if chain is not None:
            chains.append(chain)
    return chains


def compose(nodes: list[ir.Node], data: ir.Value) -> Chain | None:
    """The chain as one (scale, shift); None unless it scales per channel (a norm candidate)."""
    steps = [affine_step(n) for n in nodes]
    widths = [s[2].shape[-1] for s in steps if s and s[2].ndim]
    dims = data.shape
    last = dims[-1] if dims is not None and dims.rank() else None
    channels = max(widths, default=last if last is not None else 1)
    if not isinstance(channels, int) or any(w not in (1, channels) for w in widths):
        return None
    if isinstance(last, int) and last != channels:
        return None  # the constants broadcast the data to more channels: not x * s + t
    if not any(s and s[1] in ("mul", "div") for s in steps) or max(widths, default=1) == 1:
        return None  # a bias add or a scalar (GELU's constants, attention scale): not a norm
    scale = torch.ones(channels, dtype=torch.float64)
    shift = torch.zeros(channels, dtype=torch.float64)
    for step in steps:
        assert step is not None
        _, op, value, data_first = step
        vector = as_channel_vector(torch.from_numpy(value), channels)
        scale, shift = compose_affine(scale, shift, op, vector, data_first)
    return Chain(nodes, data, scale.numpy(), shift.numpy())


def fold_chain(graph: ir.Graph, chain: Chain) -> NormFold | None:
    # Recompose from the graph as it is now: an earlier fold may have changed a bias in it.
    step = affine_step(chain.nodes[0]) if chain.nodes[0].graph is graph else None
    chain = compose(chain.nodes, step[0]) if step else None  # type: ignore[assignment]
    if chain is None:
        return None
    name, kind = norm_name(chain.nodes[0], chain.output)
    consumers, forward_reason = matmul_consumers(chain)
    if consumers is not None:
        for layer in consumers:
            fold_into_following(graph, layer, chain)
        bypass(graph, chain, chain.data)
        return NormFold(name, kind, "folded_forward", tuple(layer_name(n) for n in consumers))
    producer, backward_reason = matmul_producer(chain)
    if producer is not None:
        fold_into_preceding(graph, producer, chain)
        return NormFold(name, kind, "folded_backward", (layer_name(producer),))
    terms, embedding_reason = embedding_terms(chain.data, chain.nodes[0])
    if terms is not None:
        fold_into_embeddings(graph, terms, chain.scale, chain.shift)
        bypass(graph, chain, chain.data)
        into = tuple(layer_name(t.node) for t in terms if t.node.op_type == "Gather")
        return NormFold(name, kind, "folded_backward", into)
    if [n.op_type for n in chain.nodes] not in (["Mul"], ["Mul", "Add"]):
        replace_with_scale_shift(graph, chain)
    reason = f"forward: {forward_reason}; backward: {backward_reason}"
    reason += f"; embeddings: {embedding_reason}" if embedding_reason else ""
    return NormFold(name, kind, "scale_shift", reason=reason)


def _weight(node: ir.Node) -> tuple[np.ndarray | None, str]:
    if node.op_type == "MatMul":
        weight = constant(node.inputs[1])
        ok = weight is not None and weight.ndim == 2 and single_use(node.inputs[1])
        return (weight, "") if ok else (None, f"{label(node)} has no constant 2-D weight")
    if node.op_type == "Gemm" and not _attr(node, "transA", 0):
        weight = constant(node.inputs[1])
        if weight is None or not single_use(node.inputs[1]):
            return None, f"{label(node)} has no constant weight of its own"
        return (weight.T if _attr(node, "transB", 0) else weight), ""  # as (K, N)
    return None, f"{label(node)} is {node.op_type}"


def _attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _channels_kept(node: ir.Node, data: ir.Value, channels: int) -> str | None:
    """None if the op passes a per-channel affine (last axis) through unchanged."""
    out = node.outputs[0]
    rank = data.shape.rank() if data.shape is not None else 0
    if node.op_type in AFFINE_OPS and all(constant(v) is None for v in node.inputs):
        what = "adds it to" if node.op_type in ("Add", "Sub") else "multiplies it by"
        return f"{label(node)} ({node.op_type}) {what} another tensor (a residual or a mask)"
    if node.inputs[0] is not data or any(v is data for v in node.inputs[1:]):
        return f"{label(node)} ({node.op_type}) reads it as something other than data"
    last_kept = out.shape is not None and out.shape.rank() and out.shape[-1] == channels
    if node.op_type in PASS_THROUGH:
        return None if last_kept else f"{label(node)} ({node.op_type}) moves the channel axis"
    if node.op_type in ("Slice", "ReduceMean", "Gather"):
        if node.op_type == "Slice":
            axes = constant(node.inputs[3]) if len(node.inputs) > 3 else np.arange(rank)
        elif node.op_type == "Gather":
            axes = np.array([_attr(node, "axis", 0)])
        else:
            axes = constant(node.inputs[1]) if len(node.inputs) > 1 else None
            if axes is None and "axes" in node.attributes:
                axes = np.array(node.attributes["axes"].value)
        if (
            axes is not None
            and rank
            and (rank - 1) not in {int(a) % rank for a in axes}
            and last_kept
        ):
            return None
        return f"{label(node)} ({node.op_type}) acts on the channel axis"
    return f"{label(node)} ({node.op_type}) does not commute with a per-channel affine"


def matmul_consumers(chain: Chain) -> tuple[list[ir.Node] | None, str]:
    channels = chain.scale.size
    found: list[ir.Node] = []
    frontier = [chain.output]
    while frontier:
        value = frontier.pop()
        if value.is_graph_output():
            return None, f"{value.name} is a model output"
        for user, index in value.uses():
            if reads_shape_only(user):
                continue  # a per-channel affine keeps the shape; re-pointed by bypass()
            if user.op_type in ("MatMul", "Gemm") and index == 0:
                weight, problem = _weight(user)
                if weight is None:
                    return None, problem
                found.append(user)
                continue
            reason = _channels_kept(user, value, channels)
            if reason:
                return None, f"it feeds {reason}"
            frontier.append(user.outputs[0])
    return (found, "") if found else (None, "no MatMul/Gemm consumes it")


def matmul_producer(chain: Chain) -> tuple[ir.Node | None, str]:
    """The MatMul/Gemm (channels last) or Conv (channels on axis 1, reached back through
    Transpose/Reshape/Flatten) whose output only this chain reads."""
    value = chain.data
    axis = value.shape.rank() - 1 if value.shape is not None else -1
    while True:
        producer = value.producer()
        if producer is None:
            return None, f"its input {value.name} is a graph input"
        if not single_data_use(value):
            return None, f"its input {value.name} is also read elsewhere"
        rank = value.shape.rank() if value.shape is not None else -1
        if producer.op_type in ("MatMul", "Gemm") and axis == rank - 1:
            weight, problem = _weight(producer)
            return (producer, "") if weight is not None else (None, problem)
        if producer.op_type == "Conv" and axis == 1:
            ok = constant(producer.inputs[1]) is not None and single_use(producer.inputs[1])
            return (producer, "") if ok else (None, f"{label(producer)} has no constant weight")
        source = producer.inputs[0]
        if producer.op_type == "Transpose" and "perm" in producer.attributes:
            axis = list(producer.attributes["perm"].value)[axis]
        elif producer.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            axis = _source_axis(source, value, axis)
        elif producer.op_type != "Identity":
            return None, f"its input comes from {label(producer)}"
        if axis is None or source is None:
            return None, f"{label(producer)} ({producer.op_type}) mixes the channel axis"
        value = source


def _source_axis(source: ir.Value | None, out: ir.Value, axis: int) -> int | None:
    """Row-major reshape: output axis ``axis`` is input axis i when the sizes before them and
    their own sizes agree (static shapes only)."""
    if source is None or source.shape is None or out.shape is None:
        return None
    before, after = list(source.shape), list(out.shape)
    offset = 0
    while axis > 0 and before and after and str(before[0]) == str(after[0]):  # e.g. batch
        before, after, axis, offset = before[1:], after[1:], axis - 1, offset + 1
    if not all(isinstance(d, int) for d in before + after):
        return None
    prefix = int(np.prod(after[:axis]))
    for i, size in enumerate(before):
        if int(np.prod(before[:i])) == prefix and size == after[axis]:
            return i + offset
    return None


def _bias_add(layer: ir.Node) -> tuple[ir.Node, int] | None:
    """The Add that adds a constant bias to a MatMul's output, if it is its only reader."""
    out = layer.outputs[0]
    if not single_data_use(out):
        return None
    user, index = next((u, i) for u, i in out.uses() if not reads_shape_only(u))
    bias = constant(user.inputs[1 - index]) if user.op_type == "Add" else None
    # A bias shared with other Adds (the exporter merges equal ones, e.g. zeros) is fine: the
    # fold gives this Add a new initializer and leaves the shared one to the others.
    if bias is None or bias.ndim > 1:
        return None
    return user, 1 - index


def _write(graph: ir.Graph, layer: ir.Node, weight_kn: np.ndarray, bias: np.ndarray) -> None:
    """Store a (K, N) weight and an (N,) bias into the MatMul (+ Add) or Gemm ``layer``."""
    dtype = constant(layer.inputs[1]).dtype  # type: ignore[union-attr]
    if layer.op_type == "Gemm":
        stored = weight_kn.T if _attr(layer, "transB", 0) else weight_kn
        set_constant_input(graph, layer, 1, stored.astype(dtype), f"{layer.name}_weight_folded")
        beta, alpha = float(_attr(layer, "beta", 1.0)), float(_attr(layer, "alpha", 1.0))
        # Y = alpha * A B + beta * C: the caller's bias is in units of A B.
        set_constant_input(
            graph, layer, 2, (alpha * bias / beta).astype(dtype), f"{layer.name}_bias_folded"
        )
        return
    set_constant_input(graph, layer, 1, weight_kn.astype(dtype), f"{layer.name}_weight_folded")
    found = _bias_add(layer)
    if found is not None:
        add, index = found
        set_constant_input(graph, add, index, bias.astype(dtype), f"{layer.name}_bias_folded")
        return
    value = ir.Value(
        name=fresh_name(graph, f"{layer.name}_bias_folded"),
        const_value=ir.tensor(bias.astype(dtype)),
    )
    graph.register_initializer(value)
    out = layer.outputs[0]
    uses = list(out.uses())  # before the new Add becomes one of them
    add = ir.Node("", "Add", [out, value])  # named by NameFixPass
    graph.insert_after(layer, add)
    for user, index in uses:
        user.replace_input_with(index, add.outputs[0])
    if out.is_graph_output():
        ir.convenience.replace_all_uses_with(out, add.outputs[0], replace_graph_outputs=True)


def _current_bias(layer: ir.Node, width: int) -> np.ndarray:
    """The layer's bias in units of A B (zeros if none)."""
    if layer.op_type == "Gemm":
        c = constant(layer.inputs[2]) if len(layer.inputs) > 2 else None
        if c is None:
            return np.zeros(width)
        beta, alpha = float(_attr(layer, "beta", 1.0)), float(_attr(layer, "alpha", 1.0))
        return np.broadcast_to(c.astype(np.float64) * beta / alpha, (width,)).copy()
    found = _bias_add(layer)
    if found is None:
        return np.zeros(width)
    add, index = found
    return np.broadcast_to(constant(add.inputs[index]).astype(np.float64), (width,)).copy()  # type: ignore[union-attr]


def _fold_weights(
    fold: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    weight: np.ndarray,
    bias: np.ndarray | None,
    chain: Chain,
) -> tuple[np.ndarray, np.ndarray]:
    """An equation of :mod:`.equations` (torch) in float64 on numpy arrays: the chain folded into
    a ``(out, in, ...)`` weight (torch's layout) and its bias."""
    new_weight, new_bias = fold(
        torch.from_numpy(weight.astype(np.float64)),
        None if bias is None else torch.from_numpy(bias.astype(np.float64)),
        torch.from_numpy(chain.scale),
        torch.from_numpy(chain.shift),
    )
    return new_weight.numpy(), new_bias.numpy()


def fold_into_following(graph: ir.Graph, layer: ir.Node, chain: Chain) -> None:
    """The chain folds into the weight it feeds (:func:`.fold_affine_into_following_linear`)."""
    weight, _ = _weight(layer)  # (K, N): transposed to torch's (out, in) and back
    assert weight is not None
    bias = _current_bias(layer, weight.shape[1])
    new_weight, new_bias = _fold_weights(fold_affine_into_following_linear, weight.T, bias, chain)
    _write(graph, layer, new_weight.T, new_bias)


def fold_into_preceding(graph: ir.Graph, layer: ir.Node, chain: Chain) -> None:
    """The chain folds into the layer whose output it reads, per output channel
    (:func:`.fold_affine_into_preceding_linear`); the chain then disappears."""
    if layer.op_type == "Conv":
        weight = constant(layer.inputs[1])
        assert weight is not None
        bias = constant(layer.inputs[2]) if len(layer.inputs) > 2 else None
        new_w, new_b = _fold_weights(fold_affine_into_preceding_linear, weight, bias, chain)
        bypass(graph, chain, chain.data)
        set_constant_input(graph, layer, 1, new_w.astype(weight.dtype), f"{layer.name}_w")
        set_constant_input(graph, layer, 2, new_b.astype(weight.dtype), f"{layer.name}_b")
        return
    weight, _ = _weight(layer)  # (K, N): transposed to torch's (out, in) and back
    assert weight is not None
    # A MatMul's bias Add, if any, is the chain's first step (already in scale and shift).
    bias = _current_bias(layer, weight.shape[1]) if layer.op_type == "Gemm" else None
    new_weight, new_bias = _fold_weights(fold_affine_into_preceding_linear, weight.T, bias, chain)
    bypass(graph, chain, chain.data)
    _write(graph, layer, new_weight.T, new_bias)


def bypass(graph: ir.Graph, chain: Chain, replacement: ir.Value) -> None:
    """Route the chain's output to ``replacement`` and remove the chain; Shape/Size readers of
    values inside it read the chain's input instead (same shape)."""
    for node in chain.nodes[:-1]:
        for user, index in list(node.outputs[0].uses()):
            if reads_shape_only(user):
                user.replace_input_with(index, chain.data)
    out = chain.output
    ir.convenience.replace_all_uses_with(out, replacement, replace_graph_outputs=True)
    if out.is_graph_output():
        replacement.name = out.name
    graph.remove(list(reversed(chain.nodes)), safe=True)


def replace_with_scale_shift(graph: ir.Graph, chain: Chain) -> None:
    """One Mul and one Add by (C,) constants, in the dtype the chain computed in."""
    first = chain.nodes[0]
    constants = [constant(v) for v in first.inputs]
    dtype = next(c.dtype for c in constants if c is not None)  # the dtype the chain computed in
    scale = ir.Value(
        name=fresh_name(graph, f"{first.name}_scale"),
        const_value=ir.tensor(chain.scale.astype(dtype)),
    )
    shift = ir.Value(
        name=fresh_name(graph, f"{first.name}_shift"),
        const_value=ir.tensor(chain.shift.astype(dtype)),
    )
    graph.register_initializer(scale)
    graph.register_initializer(shift)
    mul = ir.Node(
        "",
        "Mul",
        [chain.data, scale],
        metadata_props=dict(first.metadata_props),
    )
    add = ir.Node(
        "",
        "Add",
        [mul.outputs[0], shift],
        metadata_props=dict(first.metadata_props),
    )
    graph.insert_after(chain.nodes[-1], [mul, add])
    bypass(graph, chain, add.outputs[0])
