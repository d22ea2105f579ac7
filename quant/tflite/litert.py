"""Running TFLite files with LiteRT (ai-edge-litert): outputs, every tensor, latency.

ai-edge-litert is the maintained successor of tflite-runtime (which stops at 2.14 and fails
with numpy 2); it runs in the main venv, so measuring a TFLite file needs no TensorFlow.

Inputs are given as the ONNX model takes them (N, C, H, W for images, int64 token ids for
text), one array per model input by its ONNX name (a bare array for a one-input model): the
file's inputs are matched by name (the converter calls them ``serving_default_NAME:0``), onnx2tf
made image inputs channels-last, and ``_to_file_layout`` moves the channel axis when the file's
input shape says so. Float inputs are quantized with the input tensor's own scale and zero
point; integer ids pass through. Files have a static batch of 1, so samples run one at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from ..deadline import check
from ..measure.drift import Inputs, sqnr_db, sqnr_of_sums, sqnr_sample_count, square_sums
from ..measure.latency import Timing, time_calls
from ..samples import Feeds, as_feeds

SQNR_SAMPLES = 32
_KERAS_PREFIX = re.compile(r"^model(_\d+)?/")
_SIGNATURE_NAME = re.compile(r"^serving_default_(.*?)(:\d+)?$")


def _interpreter(
    path: str | Path, threads: int = 1, *, all_tensors: bool = False, builtin: bool = False
) -> Interpreter:
    """XNNPACK (the default delegate) for outputs and latency; the plain builtin kernels when
    every tensor must be kept (a delegated partition keeps only its outputs) or ``builtin``."""
    if all_tensors or builtin:
        interp = Interpreter(
            model_path=str(path),
            num_threads=threads,
            experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
            experimental_preserve_all_tensors=all_tensors,
        )
    else:
        interp = Interpreter(model_path=str(path), num_threads=threads)
    interp.allocate_tensors()
    return interp


def _to_file_layout(inputs: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """(N, ...) samples in the ONNX layout -> the file's layout (channels last if it says so)."""
    inputs = np.asarray(inputs)
    if tuple(inputs.shape[1:]) == tuple(shape[1:]):
        return inputs
    if inputs.ndim >= 3:
        moved = np.moveaxis(inputs, 1, -1)
        if tuple(moved.shape[1:]) == tuple(shape[1:]):
            return moved
    raise ValueError(
        f"inputs of shape {list(inputs.shape)} do not fit the TFLite input "
        f"{list(shape)} (as given or channels-last)"
    )


def _quantizer(detail: Mapping) -> Callable[[np.ndarray], np.ndarray]:
    """Model-layout float samples -> what the input tensor holds."""
    dtype = np.dtype(detail["dtype"])
    scale, zero_point = detail["quantization"]
    if dtype.kind == "f" or dtype == np.int64 or dtype == np.int32 or scale == 0:
        return lambda x: np.asarray(x).astype(dtype)
    info = np.iinfo(dtype)

    def quantize(x: np.ndarray) -> np.ndarray:
        q = np.round(np.asarray(x, dtype=np.float64) / scale) + zero_point
        return np.clip(q, info.min, info.max).astype(dtype)

    return quantize


def _dequantize(values: np.ndarray, detail: Mapping) -> np.ndarray:
    scale, zero_point = detail["quantization"]
    if scale == 0 or np.dtype(detail["dtype"]).kind == "f":
        return values.astype(np.float32)
    return ((values.astype(np.float64) - zero_point) * scale).astype(np.float32)


def input_name(detail_name: str) -> str:
    """The ONNX input a TFLite input tensor stands for: ``serving_default_input_ids:0`` ->
    ``input_ids`` (the TF converter names inputs after the saved_model signature's keys)."""
    match = _SIGNATURE_NAME.match(detail_name)
    return match.group(1) if match else detail_name


def _canonical(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


class _Feeder:
    """The file's inputs, each prepared from the model input of the same name: one call sets
    every input tensor of the interpreter to one sample."""

    def __init__(self, interp: Interpreter, inputs: Inputs) -> None:
        feeds = as_feeds(inputs)
        details = interp.get_input_details()
        by_name = {_canonical(name): array for name, array in feeds.items()}
        self.interp = interp
        self.tensors: list[tuple[int, np.ndarray]] = []
        for detail in details:
            if len(details) == 1 and len(feeds) == 1:
                array = next(iter(feeds.values()))
            else:
                array = by_name.get(_canonical(input_name(detail["name"])))
                if array is None:
                    raise ValueError(
                        f"no data for the TFLite input {detail['name']!r} "
                        f"(inputs given: {', '.join(feeds)})"
                    )
            samples = _to_file_layout(array, tuple(detail["shape"]))
            self.tensors.append((detail["index"], _quantizer(detail)(samples)))

    def __len__(self) -> int:
        return self.tensors[0][1].shape[0]

    def set(self, sample: int) -> None:
        for index, values in self.tensors:
            self.interp.set_tensor(index, values[sample : sample + 1])


def run_tflite(path: str | Path, inputs: Inputs, threads: int = 1) -> np.ndarray:
    """The model's (first) output for every sample, dequantized to float32: (N, ...)."""
    interp = _interpreter(path, threads)
    feeder = _Feeder(interp, inputs)
    out = interp.get_output_details()[0]
    results = []
    for i in range(len(feeder)):
        check()  # a watched search step (the 16x8 file's drift pass) stops between two samples
        feeder.set(i)
        interp.invoke()
        results.append(interp.get_tensor(out["index"])[0])
    return _dequantize(np.stack(results), out)


_BUILTIN_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}


def _read_graph(path: str | Path) -> tuple[schema.ModelT, schema.SubGraphT]:
    model = schema.ModelT.InitFromPackedBuf(Path(path).read_bytes(), 0)
    return model, model.subgraphs[0]


def _op_type(model: schema.ModelT, op: schema.OperatorT) -> str:
    code = model.operatorCodes[op.opcodeIndex]
    return _BUILTIN_NAMES.get(max(code.builtinCode, code.deprecatedBuiltinCode), "CUSTOM")


def _op_outputs(path: str | Path) -> list[tuple[str, list[int], list[str]]]:
    """(op type, output tensor indices, output names) of each op of the main subgraph, in order."""
    model, graph = _read_graph(path)
    ops = []
    for op in graph.operators or []:
        outs = [int(i) for i in ([] if op.outputs is None else op.outputs) if i >= 0]
        ops.append((_op_type(model, op), outs, [_decode(graph.tensors[i].name) for i in outs]))
    return ops


def op_graph(path: str | Path) -> list[tuple[str, list[str], list[str]]]:
    """(op type, input tensor names, output tensor names) of each op of the main subgraph, in
    order (``quant.sources`` walks it to name tensors onnx2tf left without an ONNX twin)."""
    model, graph = _read_graph(path)

    def names(indices: object) -> list[str]:
        found = [] if indices is None else [int(i) for i in indices]  # type: ignore[attr-defined]
        return [_decode(graph.tensors[i].name) for i in found if i >= 0]

    return [
        (_op_type(model, op), names(op.inputs), names(op.outputs)) for op in graph.operators or []
    ]


def _decode(name: object) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _activations(path: str | Path) -> dict[int, str]:
    """{tensor index: producing op type} for every tensor an op writes (no constants)."""
    return {index: op for op, outs, _ in _op_outputs(path) for index in outs}


class _AllTensors:
    """One interpreter that keeps every tensor, for all samples: ``run`` one sample (the files
    have a static batch of 1), then ``read`` any activation of it by name, dequantized."""

    def __init__(self, path: str | Path, inputs: Inputs) -> None:
        self.interp = _interpreter(path, all_tensors=True)
        self.feeder = _Feeder(self.interp, inputs)
        produced = _activations(path)
        self.details: dict[str, list[Mapping]] = {}  # a name can (rarely) hold several tensors
        for detail in self.interp.get_tensor_details():
            if detail["index"] in produced:
                self.details.setdefault(detail["name"], []).append(detail)

    def __len__(self) -> int:
        return len(self.feeder)

    def run(self, sample: int) -> None:
        self.feeder.set(sample)
        self.interp.invoke()

    def read(self, name: str) -> np.ndarray:
        """The named tensor(s) on the last sample run, float32: (tensors with that name, *shape)."""
        found = [_dequantize(self.interp.get_tensor(d["index"]), d) for d in self.details[name]]
        return np.stack(found)


def tensor_values(path: str | Path, inputs: Inputs) -> dict[str, np.ndarray]:
    """Every activation of the file (each op's outputs, not the constants), dequantized to
    float32, stacked over the samples: {TFLite tensor name: (N, *shape)}.

    Runs the builtin kernels without XNNPACK, keeping all tensors: slower than ``run_tflite``
    and memory-hungry (every tensor of every sample), so pass a few dozen samples (to reduce
    over many samples, stream them as ``tensor_sqnr_tflite`` does). Names are the file's own;
    the same saved_model gives the same names in its int8, 16x8 and float32 files, so compare
    files by name. ``onnx_names`` maps them back to ONNX tensor names.
    """
    tensors = _AllTensors(path, inputs)
    values: dict[str, list[np.ndarray]] = {name: [] for name in tensors.details}
    for sample in range(len(tensors)):
        tensors.run(sample)
        for name, stacked in values.items():
            stacked.append(tensors.read(name))
    return {name: np.concatenate(v) for name, v in values.items()}


def onnx_names(
    tflite_names: list[str] | Mapping[str, object], tensor_map: str | Path | Mapping[str, str]
) -> dict[str, str]:
    """Best-effort {TFLite tensor name: ONNX tensor name}, from the ``tensor_map.json`` that
    ``convert_tflite`` parsed out of onnx2tf's log.

    How reliable: exact for a tensor that one ONNX node produced and TFLite kept as is (Add,
    MatMul, Softmax, Gelu, Reshape, ...). When the converter fused several ops into one (MatMul +
    Add -> FULLY_CONNECTED, Conv + bias), the TFLite name lists every fused TF op and we return
    the ONNX tensor of the LAST of them in graph order, which is the one the fused op outputs.
    Tensors onnx2tf or the converter inserted (layout TRANSPOSEs, renamed duplicates ending in a
    digit, QUANTIZE) and multi-output nodes (Split) get no ONNX name: they are left out.
    """
    mapping = dict(
        json.loads(Path(tensor_map).read_text())
        if isinstance(tensor_map, (str, Path))
        else tensor_map
    )
    order = {tf_name: i for i, tf_name in enumerate(mapping)}
    result: dict[str, str] = {}
    for name in tflite_names:
        parts = [_KERAS_PREFIX.sub("", part) for part in name.split(";")]
        known = [part for part in parts if part in mapping]
        if known:
            result[name] = mapping[max(known, key=order.__getitem__)]
    return result


def tensor_sqnr_tflite(
    quantized: str | Path, reference: str | Path, inputs: Inputs, *, samples: int = SQNR_SAMPLES
) -> list[tuple[str, str, float]]:
    """(tensor name, op type, SQNR dB) of every activation of ``quantized`` against the same
    tensor of ``reference``, the fp32 TFLite file of the same conversion
    (``TfliteArtifacts.float32``: same saved_model, so same tensor names), worst first.

    Streamed: both files run one sample at a time and each tensor keeps only its two sums of
    squares, because every activation of a ViT-Tiny sample alone is ~200 MB. Over the first
    ``samples``, fewer for a model with large activations
    (``quant.measure.drift.sqnr_sample_count``)."""
    if Path(reference).suffix != ".tflite":
        raise ValueError("the SQNR reference must be the fp32 TFLite file of the same conversion")
    subset = _head(as_feeds(inputs), samples)
    q_tensors, f_tensors = _AllTensors(quantized, subset), _AllTensors(reference, subset)
    aligned = aligned_tensors(quantized, reference)
    pairs = {
        name: ref_name
        for name, (_, ref_name) in aligned.items()
        if name in q_tensors.details and ref_name in f_tensors.details
    }
    sums = {name: np.zeros(2) for name in pairs}
    values = sum(int(np.prod(d["shape"])) for name in pairs for d in q_tensors.details[name])
    for sample in range(sqnr_sample_count(values, len(q_tensors))):
        q_tensors.run(sample)
        f_tensors.run(sample)
        for name, ref_name in list(pairs.items()):
            value, ref = q_tensors.read(name), f_tensors.read(ref_name)
            if ref.shape == value.shape:
                sums[name] += square_sums(ref, value)
            else:  # not the same tensor after all: no SQNR for it
                del pairs[name]
    rows = [(name, aligned[name][0], sqnr_of_sums(*sums[name])) for name in pairs]
    return sorted(rows, key=lambda row: row[2])


def aligned_tensors(quantized: str | Path, reference: str | Path) -> dict[str, tuple[str, str]]:
    """{quantized tensor: (op type, the same tensor's name in ``reference``)}.

    Names alone do not pair the two files: the converter names a fused tensor after its TF ops
    and its constants (``MatMul;Add;Const_33`` vs ``MatMul;Add;Const_9``) and a SPLIT's outputs
    differently. Both files come from one saved_model, so their ops run in the same order: walk
    both, skip the QUANTIZE/DEQUANTIZE ops quantization inserted, pair ops of the same type and
    their outputs by position (a type mismatch skips ahead a few ops, then gives up on that op).
    """
    ref_ops = _op_outputs(reference)
    pairs: dict[str, tuple[str, str]] = {}
    j = 0
    for op, _, outs in _op_outputs(quantized):
        match = next((k for k in range(j, min(j + 4, len(ref_ops))) if ref_ops[k][0] == op), None)
        if match is None:
            continue  # an op quantization added (QUANTIZE/DEQUANTIZE) or changed
        for name, ref_name in zip(outs, ref_ops[match][2], strict=False):
            pairs[name] = (op, ref_name)
        j = match + 1
    return pairs


def _head(feeds: Feeds, count: int) -> Feeds:
    return {name: np.asarray(array)[:count] for name, array in feeds.items()}


def sample_runner(
    path: str | Path, inputs: Inputs, threads: int = 1, *, builtin: bool = False
) -> Callable[[int], np.ndarray]:
    """``run(i)``: one batch-1 inference of the file on sample ``i`` of ``inputs``, with XNNPACK
    on ``threads`` threads, or LiteRT's builtin kernels alone (``builtin``), as int16 files and
    ops XNNPACK refuses run (set the inputs, invoke, read the output tensor, as the file holds
    it: not dequantized). The interpreter is made and the inputs are put in the file's layout
    and types once, here, so a call is only the inference: what ``latency_tflite`` times, for a
    caller that times calls its own way."""
    interp = _interpreter(path, threads, builtin=builtin)
    feeder = _Feeder(interp, inputs)
    out_index = interp.get_output_details()[0]["index"]

    def run(sample: int) -> np.ndarray:
        feeder.set(sample)
        interp.invoke()
        return interp.get_tensor(out_index)

    return run


def xnnpack_ops(path: str | Path, threads: int = 1) -> dict[str, tuple[int, int]]:
    """{op type: (ops of that type in the file, ops XNNPACK's delegate took)}, read from the
    interpreter that ``run_tflite`` and ``latency_tflite`` use.

    After ``allocate_tensors`` each partition the delegate took is one DELEGATE node whose
    inputs and outputs are the partition's, while the node list still holds the ops it
    replaced: an op is delegated when it lies on the way back from a DELEGATE node's outputs
    to its inputs (a partition is closed, so that walk never leaves it)."""
    interp = _interpreter(path, threads)
    nodes = interp._get_ops_details()  # the interpreter's node list, delegate nodes last
    ops = [node for node in nodes if node["op_name"] != "DELEGATE"]
    producer = {int(t): node["index"] for node in ops for t in node["outputs"]}
    taken: set[int] = set()
    for partition in (node for node in nodes if node["op_name"] == "DELEGATE"):
        boundary = {int(t) for t in partition["inputs"]}
        pending = [int(t) for t in partition["outputs"]]
        while pending:
            tensor = pending.pop()
            index = producer.get(tensor)
            if tensor in boundary or index is None or index in taken:
                continue
            taken.add(index)
            pending += [int(t) for t in nodes[index]["inputs"] if t >= 0]
    counts: dict[str, tuple[int, int]] = {}
    for node in ops:
        total, delegated = counts.get(node["op_name"], (0, 0))
        counts[node["op_name"]] = (total + 1, delegated + (node["index"] in taken))
    return counts


def latency_tflite(
    path: str | Path, sample: Inputs, threads: int, warmup: int = 10, runs: int = 100
) -> Timing:
    """Batch-1 latency with XNNPACK on the first row of ``sample``: ``warmup`` untimed runs,
    then up to ``runs`` timed ones (set inputs, invoke, read output;
    ``quant.measure.latency.time_calls`` says when fewer run); p50/p90/p99 in ms."""
    run = sample_runner(path, _head(as_feeds(sample), 1), threads)
    return time_calls(lambda: run(0), threads, runs, warmup)


__all__ = [
    "aligned_tensors",
    "latency_tflite",
    "onnx_names",
    "op_graph",
    "run_tflite",
    "sample_runner",
    "sqnr_db",
    "tensor_sqnr_tflite",
    "tensor_values",
    "xnnpack_ops",
]
