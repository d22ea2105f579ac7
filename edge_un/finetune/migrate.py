"""Bring a LayerNorm model to an offline norm (UN by default) without retraining from scratch.

The LayerNorm model itself is the teacher: its LayerNorms are swapped for the offline norm
(weights copied), the new norms' inference statistics are measured on the data, so the student
starts close to the teacher, and a short distillation recovers the rest. Labels are optional.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor, nn

from ..errors import InputError
from ..norms import OFFLINE_KINDS, OfflineNorm, UnifiedNorm
from ..swap import swap_layernorm
from ..training.evaluation import agreement, predict
from ..training.inputs import ModelInputs, head, named
from .engine import FinetuneRecipe, FinetuneResult, distill
from .recalibrate import RecalibrationReport, recalibrate

# A student that agrees with its teacher on this share of the validation samples right after the
# swap is nearly intact: it needs polishing at a fine-tuning learning rate, not the retraining
# rate that a swap which broke the model needs (measured: docs/guides/hugging-face.md). The
# swaps measured: a pre-norm ViT 23 % (retrained), post-norm BERTs 94 % and, at BERT-base size,
# 85 %: one epoch at the retraining rate (2e-3) took that one to 62 % agreement, at the polishing
# rate (2e-4) to 93 % and 75.1 % test accuracy (its teacher 74.2 %). So 0.8, not 0.9.
INTACT_AGREEMENT = 0.8


class NothingToMigrateError(InputError):
    """The model has no LayerNorm to replace."""


def migrate(
    model: nn.Module,
    inputs: ModelInputs,
    labels: Tensor | None = None,
    kind: str = "un",
    *,
    recipe: FinetuneRecipe | None = None,
    val_inputs: ModelInputs | None = None,
    val_labels: Tensor | None = None,
    init_batches: int = 20,
    norm_kwargs: dict[str, Any] | None = None,
    polish_lr: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> FinetuneResult:
    """Swap every LayerNorm of a copy of ``model`` for ``kind`` and distil ``model`` into it.

    ``model`` is left untouched (it becomes the frozen teacher). The student's new norms get
    their inference statistics from ``init_batches`` batches of ``inputs`` (and UN's window is
    filled with them), then the student is fine-tuned with :func:`distill`. An edge_un model's
    ``config`` is updated to the new norm, so the result saves as a loadable checkpoint; a
    Hugging Face model records its norms when saved with :func:`edge_un.save_pretrained`.
    ``inputs`` is a tensor, or named tensors for a model taking several (see
    :mod:`edge_un.training.inputs`).
    With ``polish_lr``, a student that already agrees with its teacher on at least
    ``INTACT_AGREEMENT`` of the validation samples is fine-tuned at that learning rate instead of
    ``recipe.lr``. ``result.extras`` holds the agreement with the teacher before fine-tuning.
    """
    recipe = recipe or FinetuneRecipe(epochs=20, lr=1e-3)
    inputs = named(inputs)
    teacher = copy.deepcopy(model).eval()
    kwargs = dict(norm_kwargs or {})
    student, swapped, report = migration_student(
        model, inputs, kind, batches=init_batches, batch_size=recipe.batch_size, norm_kwargs=kwargs
    )
    check = val_inputs if val_inputs is not None else head(inputs, 500)
    initial = agreement(predict(student, check), predict(teacher, check))
    if log is not None:
        log(f"swapped {swapped} LayerNorm(s) for {kind}; agreement with the teacher before "
            f"fine-tuning {initial:.4f}")  # fmt: skip
    if polish_lr is not None and initial >= INTACT_AGREEMENT:
        recipe = replace(recipe, lr=polish_lr)
        if log is not None:
            log(f"nearly intact (>= {INTACT_AGREEMENT:.0%} agreement): polishing at lr "
                f"{polish_lr:g}")  # fmt: skip
    result = distill(
        student, teacher, inputs, labels, recipe=recipe, val_inputs=val_inputs,
        val_labels=val_labels, progress=progress, log=log, desc=f"migrate to {kind}",
    )  # fmt: skip
    _record_norm_in_config(student, kind, {**kwargs, **_warmup_kwargs(result)})
    result.extras.update(
        swapped=swapped, initial_agreement=initial, init_statistics=report.as_dict()
    )
    return result


def migration_student(
    model: nn.Module,
    inputs: ModelInputs,
    kind: str = "un",
    *,
    batches: int = 20,
    batch_size: int = 32,
    norm_kwargs: dict[str, Any] | None = None,
) -> tuple[nn.Module, int, RecalibrationReport]:
    """The student :func:`migrate` starts from, before any fine-tuning: a copy of ``model``
    with every LayerNorm swapped for ``kind`` (weights copied), its new norms' inference
    statistics measured on ``batches`` batches of ``inputs`` (UN's window filled with them), and
    an edge_un model's ``config`` naming the new norm. ``model`` is left untouched.

    Returns (the student, how many LayerNorms were swapped, the statistics' report). Raises
    :class:`NothingToMigrateError` if the model has no LayerNorm."""
    if kind not in OFFLINE_KINDS:
        raise InputError(f"migrate to an offline norm ({', '.join(OFFLINE_KINDS)}), not {kind!r}")
    student = copy.deepcopy(model)
    kwargs = dict(norm_kwargs or {})
    swapped = swap_layernorm(student, kind, **kwargs)
    if swapped == 0:
        raise NothingToMigrateError("the model has no LayerNorm to migrate")
    _record_norm_in_config(student, kind, kwargs)
    report = recalibrate(student, inputs, batches=batches, batch_size=batch_size)
    _fill_windows(student)
    return student, swapped, report


def _fill_windows(model: nn.Module) -> None:
    """UN's window of recent statistics starts as the measured ones, not zeros."""
    for module in model.modules():
        if isinstance(module, UnifiedNorm):
            module.window_x2.copy_(module.running_var.expand_as(module.window_x2))


def _warmup_kwargs(result: FinetuneResult) -> dict[str, Any]:
    values = set(result.norm_warmup_iters.values())
    return {"warmup_iters": values.pop()} if len(values) == 1 else {}


def _record_norm_in_config(model: nn.Module, kind: str, kwargs: dict[str, Any]) -> None:
    """edge_un models rebuild from ``config``: it must name the norm the model now has."""
    config = getattr(model, "config", None)
    if isinstance(config, dict) and "norm" in config:
        eps = {m.eps for m in model.modules() if isinstance(m, OfflineNorm)}
        extra = {"eps": eps.pop()} if len(eps) == 1 and eps != {1e-5} else {}
        model.config = {**config, "norm": kind, "norm_kwargs": {**kwargs, **extra}}
