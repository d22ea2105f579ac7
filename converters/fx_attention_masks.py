"""Attention masks int8 can carry, in a torch program: float32-min fills bounded to a penalty.

The same rule as :mod:`converters.attention_masks` applies to the ONNX export (read its
docstring for why): a Hugging Face model adds ``(1 - mask) * finfo(float32).min`` to the
attention scores, and in int8 that tensor's grid must span 3.4e38, so every real score rounds to
zero. Here, in the folded program that the TFLite targets' direct route converts, each scalar
constant at or below ``MASKED_AT_MOST`` that a mask is built from (the factor of a ``mul``, the
fill of a ``masked_fill``/``where``/``full``) becomes ``MASK_PENALTY``: the mask then holds 0
and -30, as the rewritten ONNX file's does, and the softmax is unchanged in fp32 (e^-30). A
boolean mask handed to ``scaled_dot_product_attention`` becomes that additive mask, or, when it
masks nothing whatever the input (transformers 5's ViT builds one from ``arange``), is dropped.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .attention_masks import MASK_PENALTY, MASKED_AT_MOST
from .fx_constants import constant_value, input_free_nodes

_aten = torch.ops.aten
# The ops a mask is built with, and which of their arguments is the fill or factor.
MASK_OPS = {
    _aten.mul.Tensor: (1,),
    _aten.mul.Scalar: (1,),
    _aten.masked_fill.Scalar: (2,),
    _aten.where.ScalarOther: (2,),
    _aten.where.ScalarSelf: (1,),
    _aten.where.Scalar: (1, 2),
    _aten.full.default: (1,),
    _aten.full_like.default: (1,),
    _aten.fill.Scalar: (1,),
}


def bound_program_masks(module: GraphModule) -> int:
    """Bound every mask of ``module`` in place; how many masks or fills changed."""
    changed = _additive_sdpa_masks(module)
    for node in module.graph.nodes:
        positions = MASK_OPS.get(node.target) if node.op == "call_function" else None
        for position in positions or ():
            value = node.args[position] if position < len(node.args) else None
            if isinstance(value, float) and value <= MASKED_AT_MOST:
                node.args = (*node.args[:position], MASK_PENALTY, *node.args[position + 1 :])
                changed += 1
    if changed:
        module.graph.lint()
        module.recompile()
    return changed


def _additive_sdpa_masks(module: GraphModule) -> int:
    """A boolean ``attn_mask`` of ``scaled_dot_product_attention`` (transformers 5 passes one)
    as the additive mask it stands for, ``where(mask, 0, MASK_PENALTY)``: the converter would
    otherwise fill the masked scores with float32-min inside the attention."""
    changed = 0
    free = input_free_nodes(module.graph)  # once: a rewrite adds nodes, no mask's ancestor changes
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target != _aten.scaled_dot_product_attention.default:
            continue
        mask, in_kwargs = _mask_argument(node)
        value = getattr(mask, "meta", {}).get("val")
        if value is None or value.dtype != torch.bool:
            continue
        if _masks_nothing(mask, free):
            additive = None  # a model without padding (transformers 5's ViT)
        else:
            with module.graph.inserting_before(node):
                additive = module.graph.call_function(_aten.where.Scalar, (mask, 0.0, MASK_PENALTY))
        if in_kwargs:
            node.kwargs = {**node.kwargs, "attn_mask": additive}
        else:
            node.args = (*node.args[:3], additive, *node.args[4:])
        changed += 1
    if changed:
        module.graph.eliminate_dead_code()  # a dropped mask's own ops
    return changed


def _masks_nothing(mask: torch.fx.Node, free: set[torch.fx.Node]) -> bool:
    """Whether a boolean mask is True everywhere whatever the input. An ``expand`` only repeats
    its input's values (its size may follow the input's batch): the values before it decide."""
    while mask.op == "call_function" and mask.target == _aten.expand.default:
        mask = mask.args[0]
    value = constant_value(mask, free)
    return value is not None and bool(value.all())


def _mask_argument(node: torch.fx.Node) -> tuple[object, bool]:
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"], True
    return (node.args[3] if len(node.args) > 3 else None), False
