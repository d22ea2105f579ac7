"""Plain-numpy float64 reference of Unified Normalization training, one spec line per function.

Written only from ``shared/docs/unified-norm.md`` (sections Shapes, State, Training forward,
Training backward), without reading edge_un's implementation, so that
``test_unified_norm_reference.py`` checks ``edge_un.UnifiedNorm`` against an independent
derivation. Each function carries the number of the spec step it implements ("F4" = Training
forward step 4, "B3" = Training backward step 3).

Reading of the one point the spec leaves implicit: in F4 the arithmetic and geometric means are
taken over the window AFTER this step's write (it contains x2_t, which is what an outlier test
must look at), while the threshold tau explicitly uses the window BEFORE the write.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class UNConfig:
    num_features: int
    window_size: int = 4
    warmup_iters: int = 4000
    outlier_filtration: bool = True
    momentum: float = 0.9
    eps: float = 1e-5


@dataclass(frozen=True)
class UNState:
    """The spec's State section; the window buffers start at zero like the layer's."""

    running_var: np.ndarray
    window_x2: np.ndarray
    window_g: np.ndarray
    ema_g: np.ndarray
    num_steps: int
    num_filtered: int

    @classmethod
    def initial(cls, config: UNConfig) -> UNState:
        shape = (config.window_size, config.num_features)
        return cls(
            running_var=np.ones(config.num_features),
            window_x2=np.zeros(shape),
            window_g=np.zeros(shape),
            ema_g=np.zeros(config.num_features),
            num_steps=0,
            num_filtered=0,
        )


@dataclass(frozen=True)
class UNStep:
    """Everything one training step produces, for comparison and for diagnosing a mismatch."""

    step: int
    y: np.ndarray
    dx: np.ndarray
    dweight: np.ndarray
    dbias: np.ndarray
    x2: np.ndarray  # x2_t, this batch's quadratic mean
    var_hat: np.ndarray  # the statistic actually used
    full: bool
    filtered: bool
    state: UNState  # after forward and backward


# ---- Shapes -----------------------------------------------------------------------------------


def flatten_positions(a: np.ndarray) -> np.ndarray:
    """(..., C) -> (P, C): batch and tokens reduce together."""
    return a.reshape(-1, a.shape[-1])


def valid_positions(x: np.ndarray, pad_mask: np.ndarray | None) -> np.ndarray:
    """(P,) bool, True where a position takes part in the statistics (pad_mask True = padding)."""
    if pad_mask is None:
        return np.ones(int(np.prod(x.shape[:-1])), dtype=bool)
    return ~np.asarray(pad_mask, dtype=bool).reshape(-1)


def channel_mean(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per-channel mean over the non-pad rows only (boolean selection: pad values never enter)."""
    return rows[valid].mean(axis=0)


def channel_sum(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    return rows[valid].sum(axis=0)


# ---- Training forward -------------------------------------------------------------------------


def quadratic_mean(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """F1: x2_t = mean(x**2), no mean subtraction."""
    return channel_mean(rows**2, valid)


def window_slot(step: int, window_size: int) -> int:
    """State: the slot for step t is t % M."""
    return step % window_size


def with_row(window: np.ndarray, slot: int, row: np.ndarray) -> np.ndarray:
    """A copy of the ring buffer with one slot overwritten (F2, F4, B3)."""
    out = window.copy()
    out[slot] = row
    return out


def is_full(step: int, config: UNConfig) -> bool:
    """F3: full = t > M and t > warmup_iters."""
    return step > config.window_size and step > config.warmup_iters


def arithmetic_mean(window: np.ndarray) -> np.ndarray:
    return window.mean(axis=0)


def geometric_mean(window: np.ndarray) -> np.ndarray:
    """F4/F5: GM = exp(mean(log(window))) per channel."""
    return np.exp(np.log(window).mean(axis=0))


def outlier_threshold(previous_window: np.ndarray) -> float:
    """F4: tau = M * var(sqrt(Omega_{t-1})), ONE unbiased variance over all M*C entries."""
    window_size = previous_window.shape[0]
    return float(window_size * np.var(np.sqrt(previous_window), ddof=1))


def is_outlier(window: np.ndarray, tau: float) -> bool:
    """F4: filtered if ANY channel has AM - GM > tau."""
    return bool(np.any(arithmetic_mean(window) - geometric_mean(window) > tau))


def normalise(x: np.ndarray, var_hat: np.ndarray, eps: float) -> np.ndarray:
    """F6: z = x / sqrt(var_hat + eps)."""
    return x / np.sqrt(var_hat + eps)


def affine(z: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """F6: y = weight * z + bias."""
    return weight * z + bias


def momentum_average(old: np.ndarray, new: np.ndarray, momentum: float) -> np.ndarray:
    """F7 and B5: alpha * old + (1 - alpha) * new."""
    return momentum * old + (1.0 - momentum) * new


# ---- Training backward ------------------------------------------------------------------------


def gradient_statistic(dz_rows: np.ndarray, z_rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """B2: g_t = mean(dz * z) over non-pad positions."""
    return channel_mean(dz_rows * z_rows, valid)


def input_gradient(
    dz: np.ndarray, z: np.ndarray, psi: np.ndarray, var_hat: np.ndarray, eps: float
) -> np.ndarray:
    """B7: dx = (dz - z * psi) / sqrt(var_hat + eps)."""
    return (dz - z * psi) / np.sqrt(var_hat + eps)


# ---- One step ---------------------------------------------------------------------------------


class UnifiedNormReference:
    """Stateful float64 reference: ``step`` runs one training forward and its backward."""

    def __init__(self, config: UNConfig) -> None:
        self.config = config
        self.state = UNState.initial(config)

    def step(
        self,
        x: np.ndarray,
        pad_mask: np.ndarray | None,
        dy: np.ndarray,
        weight: np.ndarray,
        bias: np.ndarray,
    ) -> UNStep:
        cfg = self.config
        s = self.state
        x = np.asarray(x, dtype=np.float64)
        dy = np.asarray(dy, dtype=np.float64)
        weight = np.asarray(weight, dtype=np.float64)
        bias = np.asarray(bias, dtype=np.float64)
        rows = flatten_positions(x)
        valid = valid_positions(x, pad_mask)

        # Training forward (t incremented first, so the first step is 1).
        t = s.num_steps + 1
        slot = window_slot(t, cfg.window_size)
        x2 = quadratic_mean(rows, valid)  # F1
        previous_window = s.window_x2
        window_x2 = with_row(previous_window, slot, x2)  # F2
        full = is_full(t, cfg)  # F3
        filtered = False
        if full and cfg.outlier_filtration:  # F4
            filtered = is_outlier(window_x2, outlier_threshold(previous_window))
            if filtered:
                window_x2 = with_row(window_x2, slot, s.running_var)
        num_filtered = s.num_filtered + int(filtered)
        batch_statistic = not full or filtered
        var_hat = x2 if batch_statistic else geometric_mean(window_x2)  # F5
        z = normalise(x, var_hat, cfg.eps)  # F6
        y = affine(z, weight, bias)
        running_var = momentum_average(s.running_var, var_hat, cfg.momentum)  # F7

        # Training backward.
        dz = weight * dy  # B1
        g = gradient_statistic(flatten_positions(dz), flatten_positions(z), valid)  # B2
        window_g = with_row(s.window_g, slot, s.ema_g if filtered else g)  # B3
        g_bar = g if batch_statistic else arithmetic_mean(window_g)  # B4
        ema_g = momentum_average(s.ema_g, g_bar, cfg.momentum)  # B5
        psi = g if filtered else ema_g  # B6
        dx = input_gradient(dz, z, psi, var_hat, cfg.eps)  # B7
        pad = ~valid.reshape(x.shape[:-1])
        dx[pad] = 0.0
        dweight = channel_sum(flatten_positions(dy * z), valid)  # B8
        dbias = channel_sum(flatten_positions(dy), valid)

        self.state = replace(
            s,
            running_var=running_var,
            window_x2=window_x2,
            window_g=window_g,
            ema_g=ema_g,
            num_steps=t,
            num_filtered=num_filtered,
        )
        return UNStep(
            step=t,
            y=y,
            dx=dx,
            dweight=dweight,
            dbias=dbias,
            x2=x2,
            var_hat=var_hat,
            full=full,
            filtered=filtered,
            state=self.state,
        )
