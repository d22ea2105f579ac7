"""One distillation engine for every fine-tune: a frozen teacher, a student, the same loop.

Migration (LayerNorm -> UN) and the int8-ready fine-tune are the same job with a different
student and a different extra loss: the student matches the teacher's temperature-softened
logits (KL), plus the label loss when labels exist. Distillation needs no labels, so a user can
migrate a model on unlabelled data from their own deployment.

Inputs are named, batch-first tensors (:mod:`.inputs`): one tensor for edge_un's own models,
several keyword inputs for a Hugging Face model (``input_ids`` with ``attention_mask``); every
batch takes the same rows of each.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..norms import PowerNormStar, UnifiedNorm, regularization_loss
from ..training.fit import (
    EVAL_BATCH,
    TrainingDivergedError,
    filtered_counts,
    lr_factor,
    parameter_groups,
    random_shift,
)
from .inputs import Inputs, ModelInputs, batches, count, forward, head, is_image, named, rows

# Called after every training forward of the student; returns a scalar added to the loss.
ExtraLoss = Callable[[nn.Module], Tensor]


@dataclass(frozen=True)
class FinetuneRecipe:
    """How a fine-tune runs. ``label_weight`` weights cross-entropy against the distillation
    term when labels exist (``distill=False``: labels only, the ablation)."""

    epochs: int = 10
    batch_size: int = 32
    lr: float = 5e-4
    weight_decay: float = 0.05
    lr_warmup_fraction: float = 0.05  # linear warm-up over this share of steps, then cosine
    norm_warmup_fraction: float = 0.08  # UN / PN warm-up (batch statistics) as a share of steps
    temperature: float = 2.0
    label_weight: float = 0.5
    distill: bool = True
    clip_grad_norm: float = 1.0
    shift: int = 0  # random translation of images by up to this many pixels
    seed: int = 0
    # Keep the epoch (0: the student as it started) whose validation agreement with the teacher
    # is highest, instead of the last: a short fine-tune of a nearly intact student can only
    # drift from its teacher, and validation says when it did.
    keep_best: bool = False

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.label_weight <= 1.0:
            raise ValueError(f"label_weight must be in [0, 1], got {self.label_weight}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    extra_loss: float
    val_accuracy: float | None  # None without validation labels
    val_agreement: float  # top-1 agreement with the teacher


@dataclass
class FinetuneResult:
    """The fine-tuned student (eval mode) and what the run measured."""

    model: nn.Module
    teacher: nn.Module
    recipe: FinetuneRecipe
    history: list[EpochRecord]
    total_steps: int
    norm_warmup_iters: dict[str, int] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    # The epoch whose weights ``model`` holds (0: as it started); None: the last one.
    kept: EpochRecord | None = None

    @property
    def final(self) -> EpochRecord:
        return self.kept if self.kept is not None else self.history[-1]

    @property
    def val_agreement(self) -> float:
        return self.final.val_agreement

    @property
    def val_accuracy(self) -> float | None:
        return self.final.val_accuracy

    def history_dicts(self) -> list[dict[str, Any]]:
        return [asdict(record) for record in self.history]


@torch.no_grad()
def predict(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """Eval-mode logits in batches; NaN/Inf is divergence, not a low score."""
    model.eval()
    logits = torch.cat([forward(model, batch) for batch in batches(named(inputs), EVAL_BATCH)])
    if not torch.isfinite(logits).all():
        raise TrainingDivergedError("model outputs NaN/Inf in eval mode")
    return logits


def agreement(a: Tensor, b: Tensor) -> float:
    """Share of rows whose top-1 class is the same in two logit tensors."""
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def accuracy_of(logits: Tensor, labels: Tensor) -> float:
    return float((logits.argmax(-1) == labels).double().mean())


def scale_norm_warmup(model: nn.Module, steps: int) -> dict[str, int]:
    """Give every UN / PN layer ``steps`` steps of warm-up (batch statistics) from its current
    step count: a migrated norm starts at step 0, an already trained one re-enters a short
    warm-up, so the new weights never meet a stale window. Returns the new warmup_iters."""
    scaled = {}
    for name, module in model.named_modules():
        if isinstance(module, (UnifiedNorm, PowerNormStar)):
            module.warmup_iters = int(module.num_steps) + steps
            scaled[name] = module.warmup_iters
    return scaled


def augment(batch: Inputs, recipe: FinetuneRecipe, generator: torch.Generator) -> Inputs:
    """The recipe's random shift applied to every image input; other inputs pass unchanged."""
    if not recipe.shift:
        return batch
    return {
        name: random_shift(tensor, recipe.shift, generator) if is_image(tensor) else tensor
        for name, tensor in batch.items()
    }


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    labels: Tensor | None,
    recipe: FinetuneRecipe,
) -> Tensor:
    """Hinton's loss: T^2 * KL(teacher_T || student_T), mixed with cross-entropy on labels."""
    if not recipe.distill:
        if labels is None:
            raise ValueError("distill=False (labels only) needs labels")
        return F.cross_entropy(student_logits, labels)
    assert teacher_logits is not None
    t = recipe.temperature
    kl = F.kl_div(
        F.log_softmax(student_logits / t, dim=-1),
        F.log_softmax(teacher_logits / t, dim=-1),
        log_target=True,
        reduction="batchmean",
    ) * (t * t)
    if labels is None or recipe.label_weight == 0.0:
        return kl
    w = recipe.label_weight
    return (1.0 - w) * kl + w * F.cross_entropy(student_logits, labels)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    inputs: ModelInputs,
    labels: Tensor | None = None,
    *,
    recipe: FinetuneRecipe | None = None,
    val_inputs: ModelInputs | None = None,
    val_labels: Tensor | None = None,
    extra_loss: ExtraLoss | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    desc: str = "fine-tune",
) -> FinetuneResult:
    """Fine-tune ``student`` in place to match the frozen ``teacher`` on ``inputs`` (a tensor,
    or named tensors for a model taking several inputs: see :mod:`.inputs`).

    AdamW (decay on matrices only) with a linear warm-up then cosine decay, gradient clipping,
    UN/PN warm-up scaled to the run, RBN's penalty when present, ``extra_loss(student)`` after
    every forward. Validation each epoch: student accuracy (with ``val_labels``) and top-1
    agreement with the teacher; without ``val_inputs`` the first 500 training inputs are used
    for agreement. With ``recipe.keep_best`` the student ends with the weights of the epoch
    (0: as it started) that agreed best with the teacher on validation. Raises
    TrainingDivergedError as soon as the loss is NaN/Inf.
    """
    recipe = recipe or FinetuneRecipe()
    inputs = named(inputs)
    samples = count(inputs)
    if labels is not None and len(labels) != samples:
        raise ValueError(f"{samples} inputs but {len(labels)} labels")
    if samples == 0:
        raise ValueError("no training inputs")
    if val_inputs is None:  # agreement only, on the first training inputs
        val, val_labels = head(inputs, 500), None
    else:
        val = named(val_inputs)
    teacher.eval().requires_grad_(False)
    teacher_val = predict(teacher, val)

    steps_per_epoch = math.ceil(samples / recipe.batch_size)
    total_steps = recipe.epochs * steps_per_epoch
    warmup_steps = max(1, round(total_steps * recipe.lr_warmup_fraction))
    norm_warmup = scale_norm_warmup(
        student, max(1, round(total_steps * recipe.norm_warmup_fraction))
    )

    torch.manual_seed(recipe.seed)
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        parameter_groups(student, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.999)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps)
    )
    history: list[EpochRecord] = []
    best: _Best | None = None
    if recipe.keep_best:
        best = _Best(student, _validate(student, teacher_val, val, val_labels, 0, [], []))
        if log is not None:
            log(_epoch_line(best.record, recipe.epochs))
    bar = tqdm(total=total_steps, disable=not progress, desc=desc, unit="step")
    try:
        for epoch in range(1, recipe.epochs + 1):
            student.train()
            order = torch.randperm(samples, generator=generator)
            losses, extras = [], []
            for start in range(0, samples, recipe.batch_size):
                picked = order[start : start + recipe.batch_size]
                batch = augment(rows(inputs, picked), recipe, generator)
                teacher_logits = None
                if recipe.distill:
                    with torch.no_grad():
                        teacher_logits = forward(teacher, batch)
                batch_labels = None if labels is None else labels[picked]
                student_logits = forward(student, batch)
                loss = distillation_loss(student_logits, teacher_logits, batch_labels, recipe)
                loss = loss + regularization_loss(student)
                extra = extra_loss(student) if extra_loss is not None else torch.zeros(())
                total = loss + extra
                if not torch.isfinite(total):
                    raise TrainingDivergedError(
                        f"fine-tune diverged: loss is {total.item()} at epoch {epoch}, step "
                        f"{bar.n + 1} (lr={recipe.lr}); try a lower lr"
                    )
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                nn.utils.clip_grad_norm_(student.parameters(), recipe.clip_grad_norm)
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                extras.append(float(extra.detach()))
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
            history.append(_validate(student, teacher_val, val, val_labels, epoch, losses, extras))
            if log is not None:
                log(_epoch_line(history[-1], recipe.epochs))
            if best is not None:
                best.offer(student, history[-1])
    finally:
        bar.close()
    kept = None
    if best is not None:
        kept = best.restore(student)
        if log is not None:
            log(f"kept epoch {kept.epoch}: the best agreement with the teacher on validation "
                f"({kept.val_agreement:.4f})")  # fmt: skip
    student.eval()
    return FinetuneResult(
        model=student,
        teacher=teacher,
        recipe=recipe,
        history=history,
        total_steps=total_steps,
        norm_warmup_iters=norm_warmup,
        extras={"num_filtered": filtered_counts(student)},
        kept=kept,
    )


class _Best:
    """The weights (parameters and buffers) of the best epoch so far; a later epoch wins ties."""

    def __init__(self, model: nn.Module, record: EpochRecord) -> None:
        self.record = record
        self.state = copy.deepcopy(model.state_dict())

    def offer(self, model: nn.Module, record: EpochRecord) -> None:
        if record.val_agreement >= self.record.val_agreement:
            self.record, self.state = record, copy.deepcopy(model.state_dict())

    def restore(self, model: nn.Module) -> EpochRecord:
        model.load_state_dict(self.state)
        return self.record


def _validate(
    student: nn.Module,
    teacher_val: Tensor,
    val_inputs: Inputs,
    val_labels: Tensor | None,
    epoch: int,
    losses: list[float],
    extras: list[float],
) -> EpochRecord:
    logits = predict(student, val_inputs)
    return EpochRecord(
        epoch=epoch,
        train_loss=sum(losses) / len(losses) if losses else 0.0,
        extra_loss=sum(extras) / len(extras) if extras else 0.0,
        val_accuracy=None if val_labels is None else accuracy_of(logits, val_labels),
        val_agreement=agreement(logits, teacher_val),
    )


def _epoch_line(record: EpochRecord, epochs: int) -> str:
    if record.epoch == 0:
        line = f"epoch 0/{epochs}: before fine-tuning"
    else:
        line = f"epoch {record.epoch}/{epochs}: loss {record.train_loss:.4f}"
    if record.extra_loss:
        line += f", extra {record.extra_loss:.4f}"
    if record.val_accuracy is not None:
        line += f", val acc {record.val_accuracy:.4f}"
    return line + f", agreement with teacher {record.val_agreement:.4f}"
