"""TFLite files of onnx2tf's saved_model: int8, 16x8, float32. Runs INSIDE the tool env.

Invoked by path with the tool environment's python (``quant.tflite.onnx2tf`` does it), never
imported by the main venv: it imports only the standard library, numpy and TensorFlow
(``onnx_to_saved_model.py`` imports its calibration helpers, to check its model on the same
samples). Why not let onnx2tf quantize (``-oiqt``): it writes five quantized variants from one
calibration set (we need two), and it casts every calibration input to float32, so a model with an
int64 input (text token ids) cannot be fully integer-quantized at all. Here the representative data
keeps the input's dtype.

Asked for both, the float32 file is the int8 conversion's own: TensorFlow converts the saved_model
to a float TFLite model, calibrates that model and quantizes it, and that float model is written as
the float32 file. A conversion of its own did that same first step again: BERT-base's float32 file
took 31.5 s of a process (TensorFlow, the saved_model, the MLIR conversion), and in the int8
process's 79 s the float model was 10.5 s of MLIR conversion, calibration 44.4 s, quantizing 8.1 s
(measured once each, alone on the 2-core host). Same ops, same tensor names, equal values on every
tensor (BERT-base, and tests/test_tflite.py); the file lacks only the converter's
CONVERSION_METADATA entry.

The converter settings are onnx2tf's own (``from_saved_model``, per-channel weights,
``unfold_batchmatmul=False`` so attention stays BATCH_MATMUL), minus ``SELECT_TF_OPS``: a
TensorFlow "Flex" op would run neither in LiteRT nor on an NPU, so an op with no integer kernel
fails the conversion here instead of slipping through.

    python tf_convert.py SAVED_MODEL CALIB.npz MODE=OUT [MODE=OUT ...]   # float32, int8, int16x8

The float32 file (LiteRT's fp32 reference for the per-tensor SQNR and for benchmarks' latency),
asked for alone, takes the same route without quantization; it is what onnx2tf's own
``*_float32.tflite`` holds, minus the Flex-op escape hatch.

CALIB.npz holds the calibration samples, one array per model input named as the ONNX model names
it (onnx2tf keeps those names as the signature's keys), float32 or int64, one sample per row (the
model has batch 1), in the ONNX model's layout (NCHW) or already channels-last as the saved_model
takes.
Exit code 0 when the files were written, in the order given; on failure the last stderr line
says why. A failed 16x8 conversion (TensorFlow has no 16x8 path for some graphs) is a
"warning: ..." line on stdout and no file, not a failure: 16x8 is the fallback, not the product.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

SIGNATURE = "serving_default"
MODES = ("float32", "int8", "int16x8")


def _signature_inputs(saved_model: str) -> dict[str, tuple[tf.dtypes.DType, tuple]]:
    """The inputs of the saved_model's serving signature: key -> (dtype, shape), an unknown
    dimension as None. Read from saved_model.pb alone: ``tf.saved_model.load`` restored every
    variable too, memory the process kept while the converter loaded them again (BERT-base's
    int8 process peaked at 6201 MiB resident with it, 5802 MiB without, the same file; measured
    once with ``/usr/bin/time``)."""
    with open(os.path.join(saved_model, "saved_model.pb"), "rb") as file:
        proto = saved_model_pb2.SavedModel.FromString(file.read())
    inputs = proto.meta_graphs[0].signature_def[SIGNATURE].inputs
    return {
        key: (
            tf.dtypes.as_dtype(info.dtype),
            tuple(None if dim.size < 0 else dim.size for dim in info.tensor_shape.dim),
        )
        for key, info in inputs.items()
    }


def _canonical(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def calibration_for(keys: list[str], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The calibration array of each signature key: the one array for a one-input model, else
    the array of the same name (onnx2tf may have changed separators or case)."""
    if len(keys) == 1 and len(arrays) == 1:
        return {keys[0]: next(iter(arrays.values()))}
    by_name = {_canonical(name): array for name, array in arrays.items()}
    missing = [key for key in keys if _canonical(key) not in by_name]
    if missing:
        raise SystemExit(
            f"error: no calibration data for input(s) {', '.join(missing)} "
            f"(given: {', '.join(arrays)})"
        )
    return {key: by_name[_canonical(key)] for key in keys}


def to_saved_model_layout(calib: np.ndarray, shape: tuple, key: str) -> np.ndarray:
    """ONNX-layout samples (N, C, H, W) -> the saved_model's (N, H, W, C), which onnx2tf made
    channels-last; samples already in the saved_model's layout pass unchanged."""
    if tuple(calib.shape[1:]) == tuple(shape[1:]):
        return calib
    if calib.ndim >= 3:
        moved = np.moveaxis(calib, 1, -1)
        if tuple(moved.shape[1:]) == tuple(shape[1:]):
            return np.ascontiguousarray(moved)
    raise SystemExit(
        f"error: calibration samples have shape {calib.shape[1:]}, the "
        f"saved_model input {key!r} takes {shape[1:]}"
    )


def _representative(calib: dict[str, np.ndarray], dtypes: dict[str, tf.dtypes.DType]):
    """One sample per step, batch 1, every input in its own dtype (int64 ids stay int64)."""
    count = min(len(array) for array in calib.values())

    def gen():
        for i in range(count):
            yield {key: tf.constant(a[i : i + 1], dtype=dtypes[key]) for key, a in calib.items()}

    return gen


def _keeping_float_model(converter: tf.lite.TFLiteConverter, keep: Callable[[bytes], None]) -> None:
    """Hand ``keep`` the float TFLite model the converter is about to calibrate and quantize.
    ``_quantize`` (TensorFlow 2.19, the tool env's pin) takes it as its first argument; a
    TensorFlow whose converter no longer calls it keeps nothing, and ``main`` then fails on the
    missing file rather than writing a float32 file of another model."""
    quantize = converter._quantize

    def quantize_and_keep(model: bytes, *args, **kwargs) -> bytes:
        keep(bytes(model))
        return quantize(model, *args, **kwargs)

    converter._quantize = quantize_and_keep


def _convert(
    saved_model: str,
    calib: dict[str, np.ndarray],
    dtypes: dict[str, tf.dtypes.DType],
    mode: str,
    keep_float: Callable[[bytes], None] | None = None,
) -> bytes:
    """The ``mode`` file's bytes; a quantized mode gives ``keep_float`` its float model."""
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model)
    converter.unfold_batchmatmul = False
    if mode == "float32":
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        return converter.convert()
    if keep_float is not None:
        _keeping_float_model(converter, keep_float)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = _representative(calib, dtypes)
    converter._experimental_disable_per_channel = False
    if mode == "int8":
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        io_type = tf.int8
    else:
        converter.target_spec.supported_types = []
        converter.target_spec.supported_ops = [
            tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8
        ]
        io_type = tf.int16
    # Only float inputs take the integer I/O type. int64 index and mask inputs keep their type
    # when inference_input_type is left alone (the converter refuses tf.int64 there); it is one
    # setting for all inputs, so a model mixing float and integer inputs keeps float input.
    if all(dtype.is_floating for dtype in dtypes.values()):
        converter.inference_input_type = io_type
    converter.inference_output_type = io_type
    return converter.convert()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("saved_model")
    parser.add_argument("calib")
    parser.add_argument("files", nargs="+", metavar="MODE=OUT", help="e.g. int8=model_int8.tflite")
    args = parser.parse_args()
    files = [tuple(item.split("=", 1)) for item in args.files]
    if any(len(item) != 2 or item[0] not in MODES for item in files):
        parser.error(f"each file is MODE=OUT with MODE one of {', '.join(MODES)}")

    with np.load(args.calib, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    signature = _signature_inputs(args.saved_model)
    calib = {
        key: to_saved_model_layout(array, signature[key][1], key)
        for key, array in calibration_for(list(signature), arrays).items()
    }
    dtypes = {key: dtype for key, (dtype, _) in signature.items()}
    for key, (dtype, shape) in signature.items():
        print(f"input {key!r} {dtype.name} {shape}; {len(calib[key])} samples", flush=True)
    outputs = dict(files)
    float_from_int8 = {"float32", "int8"} <= outputs.keys()  # one conversion writes both
    for mode, out in files:
        if mode == "float32" and float_from_int8:
            continue  # written by the int8 conversion, before its int8 file
        keep = None
        if mode == "int8" and float_from_int8:
            keep = functools.partial(_write, "float32", outputs["float32"])
        try:
            model = _convert(args.saved_model, calib, dtypes, mode, keep)
        except Exception as exc:  # the converter raises many types; report one line
            message = (
                f"{mode} conversion failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
            )
            if mode != "int16x8":
                print(f"error: {message[:400]}", file=sys.stderr)
                return 1
            # 16x8 is the fallback file, not the product: the int8 file still ships.
            print(f"warning: {message[:400]}", flush=True)
            continue
        if keep is not None and not os.path.isfile(outputs["float32"]):
            print("error: the int8 conversion handed over no float model", file=sys.stderr)
            return 1
        _write(mode, out, model)
    return 0


def _write(mode: str, out: str, model: bytes) -> None:
    with open(out, "wb") as f:
        f.write(model)
    print(f"wrote {mode}: {out} ({len(model)} bytes)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
