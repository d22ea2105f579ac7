"""The one training loop: training from scratch, migration, the int8-ready fine-tune and the
example builders all take their steps here, and differ only in what they pass in.

One step: a shuffled batch (the same rows of every named input, images randomly shifted), the
caller's loss of that batch plus RBN's penalty, an optional extra term (a fine-tune's pressure on
the model), a stop on a NaN/Inf loss, backward, gradient clipping, an AdamW step (decay on
matrices only) and a linear warm-up then cosine learning rate. After each epoch the caller's
``on_epoch`` validates, logs or keeps the best weights.

Shuffling and augmentation draw from a generator seeded with the schedule's seed; the global
RNG (initialisation, dropout) is the caller's to seed, before it builds its model. A run is
deterministic for a seed on one machine and thread count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import InputError
from ..norms import regularization_loss
from .inputs import Inputs, ModelInputs, count, is_image, named, rows

OPTIMIZER = "AdamW"
LR_SCHEDULE = "linear warm-up then cosine decay"

# The loss of one batch: (its named inputs, their labels or None) -> a scalar.
BatchLoss = Callable[[Inputs, Tensor | None], Tensor]
# Called after every training forward; returns a scalar added to the loss (a fine-tune's pressure).
ExtraLoss = Callable[[nn.Module], Tensor]


class TrainingDivergedError(InputError):
    """The loss or the model's outputs became NaN/Inf; training stopped."""


@dataclass(frozen=True)
class Schedule:
    """How a run steps: epochs of shuffled batches, AdamW at ``lr`` with a linear warm-up over
    ``lr_warmup_fraction`` of the steps then cosine decay to 0, gradients clipped to
    ``clip_grad_norm``, images shifted by up to ``shift`` pixels, UN / PN warm-up over
    ``norm_warmup_fraction`` of the steps, shuffling seeded with ``seed``."""

    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    lr_warmup_fraction: float
    norm_warmup_fraction: float
    clip_grad_norm: float
    shift: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "lr"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def of(cls, recipe: Any, **changes: Any) -> Schedule:
        """The schedule of a recipe (a training preset, a fine-tune recipe): its fields of the
        same names, with ``changes`` (e.g. the seed, when the recipe has none)."""
        values = {f.name: getattr(recipe, f.name) for f in fields(cls) if hasattr(recipe, f.name)}
        return cls(**{**values, **changes})

    def total_steps(self, samples: int) -> int:
        return self.epochs * math.ceil(samples / self.batch_size)

    def lr_warmup_steps(self, samples: int) -> int:
        return max(1, round(self.total_steps(samples) * self.lr_warmup_fraction))

    def norm_warmup_steps(self, samples: int) -> int:
        """UN / PN warm-up (batch statistics) for a run over ``samples``: its share of the steps."""
        return max(1, round(self.total_steps(samples) * self.norm_warmup_fraction))

    def record(self, samples: int) -> dict[str, Any]:
        """What a checkpoint's ``recipe`` says about the run."""
        return {
            "seed": self.seed,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "optimizer": OPTIMIZER,
            "schedule": LR_SCHEDULE,
            "lr_warmup_steps": self.lr_warmup_steps(samples),
            "total_steps": self.total_steps(samples),
            "clip_grad_norm": self.clip_grad_norm,
            "augmentation": f"random shift up to {self.shift} px" if self.shift else "none",
        }


@dataclass(frozen=True)
class EpochLosses:
    """One epoch's mean training loss (RBN's penalty included), mean extra term, and the
    learning rate it ended at."""

    epoch: int
    train_loss: float
    extra_loss: float
    lr: float


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # Decay only matrices: biases, norm affines and position/class embeddings stay undecayed.
    decay = [p for p in model.parameters() if p.ndim >= 2 and p.shape[0] != 1]
    rest = [p for p in model.parameters() if not (p.ndim >= 2 and p.shape[0] != 1)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def random_shift(images: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Translate each image by up to ``max_shift`` pixels (zero-padded, i.e. background)."""
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4, value=float(images.min()))
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None].expand(n, 1, h, w + 2 * max_shift)
    picked = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :].expand(n, 1, h, w)
    return picked.gather(3, cols)


def augment(batch: Inputs, shift: int, generator: torch.Generator) -> Inputs:
    """Every image input randomly shifted by up to ``shift`` pixels; other inputs unchanged."""
    if not shift:
        return batch
    return {
        name: random_shift(tensor, shift, generator) if is_image(tensor) else tensor
        for name, tensor in batch.items()
    }


def train(
    model: nn.Module,
    inputs: ModelInputs,
    labels: Tensor | None,
    schedule: Schedule,
    batch_loss: BatchLoss,
    *,
    extra_loss: ExtraLoss | None = None,
    on_epoch: Callable[[EpochLosses], None] | None = None,
    progress: bool = True,
    desc: str = "train",
    run: str = "training",
    context: str = "",
) -> None:
    """Train ``model`` in place on ``inputs`` (a tensor, or named tensors: see :mod:`.inputs`)
    and ``labels`` (None: ``batch_loss`` needs none) for ``schedule``.

    Each step minimises ``batch_loss(batch, batch_labels) + regularization_loss(model)
    + extra_loss(model)``; ``on_epoch`` is called after every epoch (the model is set back to
    training mode before the next). Raises :class:`TrainingDivergedError`, naming ``run``, the
    epoch, the step and ``context``, as soon as that loss is NaN/Inf, before any step on it.
    """
    inputs = named(inputs)
    samples = count(inputs)
    total_steps = schedule.total_steps(samples)
    warmup_steps = schedule.lr_warmup_steps(samples)
    generator = torch.Generator().manual_seed(schedule.seed)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, schedule.weight_decay), lr=schedule.lr, betas=(0.9, 0.999)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps)
    )
    bar = tqdm(total=total_steps, disable=not progress, desc=desc, unit="step")
    step = 0  # not bar.n: a disabled bar does not count
    try:
        for epoch in range(1, schedule.epochs + 1):
            model.train()
            order = torch.randperm(samples, generator=generator)
            losses, extras = [], []
            for start in range(0, samples, schedule.batch_size):
                picked = order[start : start + schedule.batch_size]
                batch = augment(rows(inputs, picked), schedule.shift, generator)
                loss = batch_loss(batch, None if labels is None else labels[picked])
                loss = loss + regularization_loss(model)
                extra = extra_loss(model) if extra_loss is not None else torch.zeros(())
                total = loss + extra
                step += 1
                if not torch.isfinite(total):
                    raise TrainingDivergedError(
                        f"{run} diverged: loss is {total.item()} at epoch {epoch}, step {step} "
                        f"({context}); try a lower learning rate (--lr)"
                    )
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                nn.utils.clip_grad_norm_(model.parameters(), schedule.clip_grad_norm)
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                extras.append(float(extra.detach()))
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
            if on_epoch is not None:
                mean_loss, mean_extra = sum(losses) / len(losses), sum(extras) / len(extras)
                on_epoch(EpochLosses(epoch, mean_loss, mean_extra, scheduler.get_last_lr()[0]))
    finally:
        bar.close()
