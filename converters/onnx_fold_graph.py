"""The fold rules' view of an ONNX graph (onnx_ir), and their edits to it.

After constant folding, an offline norm in eval is a chain of Mul/Add/Sub/Div by constants that
broadcast along the last axis; a chain that scales (a Mul or Div in it, wider than one channel)
is a norm, one that only adds is a bias. A Linear is a MatMul (+ its bias Add) or a Gemm. Names
and kinds come from the torch exporter's metadata where present (:mod:`.onnx_names`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from .affine_chains import broadcast_shape, chain_affine, is_per_channel
from .fold_graph import Kind, Norm, Op, Term
from .onnx_names import folded_table_name, label, layer_name, norm_name
from .onnx_rewrites import constant, fresh_name, set_constant_input

AFFINE_OPS = {"Mul": "mul", "Add": "add", "Sub": "sub", "Div": "div"}
KINDS = {
    "MatMul": Kind.LINEAR, "Gemm": Kind.LINEAR, "Conv": Kind.CONV,
    "Add": Kind.ADD, "Sub": Kind.SUB, "Mul": Kind.MUL, "Div": Kind.MUL,
    "Identity": Kind.IDENTITY, "Dropout": Kind.IDENTITY,
    "Reshape": Kind.RESHAPE, "Flatten": Kind.RESHAPE, "Squeeze": Kind.RESHAPE,
    "Unsqueeze": Kind.RESHAPE, "Transpose": Kind.TRANSPOSE, "Slice": Kind.SELECT,
    "Gather": Kind.SELECT, "ReduceMean": Kind.MEAN, "GlobalAveragePool": Kind.MEAN,
    "Pad": Kind.PAD, "Concat": Kind.CONCAT, "Shape": Kind.SHAPE, "Size": Kind.SHAPE,
}  # fmt: skip
Step = tuple[ir.Value, str, np.ndarray, bool]  # data input, op, constant, data first


class OnnxFoldGraph:
    """:class:`~converters.fold_rules.FoldGraph` over an onnx_ir graph (edited in place)."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.norm_names: set[str] = set()  # the norms described so far

    # -- the norms ---------------------------------------------------------------------------
    def norm_sites(self) -> list[tuple[ir.Node, ...]]:
        """Maximal runs of affine steps, each value in between read by the next step only."""
        chains: list[tuple[ir.Node, ...]] = []
        used: set[int] = set()
        for node in list(self.graph):
            if affine_step(node) is None or id(node) in used:
                continue
            nodes = [node]
            while len(readers := self._data_readers(nodes[-1].outputs[0])) == 1:
                step = affine_step(readers[0])
                if step is None or step[0] is not nodes[-1].outputs[0]:
                    break
                nodes.append(readers[0])
            used.update(id(n) for n in nodes)
            chains.append(tuple(nodes))
        return chains

    def _data_readers(self, value: ir.Value) -> list[ir.Node]:
        if value.is_graph_output():
            return []
        return [n for n in self.readers(value) if self.op(n).kind is not Kind.SHAPE]

    def describe_norm(self, site: Any) -> Norm | None:
        """The chain as one (scale, shift), read from the graph as it is now (an earlier fold
        may have changed a bias in it); None unless it scales per channel (a norm)."""
        nodes: tuple[ir.Node, ...] = site
        step = affine_step(nodes[0]) if nodes[0].graph is self.graph else None
        if step is None:
            return None
        data = step[0]
        steps = [affine_step(n) for n in nodes]
        if None in steps or data.shape is None:
            return None
        chain = [(op, torch.from_numpy(value), first) for _, op, value, first in steps]  # type: ignore[misc]
        found = chain_affine(chain, tuple(_size(d) for d in data.shape))
        if found is None:
            return None
        name, kind = norm_name(nodes[0], nodes[-1].outputs[0])
        name = self._call_of(name)
        output = nodes[-1].outputs[0]
        return Norm(name, kind, nodes, data, output, found.scale, found.shift, found.axis)

    def _call_of(self, name: str) -> str:
        """The legacy exporter names a module's second call ``path_1``: the module's path, so
        that every format reports the calls of a shared norm alike (``path (call 2)``)."""
        base, _, number = name.rpartition("_")
        name = base if number.isdigit() and base in self.norm_names else name
        self.norm_names.add(name)
        return name

    # -- reading the graph -------------------------------------------------------------------
    def op(self, node: ir.Node) -> Op:
        kind = KINDS.get(node.op_type, Kind.OTHER) if node.domain in ("", "ai.onnx") else Kind.OTHER
        if node.op_type == "Gather" and constant(node.inputs[0]) is not None:
            kind = Kind.LOOKUP
        if kind is Kind.PAD and _attribute(node, "mode", "constant") != "constant":
            kind = Kind.OTHER  # edge / reflect: not classified, never crossed
        inputs = tuple(node.inputs[:1]) if kind is Kind.PAD else tuple(node.inputs)
        fill = _pad_fill(node) if kind is Kind.PAD else None
        return Op(kind, inputs, node.outputs[0], self._axes(node, kind), fill)

    def _axes(self, node: ir.Node, kind: Kind) -> tuple[int, ...]:
        """SELECT / MEAN: the axes acted on (all when unknown); TRANSPOSE: the permutation;
        PAD: the axes padded by a nonzero width (all when unknown); CONCAT: its axis."""
        data = node.inputs[0]
        rank = data.shape.rank() if data is not None and data.shape is not None else 0
        if kind is Kind.TRANSPOSE:
            perm = node.attributes.get("perm")
            return tuple(perm.value) if perm is not None else tuple(reversed(range(rank)))
        if kind is Kind.CONCAT:
            return (int(_attribute(node, "axis", 0)) % max(rank, 1),)
        if kind is Kind.PAD:
            return _padded_axes(node, rank)
        if node.op_type == "GlobalAveragePool":
            return tuple(range(2, rank))
        if kind not in (Kind.SELECT, Kind.MEAN) or not rank:
            return ()
        if node.op_type == "Gather":
            axes = [_attribute(node, "axis", 0)]
        else:
            position = 3 if node.op_type == "Slice" else 1
            given = node.inputs[position] if len(node.inputs) > position else None
            axes = constant(given) if given is not None else None
            if axes is None and "axes" in node.attributes:
                axes = node.attributes["axes"].value
            starts = constant(node.inputs[1]) if node.op_type == "Slice" else None
            if axes is None and given is None and starts is not None:
                axes = range(starts.size)  # no axes input: the first len(starts) axes
        return tuple(range(rank)) if axes is None else tuple(int(a) % rank for a in axes)

    def readers(self, value: ir.Value) -> list[ir.Node]:
        return list(dict.fromkeys(node for node, _ in value.uses()))

    def producer(self, value: ir.Value) -> ir.Node | None:
        """A MatMul with its bias Add is one Linear, whose output is the Add's (what torch's
        ``linear`` computes): a norm reached through layout ops from it folds backward."""
        node = value.producer()
        if node is not None and node.op_type == "Add":
            for source in node.inputs:
                layer = source.producer() if source is not None else None
                if layer is not None and layer.op_type == "MatMul":
                    found = self._bias_add(layer)
                    if found is not None and found[0] is node:
                        return layer
        return node

    def is_output(self, value: ir.Value) -> bool:
        return value.is_graph_output()

    def is_constant(self, value: ir.Value | None) -> bool:
        return value is None or constant(value) is not None

    def shape(self, value: ir.Value) -> tuple[Any, ...] | None:
        return tuple(value.shape) if value.shape is not None else None

    def name(self, value: ir.Value) -> str:
        return value.name or "?"

    def describe(self, node: ir.Node) -> str:
        return f"{label(node)} ({node.op_type})"

    def layer_name(self, node: ir.Node) -> str:
        return layer_name(node)

    def term_name(self, term: Term) -> str:
        """A lookup's table; a constant's, when it was folded from one lookup."""
        if term.is_lookup:
            return layer_name(term.node)
        return folded_table_name(term.node.inputs[term.index])

    def layer_problem(self, layer: ir.Node) -> str:
        if layer.op_type == "Gather":  # a lookup
            table = constant(layer.inputs[0])
            if table is None or table.ndim != 2 or _attribute(layer, "axis", 0) != 0:
                return f"{label(layer)} does not look up rows of a constant table"
            own = _single_use(layer.inputs[0])
            return "" if own else f"{label(layer)} shares its table (tied weights)"
        if layer.op_type == "Conv":
            ok = constant(layer.inputs[1]) is not None and _single_use(layer.inputs[1])
            return "" if ok else f"{label(layer)} has no constant weight"
        return weight_kn(layer)[1]

    # -- editing it --------------------------------------------------------------------------
    def bypass(self, norm: Norm, replacement: ir.Value | None = None) -> None:
        """Route the chain's output to ``replacement`` (its input by default) and remove the
        chain; Shape/Size readers of values inside it read the chain's input (same shape)."""
        replacement = replacement or norm.input
        for node in norm.nodes[:-1]:
            for reader, index in list(node.outputs[0].uses()):
                if self.op(reader).kind is Kind.SHAPE:
                    reader.replace_input_with(index, norm.input)
        out = norm.output
        ir.convenience.replace_all_uses_with(out, replacement, replace_graph_outputs=True)
        if out.is_graph_output():
            replacement.name = out.name
        self.graph.remove(list(reversed(norm.nodes)), safe=True)

    def weights(self, layer: ir.Node) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As torch lays them out: a MatMul's (K, N) weight transposed, and its bias Add's."""
        if layer.op_type == "Conv":
            bias = constant(layer.inputs[2]) if len(layer.inputs) > 2 else None
            return _tensor(constant(layer.inputs[1])), _tensor(bias)
        weight, _ = weight_kn(layer)
        return _tensor(weight.T), _tensor(self._current_bias(layer, weight.shape[1]))  # type: ignore[union-attr]

    def set_weights(self, layer: ir.Node, weight: torch.Tensor, bias: torch.Tensor) -> None:
        if layer.op_type == "Conv":
            for index, value in ((1, weight), (2, bias)):
                set_constant_input(self.graph, layer, index, value.numpy(), f"{layer.name}_w")
            return
        self._write(layer, weight.numpy().T, bias.numpy())

    def term_values(self, term: Term) -> torch.Tensor:
        return _tensor(constant(term.node.inputs[term.index]))

    def set_term_values(self, term: Term, values: torch.Tensor) -> None:
        name = f"{term.node.name}_folded"
        set_constant_input(self.graph, term.node, term.index, values.numpy(), name)

    def keep_as_scale_shift(self, norm: Norm) -> None:
        """One Mul and one Add by (C,) constants, in the dtype the chain computed in (a chain
        that is one already stays as it is)."""
        if [n.op_type for n in norm.nodes] in (["Mul"], ["Mul", "Add"]):
            return
        first = norm.nodes[0]
        dtype = next(c.dtype for c in map(constant, first.inputs) if c is not None)
        shape = broadcast_shape(norm.scale.numel(), norm.axis)  # (C,), or (C, 1, 1) ...
        scale, shift = (
            self._initializer(f"{first.name}_{what}", vector.numpy().astype(dtype).reshape(shape))
            for what, vector in (("scale", norm.scale), ("shift", norm.shift))
        )
        metadata = dict(first.metadata_props)
        mul = ir.Node("", "Mul", [norm.input, scale], metadata_props=metadata)
        add = ir.Node("", "Add", [mul.outputs[0], shift], metadata_props=dict(metadata))
        self.graph.insert_after(norm.nodes[-1], [mul, add])
        self.bypass(norm, add.outputs[0])

    def reroute(self, value: ir.Value, replacement: ir.Value) -> None:
        """``value``'s readers read ``replacement``; the ops back to it that nothing reads go."""
        ir.convenience.replace_all_uses_with(value, replacement)
        node = value.producer()
        while node is not None and node is not replacement.producer():
            if any(out.uses() or out.is_graph_output() for out in node.outputs):
                break
            data = node.inputs[0]
            self.graph.remove(node, safe=True)
            node = data.producer() if data is not None else None

    def _initializer(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=fresh_name(self.graph, name), const_value=ir.tensor(array))
        self.graph.register_initializer(value)
        return value

    def _bias_add(self, layer: ir.Node) -> tuple[ir.Node, int] | None:
        """The Add that adds a constant bias to a MatMul's output, if it is its only reader.
        A bias shared with other Adds (exporters merge equal ones, e.g. zeros) is fine: the
        fold gives this Add a new initializer and leaves the shared one to the others."""
        readers = self._data_readers(layer.outputs[0])
        if len(readers) != 1 or readers[0].op_type != "Add":
            return None
        add = readers[0]
        index = 1 - list(add.inputs).index(layer.outputs[0])
        bias = constant(add.inputs[index])
        return (add, index) if bias is not None and bias.ndim <= 1 else None

    def _current_bias(self, layer: ir.Node, width: int) -> np.ndarray:
        """The layer's bias in units of A B (zeros if none)."""
        if layer.op_type == "Gemm":
            c = constant(layer.inputs[2]) if len(layer.inputs) > 2 else None
            if c is None:
                return np.zeros(width)
            beta, alpha = _attribute(layer, "beta", 1.0), _attribute(layer, "alpha", 1.0)
            return np.broadcast_to(c.astype(np.float64) * beta / alpha, (width,)).copy()
        found = self._bias_add(layer)
        if found is None:
            return np.zeros(width)
        add, index = found
        bias = constant(add.inputs[index]).astype(np.float64)  # type: ignore[union-attr]
        return np.broadcast_to(bias, (width,)).copy()

    def _write(self, layer: ir.Node, weight: np.ndarray, bias: np.ndarray) -> None:
        """Store a (K, N) weight and an (N,) bias into the MatMul (+ Add) or Gemm ``layer``."""
        graph, name = self.graph, layer.name
        dtype = constant(layer.inputs[1]).dtype  # type: ignore[union-attr]
        if layer.op_type == "Gemm":
            stored = weight.T if _attribute(layer, "transB", 0) else weight
            set_constant_input(graph, layer, 1, stored.astype(dtype), f"{name}_weight_folded")
            beta, alpha = _attribute(layer, "beta", 1.0), _attribute(layer, "alpha", 1.0)
            # Y = alpha * A B + beta * C: the caller's bias is in units of A B.
            scaled = (alpha * bias / beta).astype(dtype)
            set_constant_input(graph, layer, 2, scaled, f"{name}_bias_folded")
            return
        set_constant_input(graph, layer, 1, weight.astype(dtype), f"{name}_weight_folded")
        found = self._bias_add(layer)
        if found is not None:
            add, index = found
            set_constant_input(graph, add, index, bias.astype(dtype), f"{name}_bias_folded")
            return
        out = layer.outputs[0]
        uses = list(out.uses())  # before the new Add becomes one of them
        add = ir.Node(
            "", "Add", [out, self._initializer(f"{name}_bias_folded", bias.astype(dtype))]
        )
        add.outputs[0].shape, add.outputs[0].type = out.shape, out.type  # same as the MatMul's
        graph.insert_after(layer, add)  # named by NameFixPass
        for user, index in uses:
            user.replace_input_with(index, add.outputs[0])
        if out.is_graph_output():
            ir.convenience.replace_all_uses_with(out, add.outputs[0], replace_graph_outputs=True)


def affine_step(node: ir.Node) -> Step | None:
    """(data input, op, constant, data_first) if the node is x op constant, the constant
    varying along one axis at most (a channel axis, wherever the layout put it)."""
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
    rank = data.shape.rank() if data.shape is not None else None
    if rank is None or not is_per_channel(value.shape, rank):
        return None  # not per channel (e.g. a position embedding)
    if not np.issubdtype(value.dtype, np.floating):
        return None
    return data, op, value.astype(np.float64), data_first


def weight_kn(node: ir.Node) -> tuple[np.ndarray | None, str]:
    """A MatMul's or Gemm's constant weight of its own as (K, N), or why there is none."""
    if node.op_type == "MatMul":
        weight = constant(node.inputs[1])
        if weight is None or weight.ndim != 2:
            return None, f"{label(node)} has no constant 2-D weight"
        if not _single_use(node.inputs[1]):
            uses = len(node.inputs[1].uses())  # type: ignore[union-attr]
            return (
                None,
                f"{label(node)} shares its weight (tied or shared layers): used {uses} times",
            )
        return weight, ""
    if node.op_type == "Gemm" and not _attribute(node, "transA", 0):
        weight = constant(node.inputs[1])
        if weight is None or not _single_use(node.inputs[1]):
            return None, f"{label(node)} has no constant weight of its own"
        return (weight.T if _attribute(node, "transB", 0) else weight), ""
    return None, f"{label(node)} is {node.op_type}"


def _padded_axes(node: ir.Node, rank: int) -> tuple[int, ...]:
    """The axes a Pad widens or narrows (begins for every axis, then ends); all when unknown."""
    pads = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    given = constant(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    axes = list(range(rank)) if given is None else [int(a) % max(rank, 1) for a in given]
    if pads is None or pads.size != 2 * len(axes):
        return tuple(range(rank))
    count = len(axes)
    return tuple(sorted(a for i, a in enumerate(axes) if pads[i] or pads[i + count]))


def _pad_fill(node: ir.Node) -> float | None:
    """A constant Pad's value (0 when not given); None when it is not a constant."""
    value = node.inputs[2] if len(node.inputs) > 2 else None
    if value is None:
        return 0.0
    array = constant(value)
    return None if array is None or array.size != 1 else float(array.item())


def _size(dim: Any) -> Any:
    """A dimension as an int when known, else as it is (a symbolic one)."""
    return dim if isinstance(dim, int) else getattr(dim, "value", dim)


def _single_use(value: ir.Value | None) -> bool:
    return value is not None and len(value.uses()) == 1 and not value.is_graph_output()


def _attribute(node: ir.Node, name: str, default: float) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _tensor(array: np.ndarray | None) -> torch.Tensor | None:
    """A copy: the graph's constants are read-only arrays, which torch would warn about."""
    return None if array is None else torch.tensor(array)
