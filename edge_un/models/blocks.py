"""Transformer building blocks written for export: chunked qkv, explicit attention, GELU.

Nothing here branches on data in eval mode, and nothing indexes a packed tensor (indexing
exports as Gather, which Ethos-U cannot run; ``chunk`` exports as Split).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..norms import make_norm

# Added to the attention score of a padded key. Bounded on purpose: exp(-30) ~ 1e-13 removes the
# key in fp32 as completely as float32-min did, but an int8 quantizer calibrating the scores sees
# a range of tens, not 3.4e38 (which gave the scores an int8 scale of 1.3e36 and uniform
# attention). A row whose keys are all padded stays finite (uniform weights).
MASK_PENALTY = 30.0


def padding_bias(pad_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, N) bool, True at padding -> additive bias, 0 at tokens and -MASK_PENALTY at padding.

    Computed once per forward with a select of two constants (one Where node), not a cast of the
    mask (a bool->float Cast stays float in a full-int8 TFLite file)."""
    zero = torch.zeros((), dtype=dtype, device=pad_mask.device)
    return torch.where(pad_mask, zero - MASK_PENALTY, zero)


def init_weights(module: nn.Module) -> None:
    """Truncated-normal Linear weights (std 0.02) and zero biases, as in ViT/BERT."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class Attention(nn.Module):
    """Multi-head self-attention with one packed qkv projection split by ``chunk``."""

    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise InputError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor, key_bias: Tensor | None = None) -> Tensor:
        """``key_bias`` (B, N) is added to every query's score for each key: 0 for a real token,
        ``-MASK_PENALTY`` for padding (see :func:`padding_bias`)."""
        q, k, v = (self._split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q * self.scale) @ k.transpose(-2, -1)
        if key_bias is not None:
            scores = scores + key_bias[:, None, None, :]
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).flatten(2))

    def _split_heads(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Transformer block, pre-norm (``norm_first=True``) or post-norm."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        norm: str,
        norm_kwargs: dict[str, Any],
        norm_first: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = make_norm(norm, dim, **norm_kwargs)
        self.attn = Attention(dim, heads, bias=bias)
        self.norm2 = make_norm(norm, dim, **norm_kwargs)
        self.mlp = Mlp(dim, round(dim * mlp_ratio), bias=bias)

    def forward(
        self, x: Tensor, pad_mask: Tensor | None = None, key_bias: Tensor | None = None
    ) -> Tensor:
        """``pad_mask`` keeps padding out of norm statistics, ``key_bias`` out of attention."""
        if self.norm_first:
            x = x + self.attn(self.norm1(x, pad_mask), key_bias)
            return x + self.mlp(self.norm2(x, pad_mask))
        x = self.norm1(x + self.attn(x, key_bias), pad_mask)
        return self.norm2(x + self.mlp(x), pad_mask)
