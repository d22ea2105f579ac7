"""ONNX -> full-int8 and 16x8 TFLite through onnx2tf, run as a sandboxed subprocess.

Route (measured on the bundled examples, see ``convert_tflite``): onnx2tf builds a TensorFlow
model of the folded fp32 ONNX model, ``quant/_onnx_to_saved_model.py`` saves it as a plain
saved_model (onnx2tf's own command would also write float32 and float16 TFLite files through
TensorFlow's Keras path, which takes 14+ min for a BERT-base), then ``quant/_tf_convert.py``
converts that saved_model three times: float32 (LiteRT's reference), full int8 (int8 I/O) and
16x8 (int16 activations, int8 weights, int16 I/O), the last two with the same calibration data.
All use onnx2tf's own converter settings, so the int8 file is what ``onnx2tf -oiqt`` would
write, but without its five other variants and with integer calibration data for int64 token-id
inputs, which ``-oiqt`` cannot quantize. Both scripts run in the tool environment.

The subprocesses get a scratch working directory, a minimal environment (tool env first on
PATH, no proxies, HOME inside the scratch directory) and, where the kernel allows it, no network
at all (``unshare -rn``). onnx2tf downloads a sample-data file from GitHub for every model whose
inputs are all RGB images unless it finds that file in its working directory: we write it there
first, so it never tries.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from ai_edge_litert import schema_py_generated as schema

from . import toolenv
from .data import as_feeds, feed_for
from .drift import Inputs
from .errors import RuleViolation
from .litert import run_tflite

INT8_NAME = "model_int8.tflite"
INT16X8_NAME = "model_16x8.tflite"
FLOAT32_NAME = "model_float32.tflite"
TENSOR_MAP_NAME = "tensor_map.json"
ONNX2TF_LOG = "onnx2tf.log"
QUANTIZE_LOG = "tf_convert.log"
SAMPLE_DATA_NAME = "calibration_image_sample_data_20x128x128x3_float32.npy"
SAVED_MODEL_SCRIPT = Path(__file__).with_name("_onnx_to_saved_model.py")
TF_CONVERT_SCRIPT = Path(__file__).with_name("_tf_convert.py")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOG = re.compile(r"^[IWEF]\d{4} ")  # TensorFlow's C++ log lines: noise for a one-line error


class TfliteConversionError(RuntimeError):
    """onnx2tf or the quantizing converter failed; one line, the full log is kept in work_dir."""


@dataclass(frozen=True)
class TfliteArtifacts:
    """What one conversion produced, all inside ``work_dir``.

    ``float32`` is the fp32 TFLite file of the same saved_model (LiteRT's reference for drift and
    latency).
    ``tensor_map`` maps TFLite tensor names to the ONNX tensor names onnx2tf started from
    (best effort, see ``quant.litert.onnx_names``). ``int16x8`` is None when TensorFlow has no
    16x8 kernel for some op; ``notes`` then says which.
    """

    int8: Path
    int16x8: Path | None
    float32: Path
    tensor_map: Path
    onnx2tf_log: Path
    quantize_log: Path
    onnx2tf_s: float
    quantize_s: float
    network_isolated: bool
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        """The record with its files named relative to the directory that holds them."""
        fields = {
            key: value.name if isinstance(value, Path) else value
            for key, value in dataclasses.asdict(self).items()
        }
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str, directory: Path) -> TfliteArtifacts:
        """The record of ``to_json`` for the same files inside ``directory``."""
        fields = json.loads(text)
        for key in ("int8", "int16x8", "float32", "tensor_map", "onnx2tf_log", "quantize_log"):
            fields[key] = None if fields[key] is None else directory / fields[key]
        fields["notes"] = tuple(fields["notes"])
        return cls(**fields)


def convert_tflite(
    onnx_path: str | Path,
    calib_inputs: Inputs,
    work_dir: str | Path,
    *,
    timeout_s: float = 900,
    isolate_network: bool | None = None,
    smoke_run: bool = True,
) -> TfliteArtifacts:
    """Convert a static-batch-1 ONNX model to full-int8 and 16x8 TFLite files.

    ``calib_inputs``: calibration samples in the ONNX model's own layout (N, C, H, W for images),
    float32, or int64 token ids and masks for a text model, one array per model input by its
    name (a bare array for a one-input model); N >= 1 (a few hundred real samples). They are
    fed to the converter unchanged (no mean/std), one sample at a time.
    ``timeout_s`` bounds the whole conversion. ``isolate_network``: None runs the converter
    without network when the kernel allows it, True requires that, False never isolates.
    ``smoke_run`` runs each file once in LiteRT, in this process, so that a file LiteRT cannot
    run is named in ``notes`` now, not when it is measured; False leaves running the files to
    the caller (one LiteRT aborts on, as LiteRT 2.3 does on the LN ViT-Tiny's 16x8 file, would
    otherwise take this process with it).
    Raises TfliteConversionError (one line), or toolenv.ToolEnvMissingError.

    Why onnx2tf without ``-oiqt`` plus our own quantizing step (measured on vit-mnist-un, 256
    calibration samples): the files are numerically identical to ``-oiqt``'s
    ``*_full_integer_quant.tflite`` and ``*_full_integer_quant_with_int16_act.tflite`` (bit-equal
    outputs on the 1000 test samples), in 37 s instead of 35 s, but with one code path for
    float and int64 inputs, no five unused variants, and no Flex-op escape hatch.
    """
    onnx_path, work_dir = Path(onnx_path).resolve(), Path(work_dir).resolve()
    specs = _static_inputs(onnx_path)
    feeds = feed_for([spec.name for spec in specs], as_feeds(calib_inputs))
    calib = {spec.name: _check_calibration(feeds[spec.name], spec) for spec in specs}
    env_dir = toolenv.require()
    isolate = _network_isolation(isolate_network)
    work_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    scratch = Path(tempfile.mkdtemp(prefix="onnx2tf-", dir=work_dir))
    try:
        # onnx2tf reads this before it would download it (RGB models): float32 in [0, 1].
        sample = np.random.default_rng(0).random((20, 128, 128, 3), dtype=np.float32)
        np.save(scratch / SAMPLE_DATA_NAME, sample)
        # onnx2tf simplifies its input with onnxsim and saves the result over it: it gets a
        # copy, so the fp32 artifact stays the file that was measured, with the exporter's
        # module records that quant.sources reads.
        onnx_copy = scratch / onnx_path.name
        shutil.copyfile(onnx_path, onnx_copy)
        saved_model = scratch / "saved_model"
        start = time.monotonic()
        _run_tool(
            [
                str(toolenv.python_path(env_dir)),
                str(SAVED_MODEL_SCRIPT),
                str(onnx_copy),
                str(saved_model),
            ],
            scratch,
            env_dir,
            deadline,
            work_dir / ONNX2TF_LOG,
            "onnx2tf",
            isolate,
        )
        onnx2tf_s = time.monotonic() - start
        if not (saved_model / "saved_model.pb").is_file():
            raise TfliteConversionError(
                f"onnx2tf wrote no saved_model for {onnx_path.name} "
                f"(full log: {work_dir / ONNX2TF_LOG})"
            )
        calib_file = scratch / "calibration.npz"
        np.savez(calib_file, **calib)
        int8, int16x8 = work_dir / INT8_NAME, work_dir / INT16X8_NAME
        float32 = work_dir / FLOAT32_NAME
        for stale in (int8, int16x8, float32):
            stale.unlink(missing_ok=True)
        start = time.monotonic()
        output = _run_tool(
            [
                str(toolenv.python_path(env_dir)),
                str(TF_CONVERT_SCRIPT),
                str(saved_model),
                str(calib_file),
                "--float32",
                str(float32),
                "--int8",
                str(int8),
                "--int16x8",
                str(int16x8),
            ],
            scratch,
            env_dir,
            deadline,
            work_dir / QUANTIZE_LOG,
            "quantization",
            isolate,
        )
        quantize_s = time.monotonic() - start
        if not int8.is_file() or not float32.is_file():
            raise TfliteConversionError(
                f"the TFLite converter wrote no {INT8_NAME} or {FLOAT32_NAME} "
                f"(full log: {work_dir / QUANTIZE_LOG})"
            )
        notes = tuple(
            ln.removeprefix("warning: ") for ln in output.splitlines() if ln.startswith("warning: ")
        )
        if smoke_run:
            first = {name: array[:1] for name, array in calib.items()}
            notes += _smoke_run((int8, int16x8), first)
        tensor_map = work_dir / TENSOR_MAP_NAME
        tensor_map.write_text(
            json.dumps(parse_tensor_map(_read(work_dir / ONNX2TF_LOG)), indent=1) + "\n"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TfliteArtifacts(
        int8=int8,
        int16x8=int16x8 if int16x8.is_file() else None,
        float32=float32,
        tensor_map=tensor_map,
        onnx2tf_log=work_dir / ONNX2TF_LOG,
        quantize_log=work_dir / QUANTIZE_LOG,
        onnx2tf_s=round(onnx2tf_s, 2),
        quantize_s=round(quantize_s, 2),
        network_isolated=isolate,
        notes=notes,
    )


def _smoke_run(files: Sequence[Path], sample: Inputs) -> tuple[str, ...]:
    """One LiteRT inference per file, so that a file the CPU runtime cannot run is said here,
    not when it is measured (the LN ViT's 16x8 file: LiteRT has no int16 SQUARED_DIFFERENCE)."""
    notes = []
    for path in files:
        if not path.is_file():
            continue
        try:
            run_tflite(path, sample)
        except Exception as exc:  # the interpreter raises RuntimeError/ValueError with a story
            reason = " ".join(str(exc).split())[:200]
            notes.append(f"{path.name} does not run in LiteRT: {reason}")
    return tuple(notes)


@dataclass(frozen=True)
class _InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def _static_inputs(onnx_path: Path) -> list[_InputSpec]:
    """The model's inputs, each with a static shape (the NPU route needs batch 1, static)."""
    if not onnx_path.is_file():
        raise TfliteConversionError(f"{onnx_path}: no such file")
    try:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception as exc:  # protobuf's DecodeError and friends
        raise TfliteConversionError(f"{onnx_path.name}: not a readable ONNX model ({exc})") from exc
    initializers = {t.name for t in graph.initializer}
    specs = []
    for value in (i for i in graph.input if i.name not in initializers):
        tensor_type = value.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
        if any(d <= 0 for d in shape) or not shape or shape[0] != 1:
            raise TfliteConversionError(
                f"{onnx_path.name}: input {value.name!r} has shape "
                f"{list(shape)}; export with static batch 1 for TFLite"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        specs.append(_InputSpec(value.name, np.dtype(dtype), shape))
    if not specs:
        raise TfliteConversionError(f"{onnx_path.name}: the model has no input")
    return specs


def _check_calibration(calib: np.ndarray, spec: _InputSpec) -> np.ndarray:
    """Calibration samples shaped like the input (any count), in the input's dtype."""
    calib = np.asarray(calib)
    if calib.ndim != len(spec.shape) or tuple(calib.shape[1:]) != spec.shape[1:]:
        raise TfliteConversionError(
            f"calibration inputs have shape {list(calib.shape)}; input {spec.name!r} takes "
            f"[N, {', '.join(map(str, spec.shape[1:]))}]"
        )
    if calib.shape[0] < 1:
        raise TfliteConversionError("no calibration samples")
    if spec.dtype.kind == "f":
        if not np.all(np.isfinite(calib)):
            raise TfliteConversionError("calibration inputs contain NaN or Inf")
        return np.ascontiguousarray(calib, dtype=np.float32)
    if calib.dtype.kind not in "iu":
        raise TfliteConversionError(
            f"input {spec.name!r} is {spec.dtype}; calibration inputs are {calib.dtype}"
        )
    return np.ascontiguousarray(calib, dtype=spec.dtype)


def _tool_environment(env_dir: Path, scratch: Path) -> dict[str, str]:
    """A minimal environment: nothing of the caller's (proxies, PYTHONPATH, CUDA) leaks in."""
    return {
        "PATH": f"{toolenv.bin_dir(env_dir)}:/usr/bin:/bin",
        "HOME": str(scratch),  # keras and TF write config/cache under HOME
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TF_CPP_MIN_LOG_LEVEL": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "VIRTUAL_ENV": str(env_dir),
    }


@functools.cache
def _unshare() -> str | None:
    """`unshare`, if it can start a process without network here (not in every container)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    try:
        proc = subprocess.run(
            [unshare, "-rn", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return unshare if proc.returncode == 0 else None


def _network_isolation(requested: bool | None) -> bool:
    if requested is False:
        return False
    if _unshare() is not None:
        return True
    if requested:
        raise TfliteConversionError(
            "network isolation was required but `unshare -rn` does not "
            "work here (no unshare, or user namespaces are disabled)"
        )
    return False


def _run_tool(
    cmd: Sequence[str],
    cwd: Path,
    env_dir: Path,
    deadline: float,
    log: Path,
    what: str,
    isolate: bool,
) -> str:
    """Run one tool-env step with a deadline; log everything; return its stdout.

    The process gets its own session, so on timeout the whole group (onnx2tf starts onnxsim
    subprocesses) is killed, not just the parent.
    """
    if isolate:
        cmd = [_unshare() or "unshare", "-rn", *cmd]
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TfliteConversionError(f"{what} not started: the conversion's time limit is spent")
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_tool_environment(env_dir, cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _write_log(log, cmd, out, err, None)
        raise TfliteConversionError(
            f"{what} timed out after {remaining:.0f} s (full log: {log})"
        ) from None
    _write_log(log, cmd, out, err, proc.returncode)
    if proc.returncode != 0:
        raise TfliteConversionError(
            f"{what} failed: {last_meaningful_line(out, err)} (full log: {log})"
        )
    return _ANSI.sub("", out)


def _write_log(log: Path, cmd: Sequence[str], out: str, err: str, code: int | None) -> None:
    status = "killed (timeout)" if code is None else f"exit code {code}"
    log.write_text(
        f"$ {' '.join(cmd)}\n# {status}\n\n## stdout\n{_ANSI.sub('', out)}\n"
        f"## stderr\n{_ANSI.sub('', err)}\n"
    )


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def last_meaningful_line(stdout: str, stderr: str) -> str:
    """The line that says why a tool failed: the last error-looking line of stderr, then of
    stdout (onnx2tf prints its errors there), else the last line that is not TF log noise."""
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines()]
        lines = [ln for ln in lines if ln and not _GLOG.match(ln)]
        for line in reversed(lines):
            if re.search(r"error|exception|failed", line, re.IGNORECASE):
                return line[:300]
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines()]
        lines = [ln for ln in lines if ln and not _GLOG.match(ln)]
        if lines:
            return lines[-1][:300]
    return "no output"


_ONNX_OUTPUT = re.compile(r"^INFO:\s+output_name\.(\d+): (\S+) shape:")
_TF_OUTPUT = re.compile(r"^INFO:\s+output\.(\d+)\.\S+: name: (\S+?)(:\d+)? shape:")
_ONNX_OP = re.compile(r"^INFO: onnx_op_type: ")


def parse_tensor_map(log: str) -> dict[str, str]:
    """{TF tensor name (no ':0') -> ONNX tensor name} from onnx2tf's per-node log.

    For each ONNX node onnx2tf logs its ONNX output names, then the TensorFlow tensors it built
    for them, in the same order. Only single-output nodes are mapped (a Split's TF outputs do not
    keep their index in the TFLite names). Insertion order is ONNX graph order.
    """
    mapping: dict[str, str] = {}
    onnx_outputs: list[str] = []
    tf_outputs: list[str] = []

    def flush() -> None:
        if len(onnx_outputs) == 1 and len(tf_outputs) == 1:
            mapping[tf_outputs[0]] = onnx_outputs[0]

    for raw in _ANSI.sub("", log).splitlines():
        if _ONNX_OP.match(raw):
            flush()
            onnx_outputs, tf_outputs = [], []
        elif m := _ONNX_OUTPUT.match(raw):
            onnx_outputs.append(m.group(2))
        elif m := _TF_OUTPUT.match(raw):
            tf_outputs.append(m.group(2))
    flush()
    return mapping


# -- reading a TFLite file -------------------------------------------------------------------

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


def _op_name(code: schema.OperatorCodeT) -> str:
    builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
    if builtin == schema.BuiltinOperator.CUSTOM:
        custom = code.customCode.decode() if isinstance(code.customCode, bytes) else code.customCode
        return f"CUSTOM:{custom}"
    return _OP_NAMES.get(builtin, f"BUILTIN_{builtin}")


def _tensor_name(tensor: schema.TensorT) -> str:
    name = tensor.name
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _spec(tensor: schema.TensorT) -> TensorSpec:
    q = tensor.quantization
    scale = zero_point = None
    if q is not None and q.scale is not None and len(q.scale) == 1:
        scale, zero_point = float(q.scale[0]), int(q.zeroPoint[0])
    shape = () if tensor.shape is None else tuple(int(d) for d in tensor.shape)
    return TensorSpec(
        _tensor_name(tensor),
        _TYPE_NAMES.get(tensor.type, str(tensor.type)),
        shape,
        scale,
        zero_point,
    )


def _indices(values: object) -> list[int]:
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
        graph_in = set(_indices(graph.inputs)) if index == 0 else set()
        graph_out = set(_indices(graph.outputs)) if index == 0 else set()
        boundary: set[int] = set()
        for op in graph.operators or []:
            name = codes[op.opcodeIndex]
            histogram[name] = histogram.get(name, 0) + 1
            ins, outs = _indices(op.inputs), _indices(op.outputs)
            ref = OpRef(name, _tensor_name(tensors[outs[0]]) if outs else "")
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
                float_tensors.append(_tensor_name(tensor))
            elif dtypes[i] == "int16":
                int16.append(_tensor_name(tensor))
    tensors = main.tensors or []
    return TfliteInfo(
        path=path,
        op_histogram=dict(sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))),
        inputs=tuple(_spec(tensors[i]) for i in _indices(main.inputs)),
        outputs=tuple(_spec(tensors[i]) for i in _indices(main.outputs)),
        float_tensors=tuple(float_tensors),
        float_ops=tuple(float_ops),
        int16_tensors=tuple(int16),
        operators=tuple(operators),
    )


def check_full_integer(info: TfliteInfo, io_dtype: str | None = "int8") -> None:
    """Raise NotFullIntegerError unless nothing computes in float and the I/O is ``io_dtype``.

    ``io_dtype=None`` checks the inside only (any integer I/O type passes). An int64 input is
    allowed whatever ``io_dtype`` is: token ids are indices into an embedding table, not
    quantized values.
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
    ins_ok = {io_dtype, "int64"} if io_dtype else integer
    outs_ok = {io_dtype} if io_dtype else integer
    for kind, specs, allowed in (("input", info.inputs, ins_ok), ("output", info.outputs, outs_ok)):
        problems += [f"{kind} {t.name!r} is {t.dtype}" for t in specs if t.dtype not in allowed]
    if problems:
        io = f" with {io_dtype} I/O" if io_dtype else ""
        raise NotFullIntegerError(
            f"{info.path.name} is not full integer{io}: " + "; ".join(problems)
        )
