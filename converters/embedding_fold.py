"""Fold a norm that reads a sum of embedding lookups into the embedding tables (torch graphs).

BERT-style models normalize ``word[ids] + position[pos] + token_type[types]``: the norm is read
by a residual Add as well as by the first layer's Linears, so it folds neither forward nor into
a Linear behind it. But each lookup reads one row of its table, so the norm folds into the
tables (:func:`.equations.fold_affine_into_embedding_tables`): every table scaled, the shift in
the first. No Mul + Add is left in front of the encoder, and the int8 tensors after the lookups
carry the normalized values the quantizer calibrated for, not the raw sum.
"""

from __future__ import annotations

import torch
from torch import fx

from .equations import fold_affine_into_embedding_tables
from .graph import IDENTITY_OPS, SHAPE_ONLY_OPS, aten, fetch_attr, module_path, set_attr

EMBEDDING_OPS = {aten.embedding.default}
SUM_OPS = {aten.add.Tensor}


def embedding_lookups(
    gm: fx.GraphModule, data: fx.Node, norm_nodes: set[fx.Node]
) -> tuple[list[fx.Node] | None, str]:
    """The embedding lookups whose sum is ``data`` (a norm's input), each with a table no other
    node reads, with nothing else reading the sum or its parts; else None and the reason ("" if
    no lookup is summed there at all: nothing to explain)."""
    leaves, inner = _summands(data)
    if not any(_is_lookup(leaf) for leaf in leaves):
        return None, ""
    if len(set(leaves)) != len(leaves):  # x + x: its table would be scaled once, not twice
        return None, "the sum adds a lookup more than once"
    readers = norm_nodes | set(inner)
    for node in [*inner, *leaves]:
        others = [u for u in node.users if u not in readers and u.target not in SHAPE_ONLY_OPS]
        if others:
            return None, f"{node.name} is also read by {others[0].name}"
    for leaf in leaves:
        if not _is_lookup(leaf):
            return None, f"the sum also adds {leaf.name} ({leaf.target}), not a lookup"
        table = leaf.args[0]
        if not isinstance(table, fx.Node) or table.op != "get_attr":
            return None, f"{module_path(leaf)} looks up a computed table"
        if _table_reads(gm, str(table.target)) != 1:
            return None, f"{module_path(leaf)} shares its table ({table.target})"
    return leaves, ""


def _summands(data: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The terms of the sum ``data`` is (through Adds and identity ops) and the nodes between."""
    leaves: list[fx.Node] = []
    inner: list[fx.Node] = []
    frontier = [data]
    while frontier:
        node = frontier.pop()
        is_call = node.op == "call_function"
        parts = node.args[:2] if is_call and node.target in SUM_OPS and not node.kwargs else ()
        if is_call and node.target in IDENTITY_OPS:
            parts = node.args[:1]
        if parts and all(isinstance(p, fx.Node) for p in parts):
            inner.append(node)
            frontier.extend(parts)  # type: ignore[arg-type]
        else:
            leaves.append(node)
    return leaves, inner


def _is_lookup(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in EMBEDDING_OPS


def _table_reads(gm: fx.GraphModule, target: str) -> int:
    return sum(
        len(n.users) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) == target
    )


def fold_into_embeddings(
    gm: fx.GraphModule, lookups: list[fx.Node], scale: torch.Tensor, shift: torch.Tensor
) -> None:
    """Scale every lookup's table by ``scale`` and add ``shift`` to the first (float64 math,
    stored in each table's dtype)."""
    targets = [str(node.args[0].target) for node in lookups]  # type: ignore[union-attr]
    tables = [fetch_attr(gm, target) for target in targets]
    folded = fold_affine_into_embedding_tables([t.double() for t in tables], scale, shift)
    for target, table, new in zip(targets, tables, folded, strict=True):
        set_attr(gm, target, new.to(table.dtype))
