"""quant.measure.exact: a QDQ model with its constants computed once computes what the model as
written computes, bit for bit, without a DequantizeLinear of a weight left to run per sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quant.measure.exact as exact
from quant.measure.drift import exact_workers, onnx_runner

RNG = np.random.default_rng(0)
HIDDEN = 768  # a BERT-base Linear: long enough sums that the GEMM kernel's order shows


def qdq_linear(hidden: int = HIDDEN) -> onnx.ModelProto:
    """x -> Q/DQ -> MatMul(DQ(int8 weight, per-channel scales)) -> Add(DQ(bias)) -> Gelu-free
    Relu -> Gemm(DQ(weight) transposed by a constant Transpose) -> y: per-channel scales that
    are not powers of two, as the cpu target's files have them."""
    w1 = RNG.integers(-127, 128, (hidden, hidden), dtype=np.int8)
    w2 = RNG.integers(-127, 128, (hidden, 8), dtype=np.int8)
    initializers = [
        numpy_helper.from_array(np.array(0.0371, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(3, np.int8), "x_zero"),
        numpy_helper.from_array(w1, "w1_q"),
        numpy_helper.from_array(RNG.uniform(1e-3, 3e-3, hidden).astype(np.float32), "w1_scale"),
        numpy_helper.from_array(np.zeros(hidden, np.int8), "w1_zero"),
        numpy_helper.from_array(RNG.integers(-500, 500, hidden, dtype=np.int32), "b1_q"),
        numpy_helper.from_array(np.array(7.3e-5, np.float32), "b1_scale"),
        numpy_helper.from_array(w2, "w2_q"),
        numpy_helper.from_array(RNG.uniform(1e-3, 3e-3, 8).astype(np.float32), "w2_scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w2_zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w1_q", "w1_scale", "w1_zero"], ["w1"], axis=1),
        helper.make_node("DequantizeLinear", ["b1_q", "b1_scale"], ["b1"]),
        helper.make_node("MatMul", ["x_dq", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("DequantizeLinear", ["w2_q", "w2_scale", "w2_zero"], ["w2"], axis=1),
        helper.make_node("Transpose", ["w2"], ["w2_t"], perm=[1, 0]),
        helper.make_node("Gemm", ["r", "w2_t"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def as_written(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": row[None]})[0] for row in x])


def test_constants_computed_once_give_the_same_outputs_bit_for_bit(tmp_path: Path) -> None:
    model = qdq_linear()
    path = tmp_path / "qdq.onnx"
    onnx.save_model(model, str(path))
    x = RNG.standard_normal((6, HIDDEN)).astype(np.float32)

    computed = exact.with_constants_computed(model)
    ops = [node.op_type for node in computed.graph.node]
    # the weights' and the bias's DequantizeLinear and the constant Transpose are gone; the
    # activation's Q/DQ pair stays
    assert ops == ["QuantizeLinear", "DequantizeLinear", "MatMul", "Add", "Relu", "Gemm"]
    held = {init.name: init for init in computed.graph.initializer}
    assert {"w1", "b1", "w2_t"} <= set(held)
    assert not {"w1_q", "b1_q", "w2_q", "w2_scale"} & set(held)  # nothing reads them now
    assert held["w1"].data_type == TensorProto.FLOAT

    expected = as_written(path, x)
    outputs = onnx_runner(path, exact=True)(x)
    np.testing.assert_array_equal(outputs, expected)
    assert outputs.tobytes() == expected.tobytes()


def test_a_batch_one_file_runs_its_calls_side_by_side_in_order(tmp_path: Path) -> None:
    """A file of a fixed batch of 1 (tda4vm's) runs as many one-sample calls at once as it has
    threads, each on one thread; the outputs come back in the samples' order, the same bit for
    bit, the last odd sample included. A dynamic batch keeps one call on every thread."""
    model = qdq_linear()
    assert exact_workers(model, threads=2) == (2, 1)
    assert exact_workers(model, threads=1) == (1, 1)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    assert exact_workers(model, threads=2) == (1, 2)

    path = tmp_path / "qdq.onnx"
    onnx.save_model(qdq_linear(), str(path))
    x = RNG.standard_normal((7, HIDDEN)).astype(np.float32)
    outputs = onnx_runner(path, threads=2, exact=True)(x)
    assert outputs.tobytes() == as_written(path, x).tobytes()


def test_the_gemm_kernel_would_pack_a_constant_weight_and_sum_in_another_order(
    tmp_path: Path,
) -> None:
    """Why ``exact_session`` turns pre-packing off: with the weight a constant, ORT's GEMM
    kernel packs it and sums in another order, and the outputs are no longer those of the model
    as written. The test above is only worth something if that shows on its model."""
    model = qdq_linear()
    path = tmp_path / "qdq.onnx"
    onnx.save_model(model, str(path))
    x = RNG.standard_normal((6, HIDDEN)).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    packed = ort.InferenceSession(
        exact.with_constants_computed(model).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )
    outputs = np.concatenate([packed.run(None, {"x": row[None]})[0] for row in x])
    assert not np.array_equal(outputs, as_written(path, x))


def test_a_model_whose_constants_would_be_too_large_runs_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = qdq_linear(hidden=16)
    monkeypatch.setattr(exact, "MAX_COMPUTED_BYTES", 16 * 16 * 4 - 1)  # w1 alone passes it
    assert exact.with_constants_computed(model) is model
    monkeypatch.setattr(exact, "MAX_COMPUTED_BYTES", 1 << 20)
    assert exact.with_constants_computed(model) is not model
