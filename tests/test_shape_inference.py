"""converters.shape_inference: inference run without the weights' bytes gives the model, byte
for byte, that onnx's own inference of the whole model gives."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from converters.shape_inference import WEIGHT_ELEMENTS, infer_graph_shapes, infer_shapes


def reshaping_linear() -> onnx.ModelProto:
    """x (batch, 8, 64) -> MatMul(a 64 x 64 weight) -> Reshape(to a small shape initializer):
    the weight is over the size inference sees only by type, the shape is data it reads."""
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    assert weight.size > WEIGHT_ELEMENTS
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Shape", ["h"], ["h_shape"]),
            helper.make_node("Gather", ["h_shape", "zero"], ["batch"], axis=0),
            helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0),
            helper.make_node("Reshape", ["h", "target"], ["y"]),
        ],
        "reshaping_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([16, 32], np.int64), "rest"),
        ],
    )
    graph.metadata_props.add(key="source", value="test")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.producer_name = "test"
    return model


def exported_module() -> onnx.ModelProto:
    """A Linear - GELU - Linear exported as users export it (torch.onnx.export's defaults)."""
    module = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 48))
    buffer = io.BytesIO()
    program = torch.onnx.export(module, (torch.randn(2, 5, 48),), input_names=["x"])
    program.save(buffer)
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("make", [reshaping_linear, exported_module])
@pytest.mark.parametrize("data_prop", [False, True])
def test_the_same_model_as_inference_of_the_whole_model(make, data_prop: bool) -> None:
    model = make()
    expected = onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
    got = infer_shapes(model, data_prop=data_prop)
    assert got.graph.value_info, "inference found no shapes: the test would prove nothing"
    assert got.SerializeToString() == expected.SerializeToString()


def test_data_flowing_into_a_shape_is_read() -> None:
    """The Reshape's target is computed from a small initializer: with data propagation the
    output's shape is known, as it is when the whole model is inferred."""
    dims = infer_shapes(reshaping_linear(), data_prop=True).graph.output[0].type.tensor_type
    assert [d.dim_value or d.dim_param for d in dims.shape.dim] == ["batch", 16, 32]


def test_the_weights_reach_inference_as_inputs_only() -> None:
    model = reshaping_linear()
    light = infer_graph_shapes(model.graph, model)
    assert "w" not in {init.name for init in light.graph.initializer}
    assert {value.name for value in light.graph.input} == {"x", "w"}
    assert {init.name for init in light.graph.initializer} == {"zero", "rest"}
