"""The layout round trip a folded norm leaves behind, removed.

The UN authors' ``UN1d`` reads ``(B, N, C)`` as ``(B, C, N, 1)`` (a transpose, then reshapes)
only to compute its affine there, and goes back (reshapes, a transpose). Once the affine is
folded away, the ops that went there and back meet and compute the identity, yet each is an op
on an NPU. Two exact rules remove them, on runs of one kind through the value where the norm
was: reshapes (reshape, view, unsqueeze, squeeze, flatten) in a row whose last output has the
shape of the first one's input (a row-major reshape of a row-major reshape is one reshape), and
transposes in a row whose permutations compose to the identity. Written once, on the
:class:`~.fold_graph.FoldGraph` interface, for torch.fx and ONNX alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .fold_graph import FoldGraph, Kind

LAYOUT_KINDS = (Kind.RESHAPE, Kind.TRANSPOSE)


def remove_round_trips(graph: FoldGraph, value: Any) -> int:
    """Remove every identity run of layout ops through ``value`` (and through what it is read
    as once one goes); returns how many ops were bypassed."""
    removed = 0
    while (found := _identity_run(graph, value)) is not None:
        start, end, count = found
        graph.reroute(end, start)
        value, removed = start, removed + count
    return removed


def _identity_run(graph: FoldGraph, value: Any) -> tuple[Any, Any, int] | None:
    """(input, output, length) of the longest run of one layout kind through ``value`` that
    computes the identity, or None. Ops in the run that other ops read too stay for those."""
    for kind in LAYOUT_KINDS:
        before = _ops_before(graph, value, kind)
        best: tuple[Any, Any, int] | None = None
        for after in _paths_after(graph, value, kind):
            nodes, junction = before + after, len(before)
            if not nodes:
                continue
            values = [graph.op(nodes[0]).inputs[0], *(graph.op(n).output for n in nodes)]
            for first in range(junction + 1):
                for last in range(max(junction, first + 1), len(values)):
                    longer = best is None or last - first > best[2]
                    run = nodes[first:last]
                    if longer and _is_identity(graph, kind, run, values[first], values[last]):
                        best = (values[first], values[last], last - first)
        if best is not None:
            return best
    return None


def _ops_before(graph: FoldGraph, value: Any, kind: Kind) -> list[Any]:
    """The ops of ``kind`` in a row that compute ``value``, each reading the previous one's."""
    before: list[Any] = []
    while (node := graph.producer(value)) is not None and graph.op(node).kind is kind:
        before.insert(0, node)
        value = graph.op(node).inputs[0]
    return before


def _paths_after(graph: FoldGraph, value: Any, kind: Kind, depth: int = 8) -> list[list[Any]]:
    """Every path of ops of ``kind`` in a row that read ``value`` as their data (the empty one
    included), up to ``depth`` ops long."""
    paths: list[list[Any]] = [[]]
    if depth == 0 or graph.is_output(value):
        return paths
    for reader in dict.fromkeys(graph.readers(value)):
        op = graph.op(reader)
        if op.kind is kind and op.inputs[0] is value:
            paths += [[reader, *rest] for rest in _paths_after(graph, op.output, kind, depth - 1)]
    return paths


def _is_identity(graph: FoldGraph, kind: Kind, nodes: Sequence[Any], start: Any, end: Any) -> bool:
    if not nodes or graph.is_output(end):
        return False
    if kind is Kind.RESHAPE:
        before, after = graph.shape(start), graph.shape(end)
        known = before is not None and all(_known(d) for d in before)
        return known and after is not None and list(map(str, before)) == list(map(str, after))
    axes: list[int] | None = None
    for node in nodes:  # out axis k of a transpose is its input's axis perm[k]
        perm = list(graph.op(node).axes)
        axes = perm if axes is None else [axes[p] for p in perm]
    return axes == sorted(axes or [])


def _known(dim: Any) -> bool:
    return dim is not None and str(dim) not in ("None", "?", "")
