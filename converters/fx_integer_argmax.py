"""An argmax over integers as a top-1, in a torch program: Vela refuses the whole model otherwise.

Vela's TFLite semantic checks take an ARG_MAX only with an 8-bit input, and a model that has
one with any other input does not compile at all (``ARGMAX ... Does not have valid TFLite
Semantics``), not even with the op left to the Cortex-A. An integer argmax is how Hugging Face's
GPT-2 classifier finds the last token that is not padding (``(positions * not_pad).argmax(-1)``),
an int32 ARG_MAX in LiteRT. ``topk(x, 1, dim).indices`` is the same index (the first of equal
values: TFLite's TOPK_V2 puts the lower index first, as torch's argmax does) and Vela leaves
TOPK_V2 to the Cortex-A. A float argmax is left alone: it is quantized to int8, which Vela takes.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

_aten = torch.ops.aten


def integer_argmax_as_top1(module: GraphModule) -> int:
    """Rewrite every ``argmax`` of an integer tensor along one dim in place; how many."""
    changed = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target != _aten.argmax.default:
            continue
        source, dim, keepdim = _argmax_arguments(node)
        value = getattr(source, "meta", {}).get("val")
        if dim is None or value is None or value.dtype.is_floating_point:
            continue
        if value.dtype == torch.bool:  # topk takes no bool: left as it is
            continue
        graph = module.graph
        with graph.inserting_before(node):
            top = graph.call_function(_aten.topk.default, (source, 1, dim))
            index = graph.call_function(operator.getitem, (top, 1))
            if not keepdim:
                index = graph.call_function(_aten.squeeze.dim, (index, dim))
        node.replace_all_uses_with(index)
        graph.erase_node(node)
        changed += 1
    if changed:
        module.graph.lint()
        module.recompile()
    return changed


def _argmax_arguments(node: torch.fx.Node) -> tuple[torch.fx.Node, int | None, bool]:
    args = (*node.args, None, False)[:3]
    dim = node.kwargs.get("dim", args[1])
    keepdim = node.kwargs.get("keepdim", args[2])
    return args[0], dim, bool(keepdim)
