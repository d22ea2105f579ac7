"""swap_layernorm on models edge_un has never seen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import edge_un


def _encoder(heads: int = 2) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        d_model=16, nhead=heads, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    return nn.Sequential(
        nn.Linear(4, 16),
        nn.TransformerEncoder(
            layer, num_layers=2, norm=nn.LayerNorm(16), enable_nested_tensor=False
        ),
        nn.Linear(16, 3),
    )


def test_swaps_every_layernorm_of_a_torch_transformer_encoder() -> None:
    torch.manual_seed(0)
    model = _encoder()
    with torch.no_grad():
        first = model[1].layers[0].norm1
        first.weight.uniform_(0.5, 1.5)
        first.bias.uniform_(-0.5, 0.5)
    weight, bias = first.weight.clone(), first.bias.clone()
    assert edge_un.swap_layernorm(model, "un", warmup_iters=5) == 5
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, edge_un.UnifiedNorm)]
    assert len(norms) == 5
    assert norms[0].warmup_iters == 5
    assert torch.equal(model[1].layers[0].norm1.weight, weight)
    assert torch.equal(model[1].layers[0].norm1.bias, bias)


def test_swapped_encoder_still_trains() -> None:
    torch.manual_seed(0)
    model = _encoder()
    edge_un.swap_layernorm(model, "un", warmup_iters=10)
    x = torch.randn(64, 6, 4)
    target = (x[..., 0].mean(1) > 0).long()  # learnable from the input
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = nn.functional.cross_entropy(model(x).mean(1), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    norm = model[1].layers[1].norm2
    assert int(norm.num_steps) == 150
    assert not torch.allclose(norm.running_var, torch.ones(16))


def test_swapped_encoder_in_eval_uses_our_norm_not_the_fused_layernorm_kernel() -> None:
    # With grad disabled in eval, nn.TransformerEncoderLayer would take a fused fast path
    # that computes LayerNorm from norm1/norm2's weights; swap_layernorm must prevent that.
    torch.manual_seed(0)
    model = _encoder(heads=2)
    edge_un.swap_layernorm(model, "bn")
    model.train()
    for _ in range(5):
        model(torch.randn(8, 6, 4) * 3 + 1).sum().backward()
    model.eval()
    x = torch.randn(2, 6, 4)
    with torch.no_grad():
        fast_path_candidate = model(x)
    slow_path = model(x)  # grad enabled: never the fast path
    torch.testing.assert_close(fast_path_candidate, slow_path)


def test_multi_dimensional_layernorm_is_refused_and_nothing_changes() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm([4, 8]))
    with pytest.raises(edge_un.NormSwapError, match=r"more than one dimension.*\b2\b"):
        edge_un.swap_layernorm(model)
    assert isinstance(model[0], nn.LayerNorm)


def test_layernorm_without_affine_gets_identity_weights_and_keeps_eps() -> None:
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False, eps=1e-6))
    assert edge_un.swap_layernorm(model, "mabn") == 1
    assert isinstance(model[0], edge_un.MABN)
    assert model[0].eps == 1e-6
    assert torch.equal(model[0].weight, torch.ones(8))
