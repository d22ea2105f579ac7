"""One distillation engine for every fine-tune: a frozen teacher, a student, the one training
loop (:mod:`edge_un.training.loop`, which training from scratch takes its steps in too).

Migration (LayerNorm -> UN) and the int8-ready fine-tune are the same job with a different
student and a different extra loss: the student matches the teacher's temperature-softened
logits (KL), plus the label loss when labels exist. Distillation needs no labels, so a user can
migrate a model on unlabelled data from their own deployment.

Inputs are named, batch-first tensors (:mod:`edge_un.training.inputs`): one tensor for edge_un's
own models, several keyword inputs for a Hugging Face model (``input_ids`` with
``attention_mask``); every batch takes the same rows of each.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..norms import PowerNormStar, UnifiedNorm
from ..training.evaluation import accuracy_of, agreement, filtered_counts, predict
from ..training.inputs import Inputs, ModelInputs, count, forward, head, named
from ..training.loop import EpochLosses, ExtraLoss, Schedule, train
from .recalibrate import norm_calls


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
        self.schedule()  # refuses a non-positive epochs, batch_size or lr
        if not self.temperature > 0:
            raise InputError(f"temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.label_weight <= 1.0:
            raise InputError(f"label_weight must be in [0, 1], got {self.label_weight}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def schedule(self) -> Schedule:
        return Schedule.of(self)


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


def scale_norm_warmup(
    model: nn.Module, steps: int, calls: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Give every UN / PN layer ``steps`` steps of warm-up (batch statistics) from its current
    step count: a migrated norm starts at step 0, an already trained one re-enters a short
    warm-up, so the new weights never meet a stale window. A norm counts its calls, so one that
    ``calls`` says a forward calls k times (a layer shared across depths) gets k x ``steps``.
    Returns the new warmup_iters."""
    scaled = {}
    for name, module in model.named_modules():
        if isinstance(module, (UnifiedNorm, PowerNormStar)):
            per_step = (calls or {}).get(name, 1)
            module.warmup_iters = int(module.num_steps) + steps * per_step
            scaled[name] = module.warmup_iters
    return scaled


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    labels: Tensor | None,
    recipe: FinetuneRecipe,
) -> Tensor:
    """Hinton's loss: T^2 * KL(teacher_T || student_T), mixed with cross-entropy on labels."""
    if not recipe.distill:
        if labels is None:
            raise InputError("distill=False (labels only) needs labels")
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
    or named tensors for a model taking several inputs: see :mod:`edge_un.training.inputs`).

    The one training loop (:func:`edge_un.training.loop.train`: AdamW with decay on matrices
    only, a linear warm-up then cosine decay, gradient clipping, RBN's penalty when present)
    with :func:`distillation_loss` and ``extra_loss(student)`` after every forward; UN/PN
    warm-up scaled to the run. Validation each epoch: student accuracy (with ``val_labels``)
    and top-1 agreement with the teacher; without ``val_inputs`` the first 500 training inputs
    are used for agreement. With ``recipe.keep_best`` the student ends with the weights of the epoch
    (0: as it started) that agreed best with the teacher on validation. Raises
    TrainingDivergedError as soon as the loss is NaN/Inf.
    """
    recipe = recipe or FinetuneRecipe()
    inputs = named(inputs)
    samples = count(inputs)
    if labels is not None and len(labels) != samples:
        raise InputError(f"{samples} inputs but {len(labels)} labels")
    if samples == 0:
        raise InputError("no training inputs")
    if val_inputs is None:  # agreement only, on the first training inputs
        val, val_labels = head(inputs, 500), None
    else:
        val = named(val_inputs)
    teacher.eval().requires_grad_(False)
    teacher_val = predict(teacher, val)
    schedule = recipe.schedule()
    calls = {name: count for name, (_, count) in norm_calls(student, head(inputs, 2)).items()}
    norm_warmup = scale_norm_warmup(student, schedule.norm_warmup_steps(samples), calls)

    torch.manual_seed(recipe.seed)  # dropout, where the student has any
    history: list[EpochRecord] = []
    best: _Best | None = None
    if recipe.keep_best:
        best = _Best(student, _validate(student, teacher_val, val, val_labels))
        if log is not None:
            log(_epoch_line(best.record, recipe.epochs))

    def student_loss(batch: Inputs, batch_labels: Tensor | None) -> Tensor:
        teacher_logits = None
        if recipe.distill:
            with torch.no_grad():
                teacher_logits = forward(teacher, batch)
        return distillation_loss(forward(student, batch), teacher_logits, batch_labels, recipe)

    def end_epoch(epoch: EpochLosses) -> None:
        history.append(_validate(student, teacher_val, val, val_labels, epoch))
        if log is not None:
            log(_epoch_line(history[-1], recipe.epochs))
        if best is not None:
            best.offer(student, history[-1])

    train(
        student, inputs, labels, schedule, student_loss, extra_loss=extra_loss,
        on_epoch=end_epoch, progress=progress, desc=desc, run="fine-tune",
        context=f"lr={recipe.lr}",
    )  # fmt: skip
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
        total_steps=schedule.total_steps(samples),
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
    epoch: EpochLosses | None = None,
) -> EpochRecord:
    """The student against its teacher on validation after ``epoch`` (None: before training)."""
    logits = predict(student, val_inputs)
    return EpochRecord(
        epoch=0 if epoch is None else epoch.epoch,
        train_loss=0.0 if epoch is None else epoch.train_loss,
        extra_loss=0.0 if epoch is None else epoch.extra_loss,
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
