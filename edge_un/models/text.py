"""Text classification Transformer with padding, any norm kind, pre- or post-norm."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..norms import make_norm
from .blocks import Block, init_weights, padding_bias


class TextTransformer(nn.Module):
    """Token + learned position embeddings, Transformer blocks, mean pooling over non-pad tokens.

    Tokens equal to ``pad_id`` are padding: excluded from every norm statistic, from attention
    (as keys) and from pooling. Pre-norm models end with a final norm; post-norm ones do not.
    """

    def __init__(
        self,
        vocab_size: int = 8000,
        max_len: int = 64,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: float = 2.0,
        num_classes: int = 2,
        norm_first: bool = True,
        norm: str = "un",
        norm_kwargs: dict[str, Any] | None = None,
        pad_id: int = 0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        norm_kwargs = dict(norm_kwargs or {})
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size, "max_len": max_len, "dim": dim, "depth": depth,
            "heads": heads, "mlp_ratio": mlp_ratio, "num_classes": num_classes,
            "norm_first": norm_first, "norm": norm, "norm_kwargs": norm_kwargs, "pad_id": pad_id,
            "bias": bias,
        }  # fmt: skip
        self.pad_id = pad_id
        self.max_len = max_len
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio, norm, norm_kwargs, norm_first=norm_first, bias=bias)
            for _ in range(depth)
        )
        self.norm = make_norm(norm, dim, **norm_kwargs) if norm_first else None
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.token_embed.weight, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.apply(init_weights)

    def forward(self, token_ids: Tensor) -> Tensor:
        pad_mask = token_ids == self.pad_id  # the norms' statistics skip padding (training)
        key_bias = padding_bias(pad_mask, self.pos_embed.dtype)
        x = self.token_embed(token_ids) + self.pos_embed[:, : token_ids.shape[1]]
        for block in self.blocks:
            x = block(x, pad_mask, key_bias)
        if self.norm is not None:
            x = self.norm(x, pad_mask)
        # Mean over the non-pad tokens written as a softmax of the padding bias: uniform weights
        # on the tokens (exp(-30) on padding), so no division by a token count, which has no
        # integer kernel on the NPUs. A sequence of padding only averages all its positions.
        weights = key_bias.softmax(dim=-1)
        pooled = (weights.unsqueeze(1) @ x).squeeze(1)
        return self.head(pooled)
