"""Offline norms: inference is exactly affine(), BN is exact, every peer trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import edge_un
from edge_un.models import TextTransformer
from edge_un.norms import OFFLINE_KINDS

# Small warm-ups so that short runs exercise the post-warm-up statistics too.
SHORT_RUN_KWARGS: dict[str, dict] = {"un": {"warmup_iters": 20}, "pn": {"warmup_iters": 20}}
# Kinds whose inference subtracts a running mean (the others are scale-only).
CENTERED_KINDS = {"bn", "rbn", "on"}


def _trained_norm(kind: str, channels: int = 6, steps: int = 12) -> nn.Module:
    """A norm whose running statistics and affine parameters moved away from their init."""
    torch.manual_seed(0)
    norm = edge_un.make_norm(kind, channels, **SHORT_RUN_KWARGS.get(kind, {}))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
    for _ in range(steps):
        x = torch.randn(4, 5, channels) * torch.linspace(0.5, 3.0, channels) + 0.7
        norm(x).square().mean().backward()
    return norm.eval()


@pytest.mark.parametrize("kind", OFFLINE_KINDS)
def test_eval_output_is_the_affine_applied_by_hand(kind: str) -> None:
    norm = _trained_norm(kind)
    x = torch.randn(3, 7, 6)
    # Written from the buffers, not from norm.affine(): BN, RBN and ON subtract a running mean,
    # the power-style methods (MABN, PN, UN) only divide by the running second moment.
    buffers = dict(norm.named_buffers())
    assert ("running_mean" in buffers) == (kind in CENTERED_KINDS)
    mean = buffers["running_mean"] if kind in CENTERED_KINDS else torch.zeros(6)
    expected = (x - mean) / torch.sqrt(norm.running_var + norm.eps) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    # Running statistics and affine parameters really moved, so this is not the identity in
    # disguise (nor plain weight * x + bias).
    assert not torch.allclose(norm.running_var, torch.ones(6), atol=0.05)
    if kind in CENTERED_KINDS:
        assert not torch.allclose(mean, torch.zeros(6), atol=0.01)
    assert not torch.allclose(norm(x), x * norm.weight + norm.bias, atol=0.05)


@pytest.mark.parametrize("kind", OFFLINE_KINDS)
def test_eval_ignores_the_batch(kind: str) -> None:
    norm = _trained_norm(kind)
    x = torch.randn(2, 4, 6)
    alone = norm(x[:1])
    together = norm(torch.cat([x[:1], 100 * x[1:]]))[:1]
    torch.testing.assert_close(alone, together, rtol=0, atol=0)


def test_batchnorm_matches_autograd_batchnorm_over_non_pad_tokens() -> None:
    torch.manual_seed(1)
    norm = edge_un.BatchNorm(8).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[:, 3:] = True
    upstream = torch.randn(4, 5, 8, dtype=torch.float64)
    (norm(x, pad) * upstream).sum().backward()

    x_ref = x.detach().clone().requires_grad_(True)
    keep = ~pad
    tokens = x_ref[keep]
    mean, var = tokens.mean(0), tokens.var(0, unbiased=False)
    y_ref = (x_ref - mean) / torch.sqrt(var + norm.eps) * norm.weight.detach() + norm.bias.detach()
    (y_ref * upstream * keep[..., None]).sum().backward()

    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(x.grad[pad]) == 0
    torch.testing.assert_close(norm.running_mean, 0.1 * mean.detach(), rtol=1e-12, atol=1e-12)


def test_powernorm_uses_batch_statistic_in_warmup_and_running_one_after() -> None:
    norm = edge_un.PowerNormStar(4, warmup_iters=2)
    x = torch.randn(16, 4) * 3
    for _ in range(2):  # warm-up: normalised by this batch's quadratic mean
        y = norm(x)
        torch.testing.assert_close(y.square().mean(0), torch.ones(4), rtol=1e-4, atol=1e-4)
    running = norm.running_var.clone()
    y = norm(x)  # after warm-up: by the running statistic from before this step
    torch.testing.assert_close(y, x / torch.sqrt(running + norm.eps))


def test_mabn_normalises_with_the_momentum_average() -> None:
    norm = edge_un.MABN(4, momentum=0.5)
    x = torch.randn(32, 4) * 2
    y = norm(x)
    expected_var = 0.5 * 1.0 + 0.5 * x.square().mean(0)
    torch.testing.assert_close(y, x / torch.sqrt(expected_var + norm.eps))


def test_regularization_loss_sums_rbn_penalties_and_reaches_the_input() -> None:
    model = nn.Sequential(edge_un.RegularizedBN(4, lambda_mean=1.0, nu_std=1.0), nn.Identity())
    assert float(edge_un.regularization_loss(model)) == 0.0
    x = (torch.randn(64, 4) * 3 + 2).requires_grad_(True)
    model(x)
    loss = edge_un.regularization_loss(model)
    # Running stats start at mean 0 / std ~1: a batch at mean 2, std 3 is far from them.
    assert float(loss.detach()) > 4 * 2**2
    loss.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert float(edge_un.regularization_loss(model)) == 0.0  # consumed


@pytest.mark.parametrize("kind", OFFLINE_KINDS)
def test_bfloat16_model_keeps_float32_statistics(kind: str) -> None:
    norm = edge_un.make_norm(kind, 8).to(torch.bfloat16)
    assert norm.running_var.dtype == torch.float32
    x = torch.randn(4, 6, 8, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16
    assert torch.isfinite(x.grad).all() and torch.isfinite(norm.running_var).all()


def test_make_norm_rejects_unknown_kinds_and_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown norm kind 'gn'.*ln, bn, mabn, pn, rbn, un"):
        edge_un.make_norm("gn", 8)
    with pytest.raises(TypeError):
        edge_un.make_norm("bn", 8, window_size=4)


def test_wrong_channel_count_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"expects 8 channels"):
        edge_un.UnifiedNorm(8)(torch.randn(2, 3, 5))


# -- every peer trains -----------------------------------------------------------------------

KEY_TOKEN = 3


def _key_token_batch(generator: torch.Generator, batch: int = 32, length: int = 12) -> tuple:
    """Label 1 iff KEY_TOKEN occurs among the non-pad tokens; sequences have random padding."""
    ids = torch.randint(4, 30, (batch, length), generator=generator)
    labels = torch.randint(0, 2, (batch,), generator=generator)
    lengths = torch.randint(4, length + 1, (batch,), generator=generator)
    where = (torch.rand(batch, generator=generator) * lengths).long()
    ids[labels.bool(), where[labels.bool()]] = KEY_TOKEN
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    return ids, labels


@pytest.mark.parametrize("kind", ("ln", *OFFLINE_KINDS))
def test_each_norm_trains_a_small_transformer_beyond_chance(kind: str) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = TextTransformer(
        vocab_size=30, max_len=12, dim=32, depth=1, heads=2, mlp_ratio=2.0, num_classes=2,
        norm=kind, norm_kwargs=SHORT_RUN_KWARGS.get(kind, {}),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        ids, labels = _key_token_batch(generator)
        loss = nn.functional.cross_entropy(model(ids), labels)
        loss = loss + edge_un.regularization_loss(model)
        assert torch.isfinite(loss), f"{kind}: loss became {loss}"
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    ids, labels = _key_token_batch(torch.Generator().manual_seed(123), batch=512)
    with torch.no_grad():
        accuracy = (model(ids).argmax(-1) == labels).float().mean().item()
    assert accuracy > 0.8, f"{kind}: accuracy {accuracy:.3f} (chance 0.5)"
