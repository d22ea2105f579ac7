"""What a run measures: eval-mode logits, accuracy, agreement between two models, and how often
UN's outlier filter fired. NaN/Inf logits are divergence, not a low score."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..norms import UnifiedNorm
from .inputs import ModelInputs, batches, forward, named
from .loop import TrainingDivergedError

EVAL_BATCH = 500


@torch.no_grad()
def predict(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """Eval-mode logits in batches of ``EVAL_BATCH``; raises :class:`TrainingDivergedError` on
    NaN/Inf."""
    model.eval()
    logits = torch.cat([forward(model, batch) for batch in batches(named(inputs), EVAL_BATCH)])
    if not torch.isfinite(logits).all():
        raise TrainingDivergedError("model outputs NaN/Inf in eval mode")
    return logits


def accuracy_of(logits: Tensor, labels: Tensor) -> float:
    return float((logits.argmax(-1) == labels).double().mean())


def agreement(a: Tensor, b: Tensor) -> float:
    """Share of rows whose top-1 class is the same in two logit tensors."""
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def accuracy(model: nn.Module, inputs: ModelInputs, labels: Tensor) -> float:
    """Top-1 accuracy in eval mode."""
    return accuracy_of(predict(model, inputs), labels)


def filtered_counts(model: nn.Module) -> dict[str, int]:
    """How many training steps each UN layer's outlier filter fired, by module name."""
    return {
        name: int(module.num_filtered)
        for name, module in model.named_modules()
        if isinstance(module, UnifiedNorm)
    }
