"""A model trained with the UN authors' code reads as ours and trains on (issue 66): its
``UN1d`` state (``weight``, ``bias``, ``running_var``, ``ema_gz`` as ``(1, C, 1, 1)``;
``iters``, ``buffer_x2``, ``buffer_gz``, ``skip_counter``) loads into edge_un's UnifiedNorm,
through ``load_state_dict`` and through a checkpoint (``edge-un migrate/finetune`` read those).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

import edge_un
from edge_un.norms import UnifiedNorm
from testbed.authors_un import in_authors_layout

from .authors_un import AuthorsUN1d, trained_looking
from .builders import model_inputs


def authors_state(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s state dict as the authors' code stores it for each UnifiedNorm."""
    return in_authors_layout(model).state_dict()


def _holding(norm: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.norm = norm
    return holder


def test_the_authors_layer_loads_and_computes_the_same() -> None:
    authors = trained_looking(AuthorsUN1d(8))
    ours = UnifiedNorm(8).eval()
    ours.load_state_dict(authors.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(ours(x), authors(x), rtol=1e-6, atol=1e-6)
    assert int(ours.num_steps) == 120 and ours.window_x2.shape == (4, 8)


def test_training_goes_on_from_the_authors_state() -> None:
    """One training step from the authors' state is the step ours takes from the same state:
    the same window slot, outlier test and statistics."""
    torch.manual_seed(0)
    original = UnifiedNorm(6, warmup_iters=2)
    x = torch.randn(4, 3, 6)
    for _ in range(7):  # past warm-up: the window is full and in use
        original(x * torch.rand(1) * 3).sum().backward()
    resumed = UnifiedNorm(6, warmup_iters=2)
    state = authors_state(_holding(original))
    assert {"norm.ema_gz", "norm.buffer_x2", "norm.iters"} <= set(state)
    _holding(resumed).load_state_dict(state)
    batch = torch.randn(4, 3, 6, requires_grad=True)
    outputs = [norm(batch) for norm in (original, resumed)]
    grads = [torch.autograd.grad(out.square().sum(), batch)[0] for out in outputs]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    for name, value in original.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)
    assert int(resumed.num_steps) == 8


def test_checkpoint_in_the_authors_layout_loads(tmp_path: Path, small_vit) -> None:
    """A torch state dict with the authors' names and shapes, and an edge_un config: what
    ``edge-un migrate/finetune`` load (``edge_un.load_checkpoint``)."""
    torch.save(authors_state(small_vit), tmp_path / "authors.pt")
    assert any(name.endswith("ema_gz") for name in torch.load(tmp_path / "authors.pt"))
    saved = edge_un.save_checkpoint(small_vit, tmp_path / "ours.safetensors")
    config = tmp_path / "config.json"
    with safe_open(str(saved), framework="pt") as handle:
        config.write_text(handle.metadata()["edge_un"])
    loaded, _ = edge_un.load_checkpoint(tmp_path / "authors.pt", config=config)
    x = model_inputs(small_vit)
    assert torch.equal(loaded(x), small_vit(x))
    for name, value in small_vit.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
