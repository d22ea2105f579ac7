"""Plain-numpy float64 reference of Online Normalization training (Chiley et al., NeurIPS 2019).

Written from the paper's equations and the authors' float reference code (Cerebras
online-normalization: numpy online-norm-1d / online-norm-2d, the PyTorch layer's CPU kernel
norm_cpu.cpp and the numpy model its tests compare against, np_online_norm_2d.py), without
reading edge_un's implementation, so that the OnlineNorm tests check ``edge_un.OnlineNorm``
against an independent derivation. Equation numbers are the paper's as the authors' C reference
labels them: (8a)-(8c) forward, (11a)-(11b) and (12a)-(12b) backward. Each function carries the
step it implements ("F3" = forward step 3, "B2" = backward step 2); ``forward`` and ``backward``
run the steps in that order.

Semantics decided for edge-un
-----------------------------
* ``x`` is channels-last, ``(B, N, C)`` tokens or ``(B, C)``. ``pad_mask`` (bool, ``x.shape[:-1]``,
  True = padding) is optional.
* A SAMPLE is one batch element. For ``(B, N, C)`` its per-channel mean and biased variance are
  taken over its non-pad tokens, as the authors' 2-D layer takes them over an image's spatial
  positions. A ``(B, C)`` row is a sample with one position (within-sample variance 0): the
  authors' 1-D layer, whose update is the 2-D one with that term zero.
* Samples are processed SEQUENTIALLY in batch order: sample b is normalised with the running
  statistics left by samples 0..b-1 (and all earlier batches), then updates them. The backward
  controllers run sample by sample in the same order.
* A sample whose every position is padding updates neither the statistics nor the controllers;
  its y is whatever the normalisation gives and its dx is zero. dx is zero at pad positions; pad
  positions enter no mean, no dweight, no dbias.
* No layer scaling and no activation clamping (the authors' optional error-checking mechanisms).
  ``y = weight * x_hat + bias``; the controllers act on the gradient reaching x_hat,
  ``weight * dy``, as in the authors' layering norm -> weight -> bias.

Per sample b (sigma_{b-1}^2, mu_{b-1}, u_{b-1}, v_{b-1} are the values before the sample):

    F1  m_b = mean(x_b),  s2_b = mean((x_b - m_b)^2)                       (non-pad positions)
    F2  scale_b = sqrt(sigma_{b-1}^2 + eps)
    F3  x_hat_b = (x_b - mu_{b-1}) / scale_b                                           (8a)
    F4  y_b = weight * x_hat_b + bias
    F5  sigma_b^2 = a_f sigma_{b-1}^2 + (1 - a_f) s2_b + a_f (1 - a_f) (m_b - mu_{b-1})^2  (8c)
    F6  mu_b = a_f mu_{b-1} + (1 - a_f) m_b                                            (8b)

    B1  g_b = weight * dy_b
    B2  g~_b = g_b - (1 - a_b) v_{b-1} x_hat_b                                         (11a)
    B3  v_b = v_{b-1} + mean(g~_b * x_hat_b)                                           (11b)
    B4  dx_b = g~_b / scale_b - (1 - a_b) u_{b-1}                                      (12a)
    B5  u_b = u_{b-1} + mean(dx_b)                                                     (12b)
    B6  dx_b = 0 at pad positions
    B7  dweight = sum(dy * x_hat), dbias = sum(dy)                    (non-pad positions only)

Where the sources differ or are silent (the PyTorch reference wins, as the authors test with it):
* eps. The paper (and the C reference) divide by sigma_{t-1} with no eps. All numpy and PyTorch
  versions divide by sqrt(sigma^2 + eps): eps is added to the running variance when it is used
  (F2, and in eval), never stored in it. Followed the code.
* Which sigma divides in (12a). The C reference's bprop divides by the variance as it is AFTER the
  forward update (sigma_t); the paper, the numpy versions and the PyTorch kernels divide by the
  scale cached by the forward (sigma_{t-1}, with eps). Followed PyTorch: scale_b of F2.
* Order inside the forward update. F5 uses the OLD mean mu_{b-1}, so the variance is updated
  before the mean (all sources agree; the paper's (8b)/(8c) both read mu_{t-1}).
* Within-sample variance. The paper's 1-D equations and online-norm-1d have no (1 - a_f) s2_b
  term; the 2-D code adds it. A one-position sample has s2_b = 0, so F5 covers both. The CUDA
  kernel computes s2_b as E[x^2] - m_b^2; the CPU kernel and numpy take the two-pass
  mean((x - m_b)^2) used here (equal in exact arithmetic).
* The u controller. Before April 2020 the PyTorch CUDA kernel made u an estimator,
  u <- u + (1 - a_b)(mean(g/scale) - u), and subtracted u itself; the current kernels, the CPU
  kernel and numpy use the control process (12a)/(12b) above (commit "updt u ctrl to use ctrl
  process instead of an estimator process"). Followed the current code.
* Use-then-update. Both controllers are used with their value before the sample (u_{b-1},
  v_{b-1}) and then incremented, by a plain sum (gain 1, no decay); a_b only enters as the
  (1 - a_b) gain in B2 and B4. v is updated before dx is formed but B4 does not read v.
* The controller increments are means over the sample's positions (the 1-D code adds the single
  product; the 2-D code and kernels take the spatial mean). Here: over its non-pad positions.
* The authors' kernels keep the statistics and controllers in float32; this reference is float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ONConfig:
    num_features: int
    alpha_fwd: float = 0.999
    alpha_bkw: float = 0.99
    eps: float = 1e-5


@dataclass(frozen=True)
class ONState:
    mean: np.ndarray  # (C,) running mean mu, init 0
    var: np.ndarray  # (C,) running variance sigma^2, init 1
    u: np.ndarray  # (C,) backward controller for the mean condition, init 0
    v: np.ndarray  # (C,) backward controller for the variance condition, init 0


@dataclass(frozen=True)
class Cache:
    """What the forward leaves for the backward of the same batch."""

    x_hat: np.ndarray  # (B, P, C) normalised input, before the affine
    scale: np.ndarray  # (B, C) scale_b = sqrt(sigma_{b-1}^2 + eps) each sample was divided by
    valid: np.ndarray  # (B, P) bool, True where a position is not padding
    weight: np.ndarray  # (C,)
    shape: tuple[int, ...]  # x.shape, to give dx back in it


def initial_state(config: ONConfig) -> ONState:
    """mu = 0, sigma^2 = 1, u = v = 0 (the authors' initialisation)."""
    c = config.num_features
    return ONState(mean=np.zeros(c), var=np.ones(c), u=np.zeros(c), v=np.zeros(c))


# ---- Shapes -----------------------------------------------------------------------------------


def as_samples(a: np.ndarray) -> np.ndarray:
    """(B, C) -> (B, 1, C); (B, N, C) unchanged. Float64."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 2:
        return a[:, None, :]
    if a.ndim == 3:
        return a
    raise ValueError(f"expected (B, C) or (B, N, C), got shape {a.shape}")


def valid_positions(x: np.ndarray, pad_mask: np.ndarray | None) -> np.ndarray:
    """(B, P) bool, True where a position takes part (pad_mask True = padding)."""
    batch, positions = as_samples(x).shape[:2]
    if pad_mask is None:
        return np.ones((batch, positions), dtype=bool)
    pad = np.asarray(pad_mask, dtype=bool)
    if pad.shape != np.shape(x)[:-1]:
        raise ValueError(f"pad_mask shape {pad.shape} does not match x.shape[:-1]")
    return ~pad.reshape(batch, positions)


def position_mean(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per-channel mean of (P, C) rows over the non-pad positions (pad values never enter)."""
    return rows[valid].mean(axis=0)


# ---- Training forward -------------------------------------------------------------------------


def sample_moments(rows: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """F1: m_b = mean(x_b), s2_b = mean((x_b - m_b)^2), biased, over non-pad positions."""
    m = position_mean(rows, valid)
    return m, position_mean((rows - m) ** 2, valid)


def scale_of(var: np.ndarray, eps: float) -> np.ndarray:
    """F2: scale = sqrt(sigma^2 + eps); eps is added at use, never stored in sigma^2."""
    return np.sqrt(var + eps)


def normalise(x: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """F3 (8a): x_hat = (x - mu_{b-1}) / scale_b."""
    return (x - mean) / scale


def affine(x_hat: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """F4: y = weight * x_hat + bias."""
    return weight * x_hat + bias


def updated_var(
    var: np.ndarray, mean: np.ndarray, m: np.ndarray, s2: np.ndarray, alpha_fwd: float
) -> np.ndarray:
    """F5 (8c): sigma_b^2 = a sigma_{b-1}^2 + (1 - a) s2_b + a (1 - a) (m_b - mu_{b-1})^2."""
    a = alpha_fwd
    return a * var + (1.0 - a) * s2 + a * (1.0 - a) * (m - mean) ** 2


def updated_mean(mean: np.ndarray, m: np.ndarray, alpha_fwd: float) -> np.ndarray:
    """F6 (8b): mu_b = a mu_{b-1} + (1 - a) m_b."""
    return alpha_fwd * mean + (1.0 - alpha_fwd) * m


def forward(
    config: ONConfig,
    state: ONState,
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    pad_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, ONState, Cache]:
    """Training forward of one batch. Returns y, the state after the batch, and what backward needs.

    Samples run in batch order; u and v pass through unchanged.
    """
    samples = as_samples(x)
    valid = valid_positions(x, pad_mask)
    weight = np.asarray(weight, dtype=np.float64)
    bias = np.asarray(bias, dtype=np.float64)
    mean = np.array(state.mean, dtype=np.float64)
    var = np.array(state.var, dtype=np.float64)

    x_hat = np.empty_like(samples)
    scale = np.empty((samples.shape[0], samples.shape[2]))
    for b in range(samples.shape[0]):
        scale[b] = scale_of(var, config.eps)  # F2
        x_hat[b] = normalise(samples[b], mean, scale[b])  # F3
        if not valid[b].any():  # an all-pad sample leaves the statistics alone
            continue
        m, s2 = sample_moments(samples[b], valid[b])  # F1
        var = updated_var(var, mean, m, s2, config.alpha_fwd)  # F5, reads mu_{b-1}
        mean = updated_mean(mean, m, config.alpha_fwd)  # F6

    y = affine(x_hat, weight, bias).reshape(np.shape(x))  # F4
    new_state = ONState(mean=mean, var=var, u=np.array(state.u), v=np.array(state.v))
    cache = Cache(x_hat=x_hat, scale=scale, valid=valid, weight=weight, shape=tuple(np.shape(x)))
    return y, new_state, cache


# ---- Training backward ------------------------------------------------------------------------


def controlled_gradient(g: np.ndarray, x_hat: np.ndarray, v: np.ndarray, alpha_bkw: float):
    """B2 (11a): g~ = g - (1 - a_b) v_{b-1} x_hat."""
    return g - (1.0 - alpha_bkw) * v * x_hat


def input_gradient(g_tilde: np.ndarray, scale: np.ndarray, u: np.ndarray, alpha_bkw: float):
    """B4 (12a): dx = g~ / scale_b - (1 - a_b) u_{b-1}."""
    return g_tilde / scale - (1.0 - alpha_bkw) * u


def backward(
    config: ONConfig, state: ONState, cache: Cache, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, ONState]:
    """Training backward of the same batch: dx, dweight, dbias, and the state after it.

    ``state`` is the one ``forward`` returned: u and v are read and updated sample by sample
    (B3, B5), mean and var pass through unchanged.
    """
    dy_s = as_samples(dy)
    if dy_s.shape != cache.x_hat.shape:
        raise ValueError(f"dy shape {np.shape(dy)} does not match the forward's {cache.shape}")
    valid = cache.valid
    u = np.array(state.u, dtype=np.float64)
    v = np.array(state.v, dtype=np.float64)

    dx = np.zeros_like(dy_s)
    for b in range(dy_s.shape[0]):
        if not valid[b].any():  # all-pad sample: dx 0, controllers untouched
            continue
        x_hat = cache.x_hat[b]
        g = cache.weight * dy_s[b]  # B1
        g_tilde = controlled_gradient(g, x_hat, v, config.alpha_bkw)  # B2
        v = v + position_mean(g_tilde * x_hat, valid[b])  # B3
        dx_b = input_gradient(g_tilde, cache.scale[b], u, config.alpha_bkw)  # B4
        u = u + position_mean(dx_b, valid[b])  # B5
        dx[b] = np.where(valid[b][:, None], dx_b, 0.0)  # B6

    dweight = (dy_s * cache.x_hat)[valid].sum(axis=0)  # B7
    dbias = dy_s[valid].sum(axis=0)
    new_state = ONState(mean=np.array(state.mean), var=np.array(state.var), u=u, v=v)
    return dx.reshape(cache.shape), dweight, dbias, new_state


# ---- Eval -------------------------------------------------------------------------------------


def inference(
    config: ONConfig, state: ONState, x: np.ndarray, weight: np.ndarray, bias: np.ndarray
) -> np.ndarray:
    """Eval mode: y = weight * (x - mean) / sqrt(var + eps) + bias, any (..., C), no update."""
    x = np.asarray(x, dtype=np.float64)
    x_hat = normalise(x, state.mean, scale_of(state.var, config.eps))
    return affine(x_hat, np.asarray(weight, np.float64), np.asarray(bias, np.float64))
