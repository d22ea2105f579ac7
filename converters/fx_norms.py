"""Where the norms are in a torch.export (aten-level) fx graph, each described as a
:class:`~.fold_graph.Norm`.

Two kinds of site. A call of one of edge_un's norm classes is found by its module call
(``nn_module_stack``), not by attribute names, so any model works; its ``(scale, shift)`` is
read from the traced chain itself, which is what ``edge_un.OfflineNorm.affine()`` computes, so
a saved ``.pt2`` whose classes are never imported folds the same as a live model. Any other
frozen per-channel affine is a run of affine steps (:mod:`.fx_affine_runs`) in whatever module
and layout it stands: the UN authors' ``UN1d``, or one of ours written in that layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx

from .equations import compose_affine_chain
from .errors import ConversionError
from .fold_graph import Norm
from .fx_affine_runs import affine_runs, run_affine
from .graph import (
    AFFINE_OPS,
    ASSERT_OPS,
    IDENTITY_OPS,
    RESHAPE_OPS,
    SHAPE_ONLY_OPS,
    Constants,
    aten,
    module_call,
    module_path,
    offline_norm_classes,
    shape,
)

# What a norm class's call may compute besides its affine steps: layout and shape reads only.
LAYOUT_OPS = {
    *RESHAPE_OPS,
    *IDENTITY_OPS,
    *SHAPE_ONLY_OPS,
    aten.permute.default,
    aten.transpose.int,
}


def norm_sites(gm: fx.GraphModule, constants: Constants) -> list[Any]:
    """Each call of one of edge_un's norm classes (its key) and every other run of affine
    steps (its nodes: a frozen norm of any other code), in graph order."""
    classes = offline_norm_classes()
    keys: dict[str, None] = {}
    order: dict[Any, int] = {}
    for index, node in enumerate(gm.graph.nodes):
        call = module_call(node) if node.op == "call_function" else None
        if call and call[2] in classes:
            keys[call[0]] = None
            order.setdefault(call[0], index)
        order[node] = index
    # the nodes of our norms' calls are theirs: a run never reaches into one
    free = [n for n in gm.graph.nodes if (module_call(n) or ("",))[0] not in keys]
    runs = affine_runs(free, constants)
    return sorted(
        [*keys, *runs], key=lambda site: order[site if isinstance(site, str) else site[0]]
    )


def describe_norm(gm: fx.GraphModule, constants: Constants, site: Any) -> Norm | None:
    """A class's call: the chain ``input -> (mul/add/... by constants) -> output``, or the one
    run of affine steps in it when the rest is layout (written as the UN authors lay it out);
    any other run as itself (None unless it is a norm)."""
    if not isinstance(site, str):
        return _describe_run(gm, constants, site, None)
    try:
        return _describe_call(gm, constants, site)
    except ConversionError:
        nodes = [n for n in gm.graph.nodes if (module_call(n) or ("",))[0] == site]
        runs = affine_runs(nodes, constants)
        rest = [n for n in nodes if not constants.is_const(n) and n.target not in ASSERT_OPS]
        if len(runs) != 1 or any(n.target not in LAYOUT_OPS for n in rest if n not in runs[0]):
            raise
        return _describe_run(gm, constants, runs[0], module_call(nodes[0]))


def _describe_run(
    gm: fx.GraphModule,
    constants: Constants,
    run: tuple[fx.Node, ...],
    call: tuple[str, str, str] | None,
) -> Norm | None:
    """A run of affine steps as a norm, named by its module, of its class's kind if edge_un's;
    None unless it is one (:func:`~.affine_chains.chain_affine`)."""
    if any(node.graph is not gm.graph for node in run):
        return None
    found = run_affine(run, constants)
    if found is None:
        return None
    data, affine = found
    call = call or module_call(run[0])
    norms = offline_norm_classes()
    kind = norms[call[2]].kind if call and call[2] in norms else "affine"
    return Norm(
        module_path(run[0]), kind, run, data, run[-1], affine.scale, affine.shift, affine.axis
    )


def _describe_call(gm: fx.GraphModule, constants: Constants, site: str) -> Norm:
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and (module_call(n) or ("",))[0] == site
    ]
    _, path, cls = module_call(nodes[0])  # type: ignore[misc]
    scope = set(nodes)
    # Constants computed in one call and reused by the next (a shared norm, traced once
    # per call) are not outputs.
    outputs = [
        n for n in nodes if not constants.is_const(n) and any(u not in scope for u in n.users)
    ]
    if len(outputs) != 1:
        raise ConversionError(f"norm {path} has {len(outputs)} outputs in the graph, expected 1")
    chain: list[fx.Node] = []
    node = outputs[0]
    while node in scope:
        chain.append(node)
        data = [a for a in node.all_input_nodes if not constants.is_const(a)]
        if node.op != "call_function" or len(data) != 1:
            raise ConversionError(f"norm {path} is not a per-channel affine (exported in eval?)")
        node = data[0]
    chain.reverse()
    extra = [
        n
        for n in nodes
        if not constants.is_const(n) and n not in chain and n.target not in ASSERT_OPS
    ]
    if extra:
        raise ConversionError(f"norm {path} computes more than x * scale + shift: {extra[0]}")
    dims = shape(outputs[0])
    if not dims:
        raise ConversionError(f"norm {path}: no shape recorded for its output")
    scale, shift = _chain_affine(constants, chain, node, dims[-1], path)
    kind = offline_norm_classes()[cls].kind
    return Norm(path, kind, tuple(nodes), node, outputs[0], scale, shift)


def _chain_affine(
    constants: Constants, chain: list[fx.Node], data: fx.Node, channels: int, path: str
) -> tuple[Tensor, Tensor]:
    """The chain's elementwise ops by constants as one ``(scale, shift)`` in float64."""
    steps = []
    for node in chain:
        op = AFFINE_OPS.get(node.target)  # type: ignore[arg-type]
        if node.target not in IDENTITY_OPS:
            if op is None or (op in ("add", "sub") and node.kwargs.get("alpha", 1) != 1):
                raise ConversionError(f"norm {path}: {node.target} is not a per-channel affine op")
            data_first = node.args[0] is data
            constant = constants.value(node.args[1] if data_first else node.args[0])
            steps.append((op, torch.as_tensor(constant), data_first))
        data = node
    try:
        return compose_affine_chain(steps, channels)
    except ValueError as error:
        raise ConversionError(f"norm {path}: {error}") from None
