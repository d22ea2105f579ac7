"""Editing a TFLite file whose buffers are stored after the flatbuffer, by offset, as
ai-edge-quantizer writes a large model's (BERT-base's int8 file): the edit reads every buffer
as an array and writes a file LiteRT runs to the same result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter
from ai_edge_litert.tools import flatbuffer_utils

from quant.tflite.flatbuffer import read_model, write_model

CONSTANT = np.arange(1, 9, dtype=np.float32)  # what the file adds to its input


def _tensor(name: str, buffer: int) -> schema.TensorT:
    tensor = schema.TensorT()
    tensor.name, tensor.shape = name.encode(), [len(CONSTANT)]
    tensor.type, tensor.buffer = schema.TensorType.FLOAT32, buffer
    return tensor


def _add_model() -> schema.ModelT:
    """y = x + CONSTANT, the constant in buffer 1."""
    add = schema.OperatorCodeT()
    add.builtinCode = add.deprecatedBuiltinCode = schema.BuiltinOperator.ADD
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = 0, [0, 1], [2]
    op.builtinOptionsType, op.builtinOptions = (
        schema.BuiltinOptions.AddOptions,
        schema.AddOptionsT(),
    )
    graph = schema.SubGraphT()
    graph.tensors = [_tensor("x", 0), _tensor("constant", 1), _tensor("y", 0)]
    graph.inputs, graph.outputs, graph.operators = [0], [2], [op]
    model = schema.ModelT()
    model.version, model.operatorCodes, model.subgraphs = 3, [add], [graph]
    empty, constant = schema.BufferT(), schema.BufferT()
    constant.data = CONSTANT.view(np.uint8)
    model.buffers = [empty, constant]
    return model


def _write_with_offset_buffer(path: Path) -> None:
    """The constant's bytes after the flatbuffer, named by offset and size."""
    model = _add_model()
    payload = model.buffers[1].data.tobytes()
    model.buffers[1].data, model.buffers[1].size = None, len(payload)
    model.buffers[1].offset = 1  # a placeholder of the same width, to measure the flatbuffer
    head = len(flatbuffer_utils.convert_object_to_bytearray(model))
    start = -(-head // 16) * 16
    model.buffers[1].offset = start
    body = flatbuffer_utils.convert_object_to_bytearray(model)
    assert len(body) == head
    path.write_bytes(bytes(body) + bytes(start - head) + payload)


def _run(path: Path) -> np.ndarray:
    interpreter = Interpreter(str(path))
    interpreter.allocate_tensors()
    x = np.full(len(CONSTANT), 0.5, np.float32)
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def test_offset_stored_buffers_are_read_as_arrays_and_written_back_inline(tmp_path: Path) -> None:
    source, edited = tmp_path / "offset.tflite", tmp_path / "edited.tflite"
    _write_with_offset_buffer(source)
    np.testing.assert_array_equal(_run(source), CONSTANT + 0.5)  # a file LiteRT runs
    # LiteRT's own reader hands that buffer over as raw bytes, which its writer packs one
    # byte per Python call: the slow path this reader avoids
    raw = flatbuffer_utils.read_model(str(source)).buffers
    assert not any(isinstance(buffer.data, np.ndarray) for buffer in raw[1:])
    model = read_model(source)
    data = [buffer.data for buffer in model.buffers if buffer.data is not None]
    assert len(data) == 1 and isinstance(data[0], np.ndarray)
    np.testing.assert_array_equal(data[0].view(np.float32), CONSTANT)
    write_model(model, edited)
    np.testing.assert_array_equal(_run(edited), CONSTANT + 0.5)
    inline = flatbuffer_utils.read_model(str(edited)).buffers
    assert [b.data.tobytes() for b in inline if b.data is not None] == [CONSTANT.tobytes()]
