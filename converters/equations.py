"""The fusion equations of Algorithm 1, one per function, on plain tensors.

A per-channel affine ``y = x * s + t`` folds into a neighbouring Linear or Conv (in the style of
``torch.nn.utils.fusion.fuse_linear_bn_weights``). Weights are ``(out, in, ...)`` as in torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def fold_affine_into_following_linear(
    weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor
) -> tuple[Tensor, Tensor]:
    """``W (x * s + t) + b = (W * s[None, :]) x + (b + W @ t)``. A missing bias becomes one."""
    new_bias = weight @ shift if bias is None else bias + weight @ shift
    return weight * scale[None, :], new_bias


def fold_affine_into_preceding_linear(
    weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor
) -> tuple[Tensor, Tensor]:
    """``(W x + b) * s + t = (s[:, None] * W) x + (s * b + t)``; also Conv, per output channel."""
    per_out_channel = scale.reshape(-1, *([1] * (weight.dim() - 1)))
    new_bias = shift if bias is None else scale * bias + shift
    return per_out_channel * weight, new_bias


def compose_affine(
    scale: Tensor, shift: Tensor, op: str, constant: Tensor, data_first: bool = True
) -> tuple[Tensor, Tensor]:
    """Apply one elementwise op with a constant to ``x * scale + shift``; returns the new pair.

    ``data_first`` is False when the constant is the left operand (``c - x``, ``c / x``).
    """
    if op == "mul":
        return scale * constant, shift * constant
    if op == "add":
        return scale, shift + constant
    if op == "sub":
        return (scale, shift - constant) if data_first else (-scale, constant - shift)
    if op == "div" and data_first:
        return scale / constant, shift / constant
    raise ValueError(f"{op!r} with the data as operand {'1' if data_first else '2'} is not affine")


def compose_affine_chain(
    steps: Sequence[tuple[str, Tensor, bool]], channels: int, axis: int = -1
) -> tuple[Tensor, Tensor]:
    """Elementwise steps ``(op, constant, data_first)`` applied in turn to ``x``, as one
    ``(scale, shift)`` of ``(channels,)`` in float64, the channels on ``axis`` (counted from the
    end: -1 is the last); ValueError if a step is not per channel."""
    scale = torch.ones(channels, dtype=torch.float64)
    shift = torch.zeros(channels, dtype=torch.float64)
    for op, constant, data_first in steps:
        vector = as_channel_vector(constant.to(torch.float64), channels, axis)
        scale, shift = compose_affine(scale, shift, op, vector, data_first)
    return scale, shift


def as_channel_vector(constant: Tensor, channels: int, axis: int = -1) -> Tensor:
    """A constant that broadcasts along axis ``axis`` only (counted from the end, as
    broadcasting aligns shapes: ``(1, C, 1, 1)`` on ``(B, C, N, 1)`` is axis -3), as a
    ``(channels,)`` vector."""
    shape = tuple(constant.shape)
    along = shape[axis] if len(shape) >= -axis else 1
    others = [size for i, size in enumerate(shape) if i != len(shape) + axis]
    if any(size != 1 for size in others) or along not in (1, channels):
        raise ValueError(f"constant of shape {shape} is not per-channel")
    return constant.reshape(-1).expand(channels) if constant.numel() == 1 else constant.reshape(-1)


def channel_axis(shape: Sequence[int]) -> int | None:
    """The one axis (counted from the end) along which a constant of ``shape`` varies; -1 when
    it varies along none (a scalar); None when it varies along more than one."""
    varying = [i - len(shape) for i, size in enumerate(shape) if size != 1]
    return -1 if not varying else varying[0] if len(varying) == 1 else None


def fold_affine_into_embedding_tables(
    tables: Sequence[Tensor], scale: Tensor, shift: Tensor
) -> list[Tensor]:
    """``(E_1[k_1] + ... + E_n[k_n]) * s + t = (E_1 * s + t)[k_1] + ... + (E_n * s)[k_n]``.

    Every lookup reads exactly one row of each table (``(rows, C)``, or a constant that
    broadcasts per channel), so scaling every table and adding the shift to the first is exact.
    """
    folded = [table * scale for table in tables]
    folded[0] = folded[0] + shift
    return folded
