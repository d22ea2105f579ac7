"""The fold rules, written once: where an offline norm's ``x * scale + shift`` may go.

In eval every offline norm is a per-channel affine on the last axis. For each one, in order:

1. **forward**, into every Linear that consumes it, when all its readers reach a Linear's data
   input through ops that commute with a per-channel affine, its channel axis followed wherever
   they move it and last again at each Linear: identity, reshapes and transposes that keep the
   channel axis whole, token slices, gathers and rolls, a mean over tokens (a sum would scale
   the shift), joins of pieces that all carry it along another axis (a roll exported as Slice +
   Concat), and a pad that adds nothing or a constant the affine leaves as it is (a zero pad
   when the shift is zero: elsewhere the padded positions would read the shift, not 0);
2. **backward**, into the Linear (channels last) or Conv (channels on axis 1) that produces its
   input, through identity, transposes and reshapes that keep the channel axis whole, when
   nothing else reads any value on the way;
3. **into embedding tables**, when its input is a sum of table lookups (and constants) that
   nothing else reads: every term scaled, the shift added to the first (BERT's embeddings norm);
4. else it stays as exactly one per-channel Mul + Add, and the reason names what stopped each.

The rules read and edit a graph only through :class:`~.fold_graph.FoldGraph`, which torch.fx
(:mod:`.fx_fold_graph`) and ONNX (:mod:`.onnx_fold_graph`) each implement: one classification
of their ops into :class:`~.fold_graph.Kind` (data, not logic), the weight I/O of their layers,
and the edits. So a model folds the same from any format it is exported in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from torch import Tensor

from .equations import (
    fold_affine_into_embedding_tables,
    fold_affine_into_following_linear,
    fold_affine_into_preceding_linear,
)
from .fold_graph import FoldGraph, Kind, Norm, Op, Term
from .fold_report import NormFold
from .layout_round_trips import remove_round_trips

__all__ = ["FoldGraph", "Kind", "Norm", "Op", "Term", "fold_all", "fold_norm"]

Equation = Callable[[Tensor, Tensor | None, Tensor, Tensor], tuple[Tensor, Tensor]]


def fold_all(graph: FoldGraph) -> tuple[NormFold, ...]:
    """Fold every norm call of ``graph`` in place; each is described just before its fold,
    since an earlier fold may have changed a constant it reads. A norm module called more than
    once (ALBERT's shared layers) folds per call; its later calls are reported as
    ``name (call 2)``, ``name (call 3)``, ... in graph order."""
    results = []
    calls: dict[str, int] = {}
    for site in graph.norm_sites():
        norm = graph.describe_norm(site)
        if norm is not None:
            result = fold_norm(graph, norm)
            calls[norm.name] = calls.get(norm.name, 0) + 1
            if calls[norm.name] > 1:
                result = replace(result, name=f"{norm.name} (call {calls[norm.name]})")
            results.append(result)
    return tuple(results)


def fold_norm(graph: FoldGraph, norm: Norm) -> NormFold:
    """Forward, else backward, else into embedding tables, else one Mul + Add (and why)."""
    layers, forward_reason = following_layers(graph, norm)
    if layers is not None:
        graph.bypass(norm)
        for layer in layers:
            _fold_layer(graph, layer, norm, fold_affine_into_following_linear)
        names = tuple(graph.layer_name(layer) for layer in layers)  # in graph order: q, k, v
        _remove_layout_round_trip(graph, norm)
        return NormFold(norm.name, norm.kind, "folded_forward", names)
    layer, backward_reason = preceding_layer(graph, norm)
    if layer is not None:
        graph.bypass(norm)
        _fold_layer(graph, layer, norm, fold_affine_into_preceding_linear)
        _remove_layout_round_trip(graph, norm)
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


def _remove_layout_round_trip(graph: FoldGraph, norm: Norm) -> None:
    """A norm computed in another layout (channels not last) was reached through layout ops
    and left through their inverses: with the norm gone, they meet and go too."""
    if norm.axis != -1:
        remove_round_trips(graph, norm.input)


def _fold_layer(graph: FoldGraph, layer: Any, norm: Norm, equation: Equation) -> None:
    """One equation of :mod:`.equations` in float64, stored in the layer's dtype."""
    weight, bias = graph.weights(layer)
    new_weight, new_bias = equation(
        weight.double(), None if bias is None else bias.double(), norm.scale, norm.shift
    )
    graph.set_weights(layer, new_weight.to(weight.dtype), new_bias.to(weight.dtype))


def following_layers(graph: FoldGraph, norm: Norm) -> tuple[list[Any] | None, str]:
    """Every Linear the norm's output reaches through affine-commuting ops (its channel axis
    followed wherever they move it, and last again at each Linear), or why not. A join
    (Concat; a roll exported as Slice + Concat) is crossed once all its inputs are reached."""
    layers: list[Any] = []
    reached: dict[int, int] = {}  # id(value) -> its channel axis, for every value reached
    joins: dict[int, Any] = {}  # joins reached through some of their inputs so far
    frontier = [(norm.output, len(graph.shape(norm.output) or (0,)) + norm.axis)]
    while frontier:
        value, axis = frontier.pop()
        if graph.is_output(value):
            return None, f"{graph.name(value)} is a model output"
        reached[id(value)] = axis
        for node in _data_readers(graph, value):
            op = graph.op(node)
            if op.kind is Kind.CONCAT:
                joins[id(node)] = node
            elif op.kind is Kind.LINEAR and _reads_as_data(op, value):
                problem = graph.layer_problem(node) or _channels_last(graph, value, axis)
                if problem:
                    return None, problem
                layers.append(node)
            else:
                moved, reason = passes_through(graph, op, value, axis, norm)
                if reason:
                    return None, f"it feeds {graph.describe(node)} {reason}"
                frontier.append((op.output, moved))
        if not frontier:  # every branch ended: cross the joins whose inputs are all reached
            for key, node in list(joins.items()):
                op = graph.op(node)
                axes = {reached.get(id(v)) for v in op.inputs}
                if None not in axes:
                    del joins[key]
                    if len(axes) != 1 or op.axes[0] in axes:
                        return None, f"it feeds {graph.describe(node)} along the channel axis"
                    frontier.append((op.output, axes.pop()))
    if joins:
        node = next(iter(joins.values()))
        why = "reads it as something other than data (it joins it to another tensor)"
        return None, f"it feeds {graph.describe(node)} {why}"
    if not layers or len(set(map(id, layers))) != len(layers):
        return None, "no Linear consumes it"
    return layers, ""


def _channels_last(graph: FoldGraph, value: Any, axis: int) -> str:
    if axis == len(graph.shape(value) or ()) - 1:
        return ""
    return f"{graph.name(value)} reaches a Linear with its channels not last"


def _data_readers(graph: FoldGraph, value: Any) -> list[Any]:
    return [node for node in graph.readers(value) if graph.op(node).kind is not Kind.SHAPE]


def _reads_as_data(op: Op, value: Any) -> bool:
    return op.inputs[0] is value and all(v is not value for v in op.inputs[1:])


def passes_through(graph: FoldGraph, op: Op, value: Any, axis: int, norm: Norm) -> tuple[int, str]:
    """Where the channel axis of ``value`` (a per-channel affine of the norm's input, channels
    on ``axis``) is in ``op``'s output, and "" if ``op`` commutes with that affine; else why
    not."""
    if op.kind in (Kind.ADD, Kind.SUB, Kind.MUL) and not any(map(graph.is_constant, op.inputs)):
        verb = "multiplies it by" if op.kind is Kind.MUL else "adds it to"
        return axis, f"{verb} another tensor (a residual or a mask)"
    if not _reads_as_data(op, value):
        return axis, "reads it as something other than data"
    in_shape, out_shape = graph.shape(value) or (), graph.shape(op.output) or ()
    moved: int | None = None
    if op.kind is Kind.PAD and pad_problem(op, axis, norm):
        return axis, pad_problem(op, axis, norm)
    if op.kind in (Kind.IDENTITY, Kind.PAD):
        moved = axis
    elif op.kind is Kind.RESHAPE:
        moved = reshaped_axis(in_shape, out_shape, axis, norm.scale.numel())
    elif op.kind is Kind.TRANSPOSE and axis in op.axes:
        moved = op.axes.index(axis)
    elif op.kind in (Kind.SELECT, Kind.MEAN):
        if axis in op.axes or not op.axes:
            return axis, "acts on the channel axis"
        # A mean of x * s + t over tokens is mean(x) * s + t; a sum would scale t.
        moved = _axis_after_removing(in_shape, out_shape, op.axes, axis)
    else:
        return axis, "does not commute with a per-channel affine"
    if moved is None or not _same_size(in_shape, out_shape, axis, moved):
        return axis, "moves the channel axis apart"
    return moved, ""


def pad_problem(op: Op, axis: int, norm: Norm) -> str:
    """ "" when padding commutes with the norm's ``x * s + t``: nothing padded (a zero-width pad,
    e.g. Swin's when the feature map is a multiple of the window), or a constant ``c`` with
    ``c * s + t == c`` on every channel (0 when the shift is 0). Otherwise the padded positions
    would read ``t`` (0 * s + t) where the model reads 0: the fold is not exact there."""
    if axis in op.axes:
        return "pads the channel axis"
    if not op.axes:
        return ""
    if op.fill is None:
        return "pads with values that are not a constant"
    if np.allclose((op.fill * norm.scale + norm.shift).detach().numpy(), op.fill, atol=1e-12):
        return ""
    return (
        f"pads axes {list(op.axes)} with {op.fill:g}, which the norm's shift (not zero) would "
        "change: the padded positions are not masked, so the fold would not be exact"
    )


def reshaped_axis(before: Sequence, after: Sequence, axis: int, channels: int) -> int | None:
    """The output axis of a row-major reshape that holds input axis ``axis`` whole, or None."""
    last = len(before) - 1
    if axis == last and before and after and before[-1] == channels == after[-1]:
        return len(after) - 1  # keeping the last size keeps every element's channel index
    found = [k for k in range(len(after)) if source_axis(before, after, k) == axis]
    return found[0] if len(found) == 1 else None


def _axis_after_removing(
    before: Sequence, after: Sequence, axes: tuple[int, ...], axis: int
) -> int | None:
    """The channel axis after an op that acted on ``axes`` and kept them (same rank) or
    dropped them all; None when the ranks say neither."""
    if len(after) == len(before):
        return axis
    if len(after) == len(before) - len(axes):
        return axis - sum(a < axis for a in axes)
    return None


def _same_size(before: Sequence, after: Sequence, axis: int, moved: int) -> bool:
    if not (0 <= axis < len(before) and 0 <= moved < len(after)):
        return not before or not after  # a shape not recorded: trust the op's kind
    size, new = before[axis], after[moved]
    return not (isinstance(size, int) and isinstance(new, int)) or size == new


def preceding_layer(graph: FoldGraph, norm: Norm) -> tuple[Any | None, str]:
    """The Linear/Conv whose output is the norm's input, through ops that move the channel axis
    whole, with nothing else reading any value on the way; or why there is none."""
    value, shape = norm.input, graph.shape(norm.input)
    axis = len(shape) + norm.axis if shape is not None else -1
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
    if graph.is_constant(norm.input) or norm.axis != -1:  # tables hold channels last
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
