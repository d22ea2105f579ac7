"""Precise inference statistics: recompute every offline norm's running statistics from data.

A norm's running statistics are a momentum average taken while the weights were still moving,
so they lag the final weights (and UN's is a geometric mean of a window, not the population
statistic). "Precise BatchNorm" replaces them with the population statistics of the trained
network. Here that is done layer by layer in inference mode, in execution order, so every layer
is calibrated on exactly the inputs it will see at inference (its upstream norms already
recalibrated). Only ``running_var`` (and ``running_mean`` for centred norms) change; weights and
training state (windows, step counters) are untouched.

TID (training-inference discrepancy, Wang et al., NeurIPS 2022) per layer is measured on the
same batches: the mean over batches of ``||sqrt(var_B) - sqrt(var)|| / ||sqrt(var)||`` (plus
``||mu_B - mu|| / ||sqrt(var)||`` for centred norms), where ``var_B``/``mu_B`` are one batch's
statistics and ``var``/``mu`` the inference ones, before and after recalibration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..norms import OfflineNorm
from ..norms.stats import flatten_tokens, masked_mean
from ..training.inputs import Inputs, ModelInputs, call, count, head, named, rows


@dataclass(frozen=True)
class LayerTID:
    tid_before: float
    tid_after: float


@dataclass(frozen=True)
class RecalibrationReport:
    """Per-layer TID before and after, and how much data the statistics came from."""

    layers: dict[str, LayerTID]
    batches: int
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "samples": self.samples,
            "layers": {name: asdict(tid) for name, tid in self.layers.items()},
        }


class _Stop(Exception):
    """Raised by the hook once the layer being calibrated has its input: no need to go on."""


@torch.no_grad()
def recalibrate(
    model: nn.Module,
    inputs: ModelInputs,
    batches: int = 20,
    batch_size: int = 32,
    seed: int = 0,
) -> RecalibrationReport:
    """Recompute the inference statistics of every offline norm of ``model`` over ``batches``
    batches of ``inputs`` (seeded sample; a tensor, or named tensors for a model taking several);
    returns per-layer TID. The model ends in eval mode."""
    if batches < 1 or batch_size < 1:
        raise InputError(f"batches and batch_size must be positive, got {batches}, {batch_size}")
    inputs = named(inputs)
    calls = norm_calls(model, head(inputs, 2))
    norms = [(name, norm) for name, (norm, _) in calls.items()]
    if not norms:
        raise InputError("the model has no offline norm to recalibrate")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(count(inputs), generator=generator)[: batches * batch_size]
    chunks = [rows(inputs, order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    model.eval()
    layers = {}
    for name, norm in norms:
        means, variances = _batch_statistics(model, norm, calls[name][1], chunks)
        before = _tid(norm, means, variances)
        population_var = torch.stack(variances).mean(dim=0)
        if norm.centered:
            population_mean = torch.stack(means).mean(dim=0)
            # E[(x - mu)^2] over all batches = mean of batch variances + spread of batch means.
            spread = torch.stack([(m - population_mean) ** 2 for m in means]).mean(dim=0)
            norm.running_mean.copy_(population_mean)
            population_var = population_var + spread
        norm.running_var.copy_(population_var)
        layers[name] = LayerTID(tid_before=before, tid_after=_tid(norm, means, variances))
    return RecalibrationReport(layers=layers, batches=len(chunks), samples=len(order))


def norm_calls(model: nn.Module, example: Inputs) -> dict[str, tuple[OfflineNorm, int]]:
    """Every offline norm, in the order a forward pass first calls it, with how many times one
    forward calls it: once, or once per depth for a layer shared across depths (ALBERT)."""
    called: dict[str, tuple[OfflineNorm, int]] = {}

    def count(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            called[name] = (module, called.get(name, (module, 0))[1] + 1)

        return hook

    handles = [
        module.register_forward_pre_hook(count(name))
        for name, module in model.named_modules()
        if isinstance(module, OfflineNorm)
    ]
    was_training = model.training
    try:
        model.eval()
        call(model, example)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return called


def _batch_statistics(
    model: nn.Module, norm: OfflineNorm, calls: int, chunks: list[Inputs]
) -> tuple[list[Tensor], list[Tensor]]:
    """Per batch and call: the per-channel mean (centred norms) and variance (quadratic mean
    otherwise) of ``norm``'s input over non-pad positions, the forward stopped after the last of
    its ``calls`` (a shared norm's statistics cover every depth it normalises; its later calls
    see inputs made with its earlier calls' old statistics, one pass's approximation)."""
    means: list[Tensor] = []
    variances: list[Tensor] = []
    seen = 0

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal seen
        x = args[0]
        pad_mask = args[1] if len(args) > 1 else kwargs.get("pad_mask")
        flat, keep = flatten_tokens(x.to(module.running_var.dtype), pad_mask)
        mean = masked_mean(flat, keep) if norm.centered else None
        centred = flat if mean is None else flat - mean
        variances.append(masked_mean(centred * centred, keep))
        if mean is not None:
            means.append(mean)
        seen += 1
        if seen % calls == 0:
            raise _Stop

    handle = norm.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for chunk in chunks:
            with contextlib.suppress(_Stop):
                call(model, chunk)
    finally:
        handle.remove()
    return means, variances


def _tid(norm: OfflineNorm, means: list[Tensor], variances: list[Tensor]) -> float:
    std = torch.sqrt(norm.running_var)
    scale = std.norm()
    gaps = [(torch.sqrt(v) - std).norm() / scale for v in variances]
    if norm.centered:
        offsets = [(m - norm.running_mean).norm() / scale for m in means]
        gaps = [g + o for g, o in zip(gaps, offsets, strict=True)]
    return float(torch.stack(gaps).mean())


def inference_statistics(model: nn.Module) -> dict[str, Tensor]:
    """Copies of every offline norm's inference statistics, by buffer name."""
    stats = {}
    for name, module in model.named_modules():
        if isinstance(module, OfflineNorm):
            stats[f"{name}.running_var"] = module.running_var.clone()
            if module.centered:
                stats[f"{name}.running_mean"] = module.running_mean.clone()
    return stats
