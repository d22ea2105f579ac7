"""Online Normalization: per-sample sequential semantics, padding, eval = affine(), checkpoints,
folding, float32 statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import edge_un
from converters import fold_norms

from . import online_norm_reference as ref
from .builders import trained_small_model
from .fold_helpers import inputs_for, relative_diff

F64 = torch.float64
BUFFERS = ("running_mean", "running_var", "u", "v")


def _norm(channels: int = 5, **kwargs) -> edge_un.OnlineNorm:
    norm = edge_un.OnlineNorm(channels, **{"alpha_fwd": 0.9, "alpha_bkw": 0.8, **kwargs}).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
    return norm


def _step(norm: nn.Module, x: Tensor, dy: Tensor, pad: Tensor | None = None) -> dict[str, Tensor]:
    """One training step: output, input and parameter gradients, buffers afterwards."""
    x = x.detach().clone().requires_grad_(True)
    norm.weight.grad = norm.bias.grad = None
    y = norm(x, pad)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dweight": norm.weight.grad, "dbias": norm.bias.grad}
    return out | {name: getattr(norm, name).clone() for name in BUFFERS}


# -- 1. against the independent float64 reference -------------------------------------------

REFERENCE_STEPS = 24
REFERENCE_TOL = 1e-10


def _reference_batch(generator: torch.Generator, step: int) -> tuple[Tensor, Tensor | None]:
    """Random (B, N, C) batches with padded tokens and a fully padded sample; every fourth a
    (B, C) batch (the 1-D case). Means and scales drift so the statistics keep moving."""
    if step % 4 == 3:
        return torch.randn(5, 6, generator=generator, dtype=F64) * 1.5 - 0.5, None
    batch, length = 6, 7
    x = torch.randn(batch, length, 6, generator=generator, dtype=F64)
    x = x * torch.linspace(0.5, 3.0, 6, dtype=F64) + 0.3 * step - 2.0
    pad = torch.rand(batch, length, generator=generator) < 0.25
    pad[:, 0] = False
    pad[step % batch] = True  # one sample entirely padding
    return x, pad


def _check(name: str, actual: Tensor, expected: np.ndarray, step: int) -> float:
    expected_t = torch.from_numpy(np.ascontiguousarray(expected))
    assert actual.shape == expected_t.shape, (name, step)
    error = float((actual.detach() - expected_t).abs().max())
    scale = float(expected_t.abs().max())
    assert error <= REFERENCE_TOL * max(scale, 1e-3), (
        f"step {step}: {name} differs from the reference by {error:.3g} (max |value| {scale:.3g})"
    )
    return error / max(scale, 1e-300)


def test_matches_the_independent_float64_reference() -> None:
    """>= 20 training steps against tests/online_norm_reference.py (written from the paper and
    the authors' code without reading this implementation): y, dx, dweight, dbias and every
    buffer, each step, with controllers that matter (alpha_bkw = 0.8) and moving affine."""
    config = ref.ONConfig(num_features=6, alpha_fwd=0.9, alpha_bkw=0.8)
    state = ref.initial_state(config)
    norm = edge_un.OnlineNorm(6, alpha_fwd=0.9, alpha_bkw=0.8).double()
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(REFERENCE_STEPS):
        with torch.no_grad():
            norm.weight.copy_(torch.rand(6, generator=generator, dtype=F64) * 1.5 + 0.25)
            norm.bias.copy_(torch.randn(6, generator=generator, dtype=F64))
        x, pad = _reference_batch(generator, step)
        dy = torch.randn(x.shape, generator=generator, dtype=F64)
        got = _step(norm, x, dy, pad)

        weight, bias = norm.weight.detach().numpy(), norm.bias.detach().numpy()
        pad_np = None if pad is None else pad.numpy()
        y, state, cache = ref.forward(config, state, x.numpy(), weight, bias, pad_np)
        dx, dweight, dbias, state = ref.backward(config, state, cache, dy.numpy())
        expected = {"y": y, "dx": dx, "dweight": dweight, "dbias": dbias,
                    "running_mean": state.mean, "running_var": state.var,
                    "u": state.u, "v": state.v}  # fmt: skip
        for name, value in expected.items():
            worst = max(worst, _check(name, got[name], value, step))
        assert int(norm.num_steps) == step + 1
    # The controllers and statistics really moved (else the comparison would prove little).
    assert np.abs(state.u).min() > 1e-3 and np.abs(state.v).min() > 1e-3
    assert np.abs(state.var - 1).min() > 1e-2
    norm.eval()
    x = torch.randn(3, 4, 6, generator=generator, dtype=F64)
    inference = ref.inference(config, state, x.numpy(), norm.weight.detach().numpy(),
                              norm.bias.detach().numpy())  # fmt: skip
    _check("eval y", norm(x), inference, REFERENCE_STEPS)
    assert worst < REFERENCE_TOL


def test_a_batch_is_its_samples_one_at_a_time() -> None:
    """Sequential semantics: sample b sees the statistics left by samples 0..b-1, and the
    controllers run sample by sample, so a batch of B equals B batches of one."""
    torch.manual_seed(0)
    whole, single = _norm(), _norm()
    single.load_state_dict(whole.state_dict())
    for _ in range(3):
        x = torch.randn(6, 4, 5, dtype=F64) * 2 + 1
        dy = torch.randn(6, 4, 5, dtype=F64)
        pad = torch.rand(6, 4) < 0.3
        pad[:, 0] = False
        batch = _step(whole, x, dy, pad)
        parts = [_step(single, x[b : b + 1], dy[b : b + 1], pad[b : b + 1]) for b in range(6)]
        for name in ("y", "dx"):
            joined = torch.cat([p[name] for p in parts])
            torch.testing.assert_close(batch[name], joined, rtol=1e-12, atol=1e-12)
        for name in ("dweight", "dbias"):
            total = torch.stack([p[name] for p in parts]).sum(0)
            torch.testing.assert_close(batch[name], total, rtol=1e-12, atol=1e-12)
        for name in BUFFERS:
            torch.testing.assert_close(batch[name], parts[-1][name], rtol=1e-12, atol=1e-12)


def test_first_sample_uses_the_previous_statistics_and_the_controllers_act() -> None:
    norm = _norm(3)
    x = torch.randn(2, 7, 3, dtype=F64) * 3 + 2
    y = _step(norm, x, torch.ones(2, 7, 3, dtype=F64))["y"]
    # Sample 0 is normalised with the initial statistics (mean 0, var 1).
    expected = x[0] / torch.sqrt(torch.tensor(1.0 + norm.eps, dtype=F64)) * norm.weight + norm.bias
    torch.testing.assert_close(y[0], expected.detach(), rtol=1e-14, atol=1e-14)
    assert not torch.allclose(y[1], (x[1] * norm.weight + norm.bias).detach() / (1 + 1e-5) ** 0.5)
    assert norm.u.abs().min() > 0 and norm.v.abs().min() > 0


def test_padding_changes_nothing_and_gets_no_gradient() -> None:
    torch.manual_seed(1)
    a, b = _norm(), _norm()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 6, 5, dtype=F64)
    dy = torch.randn(4, 6, 5, dtype=F64)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[0, 4:] = pad[2, 1:] = True
    other_x, other_dy = x.clone(), dy.clone()
    other_x[pad] = 1e3 * torch.randn(int(pad.sum()), 5, dtype=F64)
    other_dy[pad] = 1e3
    first, second = _step(a, x, dy, pad), _step(b, other_x, other_dy, pad)
    assert torch.count_nonzero(first["dx"][pad]) == 0
    for name in ("dweight", "dbias", *BUFFERS):
        torch.testing.assert_close(first[name], second[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first["y"][~pad], second["y"][~pad], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first["dx"], second["dx"], rtol=1e-12, atol=1e-12)


def test_a_sample_that_is_all_padding_is_skipped() -> None:
    torch.manual_seed(2)
    a, b = _norm(), _norm()
    b.load_state_dict(a.state_dict())
    initial = {k: v.clone() for k, v in a.state_dict().items()}
    x = torch.randn(5, 3, 5, dtype=F64) + 1
    dy = torch.randn(5, 3, 5, dtype=F64)
    pad = torch.zeros(5, 3, dtype=torch.bool)
    pad[2] = True
    rest = [0, 1, 3, 4]
    with_pad, without = _step(a, x, dy, pad), _step(b, x[rest], dy[rest], pad[rest])
    assert torch.count_nonzero(with_pad["dx"][2]) == 0
    for name in ("dweight", "dbias", *BUFFERS):
        torch.testing.assert_close(with_pad[name], without[name], rtol=1e-12, atol=1e-12)
    for name in ("y", "dx"):
        torch.testing.assert_close(with_pad[name][rest], without[name], rtol=1e-12, atol=1e-12)
    # The skipped sample is still normalised (y only), with the statistics sample 3 sees.
    c = _norm()
    c.load_state_dict(initial)
    _step(c, x[:2], dy[:2])
    expected = (x[2] - c.running_mean) / torch.sqrt(c.running_var + c.eps) * c.weight + c.bias
    torch.testing.assert_close(with_pad["y"][2], expected.detach(), rtol=1e-12, atol=1e-12)


def test_two_dimensional_input_is_one_position_per_sample() -> None:
    torch.manual_seed(3)
    a, b = _norm(), _norm()
    b.load_state_dict(a.state_dict())
    x, dy = torch.randn(8, 5, dtype=F64), torch.randn(8, 5, dtype=F64)
    flat, seq = _step(a, x, dy), _step(b, x[:, None], dy[:, None])
    for name, value in flat.items():
        expected = seq[name][:, 0] if name in ("y", "dx") else seq[name]
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="batch dimension"):
        a(torch.randn(5, dtype=F64))


# -- 2. eval is affine() ---------------------------------------------------------------------


def test_eval_output_is_the_affine_and_leaves_state_alone() -> None:
    torch.manual_seed(4)
    norm = _norm()
    for _ in range(4):
        _step(norm, torch.randn(3, 4, 5, dtype=F64) * 2 + 1, torch.randn(3, 4, 5, dtype=F64))
    norm.eval()
    state = {k: v.clone() for k, v in norm.state_dict().items()}
    scale, shift = norm.affine()
    x = torch.randn(3, 4, 5, dtype=F64)
    pad = torch.rand(3, 4) < 0.5
    assert torch.equal(norm(x, pad), x * scale + shift)
    assert torch.equal(norm(x[:, 0]), x[:, 0] * scale + shift)
    expected = (x - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
    torch.testing.assert_close(x * scale + shift, expected * norm.weight + norm.bias)
    for key, value in norm.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not torch.allclose(norm.running_mean, torch.zeros(5, dtype=F64))


# -- 3. a checkpoint continues bit-identically -----------------------------------------------


def test_checkpoint_mid_training_continues_bit_identically(tmp_path: Path) -> None:
    model = trained_small_model("text", "on").train()
    path = edge_un.save_checkpoint(model, tmp_path / "on.safetensors")
    restored, info = edge_un.load_checkpoint(path)
    restored.train()
    assert info.norm_kind == "on"
    assert {n for n, _ in restored.named_buffers() if n.endswith((".u", ".v"))}
    generator = torch.Generator().manual_seed(11)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, restored)]
    for step in range(6):
        ids = torch.randint(1, 50, (5, 10), generator=generator)
        ids[step % 5, 6:] = 0  # padding
        outputs = []
        for m, optimizer in zip((model, restored), optimizers, strict=True):
            logits = m(ids)
            optimizer.zero_grad()
            logits.square().mean().backward()
            outputs.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            optimizer.step()
        assert torch.equal(outputs[0][0], outputs[1][0]), step
        for name, grad in outputs[0][1].items():
            assert torch.equal(grad, outputs[1][1][name]), (step, name)
    for (name, value), other in zip(model.state_dict().items(), restored.state_dict().values(),
                                    strict=True):  # fmt: skip
        assert torch.equal(value, other), name


# -- 4. folds exactly ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["vit", "text"])
def test_trained_online_norm_model_folds_exactly(family: str) -> None:
    model = trained_small_model(family, "on", steps=4).double()
    norms = [m for m in model.modules() if isinstance(m, edge_un.OnlineNorm)]
    assert norms and all(int(n.num_steps) == 4 for n in norms)
    assert not torch.allclose(norms[0].running_mean, torch.zeros_like(norms[0].running_mean))
    x = inputs_for(model, batch=4)
    x = x.double() if x.is_floating_point() else x
    folded, report = fold_norms(model)
    assert {n.kind for n in report.norms} == {"on"} and report.fully_integer
    with torch.no_grad():
        assert relative_diff(model(x), folded(x)) <= 1e-10


# -- 5. statistics stay float32 --------------------------------------------------------------


def test_bfloat16_keeps_float32_statistics_and_controllers() -> None:
    norm = edge_un.make_norm("on", 8, alpha_fwd=0.9).to(torch.bfloat16)
    assert norm.weight.dtype == torch.bfloat16
    for name in BUFFERS:
        assert getattr(norm, name).dtype == torch.float32, name
    for _ in range(3):
        x = (torch.randn(4, 6, 8) * 3 + 1).to(torch.bfloat16).requires_grad_(True)
        y = norm(x, torch.rand(4, 6) < 0.2)
        y.float().square().sum().backward()
        assert y.dtype == x.grad.dtype == torch.bfloat16
    for name in BUFFERS:
        buffer = getattr(norm, name)
        assert buffer.dtype == torch.float32 and torch.isfinite(buffer).all(), name
    assert norm.u.abs().sum() > 0 and norm.v.abs().sum() > 0


def test_swap_layernorm_and_factory() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6, eps=1e-6), nn.Linear(6, 2))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    weight = model[1].weight.clone()
    assert edge_un.swap_layernorm(model, "on", alpha_bkw=0.9) == 1
    norm = model[1]
    assert isinstance(norm, edge_un.OnlineNorm) and norm.kind == "on"
    assert (norm.eps, norm.alpha_fwd, norm.alpha_bkw) == (1e-6, 0.999, 0.9)
    assert torch.equal(norm.weight, weight)
    model(torch.randn(3, 5, 4)).sum().backward()
    assert int(norm.num_steps) == 1
    assert "on" in edge_un.OFFLINE_KINDS and "on" in edge_un.NORM_KINDS
    with pytest.raises(ValueError, match="alpha_bkw"):
        edge_un.make_norm("on", 4, alpha_bkw=1.5)
