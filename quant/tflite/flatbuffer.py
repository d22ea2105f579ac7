"""Reading a TFLite flatbuffer without TensorFlow, and checking that it is full integer.

:func:`inspect_tflite` reads a file's op histogram, its I/O (type, shape, quantization), every op
in execution order and every float or int16 tensor; :func:`check_full_integer` is the rule a
full-integer target enforces on that (nothing computes in float, the I/O has the right type).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.tools import flatbuffer_utils

from ..errors import RuleViolation

_FLOAT_TYPES = frozenset({"float32", "float16", "float64", "bfloat16"})
_OP_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
_TYPE_NAMES = {v: k.lower() for k, v in vars(schema.TensorType).items() if not k.startswith("_")}


class NotFullIntegerError(RuleViolation):
    """A TFLite file still computes in float somewhere, or its I/O has the wrong type."""


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: what a runtime must feed or read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    scale: float | None
    zero_point: int | None


@dataclass(frozen=True)
class OpRef:
    """One operator, named by its type (builtin name) and its first output tensor."""

    op: str
    output: str


@dataclass(frozen=True)
class TfliteInfo:
    """What a TFLite flatbuffer contains, read without TensorFlow.

    ``float_tensors`` and ``float_ops`` leave out the float I/O boundary only: a QUANTIZE that
    reads a graph input and a DEQUANTIZE that writes a graph output (with their float graph
    tensors). Everything else in float is listed, constants included (a float weight feeding a
    DEQUANTIZE is float compute on an NPU's terms too).
    """

    path: Path
    op_histogram: dict[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    float_tensors: tuple[str, ...]
    float_ops: tuple[OpRef, ...]
    int16_tensors: tuple[str, ...]
    operators: tuple[OpRef, ...] = ()  # every op of the main subgraph, in execution order

    @property
    def ops(self) -> tuple[str, ...]:
        """The op types present (builtin names), most frequent first."""
        return tuple(self.op_histogram)

    @property
    def n_ops(self) -> int:
        return sum(self.op_histogram.values())

    @property
    def input_dtypes(self) -> tuple[str, ...]:
        return tuple(t.dtype for t in self.inputs)

    @property
    def output_dtypes(self) -> tuple[str, ...]:
        return tuple(t.dtype for t in self.outputs)


def read_model(path: Path) -> schema.ModelT:
    """``path`` as LiteRT's object API reads it, for an edit, each buffer's data an array.

    ai-edge-quantizer stores a large model's buffers after the flatbuffer, by offset;
    ``flatbuffer_utils.read_model`` reads those back as raw bytes (a memoryview), which its
    writer packs one byte per Python call: BERT-base's int8 file (110 MB) took 83 s to write.
    """
    model = flatbuffer_utils.read_model(str(path))
    for buffer in model.buffers or []:
        if isinstance(buffer.data, bytes | bytearray | memoryview):
            buffer.data = np.frombuffer(buffer.data, np.uint8)
    return model


def write_model(model: schema.ModelT, path: Path) -> None:
    flatbuffer_utils.write_model(model, str(path))


def _op_name(code: schema.OperatorCodeT) -> str:
    builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
    if builtin == schema.BuiltinOperator.CUSTOM:
        custom = code.customCode.decode() if isinstance(code.customCode, bytes) else code.customCode
        return f"CUSTOM:{custom}"
    return _OP_NAMES.get(builtin, f"BUILTIN_{builtin}")


def op_type(model: schema.ModelT, op: schema.OperatorT) -> str:
    """An operator's type, as its builtin name (``CUSTOM:name`` for a custom op)."""
    return _op_name(model.operatorCodes[op.opcodeIndex])


def tensor_name(tensor: schema.TensorT) -> str:
    """A tensor's name as text (the flatbuffer holds bytes)."""
    name = tensor.name
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _spec(tensor: schema.TensorT) -> TensorSpec:
    q = tensor.quantization
    scale = zero_point = None
    if q is not None and q.scale is not None and len(q.scale) == 1:
        scale, zero_point = float(q.scale[0]), int(q.zeroPoint[0])
    shape = () if tensor.shape is None else tuple(int(d) for d in tensor.shape)
    return TensorSpec(
        tensor_name(tensor),
        _TYPE_NAMES.get(tensor.type, str(tensor.type)),
        shape,
        scale,
        zero_point,
    )


def tensor_indices(values: object) -> list[int]:
    """Tensor indices of a flatbuffer vector (None or a numpy array; -1 = optional, absent)."""
    return [] if values is None else [int(i) for i in values if i >= 0]  # type: ignore[attr-defined]


def inspect_tflite(path: str | Path) -> TfliteInfo:
    """Op histogram (builtin names), I/O types and every float or int16 tensor of a file."""
    path = Path(path)
    try:
        model = schema.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    except OSError:
        raise
    except Exception as exc:  # a truncated or foreign file fails deep inside flatbuffers
        raise ValueError(f"{path.name}: not a readable TFLite file ({exc})") from exc
    if not model.subgraphs:
        raise ValueError(f"{path.name}: a TFLite file with no subgraph")
    codes = [_op_name(c) for c in model.operatorCodes or []]
    histogram: dict[str, int] = {}
    float_tensors: list[str] = []
    float_ops: list[OpRef] = []
    int16: list[str] = []
    operators: list[OpRef] = []
    main = model.subgraphs[0]
    for index, graph in enumerate(model.subgraphs):
        tensors = graph.tensors or []
        dtypes = [_TYPE_NAMES.get(t.type, "") for t in tensors]
        graph_in = set(tensor_indices(graph.inputs)) if index == 0 else set()
        graph_out = set(tensor_indices(graph.outputs)) if index == 0 else set()
        boundary: set[int] = set()
        for op in graph.operators or []:
            name = codes[op.opcodeIndex]
            histogram[name] = histogram.get(name, 0) + 1
            ins, outs = tensor_indices(op.inputs), tensor_indices(op.outputs)
            ref = OpRef(name, tensor_name(tensors[outs[0]]) if outs else "")
            if index == 0:
                operators.append(ref)
            if name == "QUANTIZE" and ins and set(ins) <= graph_in:
                boundary.update(ins)
                continue
            if name == "DEQUANTIZE" and outs and set(outs) <= graph_out:
                boundary.update(outs)
                continue
            if any(dtypes[i] in _FLOAT_TYPES for i in (*ins, *outs)):
                float_ops.append(ref)
        for i, tensor in enumerate(tensors):
            if dtypes[i] in _FLOAT_TYPES and i not in boundary:
                float_tensors.append(tensor_name(tensor))
            elif dtypes[i] == "int16":
                int16.append(tensor_name(tensor))
    tensors = main.tensors or []
    return TfliteInfo(
        path=path,
        op_histogram=dict(sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))),
        inputs=tuple(_spec(tensors[i]) for i in tensor_indices(main.inputs)),
        outputs=tuple(_spec(tensors[i]) for i in tensor_indices(main.outputs)),
        float_tensors=tuple(float_tensors),
        float_ops=tuple(float_ops),
        int16_tensors=tuple(int16),
        operators=tuple(operators),
    )


def check_full_integer(info: TfliteInfo, io_dtype: str | None = "int8") -> None:
    """Raise NotFullIntegerError unless nothing computes in float and the I/O is ``io_dtype``.

    ``io_dtype=None`` checks the inside only (any integer I/O type passes). An int64 or int32
    input is allowed whatever ``io_dtype`` is: token ids are indices into an embedding table,
    not quantized values (onnx2tf keeps int64, litert-torch makes them int32).
    """
    problems: list[str] = []
    if info.float_ops:
        counts: dict[str, int] = {}
        for op in info.float_ops:
            counts[op.op] = counts.get(op.op, 0) + 1
        listed = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())[:6])
        problems.append(f"{len(info.float_ops)} float ops ({listed})")
    if info.float_tensors:
        problems.append(f"{len(info.float_tensors)} float tensors (first: {info.float_tensors[0]})")
    integer = {"int8", "uint8", "int16", "int32", "int64"}
    ins_ok = {io_dtype, "int64", "int32"} if io_dtype else integer
    outs_ok = {io_dtype} if io_dtype else integer
    for kind, specs, allowed in (("input", info.inputs, ins_ok), ("output", info.outputs, outs_ok)):
        problems += [f"{kind} {t.name!r} is {t.dtype}" for t in specs if t.dtype not in allowed]
    if problems:
        io = f" with {io_dtype} I/O" if io_dtype else ""
        raise NotFullIntegerError(
            f"{info.path.name} is not full integer{io}: " + "; ".join(problems)
        )
