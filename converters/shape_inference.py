"""ONNX shape inference without the weights' bytes.

Why: ``onnx.shape_inference.infer_shapes`` serializes the whole model into C++ and back, and
copies it; for BERT-base (418 MB of weights) one call takes ~6 s, nearly all of it moving
bytes that inference never reads. It reads a weight's type and dims, and reads values only
where data flows into a shape (Reshape's target, a Shape/Gather chain), and those are small
tensors. So inference runs here on a copy whose large initializers are graph inputs of the
same type and dims: the same shapes, at a fraction of the cost, and the value_info put back
on the full model is the one inference of the full model gives.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

# An initializer larger than this (elements) is a weight: inference sees only its type and dims.
# Shape data (a Reshape target, a Slice's bounds, position ids up to 512) stays well under it.
WEIGHT_ELEMENTS = 1024


def infer_shapes(model: onnx.ModelProto, *, data_prop: bool = False) -> onnx.ModelProto:
    """What ``onnx.shape_inference.infer_shapes(model, data_prop=...)`` returns: a copy of
    ``model`` with the inferred value_info and output types; its weights' bytes never
    serialized for it."""
    inferred = infer_graph_shapes(model.graph, model, data_prop=data_prop)
    placeholders = {weight.name for weight in _weights(model.graph)}
    kept_inputs = [value for value in inferred.graph.input if value.name not in placeholders]
    del inferred.graph.input[:]
    inferred.graph.input.extend(kept_inputs)
    del inferred.graph.initializer[:]
    inferred.graph.initializer.extend(model.graph.initializer)  # in their order
    return inferred


def infer_graph_shapes(
    graph: onnx.GraphProto, model: onnx.ModelProto, *, data_prop: bool = False
) -> onnx.ModelProto:
    """Shape inference of ``graph`` (``model``'s, or one being rewritten from it: its opsets,
    IR version and functions apply) with its weights as inputs: read its value_info, not its
    weights."""
    weights = _weights(graph)
    weight_names = {weight.name for weight in weights}
    light = helper.make_graph(
        graph.node,
        graph.name,
        [
            *graph.input,
            *(helper.make_tensor_value_info(w.name, w.data_type, w.dims) for w in weights),
        ],
        graph.output,
        [init for init in graph.initializer if init.name not in weight_names],
        doc_string=graph.doc_string,
        value_info=graph.value_info,
    )
    light.sparse_initializer.extend(graph.sparse_initializer)
    light.metadata_props.extend(graph.metadata_props)
    light_model = helper.make_model(
        light,
        opset_imports=model.opset_import,
        ir_version=model.ir_version,
        functions=model.functions,
    )
    light_model.metadata_props.extend(model.metadata_props)
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        if model.HasField(field):  # proto2: a field set to its default is still written
            setattr(light_model, field, getattr(model, field))
    return onnx.shape_inference.infer_shapes(light_model, data_prop=data_prop)


def _weights(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """The large initializers, except one the graph already lists as an input (old IRs)."""
    inputs = {value.name for value in graph.input}
    return [
        init
        for init in graph.initializer
        if init.name not in inputs and math.prod(init.dims) > WEIGHT_ELEMENTS
    ]
