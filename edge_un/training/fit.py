"""Train a reference Transformer on a real data set with any norm kind, and save the checkpoint.

Recipe: cross-entropy through the one training loop (:mod:`.loop`: AdamW with no decay on
biases, norms and embeddings' 1-D params, linear learning-rate warm-up then cosine decay,
gradient clipping, RBN's penalty added to the loss), UN / PN warm-up scaled to the run length.
Deterministic for a seed on one machine and thread count.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import save_checkpoint
from ..data import Dataset, load_dataset
from ..errors import InputError
from ..models import TextTransformer, VisionTransformer
from ..norms import NORM_KINDS
from .evaluation import accuracy, filtered_counts
from .inputs import Inputs, forward
from .loop import EpochLosses, Schedule, train
from .presets import DEFAULT_DATA, Preset, get_preset

WARMUP_KINDS = ("un", "pn")  # norms whose warmup_iters is scaled to the run length
DATA_FOR_MODEL = {"vit": ("mnist", "digits"), "text": ("rt",)}


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


# -- training ------------------------------------------------------------------------------


class ClassifierRun(NamedTuple):
    history: list[EpochRecord]
    test_accuracy: float


def train_classifier(
    net: nn.Module,
    dataset: Dataset,
    schedule: Schedule,
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    desc: str = "train",
    context: str = "",
) -> ClassifierRun:
    """Train ``net``, a classifier of ``dataset``'s input tensor, with cross-entropy on its
    training split (the one loop, :func:`.loop.train`); validation accuracy after every epoch,
    test accuracy at the end, each logged. ``context`` goes into a divergence error."""
    history: list[EpochRecord] = []

    def validate(epoch: EpochLosses) -> None:
        record = EpochRecord(
            epoch=epoch.epoch,
            train_loss=epoch.train_loss,
            val_accuracy=accuracy(net, *dataset.part("val")),
            lr=epoch.lr,
            num_filtered=filtered_counts(net),
        )
        history.append(record)
        if log is not None:
            filtered = sum(record.num_filtered.values())
            log(
                f"epoch {record.epoch}/{schedule.epochs}: loss {record.train_loss:.4f}, "
                f"val acc {record.val_accuracy:.4f}"
                + (f", UN filtered steps {filtered}" if filtered else "")
            )

    def cross_entropy(batch: Inputs, labels: Tensor | None) -> Tensor:
        return F.cross_entropy(forward(net, batch), labels)

    train(
        net, *dataset.part("train"), schedule, cross_entropy, on_epoch=validate,
        progress=progress, desc=desc, context=context,
    )  # fmt: skip
    test_accuracy = accuracy(net, *dataset.part("test"))
    if log is not None:
        log(f"test accuracy {test_accuracy:.4f}")
    return ClassifierRun(history, test_accuracy)


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
        raise InputError(
            f"model {model} trains on {', '.join(DATA_FOR_MODEL[model])}, not {data!r}"
        )
    if norm not in NORM_KINDS:
        raise InputError(f"unknown norm kind {norm!r}; expected one of {', '.join(NORM_KINDS)}")
    if not norm_first and model != "text":
        raise InputError("post-norm is only available for the text model")
    given = {name: value for name, value in overrides.items() if value is not None}
    schedule = Schedule.of(recipe, seed=seed, **given)

    dataset = dataset if dataset is not None else load_dataset(data)
    samples = len(dataset.part("train")[1])
    norm_kwargs = {**recipe.norm_kwargs.get(norm, {}), **(norm_kwargs or {})}
    if norm in WARMUP_KINDS and "warmup_iters" not in norm_kwargs:
        norm_kwargs["warmup_iters"] = schedule.norm_warmup_steps(samples)

    torch.manual_seed(seed)  # the initial weights; shuffling has the loop's own generator
    net = build_model(recipe, dataset, norm, norm_kwargs, norm_first)
    run = train_classifier(
        net, dataset, schedule, progress=progress, log=log, desc=f"{model}-{data}-{norm}",
        context=f"norm={norm}, lr={schedule.lr}",
    )  # fmt: skip
    history = run.history

    metadata = {
        "dataset": data,
        "split": dataset.split,
        "preprocessing": dataset.preprocessing,
        "task": model,
        "preset": preset,
        "norm": norm,
        "norm_first": norm_first,
        "recipe": {**schedule.record(samples), "norm_kwargs": norm_kwargs},
        "test_accuracy": run.test_accuracy,
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
        test_accuracy=run.test_accuracy,
        val_accuracy=history[-1].val_accuracy,
        history=history,
        metadata=metadata,
        path=path,
        num_filtered=filtered_counts(net),
    )
