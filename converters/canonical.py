"""One form for every traced program before the fold rules match it, and what was rewritten.

Exporters write the same arithmetic in different ops. ``torch.export`` keeps a model's in-place
ops (Hugging Face's embeddings add their position rows with ``+=``: ``aten.add_.Tensor``),
where the rules know ``aten.add.Tensor``; it keeps ``rsub`` (``c - x``) whole, where the rules
know a ``sub``. Each is rewritten to the functional op it computes, exactly, so a model folds
the same from a .pt2 as from an ONNX file (which has no in-place ops). An in-place op on a
graph input, a parameter or buffer, or a tensor that some view shares is left as it is: there
the mutation is seen elsewhere.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

aten = torch.ops.aten
RSUB = {aten.rsub.Scalar, aten.rsub.Tensor}


def canonicalize(gm: fx.GraphModule) -> tuple[str, ...]:
    """Rewrite ``gm`` in place; returns ``"aten.add_.Tensor -> aten.add.Tensor (2)"`` per kind
    of rewrite (empty when the program was in canonical form already)."""
    rewritten: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        functional = functional_op(node.target)
        if functional is not None and _owns_its_data(node):
            _functionalize(gm.graph, node, functional)
            rewritten[f"{node.target} -> {functional}"] += 1
        elif node.target in RSUB and len(node.args) == 2 and not node.kwargs:
            _rsub_as_affine(gm.graph, node)
            rewritten[f"{node.target} -> aten.mul.Tensor, aten.add.Tensor"] += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return tuple(f"{what} ({count})" for what, count in rewritten.items())


def functional_op(target: object) -> torch._ops.OpOverload | None:
    """The functional op of an in-place aten op (``add_.Tensor`` -> ``add.Tensor``), else None."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    name = schema.name.split("::")[-1]
    if first is None or not first.is_write or not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None for r in target._schema.returns)


def _owns_its_data(node: fx.Node) -> bool:
    """The mutated tensor is computed in the graph, is no view, and no view of it exists: the
    mutation is seen only by who reads it later."""
    mutated = node.args[0] if node.args else None
    if not isinstance(mutated, fx.Node) or mutated.op != "call_function" or _is_view(mutated):
        return False
    return not any(_is_view(user) for user in mutated.users if user is not node)


def _functionalize(graph: fx.Graph, node: fx.Node, functional: torch._ops.OpOverload) -> None:
    """``node`` as its functional op; what read the mutated tensor after it reads the result."""
    mutated: fx.Node = node.args[0]  # type: ignore[assignment]
    order = {n: index for index, n in enumerate(graph.nodes)}
    later = [user for user in mutated.users if order[user] > order[node]]
    with graph.inserting_before(node):
        result = graph.call_function(functional, node.args, node.kwargs)
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    for user in later:
        user.replace_input_with(mutated, result)
    graph.erase_node(node)


def _rsub_as_affine(graph: fx.Graph, node: fx.Node) -> None:
    """``rsub(x, c) = c - x`` as ``x * -1 + c``: two steps the affine rules read."""
    data, constant = node.args
    with graph.inserting_before(node):
        negated = graph.call_function(aten.mul.Tensor, (data, -1))
        result = graph.call_function(aten.add.Tensor, (negated, constant))
    negated.meta, result.meta = dict(node.meta), dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
