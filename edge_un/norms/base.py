"""The offline-norm core shared by every method (the paper's unified framework, Sec. 3.1).

An offline norm normalises with statistics that do not have to be recomputed from the input at
inference, so in eval mode it is a frozen per-channel affine ``x * scale + shift``. During training
every method runs the same autograd function; a method is only a choice of two averaging functions:

* ``forward_statistics``: from this batch's statistics, which mean and variance to normalise
  with (the paper's Theta_mu and Theta_sigma2), and how the running statistics move;
* ``backward_statistics``: from this batch's gradient statistics, which ones the backward pass
  subtracts (Theta_g_mu and Theta_g_sigma2).

With z the normalised input and dz = weight * dy, the backward is
``dx = (dz - psi_mean - z * psi_var) / sqrt(var_hat + eps)``: exact batch statistics for both give
ordinary BatchNorm; smoothed ones give MABN, PowerNorm and Unified Normalization.

Statistics are taken over every non-pad position of the batch (shape ``(C,)``), or, for a method
with ``per_sample = True``, separately over each batch element's non-pad positions (shape
``(B, C)``): its averaging functions then return one mean/variance and one psi per sample, which
is how Online Normalization's per-sample recurrence over the batch fits the same core.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..errors import InputError
from .stats import group_tokens, masked_sum

# What forward_statistics hands to backward_statistics for the same step (method-specific).
StepState = Any


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics never run below float32: bfloat16/float16 -> float32, float64 stays."""
    return torch.promote_types(dtype, torch.float32)


class OfflineNorm(nn.Module):
    """Base class: channels-last input ``(..., C)``, optional ``pad_mask`` (True = padding).

    Subclasses set ``kind``, ``centered`` (a mean is subtracted) and ``per_sample`` (statistics
    per batch element instead of over the whole batch) and implement the two averaging functions.
    Statistics are computed in at least float32 (bfloat16 input: float32; float64: float64).
    """

    kind: ClassVar[str]
    centered: ClassVar[bool] = False
    per_sample: ClassVar[bool] = False

    def __init__(self, num_features: int, *, momentum: float = 0.9, eps: float = 1e-5) -> None:
        super().__init__()
        if num_features <= 0:
            raise InputError(f"num_features must be positive, got {num_features}")
        if not 0.0 <= momentum < 1.0:
            raise InputError(f"momentum must be in [0, 1), got {momentum}")
        self.num_features = num_features
        self.momentum = momentum
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        if self.centered:
            self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("num_steps", torch.tensor(0, dtype=torch.long))

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.num_features:
            raise InputError(
                f"{type(self).__name__} expects {self.num_features} channels in the last "
                f"dimension, got input of shape {tuple(x.shape)}"
            )
        if self.training:
            return OfflineNormFunction.apply(x, self.weight, self.bias, pad_mask, self)
        scale, shift = self.affine()
        return x * scale.to(x.dtype) + shift.to(x.dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> OfflineNorm:
        # model.to(torch.bfloat16) casts buffers too; statistics stay at least float32.
        super()._apply(fn, recurse)
        for name, buffer in self.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != statistics_dtype(buffer.dtype):
                setattr(self, name, buffer.to(statistics_dtype(buffer.dtype)))
        return self

    def affine(self) -> tuple[Tensor, Tensor]:
        """The inference transform as ``(scale, shift)``: eval output is ``x * scale + shift``."""
        dtype = statistics_dtype(self.weight.dtype)
        scale = self.weight.to(dtype) / torch.sqrt(self.running_var.to(dtype) + self.eps)
        shift = self.bias.to(dtype)
        if self.centered:
            shift = shift - self.running_mean.to(dtype) * scale
        return scale, shift

    def _update_running(self, buffer: Tensor, value: Tensor) -> None:
        """buffer <- momentum * buffer + (1 - momentum) * value."""
        buffer.mul_(self.momentum).add_(value.to(buffer.dtype), alpha=1.0 - self.momentum)

    # The two averaging functions. Both run under no_grad and may update buffers.
    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[Tensor | None, Tensor, StepState]:
        """Per-channel batch mean (None if not centered) and mean square of the (centred) input,
        and how many non-pad positions they were taken over
        -> (mean to subtract or None, variance to divide by, state for the backward).

        Shapes: ``(C,)`` statistics and a scalar count; with ``per_sample``, ``(B, C)`` and
        ``(B,)`` (a sample that is all padding has count 0 and zero statistics), and the returned
        mean/variance may be ``(B, C)``: one per sample."""
        raise NotImplementedError

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: StepState
    ) -> tuple[Tensor | None, Tensor]:
        """Per-channel mean(dz) (None if not centered) and mean(dz * z) of this step (per sample
        with ``per_sample``: ``(B, C)``) -> (psi_mean or None, psi_var) that the backward
        subtracts, of the same shape."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"


class OfflineNormFunction(torch.autograd.Function):
    """Training forward/backward of every OfflineNorm, parameterised by its averaging functions."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor,
        pad_mask: Tensor | None,
        norm: OfflineNorm,
    ) -> Tensor:
        dtype = statistics_dtype(x.dtype)
        # (G, T, C): G = 1 group of every position, or one group per sample.
        tokens, keep = group_tokens(x.to(dtype), pad_mask, norm.per_sample)
        with torch.no_grad():
            norm.num_steps += 1
            if keep is None:
                count = tokens.new_full((tokens.shape[0], 1), tokens.shape[1])
            else:
                count = keep.sum(dim=1)
            divisor = count.clamp(min=1)  # a group that is all padding gets zero statistics
            batch_mean = _group_mean(tokens, keep, divisor) if norm.centered else None
            centred = tokens if batch_mean is None else tokens - batch_mean.unsqueeze(1)
            batch_var = _group_mean(centred * centred, keep, divisor)
            mean_hat, var_hat, step = norm.forward_statistics(
                *_ungroup(norm, batch_mean, batch_var, count.squeeze(1))
            )
            mean_hat, var_hat = _per_position(norm, mean_hat), _per_position(norm, var_hat)
        inv_std = torch.rsqrt(var_hat + norm.eps)
        z = (tokens if mean_hat is None else tokens - mean_hat) * inv_std
        y = z * weight.to(dtype) + bias.to(dtype)
        ctx.save_for_backward(z, inv_std, weight, keep, divisor)
        ctx.norm, ctx.step, ctx.x_shape, ctx.x_dtype = norm, step, x.shape, x.dtype
        return y.reshape(x.shape).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        z, inv_std, weight, keep, divisor = ctx.saved_tensors
        norm: OfflineNorm = ctx.norm
        dy = dy.reshape(z.shape).to(z.dtype)
        dz = dy * weight.to(z.dtype)
        with torch.no_grad():
            grad_mean = _group_mean(dz, keep, divisor) if norm.centered else None
            grad_var = _group_mean(dz * z, keep, divisor)
            psi_mean, psi_var = norm.backward_statistics(
                *_ungroup(norm, grad_mean, grad_var), ctx.step
            )
            psi_mean, psi_var = _per_position(norm, psi_mean), _per_position(norm, psi_var)
        dx = dz - z * psi_var
        if psi_mean is not None:
            dx = dx - psi_mean
        dx = dx * inv_std
        if keep is not None:
            dx = dx * keep
        grad_weight = masked_sum(dy * z, keep, dim=(0, 1)).to(weight.dtype)
        grad_bias = masked_sum(dy, keep, dim=(0, 1)).to(weight.dtype)
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), grad_weight, grad_bias, None, None


def _group_mean(values: Tensor, keep: Tensor | None, divisor: Tensor) -> Tensor:
    """(G, T, C) -> (G, C): mean over each group's non-pad positions."""
    return masked_sum(values, keep, dim=1) / divisor


def _ungroup(norm: OfflineNorm, *stats: Tensor | None) -> tuple[Tensor | None, ...]:
    """Batch statistics (one group) go to the averaging functions as (C,) / scalar count."""
    if norm.per_sample:
        return stats
    return tuple(None if s is None else s[0] for s in stats)


def _per_position(norm: OfflineNorm, stat: Tensor | None) -> Tensor | None:
    """A per-sample (B, C) statistic broadcast over each sample's positions: (B, 1, C)."""
    if stat is None or not norm.per_sample:
        return stat
    return stat.unsqueeze(1)
