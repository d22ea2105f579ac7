"""Fold a norm that reads a sum of embedding lookups into the embedding tables (ONNX graphs).

The ONNX twin of :mod:`.embedding_fold`: BERT's embeddings norm reads
``Gather(word_table, ids) + Gather(type_table, types) + positions``, where exporters often leave
a lookup with constant indices as a constant (``(1, L, C)``: the position rows). Every term is
scaled and the shift goes into the first (:func:`.equations.fold_affine_into_embedding_tables`):
the tables and constants get new initializers, and the chain disappears.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from .equations import fold_affine_into_embedding_tables
from .onnx_names import label
from .onnx_rewrites import constant, is_default_op, set_constant_input


@dataclass(frozen=True)
class Term:
    """One term of the sum: input ``index`` of ``node`` holds the values to change (a Gather's
    table, or a constant added in)."""

    node: ir.Node
    index: int
    values: np.ndarray


def embedding_terms(data: ir.Value, reader: ir.Node) -> tuple[list[Term] | None, str]:
    """The terms of the sum ``data`` (read by ``reader``, the norm's first node) when every term
    is a table lookup (Gather of a constant table of its own, along rows) or a constant, at least
    one a lookup, and nothing else reads the sum or its parts; else None and the reason ("" when
    no lookup is summed there: nothing to explain)."""
    terms: list[Term] = []
    leaves: list[tuple[ir.Node, int, ir.Value]] = []
    problems: list[str] = []
    frontier = [(reader, data)]
    while frontier:
        user, value = frontier.pop()
        producer = value.producer()
        readers = [u for u, _ in value.uses()]
        if value.is_graph_output() or readers != [user]:
            problems.append(f"{value.name} is also read elsewhere")
        if is_default_op(producer, "Add") and len(producer.inputs) == 2:
            frontier.extend((producer, v) for v in producer.inputs)  # type: ignore[misc]
            continue
        index = next(i for i, v in enumerate(user.inputs) if v is value)
        leaves.append((user, index, value))
    for user, index, value in leaves:
        term, problem = _term(user, index, value)
        if term is None:
            problems.append(problem)
        else:
            terms.append(term)
    if not any(t.node.op_type == "Gather" for t in terms):
        return None, ""
    return (None, problems[0]) if problems else (terms, "")


def _term(user: ir.Node, index: int, value: ir.Value) -> tuple[Term | None, str]:
    fixed = constant(value)
    if fixed is not None:
        return Term(user, index, fixed), ""
    gather = value.producer()
    if not is_default_op(gather, "Gather"):
        what = f"{label(gather)} ({gather.op_type})" if gather else f"input {value.name}"
        return None, f"the sum also adds {what}, not a table lookup"
    table = constant(gather.inputs[0])  # type: ignore[union-attr]
    axis = gather.attributes.get("axis")  # type: ignore[union-attr]
    if table is None or table.ndim != 2 or (axis is not None and axis.value != 0):
        return None, f"{label(gather)} does not look up rows of a constant table"
    if len(gather.inputs[0].uses()) != 1:  # type: ignore[union-attr]
        return None, f"{label(gather)} shares its table (tied weights)"
    return Term(gather, 0, table), ""  # type: ignore[arg-type]


def fold_into_embeddings(
    graph: ir.Graph, terms: list[Term], scale: np.ndarray, shift: np.ndarray
) -> None:
    """Every term scaled, the shift added to the first; stored in each term's dtype."""
    folded = fold_affine_into_embedding_tables(
        [torch.from_numpy(t.values.astype(np.float64)) for t in terms],
        torch.from_numpy(scale),
        torch.from_numpy(shift),
    )
    for term, values in zip(terms, folded, strict=True):
        array = values.numpy().astype(term.values.dtype)
        set_constant_input(graph, term.node, term.index, array, f"{term.node.name}_folded")
