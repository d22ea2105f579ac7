"""Checks of the Online Normalization reference itself (tests/online_norm_reference.py).

Not of edge_un: these test properties that follow from the paper's equations (hand-computed first
steps, the sequential order, padding, the statistics' fixed points, the exact gradient where the
equations give one, and the controllers' zero-mean / orthogonality conditions) so that a slip in
the reference cannot silently become the specification edge_un.OnlineNorm is tested against.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from .online_norm_reference import (
    ONConfig,
    ONState,
    backward,
    forward,
    inference,
    initial_state,
)

C = 3


def random_affine(rng: np.random.Generator, c: int = C) -> tuple[np.ndarray, np.ndarray]:
    return rng.uniform(0.5, 1.5, c), rng.normal(0.0, 0.3, c)


def assert_states_equal(a: ONState, b: ONState, **tol) -> None:
    for name in ("mean", "var", "u", "v"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), err_msg=name, **tol)


def warmed_state(config: ONConfig, rng: np.random.Generator) -> ONState:
    """A state with non-trivial statistics and controllers (one random batch, forward+backward)."""
    weight, bias = random_affine(rng, config.num_features)
    x = rng.normal(0.7, 2.0, (4, 5, config.num_features))
    _, state, cache = forward(config, initial_state(config), x, weight, bias)
    dy = rng.normal(0.4, 1.0, x.shape)
    return backward(config, state, cache, dy)[3]


def test_initial_state() -> None:
    s = initial_state(ONConfig(num_features=4))
    for got, want in ((s.mean, 0.0), (s.var, 1.0), (s.u, 0.0), (s.v, 0.0)):
        np.testing.assert_array_equal(got, np.full(4, want))


def test_first_1d_sample_by_hand() -> None:
    """(B, C), one sample from the initial state: (8a)-(8c) with s2 = 0, and a single backward."""
    cfg = ONConfig(num_features=C, alpha_fwd=0.9, alpha_bkw=0.8, eps=1e-3)
    a = cfg.alpha_fwd
    x = np.array([[2.0, -1.0, 0.5]])
    w, b = np.array([1.5, 0.5, 2.0]), np.array([0.1, -0.2, 0.3])
    y, s, cache = forward(cfg, initial_state(cfg), x, w, b)
    np.testing.assert_allclose(y, w * x / np.sqrt(1.0 + cfg.eps) + b, rtol=1e-14)
    np.testing.assert_allclose(s.mean, (1 - a) * x[0], rtol=1e-14)
    np.testing.assert_allclose(s.var, a + a * (1 - a) * x[0] ** 2, rtol=1e-14)
    np.testing.assert_array_equal(s.u, 0.0)
    np.testing.assert_array_equal(s.v, 0.0)

    dy = np.array([[0.3, -2.0, 1.0]])
    dx, dw, db, s2 = backward(cfg, s, cache, dy)
    x_hat = x / np.sqrt(1.0 + cfg.eps)
    np.testing.assert_allclose(dx, w * dy / np.sqrt(1.0 + cfg.eps), rtol=1e-14)
    np.testing.assert_allclose(dw, dy[0] * x_hat[0], rtol=1e-14)
    np.testing.assert_allclose(db, dy[0], rtol=1e-14)
    np.testing.assert_allclose(s2.v, w * dy[0] * x_hat[0], rtol=1e-14)  # v = 0 + g x_hat
    np.testing.assert_allclose(s2.u, dx[0], rtol=1e-14)  # u = 0 + dx
    np.testing.assert_array_equal(s2.mean, s.mean)
    np.testing.assert_array_equal(s2.var, s.var)


def test_second_1d_sample_uses_the_first_ones_statistics_and_controllers() -> None:
    cfg = ONConfig(num_features=1, alpha_fwd=0.8, alpha_bkw=0.75, eps=0.0)
    a, k = cfg.alpha_fwd, 1.0 - cfg.alpha_bkw
    x = np.array([[3.0], [1.0]])
    y, s, cache = forward(cfg, initial_state(cfg), x, np.ones(1), np.zeros(1))
    mu1, var1 = (1 - a) * 3.0, a + a * (1 - a) * 9.0
    y1 = (1.0 - mu1) / np.sqrt(var1)
    np.testing.assert_allclose(y[:, 0], [3.0, y1], rtol=1e-14)
    np.testing.assert_allclose(s.mean, a * mu1 + (1 - a) * 1.0, rtol=1e-14)
    np.testing.assert_allclose(s.var, a * var1 + a * (1 - a) * (1.0 - mu1) ** 2, rtol=1e-14)

    dy = np.array([[2.0], [-1.0]])
    dx, _, _, s2 = backward(cfg, s, cache, dy)
    v1, u1 = 2.0 * 3.0, 2.0  # sample 0: g~ = 2, x_hat = 3, scale 1, dx = 2
    g1 = -1.0 - k * v1 * y1
    dx1 = g1 / np.sqrt(var1) - k * u1
    np.testing.assert_allclose(dx[:, 0], [2.0, dx1], rtol=1e-14)
    np.testing.assert_allclose(s2.v, v1 + g1 * y1, rtol=1e-14)
    np.testing.assert_allclose(s2.u, u1 + dx1, rtol=1e-14)


def test_first_token_sample_by_hand() -> None:
    """(1, N, C): the within-sample mean and biased variance enter (8b)/(8c)."""
    cfg = ONConfig(num_features=C, alpha_fwd=0.7)
    a = cfg.alpha_fwd
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, (1, 6, C))
    _, s, _ = forward(cfg, initial_state(cfg), x, np.ones(C), np.zeros(C))
    m, s2 = x[0].mean(axis=0), x[0].var(axis=0)
    np.testing.assert_allclose(s.mean, (1 - a) * m, rtol=1e-13)
    np.testing.assert_allclose(s.var, a + (1 - a) * s2 + a * (1 - a) * m**2, rtol=1e-13)


def test_2d_input_is_one_position_per_sample() -> None:
    cfg = ONConfig(num_features=C, alpha_fwd=0.9, alpha_bkw=0.7)
    rng = np.random.default_rng(1)
    state = warmed_state(cfg, rng)
    w, b = random_affine(rng)
    x = rng.normal(0.5, 1.5, (7, C))
    dy = rng.normal(0.2, 1.0, (7, C))
    pad = np.array([False, True, False, False, True, False, False])

    y2, s2, c2 = forward(cfg, state, x, w, b, pad)
    y3, s3, c3 = forward(cfg, state, x[:, None, :], w, b, pad[:, None])
    np.testing.assert_array_equal(y2, y3[:, 0, :])
    assert_states_equal(s2, s3, rtol=0, atol=0)
    dx2, dw2, db2, t2 = backward(cfg, s2, c2, dy)
    dx3, dw3, db3, t3 = backward(cfg, s3, c3, dy[:, None, :])
    assert dx2.shape == x.shape
    np.testing.assert_array_equal(dx2, dx3[:, 0, :])
    np.testing.assert_array_equal(dw2, dw3)
    np.testing.assert_array_equal(db2, db3)
    assert_states_equal(t2, t3, rtol=0, atol=0)


def test_batch_equals_one_sample_at_a_time() -> None:
    """Sequential semantics: a batch of B == B batches of one, forward and backward interleaved.

    The forward never reads u, v and the backward never reads mean, var, so the two orders give
    the same numbers.
    """
    cfg = ONConfig(num_features=C, alpha_fwd=0.8, alpha_bkw=0.6)
    rng = np.random.default_rng(2)
    state = warmed_state(cfg, rng)
    w, b = random_affine(rng)
    x = rng.normal(-0.3, 1.2, (5, 4, C))
    dy = rng.normal(0.3, 1.0, x.shape)
    pad = rng.random((5, 4)) < 0.3
    pad[3] = True  # one all-pad sample

    y, s, cache = forward(cfg, state, x, w, b, pad)
    dx, dw, db, s_end = backward(cfg, s, cache, dy)

    one = state
    for i in range(5):
        yi, one, ci = forward(cfg, one, x[i : i + 1], w, b, pad[i : i + 1])
        dxi, dwi, dbi, one = backward(cfg, one, ci, dy[i : i + 1])
        np.testing.assert_allclose(yi[0], y[i], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(dxi[0], dx[i], rtol=1e-13, atol=1e-13)
        dw, db = dw - dwi, db - dbi
    np.testing.assert_allclose(dw, 0.0, atol=1e-12)
    np.testing.assert_allclose(db, 0.0, atol=1e-12)
    assert_states_equal(one, s_end, rtol=1e-13, atol=1e-13)


def test_forward_leaves_controllers_backward_leaves_statistics() -> None:
    cfg = ONConfig(num_features=C)
    rng = np.random.default_rng(3)
    state = warmed_state(cfg, rng)
    x = rng.normal(size=(3, 2, C))
    _, s, cache = forward(cfg, state, x, np.ones(C), np.zeros(C))
    np.testing.assert_array_equal(s.u, state.u)
    np.testing.assert_array_equal(s.v, state.v)
    s2 = backward(cfg, s, cache, rng.normal(size=x.shape))[3]
    np.testing.assert_array_equal(s2.mean, s.mean)
    np.testing.assert_array_equal(s2.var, s.var)


def test_each_output_is_inference_with_the_statistics_before_its_sample() -> None:
    cfg = ONConfig(num_features=C, alpha_fwd=0.85)
    rng = np.random.default_rng(4)
    state = warmed_state(cfg, rng)
    w, b = random_affine(rng)
    x = rng.normal(1.0, 3.0, (4, 3, C))
    pad = np.zeros((4, 3), dtype=bool)
    pad[1, 2] = True
    y, _, _ = forward(cfg, state, x, w, b, pad)
    for i in range(4):
        before = forward(cfg, state, x[:i], w, b, pad[:i])[1] if i else state
        want = w * (x[i] - before.mean) / np.sqrt(before.var + cfg.eps) + b
        np.testing.assert_allclose(y[i], want, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(inference(cfg, before, x[i], w, b), want, rtol=1e-15)


def test_pad_positions_change_nothing() -> None:
    """Padding == the sample with those tokens removed; pad values and pad dy never matter."""
    cfg = ONConfig(num_features=C, alpha_fwd=0.75, alpha_bkw=0.7)
    rng = np.random.default_rng(5)
    state = warmed_state(cfg, rng)
    w, b = random_affine(rng)
    x = rng.normal(0.4, 1.3, (4, 6, C))
    dy = rng.normal(-0.2, 1.0, x.shape)
    pad = np.zeros((4, 6), dtype=bool)
    pad[0, 4:] = pad[2, 1] = pad[2, 5] = pad[3, 0] = True

    y, s, cache = forward(cfg, state, x, w, b, pad)
    dx, dw, db, s_end = backward(cfg, s, cache, dy)
    np.testing.assert_array_equal(dx[pad], 0.0)

    # Other values at the pad positions: identical results at the valid ones.
    x2, dy2 = x.copy(), dy.copy()
    x2[pad] = 1e3 * rng.normal(size=(pad.sum(), C))
    dy2[pad] = 1e3 * rng.normal(size=(pad.sum(), C))
    y2, s2, cache2 = forward(cfg, state, x2, w, b, pad)
    dx2, dw2, db2, s2_end = backward(cfg, s2, cache2, dy2)
    np.testing.assert_array_equal(y2[~pad], y[~pad])
    np.testing.assert_array_equal(dx2, dx)
    np.testing.assert_allclose(dw2, dw, rtol=1e-15)
    np.testing.assert_allclose(db2, db, rtol=1e-15)
    assert_states_equal(s2_end, s_end, rtol=0, atol=0)

    # Ragged samples without padding, one at a time.
    one = state
    dw_sum, db_sum = np.zeros(C), np.zeros(C)
    for i in range(4):
        keep = ~pad[i]
        yi, one, ci = forward(cfg, one, x[i : i + 1, keep], w, b)
        dxi, dwi, dbi, one = backward(cfg, one, ci, dy[i : i + 1, keep])
        np.testing.assert_allclose(yi[0], y[i, keep], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(dxi[0], dx[i, keep], rtol=1e-13, atol=1e-13)
        dw_sum, db_sum = dw_sum + dwi, db_sum + dbi
    np.testing.assert_allclose(dw_sum, dw, rtol=1e-12)
    np.testing.assert_allclose(db_sum, db, rtol=1e-12)
    assert_states_equal(one, s_end, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", [(5, C), (5, 3, C)])
def test_all_pad_sample_is_skipped(shape: tuple[int, ...]) -> None:
    cfg = ONConfig(num_features=C, alpha_fwd=0.8, alpha_bkw=0.6)
    rng = np.random.default_rng(6)
    state = warmed_state(cfg, rng)
    w, b = random_affine(rng)
    x = rng.normal(0.5, 1.0, shape)
    dy = rng.normal(0.5, 1.0, shape)
    pad = np.zeros(shape[:-1], dtype=bool)
    pad[2] = True
    keep = np.array([0, 1, 3, 4])

    y, s, cache = forward(cfg, state, x, w, b, pad)
    dx, dw, db, s_end = backward(cfg, s, cache, dy)
    y_k, s_k, cache_k = forward(cfg, state, x[keep], w, b)
    dx_k, dw_k, db_k, s_k_end = backward(cfg, s_k, cache_k, dy[keep])

    np.testing.assert_allclose(y[keep], y_k, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(dx[keep], dx_k, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(dx[2], 0.0)
    np.testing.assert_allclose(dw, dw_k, rtol=1e-13)
    np.testing.assert_allclose(db, db_k, rtol=1e-13)
    assert_states_equal(s_end, s_k_end, rtol=1e-14, atol=1e-14)
    # Its own output is the normalisation with the statistics left by samples 0 and 1.
    before = forward(cfg, state, x[:2], w, b)[1]
    np.testing.assert_allclose(y[2], inference(cfg, before, x[2], w, b), rtol=1e-13)


def test_identical_samples_drive_statistics_to_their_moments() -> None:
    """Fixed point of (8b)/(8c) for a constant sample: mu -> m, sigma^2 -> s2.

    With mu_t = m + a^t (mu_0 - m), the variance error e_t = sigma_t^2 - s2 obeys
    e_t = a e_{t-1} + a (1 - a) (m - mu_{t-1})^2 and decays like t a^t.
    """
    cfg = ONConfig(num_features=C, alpha_fwd=0.9)
    rng = np.random.default_rng(7)
    sample = rng.normal(0.0, 1.0, (8, C)) * np.array([0.5, 2.0, 3.0]) + np.array([4.0, -1.0, 0.2])
    x = np.broadcast_to(sample, (600, 8, C))
    _, s, _ = forward(cfg, initial_state(cfg), x, np.ones(C), np.zeros(C))
    np.testing.assert_allclose(s.mean, sample.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.var, sample.var(axis=0), rtol=1e-12)


def test_iid_1d_stream_statistics_stationary_means() -> None:
    """For i.i.d. x with mean m and variance s^2 the recursions give, at stationarity,
    E[mu] = m, Var[mu] = s^2 (1 - a) / (1 + a), and from (8c)
    E[sigma^2] = a (1 - a) E[(x - mu)^2] / (1 - a) = 2 a s^2 / (1 + a)   (0.947 s^2 at a = 0.9).
    """
    cfg = ONConfig(num_features=2, alpha_fwd=0.9, eps=0.0)
    a = cfg.alpha_fwd
    m, sd = np.array([3.0, -1.0]), np.array([2.0, 0.5])
    rng = np.random.default_rng(8)
    x = m + sd * rng.standard_normal((20000, 2))
    _, _, cache = forward(cfg, initial_state(cfg), x, np.ones(2), np.zeros(2))
    var_before = cache.scale[200:] ** 2  # sigma_{t-1}^2 seen by sample t (eps = 0)
    mean_before = x[200:] - cache.x_hat[200:, 0, :] * cache.scale[200:]
    assert np.all(np.abs(mean_before.mean(axis=0) - m) < 0.05 * sd)
    np.testing.assert_allclose(var_before.mean(axis=0), 2 * a / (1 + a) * sd**2, rtol=0.025)
    np.testing.assert_allclose(mean_before.var(axis=0), sd**2 * (1 - a) / (1 + a), rtol=0.1)


def test_single_sample_fresh_controllers_dx_is_the_exact_gradient() -> None:
    """Sample 0 of a batch is normalised with statistics that do not depend on it, so with
    u = v = 0, (11a)/(12a) reduce to dx = weight dy / scale: the exact d(sum dy*y)/dx.
    dweight and dbias are exact for any batch and any controller state.
    """
    cfg = ONConfig(num_features=C, alpha_fwd=0.9, alpha_bkw=0.8)
    rng = np.random.default_rng(9)
    state = warmed_state(cfg, rng)
    fresh = replace(state, u=np.zeros(C), v=np.zeros(C))
    w, b = random_affine(rng)
    x = rng.normal(0.3, 1.5, (1, 4, C))
    dy = rng.normal(0.2, 1.0, x.shape)

    def loss(xx, ww=w, bb=b):
        return float(np.sum(dy * forward(cfg, fresh, xx, ww, bb)[0]))

    _, s, cache = forward(cfg, fresh, x, w, b)
    dx, _, _, _ = backward(cfg, s, cache, dy)
    h = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        fd[idx] = (loss(x + e) - loss(x - e)) / (2 * h)
    np.testing.assert_allclose(dx, fd, rtol=1e-7, atol=1e-9)

    # Warm controllers make dx differ from the gradient (the controllers are not a derivative).
    _, s_w, cache_w = forward(cfg, state, x, w, b)
    assert not np.allclose(backward(cfg, s_w, cache_w, dy)[0], fd, rtol=1e-3)

    # dweight, dbias: exact for a multi-sample padded batch with warm controllers.
    xb = rng.normal(0.3, 1.5, (3, 4, C))
    dyb = rng.normal(0.2, 1.0, xb.shape)
    pad = np.zeros((3, 4), dtype=bool)
    pad[1, 3] = True
    _, sb, cb = forward(cfg, state, xb, w, b, pad)
    _, dw, db, _ = backward(cfg, sb, cb, dyb)

    def loss_b(ww, bb):
        y = forward(cfg, state, xb, ww, bb, pad)[0]
        return float(np.sum((dyb * y)[~pad]))

    for c in range(C):
        e = np.zeros(C)
        e[c] = h
        fd_w = (loss_b(w + e, b) - loss_b(w - e, b)) / (2 * h)
        fd_b = (loss_b(w, b + e) - loss_b(w, b - e)) / (2 * h)
        np.testing.assert_allclose(dw[c], fd_w, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(db[c], fd_b, rtol=1e-7, atol=1e-9)


def test_controllers_make_dx_zero_mean_and_orthogonal_to_x_hat() -> None:
    """The paper's backward conditions, reached by the integral controllers (11b)/(12b).

    Summing (12b) over samples, the running average of mean(dx) is exactly (u_T - u_0) / T, and
    of mean(g~ x_hat) it is (v_T - v_0) / T; both tend to 0 because u, v settle (the (1 - a_b)
    feedback makes them stable). An incoming gradient with a large mean and a large component
    along x_hat must therefore leave dx with neither, on average.
    """
    cfg = ONConfig(num_features=C, alpha_fwd=0.99, alpha_bkw=0.9)
    rng = np.random.default_rng(10)
    loc, spread = np.array([2.0, -1.0, 0.0]), np.array([1.0, 3.0, 0.5])
    w, b = np.array([1.0, 0.5, 2.0]), np.zeros(C)
    state = initial_state(cfg)
    steps, batch, tokens = 300, 8, 6
    mean_dx, mean_dx_xhat, mean_raw, mean_raw_xhat = [], [], [], []
    for step in range(steps):
        x = loc + spread * rng.standard_normal((batch, tokens, C))
        _, state, cache = forward(cfg, state, x, w, b)
        x_hat = cache.x_hat
        dy = 0.5 + 0.8 * x_hat + 0.3 * rng.standard_normal(x_hat.shape)
        dx, _, _, state = backward(cfg, state, cache, dy)
        if step >= steps // 3:  # after the statistics have settled
            raw = w * dy / cache.scale[:, None, :]  # what dx would be without controllers
            mean_dx.append(dx.mean(axis=(0, 1)))
            mean_dx_xhat.append((dx * x_hat).mean(axis=(0, 1)))
            mean_raw.append(raw.mean(axis=(0, 1)))
            mean_raw_xhat.append((raw * x_hat).mean(axis=(0, 1)))

    avg = np.mean(mean_dx, axis=0)
    avg_xhat = np.mean(mean_dx_xhat, axis=0)
    raw = np.abs(np.mean(mean_raw, axis=0))
    raw_xhat = np.abs(np.mean(mean_raw_xhat, axis=0))
    assert np.all(raw > 0.05) and np.all(raw_xhat > 0.1)  # the uncontrolled gradient has both
    assert np.all(np.abs(avg) < 0.02 * raw), (avg, raw)
    assert np.all(np.abs(avg_xhat) < 0.05 * raw_xhat), (avg_xhat, raw_xhat)
