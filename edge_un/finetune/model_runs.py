"""Model in, model out: a whole migrate / int8-ready run behind the CLI verbs.

The model is an edge_un ``.safetensors`` checkpoint or a Hugging Face ``save_pretrained``
directory, and is written back in the same form. Data comes from the model's own record (its
data set, split and preprocessing, so a tokenizer or pixel scaling is never refitted), from a
named data set (edge_un checkpoints), or from an ``.npz`` whose arrays are the model's inputs by
name (``inputs`` for edge_un's one-input models; see :mod:`.npz`).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..checkpoint import CheckpointInfo, load_checkpoint
from ..data import UnknownDatasetError, checkpoint_dataset, load_dataset
from ..errors import InputError
from ..hf import is_pretrained_model, load_pretrained, named_inputs
from ..training.inputs import SINGLE_INPUT, ModelInputs, count, named
from ..training.presets import PRESETS
from .engine import FinetuneRecipe, FinetuneResult
from .int8_ready import make_int8_ready
from .migrate import migrate
from .npz import FinetuneDataError, input_specs, load_npz
from .recalibrate import recalibrate
from .record import finetune_metadata, save_finetuned

# The recipes benchmarks/training/finetune.py measured (ViT on MNIST-5k): see benchmarks/results.
DEFAULTS: dict[str, dict[str, Any]] = {
    "migrate": {"epochs": 20, "lr": 1e-3},
    "int8-ready": {"epochs": 10, "lr": 5e-4},
}
# Hugging Face models: a budget in optimizer steps, not epochs, so that the default takes minutes
# whatever the data set's size (epochs = steps / steps per epoch, at least 1, at most 30). It
# migrates the HF ViT (29 epochs of 3500 images) and BERT (11 epochs of 8965 sentences) of
# benchmarks/training/hf_migrate.py to within 0.5 pt of their teachers in minutes on 2 cores (docs/
# guides/hugging-face.md); 800 steps left a ViT taught for 120 epochs 0.6 pt short. Migration
# keeps its best epoch by validation agreement with the teacher, and a swap that left the model
# nearly intact (BERT's post-norm blocks: 94 % agreement before fine-tuning; the ViT's pre-norm
# ones: 23 %) is polished at 2e-4: at 2e-3 the BERT lost 1.1-1.4 pt on two of three seeds.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "migrate": {"steps": 1600, "batch_size": 64, "lr": 2e-3, "keep_best": True},
    "int8-ready": {"steps": 400, "batch_size": 64, "lr": 5e-4},
}
HF_POLISH_LR = 2e-4  # migrate's learning rate for a nearly intact swap (migrate.INTACT_AGREEMENT)
MAX_DEFAULT_EPOCHS = 30


@dataclass(frozen=True)
class FinetuneData:
    """Inputs are a tensor for edge_un's one-input models, named tensors for a Hugging Face
    model (see :mod:`edge_un.training.inputs`)."""

    inputs: ModelInputs
    labels: Tensor | None
    val_inputs: ModelInputs | None
    val_labels: Tensor | None
    test: tuple[ModelInputs, Tensor] | None
    description: str
    shift: int = 0  # the source recipe's image augmentation, reused


def load_model(path: str | Path) -> tuple[nn.Module, CheckpointInfo]:
    """An edge_un checkpoint file, or a Hugging Face model directory."""
    path = Path(path)
    return load_pretrained(path) if path.is_dir() else load_checkpoint(path)


def load_finetune_data(
    info: CheckpointInfo,
    data: str | None = None,
    npz: str | Path | None = None,
    model: nn.Module | None = None,
) -> FinetuneData:
    """Training (and validation / test) data for fine-tuning ``model``, loaded from ``info``:
    as ``model`` takes it (its named inputs for a Hugging Face model)."""
    if data is not None and npz is not None:
        raise FinetuneDataError("give --data or --npz, not both")
    if npz is not None:
        return _npz_data(Path(npz), model)
    recorded = info.metadata.get("dataset")
    if data is not None and recorded is not None and data != recorded:
        raise FinetuneDataError(
            f"{info.path.name} was trained on {recorded!r}, not {data!r}: its inputs are "
            f"preprocessed for {recorded!r}"
        )
    name = data or recorded
    if name is None or (is_pretrained_model(model) and recorded is None):
        raise FinetuneDataError(f"{info.path.name} records no data set: {_what_to_pass(model)}")
    try:
        dataset = checkpoint_dataset(info) if recorded else load_dataset(name)
    except UnknownDatasetError as error:
        raise FinetuneDataError(str(error)) from None

    def part(which: str) -> tuple[ModelInputs, Tensor]:
        inputs, labels = dataset.part(which)
        return _as_model_takes(model, inputs), labels

    preset = PRESETS.get((info.metadata.get("task", ""), info.metadata.get("preset", "")))
    return FinetuneData(
        *part("train"), *part("val"), test=part("test"),
        description=f"{name} (train {len(dataset.part('train')[1])})",
        shift=preset.shift if preset is not None else 0,
    )  # fmt: skip


def _as_model_takes(model: nn.Module | None, inputs: Tensor) -> ModelInputs:
    """A data set's one tensor as ``model`` takes it: named inputs for a Hugging Face model."""
    if model is not None and is_pretrained_model(model):
        return named_inputs(model, inputs)
    return inputs


def _what_to_pass(model: nn.Module | None) -> str:
    arrays = ", ".join(spec.name for spec in input_specs(model))
    if is_pretrained_model(model):
        # A named data set would be preprocessed by edge_un, not the way this model was trained.
        return f"pass --npz FILE with its inputs ({arrays}) and optionally labels"
    return "pass --data NAME or --npz FILE"


def _npz_data(path: Path, model: nn.Module | None) -> FinetuneData:
    arrays = load_npz(path, model)
    inputs = _as_given(arrays.inputs)
    val_inputs = None if arrays.val_inputs is None else _as_given(arrays.val_inputs)
    return FinetuneData(
        inputs, arrays.labels, val_inputs, arrays.val_labels, test=None,
        description=f"{path.name} ({count(arrays.inputs)} samples: {', '.join(arrays.inputs)})",
    )  # fmt: skip


def _as_given(inputs: dict[str, Tensor]) -> ModelInputs:
    """edge_un's one input stays a bare tensor, as its data sets give it."""
    return inputs[SINGLE_INPUT] if list(inputs) == [SINGLE_INPUT] else inputs


def default_recipe(
    purpose: str, model: nn.Module, samples: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """The recipe's defaults for ``purpose``; a Hugging Face model's epochs come from its step
    budget at the batch size the run will use."""
    if purpose not in DEFAULTS:
        raise InputError(f"unknown fine-tune purpose {purpose!r}")
    if not is_pretrained_model(model):
        return dict(DEFAULTS[purpose])
    defaults = dict(HF_DEFAULTS[purpose])
    steps = defaults.pop("steps")
    batch_size = max(1, overrides.get("batch_size", defaults["batch_size"]))  # <1: refused later
    steps_per_epoch = math.ceil(samples / batch_size)
    defaults["epochs"] = min(MAX_DEFAULT_EPOCHS, max(1, round(steps / steps_per_epoch)))
    return defaults


def check_out(source: Path, out: Path, model: nn.Module) -> None:
    """Refuse, before any training, an output that would overwrite the source or that cannot
    hold the model (a Hugging Face model is a directory)."""
    if out.resolve() == source.resolve():
        raise InputError(f"--out {out} is the source itself: write the fine-tuned model elsewhere")
    if is_pretrained_model(model) and (out.is_file() or out.suffix == ".safetensors"):
        raise InputError(
            f"--out {out}: a Hugging Face model is written as a directory (config.json + "
            "model.safetensors); give a directory path"
        )


def finetune_model(
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
    """Load ``checkpoint`` (a file or a Hugging Face directory), run ``purpose`` ("migrate" or
    "int8-ready"), optionally recalibrate the inference statistics over
    ``recalibrate_batches`` batches, save to ``out`` in the same form.
    Returns the written path and its metadata."""
    model, info = load_model(checkpoint)
    check_out(Path(checkpoint), Path(out), model)
    source = load_finetune_data(info, data, npz, model)
    labels = source.labels if use_labels else None
    overrides = {k: v for k, v in (recipe_overrides or {}).items() if v is not None}
    defaults = default_recipe(purpose, model, count(named(source.inputs)), overrides)
    recipe = FinetuneRecipe(**{**defaults, "shift": source.shift, **overrides})
    options = dict(job_options or {})
    if purpose == "migrate" and is_pretrained_model(model) and "lr" not in overrides:
        options.setdefault("polish_lr", HF_POLISH_LR)
    run = migrate if purpose == "migrate" else make_int8_ready
    if log is not None:
        log(f"{purpose}: {Path(checkpoint).name} on {source.description}, {_recipe_line(recipe)}")
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


def _recipe_line(recipe: FinetuneRecipe) -> str:
    return f"{recipe.epochs} epoch(s) of batch {recipe.batch_size} at lr {recipe.lr:g}"
