"""The attention forms users' models are written in, each computing exactly what edge_un's own
:class:`~edge_un.models.blocks.Attention` computes, from its weights.

The fold and the int8 rewrites see an attention only as the exporter writes it, and the forms
in use differ in where the ``head_dim ** -0.5`` factor and the padding mask stand and how q, k
and v are projected. Each form here takes an ``Attention``'s parameters (the packed ``qkv``
Linear, or three Linears cut from it) so that a trained model rewritten in any form has the
same logits (to float rounding): a rewrite that changes the function is then visible as drift
on real data (``convert_in_form``), and a property of the rewritten float graph on any data.
For the tests
(tests/test_attention_forms.py) and the benchmark (benchmarks/conversion/attention_forms.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional

from edge_un import examples
from edge_un.checkpoint import load_checkpoint
from edge_un.models.blocks import Attention
from quant.pipeline import convert
from quant.report import Report
from quant.samples import checkpoint_samples
from quant.targets import resolve_targets

Form = Literal[
    "q_scaled",  # (q * scale) @ k^T: edge_un's own, HF ViT's exports
    "k_scaled",  # q @ (k * scale)^T
    "scores_scaled",  # timm, DeiT, T2T-ViT: packed qkv unbound, (q @ k^T) * scale
    "scores_divided",  # HF BERT: separate q, k, v Linears, (q @ k^T) / sqrt(head_dim)
    "sdpa",  # torch's scaled_dot_product_attention, the mask as its attn_mask
    "mask_before_scale",  # (q @ k^T + mask / scale) * scale: the mask inside the scaled sum
]
FORMS: tuple[Form, ...] = (
    "q_scaled", "k_scaled", "scores_scaled", "scores_divided", "sdpa", "mask_before_scale",
)  # fmt: skip
# forms that differ from another only where a padding mask is added: a vision model has none
MASK_FORMS: frozenset[Form] = frozenset({"mask_before_scale"})


class FormAttention(nn.Module):
    """An :class:`Attention`'s weights in one of the ``FORMS``; the same forward signature."""

    def __init__(self, attention: Attention, form: Form) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"unknown attention form {form!r}; choose from {', '.join(FORMS)}")
        self.form, self.heads, self.head_dim = form, attention.heads, attention.head_dim
        self.scale = attention.scale
        self.proj = copy.deepcopy(attention.proj)
        if form == "scores_divided":  # three Linears cut from the packed one
            self.query, self.key, self.value = (
                _linear_part(attention.qkv, part) for part in range(3)
            )
        else:
            self.qkv = copy.deepcopy(attention.qkv)

    def forward(self, x: Tensor, key_bias: Tensor | None = None) -> Tensor:
        q, k, v = self._project(x)
        mask = None if key_bias is None else key_bias[:, None, None, :]
        if self.form == "sdpa":
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = self._scores(q, k, mask).softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).flatten(2))

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as (batch, heads, tokens, head_dim)."""
        if self.form == "scores_divided":
            return tuple(self._heads(linear(x)) for linear in (self.query, self.key, self.value))
        if self.form == "scores_scaled":  # timm: one reshape and permute, then unbind
            batch, tokens, _ = x.shape
            qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, self.head_dim)
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return tuple(self._heads(t) for t in self.qkv(x).chunk(3, dim=-1))

    def _scores(self, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        if self.form == "q_scaled":
            scores = (q * self.scale) @ k.transpose(-2, -1)
        elif self.form == "k_scaled":
            scores = q @ (k * self.scale).transpose(-2, -1)
        elif self.form == "scores_divided":
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        elif self.form == "mask_before_scale":
            scores = q @ k.transpose(-2, -1)
            if mask is not None:  # the mask scaled up so that the scaled sum masks as before
                scores = scores + mask / self.scale
            return scores * self.scale
        else:  # scores_scaled
            scores = (q @ k.transpose(-2, -1)) * self.scale
        return scores if mask is None else scores + mask

    def _heads(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)


def _linear_part(packed: nn.Linear, part: int) -> nn.Linear:
    """The ``part``-th third of a packed qkv Linear's outputs, as a Linear of its own."""
    size = packed.out_features // 3
    linear = nn.Linear(packed.in_features, size, bias=packed.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(packed.weight[part * size : (part + 1) * size])
        if packed.bias is not None:
            linear.bias.copy_(packed.bias[part * size : (part + 1) * size])
    return linear


def with_attention_form(model: nn.Module, form: Form) -> nn.Module:
    """A copy of ``model`` whose every :class:`Attention` is written in ``form``."""
    rewritten = copy.deepcopy(model)
    blocks = [m for m in rewritten.modules() if isinstance(getattr(m, "attn", None), Attention)]
    for block in blocks:
        block.attn = FormAttention(block.attn, form)
    return rewritten.eval()


def convert_in_form(
    example: str, form: Form, targets: Sequence[str], scratch: Path, evaluation: int | None = None
) -> Report:
    """A bundled trained example (``vit-mnist-un``, ``text-rt-un``...) rewritten in ``form``,
    brought as a user brings a model from elsewhere: a ``torch.export`` program (.pt2, a
    dynamic batch) with calib.npz (128 training samples) and eval.npz (the first
    ``evaluation`` held-out samples, all by default), converted for ``targets``."""
    model, info = load_checkpoint(examples.path(example))
    calibration = checkpoint_samples(info, "train", 128)
    test = checkpoint_samples(info, "test")
    test = test if evaluation is None else test.head(evaluation)
    example_input = torch.from_numpy(calibration.inputs[:2])
    batch = {0: torch.export.Dim("batch", min=1, max=1024)}
    rewritten = with_attention_form(model, form)
    program = torch.export.export(rewritten, (example_input,), dynamic_shapes=(batch,))
    torch.export.save(program, scratch / "model.pt2")
    np.savez(scratch / "calib.npz", inputs=calibration.inputs)
    np.savez(scratch / "eval.npz", inputs=test.inputs, labels=test.labels)
    return convert(
        scratch / "model.pt2", targets=resolve_targets(targets), calib=scratch / "calib.npz",
        eval=scratch / "eval.npz", out_dir=scratch / "out", latency_runs=3,
    )  # fmt: skip
