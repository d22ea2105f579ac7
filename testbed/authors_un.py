"""Models as other code writes them, for the fold's tests and benchmarks (issue 66).

* The UN authors' ``UN1d`` in eval, built from its description: for ``x`` of shape
  ``(B, N, C)``, ``x.permute(0, 2, 1)`` -> reshape to ``(B, C, N, 1)`` -> ``x / sqrt(running_var
  + eps)`` (no mean subtracted) -> ``weight * x + bias`` (both ``(1, C, 1, 1)``) -> reshape back
  -> ``permute(0, 2, 1)``; its state dict holds ``weight``, ``bias``, ``running_var``,
  ``ema_gz``, ``iters``, ``buffer_x2``, ``buffer_gz``, ``skip_counter``.
  :func:`in_authors_layout` puts one, with the same state, in place of every UnifiedNorm.
* Hugging Face's BERT embeddings as transformers 4.x wrote them, adding the position rows in
  place (``embeddings += position_embeddings``: ``aten.add_.Tensor`` in a program):
  :func:`with_in_place_embeddings`.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch import Tensor, nn

from edge_un.norms import UnifiedNorm


class AuthorsUN1d(nn.Module):
    """Eval only: the authors' training forward is not what an exported program holds."""

    def __init__(self, channels: int, window_size: int = 4, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.register_buffer("running_var", torch.ones(1, channels, 1, 1))
        self.register_buffer("ema_gz", torch.zeros(1, channels, 1, 1))
        self.register_buffer("iters", torch.zeros(1, dtype=torch.long))
        self.register_buffer("buffer_x2", torch.zeros(window_size, channels))
        self.register_buffer("buffer_gz", torch.zeros(window_size, channels))
        self.register_buffer("skip_counter", torch.zeros(1, dtype=torch.long))

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        b, n, c = x.shape
        x = x.permute(0, 2, 1).reshape(b, c, n, 1)
        x = x / torch.sqrt(self.running_var + self.eps)
        x = self.weight * x + self.bias
        return x.reshape(b, c, n).permute(0, 2, 1)


def in_authors_layout(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (eval) with every UnifiedNorm an :class:`AuthorsUN1d` holding its
    state: the same function, in the authors' layout and names."""
    model = copy.deepcopy(model).eval()
    for path, norm in list(model.named_modules()):
        if not isinstance(norm, UnifiedNorm):
            continue
        authors = AuthorsUN1d(norm.num_features, norm.window_size, norm.eps)
        with torch.no_grad():
            for name, ours in (("weight", "weight"), ("bias", "bias"),
                               ("running_var", "running_var"), ("ema_gz", "ema_g")):  # fmt: skip
                getattr(authors, name).copy_(getattr(norm, ours).reshape(1, -1, 1, 1))
            authors.iters.copy_(norm.num_steps.reshape(1))
            authors.buffer_x2.copy_(norm.window_x2)
            authors.buffer_gz.copy_(norm.window_g)
            authors.skip_counter.copy_(norm.num_filtered.reshape(1))
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, name, authors.eval())
    return model


def with_in_place_embeddings(model: nn.Module) -> nn.Module:
    """A copy of a Hugging Face BERT whose embeddings add their rows in place, as
    transformers 4.x did (``embeddings += position_embeddings``)."""
    model = copy.deepcopy(model).eval()
    for module in model.modules():
        if type(module).__name__ == "BertEmbeddings":
            module.forward = types.MethodType(_in_place_forward, module)
    return model


def _in_place_forward(
    self: Any,
    input_ids: Tensor | None = None,
    token_type_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    past_key_values_length: int = 0,
) -> Tensor:
    embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    length = embeddings.shape[1]
    if position_ids is None:
        position_ids = self.position_ids[
            :, past_key_values_length : length + past_key_values_length
        ]
    if token_type_ids is None:
        token_type_ids = torch.zeros(embeddings.shape[:2], dtype=torch.long)
    embeddings += self.token_type_embeddings(token_type_ids)
    embeddings += self.position_embeddings(position_ids)
    return self.dropout(self.LayerNorm(embeddings))
