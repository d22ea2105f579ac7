"""Norm statistics and TID written out by hand, from the activations a forward pass feeds each
offline norm, for tests that check what ``edge_un.recalibrate`` reports (not a test module).

TID (training-inference discrepancy, Wang et al., NeurIPS 2022) of one layer over a list of
batches: the mean over batches of ``||sqrt(var_B) - sqrt(var)|| / ||sqrt(var)||``, plus
``||mu_B - mu|| / ||sqrt(var)||`` for a norm that subtracts a mean; ``var_B`` is the batch's
variance over its non-pad tokens (its mean square for a norm that does not centre).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edge_un.norms import OfflineNorm


def centred(norm: nn.Module) -> bool:
    return "running_mean" in dict(norm.named_buffers())


@torch.no_grad()
def norm_inputs(model: nn.Module, batch: Tensor) -> dict[str, Tensor]:
    """{norm name: its input's non-pad tokens, (tokens, C) float64} for one eval forward."""
    seen: dict[str, Tensor] = {}

    def hook(name: str):
        def capture(_: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0].double()
            pad = args[1] if len(args) > 1 else kwargs.get("pad_mask")
            seen[name] = x.reshape(-1, x.shape[-1]) if pad is None else x[~pad]

        return capture

    handles = [
        module.register_forward_pre_hook(hook(name), with_kwargs=True)
        for name, module in model.named_modules()
        if isinstance(module, OfflineNorm)
    ]
    try:
        model.eval()
        model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def batch_statistics(tokens: Tensor, centre: bool) -> tuple[Tensor | None, Tensor]:
    """(mean or None, variance about it or mean square) per channel of (tokens, C)."""
    if not centre:
        return None, tokens.square().mean(0)
    mean = tokens.mean(0)
    return mean, (tokens - mean).square().mean(0)


def tid(statistics: list[tuple[Tensor | None, Tensor]], mean: Tensor | None, var: Tensor) -> float:
    std = var.double().sqrt()
    gaps = []
    for batch_mean, batch_var in statistics:
        gap = (batch_var.sqrt() - std).norm() / std.norm()
        if mean is not None:
            gap = gap + (batch_mean - mean.double()).norm() / std.norm()
        gaps.append(float(gap))
    return sum(gaps) / len(gaps)


def recalibration_batches(inputs: Tensor, batches: int, batch_size: int, seed: int = 0):
    """The batches ``edge_un.recalibrate`` draws: a seeded permutation of the samples, cut."""
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    order = order[: batches * batch_size]
    return [inputs[order[i : i + batch_size]] for i in range(0, len(order), batch_size)]
