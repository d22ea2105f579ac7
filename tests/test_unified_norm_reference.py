"""edge_un.UnifiedNorm against an independent float64 numpy reference (tests/un_reference.py).

The reference is written from shared/docs/unified-norm.md only; these tests drive both with the
same batches through warm-up, the window filling, the switch to the geometric mean, injected
outlier batches that trigger the filter, and padding masks on 2-D and 3-D inputs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_un.norms import UnifiedNorm

from .un_reference import UNConfig, UnifiedNormReference, UNStep, geometric_mean

NUM_FEATURES = 6
WINDOW_SIZE = 4
WARMUP_ITERS = 6
NUM_STEPS = 34
# After warm-up (t > 6) and with the window full; 20 and 21 are back to back, 14 precedes the
# state_dict checkpoint at 17.
OUTLIER_STEPS = frozenset({9, 14, 20, 21, 27})
OUTLIER_CHANNELS = (1, 4)
# x 4 (16x the variance) puts AM - GM at 5-12x the threshold on these steps and below 0.5x on all
# others. Much larger outliers make the filter cascade, see test_extreme_outliers_cascade_per_spec.
OUTLIER_SCALE = 4.0
EXTREME_OUTLIER_SCALE = 25.0
CHECKPOINT_STEP = 17

BUFFERS = ("running_var", "window_x2", "window_g", "ema_g")


@dataclass(frozen=True)
class Batch:
    """One training step's inputs, shared by the torch layer and the reference."""

    step: int
    x: np.ndarray
    pad_mask: np.ndarray | None
    dy: np.ndarray
    weight: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class TorchStep:
    y: np.ndarray
    dx: np.ndarray
    dweight: np.ndarray
    dbias: np.ndarray
    buffers: dict[str, np.ndarray]
    num_steps: int
    num_filtered: int


def trailing_padding(rng: np.random.Generator, batch: int, tokens: int) -> np.ndarray:
    """(B, N) mask of text-like sequences: each keeps a random prefix of at least 2 tokens."""
    lengths = rng.integers(2, tokens + 1, size=batch)
    return np.arange(tokens)[None, :] >= lengths[:, None]


def scattered_padding(rng: np.random.Generator, positions: int) -> np.ndarray:
    """(P,) mask with about 30% padding anywhere, never all of it."""
    mask = rng.random(positions) < 0.3
    mask[rng.integers(positions)] = False
    return mask


def batch_shape_and_mask(
    rng: np.random.Generator, step: int
) -> tuple[tuple[int, ...], np.ndarray | None]:
    """Cycle 3-D padded, 2-D plain, 3-D plain, 2-D padded inputs with varying token counts."""
    kind = step % 4
    if kind == 0:
        tokens = int(rng.integers(6, 11))
        return (4, tokens, NUM_FEATURES), trailing_padding(rng, 4, tokens)
    if kind == 1:
        return (int(rng.integers(30, 41)), NUM_FEATURES), None
    if kind == 2:
        return (3, int(rng.integers(8, 13)), NUM_FEATURES), None
    positions = int(rng.integers(30, 41))
    return (positions, NUM_FEATURES), scattered_padding(rng, positions)


def make_sequence(
    seed: int = 0, num_steps: int = NUM_STEPS, outlier_scale: float = OUTLIER_SCALE
) -> list[Batch]:
    """Batches with fixed per-channel scales; the outlier steps blow up a few channels."""
    rng = np.random.default_rng(seed)
    channel_scale = rng.uniform(0.5, 2.0, NUM_FEATURES)
    batches = []
    for step in range(1, num_steps + 1):
        shape, pad_mask = batch_shape_and_mask(rng, step)
        x = rng.standard_normal(shape) * channel_scale
        if step in OUTLIER_STEPS:
            x[..., OUTLIER_CHANNELS] *= outlier_scale
        if pad_mask is not None:
            # Garbage at pad positions: it must not matter.
            x[pad_mask] = rng.uniform(-50.0, 50.0, (int(pad_mask.sum()), NUM_FEATURES))
        batches.append(
            Batch(
                step=step,
                x=x,
                pad_mask=pad_mask,
                dy=rng.standard_normal(shape),
                weight=rng.uniform(0.5, 1.5, NUM_FEATURES),
                bias=rng.uniform(-0.5, 0.5, NUM_FEATURES),
            )
        )
    return batches


def make_layer(outlier_filtration: bool = True) -> UnifiedNorm:
    return UnifiedNorm(
        NUM_FEATURES,
        window_size=WINDOW_SIZE,
        warmup_iters=WARMUP_ITERS,
        outlier_filtration=outlier_filtration,
    )


def make_reference(outlier_filtration: bool = True) -> UnifiedNormReference:
    return UnifiedNormReference(
        UNConfig(
            NUM_FEATURES,
            window_size=WINDOW_SIZE,
            warmup_iters=WARMUP_ITERS,
            outlier_filtration=outlier_filtration,
        )
    )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def torch_step(layer: UnifiedNorm, batch: Batch, dtype: torch.dtype) -> TorchStep:
    """One training forward + backward of the layer on ``batch`` (weight/bias set from it)."""
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(batch.weight))
        layer.bias.copy_(torch.from_numpy(batch.bias))
    layer.zero_grad(set_to_none=True)
    x = torch.tensor(batch.x, dtype=dtype, requires_grad=True)
    pad_mask = None if batch.pad_mask is None else torch.from_numpy(batch.pad_mask)
    y = layer(x, pad_mask)
    y.backward(torch.tensor(batch.dy, dtype=y.dtype))
    return TorchStep(
        y=to_numpy(y),
        dx=to_numpy(x.grad),
        dweight=to_numpy(layer.weight.grad),
        dbias=to_numpy(layer.bias.grad),
        buffers={name: to_numpy(getattr(layer, name)) for name in BUFFERS},
        num_steps=int(layer.num_steps),
        num_filtered=int(layer.num_filtered),
    )


def torch_outputs(layer: UnifiedNorm, batch: Batch) -> tuple[torch.Tensor, ...]:
    """Raw tensors of one step, for bit-exact comparison."""
    layer.zero_grad(set_to_none=True)
    x = torch.tensor(batch.x, requires_grad=True)
    pad_mask = None if batch.pad_mask is None else torch.from_numpy(batch.pad_mask)
    y = layer(x, pad_mask)
    y.backward(torch.tensor(batch.dy))
    return (y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone())


def relative_difference(actual: np.ndarray, desired: np.ndarray) -> float:
    """max |a - d| / max(|d|, 1e-3 * max|d|): entries near zero measured against the array."""
    floor = max(1e-3 * float(np.abs(desired).max(initial=0.0)), 1e-300)
    return float((np.abs(actual - desired) / np.maximum(np.abs(desired), floor)).max(initial=0.0))


def compare_step(
    got: TorchStep, want: UNStep, rtol: float, atol_fraction: float, measured: dict[str, float]
) -> None:
    """assert_allclose of every output and buffer; atol is a fraction of the array's magnitude
    (entries that cancel to ~0, e.g. in dx, carry the array's absolute rounding error)."""
    pairs = {
        "y": (got.y, want.y),
        "dx": (got.dx, want.dx),
        "dweight": (got.dweight, want.dweight),
        "dbias": (got.dbias, want.dbias),
        **{name: (got.buffers[name], getattr(want.state, name)) for name in BUFFERS},
    }
    for name, (actual, desired) in pairs.items():
        measured[name] = max(measured.get(name, 0.0), relative_difference(actual, desired))
        np.testing.assert_allclose(
            actual,
            desired,
            rtol=rtol,
            atol=atol_fraction * float(np.abs(desired).max(initial=0.0)),
            err_msg=f"step {want.step}: {name} differs from the reference",
        )
    assert got.num_steps == want.state.num_steps, f"step {want.step}: num_steps"
    assert got.num_filtered == want.state.num_filtered, f"step {want.step}: num_filtered"


def batch_statistic_output(batch: Batch, eps: float = 1e-5) -> np.ndarray:
    """y when the layer normalises with this batch's own quadratic mean x2_t."""
    rows = batch.x.reshape(-1, NUM_FEATURES)
    if batch.pad_mask is not None:
        rows = rows[~batch.pad_mask.reshape(-1)]
    x2 = (rows**2).mean(axis=0)
    return batch.weight * batch.x / np.sqrt(x2 + eps) + batch.bias


def run_against_reference(
    dtype: torch.dtype,
    outlier_filtration: bool,
    rtol: float,
    atol_fraction: float,
    outlier_scale: float = OUTLIER_SCALE,
) -> tuple[list[Batch], list[TorchStep], list[UNStep], dict[str, float]]:
    layer = make_layer(outlier_filtration).to(dtype)
    reference = make_reference(outlier_filtration)
    batches = make_sequence(outlier_scale=outlier_scale)
    measured: dict[str, float] = {}
    got_steps, want_steps = [], []
    for batch in batches:
        got = torch_step(layer, batch, dtype)
        want = reference.step(batch.x, batch.pad_mask, batch.dy, batch.weight, batch.bias)
        compare_step(got, want, rtol, atol_fraction, measured)
        got_steps.append(got)
        want_steps.append(want)
    print(f"\nmax relative difference, torch {dtype} vs float64 reference:")
    for name, value in measured.items():
        print(f"  {name:12s} {value:.2e}")
    return batches, got_steps, want_steps, measured


def filtered_steps(num_filtered: list[int]) -> set[int]:
    """1-based steps on which the counter went up (by exactly one)."""
    before = [0, *num_filtered[:-1]]
    increments = [after - prev for prev, after in zip(before, num_filtered, strict=True)]
    assert set(increments) <= {0, 1}, f"num_filtered jumped by more than 1: {increments}"
    return {step for step, inc in enumerate(increments, start=1) if inc == 1}


# ---- 1-2: float64 and float32 runs through every phase ----------------------------------------


def test_float64_matches_reference_through_every_phase() -> None:
    batches, got, want, _ = run_against_reference(
        torch.float64, outlier_filtration=True, rtol=1e-5, atol_fraction=1e-12
    )

    # The run covers warm-up, the window filling, the geometric mean and padded 2-D/3-D inputs.
    assert [w.full for w in want] == [w.step > WARMUP_ITERS for w in want]
    geometric_steps = [w for w in want if w.full and not w.filtered]
    assert len(geometric_steps) >= 15
    # The geometric mean differs materially from the batch statistic, so matching the reference
    # on these steps proves the layer switched to it.
    assert max(float(np.max(np.abs(w.var_hat / w.x2 - 1))) for w in geometric_steps) > 0.05
    assert any(b.pad_mask is not None and b.x.ndim == 3 for b in batches)
    assert any(b.pad_mask is not None and b.x.ndim == 2 for b in batches)

    # The filter fires exactly on the injected outlier batches, in both.
    assert filtered_steps([w.state.num_filtered for w in want]) == OUTLIER_STEPS
    assert filtered_steps([g.num_filtered for g in got]) == OUTLIER_STEPS
    for batch, g in zip(batches, got, strict=True):
        if batch.step in OUTLIER_STEPS:
            # Filtered step: the batch's own statistic normalises it.
            np.testing.assert_allclose(
                g.y, batch_statistic_output(batch), rtol=1e-10, atol=1e-12, err_msg=f"{batch.step}"
            )


def test_extreme_outliers_cascade_per_spec() -> None:
    """x25 outliers: F7 folds the outlier's x2_t into running_var ("every step"), and the next
    filtered step passivates its slot with that inflated running_var (F4), so the filter then
    also fires on ordinary batches. The layer still matches the spec step for step."""
    _, got, want, _ = run_against_reference(
        torch.float64,
        outlier_filtration=True,
        rtol=1e-5,
        atol_fraction=1e-12,
        outlier_scale=EXTREME_OUTLIER_SCALE,
    )
    fired = filtered_steps([g.num_filtered for g in got])
    assert fired == filtered_steps([w.state.num_filtered for w in want])
    assert fired > OUTLIER_STEPS


def test_float32_matches_reference() -> None:
    _, got, _, measured = run_against_reference(
        torch.float32, outlier_filtration=True, rtol=1e-4, atol_fraction=1e-5
    )
    assert filtered_steps([g.num_filtered for g in got]) == OUTLIER_STEPS
    # float32 really carried the computation (not float64 in disguise): rounding is visible.
    assert max(measured.values()) > 1e-9


def test_bfloat16_inputs_run_finite_with_float32_statistics() -> None:
    layer = make_layer()  # float32 parameters and buffers
    reference = make_reference()
    for batch in make_sequence():
        got = torch_step(layer, batch, torch.bfloat16)
        want = reference.step(batch.x, batch.pad_mask, batch.dy, batch.weight, batch.bias)
        for name in BUFFERS:
            assert getattr(layer, name).dtype == torch.float32, name
        for name, value in [("y", got.y), ("dx", got.dx), *got.buffers.items()]:
            assert np.isfinite(value).all(), f"step {batch.step}: {name} not finite"
        # Loosely on track: bf16 has 8 mantissa bits (~0.4% per rounding).
        np.testing.assert_allclose(
            got.buffers["running_var"], want.state.running_var, rtol=5e-2, err_msg=f"{batch.step}"
        )
    assert int(layer.num_steps) == NUM_STEPS


# ---- 3: without outlier filtration ------------------------------------------------------------


def test_without_outlier_filtration_the_filter_never_fires() -> None:
    batches, got, want, _ = run_against_reference(
        torch.float64, outlier_filtration=False, rtol=1e-5, atol_fraction=1e-12
    )
    assert all(g.num_filtered == 0 for g in got)
    # The outlier batches are normalised with the geometric mean of a window that now holds
    # them, not with their own statistic.
    for batch, g, w in zip(batches, got, want, strict=True):
        if batch.step in OUTLIER_STEPS:
            assert not np.allclose(g.y, batch_statistic_output(batch), rtol=1e-3)
            np.testing.assert_allclose(w.var_hat, geometric_mean(w.state.window_x2), rtol=1e-12)


# ---- 4: state_dict round trip mid-training ----------------------------------------------------


def test_state_dict_mid_training_continues_bit_identically() -> None:
    torch.manual_seed(0)
    batches = make_sequence()
    original = make_layer().double()
    for batch in batches[:CHECKPOINT_STEP]:
        torch_outputs(original, batch)
    assert int(original.num_steps) == CHECKPOINT_STEP > max(WINDOW_SIZE, WARMUP_ITERS)
    assert int(original.num_filtered) == len({s for s in OUTLIER_STEPS if s <= CHECKPOINT_STEP})

    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = make_layer().double()
    restored.load_state_dict(torch.load(buffer, weights_only=True))

    continued = batches[CHECKPOINT_STEP:]
    assert len(continued) >= 10
    assert any(b.step in OUTLIER_STEPS for b in continued)
    for batch in continued:
        for name, a, b in zip(
            ("y", "dx", "dweight", "dbias"),
            torch_outputs(original, batch),
            torch_outputs(restored, batch),
            strict=True,
        ):
            assert torch.equal(a, b), f"step {batch.step}: {name} differs after reload"
        for name, a in original.state_dict().items():
            assert torch.equal(a, restored.state_dict()[name]), f"step {batch.step}: {name}"


# ---- 5: pad positions ------------------------------------------------------------------------


@st.composite
def padded_inputs(draw: st.DrawFn) -> tuple[tuple[int, ...], np.ndarray, int]:
    """A 2-D or 3-D shape, a pad mask with at least one real position, and a seed."""
    shape = draw(
        st.one_of(
            st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 5)),
            st.tuples(st.integers(1, 20), st.integers(1, 5)),
        )
    )
    positions = int(np.prod(shape[:-1]))
    flat = draw(st.lists(st.booleans(), min_size=positions, max_size=positions))
    keep = draw(st.integers(0, positions - 1))
    flat[keep] = False
    return shape, np.array(flat).reshape(shape[:-1]), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(padded_inputs())
def test_pad_positions_have_no_influence(case: tuple[tuple[int, ...], np.ndarray, int]) -> None:
    shape, pad_mask, seed = case
    channels = shape[-1]
    rng = np.random.default_rng(seed)
    # Small window and warm-up so five steps run through the geometric mean and both buffers.
    clean = UnifiedNorm(channels, window_size=2, warmup_iters=1).double()
    noisy = UnifiedNorm(channels, window_size=2, warmup_iters=1).double()
    mask = torch.from_numpy(pad_mask)
    keep = ~mask
    for step in range(5):
        x = torch.from_numpy(rng.standard_normal(shape))
        dy = torch.from_numpy(rng.standard_normal(shape))
        garbage = torch.from_numpy(rng.uniform(-1e4, 1e4, shape))
        x_noisy = torch.where(mask[..., None], garbage, x)
        dy_noisy = torch.where(mask[..., None], -garbage, dy)
        outs = []
        for layer, xi, dyi in ((clean, x, dy), (noisy, x_noisy, dy_noisy)):
            layer.zero_grad(set_to_none=True)
            xi = xi.clone().requires_grad_(True)
            y = layer(xi, mask)
            y.backward(dyi)
            outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
        (y_c, dx_c, dw_c, db_c), (y_n, dx_n, dw_n, db_n) = outs
        assert torch.all(dx_c[mask] == 0) and torch.all(dx_n[mask] == 0), f"step {step}"
        torch.testing.assert_close(y_n[keep], y_c[keep], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx_n, dx_c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dw_n, dw_c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(db_n, db_c, rtol=1e-12, atol=1e-12)
        for name, buf in clean.named_buffers():
            torch.testing.assert_close(dict(noisy.named_buffers())[name], buf, rtol=1e-12, atol=0)


# ---- the filter's threshold, at its edge -------------------------------------------------------


def quadratic_mean_solving(window: np.ndarray, slot: int, channel: int, target: float) -> float:
    """The x2 for ``channel`` at which AM - GM of the window (x2 written at ``slot``) is target."""

    def gap(value: float) -> float:
        column = window[:, channel].copy()
        column[slot] = value
        return float(column.mean() - np.exp(np.log(column).mean()))

    low, high = float(window[:, channel].max()), 1e6
    for _ in range(200):  # bisection: gap grows monotonically above the window's maximum
        mid = 0.5 * (low + high)
        low, high = (mid, high) if gap(mid) < target else (low, mid)
    return 0.5 * (low + high)


@pytest.mark.parametrize("ratio", [0.98, 1.02])
def test_filter_threshold_is_pooled_unbiased_variance_of_previous_window(ratio: float) -> None:
    """AM - GM set to 0.98x / 1.02x of tau = M * var(sqrt(Omega_{t-1}), ddof=1) over all M*C
    entries: the filter must fire exactly above it. The biased, per-channel and after-the-write
    variants of tau all fall outside [0.98, 1.02] x tau here, so they would decide differently."""
    channels, window_size, step = 3, 4, 10
    previous = np.array(
        [[1.0, 2.0, 0.5], [1.2, 2.4, 0.45], [0.9, 1.8, 0.55], [1.1, 2.2, 0.5]]
    )  # Omega_{t-1}
    slot = step % window_size
    tau = window_size * np.var(np.sqrt(previous), ddof=1)
    x2 = geometric_mean(previous)  # ordinary channels: far below tau
    x2[0] = quadratic_mean_solving(previous, slot, 0, ratio * tau)
    after = previous.copy()
    after[slot] = x2
    alternatives = {
        "biased": window_size * np.var(np.sqrt(previous)),
        "per-channel": window_size * np.var(np.sqrt(previous), axis=0, ddof=1)[0],
        "after the write": window_size * np.var(np.sqrt(after), ddof=1),
    }
    for name, other in alternatives.items():
        assert not 0.98 * tau <= other <= 1.02 * tau, f"{name} tau too close to discriminate"

    running_var = np.array([1.05, 2.1, 0.5])
    state = {
        "weight": torch.ones(channels, dtype=torch.float64),
        "bias": torch.zeros(channels, dtype=torch.float64),
        "running_var": torch.from_numpy(running_var),
        "num_steps": torch.tensor(step - 1),
        "window_x2": torch.from_numpy(previous),
        "window_g": torch.zeros(window_size, channels, dtype=torch.float64),
        "ema_g": torch.zeros(channels, dtype=torch.float64),
        "num_filtered": torch.tensor(0),
    }
    layer = UnifiedNorm(channels, window_size=window_size, warmup_iters=6).double()
    layer.load_state_dict(state)
    reference = UnifiedNormReference(UNConfig(channels, window_size=window_size, warmup_iters=6))
    reference.state = replace(
        reference.state, running_var=running_var, window_x2=previous, num_steps=step - 1
    )
    x = np.tile(np.sqrt(x2), (5, 1))  # every row equal: the quadratic mean is exactly x2
    dy = np.random.default_rng(0).standard_normal(x.shape)
    batch = Batch(step, x, None, dy, np.ones(channels), np.zeros(channels))

    got = torch_step(layer, batch, torch.float64)
    want = reference.step(x, None, dy, batch.weight, batch.bias)
    assert want.filtered == (ratio > 1)
    assert got.num_filtered == int(ratio > 1)
    compare_step(got, want, rtol=1e-5, atol_fraction=1e-12, measured={})
