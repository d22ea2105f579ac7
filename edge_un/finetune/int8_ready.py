"""Fine-tune a UN model so that its pure int8 post-training quantization is accurate.

Why a trained UN model quantizes worse than its LayerNorm twin: once the norms are folded into
the next Linear, a pre-norm block's int8 input to qkv and fc1 is the raw residual stream, the
norm's INPUT. A per-channel norm does not care how large that stream is, so nothing in training
keeps it small: in the bundled UN ViT trained with UN momentum 0.9 it grew from abs max 60 to
over 2000 with depth (LN twin: under 12; retrained with momentum 0.5: to 771) while the signal
each block adds stays small, and a per-tensor int8 scale of ~17 per step drowns it. The fix is
applied where it arises: the model is distilled from its own frozen copy (so it keeps what it
computes) under one of two pressures on that range:

* ``"range"``: a penalty on each norm input's soft abs max (the mean of its top 0.1 % absolute
  values), hinged at ``target``, so streams already small are left alone;
* ``"growth"``: the same penalty with the limit relative to the first norm input's range, so
  it bounds how much the stream grows with depth rather than its absolute scale;
* ``"decay"``: extra L2 decay on the residual branches' output projections (weights and biases
  of ``attn.proj`` and ``mlp.fc2``, or each Hugging Face family's names: see
  ``BRANCH_OUTPUTS``), which is what the stream accumulates;
* ``"fakequant"``: quantization-aware training of those tensors: every norm input, the inputs
  of the branch output projections and every Linear's output go through symmetric per-tensor
  int8 fake quantization
  (scale = the batch's abs max / 127, as MinMax calibration; straight-through gradient), so the
  model learns to compute with the rounding it will meet.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..norms import LayerNorm, OfflineNorm
from ..training.inputs import ModelInputs, batches, call, head, named
from .engine import FinetuneRecipe, FinetuneResult, distill

METHODS: tuple[str, ...] = ("range", "growth", "decay", "fakequant")
# The Linear that ends each residual branch (attention, MLP), by module name suffix, family by
# family (transformers 5's names; BERT's also cover the older ViT, DeiT and Swin):
BRANCH_OUTPUTS: tuple[str, ...] = (
    "attn.proj", "mlp.fc2",  # edge_un's ViT and text model; transformers' ViT, DeiT, Swin (fc2)
    "attention.o_proj",  # ViT, DeiT, Swin
    "output.dense",  # BERT, RoBERTa, ELECTRA: attention.output.dense and output.dense
    "attention.out_lin", "ffn.lin2",  # DistilBERT
    "attention.dense", "ffn_output",  # ALBERT (one shared layer: its modules appear once)
    "attn.c_proj", "mlp.c_proj",  # GPT-2 (Conv1D: a Linear with its weight transposed)
)  # fmt: skip
NORM_TYPES = (OfflineNorm, nn.LayerNorm, LayerNorm)
# transformers' GPT-2 Conv1D computes x @ weight + bias: a Linear, stored transposed. Told apart
# by its class and package, so that this module never imports transformers.
CONV1D = ("Conv1D", "transformers.pytorch_utils")


class NoBranchOutputsError(InputError):
    """The model has none of the residual branch output projections ``decay`` acts on."""


def is_linear(module: nn.Module) -> bool:
    """A Linear layer: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's)."""
    cls = type(module)
    return isinstance(module, nn.Linear) or (cls.__name__, cls.__module__) == CONV1D


def branch_outputs(
    model: nn.Module, names: Sequence[str] = BRANCH_OUTPUTS
) -> list[tuple[str, nn.Module]]:
    """The Linears ending the residual branches (their name ends with one of ``names``), each
    once: a layer shared across depths (ALBERT) is one module."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if is_linear(module) and any(name == n or name.endswith(f".{n}") for n in names)
    ]


def require_branch_outputs(
    model: nn.Module, names: Sequence[str] = BRANCH_OUTPUTS
) -> list[tuple[str, nn.Module]]:
    """:func:`branch_outputs`, or a one-line error naming the method that needs none."""
    found = branch_outputs(model, names)
    if not found:
        raise NoBranchOutputsError(
            f"no residual branch output projection ({', '.join(names)}) found in "
            f"{type(model).__name__}: use --method range (method='range'), which bounds the "
            "norms' inputs and needs no module names"
        )
    return found


def norm_inputs_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every norm (offline or LayerNorm): its input is the tensor folding makes int8."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NORM_TYPES)]


@torch.no_grad()
def residual_ranges(
    model: nn.Module, inputs: ModelInputs, batch_size: int = 256
) -> dict[str, float]:
    """Abs max of every norm's input over ``inputs`` in eval mode, by norm name (what a MinMax
    int8 calibration on the same inputs would see)."""
    ranges: dict[str, float] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            ranges[name] = max(ranges.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in norm_inputs_modules(model)]
    try:
        model.eval()
        for batch in batches(named(inputs), batch_size):
            call(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


class RangePenalty:
    """``weight * mean over norms of relu(soft_absmax(input) - limit) / limit``, where limit is
    ``target`` or, with ``relative``, ``target`` times the first norm input's soft abs max (a
    bound on the stream's growth with depth, which int8 scale-invariance makes what counts).

    Hooks record each norm's input during the student's training forward; calling the penalty
    consumes them. The soft abs max (mean of the top ``top_fraction`` absolute values) moves
    many values per step, not the single largest, and tracks the true maximum closely.
    """

    def __init__(
        self, model: nn.Module, weight: float = 1.0, target: float = 8.0,
        top_fraction: float = 1e-3, relative: bool = False,
    ) -> None:  # fmt: skip
        if weight < 0 or target <= 0 or not 0 < top_fraction <= 1:
            raise InputError("weight >= 0, target > 0 and 0 < top_fraction <= 1 are required")
        self.weight, self.target, self.top_fraction = weight, target, top_fraction
        self.relative = relative
        self._recorded: list[Tensor] = []
        norms = norm_inputs_modules(model)
        self.modules = [name for name, _ in norms]
        self._handles = [m.register_forward_pre_hook(self._record) for _, m in norms]

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            self._recorded.append(args[0])

    def soft_absmax(self, x: Tensor) -> Tensor:
        flat = x.abs().flatten()
        k = max(1, math.ceil(flat.numel() * self.top_fraction))
        return flat.topk(k).values.mean()

    def __call__(self, model: nn.Module) -> Tensor:
        recorded, self._recorded = self._recorded, []
        if not recorded:
            return torch.zeros(())
        ranges = torch.stack([self.soft_absmax(x) for x in recorded])
        # relative: the allowed range is target x the first norm input's (growth with depth).
        limit = self.target * (ranges[0].detach() if self.relative else 1.0)
        return self.weight * (torch.relu(ranges - limit) / limit).mean()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BranchDecay:
    """``weight * sum of squares`` of the residual branches' output projections."""

    def __init__(
        self, model: nn.Module, weight: float = 1e-3, names: Sequence[str] = BRANCH_OUTPUTS
    ) -> None:
        if weight < 0:
            raise InputError(f"weight must be >= 0, got {weight}")
        self.weight = weight
        found = require_branch_outputs(model, names)
        self.modules = [name for name, _ in found]
        self.parameters = [p for _, module in found for p in module.parameters()]

    def __call__(self, model: nn.Module) -> Tensor:
        return self.weight * torch.stack([p.square().sum() for p in self.parameters]).sum()

    def close(self) -> None:
        return None


class FakeQuant:
    """Symmetric per-tensor int8 fake quantization of the int8-bound tensors in training mode.

    Forward pre-hooks replace the input of every norm (the raw residual stream once folded) and
    of each branch output projection with its int8 rounding; the gradient passes straight
    through. Adds no loss term; ``weight`` is unused (kept for one signature).
    """

    def __init__(
        self, model: nn.Module, weight: float = 0.0, names: Sequence[str] = BRANCH_OUTPUTS
    ) -> None:
        inputs = norm_inputs_modules(model) + branch_outputs(model, names)
        self._handles = [m.register_forward_pre_hook(self._quantize) for _, m in inputs]
        # Every Linear's output is an int8 tensor too (qkv, fc1, the branch outputs).
        linears = [(name, m) for name, m in model.named_modules() if is_linear(m)]
        self._handles += [m.register_forward_hook(self._quantize_output) for _, m in linears]
        self.modules = sorted({name for name, _ in inputs + linears})

    @staticmethod
    def _quantize(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not module.training:
            return None
        x = args[0]
        scale = (x.detach().abs().max() / 127.0).clamp(min=1e-8).float()
        zero = torch.zeros((), dtype=torch.int32)
        fake = torch.fake_quantize_per_tensor_affine(x.float(), scale, zero, -127, 127)
        return (fake.to(x.dtype), *args[1:])

    @staticmethod
    def _quantize_output(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if not module.training:
            return output
        return FakeQuant._quantize(module, (output,))[0]

    def __call__(self, model: nn.Module) -> Tensor:
        return torch.zeros(())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


DEFAULT_WEIGHTS = {"range": 1.0, "growth": 0.01, "decay": 3e-3, "fakequant": 0.0}


def make_int8_ready(
    model: nn.Module,
    inputs: ModelInputs,
    labels: Tensor | None = None,
    *,
    method: str = "range",
    weight: float | None = None,
    target: float = 8.0,
    recipe: FinetuneRecipe | None = None,
    val_inputs: ModelInputs | None = None,
    val_labels: Tensor | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> FinetuneResult:
    """Distil a copy of ``model`` from ``model`` (frozen) under a pressure that bounds the
    range of every norm's input, or makes it robust to int8 rounding (``method`` "range",
    "decay" or "fakequant", see the module docstring).

    ``model`` is left untouched. ``result.extras`` holds the per-norm input abs max before and
    after on the first 256 training inputs, the method, its weight and ``applied_to``: the
    modules the pressure acts on (the norms whose input it bounds, the branch output projections
    it decays, the modules whose tensors it fake-quantizes). ``decay`` on a model with none of
    :data:`BRANCH_OUTPUTS` is refused before any training (:class:`NoBranchOutputsError`).
    """
    if method not in METHODS:
        raise InputError(f"unknown int8-ready method {method!r}; expected one of {METHODS}")
    if not any(isinstance(m, OfflineNorm) for m in model.modules()):
        raise InputError("make_int8_ready needs a model with offline norms (migrate it first)")
    if method == "decay":
        require_branch_outputs(model)  # refused before any copy or training
    weight = DEFAULT_WEIGHTS[method] if weight is None else weight
    recipe = recipe or FinetuneRecipe(lr=5e-4)
    teacher = copy.deepcopy(model).eval()
    student = copy.deepcopy(model)
    inputs = named(inputs)
    probe = head(inputs, 256)
    before = residual_ranges(student, probe)
    penalty: RangePenalty | BranchDecay | FakeQuant
    if method in ("range", "growth"):
        penalty = RangePenalty(student, weight=weight, target=target, relative=method == "growth")
    elif method == "decay":
        penalty = BranchDecay(student, weight=weight)
    else:
        penalty = FakeQuant(student)
    try:
        result = distill(
            student, teacher, inputs, labels, recipe=recipe, val_inputs=val_inputs,
            val_labels=val_labels, extra_loss=penalty, progress=progress, log=log,
            desc=f"int8-ready ({method})",
        )  # fmt: skip
    finally:
        penalty.close()
    result.extras.update(
        method=method,
        weight=weight,
        applied_to=penalty.modules,
        target=target if method in ("range", "growth") else None,
        ranges_before=before,
        ranges_after=residual_ranges(student, probe),
    )
    return result
