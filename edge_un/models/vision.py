"""Vision Transformer for small images (MNIST, digits), any norm kind."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..norms import make_norm
from .blocks import Block, init_weights


class VisionTransformer(nn.Module):
    """ViT: conv patch embedding, pre-norm blocks, final norm, cls or mean pooling, linear head.

    ``config`` holds the constructor arguments, which is what a checkpoint records.
    """

    def __init__(
        self,
        img_size: int = 28,
        in_chans: int = 1,
        patch_size: int = 4,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: float = 2.0,
        num_classes: int = 10,
        pool: Literal["cls", "mean"] = "cls",
        norm: str = "un",
        norm_kwargs: dict[str, Any] | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if img_size % patch_size:
            raise InputError(
                f"img_size ({img_size}) must be divisible by patch_size ({patch_size})"
            )
        if pool not in ("cls", "mean"):
            raise InputError(f"pool must be 'cls' or 'mean', got {pool!r}")
        norm_kwargs = dict(norm_kwargs or {})
        self.config: dict[str, Any] = {
            "img_size": img_size, "in_chans": in_chans, "patch_size": patch_size, "dim": dim,
            "depth": depth, "heads": heads, "mlp_ratio": mlp_ratio, "num_classes": num_classes,
            "pool": pool, "norm": norm, "norm_kwargs": norm_kwargs, "bias": bias,
        }  # fmt: skip
        self.pool = pool
        num_patches = (img_size // patch_size) ** 2
        num_tokens = num_patches + (1 if pool == "cls" else 0)
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == "cls" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dim))
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio, norm, norm_kwargs, norm_first=True, bias=bias)
            for _ in range(depth)
        )
        self.norm = make_norm(norm, dim, **norm_kwargs)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        # Slicing, not x[:, 0]: a select exports as Gather.
        pooled = x[:, :1].flatten(1) if self.pool == "cls" else x.mean(dim=1)
        return self.head(pooled)
