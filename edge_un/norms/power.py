"""PowerNorm without its group-scaling layer, "PN*" (Shen et al., ICML 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from .base import OfflineNorm


class PowerNormStar(OfflineNorm):
    """Quadratic-mean norm: the batch statistic during warm-up, the running average afterwards.

    Backward: ``g~ = dz - (1 - momentum) * Gamma * z``, ``Gamma += mean(g~ * z)``.
    """

    kind = "pn"

    def __init__(
        self,
        num_features: int,
        warmup_iters: int = 4000,
        momentum: float = 0.9,
        eps: float = 1e-5,
    ) -> None:
        super().__init__(num_features, momentum=momentum, eps=eps)
        if warmup_iters < 0:
            raise InputError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.warmup_iters = warmup_iters
        self.register_buffer("grad_gamma", torch.zeros(num_features))

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[None, Tensor, Tensor]:
        in_warmup = self.num_steps <= self.warmup_iters
        var_hat = torch.where(in_warmup, batch_var, self.running_var)
        self._update_running(self.running_var, batch_var)
        mean_z2 = batch_var / (var_hat + self.eps)  # mean(z^2), needed to update Gamma
        return None, var_hat, mean_z2

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: Tensor
    ) -> tuple[None, Tensor]:
        psi = (1.0 - self.momentum) * self.grad_gamma
        # mean(g~ * z) = mean(dz * z) - psi * mean(z^2)
        self.grad_gamma.add_(grad_var - psi * step)
        return None, psi

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, warmup_iters={self.warmup_iters}"
