"""ONNX -> full-int8 and 16x8 TFLite through onnx2tf, run as a sandboxed subprocess.

Route (measured on the bundled examples, see ``convert_tflite``): onnx2tf builds a TensorFlow
model of the folded fp32 ONNX model (fast, checked against ONNX Runtime on the first
calibration samples, built again in onnx2tf's strict mode where it disagrees, refused where
that disagrees too), ``quant/tflite/tool_scripts/onnx_to_saved_model.py`` saves it as a plain
saved_model (onnx2tf's own command would also write float32 and float16 TFLite files through
TensorFlow's Keras path, which takes 14+ min for a BERT-base), then
``quant/tflite/tool_scripts/tf_convert.py`` converts that saved_model to full int8 (int8 I/O) in one
TensorFlow process, which also writes the float model it quantized as float32 (LiteRT's reference),
and on demand (``convert_int16x8``: a target whose int8 file misses the bars) to 16x8 (int16
activations, int8 weights, int16 I/O), the last two with the same calibration data.
All use onnx2tf's own converter settings, so the int8 file is what ``onnx2tf -oiqt`` would
write, but without its five other variants and with integer calibration data for int64 token-id
inputs, which ``-oiqt`` cannot quantize. Both scripts run in the tool environment. The int8 file
is then given symmetric BATCH_MATMUL right operands (:mod:`quant.tflite.symmetric`), without
which LiteRT's XNNPACK leaves every attention product to TFLite's reference kernel.

The scripts run sandboxed (:mod:`quant.tflite.tool_sandbox`: a scratch working directory, a minimal
environment and, where the kernel allows it, no network). onnx2tf downloads a sample-data file
from GitHub for every model whose inputs are all RGB images unless it finds that file in its
working directory: we write it there first, so it never tries. The tensor map comes from its log
(:mod:`quant.tflite.onnx2tf_log`); the files are read and checked by :mod:`quant.tflite.flatbuffer`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..measure.drift import Inputs
from ..samples import as_feeds, feed_for
from . import toolenv
from .litert import run_tflite
from .onnx2tf_log import parse_tensor_map
from .symmetric import SymmetricOperand, make_matmul_operands_symmetric
from .tool_sandbox import TfliteConversionError, network_isolation, run_tool

INT8_NAME = "model_int8.tflite"
INT16X8_NAME = "model_16x8.tflite"
FLOAT32_NAME = "model_float32.tflite"
TENSOR_MAP_NAME = "tensor_map.json"
ONNX2TF_LOG = "onnx2tf.log"
QUANTIZE_LOG = "tf_convert_{modes}.log"  # one per TensorFlow process: "float32_int8"
SAVED_MODEL_NAME = "saved_model"  # kept beside the files, for a 16x8 file made later
CALIBRATION_NAME = "calibration.npz"  # the calibration samples as the converter takes them
SAMPLE_DATA_NAME = "calibration_image_sample_data_20x128x128x3_float32.npy"
SAVED_MODEL_SCRIPT = Path(__file__).parent / "tool_scripts" / "onnx_to_saved_model.py"
TF_CONVERT_SCRIPT = Path(__file__).parent / "tool_scripts" / "tf_convert.py"


@dataclass(frozen=True)
class TfliteArtifacts:
    """What one conversion produced, all inside ``work_dir``.

    ``float32`` is the fp32 TFLite file of the same saved_model, the float model the int8 file
    was quantized from (LiteRT's reference for the per-tensor SQNR).
    ``tensor_map`` maps TFLite tensor names to the ONNX tensor names onnx2tf started from
    (best effort, see ``quant.tflite.litert.onnx_names``). ``int16x8`` is None until
    ``convert_int16x8`` made it, and when TensorFlow has no 16x8 path for the model; ``notes``
    then says why. ``saved_model`` and ``calibration`` are what that later conversion starts
    from. ``matmul_operands``: what
    :mod:`quant.tflite.symmetric` changed in the int8 file so that XNNPACK runs its
    BATCH_MATMULs (or why not), one record per group of tensors. ``quantize_log`` is the log of
    the TensorFlow process that wrote the int8 file; another's, if any, is beside it.
    """

    int8: Path
    int16x8: Path | None
    float32: Path
    tensor_map: Path
    onnx2tf_log: Path
    quantize_log: Path
    saved_model: Path
    calibration: Path
    onnx2tf_s: float
    quantize_s: float
    network_isolated: bool
    notes: tuple[str, ...] = field(default=())
    matmul_operands: tuple[SymmetricOperand, ...] = field(default=())

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
        for key in _FILE_FIELDS:
            fields[key] = None if fields[key] is None else directory / fields[key]
        fields["notes"] = tuple(fields["notes"])
        fields["matmul_operands"] = tuple(
            SymmetricOperand(**record) for record in fields.get("matmul_operands", ())
        )
        return cls(**fields)


_FILE_FIELDS = (
    "int8", "int16x8", "float32", "tensor_map", "onnx2tf_log", "quantize_log", "saved_model",
    "calibration",
)  # fmt: skip


def convert_tflite(
    onnx_path: str | Path,
    calib_inputs: Inputs,
    work_dir: str | Path,
    *,
    timeout_s: float = 900,
    isolate_network: bool | None = None,
    smoke_run: bool = True,
    symmetric_matmul: bool = True,
) -> TfliteArtifacts:
    """Convert a static-batch-1 ONNX model to full-int8 TFLite and its float32 reference.

    ``calib_inputs``: calibration samples in the ONNX model's own layout (N, C, H, W for images),
    float32, or int64 token ids and masks for a text model, one array per model input by its
    name (a bare array for a one-input model); N >= 1 (a few hundred real samples). They are
    fed to the converter unchanged (no mean/std), one sample at a time.
    ``timeout_s`` bounds the whole conversion. ``isolate_network``: None runs the converter
    without network when the kernel allows it, True requires that, False never isolates.
    ``smoke_run`` runs each file once in LiteRT, in this process, so that a file LiteRT cannot
    run is named in ``notes`` now, not when it is measured; False leaves running the files to
    the caller. ``symmetric_matmul`` gives every int8 BATCH_MATMUL's
    right operand zero point 0 at its producer (:mod:`quant.tflite.symmetric`), so that
    XNNPACK runs it; False keeps the converter's quantization (a benchmark's "before").
    The 16x8 file is not made here: ``convert_int16x8`` makes it from the saved_model and the
    calibration set this keeps in ``work_dir``, for the target whose int8 file missed the bars
    (a whole calibration pass at 16 bits, made for every model when it was made with the
    others: ViT-B/16's TFLite stage went 370 -> 190 s without it).
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
    env_dir = toolenv.ONNX2TF.require()
    isolate = network_isolation(isolate_network)
    work_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    saved_model, calib_file = work_dir / SAVED_MODEL_NAME, work_dir / CALIBRATION_NAME
    int8, float32 = work_dir / INT8_NAME, work_dir / FLOAT32_NAME
    shutil.rmtree(saved_model, ignore_errors=True)
    for stale in (int8, work_dir / INT16X8_NAME, float32):
        stale.unlink(missing_ok=True)
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
        np.savez(calib_file, **calib)  # the build checks its model on the first samples
        start = time.monotonic()
        run_tool(
            [
                str(toolenv.ONNX2TF.python(env_dir)),
                str(SAVED_MODEL_SCRIPT),
                str(onnx_copy),
                str(saved_model),
                str(calib_file),
            ],
            scratch,
            env_dir,
            deadline,
            work_dir / ONNX2TF_LOG,
            "onnx2tf",
            isolate,
        )
        onnx2tf_s = time.monotonic() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not (saved_model / "saved_model.pb").is_file():
        raise TfliteConversionError(
            f"onnx2tf wrote no saved_model for {onnx_path.name} "
            f"(full log: {work_dir / ONNX2TF_LOG})"
        )
    start = time.monotonic()
    # one conversion: the float32 file is the float model the int8 conversion quantizes
    files = [("float32", float32), ("int8", int8)]
    _, quantize_log = _tf_convert(saved_model, calib_file, files, env_dir, deadline, isolate)
    quantize_s = time.monotonic() - start
    if not int8.is_file() or not float32.is_file():
        raise TfliteConversionError(
            f"the TFLite converter wrote no {INT8_NAME} or {FLOAT32_NAME} "
            f"(full log: {quantize_log})"
        )
    operands = make_matmul_operands_symmetric(int8, int8) if symmetric_matmul else ()
    notes = (
        _smoke_run((int8,), {name: array[:1] for name, array in calib.items()}) if smoke_run else ()
    )
    tensor_map = work_dir / TENSOR_MAP_NAME
    tensor_map.write_text(
        json.dumps(parse_tensor_map(_read(work_dir / ONNX2TF_LOG)), indent=1) + "\n"
    )
    return TfliteArtifacts(
        int8=int8,
        int16x8=None,
        float32=float32,
        tensor_map=tensor_map,
        onnx2tf_log=work_dir / ONNX2TF_LOG,
        quantize_log=quantize_log,
        saved_model=saved_model,
        calibration=calib_file,
        onnx2tf_s=round(onnx2tf_s, 2),
        quantize_s=round(quantize_s, 2),
        network_isolated=isolate,
        notes=notes,
        matmul_operands=operands,
    )


def convert_int16x8(
    converted: TfliteArtifacts,
    *,
    timeout_s: float = 900,
    smoke_run: bool = True,
) -> TfliteArtifacts:
    """``converted`` with its 16x8 file (int8 weights, int16 activations and I/O), made from the
    saved_model and calibration set ``convert_tflite`` kept, in a TensorFlow process of its own,
    network isolated as the first conversion was. No file (``int16x8`` None, and a note that
    says why) when TensorFlow has no 16x8 path for the model: for an integer input (token ids,
    a mask) its 16x8 calibration wants a range it never records, and fails after a whole
    calibration pass (98 s of BERT-base's conversion), so such a model is not tried. ``smoke_run``
    as for ``convert_tflite`` (LiteRT 2.3 aborts the process on an LN model's 16x8 file); a file
    it finds LiteRT cannot run is removed, and the note says why.
    Raises TfliteConversionError (one line), or toolenv.ToolEnvMissingError."""
    wide = converted.int8.with_name(INT16X8_NAME)
    wide.unlink(missing_ok=True)
    if (blocked := int16x8_blocker(converted)) is not None:
        return dataclasses.replace(converted, notes=(*converted.notes, blocked))
    with np.load(converted.calibration, allow_pickle=False) as archive:
        first = {name: archive[name][:1] for name in archive.files}
    env_dir = toolenv.ONNX2TF.require()
    deadline = time.monotonic() + timeout_s
    output, log = _tf_convert(
        converted.saved_model,
        converted.calibration,
        [("int16x8", wide)],
        env_dir,
        deadline,
        converted.network_isolated,
    )
    notes = tuple(
        ln.removeprefix("warning: ") for ln in output.splitlines() if ln.startswith("warning: ")
    )
    if smoke_run and wide.is_file() and (failed := _smoke_run((wide,), first)):
        wide.unlink()  # a file LiteRT cannot run has no drift to measure
        notes += failed
    if not wide.is_file() and not notes:
        notes = (f"TensorFlow wrote no {INT16X8_NAME} (full log: {log})",)
    return dataclasses.replace(
        converted,
        int16x8=wide if wide.is_file() else None,
        notes=converted.notes + notes,
    )


def int16x8_blocker(converted: TfliteArtifacts) -> str | None:
    """Why TensorFlow has no 16x8 path for the model ``converted`` came from, or None: its
    16x8 calibration wants a range for each integer input (token ids, a mask) that it never
    records."""
    with np.load(converted.calibration, allow_pickle=False) as archive:
        integer = [name for name in archive.files if archive[name].dtype.kind in "iu"]
    if not integer:
        return None
    return (
        "int16x8 conversion skipped: TensorFlow has no 16x8 path for integer "
        f"input(s) {', '.join(integer)}"
    )


def _tf_convert(
    saved_model: Path,
    calib_file: Path,
    files: Sequence[tuple[str, Path]],
    env_dir: Path,
    deadline: float,
    isolate: bool,
) -> tuple[str, Path]:
    """One TensorFlow process writing ``files`` (mode, path) of the saved_model: its stdout and
    its log, beside the files."""
    modes = "_".join(mode for mode, _ in files)
    log = files[0][1].with_name(QUANTIZE_LOG.format(modes=modes))
    scratch = Path(tempfile.mkdtemp(prefix="tf-convert-", dir=log.parent))
    try:
        output = run_tool(
            [
                str(toolenv.ONNX2TF.python(env_dir)),
                str(TF_CONVERT_SCRIPT),
                str(saved_model),
                str(calib_file),
                *(f"{mode}={out}" for mode, out in files),
            ],
            scratch,
            env_dir,
            deadline,
            log,
            f"the TFLite converter ({modes.replace('_', ', ')})",
            isolate,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output, log


def _smoke_run(files: Sequence[Path], sample: Inputs) -> tuple[str, ...]:
    """One LiteRT inference per file, so that a file the CPU runtime cannot run is said here,
    not when it is measured (the LN ViT's 16x8 file: LiteRT has no int16 SQUARED_DIFFERENCE).
    A file that aborts the process instead of raising cannot be caught here: ``convert_tflite``
    then takes ``smoke_run=False``."""
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


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""
