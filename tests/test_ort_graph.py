"""The ONNX Runtime speed rewrites (quant.ort_graph) on the bundled trained UN ViT: the fp32
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

from quant.drift import measure_drift, onnx_runner
from quant.ort_graph import float_inputs, linear_as_gemm
from quant.ort_int8 import quantize_onnx
from quant.targets import DEFAULT_MIN_AGREEMENT, PROFILES

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
