"""Moving Average Batch Normalization (Yan et al., ICLR 2020), quadratic-mean form."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from .base import OfflineNorm


class MABN(OfflineNorm):
    """Normalises with a momentum average of x2_t; the backward subtracts the simple moving
    average of the gradient statistic over the last ``window_size`` steps."""

    kind = "mabn"

    def __init__(
        self, num_features: int, window_size: int = 4, momentum: float = 0.9, eps: float = 1e-5
    ) -> None:
        super().__init__(num_features, momentum=momentum, eps=eps)
        if window_size < 1:
            raise InputError(f"window_size must be positive, got {window_size}")
        self.window_size = window_size
        self.register_buffer("window_g", torch.zeros(window_size, num_features))

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[None, Tensor, Tensor]:
        self._update_running(self.running_var, batch_var)
        slot = (self.num_steps % self.window_size).reshape(1)
        return None, self.running_var.clone(), slot

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: Tensor
    ) -> tuple[None, Tensor]:
        self.window_g.index_copy_(0, step, grad_var.unsqueeze(0))
        # Unused slots are zero, so divide by how many steps the window has seen so far.
        filled = self.num_steps.clamp(max=self.window_size).to(grad_var.dtype)
        return None, self.window_g.sum(dim=0) / filled

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window_size={self.window_size}"
