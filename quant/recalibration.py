"""Precise norm statistics before folding (``convert --recalibrate N``).

An edge_un checkpoint's offline norms carry running statistics that lag the final weights;
:func:`edge_un.recalibrate` recomputes them over N batches of data with the weights frozen. Done
here on the loaded model, before its one fold puts the norms into the Linear layers, and
recorded in the report (per-layer TID before and after, fp32 top-1 before and after).
"""

from __future__ import annotations

import numpy as np
import torch

import edge_un
from converters.loaded_source import LoadedSource

from .errors import QuantError
from .report import schema
from .samples import Samples, checkpoint_samples

RECALIBRATION_BATCH = 32  # edge_un.recalibrate's default batch size


def check_recalibratable(loaded: LoadedSource) -> None:
    """Recalibration needs an edge_un checkpoint with at least one offline norm."""
    from edge_un.norms import OfflineNorm

    name = loaded.source.path.name
    if loaded.is_onnx:
        raise QuantError(
            f"{name}: cannot recalibrate an ONNX model (its norms are already folded into the "
            "weights); convert the checkpoint (.safetensors or .pt) it was exported from"
        )
    if loaded.info is None or not isinstance(loaded.model, torch.nn.Module):
        raise QuantError(
            f"{name}: cannot recalibrate a torch.export program; convert the edge_un checkpoint "
            "(.safetensors or .pt) instead"
        )
    if not any(isinstance(module, OfflineNorm) for module in loaded.model.modules()):
        raise QuantError(f"{name}: the model has no offline norm to recalibrate")


def recalibrate(
    loaded: LoadedSource, data: Samples | None, evaluation: Samples, batches: int
) -> schema.Recalibration:
    """Recompute the offline norms' inference statistics of ``loaded.model`` in place over
    ``batches`` batches of ``data`` (None: the checkpoint's training split), before its fold."""
    model = loaded.model
    if data is None:
        data = checkpoint_samples(loaded.info, "train", batches * RECALIBRATION_BATCH)
    top1_before = _torch_top1(model, evaluation)
    report = edge_un.recalibrate(
        model, torch.from_numpy(data.inputs), batches=batches, batch_size=RECALIBRATION_BATCH
    )
    layers = {name: schema.LayerTID(**vars(tid)) for name, tid in report.layers.items()}
    return schema.Recalibration(
        batches=report.batches,
        batch_size=RECALIBRATION_BATCH,
        samples=report.samples,
        source=data.source,
        mean_tid_before=float(np.mean([t.tid_before for t in layers.values()])),
        mean_tid_after=float(np.mean([t.tid_after for t in layers.values()])),
        top1_fp32_before=top1_before,
        top1_fp32_after=_torch_top1(model, evaluation),
        layers=layers,
    )


@torch.no_grad()
def _torch_top1(model: torch.nn.Module, evaluation: Samples) -> float | None:
    if evaluation.labels is None:
        return None
    model.eval()
    inputs = torch.from_numpy(evaluation.inputs)
    logits = torch.cat([model(inputs[i : i + 256]) for i in range(0, len(inputs), 256)])
    return float((logits.argmax(-1).numpy() == evaluation.labels).mean())


def recalibration_note(recalibration: schema.Recalibration, requested: int | None = None) -> str:
    """One line for the report's notes and the CLI; says so when the data held fewer than the
    ``requested`` batches."""
    short = ""
    if requested is not None and recalibration.batches < requested:
        short = f" (of {requested} asked: the data holds no more)"
    text = (
        f"norm statistics recalibrated before folding: {recalibration.batches} batches{short}, "
        f"{recalibration.samples} samples ({recalibration.source}); mean TID "
        f"{recalibration.mean_tid_before:.4f} -> {recalibration.mean_tid_after:.4f}"
    )
    before, after = recalibration.top1_fp32_before, recalibration.top1_fp32_after
    if before is not None and after is not None:
        text += f"; fp32 top-1 {100 * before:.1f} % -> {100 * after:.1f} %"
    return text
