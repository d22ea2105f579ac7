"""quant.ort.multiply_adds: one sample's multiply-adds, counted from the graph's shapes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quant.ort.multiply_adds import multiply_adds_per_sample

TOKENS, FEATURES, HIDDEN, CLASSES = 10, 16, 32, 5


def _weight(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones(shape, np.float32), name)


def _graph(batch: int | str, unknown_tokens: bool = False) -> onnx.ModelProto:
    """(batch, 1, 8, 8) image -> 3x3 Conv to 4 channels -> (batch, tokens, features) ->
    MatMul to HIDDEN -> mean over tokens -> Gemm (transB) to CLASSES."""
    tokens = "T" if unknown_tokens else TOKENS
    nodes = [
        helper.make_node("Conv", ["image", "conv_w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("Gemm", ["pooled", "w2"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 1, 8, 8]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, tokens, FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, CLASSES]),
         helper.make_tensor_value_info("conv", TensorProto.FLOAT, None)],
        [_weight("conv_w", 4, 1, 3, 3), _weight("w1", FEATURES, HIDDEN),
         _weight("w2", CLASSES, HIDDEN)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


CONV = 4 * 8 * 8 * (1 * 3 * 3)  # output elements x (in channels x kernel)
MATMUL = TOKENS * HIDDEN * FEATURES
GEMM = CLASSES * HIDDEN


def test_each_product_counts_its_outputs_times_its_reduced_axis_for_one_sample() -> None:
    for batch in (1, 8, "batch"):  # a static batch, a larger one and a dynamic one
        assert multiply_adds_per_sample(_graph(batch)) == CONV + MATMUL + GEMM, batch


def test_a_product_of_unknown_shape_counts_its_weights_once() -> None:
    # the tokens are unknown: the MatMul counts as its weight's size, a lower bound
    assert multiply_adds_per_sample(_graph(1, unknown_tokens=True)) == (
        CONV + FEATURES * HIDDEN + GEMM
    )
