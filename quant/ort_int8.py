"""int8 ONNX through ONNX Runtime's quantizer: QDQ, per-channel int8 weights, MinMax calibration.

Nothing here calibrates by hand: ``quant_pre_process`` then ``quantize_static`` do the work; a
profile only chooses the options, and ``int16_tensors`` moves named activations to 16 bits
through ORT's ``TensorQuantOverrides`` (the drift fallback). Power-of-two scales (TIDL's simple
calibration) are the one post-processing step: each scale is rounded UP to a power of two, so
no calibrated value clips, and the integer weights are re-quantized to their new scale.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)
from onnxruntime.quantization.qdq_loss_debug import (
    collect_activations,
    modify_model_output_intermediate_tensors,
)

from .data import Samples
from .targets import TargetProfile

CALIBRATION_BATCH = 32
POWER_OF_TWO_SAMPLES = 32  # activations kept in memory to choose each power-of-two scale
ACTIVATION_TYPES = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}


class SamplesReader(CalibrationDataReader):
    """Feeds calibration samples to ORT's calibrator in batches (the model's first input)."""

    def __init__(self, input_name: str, inputs: np.ndarray, batch: int) -> None:
        self.input_name = input_name
        self.batches = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
        self.position = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= len(self.batches):
            return None
        self.position += 1
        return {self.input_name: self.batches[self.position - 1]}

    def rewind(self) -> None:
        self.position = 0


def quantize_onnx(
    fp32_path: Path,
    out_path: Path,
    profile: TargetProfile,
    calibration: Samples,
    int16_tensors: Sequence[str] = (),
) -> Path:
    """Quantize ``fp32_path`` for ``profile``; the activations in ``int16_tensors`` get 16 bits."""
    model = onnx.load(str(fp32_path))
    input_name = model.graph.input[0].name
    static_batch = _static_batch(model)
    overrides = {name: [{"quant_type": QuantType.QInt16}] for name in int16_tensors}
    activations: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as scratch, _quiet():
        prepared = Path(scratch) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=False)
        if profile.power_of_two_scales:
            activations = _activation_values(prepared, Path(scratch), calibration.inputs)
        quantize_static(
            str(prepared),
            str(out_path),
            SamplesReader(input_name, calibration.inputs, static_batch or CALIBRATION_BATCH),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=ACTIVATION_TYPES[profile.activation_type],
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={
                "ActivationSymmetric": profile.symmetric_activations,
                "WeightSymmetric": True,
                "TensorQuantOverrides": overrides,
            },
        )
    if profile.power_of_two_scales:
        quantized = onnx.load(str(out_path))
        round_scales_to_power_of_two(quantized, activations)
        onnx.save_model(quantized, str(out_path))
    return out_path


def _activation_values(
    model_path: Path, scratch: Path, inputs: np.ndarray
) -> dict[str, np.ndarray]:
    """Every float tensor of the model on a few calibration samples (to choose power-of-2 scales
    by error, not only by range)."""
    augmented = scratch / "augmented.onnx"
    modify_model_output_intermediate_tensors(str(model_path), str(augmented))
    model = onnx.load(str(model_path))
    batch = _static_batch(model) or CALIBRATION_BATCH
    reader = SamplesReader(model.graph.input[0].name, inputs[:POWER_OF_TWO_SAMPLES], batch)
    collected = collect_activations(str(augmented), reader)
    return {name: np.concatenate([v.ravel() for v in values]) for name, values in collected.items()}


def _static_batch(model: onnx.ModelProto) -> int | None:
    """The fixed batch size of the first input, or None when it is dynamic."""
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    return dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None


def power_of_two_ceil(scale: np.ndarray) -> np.ndarray:
    """The smallest power of two >= each scale (>= keeps every calibrated value in range)."""
    return np.exp2(np.ceil(np.log2(scale))).astype(scale.dtype)


def best_power_of_two(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """Per element of ``scale`` (broadcast against ``real``), the power of two just below or just
    above it, whichever quantizes ``real`` with the smaller squared error. Rounding up never
    clips but loses up to one bit everywhere; rounding down keeps the bit and clips the tail,
    which wins for the heavy-tailed activations of a trained Transformer."""
    high = power_of_two_ceil(scale.astype(np.float64))
    low = high / 2
    info = np.iinfo(dtype)
    axes = tuple(i for i in range(real.ndim) if scale.ndim == 0 or scale.shape[i] == 1)
    errors = []
    for candidate in (low, high):
        quantized = np.clip(np.round(real / candidate) + zero_point, info.min, info.max)
        errors.append(
            np.square((quantized - zero_point) * candidate - real).sum(axis=axes, keepdims=True)
        )
    return np.where(errors[0] < errors[1], low, high)


def round_scales_to_power_of_two(
    model: onnx.ModelProto, activations: Mapping[str, np.ndarray] | None = None
) -> None:
    """Every Quantize/DequantizeLinear scale -> a power of two, in place.

    Weights pick their power of two per channel on their own values and are re-quantized to it;
    an activation picks on its calibration values in ``activations`` (tensor name -> values), or
    rounds up when it has none (nothing clips); an int32 bias takes input scale x weight scale,
    the scale integer kernels assume for it, and is re-quantized to that.
    """
    activations = activations or {}
    initializers = {init.name: init for init in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    constant = [n for n in qdq if n.op_type == "DequantizeLinear" and n.input[0] in initializers]
    is_bias = {n.input[0]: _dtype_of(initializers[n.input[0]]) == np.int32 for n in constant}
    chosen: dict[str, np.ndarray] = {}
    for node in constant:
        if not is_bias[node.input[0]] and node.input[1] not in chosen:
            chosen[node.input[1]] = _requantize(node, initializers, None)
    for node in qdq:
        tensor, scale_name = node.input[0], node.input[1]
        if node.op_type != "QuantizeLinear" or scale_name in chosen:
            continue
        old = numpy_helper.to_array(initializers[scale_name]).astype(np.float64)
        if tensor in activations:
            zero_point = _zero_point(node, initializers)
            dtype = _quantized_dtype(node, initializers)
            chosen[scale_name] = best_power_of_two(activations[tensor], old, zero_point, dtype)
        else:
            chosen[scale_name] = power_of_two_ceil(old)
    bias_scales = _bias_scales(model, initializers, chosen)
    for node in constant:
        if is_bias[node.input[0]] and node.input[1] not in chosen:
            chosen[node.input[1]] = _requantize(node, initializers, bias_scales.get(node.output[0]))
    for node in qdq:  # any scale left: round up
        if node.input[1] not in chosen:
            old = numpy_helper.to_array(initializers[node.input[1]]).astype(np.float64)
            chosen[node.input[1]] = power_of_two_ceil(old)
    for name, scale in chosen.items():
        old = numpy_helper.to_array(initializers[name])
        new = np.asarray(scale, dtype=old.dtype).reshape(old.shape)
        initializers[name].CopyFrom(numpy_helper.from_array(new, name))


def _dtype_of(tensor: onnx.TensorProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))


def _requantize(
    node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], new: np.ndarray | None
) -> np.ndarray:
    """Re-quantize a DequantizeLinear's constant data to ``new`` (or to its best power of two)
    so that it dequantizes to the same real values; returns the new scale, shaped like the old."""
    data, scale_name = node.input[0], node.input[1]
    values = numpy_helper.to_array(initializers[data])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    zero_point = _broadcast(_zero_point(node, initializers), values.ndim, axis)
    old_scale = numpy_helper.to_array(initializers[scale_name])
    old = _broadcast(old_scale, values.ndim, axis)
    real = (values.astype(np.float64) - zero_point) * old
    if new is None:
        new = best_power_of_two(real, old, zero_point, values.dtype)
    else:
        new = _broadcast(np.broadcast_to(new, old_scale.shape), values.ndim, axis)
    info = np.iinfo(values.dtype)
    quantized = np.clip(np.round(real / new) + zero_point, info.min, info.max)
    initializers[data].CopyFrom(numpy_helper.from_array(quantized.astype(values.dtype), data))
    return np.asarray(new).reshape(old_scale.shape)


def _bias_scales(
    model: onnx.ModelProto,
    initializers: dict[str, onnx.TensorProto],
    chosen: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Dequantized-bias tensor name -> input scale x weight scale, for each Conv/Gemm whose
    three inputs all come from DequantizeLinear nodes with chosen scales."""
    dequantized = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    scales = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3:
            continue
        feeds = [dequantized.get(name) for name in node.input[:3]]
        if any(f is None for f in feeds) or not all(f.input[1] in chosen for f in feeds[:2]):
            continue
        x_scale, w_scale = (np.asarray(chosen[f.input[1]]).reshape(-1) for f in feeds[:2])
        scales[node.input[2]] = x_scale * w_scale
    return scales


def _quantized_dtype(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.dtype:
    if len(node.input) > 2 and node.input[2] in initializers:
        return numpy_helper.to_array(initializers[node.input[2]]).dtype
    return np.dtype(np.uint8)  # ONNX's default output type without a zero point


def _zero_point(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray:
    if len(node.input) > 2 and node.input[2] in initializers:
        return numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64)
    return np.zeros((), dtype=np.float64)


def _broadcast(scale: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """A per-axis scale shaped to broadcast against data of rank ``ndim`` along ``axis``."""
    if scale.ndim == 0 or ndim == 0:
        return scale.astype(np.float64)
    shape = [1] * ndim
    shape[axis % ndim] = scale.size
    return scale.astype(np.float64).reshape(shape)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ORT's quantizer logs and prints calibration chatter; the caller's output stays clean."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
