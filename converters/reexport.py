"""A traced (folded) graph made safe to export again: attention as its formula, views as
reshapes.

``torch.export`` records ``aten.view`` where a reshape met a tensor whose strides allowed it at
trace time. Strides are not values: an op the ONNX exporter later decomposes may produce the
same values with other strides. HF Swin is the case: the strides torch's CPU attention kernel
gives ``scaled_dot_product_attention``'s output make its ``transpose(1, 2).reshape(...)`` a view;
the math the exporter decomposes attention into does not, and the export fails with "Cannot view
a tensor ... as ...". So before a graph is exported again:

* every ``scaled_dot_product_attention`` becomes its formula, written as the ONNX exporter's own
  translation writes it (``q * sqrt(scale)`` and ``k^T * sqrt(scale)``, MatMul, the mask added,
  Softmax, MatMul; a boolean mask as 0 / the dtype's minimum, fully masked rows 0): the same
  ONNX graph, from strides that never change again;
* every ``view`` becomes a ``reshape``: the same values, and the export decides from the strides
  it then sees whether that is a view or a copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, fx

from .graph import aten

VIEW_OPS = {aten.view.default, aten._unsafe_view.default}


def prepare_for_reexport(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; returns how many nodes changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.scaled_dot_product_attention.default:
            node.target = attention_formula
            changed += 1
        elif node.target in VIEW_OPS:
            node.target = aten.reshape.default
            changed += 1
    if changed:
        gm.recompile()
    return changed


def attention_formula(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` in eval (no dropout), as torch's
    ``scaled_dot_product_attention`` defines it."""
    factor = math.sqrt(1 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scores = torch.matmul(query * factor, key.transpose(-2, -1) * factor)
    if is_causal:  # as the exporter writes it: 0 on and below the diagonal, -inf above
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        attn_mask = torch.zeros(causal.shape, dtype=scores.dtype).masked_fill(~causal, -math.inf)
    if attn_mask is None:
        return torch.matmul(torch.softmax(scores, dim=-1), value)
    if attn_mask.dtype != torch.bool:
        return torch.matmul(torch.softmax(scores + attn_mask, dim=-1), value)
    lowest = torch.finfo(scores.dtype).min
    bias = torch.where(attn_mask, 0.0, lowest).to(scores.dtype)
    weights = torch.softmax(scores + bias, dim=-1)
    weights = torch.where(torch.isnan(weights), 0.0, weights)
    return torch.matmul(weights, value)
