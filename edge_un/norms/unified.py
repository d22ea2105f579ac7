"""Unified Normalization (Yang et al., ACM MM 2022), per ``shared/docs/unified-norm.md``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from .authors import authors_prefixes, renamed, reshaped
from .base import OfflineNorm
from .stats import geometric_mean


class UnifiedNorm(OfflineNorm):
    """Unified Normalization: smoothed quadratic-mean statistics, frozen affine at inference.

    Forward (step t, counted in training-mode calls): the per-channel quadratic mean x2_t of the
    non-pad positions enters a ring buffer of ``window_size`` steps. After warm-up
    (``t > window_size`` and ``t > warmup_iters``) the layer normalises with the geometric mean of
    that window, unless the outlier filter fires (arithmetic minus geometric mean of the window
    exceeds ``window_size * var(sqrt(previous window))`` in any channel), in which case this batch's
    own statistic is used and the window slot is passivated with ``running_var``.

    Backward: the gradient statistic mean(dz * z) goes through a ring buffer too; the backward
    subtracts psi, its momentum average (or the exact value on a filtered step).

    The backward updates state, so it must run exactly once per training forward: activation
    checkpointing that re-runs the forward is not supported.
    """

    kind = "un"

    def __init__(
        self,
        num_features: int,
        window_size: int = 4,
        warmup_iters: int = 4000,
        outlier_filtration: bool = True,
        momentum: float = 0.9,
        eps: float = 1e-5,
    ) -> None:
        super().__init__(num_features, momentum=momentum, eps=eps)
        if window_size < 2:
            raise InputError(f"window_size must be at least 2, got {window_size}")
        if warmup_iters < 0:
            raise InputError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.window_size = window_size
        self.warmup_iters = warmup_iters
        self.outlier_filtration = outlier_filtration
        self.register_buffer("window_x2", torch.zeros(window_size, num_features))
        self.register_buffer("window_g", torch.zeros(window_size, num_features))
        self.register_buffer("ema_g", torch.zeros(num_features))
        self.register_buffer("num_filtered", torch.tensor(0, dtype=torch.long))
        # the UN authors' UN1d state loads too, renamed and reshaped (.authors)
        self.register_load_state_dict_pre_hook(_read_authors_state)

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[None, Tensor, tuple[Tensor, Tensor, Tensor]]:
        # Everything stays a tensor (no .item()), so no host synchronisation on an accelerator.
        x2 = batch_var
        t = self.num_steps
        slot = (t % self.window_size).reshape(1)
        full = (t > self.window_size) & (t > self.warmup_iters)
        previous_window = self.window_x2.clone()  # Omega_{t-1}, for the outlier threshold
        self.window_x2.index_copy_(0, slot, x2.unsqueeze(0))
        window_gm = geometric_mean(self.window_x2)
        filtered = torch.zeros_like(full)
        if self.outlier_filtration:
            window_am = self.window_x2.mean(dim=0)
            # One unbiased variance pooled over all M*C entries (Eq. 18-19, as released).
            threshold = self.window_size * previous_window.sqrt().var()
            filtered = full & ((window_am - window_gm) > threshold).any()
            passivated = torch.where(filtered, self.running_var, x2)
            self.window_x2.index_copy_(0, slot, passivated.unsqueeze(0))
            self.num_filtered += filtered.long()
        var_hat = torch.where(full & ~filtered, window_gm, x2)
        self._update_running(self.running_var, var_hat)
        return None, var_hat, (slot, full, filtered)

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: tuple[Tensor, Tensor, Tensor]
    ) -> tuple[None, Tensor]:
        slot, full, filtered = step
        g = grad_var
        written = torch.where(filtered, self.ema_g, g)
        self.window_g.index_copy_(0, slot, written.unsqueeze(0))
        g_bar = torch.where(full & ~filtered, self.window_g.mean(dim=0), g)
        self._update_running(self.ema_g, g_bar)
        psi = torch.where(filtered, g, self.ema_g)
        return None, psi

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, window_size={self.window_size}, "
            f"warmup_iters={self.warmup_iters}, outlier_filtration={self.outlier_filtration}"
        )


def _read_authors_state(
    module: UnifiedNorm, state: dict[str, Tensor], prefix: str, *args: object
) -> None:
    """A load_state_dict pre-hook: the authors' ``UN1d`` tensors under ``prefix`` become this
    layer's, in place (``state`` is the dict being loaded)."""
    names = [name for name in state if name.startswith(prefix)]
    if prefix not in authors_prefixes({name for name in names if "." not in name[len(prefix) :]}):
        return
    shapes = {name: tuple(state[name].shape) for name in names}
    for name in names:
        if "." not in name[len(prefix) :]:
            state[renamed(name, [prefix])] = reshaped(name, state.pop(name), [prefix], shapes)
