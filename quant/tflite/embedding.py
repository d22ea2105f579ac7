"""An embedding table the quantizer left in float, put on the int8 grid its lookup is read at.

litert-torch writes ``aten.embedding`` as EMBEDDING_LOOKUP of a float32 table, and
ai-edge-quantizer leaves it so, with a QUANTIZE after it: the file then computes in float
(the lookup) and fails the full-integer check, so every text model took the onnx2tf route.
The lookup only copies rows, so quantizing the table once, to the QUANTIZE's own scale and zero
point, gives bit for bit what the QUANTIZE computed at run time; LiteRT's EMBEDDING_LOOKUP copies
int8 rows to an int8 output. The QUANTIZE goes, its readers read the lookup's output, now int8.
A QUANTIZE to int16 (a 16x8 file) stays: LiteRT looks up int8 tables only, so the table takes
its own int8 grid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from .flatbuffer import op_type, read_model, write_model


def quantize_embedding_tables(path: Path) -> int:
    """Rewrite ``path`` in place; how many lookups now read an int8 table (the file is left as
    it was when none)."""
    model = read_model(path)
    graph = model.subgraphs[0]
    operators = list(graph.operators or [])
    readers: dict[int, list[schema.OperatorT]] = {}
    for op in operators:
        for index in op.inputs:
            readers.setdefault(int(index), []).append(op)
    dropped, rewritten = [], 0
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
        if op_type(model, quantize) != "QUANTIZE":
            continue
        buffer = model.buffers[table.buffer]
        values = np.asarray(buffer.data, dtype=np.uint8).view(np.float32)
        if target.type == schema.TensorType.INT8 and not _is_output(graph, quantize):
            # the QUANTIZE's own grid: the lookup then writes what it computed, and it goes
            scale = float(target.quantization.scale[0])
            zero = int(target.quantization.zeroPoint[0])
            dropped.append(quantize)
            for reader in readers.get(int(quantize.outputs[0]), []):
                reader.inputs = np.array(
                    [out if int(i) == int(quantize.outputs[0]) else int(i) for i in reader.inputs],
                    dtype=np.int32,
                )
        elif target.type == schema.TensorType.INT16:
            # LiteRT looks up int8 tables only: the table's own int8 grid, and the QUANTIZE
            # stays, now int8 -> int16
            low, high = min(float(values.min()), 0.0), max(float(values.max()), 0.0)
            scale = (high - low) / 255 or 1.0
            zero = int(np.clip(round(-128 - low / scale), -128, 127))
            rewritten += 1
        else:
            continue
        rounded = _round_half_away(values / scale) + zero
        buffer.data = np.clip(rounded, -128, 127).astype(np.int8).view(np.uint8)
        table.type, table.quantization = schema.TensorType.INT8, _per_tensor(scale, zero)
        looked_up = graph.tensors[out]
        looked_up.type, looked_up.quantization = schema.TensorType.INT8, _per_tensor(scale, zero)
    if not dropped and not rewritten:
        return 0
    graph.operators = [op for op in operators if all(op is not d for d in dropped)]
    write_model(model, path)
    return len(dropped) + rewritten


def _is_output(graph: schema.SubGraphT, op: schema.OperatorT) -> bool:
    return int(op.outputs[0]) in {int(i) for i in graph.outputs}


def _round_half_away(values: np.ndarray) -> np.ndarray:
    """TFLite's rounding (QUANTIZE): half away from zero."""
    return np.sign(values) * np.floor(np.abs(values) + 0.5)


def _per_tensor(scale: float, zero: int) -> schema.QuantizationParametersT:
    params = schema.QuantizationParametersT()
    params.scale, params.zeroPoint = np.array([scale], np.float32), np.array([zero], np.int64)
    return params
