"""When a chain of elementwise ops by constants is a frozen per-channel affine (a norm in eval):
decided once, for the torch.fx and the ONNX adapters alike.

A norm may stand in any layout: the UN authors' ``UN1d`` computes ``x / sqrt(running_var +
eps)`` and ``weight * x + bias`` on ``(B, C, N, 1)`` with ``(1, C, 1, 1)`` constants, edge_un's
own norms on ``(..., C)`` with ``(C,)`` ones. What makes a chain a norm is the same in both:
every constant varies along one and the same axis (counted from the end, as broadcasting aligns
shapes), by the data's size there, and the chain scales (a Mul or Div in it, some constant wider
than one channel): a chain that only adds is a bias, one by scalars only is GELU's or
attention's constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .equations import channel_axis, compose_affine_chain

Step = tuple[str, Tensor, bool]  # op ("mul", "add", "sub", "div"), constant, data first


@dataclass(frozen=True)
class ChainAffine:
    """A chain as ``x * scale + shift`` (float64, ``(C,)``), the channels on ``axis``."""

    scale: Tensor
    shift: Tensor
    axis: int


def is_per_channel(constant_shape: Sequence[int], data_rank: int) -> bool:
    """A constant that may be one step of a norm on data of rank ``data_rank``: it varies along
    at most one axis and adds no axis to the data."""
    return len(constant_shape) <= data_rank and channel_axis(constant_shape) is not None


def chain_affine(steps: Sequence[Step], data_shape: Sequence[Any]) -> ChainAffine | None:
    """The chain's ``(scale, shift)`` and channel axis when it is a norm on data of
    ``data_shape`` (sizes may be symbolic), else None."""
    wide = [tuple(c.shape) for _, c, _ in steps if c.numel() > 1]
    axes = {channel_axis(shape) for shape in wide}
    if len(axes) != 1 or None in axes:  # no constant wider than one channel, or two axes
        return None
    axis: int = axes.pop()  # type: ignore[assignment]
    widths = {shape[axis] for shape in wide if len(shape) >= -axis}
    if len(widths) != 1 or len(data_shape) < -axis:
        return None
    channels = widths.pop()
    size = data_shape[axis]
    if isinstance(size, int) and size != channels:
        return None  # the constants broadcast the data to more channels: not x * s + t
    if not any(op in ("mul", "div") for op, _, _ in steps):
        return None  # a bias: it only adds
    scale, shift = compose_affine_chain(
        [(op, c.to(torch.float64), first) for op, c, first in steps], channels, axis
    )
    return ChainAffine(scale, shift, axis)


def broadcast_shape(channels: int, axis: int) -> tuple[int, ...]:
    """The shape of a ``(C,)`` vector laid out to broadcast along ``axis`` (from the end)."""
    return (channels, *([1] * (-axis - 1)))
