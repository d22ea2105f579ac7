"""The exact rewrites every exported or folded ONNX graph gets for edge runtimes
(:mod:`converters.edge_rewrites`), each on a small graph built by hand, against ONNX Runtime:
the same outputs, and the op the NPU cannot run gone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from converters.edge_rewrites import for_edge_runtimes
from converters.export import op_histogram

L = 6


def _model(nodes, inputs, outputs, inits, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model)


def _rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    ir_model = ir.from_proto(model)
    changed = for_edge_runtimes(ir_model.graph)
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, changed


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def last_token_model(opset: int) -> onnx.ModelProto:
    """HF's sequence-classifier pooling index: argmax(arange(L) * (ids != pad))."""
    nodes = [
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
        helper.make_node("Not", ["is_pad"], ["real"]),
        helper.make_node("Cast", ["real"], ["flags"], to=TensorProto.INT32),
        helper.make_node("Mul", ["positions", "flags"], ["scored"]),
        helper.make_node("ArgMax", ["scored"], ["last"], axis=-1, keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "pad"),
             numpy_helper.from_array(np.arange(L, dtype=np.int32), "positions")]  # fmt: skip
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [4, L])]
    outputs = [helper.make_tensor_value_info("last", TensorProto.INT64, [4])]
    return _model(nodes, inputs, outputs, inits, opset)


def test_the_last_token_argmax_is_a_max_with_the_same_index() -> None:
    ids = np.array(
        [[5, 3, 2, 0, 0, 0], [0, 0, 7, 7, 0, 0], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0]], np.int64
    )  # right, inner padding, none, all pads
    for opset in (17, 18):
        model = last_token_model(opset)
        proto, changed = _rewritten(model)
        assert changed == 1 and "ArgMax" not in op_histogram(proto)
        assert "TopK" in op_histogram(proto)
        (expected,), (actual,) = _run(model, {"ids": ids}), _run(proto, {"ids": ids})
        assert actual.dtype == np.int64 and actual.tolist() == expected.tolist() == [2, 3, 5, 0]


def test_an_argmax_of_other_values_stays() -> None:
    model = last_token_model(18)
    positions = next(i for i in model.graph.initializer if i.name == "positions")
    positions.CopyFrom(numpy_helper.from_array(np.arange(L, 0, -1, dtype=np.int32), "positions"))
    _, changed = _rewritten(model)
    assert changed == 0  # not positions 0 .. L - 1: values int8 may not hold


def test_an_in_order_gather_after_a_flatten_is_one_reshape() -> None:
    """What the exporter writes for Swin's pooled (B, C, 1) -> (B, C): Reshape to (-1), then
    Gather of every position in order into (B, C, 1, 1)."""
    b, c = 3, 4
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["f"]),
        helper.make_node("Gather", ["f", "order"], ["y"], axis=0),
    ]
    order = np.arange(b * c, dtype=np.int64).reshape(b, c, 1, 1)
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "flat"),
             numpy_helper.from_array(order, "order")]  # fmt: skip
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, c, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, c, 1, 1])],
        inits,
    )
    proto, changed = _rewritten(model)
    assert changed == 2 and op_histogram(proto) == {"Reshape": 1}
    x = np.random.default_rng(0).normal(size=(b, c, 1, 1)).astype(np.float32)
    np.testing.assert_array_equal(_run(proto, {"x": x})[0], _run(model, {"x": x})[0])


def test_a_zero_width_pad_goes_and_a_real_one_stays() -> None:
    for widths, kept in (([0, 0, 0, 0], 0), ([0, 0, 0, 1], 1)):
        nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
                 helper.make_node("Relu", ["p"], ["y"])]  # fmt: skip
        inits = [numpy_helper.from_array(np.array(widths, np.int64), "pads")]
        shape = [2, 3 + sum(widths)]
        model = _model(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
            inits,
        )
        proto, _ = _rewritten(model)
        assert op_histogram(proto).get("Pad", 0) == kept
        x = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)
        np.testing.assert_array_equal(_run(proto, {"x": x})[0], _run(model, {"x": x})[0])
