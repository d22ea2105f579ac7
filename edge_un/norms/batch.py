"""BatchNorm over tokens, and Regularized BatchNorm (Wang et al., NeurIPS 2022)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import OfflineNorm, statistics_dtype
from .stats import flatten_tokens, masked_mean


class BatchNorm(OfflineNorm):
    """Channels-last BatchNorm over every non-pad token of the batch.

    Normalises with this batch's mean and (biased) variance and back-propagates through them
    exactly; the running statistics are momentum averages used at inference.
    """

    kind = "bn"
    centered = True

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[Tensor | None, Tensor, None]:
        assert batch_mean is not None
        self._update_running(self.running_mean, batch_mean)
        self._update_running(self.running_var, batch_var)
        return batch_mean, batch_var, None

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: None
    ) -> tuple[Tensor | None, Tensor]:
        return grad_mean, grad_var


class RegularizedBN(BatchNorm):
    """BatchNorm plus a training loss that keeps batch statistics near the running ones.

    Each training forward records ``lambda_mean * ||mu_B - mu||^2 + nu_std * ||sigma_B - sigma||^2``
    with gradients stopped through the running statistics; :func:`regularization_loss` sums the
    recorded terms over a model so the training loop can add them to the task loss.
    """

    kind = "rbn"

    def __init__(
        self,
        num_features: int,
        lambda_mean: float = 0.01,
        nu_std: float = 0.01,
        momentum: float = 0.9,
        eps: float = 1e-5,
    ) -> None:
        super().__init__(num_features, momentum=momentum, eps=eps)
        self.lambda_mean = lambda_mean
        self.nu_std = nu_std
        self.regularization: Tensor | None = None

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        if self.training:
            self.regularization = self._statistics_penalty(x, pad_mask)
        return super().forward(x, pad_mask)

    def _statistics_penalty(self, x: Tensor, pad_mask: Tensor | None) -> Tensor:
        # Read before this step's forward moves the running statistics.
        running_mean = self.running_mean.detach().clone()
        running_std = torch.sqrt(self.running_var.detach() + self.eps)
        flat, keep = flatten_tokens(x.to(statistics_dtype(x.dtype)), pad_mask)
        batch_mean = masked_mean(flat, keep)
        batch_std = torch.sqrt(masked_mean((flat - batch_mean) ** 2, keep) + self.eps)
        return (
            self.lambda_mean * (batch_mean - running_mean).square().sum()
            + self.nu_std * (batch_std - running_std).square().sum()
        )

    def train(self, mode: bool = True) -> RegularizedBN:
        # A recorded term holds an autograd graph; never carry one into eval (or a deepcopy).
        self.regularization = None
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_mean={self.lambda_mean}, nu_std={self.nu_std}"


def regularization_loss(model: nn.Module) -> Tensor:
    """Sum of the RBN penalties recorded by the last training forward (0 if none), and clears them.

    Add it to the task loss: ``loss = task_loss + regularization_loss(model)``.
    """
    terms = []
    for module in model.modules():
        if isinstance(module, RegularizedBN) and module.regularization is not None:
            terms.append(module.regularization)
            module.regularization = None
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()
