"""The ONNX Runtime speed rewrites (quant.ort.graph) on the bundled trained UN ViT: the fp32
rewrite computes the same function, the QDQ rewrite leaves every matrix product integer and
makes ORT pick the kernels it is meant to, and the cpu target's file stays within its bars."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quant.measure.bars import DEFAULT_MIN_AGREEMENT
from quant.measure.drift import measure_drift, onnx_runner
from quant.ort.graph import float_inputs, linear_as_gemm
from quant.ort.quantize import quantize_onnx
from quant.targets import PROFILES

CPU = PROFILES["cpu"]


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def ort_optimized(path: Path, out: Path) -> onnx.ModelProto:
    """The graph ONNX Runtime actually runs (after its QDQ fusions)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out)
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(out))


def test_linear_as_gemm_computes_the_same_function(vit_onnx: dict) -> None:
    model = onnx.load(str(vit_onnx["fp32"]["cpu"]))
    before = ops(model)
    count = linear_as_gemm(model)
    after = ops(model)
    # every Linear of the 4 blocks (qkv, proj, fc1, fc2) becomes one Gemm and two Reshapes
    assert count == 16
    assert after["Gemm"] == before["Gemm"] + count
    assert after["MatMul"] == before["MatMul"] - count
    assert after["Add"] == before["Add"] - count
    onnx.checker.check_model(model, full_check=True)
    rewritten = vit_onnx["dir"] / "gemm.onnx"
    onnx.save(model, str(rewritten))
    inputs = vit_onnx["evaluation"].inputs[:64]  # a batch of 64: the dynamic axis still works
    np.testing.assert_allclose(
        onnx_runner(rewritten)(inputs),
        onnx_runner(vit_onnx["fp32"]["cpu"])(inputs),
        rtol=1e-4,
        atol=1e-4,
    )


def test_linear_as_gemm_leaves_a_matmul_whose_output_is_read_twice() -> None:
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    bias = numpy_helper.from_array(np.ones(3, np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("Add", ["y", "b"], ["z"]),
            helper.make_node("Mul", ["y", "z"], ["out"]),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 5, 3])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert linear_as_gemm(model) == 0
    assert ops(model) == Counter({"MatMul": 1, "Add": 1, "Mul": 1})


def test_float_inputs_keep_the_matrix_products_integer_and_ort_fuses_them(vit_onnx: dict) -> None:
    plain = vit_onnx["dir"] / "plain.onnx"
    no_float_inputs = dataclasses.replace(CPU, float_inputs=frozenset())
    quantize_onnx(vit_onnx["fp32"]["cpu"], plain, no_float_inputs, vit_onnx["calibration"])
    model = onnx.load(str(plain))
    assert float_inputs(model, {"Softmax", "Gelu"}) == 8  # 4 blocks x (Softmax, GELU)
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type in ("Softmax", "Gelu"):  # fed in float, by a matrix product
            assert producers[node.input[0]].op_type not in ("DequantizeLinear",), node.name
        if node.op_type in ("MatMul", "Gemm", "Conv"):  # every product still reads int8
            assert all(producers[name].op_type == "DequantizeLinear" for name in node.input)
    read = {name for node in model.graph.node for name in node.input}
    assert all(init.name in read for init in model.graph.initializer)  # no orphan scales
    rewired = vit_onnx["dir"] / "rewired.onnx"
    onnx.save(model, str(rewired))
    before = ops(ort_optimized(plain, vit_onnx["dir"] / "plain.opt.onnx"))
    after = ops(ort_optimized(rewired, vit_onnx["dir"] / "rewired.opt.onnx"))
    assert before["QLinearSoftmax"] == 4 and after["QLinearSoftmax"] == 0
    assert after["Softmax"] == 4 and after["MatMulIntegerToFloat"] == 4


def test_the_cpu_file_with_the_speed_rewrites_stays_within_the_bars(vit_onnx: dict) -> None:
    path = vit_onnx["dir"] / "cpu.onnx"
    quantize_onnx(vit_onnx["fp32"]["cpu"], path, CPU, vit_onnx["calibration"])
    evaluation = vit_onnx["evaluation"]
    reference = onnx_runner(vit_onnx["fp32"]["cpu"])(evaluation.inputs)
    # The bar on the file's exact arithmetic (what the pipeline's bars act on), the same on
    # every host; and on this host's fused int8 kernels, which the rewrites are for: 7-bit
    # weights cannot saturate ORT's AVX2 kernels without VNNI either (tests/test_int8_hosts.py
    # runs the cpu file on an emulated Haswell), so this bound holds there too.
    exact = onnx_runner(path, exact=True)(evaluation.inputs)
    host = onnx_runner(path)(evaluation.inputs)
    for outputs in (exact, host):
        drift = measure_drift(reference, outputs, evaluation.labels)
        assert drift.agreement >= DEFAULT_MIN_AGREEMENT, drift
    assert ops(onnx.load(str(path)))["Gemm"] >= 16


def masked_scores(factor_above_add: float = 1.0) -> onnx.ModelProto:
    """softmax(q @ k^T + mask) on u8 activations, as ORT's quantizer writes a text model's
    attention: the scores, the mask and their sum each a QuantizeLinear/DequantizeLinear pair
    (the sum's DequantizeLinear scale times ``factor_above_add``: a factor folded there)."""
    c = numpy_helper.from_array
    inits = [
        c(np.array(0.05, np.float32), "s"), c(np.array(128, np.uint8), "z"),
        c(np.array(0.12, np.float32), "s_mask"), c(np.array(255, np.uint8), "z_mask"),
        c(np.array(0.15, np.float32), "s_sum"), c(np.array(200, np.uint8), "z_sum"),
        c(np.array(0.15 * factor_above_add, np.float32), "s_sum_dq"),
        c(np.array(1 / 255, np.float32), "s_p"), c(np.array(0, np.uint8), "z_p"),
    ]  # fmt: skip
    nodes: list[onnx.NodeProto] = []

    def pair(name: str, scale: str = "s", zero: str = "z", dq_scale: str | None = None) -> str:
        nodes.extend([
            helper.make_node("QuantizeLinear", [name, scale, zero], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", dq_scale or scale, zero],
                             [f"{name}_dq"]),
        ])  # fmt: skip
        return f"{name}_dq"

    nodes.append(helper.make_node("MatMul", [pair("q"), pair("k_t")], ["scores"]))
    nodes.append(
        helper.make_node("Add", [pair("scores"), pair("mask", "s_mask", "z_mask")], ["sum"])
    )
    nodes.append(helper.make_node("Softmax", [pair("sum", "s_sum", "z_sum", "s_sum_dq")], ["p"]))
    pair("p", "s_p", "z_p")  # the probabilities, quantized for the product with V
    for number, node in enumerate(nodes):
        node.name = f"{node.op_type}_{number}"
    graph = helper.make_graph(
        nodes, "masked",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 6, 4]),
         helper.make_tensor_value_info("k_t", TensorProto.FLOAT, [1, 4, 6]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 6])],
        [helper.make_tensor_value_info("p_dq", TensorProto.FLOAT, [1, 6, 6])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_softmax_after_a_mask_is_fed_in_float_and_the_mask_stays_as_it_is(
    tmp_path: Path,
) -> None:
    """A text model adds its attention mask to the scores before the Softmax: the sum is fed
    in float (MatMulIntegerToFloat, a float Add, a float Softmax) instead of an integer Add
    whose output is requantized to the mask's range and an integer Softmax."""
    rng = np.random.default_rng(0)
    feeds = {
        "q": rng.uniform(-3, 3, (1, 6, 4)).astype(np.float32),
        "k_t": rng.uniform(-3, 3, (1, 4, 6)).astype(np.float32),
        "mask": np.array([[[0, 0, 0, 0, -30, -30]]], np.float32),
    }
    model = masked_scores()
    plain = tmp_path / "plain.onnx"
    onnx.save(model, str(plain))
    assert float_inputs(model, {"Softmax"}) == 1
    producers = {out: node for node in model.graph.node for out in node.output}
    add = producers[next(n for n in model.graph.node if n.op_type == "Softmax").input[0]]
    assert add.op_type == "Add" and producers[add.input[0]].op_type == "MatMul"
    assert producers[add.input[1]].op_type == "DequantizeLinear"  # the mask, as quantized
    rewired = tmp_path / "rewired.onnx"
    onnx.save(model, str(rewired))
    before = ops(ort_optimized(plain, tmp_path / "plain.opt.onnx"))
    after = ops(ort_optimized(rewired, tmp_path / "rewired.opt.onnx"))
    assert before["QLinearSoftmax"] == 1 and before["QLinearAdd"] == 1
    assert after["QLinearSoftmax"] == after["QLinearAdd"] == 0
    assert after["MatMulIntegerToFloat"] == 1 and after["Softmax"] == 1

    # what it computes: the integer product of q and k, plus the mask as quantized, in float
    def rounded(values: np.ndarray, scale: float, zero: int) -> np.ndarray:
        return (np.clip(np.round(values / scale) + zero, 0, 255) - zero) * scale

    logits = rounded(feeds["q"], 0.05, 128) @ rounded(feeds["k_t"], 0.05, 128)
    logits = logits + rounded(feeds["mask"], 0.12, 255)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected = rounded(expected / expected.sum(-1, keepdims=True), 1 / 255, 0)
    session = ort.InferenceSession(str(rewired), providers=["CPUExecutionProvider"])
    # one step of the probabilities' u8 grid apart at most: a value at a rounding boundary
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, atol=1 / 255 + 1e-6)
    # a factor folded above the Add would scale the mask too if moved into the product: kept
    assert float_inputs(masked_scores(factor_above_add=0.5), {"Softmax"}) == 0
