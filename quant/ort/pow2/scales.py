"""Power-of-two scales (TIDL's simple calibration) for a QDQ model ORT's quantizer wrote.

Each scale becomes, of the powers of two at and below its ceiling power of two
(``power_of_two_candidates``), the one that quantizes the values it scales with the smallest
squared error (a masked Softmax input: as the Softmax sees it, ``softmax_visible_error``): the
range search runs on the grid the file will have, not on MinMax scales rounded afterwards. A
weight's own values, per channel, are quantized to its new scale from the fp32 values (not
rounded again from ORT's int8 copy, ``fp32_constants``); an activation's calibration
values are summed over (``quant.ort.quantize`` runs the fp32 model over them and adds each
candidate's error); an int32 bias takes input scale x weight scale, the scale integer kernels
assume for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization.quant_utils import TENSOR_NAME_QUANT_SUFFIX

from converters.attention_masks import MASK_PENALTY
from converters.attention_masks import masked_softmax_inputs as attention_masked


def power_of_two_ceil(scale: np.ndarray) -> np.ndarray:
    """The smallest power of two >= each scale (>= keeps every calibrated value in range)."""
    return np.exp2(np.ceil(np.log2(scale))).astype(scale.dtype)


# Ops whose output range the op itself bounds: the top of the range is no outlier but the signal
# (a Softmax's largest probabilities carry its attention, which P.V weighs by V and the squared
# error of P alone does not), so their scales weigh only the two powers of two around the
# MinMax scale. Measured on text-rt-un's tda4vm file: with four candidates its two Softmax
# outputs clipped at 1/2 and 1/4, the logits' cosine fell 0.9979 -> 0.9964 and the agreement
# 99.6 -> 99.5 %; bounded to two, the file is the one before, and hf_migrate's BERT seed 0
# 99.4 -> 99.5 % (measured once; Sigmoid and Tanh by the same reasoning, not measured).
BOUNDED_OPS = frozenset({"Softmax", "Sigmoid", "Tanh"})


def candidate_count(producer: str | None, count: int) -> int:
    """How many candidates a tensor written by the op ``producer`` weighs, of a profile's
    ``count``: at most the two around its MinMax scale for a ``BOUNDED_OPS`` output."""
    return min(count, 2) if producer in BOUNDED_OPS else count


def power_of_two_candidates(scale: np.ndarray, count: int) -> tuple[np.ndarray, ...]:
    """``count`` powers of two: ``scale``'s ceiling power of two, which clips nothing, then each
    one below it, which halves the step and clips more of the tail (``TargetProfile``'s
    ``power_of_two_candidates``)."""
    high = power_of_two_ceil(scale.astype(np.float64))
    return tuple(high / 2**k for k in range(count))


def squared_error(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """Sum of squared quantize-dequantize errors of ``real`` with ``scale``, per element of
    ``scale`` (summed over the axes it broadcasts along; kept, of size 1). A sum, so the error
    over many batches is the sum of theirs.

    A float32 tensor (an activation) is quantized in float32, in place in one scratch array:
    with a power-of-two scale every step but the last subtraction is exact there, and it takes
    a twelfth of the float64 time on a 128 x 3072 activation (BERT-base's whole choice over 32
    samples, measured once side by side: 18.9 -> 17.0 s, the same 268 scales). The squares are
    summed in float64."""
    axes = tuple(i for i in range(real.ndim) if scale.ndim == 0 or scale.shape[i] == 1)
    error = _dequantized(real, scale, zero_point, dtype)
    error -= real
    np.square(error, out=error)
    return error.sum(axis=axes, keepdims=True, dtype=np.float64)


def _dequantized(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """``real`` quantized to ``dtype`` with ``scale`` and ``zero_point`` and dequantized, in one
    new array of ``real``'s float type (float32 stays float32, ``squared_error`` says why)."""
    info = np.iinfo(dtype)
    work = np.float32 if real.dtype == np.float32 else np.float64
    scale, zero_point = np.asarray(scale, work), np.asarray(zero_point, work)
    values = np.asarray(np.divide(real, scale, dtype=work))  # an array even for one value
    np.round(values, out=values)
    values += zero_point
    np.clip(values, info.min, info.max, out=values)
    values -= zero_point
    values *= scale
    return values


# A Softmax input this far below its row's maximum weighs under e^-16 = 1.1e-7 of that row's
# largest weight, under float32's resolution next to it: the Softmax cannot tell such values apart.
SOFTMAX_FLOOR = 16.0
# ... and a value is a masked key's at or below half the mask's penalty, in a Softmax input that
# a mask is added into (``masked_softmax_inputs``). A model's own scores also reach 16 below their
# row's maximum, and counting those as free moved a ViT's steps away from what its logits wanted
# (held-out logits' error of hf-vit-mnist-un's tda4vm file 0.131 -> 0.161 with neither bound,
# 0.133 with this one; vit-mnist-un's 0.141 -> 0.158 with this one, 0.141 with both: measured
# once side by side)
MASK_LEVEL = MASK_PENALTY / 2


def softmax_visible_error(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype, axis: int
) -> np.ndarray:
    """``squared_error`` of a Softmax's input (over ``axis``) as the Softmax sees it: values
    ``SOFTMAX_FLOOR`` or more below their row's maximum, and masked (at most ``MASK_LEVEL``),
    count as equal. An attention mask's penalty (-30, ``converters.attention_masks``) then no
    longer sets the scale: its own error would keep it in range at a step coarse for the scores
    (BERT's 1/4), while clipping it to -16 changes nothing the Softmax computes. Per tensor (an
    activation's scale), kept with size 1 on every axis like ``squared_error``'s."""
    work = real.astype(np.float32, copy=False)
    unseen = work.max(axis=axis, keepdims=True) - np.float32(SOFTMAX_FLOOR)
    floor = np.minimum(unseen, np.float32(MASK_LEVEL))
    error = np.maximum(_dequantized(work, scale, zero_point, dtype), floor)
    error -= np.maximum(work, floor)
    return np.square(error, dtype=np.float64).sum(keepdims=True)


def masked_softmax_inputs(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor -> the axis of its Softmax, for each tensor of the float graph ``model`` that a
    Softmax alone reads and an attention mask was added into (``converters.attention_masks``):
    the scales ``softmax_visible_error`` judges."""
    masked = attention_masked(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {output.name for output in model.graph.output}
    found = {}
    for name in masked - outputs:
        nodes = readers.get(name, [])
        if len(nodes) == 1 and nodes[0].op_type == "Softmax":
            found[name] = next((a.i for a in nodes[0].attribute if a.name == "axis"), -1)
    return found


def best_power_of_two(
    real: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype, count: int
) -> np.ndarray:
    """Per element of ``scale`` (broadcast against ``real``), of its ``count`` candidate powers
    of two (``power_of_two_candidates``) the one that quantizes ``real`` with the smallest squared
    error. Rounding up never clips but loses up to one bit everywhere; rounding down keeps the
    bit and clips the tail, which wins for the heavy-tailed activations of a trained
    Transformer, and for some (attention scores) a power of two further down wins again."""
    candidates = power_of_two_candidates(scale, count)
    errors = [squared_error(real, candidate, zero_point, dtype) for candidate in candidates]
    return smallest_error(candidates, errors)


def smallest_error(candidates: Sequence[np.ndarray], errors: Sequence[np.ndarray]) -> np.ndarray:
    """Element by element, the candidate with the smallest error; of equal ones the first (the
    larger scale: no clipping)."""
    best = np.argmin(np.stack(np.broadcast_arrays(*errors)), axis=0)
    return np.choose(best, np.broadcast_arrays(*candidates))


def round_scales_to_power_of_two(
    model: onnx.ModelProto,
    activation_scales: Mapping[str, np.ndarray],
    count: int,
    originals: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Every Quantize/DequantizeLinear scale -> a power of two, in place.

    Weights pick their power of two per channel, of ``count`` candidates, on their own values
    and are re-quantized to it; an activation takes the power of two chosen on its calibration
    values, given in ``activation_scales`` (scale name -> power of two, from
    ``calibration_pass``), or rounds up when it has none (nothing clips); an int32 bias takes
    input scale x weight scale, the scale integer kernels assume for it, and is re-quantized to
    that (one that no Conv/Gemm adds, a LayerNormalization's, picks its own best of ``count``).
    Every constant is judged and re-quantized on its fp32 values where ``originals`` has them
    (quantized initializer -> the values it was quantized from, ``fp32_constants``), else on the
    int8 copy's. Returns every scale's new value, by scale name.
    """
    originals = originals or {}
    initializers = {init.name: init for init in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    constant = [n for n in qdq if n.op_type == "DequantizeLinear" and n.input[0] in initializers]
    is_bias = {n.input[0]: _dtype_of(initializers[n.input[0]]) == np.int32 for n in constant}
    chosen: dict[str, np.ndarray] = {}
    for node in constant:
        if not is_bias[node.input[0]] and node.input[1] not in chosen:
            real = originals.get(node.input[0])
            chosen[node.input[1]] = _requantize(node, initializers, None, count, real)
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
            new = bias_scales.get(node.output[0])
            real = originals.get(node.input[0])
            chosen[node.input[1]] = _requantize(node, initializers, new, count, real)
    for node in qdq:  # any scale left: round up
        if node.input[1] not in chosen:
            old = numpy_helper.to_array(initializers[node.input[1]]).astype(np.float64)
            chosen[node.input[1]] = power_of_two_ceil(old)
    for name, scale in chosen.items():
        old = numpy_helper.to_array(initializers[name])
        new = np.asarray(scale, dtype=old.dtype).reshape(old.shape)
        initializers[name].CopyFrom(numpy_helper.from_array(new, name))
    return chosen


def fp32_constants(quantized: onnx.ModelProto, fp32: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Quantized initializer -> the fp32 values it was quantized from, for each constant of the
    QDQ ``quantized`` that ``fp32`` (the graph ORT's quantizer was given) holds, with its
    shape, under the name the quantizer derives it from (its ``TENSOR_NAME_QUANT_SUFFIX``).

    What ``round_scales_to_power_of_two`` re-quantizes from: the int8 copy is already rounded
    to its MinMax scale's grid, and rounding it again to a power of two adds up to half a new
    step more (an error variance of (s_minmax^2 + s^2) / 12 instead of s^2 / 12 where the two
    grids do not line up). From the fp32 values, the held-out logits' error of every bundled UN
    example's tda4vm file fell (hf-bert-rt-un 0.00073 -> 0.00070, vit-mnist-un 0.141 -> 0.135;
    benchmarks/results/tda4vm_streams.md)."""
    originals = {init.name: init for init in fp32.graph.initializer}
    found = {}
    for init in quantized.graph.initializer:
        if not init.name.endswith(TENSOR_NAME_QUANT_SUFFIX):
            continue
        original = originals.get(init.name.removesuffix(TENSOR_NAME_QUANT_SUFFIX))
        if original is not None and list(original.dims) == list(init.dims):
            found[init.name] = numpy_helper.to_array(original)
    return found


def _dtype_of(tensor: onnx.TensorProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))


def _requantize(
    node: onnx.NodeProto,
    initializers: dict[str, onnx.TensorProto],
    new: np.ndarray | None,
    count: int,
    real: np.ndarray | None = None,
) -> np.ndarray:
    """Re-quantize a DequantizeLinear's constant data to ``new`` (or to its best power of two of
    ``count``): from ``real``, the values it was quantized from, where given, else from the
    data itself (rounded twice); returns the new scale, shaped like the old."""
    data, scale_name = node.input[0], node.input[1]
    values = numpy_helper.to_array(initializers[data])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    zero_point = _broadcast(zero_point_of(node, initializers), values.ndim, axis)
    old_scale = numpy_helper.to_array(initializers[scale_name])
    old = _broadcast(old_scale, values.ndim, axis)
    if real is None:
        real = (values.astype(np.float64) - zero_point) * old
    real = real.astype(np.float64)
    if new is None:
        new = best_power_of_two(real, old, zero_point, values.dtype, count)
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


def quantized_dtype(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.dtype:
    if len(node.input) > 2 and node.input[2] in initializers:
        return numpy_helper.to_array(initializers[node.input[2]]).dtype
    return np.dtype(np.uint8)  # ONNX's default output type without a zero point


def zero_point_of(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray:
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
