"""An embedding table the quantizer left in float, put on the int8 grid its lookup is read at.

litert-torch writes ``aten.embedding`` as EMBEDDING_LOOKUP of a float32 table, and
ai-edge-quantizer leaves it so, with a QUANTIZE after it: the file then computes in float
(the lookup) and fails the full-integer check, so every text model took the onnx2tf route.
The lookup only copies rows, so quantizing the table once, to the QUANTIZE's own scale and zero
point, gives bit for bit what the QUANTIZE computed at run time; LiteRT's EMBEDDING_LOOKUP copies
int8 rows to an int8 output. The QUANTIZE goes, its readers read the lookup's output, now int8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.tools import flatbuffer_utils

from .tflite_flatbuffer import op_type


def quantize_embedding_tables(path: Path) -> int:
    """Rewrite ``path`` in place; how many lookups now read an int8 table (the file is left as
    it was when none)."""
    model = flatbuffer_utils.read_model(str(path))
    graph = model.subgraphs[0]
    operators = list(graph.operators or [])
    readers: dict[int, list[schema.OperatorT]] = {}
    for op in operators:
        for index in op.inputs:
            readers.setdefault(int(index), []).append(op)
    dropped = []
    for op in operators:
        if op_type(model, op) != "EMBEDDING_LOOKUP":
            continue
        table, out = graph.tensors[int(op.inputs[1])], int(op.outputs[0])
        after = readers.get(out, [])
        shared = len(readers.get(int(op.inputs[1]), [])) != 1  # a tied table: leave it
        if table.type != schema.TensorType.FLOAT32 or len(after) != 1 or shared:
            continue
        quantize = after[0]
        target = graph.tensors[int(quantize.outputs[0])]
        if op_type(model, quantize) != "QUANTIZE" or target.type != schema.TensorType.INT8:
            continue
        if int(quantize.outputs[0]) in {int(i) for i in graph.outputs}:
            continue
        scale = float(target.quantization.scale[0])
        zero = int(target.quantization.zeroPoint[0])
        buffer = model.buffers[table.buffer]
        values = np.asarray(buffer.data, dtype=np.uint8).view(np.float32) / scale
        # TFLite's QUANTIZE rounds half away from zero
        rounded = np.sign(values) * np.floor(np.abs(values) + 0.5) + zero
        buffer.data = np.clip(rounded, -128, 127).astype(np.int8).view(np.uint8)
        table.type, table.quantization = schema.TensorType.INT8, _per_tensor(scale, zero)
        looked_up = graph.tensors[out]  # now int8 on the QUANTIZE's grid; its readers read it
        looked_up.type, looked_up.quantization = schema.TensorType.INT8, _per_tensor(scale, zero)
        for reader in readers.get(int(quantize.outputs[0]), []):
            reader.inputs = np.array(
                [out if int(i) == int(quantize.outputs[0]) else int(i) for i in reader.inputs],
                dtype=np.int32,
            )
        dropped.append(quantize)
    if not dropped:
        return 0
    graph.operators = [op for op in operators if all(op is not d for d in dropped)]
    flatbuffer_utils.write_model(model, str(path))
    return len(dropped)


def _per_tensor(scale: float, zero: int) -> schema.QuantizationParametersT:
    params = schema.QuantizationParametersT()
    params.scale, params.zeroPoint = np.array([scale], np.float32), np.array([zero], np.int64)
    return params
