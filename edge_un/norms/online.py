"""Online Normalization (Chiley et al., NeurIPS 2019), in the offline-norm core."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from .base import OfflineNorm


class OnlineNorm(OfflineNorm):
    """Online Normalization: per-sample running mean and variance forward, two integral
    controllers backward; a frozen per-channel affine at inference.

    A *sample* is one batch element: for ``(B, N, C)`` input one sequence, whose per-channel
    mean and biased variance are taken over its non-pad tokens (as the authors' 2-D layer takes
    them over an image's positions); ``(B, C)`` is the 1-D case, each row a sample of one
    position. The batch is processed sequentially, in batch order, as in the paper: sample b is
    normalised with the running statistics left by samples 0..b-1 (and earlier batches),
    ``y_b = weight * (x_b - mean) / sqrt(var + eps) + bias``, and only then are they updated with
    it (decay ``alpha_fwd``; mu_b, s2_b the sample's own mean and variance)::

        delta = mu_b - mean
        var   = alpha_fwd * var + (1 - alpha_fwd) * s2_b + alpha_fwd * (1 - alpha_fwd) * delta**2
        mean  = mean + (1 - alpha_fwd) * delta

    The backward runs sample by sample in the same order (decay ``alpha_bkw``; dz = weight * dy,
    z the normalised sample, means over its non-pad positions)::

        g    = dz - (1 - alpha_bkw) * v * z
        v    = v + mean(g * z)                    # drives mean(dx * z) to zero
        dx   = g / sqrt(var_b + eps) - (1 - alpha_bkw) * u
        u    = u + mean(dx)                       # drives mean(dx) to zero

    Where the paper and the authors' code differ in the order of these operations, this follows
    the authors' PyTorch reference (``norm_fwd``/``norm_bwd``). A sample that is all padding
    updates neither the statistics nor the controllers; dx is zero at pad positions and padding
    contributes nothing to dweight, dbias or the controllers.

    In the core this is a ``per_sample`` method: the averaging functions get per-sample
    statistics ``(B, C)`` and return the mean/variance (forward) and psi (backward) each sample
    is normalised and corrected with; ``psi_var = (1 - alpha_bkw) * v_b`` and
    ``psi_mean = (1 - alpha_bkw) * u_b * sqrt(var_b + eps)`` turn the core's
    ``dx = (dz - psi_mean - z * psi_var) / sqrt(var_b + eps)`` into the controlled backward above.
    Each of the four recurrences (mean, var, v, u) is a first-order linear recurrence over the
    batch, ``s_{b+1} = c_b * s_b + d_b`` (an all-padding sample: c = 1, d = 0); mean(g * z) and
    mean(dx) are rewritten with the sample's mean(z) and mean(z**2), which the forward knows in
    closed form. The recurrences are evaluated exactly (up to rounding: 4e-16 relative to a loop
    over the samples in float64) by a parallel prefix scan over the batch, ceil(log2 B)
    vectorised steps instead of B sequential ones; everything else is vectorised over the whole
    batch either way. Measured on 1 CPU thread, (64, 49, 64) float32 input: one recurrence 0.24 ms
    scanned vs 0.65 ms looped (B = 256: 0.5 vs 2.8 ms); forward + backward 2.4 ms vs 3.0 ms
    looped (BatchNorm 2.1 ms).

    Buffers: ``running_mean`` (init 0), ``running_var`` (init 1), the controllers ``u`` and ``v``
    (init 0), ``num_steps`` (training batches, not samples). Defaults are the authors':
    ``alpha_fwd=0.999``, ``alpha_bkw=0.99``, ``eps=1e-5``.

    Not included: the authors' optional layer scaling (divide by the per-sample second moment
    over all channels) and activation clamping that follow the norm. Neither is a per-channel
    affine, so neither could be folded into a neighbouring Linear; this layer is the norm and
    its affine only.

    Inference: ``x * scale + shift`` with ``(scale, shift) = affine()``, i.e.
    ``weight * (x - running_mean) / sqrt(running_var + eps) + bias``, which folds like every
    offline norm.

    The backward updates state, so it must run exactly once per training forward: activation
    checkpointing that re-runs the forward is not supported.
    """

    kind = "on"
    centered = True
    per_sample = True

    def __init__(
        self,
        num_features: int,
        alpha_fwd: float = 0.999,
        alpha_bkw: float = 0.99,
        eps: float = 1e-5,
    ) -> None:
        if not 0.0 <= alpha_fwd < 1.0:
            raise InputError(f"alpha_fwd must be in [0, 1), got {alpha_fwd}")
        if not 0.0 <= alpha_bkw < 1.0:
            raise InputError(f"alpha_bkw must be in [0, 1), got {alpha_bkw}")
        super().__init__(num_features, momentum=alpha_fwd, eps=eps)
        self.alpha_bkw = alpha_bkw
        self.register_buffer("u", torch.zeros(num_features))
        self.register_buffer("v", torch.zeros(num_features))

    @property
    def alpha_fwd(self) -> float:
        """The forward decay (the core's ``momentum``)."""
        return self.momentum

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
        assert batch_mean is not None
        a = self.alpha_fwd
        present = (count > 0).unsqueeze(1)  # (B, 1): the sample has a non-pad position
        decay = torch.full_like(batch_var, a).where(present, 1.0)
        # mean <- mean + (1 - a) * (mu_b - mean) = a * mean + (1 - a) * mu_b
        means, last_mean = linear_recurrence(
            decay, ((1.0 - a) * batch_mean).where(present, 0.0), self.running_mean
        )
        delta = batch_mean - means
        var_drive = (1.0 - a) * batch_var + (a * (1.0 - a)) * delta.square()
        variances, last_var = linear_recurrence(
            decay, var_drive.where(present, 0.0), self.running_var
        )
        self.running_mean.copy_(last_mean)
        self.running_var.copy_(last_var)
        std = torch.sqrt(variances + self.eps)
        # The normalised sample z = (x - mean_b) / std_b has, over its non-pad positions,
        # mean(z) = delta / std and mean(z**2) = (s2_b + delta**2) / std**2.
        mean_z = delta / std
        mean_z2 = (batch_var + delta.square()) / (variances + self.eps)
        return means, variances, (present, std, mean_z, mean_z2)

    def backward_statistics(
        self,
        grad_mean: Tensor | None,
        grad_var: Tensor,
        step: tuple[Tensor, Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor]:
        assert grad_mean is not None
        present, std, mean_z, mean_z2 = step
        k = 1.0 - self.alpha_bkw
        # v <- v + mean((dz - k v z) z) = (1 - k mean(z**2)) v + mean(dz z)
        v_before, v_last = linear_recurrence(
            (1.0 - k * mean_z2).where(present, 1.0), grad_var.where(present, 0.0), self.v
        )
        # u <- u + mean(dx), dx = (dz - k v z) / std - k u: u <- (1 - k) u + mean(dz - k v z) / std
        u_drive = (grad_mean - k * v_before * mean_z) / std
        u_before, u_last = linear_recurrence(
            torch.full_like(grad_var, self.alpha_bkw).where(present, 1.0),
            u_drive.where(present, 0.0),
            self.u,
        )
        self.v.copy_(v_last)
        self.u.copy_(u_last)
        return k * u_before * std, k * v_before

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
            f"eps={self.eps}"
        )


def linear_recurrence(decay: Tensor, drive: Tensor, initial: Tensor) -> tuple[Tensor, Tensor]:
    """``s_{b+1} = decay[b] * s_b + drive[b]`` from ``s_0 = initial`` over dim 0 of (B, C)
    tensors -> (the state before each step, (B, C); the state after the last, (C,)).

    A Hillis-Steele prefix scan: after the step with shift 2**k, entry b holds the composition
    of the affine maps of steps max(0, b - 2**(k+1) + 1)..b, so ceil(log2 B) vectorised steps
    give every prefix. Mathematically identical to the sequential loop; rounding differs at the
    last bits.
    """
    initial = initial.to(drive.dtype)
    if drive.shape[0] == 0:
        return drive.clone(), initial.clone()
    scale, offset = decay, drive
    shift, steps = 1, decay.shape[0]
    while shift < steps:
        # (map b) after (map b - shift): s -> scale_b * (scale_p * s + offset_p) + offset_b
        offset = torch.cat([offset[:shift], scale[shift:] * offset[:-shift] + offset[shift:]])
        scale = torch.cat([scale[:shift], scale[shift:] * scale[:-shift]])
        shift *= 2
    after = scale * initial + offset
    before = torch.cat([initial.unsqueeze(0), after[:-1]])
    return before, after[-1]
