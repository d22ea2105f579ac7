"""A depthwise convolution of a one-channel input, written back as the plain convolution it is.

litert-torch lowers a ``Conv2d`` with one input channel (a grey-scale patch embedding) to
DEPTHWISE_CONV_2D with a depth multiplier of its output channels. The two compute the same
thing: with one input channel, output channel ``m`` is the input convolved with filter ``m``.
But Vela runs a depthwise convolution only with strides up to 3, so a ViT's 4x4 stride-4 patch
embedding went to the Cortex-A55; as CONV_2D (what TensorFlow's converter writes for it) Vela
places it on the NPU. The filter [1, kh, kw, M] becomes [M, kh, kw, 1], its per-channel
quantization moves from axis 3 to axis 0, the bias and everything else stay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from .flatbuffer import op_type, read_model, write_model

_DTYPES = {schema.TensorType.INT8: np.int8, schema.TensorType.FLOAT32: np.float32}


def depthwise_as_conv(path: Path) -> int:
    """Rewrite ``path`` in place; how many ops became CONV_2D (the file is left as it was
    when none)."""
    model = read_model(path)
    graph = model.subgraphs[0]
    rewritten = 0
    for op in graph.operators or []:
        if op_type(model, op) != "DEPTHWISE_CONV_2D":
            continue
        source, weights = graph.tensors[int(op.inputs[0])], graph.tensors[int(op.inputs[1])]
        if list(source.shape)[-1] != 1 or weights.buffer <= 0:
            continue
        buffer = model.buffers[weights.buffer]
        if buffer.data is None:
            continue
        dtype = _DTYPES.get(weights.type)
        if dtype is None:
            continue
        options = op.builtinOptions
        filters = np.asarray(buffer.data, dtype=np.uint8).view(dtype)
        filters = filters.reshape(list(weights.shape)).transpose(3, 1, 2, 0)
        buffer.data = np.ascontiguousarray(filters).view(np.uint8).ravel()
        weights.shape = np.array(filters.shape, dtype=np.int32)
        if weights.quantization is not None:
            weights.quantization.quantizedDimension = 0
        conv = schema.Conv2DOptionsT()
        conv.padding, conv.strideW, conv.strideH = options.padding, options.strideW, options.strideH
        conv.dilationWFactor, conv.dilationHFactor = (
            options.dilationWFactor,
            options.dilationHFactor,
        )
        conv.fusedActivationFunction = options.fusedActivationFunction
        op.builtinOptionsType, op.builtinOptions = schema.BuiltinOptions.Conv2DOptions, conv
        op.opcodeIndex = _opcode(model, schema.BuiltinOperator.CONV_2D, version=3)
        rewritten += 1
    if rewritten:
        write_model(model, path)
    return rewritten


def _opcode(model: schema.ModelT, builtin: int, version: int) -> int:
    """The index of ``builtin``'s operator code, added when the file has none."""
    for index, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin:
            return index
    code = schema.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, builtin, version
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1
