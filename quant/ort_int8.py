"""int8 ONNX through ONNX Runtime's quantizer: QDQ, per-channel int8 weights, MinMax calibration.

Nothing here calibrates by hand: ``quant_pre_process`` then ``quantize_static`` do the work; a
profile only chooses the options, and ``int16_tensors`` moves named activations to 16 bits
through ORT's ``TensorQuantOverrides`` (the drift fallback). Around it, a profile may ask for
ONNX Runtime's speed rewrites (``quant.ort_graph``: Linears as Gemm before; after,
``quant.ort_rewrites``: float inputs for Softmax/GELU, the attention's operands), for
power-of-two scales (TIDL's simple calibration): each scale becomes
the power of two just below or above it, whichever quantizes the calibration values with the
smaller squared error, and the integer weights are re-quantized to their new scale; and for
its int32 biases corrected on the calibration data (``quant.bias_correction``).
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
import onnxruntime as ort
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
    _TENSOR_SAVE_POSTFIX,  # the suffix of the outputs it adds: its own naming rule, not copied
    modify_model_output_intermediate_tensors,
)

from .bias_correction import correct_biases
from .data import Feeds, Samples, feed_for
from .graph_walk import graph_input_names, static_batch
from .ort_graph import linear_as_gemm
from .ort_rewrites import apply_ort_rewrites, ort_rewrites, shared_quantization
from .pow2_record import scale_choices, scales_by_name, write_choices
from .targets import TargetProfile

CALIBRATION_BATCH = 32
POWER_OF_TWO_SAMPLES = 32  # calibration samples that choose each power-of-two activation scale
# Samples per run when every tensor of a model is saved (a model without a static batch): all
# of them are in memory at once, ~200 MB a sample for ViT-Tiny, so a few, not the whole set.
STREAM_BATCH = 4
QUANT_TYPES = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}


class SamplesReader(CalibrationDataReader):
    """Feeds calibration samples to ORT's calibrator in batches, every input by its name."""

    def __init__(
        self, input_names: Sequence[str], samples: Samples, batch: int, *, pad: bool = False
    ) -> None:
        feeds = feed_for(input_names, samples.feeds)
        self.batches = list(Samples(feeds, None, samples.source).batches(batch, pad=pad))
        self.position = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= len(self.batches):
            return None
        self.position += 1
        return self.batches[self.position - 1]

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
    input_names = graph_input_names(model)
    fixed = static_batch(model)
    with tempfile.TemporaryDirectory() as scratch, _quiet():
        prepared = prepare_for_quantization(fp32_path, profile, Path(scratch))
        widened = shared_quantization(onnx.load(str(prepared)), int16_tensors)
        overrides = {name: [{"quant_type": QuantType.QInt16}] for name in widened}
        quantize_static(
            str(prepared),
            str(out_path),
            SamplesReader(
                input_names, calibration, fixed or CALIBRATION_BATCH, pad=fixed is not None
            ),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QUANT_TYPES[profile.activation_type],
            weight_type=QUANT_TYPES[profile.weight_type],
            reduce_range=profile.weight_bits == 7,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={
                "ActivationSymmetric": profile.symmetric_activations,
                "WeightSymmetric": True,
                "TensorQuantOverrides": overrides,
            },
        )
        if profile.power_of_two_scales or profile.bias_correction or ort_rewrites(profile):
            quantized = onnx.load(str(out_path))
            if profile.power_of_two_scales:
                # MinMax scales first: they give each activation its two power-of-two candidates
                scales = _activation_scales(
                    quantized, prepared, calibration.head(POWER_OF_TWO_SAMPLES), Path(scratch)
                )
                minmax = scales_by_name(quantized)
                chosen = round_scales_to_power_of_two(quantized, scales)
                write_choices(quantized, scale_choices(quantized, minmax, chosen, set(scales)))
            batch = fixed or CALIBRATION_BATCH
            apply_ort_rewrites(quantized, profile, prepared, calibration, batch, fixed is not None)
            if profile.bias_correction:  # last: on the graph that ships, with its final scales
                correct_biases(quantized, onnx.load(str(prepared)), calibration)
            onnx.save_model(quantized, str(out_path))
    return out_path


def prepare_for_quantization(fp32_path: Path, profile: TargetProfile, scratch: Path) -> Path:
    """The fp32 graph ORT's quantizer is given, and the reference bias correction measures
    against (in ``scratch``): its Linears as Gemm where ``profile`` wants them, then ORT's own
    pre-processing (shape inference; its fusions rename tensors)."""
    source = fp32_path
    if profile.gemm_linears:
        model = onnx.load(str(fp32_path))
        linear_as_gemm(model)
        source = scratch / "gemm_linears.onnx"
        onnx.save_model(model, str(source))
    prepared = scratch / "prepared.onnx"
    quant_pre_process(str(source), str(prepared), skip_symbolic_shape=False)
    return prepared


def _activation_scales(
    quantized: onnx.ModelProto, fp32_path: Path, samples: Samples, scratch: Path
) -> dict[str, np.ndarray]:
    """Scale name -> its best power of two, for each activation QuantizeLinear of ``quantized``
    (by error, not only by range), judged on ``samples`` run through the fp32 model it came from.

    Streamed: a batch adds each candidate's squared error to its total and its tensors are
    dropped; the choice compares the totals, as if all samples had been kept at once."""
    initializers = {init.name: init for init in quantized.graph.initializer}
    sites: dict[str, onnx.NodeProto] = {}  # scale -> the first QuantizeLinear using it decides
    for node in quantized.graph.node:
        if node.op_type == "QuantizeLinear":
            sites.setdefault(node.input[1], node)
    candidates = {
        scale: power_of_two_candidates(numpy_helper.to_array(initializers[scale]))
        for scale in sites
    }
    errors: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # scale -> (low's, high's) totals
    run = SavedTensors(fp32_path, scratch / "augmented.onnx")
    # a scale whose tensor is not a float tensor of the fp32 model is rounded up later
    sites = {scale: node for scale, node in sites.items() if node.input[0] in run.outputs}
    wanted = sorted({node.input[0] for node in sites.values()})
    fp32 = onnx.load(str(fp32_path))
    for chunk in samples.batches(stream_batch(fp32), pad=static_batch(fp32) is not None):
        values = run(chunk, wanted)
        for scale, node in sites.items():
            real = values[node.input[0]]
            zero_point = _zero_point(node, initializers)
            dtype = _quantized_dtype(node, initializers)
            low, high = (squared_error(real, c, zero_point, dtype) for c in candidates[scale])
            total_low, total_high = errors.get(scale, (0.0, 0.0))
            errors[scale] = (total_low + low, total_high + high)
        del values  # before the next batch's tensors arrive
    return {scale: _smaller_error(*candidates[scale], *errors[scale]) for scale in errors}


class SavedTensors:
    """A batch of inputs (by input name) -> the float tensors of the model on it, by name.

    ORT's ``collect_activations`` keeps every batch and builds a session per call; this builds
    one session (graph optimizations off, as there: an int8 model runs its Q/DQ nodes as
    written) on the model saved with all its tensors as outputs at ``augmented``, and returns
    one batch's tensors for the caller to reduce and drop: all of them, or only the ``wanted``
    ones (``names`` lists what there is), so that ORT hands Python no more than is used."""

    def __init__(self, model_path: Path, augmented: Path) -> None:
        modify_model_output_intermediate_tensors(str(model_path), str(augmented))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_cpu_mem_arena = False  # the arena would hold a batch's tensors after it
        self.session = ort.InferenceSession(
            str(augmented), options, providers=["CPUExecutionProvider"]
        )
        self.input_names = [value.name for value in self.session.get_inputs()]
        self.outputs = {
            o.name[: -len(_TENSOR_SAVE_POSTFIX)]: o.name
            for o in self.session.get_outputs()
            if o.name.endswith(_TENSOR_SAVE_POSTFIX)
        }

    @property
    def names(self) -> list[str]:
        return list(self.outputs)

    def __call__(self, feeds: Feeds, wanted: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = self.names if wanted is None else list(wanted)
        outputs = self.session.run(
            [self.outputs[n] for n in names], feed_for(self.input_names, feeds)
        )
        return dict(zip(names, outputs, strict=True))


def stream_batch(model: onnx.ModelProto) -> int:
    """How many samples to run at once when every tensor is kept: the static batch, if any."""
    return static_batch(model) or STREAM_BATCH


def power_of_two_ceil(scale: np.ndarray) -> np.ndarray:
    """The smallest power of two >= each scale (>= keeps every calibrated value in range)."""
    return np.exp2(np.ceil(np.log2(scale))).astype(scale.dtype)


def power_of_two_candidates(scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the power of two just below ``scale``'s ceiling power of two, that ceiling)."""
    high = power_of_two_ceil(scale.astype(np.float64))
    return high / 2, high


def squared_error(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """Sum of squared quantize-dequantize errors of ``real`` with ``scale``, per element of
    ``scale`` (summed over the axes it broadcasts along; kept, of size 1). A sum, so the error
    over many batches is the sum of theirs.

    A float32 tensor (an activation) is quantized in float32, in place in one scratch array:
    with a power-of-two scale every step but the last subtraction is exact there, and it was
    most of the power-of-two choice's time in float64 (BERT-base: 11 of its 24 s; 12x less on
    one 128 x 3072 activation). The squares are summed in float64."""
    info = np.iinfo(dtype)
    axes = tuple(i for i in range(real.ndim) if scale.ndim == 0 or scale.shape[i] == 1)
    work = np.float32 if real.dtype == np.float32 else np.float64
    scale, zero_point = np.asarray(scale, work), np.asarray(zero_point, work)
    error = np.asarray(np.divide(real, scale, dtype=work))  # an array even for one value
    np.round(error, out=error)
    error += zero_point
    np.clip(error, info.min, info.max, out=error)
    error -= zero_point
    error *= scale
    error -= real
    np.square(error, out=error)
    return error.sum(axis=axes, keepdims=True, dtype=np.float64)


def best_power_of_two(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """Per element of ``scale`` (broadcast against ``real``), the power of two just below or just
    above it, whichever quantizes ``real`` with the smaller squared error. Rounding up never
    clips but loses up to one bit everywhere; rounding down keeps the bit and clips the tail,
    which wins for the heavy-tailed activations of a trained Transformer."""
    low, high = power_of_two_candidates(scale)
    return _smaller_error(
        low,
        high,
        squared_error(real, low, zero_point, dtype),
        squared_error(real, high, zero_point, dtype),
    )


def _smaller_error(
    low: np.ndarray, high: np.ndarray, low_error: np.ndarray, high_error: np.ndarray
) -> np.ndarray:
    return np.where(low_error < high_error, low, high)


def round_scales_to_power_of_two(
    model: onnx.ModelProto, activation_scales: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every Quantize/DequantizeLinear scale -> a power of two, in place.

    Weights pick their power of two per channel on their own values and are re-quantized to it;
    an activation takes the power of two chosen on its calibration values, given in
    ``activation_scales`` (scale name -> power of two, from ``_activation_scales``), or rounds
    up when it has none (nothing clips); an int32 bias takes input scale x weight scale, the
    scale integer kernels assume for it, and is re-quantized to that. Returns every scale's
    new value, by scale name.
    """
    activation_scales = activation_scales or {}
    initializers = {init.name: init for init in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    constant = [n for n in qdq if n.op_type == "DequantizeLinear" and n.input[0] in initializers]
    is_bias = {n.input[0]: _dtype_of(initializers[n.input[0]]) == np.int32 for n in constant}
    chosen: dict[str, np.ndarray] = {}
    for node in constant:
        if not is_bias[node.input[0]] and node.input[1] not in chosen:
            chosen[node.input[1]] = _requantize(node, initializers, None)
    for node in qdq:
        scale_name = node.input[1]
        if node.op_type != "QuantizeLinear" or scale_name in chosen:
            continue
        if scale_name in activation_scales:
            chosen[scale_name] = activation_scales[scale_name]
        else:
            old = numpy_helper.to_array(initializers[scale_name]).astype(np.float64)
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
    return chosen


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
