"""The fold rules, written once: where an offline norm's ``x * scale + shift`` may go.

In eval every offline norm is a per-channel affine on the last axis. For each one, in order:

1. **forward**, into every Linear that consumes it, when all its readers reach a Linear's data
   input through ops that commute with a per-channel affine and keep the channel axis last
   (identity, channel-preserving reshapes and transposes, token slices and gathers, a mean over
   tokens; a sum over tokens would scale the shift, so it is not one of them);
2. **backward**, into the Linear (channels last) or Conv (channels on axis 1) that produces its
   input, through identity, transposes and reshapes that keep the channel axis whole, when
   nothing else reads any value on the way;
3. **into embedding tables**, when its input is a sum of table lookups (and constants) that
   nothing else reads: every term scaled, the shift added to the first (BERT's embeddings norm);
4. else it stays as exactly one per-channel Mul + Add, and the reason names what stopped each.

The rules read and edit a graph only through :class:`FoldGraph`, which torch.fx
(:mod:`.fx_fold_graph`) and ONNX (:mod:`.onnx_fold_graph`) each implement: one classification
of their ops into :class:`Kind` (data, not logic), the weight I/O of their layers, and the edits.
So a model folds the same from any format it is exported in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from .equations import (
    fold_affine_into_embedding_tables,
    fold_affine_into_following_linear,
    fold_affine_into_preceding_linear,
)
from .fold_report import NormFold

Equation = Callable[[Tensor, Tensor | None, Tensor, Tensor], tuple[Tensor, Tensor]]


class Kind(Enum):
    """What an op does, as far as a per-channel affine on its data input is concerned."""

    LINEAR = "linear"  # x @ W (+ b); data is input 0
    CONV = "conv"  # channels on axis 1
    LOOKUP = "lookup"  # rows of a table: input 0 is the table
    ADD = "add"  # a sum of two tensors
    SUB = "sub"  # a difference of two tensors
    MUL = "mul"  # a product (or quotient) of two tensors
    IDENTITY = "identity"  # the same values (copies, dropout in eval, casts)
    RESHAPE = "reshape"  # row-major reshape
    TRANSPOSE = "transpose"  # axes: the permutation
    SELECT = "select"  # picks positions along ``axes`` (slice, gather, select)
    MEAN = "mean"  # mean over ``axes``
    SHAPE = "shape"  # reads the shape only, which a per-channel affine never changes
    OTHER = "other"


@dataclass(frozen=True)
class Op:
    """One node of the graph, classified: ``inputs[0]`` is its data input."""

    kind: Kind
    inputs: tuple[Any, ...]
    output: Any
    axes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Norm:
    """One offline norm, reduced to ``output = input * scale + shift`` (float64, ``(C,)``)."""

    name: str
    kind: str
    nodes: tuple[Any, ...]
    input: Any
    output: Any
    scale: Tensor
    shift: Tensor


@dataclass(frozen=True)
class Term:
    """One term of a summed embedding: input ``index`` of ``node`` holds the values to scale
    (a lookup's table, or a constant added in)."""

    node: Any
    index: int
    is_lookup: bool


class FoldGraph(Protocol):
    """What the rules need of a graph. Values are what flows along edges (an fx node, an ONNX
    value), nodes what computes them; weights cross in torch's ``(out, in, ...)`` layout."""

    def norm_sites(self) -> list[Hashable]: ...  # one per norm, described when its turn comes
    def describe_norm(self, site: Hashable) -> Norm | None: ...
    def op(self, node: Any) -> Op: ...
    def readers(self, value: Any) -> list[Any]: ...
    def producer(self, value: Any) -> Any | None: ...  # None for a graph input
    def is_output(self, value: Any) -> bool: ...
    def is_constant(self, value: Any) -> bool: ...
    def shape(self, value: Any) -> tuple[Any, ...] | None: ...
    def name(self, value: Any) -> str: ...
    def describe(self, node: Any) -> str: ...  # a node in a message
    def layer_name(self, node: Any) -> str: ...  # a layer or lookup in the report
    def term_name(self, term: Term) -> str: ...  # "" when the file does not say
    def layer_problem(self, node: Any) -> str: ...  # "" if its weights (table) are its own
    def weights(self, layer: Any) -> tuple[Tensor, Tensor | None]: ...
    def set_weights(self, layer: Any, weight: Tensor, bias: Tensor) -> None: ...
    def term_values(self, term: Term) -> Tensor: ...
    def set_term_values(self, term: Term, values: Tensor) -> None: ...
    def bypass(self, norm: Norm) -> None: ...  # its readers read its input; its nodes go
    def keep_as_scale_shift(self, norm: Norm) -> None: ...


def fold_all(graph: FoldGraph) -> tuple[NormFold, ...]:
    """Fold every norm of ``graph`` in place; each is described just before its fold, since an
    earlier fold may have changed a constant it reads."""
    results = []
    for site in graph.norm_sites():
        norm = graph.describe_norm(site)
        if norm is not None:
            results.append(fold_norm(graph, norm))
    return tuple(results)


def fold_norm(graph: FoldGraph, norm: Norm) -> NormFold:
    """Forward, else backward, else into embedding tables, else one Mul + Add (and why)."""
    layers, forward_reason = following_layers(graph, norm)
    if layers is not None:
        graph.bypass(norm)
        for layer in layers:
            _fold_layer(graph, layer, norm, fold_affine_into_following_linear)
        names = tuple(graph.layer_name(layer) for layer in layers)  # in graph order: q, k, v
        return NormFold(norm.name, norm.kind, "folded_forward", names)
    layer, backward_reason = preceding_layer(graph, norm)
    if layer is not None:
        graph.bypass(norm)
        _fold_layer(graph, layer, norm, fold_affine_into_preceding_linear)
        return NormFold(norm.name, norm.kind, "folded_backward", (graph.layer_name(layer),))
    terms, embedding_reason = embedding_terms(graph, norm)
    if terms is not None:
        tables = tuple(sorted(filter(None, map(graph.term_name, terms))))  # before the edit
        values = [graph.term_values(term) for term in terms]
        folded = fold_affine_into_embedding_tables(
            [v.double() for v in values], norm.scale, norm.shift
        )
        graph.bypass(norm)
        for term, old, new in zip(terms, values, folded, strict=True):
            graph.set_term_values(term, new.to(old.dtype))
        return NormFold(norm.name, norm.kind, "folded_backward", tables)
    graph.keep_as_scale_shift(norm)
    reason = f"forward: {forward_reason}; backward: {backward_reason}"
    reason += f"; embeddings: {embedding_reason}" if embedding_reason else ""
    return NormFold(norm.name, norm.kind, "scale_shift", reason=reason)


def _fold_layer(graph: FoldGraph, layer: Any, norm: Norm, equation: Equation) -> None:
    """One equation of :mod:`.equations` in float64, stored in the layer's dtype."""
    weight, bias = graph.weights(layer)
    new_weight, new_bias = equation(
        weight.double(), None if bias is None else bias.double(), norm.scale, norm.shift
    )
    graph.set_weights(layer, new_weight.to(weight.dtype), new_bias.to(weight.dtype))


def _data_readers(graph: FoldGraph, value: Any) -> list[Any]:
    return [node for node in graph.readers(value) if graph.op(node).kind is not Kind.SHAPE]


def following_layers(graph: FoldGraph, norm: Norm) -> tuple[list[Any] | None, str]:
    """Every Linear the norm's output reaches through affine-commuting ops, or why not."""
    channels = norm.scale.numel()
    layers: list[Any] = []
    frontier = [norm.output]
    while frontier:
        value = frontier.pop()
        if graph.is_output(value):
            return None, f"{graph.name(value)} is a model output"
        for node in _data_readers(graph, value):
            op = graph.op(node)
            if op.kind is Kind.LINEAR and _reads_as_data(op, value):
                problem = graph.layer_problem(node)
                if problem:
                    return None, problem
                layers.append(node)
                continue
            reason = _commutes(graph, op, value, channels)
            if reason:
                return None, f"it feeds {graph.describe(node)} {reason}"
            frontier.append(op.output)
    if not layers or len(set(map(id, layers))) != len(layers):
        return None, "no Linear consumes it"
    return layers, ""


def _reads_as_data(op: Op, value: Any) -> bool:
    return op.inputs[0] is value and all(v is not value for v in op.inputs[1:])


def _commutes(graph: FoldGraph, op: Op, value: Any, channels: int) -> str:
    """ "" if ``op`` passes a per-channel affine of ``value`` (channels last) through, keeping the
    channel axis last; else what it does instead."""
    if op.kind in (Kind.ADD, Kind.SUB, Kind.MUL) and not any(map(graph.is_constant, op.inputs)):
        verb = "multiplies it by" if op.kind is Kind.MUL else "adds it to"
        return f"{verb} another tensor (a residual or a mask)"
    if not _reads_as_data(op, value):
        return "reads it as something other than data"
    in_shape, out_shape = graph.shape(value), graph.shape(op.output)
    rank = len(in_shape) if in_shape is not None else 0
    last_kept = bool(out_shape) and out_shape[-1] == channels  # type: ignore[index]
    if op.kind is Kind.IDENTITY:
        return ""
    if op.kind is Kind.RESHAPE:
        return "" if last_kept and rank and in_shape[-1] == channels else "moves the channel axis"  # type: ignore[index]
    if op.kind is Kind.TRANSPOSE:
        return "" if rank and op.axes[-1] == rank - 1 else "moves the channel axis"
    if op.kind in (Kind.SELECT, Kind.MEAN):
        # A mean of x * s + t over tokens is mean(x) * s + t; a sum would scale t.
        return "" if rank and rank - 1 not in op.axes and last_kept else "acts on the channel axis"
    return "does not commute with a per-channel affine"


def preceding_layer(graph: FoldGraph, norm: Norm) -> tuple[Any | None, str]:
    """The Linear/Conv whose output is the norm's input, through ops that move the channel axis
    whole, with nothing else reading any value on the way; or why there is none."""
    value, shape = norm.input, graph.shape(norm.input)
    axis = len(shape) - 1 if shape is not None else -1
    previous: set[int] = {id(node) for node in norm.nodes}  # who may read ``value``
    while True:
        node = graph.producer(value)
        if node is None:
            return None, f"its input {graph.name(value)} is a graph input"
        others = [n for n in _data_readers(graph, value) if id(n) not in previous]
        if others or graph.is_output(value):
            where = graph.describe(others[0]) if others else "a model output"
            return None, f"its input {graph.name(value)} is also read elsewhere ({where})"
        op = graph.op(node)
        rank = len(graph.shape(value) or ())
        if (op.kind is Kind.LINEAR and axis == rank - 1) or (op.kind is Kind.CONV and axis == 1):
            problem = graph.layer_problem(node)
            return (None, problem) if problem else (node, "")
        if op.kind is Kind.TRANSPOSE:
            axis = op.axes[axis]
        elif op.kind is Kind.RESHAPE:
            axis = source_axis(graph.shape(op.inputs[0]), graph.shape(value), axis)
            if axis is None:
                return None, f"{graph.describe(node)} mixes the channel axis"
        elif op.kind is not Kind.IDENTITY:
            return None, f"its input comes from {graph.describe(node)}"
        previous, value = {id(node)}, op.inputs[0]


def source_axis(before: Sequence | None, after: Sequence | None, axis: int) -> int | None:
    """The input axis that a row-major reshape ``before -> after`` turned into output axis
    ``axis`` whole (same size, same number of elements before it); None if it was split or
    merged, or the sizes are not known. Leading axes the two shapes share (a symbolic batch)
    are skipped first."""
    if before is None or after is None:
        return None
    before, after, offset = list(before), list(after), 0
    while axis > 0 and before and after and str(before[0]) == str(after[0]):
        before, after, axis, offset = before[1:], after[1:], axis - 1, offset + 1
    if not all(isinstance(d, int) for d in [*before, *after]):
        return None
    prefix = int(np.prod(after[:axis]))
    for index, size in enumerate(before):
        if int(np.prod(before[:index])) == prefix and size == after[axis]:
            return index + offset
    return None


def embedding_terms(graph: FoldGraph, norm: Norm) -> tuple[list[Term] | None, str]:
    """The terms of the sum the norm reads, when every term is a lookup of a table of its own
    or a constant, at least one a lookup, and nothing else reads the sum or its parts; else
    None and why ("" when no lookup is summed there: nothing to explain)."""
    if graph.is_constant(norm.input):
        return None, ""
    terms: list[Term] = []
    problems: list[str] = []
    inside: set[int] = {id(node) for node in norm.nodes}
    frontier = [(norm.nodes[0], norm.input)]
    while frontier:
        reader, value = frontier.pop()
        node = graph.producer(value)
        op = graph.op(node) if node is not None else None
        is_lookup = op is not None and op.kind is Kind.LOOKUP  # even at constant indices
        if graph.is_constant(value) and not is_lookup:  # scaled in a constant of its own
            terms.append(Term(reader, _index(graph, reader, value), is_lookup=False))
            continue
        others = [n for n in _data_readers(graph, value) if id(n) not in inside]
        if others or graph.is_output(value):
            problems.append(f"{graph.name(value)} is also read elsewhere")
        if is_lookup:
            problem = graph.layer_problem(node)
            problems += [problem] if problem else []
            terms.append(Term(node, 0, is_lookup=True))
        elif op is not None and op.kind is Kind.IDENTITY:
            inside.add(id(node))
            frontier.append((node, op.inputs[0]))
        elif op is not None and op.kind is Kind.ADD and len(op.inputs) == 2:
            inside.add(id(node))
            frontier.extend((node, v) for v in op.inputs)
        else:
            what = graph.describe(node) if node is not None else f"input {graph.name(value)}"
            problems.append(f"the sum also adds {what}, not a table lookup")
    lookups = [t.node for t in terms if t.is_lookup]
    if not lookups:
        return None, ""
    if len(set(map(id, lookups))) != len(lookups):
        problems.append("the sum adds a lookup more than once")
    return (None, problems[0]) if problems else (terms, "")


def _index(graph: FoldGraph, node: Any, value: Any) -> int:
    return next(i for i, v in enumerate(graph.op(node).inputs) if v is value)
