"""The fold rules' view of a torch.export (aten-level) fx graph, and their edits to it.

The norms are found and described by :mod:`.fx_norms` (a call of edge_un's norm classes, or any
other frozen per-channel affine); this module classifies the ops, reads the layers' weights and
makes the edits.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, fx

from .affine_chains import broadcast_shape
from .fold_graph import Kind, Norm, Op, Term
from .fx_norms import describe_norm, norm_sites
from .graph import (
    AFFINE_OPS,
    CONV_OPS,
    IDENTITY_OPS,
    LINEAR_OPS,
    RESHAPE_OPS,
    SHAPE_ONLY_OPS,
    Constants,
    aten,
    fetch_attr,
    module_path,
    normalize_dims,
    offline_norm_classes,
    set_attr,
    shape,
)

ELEMENTWISE = {"add": Kind.ADD, "sub": Kind.SUB, "mul": Kind.MUL, "div": Kind.MUL}
LOOKUP_OPS = {aten.embedding.default}
# A roll reorders positions along its dims, as a slice picks them.
SELECT_OPS = {aten.slice.Tensor, aten.select.int, aten.index_select.default, aten.roll.default}
PAD_OPS = {aten.pad.default, aten.constant_pad_nd.default}
# Adaptive pooling to one position is a mean over the pooled axes (Swin's classifier pooling).
GLOBAL_POOL_OPS = {aten.adaptive_avg_pool1d.default: 1, aten._adaptive_avg_pool2d.default: 2,
                   aten.adaptive_avg_pool2d.default: 2}  # fmt: skip
# GPT-2's Conv1D: addmm(bias, x, weight) with the weight stored (in, out).
ADDMM = aten.addmm.default


class FxFoldGraph:
    """:class:`~converters.fold_rules.FoldGraph` over a GraphModule (edited in place)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.constants = Constants(gm)

    # -- the norms ---------------------------------------------------------------------------
    def norm_sites(self) -> list[Any]:
        return norm_sites(self.gm, self.constants)

    def describe_norm(self, site: Any) -> Norm | None:
        return describe_norm(self.gm, self.constants, site)

    # -- reading the graph -------------------------------------------------------------------
    def op(self, node: fx.Node) -> Op:
        kind = _kind(node)
        inputs: list[Any] = []
        fx.node.map_arg((node.args, node.kwargs), inputs.append)  # every tensor read, in order
        if kind is Kind.LINEAR and node.target == ADDMM:
            inputs = [node.args[1], node.args[2], node.args[0]]  # data, weight, bias
        elif kind is not Kind.CONCAT and not (node.args and isinstance(node.args[0], fx.Node)):
            inputs.insert(0, None)  # its first argument is not a tensor: no data input
        return Op(kind, tuple(inputs), node, _axes(node), _pad_fill(node, kind))

    def readers(self, value: fx.Node) -> list[fx.Node]:
        return [user for user in value.users if user.op != "output"]

    def producer(self, value: fx.Node) -> fx.Node | None:
        return value if value.op == "call_function" else None

    def is_output(self, value: fx.Node) -> bool:
        return any(user.op == "output" for user in value.users)

    def is_constant(self, value: Any) -> bool:
        return not isinstance(value, fx.Node) or self.constants.is_const(value)

    def shape(self, value: fx.Node) -> tuple[Any, ...] | None:
        return shape(value)

    def name(self, value: fx.Node) -> str:
        return value.name

    def describe(self, node: fx.Node) -> str:
        return f"{module_path(node)}: {node.name} ({node.target})"

    def layer_name(self, node: fx.Node) -> str:
        return module_path(node)

    def term_name(self, term: Term) -> str:
        return module_path(term.node) if term.is_lookup else ""

    def layer_problem(self, layer: fx.Node) -> str:
        """ "" if the layer's weight and bias (a lookup's table) are parameters it alone uses."""
        is_lookup = layer.target in LOOKUP_OPS
        for arg in _parameter_args(layer):
            if arg is None:
                continue
            what = "table" if is_lookup else "weight"
            if not isinstance(arg, fx.Node) or arg.op != "get_attr":
                return f"{module_path(layer)} has a {what} that is not a constant parameter"
            uses = self._reads(str(arg.target))
            if uses != 1:
                return f"{module_path(layer)} shares its {what} ({arg.target}): used {uses} times"
        return ""

    def _reads(self, target: str) -> int:
        nodes = self.gm.graph.nodes
        return sum(len(n.users) for n in nodes if n.op == "get_attr" and str(n.target) == target)

    # -- editing it --------------------------------------------------------------------------
    def bypass(self, norm: Norm) -> None:
        self._route(norm, norm.input)

    def _route(self, norm: Norm, replacement: fx.Node) -> None:
        """Route the norm's readers to ``replacement`` and delete the norm's nodes."""
        scope = set(norm.nodes)
        norm.output.replace_all_uses_with(replacement, delete_user_cb=lambda u: u not in scope)
        for node in reversed(norm.nodes):
            if not node.users:  # a constant a later call of a shared norm reads stays
                self.gm.graph.erase_node(node)

    def weights(self, layer: fx.Node) -> tuple[Tensor, Tensor | None]:
        """As torch's Linear lays them out: a Conv1D's (in, out) weight transposed."""
        weight_node, bias_node = _weight_and_bias(layer)
        weight = fetch_attr(self.gm, str(weight_node.target))
        if layer.target == ADDMM:
            weight = weight.T
        bias = fetch_attr(self.gm, str(bias_node.target)) if bias_node is not None else None
        return weight, bias

    def set_weights(self, layer: fx.Node, weight: Tensor, bias: Tensor) -> None:
        """Write the weight and the bias back (a bias is created if the layer had none)."""
        weight_node, bias_node = _weight_and_bias(layer)
        if layer.target == ADDMM:
            weight = weight.T.contiguous()
        set_attr(self.gm, str(weight_node.target), weight)
        if isinstance(bias_node, fx.Node):
            set_attr(self.gm, str(bias_node.target), bias)
            return
        owner = str(layer.args[1].target).rpartition(".")[0]  # type: ignore[union-attr]
        created = self._new_attribute(f"{owner}.bias" if owner else "bias", bias)
        with self.gm.graph.inserting_before(layer):
            new_node = self.gm.graph.get_attr(created)
        layer.args = (*layer.args[:2], new_node, *layer.args[3:])

    def term_values(self, term: Term) -> Tensor:
        return torch.as_tensor(self.constants.value(term.node.args[term.index]))

    def set_term_values(self, term: Term, values: Tensor) -> None:
        source = term.node.args[term.index]
        if source.op == "get_attr":  # a lookup's table
            set_attr(self.gm, str(source.target), values)
            return
        created = self._new_attribute(f"{module_path(term.node)}.folded_term", values)
        with self.gm.graph.inserting_before(term.node):
            term.node.replace_input_with(source, self.gm.graph.get_attr(created))

    def keep_as_scale_shift(self, norm: Norm) -> None:
        """One Mul and one Add by constant (C,) vectors: no reduction, division or square root."""
        dtype = norm.output.meta["val"].dtype
        layout = broadcast_shape(norm.scale.numel(), norm.axis)  # (C,), or (C, 1, 1) ...
        scale, shift = (v.to(dtype).reshape(layout) for v in (norm.scale, norm.shift))
        scale_target = self._new_attribute(f"{norm.name}.folded_scale", scale)
        shift_target = self._new_attribute(f"{norm.name}.folded_shift", shift)
        graph = self.gm.graph
        with graph.inserting_before(norm.output.next):
            mul = graph.call_function(aten.mul.Tensor, (norm.input, graph.get_attr(scale_target)))
            add = graph.call_function(aten.add.Tensor, (mul, graph.get_attr(shift_target)))
        for node in (mul, add):  # keep the norm's name on its replacement (ONNX metadata shows it)
            node.meta["nn_module_stack"] = norm.output.meta.get("nn_module_stack", {})
            node.meta["val"] = norm.output.meta.get("val")
        self._route(norm, add)

    def reroute(self, value: fx.Node, replacement: fx.Node) -> None:
        """``value``'s readers read ``replacement``; the ops back to it that nothing reads go."""
        value.replace_all_uses_with(replacement)
        node: Any = value
        while isinstance(node, fx.Node) and node is not replacement and not node.users:
            data = node.args[0] if node.args else None
            self.gm.graph.erase_node(node)
            node = data

    def _new_attribute(self, target: str, tensor: Tensor) -> str:
        """A free attribute name at ``target`` (suffixed if taken) holding ``tensor``; on the
        root when ``target`` names no module (a run in the model's own forward)."""
        owner_path, _, name = target.rpartition(".")
        try:
            owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        except AttributeError:
            owner_path, owner = "", self.gm
        candidate, index = name, 0
        while hasattr(owner, candidate):
            index += 1
            candidate = f"{name}_{index}"
        free = f"{owner_path}.{candidate}" if owner_path else candidate
        set_attr(self.gm, free, tensor)
        return free

    def remove_dead_attributes(self) -> None:
        """Drop get_attr nodes nothing reads any more, and the norm tensors behind them (first
        what a folded run's constants were computed with, ``sqrt(running_var + eps)``)."""
        graph = self.gm.graph
        for node in reversed(graph.nodes):
            pure = self.constants.is_const(node) or _kind(node) is Kind.SHAPE
            if node.op == "call_function" and not node.users and pure:
                graph.erase_node(node)
        dead = [n for n in graph.nodes if n.op == "get_attr" and not n.users]
        for node in dead:
            graph.erase_node(node)
        live = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
        norm_classes = tuple(offline_norm_classes().values())
        for node in dead:
            target = str(node.target)
            if target in live:
                continue
            owner_path, _, name = target.rpartition(".")
            owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
            if (
                name in owner._parameters
                or name in owner._buffers
                or isinstance(owner, norm_classes)
            ):
                delattr(owner, name)


def _kind(node: fx.Node) -> Kind:
    target = node.target
    if node.op == "call_module" and str(target).startswith("_guards"):
        return Kind.SHAPE  # torch.export's input-shape guard: reads shapes, not values
    if node.op != "call_function":
        return Kind.OTHER
    if target in AFFINE_OPS:
        binary = all(isinstance(a, fx.Node) for a in node.args[:2]) and len(node.args) >= 2
        return ELEMENTWISE[AFFINE_OPS[target]] if binary and not node.kwargs else Kind.OTHER  # type: ignore[index]
    if target == ADDMM:  # a Linear unless scaled (beta, alpha)
        return Kind.LINEAR if not node.kwargs and len(node.args) == 3 else Kind.OTHER
    if target in PAD_OPS:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        return Kind.PAD if mode == "constant" else Kind.OTHER
    if target in GLOBAL_POOL_OPS:
        size = node.args[1] if len(node.args) > 1 else None
        return Kind.MEAN if list(size or []) == [1] * GLOBAL_POOL_OPS[target] else Kind.OTHER  # type: ignore[index]
    kinds = (
        (LINEAR_OPS, Kind.LINEAR), (CONV_OPS, Kind.CONV), (LOOKUP_OPS, Kind.LOOKUP),
        (IDENTITY_OPS, Kind.IDENTITY), (RESHAPE_OPS, Kind.RESHAPE), (SELECT_OPS, Kind.SELECT),
        ({aten.transpose.int, aten.permute.default}, Kind.TRANSPOSE),
        ({aten.mean.dim}, Kind.MEAN), ({aten.cat.default}, Kind.CONCAT),
        (SHAPE_ONLY_OPS, Kind.SHAPE),
    )  # fmt: skip
    return next((kind for ops, kind in kinds if target in ops), Kind.OTHER)


def _axes(node: fx.Node) -> tuple[int, ...]:
    """SELECT / MEAN: the axes acted on; TRANSPOSE: the permutation (normalized); PAD: the
    axes padded by a nonzero width; CONCAT: the axis joined along."""
    data = node.args[0] if node.args else None
    if node.target == aten.cat.default and data:
        data = data[0]  # type: ignore[index]
    rank = len(shape(data) or ()) if isinstance(data, fx.Node) else 0
    target = node.target
    if not rank or target == operator.getitem:
        return ()
    if target == aten.transpose.int:
        d0, d1 = normalize_dims(node.args[1:3], rank)
        perm = list(range(rank))
        perm[d0], perm[d1] = d1, d0
        return tuple(perm)
    if target == aten.permute.default:
        return tuple(normalize_dims(node.args[1], rank))
    if target == aten.roll.default:
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims")
        return tuple(normalize_dims(dims, rank)) if dims else tuple(range(rank))
    if target in SELECT_OPS:
        return tuple(normalize_dims(node.args[1] if len(node.args) > 1 else 0, rank))
    if target == aten.mean.dim:
        dims = node.args[1] if len(node.args) > 1 else None
        return tuple(normalize_dims(dims, rank)) if dims else tuple(range(rank))
    if target in GLOBAL_POOL_OPS:
        return tuple(range(rank - GLOBAL_POOL_OPS[target], rank))  # type: ignore[index]
    if target in PAD_OPS:  # widths in pairs, the last axis first
        widths = list(node.args[1])  # type: ignore[arg-type]
        pairs = [widths[i : i + 2] for i in range(0, len(widths), 2)]
        return tuple(sorted(rank - 1 - i for i, pair in enumerate(pairs) if any(pair)))
    if target == aten.cat.default:
        return tuple(normalize_dims(node.args[1] if len(node.args) > 1 else 0, rank))
    return ()


def _pad_fill(node: fx.Node, kind: Kind) -> float | None:
    """A constant pad's value (0 unless given); None for any other op."""
    if kind is not Kind.PAD:
        return None
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    if node.target == aten.constant_pad_nd.default:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
    return 0.0 if value is None else float(value)  # type: ignore[arg-type]


def _weight_and_bias(layer: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """A Linear's weight and bias arguments: linear(x, W, b), addmm(b, x, W)."""
    if layer.target == ADDMM:
        return layer.args[2], layer.args[0]  # type: ignore[return-value]
    bias = layer.args[2] if len(layer.args) > 2 else None
    return layer.args[1], bias  # type: ignore[return-value]


def _parameter_args(layer: fx.Node) -> list[Any]:
    """The arguments that must be parameters of the layer's own: a lookup's table; a Linear's
    or Conv's weight and bias (None where it has no bias)."""
    if layer.target in LOOKUP_OPS:
        return list(layer.args[:1])
    if layer.target == ADDMM:
        return list(_weight_and_bias(layer))
    return list(layer.args[1:3])
