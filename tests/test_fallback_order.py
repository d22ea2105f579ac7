"""The cpu drift fallback's order: the first few activations to int16, then all of them, then the
doubling between; a model no file of which meets the bars stops after those two steps; which
activations come first (their error, and what their int16 costs ONNX Runtime)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from converters import export_onnx, fold_norms
from edge_un.models import VisionTransformer
from quant.measure.bars import Bars
from quant.measure.drift import Drift, TensorError
from quant.ort.graph import product_operands
from quant.ort.quantize import quantize_onnx
from quant.pipeline import convert
from quant.targets import PROFILES
from quant.targets.fallback_ladder import (
    SLOW_INT16_PENALTY_DB,
    fallback_order,
    fallback_sizes,
    out_of_reach,
)


def test_all_activations_are_measured_second_then_the_doubling_between() -> None:
    assert fallback_sizes(152) == [4, 152, 8, 16, 32, 64, 128]
    assert fallback_sizes(9) == [4, 9, 8]
    assert fallback_sizes(8) == [4, 8]  # nothing between: the plain doubling
    assert fallback_sizes(3) == [3]


def _drift(agreement: float, drop_pts: float, samples: int) -> Drift:
    return Drift(0.5, 0.5 - drop_pts / 100, drop_pts, agreement, 1.0, 0.0, samples)


def test_a_file_of_all_activations_in_int16_out_of_reach_only_by_more_than_a_few_samples() -> None:
    """Measured cases: ViT-B/16's random weights (all 152 activations in int16: 92 of 100
    samples agree, 7 short of 99 %) are out of reach; the bundled ViT at a 0.0 pt bar (all 74:
    one sample lost, while 16 of them lost none) is not."""
    vit_b16 = _drift(0.92, 0.0, 100)
    assert vit_b16.disagreements == 8 and vit_b16.samples_short(Bars()) == 7
    assert out_of_reach(vit_b16, Bars())
    bundled, tight = _drift(0.999, 0.1, 1000), Bars(max_drift=0.0, min_agreement=0.998)
    assert bundled.samples_short(tight) == 1 and not out_of_reach(bundled, tight)
    assert _drift(0.995, 0.3, 1000).samples_short(Bars()) == 0  # within the bars
    assert _drift(0.97, 1.0, 100).samples_short(Bars()) == 2  # the larger of the two


def test_a_fallback_whose_every_activation_in_int16_misses_tries_no_smaller_set(
    tmp_path: Path,
) -> None:
    """Logits that differ by less than an int16 step of their range (a random head scaled down,
    a bias of 10 for every class), as random weights give: no file orders them as fp32 does.
    At a 100 % agreement bar the cpu target climbs its ladder, widens 4 activations, then all
    of them, and, as that misses too, tries none of the steps between (ViT-B/16's random
    weights went through 7 steps): of the files it measured, the closest to the bars ships."""
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
    widened = len(cpu.excluded[-1].tensors)
    assert widened > 8  # more than the doubling's first two steps
    assert [len(step.tensors) for step in cpu.excluded] == [4, widened]
    assert cpu.status == "over_bar" and cpu.excluded[1].agreement < 1.0
    (note,) = [w for w in cpu.warnings if w.startswith("the drift fallback stopped")]
    assert f"all {widened} ranked activations in int16" in note and "none was tried" in note
    # the file closest to the bars ships, of equals the one with the fewer int16 tensors
    measured = [(cpu.pure_int8_drift or cpu.drift, 0)] + [
        (step, len(step.tensors)) for step in cpu.excluded
    ]
    short = [round((1.0 - d.agreement) * cpu.drift.samples) for d, _ in measured]  # at 100 %
    closest = min(range(len(measured)), key=lambda i: (short[i], measured[i][1]))
    assert len(cpu.int16_tensors) == measured[closest][1]
    assert cpu.drift.agreement == measured[closest][0].agreement


def test_a_tensor_a_product_reads_is_widened_after_cheaper_ones_up_to_a_bit_more_accurate() -> None:
    errors = [
        TensorError("gelu_out", "Gelu", 20.0, 30.0),  # fc2 reads it: slow in int16
        TensorError("fc2_out", "Gemm", 20.0, 32.0),  # a residual Add reads it: cheap
        TensorError("scores", "MatMul", 20.0, 37.0),
        TensorError("k", "Gemm", 20.0, 20.0),  # far worse than any other: first anyway
    ]
    slow = {"gelu_out", "k"}
    assert fallback_order(errors, slow) == ["k", "fc2_out", "gelu_out", "scores"]
    assert fallback_order(errors, set()) == ["k", "gelu_out", "fc2_out", "scores"]
    assert 30.0 + SLOW_INT16_PENALTY_DB < 37.0  # more than a bit apart: the error decides


def test_the_operands_of_a_product_are_found_through_shape_ops() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["a_2d"]),
        helper.make_node("Gemm", ["a_2d", "w"], ["y"]),
        helper.make_node("Add", ["y", "x_2d"], ["z"]),
        helper.make_node("Reshape", ["x", "shape"], ["x_2d"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [4, 4]),
         helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.0] * 16)],
    )  # fmt: skip
    assert product_operands(helper.make_model(graph)) == {"a", "a_2d"}


def test_an_int16_operand_takes_its_product_off_the_integer_kernels(
    vit_onnx: dict, tmp_path: Path
) -> None:
    """Why the order weighs speed: ONNX Runtime runs a Gemm whose input is int16 in float (with
    its weights dequantized at every call); an int16 tensor that no product reads costs none of
    them."""
    fp32 = vit_onnx["fp32"]["cpu"]
    model = onnx.load(str(fp32))
    read_by_products = product_operands(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    plain = tmp_path / "plain.onnx"
    quantize_onnx(fp32, plain, PROFILES["cpu"], vit_onnx["calibration"])
    quantized = sorted(  # the activations the int8 file quantizes: the fallback's candidates
        node.input[0] for node in onnx.load(str(plain)).graph.node
        if node.op_type == "QuantizeLinear" and node.input[0] in producers
    )  # fmt: skip
    # a residual sum the next block's Linear reads (through its Reshape to 2-D), and a tensor
    # no product reads
    gemm_input = next(
        n for n in quantized if producers[n].op_type == "Add" and n in read_by_products
    )
    add_input = next(n for n in quantized if n not in read_by_products)

    def fused_products(int16: list[str]) -> tuple[int, int]:
        path = tmp_path / f"int16-{len(int16)}-{int16[0][-8:] if int16 else ''}.onnx"
        quantize_onnx(fp32, path, PROFILES["cpu"], vit_onnx["calibration"], int16)
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(path.with_suffix(".opt.onnx"))
        options.log_severity_level = 3
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
        return ops.count("QGemm"), ops.count("Gemm") + ops.count("MatMul")

    integer, floating = fused_products([])
    assert floating == 0
    assert fused_products([add_input]) == (integer, 0)
    assert fused_products([gemm_input]) == (integer - 1, 1)
