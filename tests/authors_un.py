"""A small pre-norm ViT whose every norm is the UN authors' ``UN1d`` (built from its
description: :mod:`testbed.authors_un`), the same written with edge_un's UnifiedNorm laid out
as the authors lay it out, and an in-place-embeddings model for the canonical form (issue 66).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edge_un.norms import UnifiedNorm
from testbed.authors_un import AuthorsUN1d

__all__ = ["AuthorsUN1d", "AuthorsViT", "InPlaceEmbeddings", "LaidOutUnifiedNorm"]


class Block(nn.Module):
    def __init__(self, dim: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm1, self.qkv, self.proj = norm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2, self.fc1, self.fc2 = norm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.scale = dim**-0.5

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attention = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        x = x + self.proj(attention @ v)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class AuthorsViT(nn.Module):
    """Patches in, logits out: 2 pre-norm blocks and a final norm, 5 norms in all."""

    def __init__(self, norm: type[nn.Module] = AuthorsUN1d, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(12, dim)
        self.blocks = nn.ModuleList(Block(dim, norm) for _ in range(depth))
        self.norm, self.head = norm(dim), nn.Linear(dim, 5)

    def forward(self, patches: Tensor) -> Tensor:
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def trained_looking(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every AuthorsUN1d given statistics and an affine far from the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AuthorsUN1d):
                shape = module.weight.shape
                module.running_var.copy_(torch.rand(shape, generator=generator) * 3 + 0.2)
                module.weight.copy_(torch.rand(shape, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(shape, generator=generator) * 0.3)
                module.iters.fill_(120)
    return model.eval()


class InPlaceEmbeddings(nn.Module):
    """Word + position rows added in place, as Hugging Face's embeddings have (``+=``: an
    ``aten.add_.Tensor`` in the program), then a UN; its output is read by the head and by a
    sum, so only the fold into the tables is open to it."""

    def __init__(self, vocab: int = 30, length: int = 6, dim: int = 8) -> None:
        super().__init__()
        self.word, self.position = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.norm, self.head = UnifiedNorm(dim), nn.Linear(dim, 3)
        with torch.no_grad():
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.word(ids)
        x += self.position(torch.arange(ids.shape[1]))
        hidden = self.norm(x)
        return self.head(hidden.mean(1)) + hidden.sum((1, 2)).unsqueeze(-1)


class LaidOutUnifiedNorm(UnifiedNorm):
    """edge_un's own UnifiedNorm with its eval affine written in the authors' layout."""

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        if self.training:
            return super().forward(x, pad_mask)
        b, n, c = x.shape
        scale, shift = (v.reshape(1, c, 1, 1) for v in self.affine())
        y = x.permute(0, 2, 1).reshape(b, c, n, 1) * scale + shift
        return y.reshape(b, c, n).permute(0, 2, 1)
