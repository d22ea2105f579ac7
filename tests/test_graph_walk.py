"""quant.measure.graph_walk: a graph run piece by piece computes what the whole graph computes with
the constants as they are when each piece runs (bias correction's one walk instead of one pass per
bias)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quant.measure.exact import constant_tensors
from quant.measure.graph_walk import GraphWalk
from quant.samples import Samples

RNG = np.random.default_rng(0)


def two_linears(batch: int | str) -> onnx.ModelProto:
    """x -> Gemm(w1, DequantizeLinear(b1 int32)) -> Relu -> Gemm(w2, b2) -> y; the first bias an
    int32 constant behind a DequantizeLinear, as ORT's QDQ files hold it."""
    nodes = [
        helper.make_node("DequantizeLinear", ["b1_int", "b1_scale"], ["b1"]),
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1),
    ]
    initializers = [
        numpy_helper.from_array(RNG.standard_normal((5, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([3, -2, 0, 7, 1], np.int32), "b1_int"),
        numpy_helper.from_array(np.array(0.25, np.float32), "b1_scale"),
        numpy_helper.from_array(RNG.standard_normal((2, 5)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(2, np.float32), "b2"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_linears",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run_whole(model: onnx.ModelProto, x: np.ndarray, outputs: list[str]) -> list[np.ndarray]:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in outputs if n != "y")
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, {"x": x})


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(value, name))


def test_a_constant_changed_between_two_pieces_reaches_everything_after_it() -> None:
    model = two_linears("N")
    x = RNG.standard_normal((7, 3)).astype(np.float32)
    walk = GraphWalk(model, Samples({"x": x}, None, "test"), 4, pad=False)
    assert walk.batches == [(4, 4), (3, 3)]
    (h_before,) = run_whole(model, x, ["h"])
    np.testing.assert_array_equal(np.concatenate(walk.advance_to("h")), h_before)
    # the first bias changes after ``h`` was measured: ``h`` is computed again with it, and
    # ``y`` is what the whole graph computes with the new bias, not with the old one
    set_initializer(model, "b1_int", np.array([-40, 9, 2, 0, -5], np.int32))
    h_after, y_after = run_whole(model, x, ["h", "y"])
    assert not np.array_equal(h_after, h_before)
    np.testing.assert_array_equal(np.concatenate(walk.advance_to("y")), y_after)
    # the walk keeps only what a later node reads: the input of the last node (which a next
    # piece would run again), not ``x``, ``h`` or ``y``
    assert [set(live) for live in walk.live] == [{"r"}, {"r"}]
    with pytest.raises(ValueError, match="not in order"):
        walk.advance_to("h")


def test_a_fixed_batch_is_padded_and_the_padding_is_said() -> None:
    model = two_linears(4)
    x = RNG.standard_normal((6, 3)).astype(np.float32)
    walk = GraphWalk(model, Samples({"x": x}, None, "test"), 4, pad=True)
    assert walk.batches == [(4, 4), (4, 2)]
    values = walk.advance_to("r")
    assert [v.shape for v in values] == [(4, 5), (4, 5)]
    np.testing.assert_array_equal(values[0], run_whole(model, x[:4], ["r"])[0])
    last_repeated = np.concatenate([x[4:], x[5:], x[5:]])  # 4 rows: the last sample twice more
    np.testing.assert_array_equal(values[1], run_whole(model, last_repeated, ["r"])[0])


def test_constants_are_the_initializers_and_what_is_computed_from_them_alone() -> None:
    constants = constant_tensors(two_linears("N").graph)
    assert constants == {"w1", "b1_int", "b1_scale", "w2", "b2", "b1"}
