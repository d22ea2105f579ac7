"""What a fine-tuned checkpoint says about itself: source, recipe, teacher and student accuracy.

The source's data set, split and preprocessing are carried over unchanged, so every consumer
(the converter's test-split check, calibration for int8) still finds the exact data the model
expects; the source's own training record moves under ``source``. An edge_un model is written
as a ``.safetensors`` checkpoint, a Hugging Face model as a ``save_pretrained`` directory whose
``config.json`` holds the same metadata under ``edge_un``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ..checkpoint import save_checkpoint
from ..hf import is_pretrained_model, save_pretrained
from ..training.evaluation import accuracy_of, agreement, predict
from ..training.inputs import ModelInputs
from ..training.loop import LR_SCHEDULE, OPTIMIZER
from .engine import FinetuneResult

# Keys of the source's metadata that describe the data, not the source's own training
# (model_inputs: how a Hugging Face model's inputs are made from the data set's).
DATA_KEYS = ("dataset", "split", "preprocessing", "model_inputs", "task", "preset", "norm_first")


def finetune_metadata(
    result: FinetuneResult,
    purpose: str,
    source: str,
    source_metadata: Mapping[str, Any] | None = None,
    test: tuple[ModelInputs, Tensor] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Metadata for a fine-tuned checkpoint. ``purpose`` is "migrate" or "int8-ready";
    ``test`` (inputs, labels) adds teacher and student test accuracy and their agreement."""
    source_metadata = dict(source_metadata or {})
    metadata: dict[str, Any] = {k: source_metadata[k] for k in DATA_KEYS if k in source_metadata}
    kinds = {m.kind for m in result.model.modules() if isinstance(getattr(m, "kind", None), str)}
    config = getattr(result.model, "config", None)
    # edge_un models name their norm in a config dict; a Hugging Face config is an object.
    recorded = config.get("norm") if isinstance(config, Mapping) else None
    metadata["norm"] = recorded or ",".join(sorted(kinds))
    recipe = result.recipe.to_dict()
    recipe.update(
        optimizer=OPTIMIZER,
        schedule=LR_SCHEDULE,
        loss="T^2 KL(teacher || student) at temperature T"
        + (", mixed with cross-entropy on labels" if result.recipe.label_weight else "")
        if result.recipe.distill
        else "cross-entropy on labels only",
        total_steps=result.total_steps,
        norm_warmup_iters=result.norm_warmup_iters,
    )
    extras = {k: v for k, v in result.extras.items() if k != "num_filtered"}
    metadata["finetune"] = {
        "purpose": purpose,
        "source": source,
        "recipe": recipe,
        **extras,
        "history": result.history_dicts(),
    }
    if result.kept is not None:
        metadata["finetune"]["kept_epoch"] = result.kept.epoch
    metadata["recipe"] = recipe
    metadata["source"] = {
        "path": source,
        **{k: source_metadata[k] for k in ("test_accuracy", "recipe", "command", "norm")
           if k in source_metadata},
    }  # fmt: skip
    if result.val_accuracy is not None:
        metadata["val_accuracy"] = result.val_accuracy
    metadata["val_agreement_with_teacher"] = result.val_agreement
    if test is not None:
        inputs, labels = test
        student, teacher = predict(result.model, inputs), predict(result.teacher, inputs)
        metadata["test_accuracy"] = accuracy_of(student, labels)
        metadata["teacher_test_accuracy"] = accuracy_of(teacher, labels)
        metadata["test_agreement_with_teacher"] = agreement(student, teacher)
    if command is not None:
        metadata["command"] = command
    return metadata


def save_finetuned(result: FinetuneResult, path: str | Path, metadata: dict[str, Any]) -> Path:
    """Write the fine-tuned student with ``metadata`` (see :func:`finetune_metadata`): a
    Hugging Face model as the directory ``path``, an edge_un model as the file ``path``."""
    if is_pretrained_model(result.model):
        return save_pretrained(result.model, path, metadata=metadata)
    return save_checkpoint(result.model, path, metadata=metadata)
