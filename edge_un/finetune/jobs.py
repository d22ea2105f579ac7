"""Checkpoint in, checkpoint out: the whole migrate / int8-ready job behind the CLI verbs.

Data comes from the checkpoint's own record (its data set, split and preprocessing, so a
tokenizer or pixel scaling is never refitted), from a named data set, or from an ``.npz`` file
with ``inputs`` (and optionally ``labels``, ``val_inputs``, ``val_labels``) already in model
input form.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checkpoint import CheckpointInfo, load_checkpoint
from ..data import UnknownDatasetError, checkpoint_dataset, load_dataset
from ..training.presets import PRESETS
from .engine import FinetuneRecipe, FinetuneResult
from .int8_ready import make_int8_ready
from .migrate import migrate
from .recalibrate import recalibrate
from .record import finetune_metadata, save_finetuned

NPZ_KEYS = ("inputs", "labels", "val_inputs", "val_labels")
# The recipes benchmarks/finetune.py measured (ViT on MNIST-5k): see benchmarks/results.
DEFAULTS: dict[str, dict[str, Any]] = {
    "migrate": {"epochs": 20, "lr": 1e-3},
    "int8-ready": {"epochs": 10, "lr": 5e-4},
}


class FinetuneDataError(ValueError):
    """No usable data for a fine-tune; the message says what to pass."""


@dataclass(frozen=True)
class FinetuneData:
    inputs: Tensor
    labels: Tensor | None
    val_inputs: Tensor | None
    val_labels: Tensor | None
    test: tuple[Tensor, Tensor] | None
    description: str
    shift: int = 0  # the source recipe's image augmentation, reused


def load_finetune_data(
    info: CheckpointInfo, data: str | None = None, npz: str | Path | None = None
) -> FinetuneData:
    """Training (and validation / test) data for fine-tuning the checkpoint ``info``."""
    if data is not None and npz is not None:
        raise FinetuneDataError("give --data or --npz, not both")
    if npz is not None:
        return _npz_data(Path(npz))
    recorded = info.metadata.get("dataset")
    if data is not None and recorded is not None and data != recorded:
        raise FinetuneDataError(
            f"{info.path.name} was trained on {recorded!r}, not {data!r}: its inputs are "
            f"preprocessed for {recorded!r}"
        )
    name = data or recorded
    if name is None:
        raise FinetuneDataError(
            f"{info.path.name} records no data set: pass --data NAME or --npz FILE"
        )
    try:
        dataset = checkpoint_dataset(info) if recorded else load_dataset(name)
    except UnknownDatasetError as error:
        raise FinetuneDataError(str(error)) from None
    preset = PRESETS.get((info.metadata.get("task", ""), info.metadata.get("preset", "")))
    return FinetuneData(
        *dataset.part("train"), *dataset.part("val"), test=dataset.part("test"),
        description=f"{name} (train {len(dataset.part('train')[0])})",
        shift=preset.shift if preset is not None else 0,
    )  # fmt: skip


def _npz_data(path: Path) -> FinetuneData:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in NPZ_KEYS if k in archive.files}
    except (OSError, ValueError) as error:
        raise FinetuneDataError(f"{path}: not a readable .npz file ({error})") from None
    if "inputs" not in arrays:
        raise FinetuneDataError(f"{path}: no 'inputs' array (keys: {', '.join(NPZ_KEYS)})")

    def tensor(key: str) -> Tensor | None:
        if key not in arrays:
            return None
        value = torch.from_numpy(arrays[key])
        if key.endswith("labels"):
            return value.long()
        return value if not value.is_floating_point() else value.float()

    return FinetuneData(
        tensor("inputs"), tensor("labels"), tensor("val_inputs"), tensor("val_labels"),
        test=None, description=f"{path.name} ({len(arrays['inputs'])} inputs)",
    )  # fmt: skip


def run_job(
    purpose: str,
    checkpoint: str | Path,
    out: str | Path,
    *,
    data: str | None = None,
    npz: str | Path | None = None,
    recipe_overrides: dict[str, Any] | None = None,
    use_labels: bool = True,
    recalibrate_batches: int = 0,
    job_options: dict[str, Any] | None = None,
    argv: Sequence[str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> tuple[Path, dict[str, Any]]:
    """Load ``checkpoint``, run ``purpose`` ("migrate" or "int8-ready"), optionally recalibrate
    the inference statistics over ``recalibrate_batches`` batches, save to ``out``.
    Returns the written path and its metadata."""
    model, info = load_checkpoint(checkpoint)
    source = load_finetune_data(info, data, npz)
    labels = source.labels if use_labels else None
    overrides = {k: v for k, v in (recipe_overrides or {}).items() if v is not None}
    if purpose not in DEFAULTS:
        raise ValueError(f"unknown fine-tune purpose {purpose!r}")
    recipe = FinetuneRecipe(**{**DEFAULTS[purpose], "shift": source.shift, **overrides})
    options = dict(job_options or {})
    run = migrate if purpose == "migrate" else make_int8_ready
    result: FinetuneResult = run(
        model, source.inputs, labels, recipe=recipe, val_inputs=source.val_inputs,
        val_labels=source.val_labels, progress=progress, log=log, **options,
    )  # fmt: skip
    if recalibrate_batches:
        report = recalibrate(result.model, source.inputs, batches=recalibrate_batches)
        result.extras["recalibration"] = report.as_dict()
    command = shlex.join(["edge-un", *argv]) if argv is not None else None
    metadata = finetune_metadata(
        result, purpose, str(checkpoint), info.metadata, test=source.test, command=command
    )
    metadata["finetune"]["data"] = source.description
    return save_finetuned(result, out, metadata), metadata
