"""Train a reference Transformer on a real data set with any norm kind, and save the checkpoint.

Recipe: AdamW (no decay on biases, norms and embeddings' 1-D params), linear learning-rate
warm-up then cosine decay, gradient clipping, RBN's penalty added to the loss, UN / PN warm-up
scaled to the run length. Deterministic for a seed on one machine and thread count.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..checkpoint import save_checkpoint
from ..data import Dataset, load_dataset
from ..models import TextTransformer, VisionTransformer
from ..norms import NORM_KINDS, UnifiedNorm, regularization_loss
from .presets import DEFAULT_DATA, Preset, get_preset

WARMUP_KINDS = ("un", "pn")  # norms whose warmup_iters is scaled to the run length
DATA_FOR_MODEL = {"vit": ("mnist", "digits"), "text": ("rt",)}
EVAL_BATCH = 500


class TrainingDivergedError(ValueError):
    """The loss or the model's outputs became NaN/Inf; training stopped."""


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    val_accuracy: float
    lr: float
    num_filtered: dict[str, int]


@dataclass
class FitResult:
    model: nn.Module
    test_accuracy: float
    val_accuracy: float
    history: list[EpochRecord]
    metadata: dict[str, Any]
    path: Path | None = None
    num_filtered: dict[str, int] = field(default_factory=dict)


# -- small pieces ----------------------------------------------------------------------------


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def norm_warmup_iters(total_steps: int, fraction: float) -> int:
    return max(1, round(total_steps * fraction))


def filtered_counts(model: nn.Module) -> dict[str, int]:
    """How many training steps each UN layer's outlier filter fired, by module name."""
    return {
        name: int(module.num_filtered)
        for name, module in model.named_modules()
        if isinstance(module, UnifiedNorm)
    }


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


def build_model(
    preset: Preset, data: Dataset, norm: str, norm_kwargs: dict[str, Any], norm_first: bool
) -> nn.Module:
    if preset.model == "vit":
        side = data.preprocessing["input_shape"][-1]
        return VisionTransformer(
            img_size=side,
            in_chans=1,
            patch_size=preset.patch_sizes.get(side, 2),
            num_classes=data.num_classes,
            norm=norm,
            norm_kwargs=norm_kwargs,
            **preset.architecture,
        )
    tokenizer = data.preprocessing["tokenizer"]
    return TextTransformer(
        vocab_size=len(tokenizer["vocab"]) + 2,
        max_len=tokenizer["max_len"],
        num_classes=data.num_classes,
        norm_first=norm_first,
        norm=norm,
        norm_kwargs=norm_kwargs,
        pad_id=tokenizer["pad_id"],
        **preset.architecture,
    )


@torch.no_grad()
def accuracy(model: nn.Module, inputs: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy in eval mode; NaN/Inf outputs are divergence, not a low score."""
    model.eval()
    correct = 0
    for start in range(0, len(inputs), EVAL_BATCH):
        logits = model(inputs[start : start + EVAL_BATCH])
        if not torch.isfinite(logits).all():
            raise TrainingDivergedError("model outputs NaN/Inf in eval mode")
        correct += int((logits.argmax(dim=-1) == labels[start : start + EVAL_BATCH]).sum())
    return correct / len(inputs)


def regenerate_command(
    model: str,
    preset: str,
    norm: str,
    data: str,
    seed: int,
    norm_first: bool,
    out: str,
    overrides: dict[str, Any],
) -> str:
    parts = ["edge-un", "train", "--model", model, "--preset", preset, "--norm", norm]
    parts += ["--data", data, "--seed", str(seed)]
    for name, value in overrides.items():
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    if not norm_first:
        parts.append("--post-norm")
    return shlex.join([*parts, "--out", out])


# -- the loop --------------------------------------------------------------------------------


def fit(
    model: str = "vit",
    preset: str = "tiny",
    norm: str = "un",
    data: str | None = None,
    *,
    epochs: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    norm_first: bool = True,
    norm_kwargs: dict[str, Any] | None = None,
    out: str | Path | None = None,
    dataset: Dataset | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> FitResult:
    """Train ``model`` ("vit" or "text") of size ``preset`` with norm ``norm`` on ``data``.

    Returns the trained model (eval mode) with its history and test accuracy; with ``out``,
    also writes a checkpoint whose metadata records data set, split, preprocessing, recipe and
    accuracies. Raises :class:`TrainingDivergedError` as soon as the loss is NaN/Inf.
    ``dataset`` reuses an already loaded :class:`~edge_un.data.Dataset` (benchmarks).
    """
    recipe = get_preset(model, preset)
    overrides = {"epochs": epochs, "batch_size": batch_size, "lr": lr}
    data = data or DEFAULT_DATA[model]
    if data not in DATA_FOR_MODEL[model]:
        raise ValueError(
            f"model {model} trains on {', '.join(DATA_FOR_MODEL[model])}, not {data!r}"
        )
    if norm not in NORM_KINDS:
        raise ValueError(f"unknown norm kind {norm!r}; expected one of {', '.join(NORM_KINDS)}")
    if not norm_first and model != "text":
        raise ValueError("post-norm is only available for the text model")
    epochs = recipe.epochs if epochs is None else epochs
    batch_size = recipe.batch_size if batch_size is None else batch_size
    lr = recipe.lr if lr is None else lr
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")

    dataset = dataset if dataset is not None else load_dataset(data)
    train_x, train_y = dataset.part("train")
    steps_per_epoch = math.ceil(len(train_x) / batch_size)
    total_steps = epochs * steps_per_epoch
    warmup_steps = max(1, round(total_steps * recipe.lr_warmup_fraction))
    norm_kwargs = {**recipe.norm_kwargs.get(norm, {}), **(norm_kwargs or {})}
    if norm in WARMUP_KINDS and "warmup_iters" not in norm_kwargs:
        norm_kwargs["warmup_iters"] = norm_warmup_iters(total_steps, recipe.norm_warmup_fraction)

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    net = build_model(recipe, dataset, norm, norm_kwargs, norm_first)
    optimizer = torch.optim.AdamW(
        parameter_groups(net, recipe.weight_decay), lr=lr, betas=(0.9, 0.999)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps)
    )

    history: list[EpochRecord] = []
    bar = tqdm(total=total_steps, disable=not progress, desc=f"{model}-{data}-{norm}", unit="step")
    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(len(train_x), generator=generator)
        losses = []
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            inputs = train_x[rows]
            if recipe.shift and inputs.ndim == 4:
                inputs = random_shift(inputs, recipe.shift, generator)
            loss = F.cross_entropy(net(inputs), train_y[rows]) + regularization_loss(net)
            if not torch.isfinite(loss):
                bar.close()
                raise TrainingDivergedError(
                    f"training diverged: loss is {loss.item()} at epoch {epoch}, step "
                    f"{bar.n + 1} (norm={norm}, lr={lr}); try a lower --lr"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), recipe.clip_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
        val_accuracy = accuracy(net, *dataset.part("val"))
        record = EpochRecord(
            epoch=epoch,
            train_loss=sum(losses) / len(losses),
            val_accuracy=val_accuracy,
            lr=scheduler.get_last_lr()[0],
            num_filtered=filtered_counts(net),
        )
        history.append(record)
        if log is not None:
            filtered = sum(record.num_filtered.values())
            log(
                f"epoch {epoch}/{epochs}: loss {record.train_loss:.4f}, "
                f"val acc {val_accuracy:.4f}"
                + (f", UN filtered steps {filtered}" if filtered else "")
            )
    bar.close()
    test_accuracy = accuracy(net, *dataset.part("test"))
    if log is not None:
        log(f"test accuracy {test_accuracy:.4f}")

    metadata = {
        "dataset": data,
        "split": dataset.split,
        "preprocessing": dataset.preprocessing,
        "task": model,
        "preset": preset,
        "norm": norm,
        "norm_first": norm_first,
        "recipe": {
            "seed": seed,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": recipe.weight_decay,
            "optimizer": "AdamW",
            "schedule": "linear warm-up then cosine decay",
            "lr_warmup_steps": warmup_steps,
            "total_steps": total_steps,
            "clip_grad_norm": recipe.clip_grad_norm,
            "augmentation": f"random shift up to {recipe.shift} px" if recipe.shift else "none",
            "norm_kwargs": norm_kwargs,
        },
        "test_accuracy": test_accuracy,
        "val_accuracy": history[-1].val_accuracy,
        "num_filtered": filtered_counts(net),
        "history": [
            {"epoch": r.epoch, "train_loss": r.train_loss, "val_accuracy": r.val_accuracy}
            for r in history
        ],
    }
    path = None
    if out is not None:
        metadata["command"] = regenerate_command(
            model, preset, norm, data, seed, norm_first, str(out), overrides
        )
        path = save_checkpoint(net, out, metadata=metadata)
    return FitResult(
        model=net.eval(),
        test_accuracy=test_accuracy,
        val_accuracy=history[-1].val_accuracy,
        history=history,
        metadata=metadata,
        path=path,
        num_filtered=filtered_counts(net),
    )
