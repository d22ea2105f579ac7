"""The cpu drift fallback's order: the first few activations to int16, then all of them, then the
doubling between; a model no file of which meets the bars stops after those two steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from converters import export_onnx, fold_norms
from edge_un.models import VisionTransformer
from quant.onnx_target import fallback_sizes
from quant.pipeline import convert
from quant.targets import PROFILES


def test_all_activations_are_measured_second_then_the_doubling_between() -> None:
    assert fallback_sizes(152) == [4, 152, 8, 16, 32, 64, 128]
    assert fallback_sizes(9) == [4, 9, 8]
    assert fallback_sizes(8) == [4, 8]  # nothing between: the plain doubling
    assert fallback_sizes(3) == [3]


def test_a_fallback_whose_every_activation_in_int16_misses_tries_no_smaller_set(
    tmp_path: Path,
) -> None:
    """Logits that differ by less than an int16 step of their range (a random head scaled down,
    a bias of 10 for every class), as random weights give: no file orders them as fp32 does.
    At a 100 % agreement bar the cpu target climbs its ladder, widens 4 activations, then all
    of them, and, as that misses too, ships it without the steps between (ViT-B/16's random
    weights went through 7 steps to the same file)."""
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, in_chans=3, patch_size=8, dim=32, depth=2, heads=2, num_classes=10, norm="un"
    )
    with torch.no_grad():
        model.head.weight.mul_(1e-3)
        model.head.bias.fill_(10.0)
    folded, _ = fold_norms(model.eval())
    onnx_path = tmp_path / "model.onnx"
    export_onnx(folded, (torch.randn(1, 3, 32, 32),), onnx_path, opset=17)
    rng = np.random.default_rng(0)
    calib, evaluation = tmp_path / "calib.npz", tmp_path / "eval.npz"
    np.savez(calib, inputs=rng.standard_normal((64, 3, 32, 32), dtype=np.float32))
    images = rng.standard_normal((100, 3, 32, 32), dtype=np.float32)
    np.savez(evaluation, inputs=images, labels=np.zeros(100, np.int64))

    report = convert(
        onnx_path, targets=[PROFILES["cpu"]], calib=calib, eval=evaluation,
        out_dir=tmp_path / "out", max_drift=100.0, min_agreement=1.0, latency_runs=3,
    )  # fmt: skip
    cpu = report.targets["cpu"]
    widened = len(cpu.int16_tensors)
    assert widened > 8  # more than the doubling's first two steps
    assert [len(step.tensors) for step in cpu.excluded] == [4, widened]
    assert cpu.status == "over_bar" and cpu.drift.agreement == cpu.excluded[1].agreement < 1.0
    (note,) = [w for w in cpu.warnings if w.startswith("the drift fallback stopped")]
    assert f"all {widened} ranked activations in int16" in note and "no smaller set" in note
