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
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .stats import flatten_tokens, masked_mean, masked_sum

# What forward_statistics hands to backward_statistics for the same step (method-specific).
StepState = Any


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics never run below float32: bfloat16/float16 -> float32, float64 stays."""
    return torch.promote_types(dtype, torch.float32)


class OfflineNorm(nn.Module):
    """Base class: channels-last input ``(..., C)``, optional ``pad_mask`` (True = padding).

    Subclasses set ``kind`` and ``centered`` and implement the two averaging functions.
    Statistics are computed in at least float32 (bfloat16 input: float32; float64: float64).
    """

    kind: ClassVar[str]
    centered: ClassVar[bool] = False

    def __init__(self, num_features: int, *, momentum: float = 0.9, eps: float = 1e-5) -> None:
        super().__init__()
        if num_features <= 0:
            raise ValueError(f"num_features must be positive, got {num_features}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
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
            raise ValueError(
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
        self, batch_mean: Tensor | None, batch_var: Tensor
    ) -> tuple[Tensor | None, Tensor, StepState]:
        """Per-channel batch mean (None if not centered) and mean square of the (centred) input
        -> (mean to subtract or None, variance to divide by, state for the backward)."""
        raise NotImplementedError

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: StepState
    ) -> tuple[Tensor | None, Tensor]:
        """Per-channel mean(dz) (None if not centered) and mean(dz * z) of this step
        -> (psi_mean or None, psi_var) that the backward subtracts."""
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
        flat, keep = flatten_tokens(x.to(dtype), pad_mask)
        with torch.no_grad():
            norm.num_steps += 1
            batch_mean = masked_mean(flat, keep) if norm.centered else None
            centred = flat if batch_mean is None else flat - batch_mean
            batch_var = masked_mean(centred * centred, keep)
            mean_hat, var_hat, step = norm.forward_statistics(batch_mean, batch_var)
        inv_std = torch.rsqrt(var_hat + norm.eps)
        z = (flat if mean_hat is None else flat - mean_hat) * inv_std
        y = z * weight.to(dtype) + bias.to(dtype)
        ctx.save_for_backward(z, inv_std, weight, keep)
        ctx.norm, ctx.step, ctx.x_shape, ctx.x_dtype = norm, step, x.shape, x.dtype
        return y.reshape(x.shape).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        z, inv_std, weight, keep = ctx.saved_tensors
        norm: OfflineNorm = ctx.norm
        dy = dy.reshape(z.shape).to(z.dtype)
        dz = dy * weight.to(z.dtype)
        with torch.no_grad():
            grad_mean = masked_mean(dz, keep) if norm.centered else None
            grad_var = masked_mean(dz * z, keep)
            psi_mean, psi_var = norm.backward_statistics(grad_mean, grad_var, ctx.step)
        dx = dz - z * psi_var
        if psi_mean is not None:
            dx = dx - psi_mean
        dx = dx * inv_std
        if keep is not None:
            dx = dx * keep
        grad_weight = masked_sum(dy * z, keep).to(weight.dtype)
        grad_bias = masked_sum(dy, keep).to(weight.dtype)
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), grad_weight, grad_bias, None, None
