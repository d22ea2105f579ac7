"""Small models of both families, any norm kind, with trained-looking state, and their inputs;
the bundled trained UN ViT as fp32 ONNX files with its own data (``example_vit_onnx``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import edge_un
from edge_un.models import TextTransformer, VisionTransformer

if TYPE_CHECKING:
    from converters.fold_and_export import FoldedSource

SMALL_VIT = {"img_size": 8, "in_chans": 1, "patch_size": 2, "dim": 16, "depth": 2, "heads": 2,
             "mlp_ratio": 2.0, "num_classes": 10}  # fmt: skip
SMALL_TEXT = {"vocab_size": 50, "max_len": 10, "dim": 16, "depth": 2, "heads": 2,
              "mlp_ratio": 2.0, "num_classes": 2}  # fmt: skip


def model_inputs(model: nn.Module, batch: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if isinstance(model, VisionTransformer):
        size, chans = model.config["img_size"], model.config["in_chans"]
        return torch.randn(batch, chans, size, size, generator=generator)
    ids = torch.randint(1, model.config["vocab_size"], (batch, model.config["max_len"]),
                        generator=generator)  # fmt: skip
    ids[:, -3:] = model.config["pad_id"]
    return ids


def trained_small_model(family: str, kind: str, steps: int = 3, **overrides) -> nn.Module:
    """A small model after a few training steps, so norm statistics are not at their init."""
    torch.manual_seed(0)
    norm_kwargs = {"warmup_iters": 1} if kind in ("un", "pn") else {}
    if family == "vit":
        model = VisionTransformer(**{**SMALL_VIT, **overrides}, norm=kind, norm_kwargs=norm_kwargs)
    else:
        model = TextTransformer(**{**SMALL_TEXT, **overrides}, norm=kind, norm_kwargs=norm_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = model_inputs(model, batch=4 + step)
        loss = model(x).square().mean() + edge_un.regularization_loss(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


class Fp32Exports(dict):
    """A folded model's fp32 ONNX files by target name (``exports["cpu"]``), each exported into
    ``directory`` at its target's opset and batch the first time it is asked for."""

    def __init__(self, folded: FoldedSource, directory: Path) -> None:
        super().__init__()
        self.folded, self.directory = folded, directory

    def __missing__(self, target: str) -> Path:
        from converters.fold_and_export import export_folded
        from quant.targets import PROFILES

        profile = PROFILES[target]
        path = self.directory / f"fp32_{target}.onnx"
        export_folded(self.folded, path, opset=profile.opset,
                      dynamic_batch=not profile.static_batch)  # fmt: skip
        self[target] = path
        return path


def example_vit_onnx(directory: Path) -> dict:
    """The bundled trained UN ViT folded, its fp32 ONNX files per target (exported on demand),
    128 training samples to calibrate and 300 test samples to evaluate with (``test``: the
    whole test split)."""
    from converters.fold_and_export import load_and_fold
    from edge_un import examples
    from quant.samples import checkpoint_samples

    folded = load_and_fold(examples.path("vit-mnist-un"))
    test = checkpoint_samples(folded.info, "test")
    return {
        "dir": directory,
        "fp32": Fp32Exports(folded, directory),
        "calibration": checkpoint_samples(folded.info, "train", 128),
        "evaluation": test.head(300),
        "test": test,
    }
