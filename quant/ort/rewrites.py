"""A profile's ONNX Runtime rewrites of the QDQ file ``quantize_static`` wrote, in their order,
and which tensors ORT's quantizer quantizes together.

The rewrites themselves live in ``quant.ort.graph`` (float inputs, constant factors, Shapes)
and ``quant.ort.attention`` (the attention's s8 right operands); measured step by step in
``benchmarks/results/ort_speed.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnxruntime.quantization.calibrate import TensorsData

from ..targets.profiles import TargetProfile
from .attention import calibrated_absmax, signed_operand_sources, signed_right_operands
from .graph import float_inputs, fold_constant_factors, shapes_of_quantized

# ops whose output ORT's quantizer quantizes with its input's scale and type
# (``quantize_output_same_as_input``): an override of the output alone is not applied
SHARED_QUANTIZATION_OPS = frozenset({"Split", "Reshape", "Transpose", "Squeeze", "Unsqueeze"})


def ort_rewrites(profile: TargetProfile) -> bool:
    """Whether the profile rewrites the quantized file for ONNX Runtime at all."""
    return bool(
        profile.float_inputs
        or profile.fold_factors
        or profile.shapes_of_quantized
        or profile.signed_right_operands
    )


def apply_ort_rewrites(
    quantized: onnx.ModelProto, profile: TargetProfile, ranges: TensorsData
) -> None:
    """The profile's rewrites of ``quantized``, in place. ``ranges``: ORT's calibration of the
    fp32 model it was quantized from, which bounds the s8 operands."""
    if profile.fold_factors:  # first: the factors' Q/DQ pairs would stop the rewrites below
        fold_constant_factors(quantized)
    if profile.shapes_of_quantized:
        shapes_of_quantized(quantized)
    if profile.float_inputs:
        float_inputs(quantized, profile.float_inputs)
    if profile.signed_right_operands:  # last: on the float tensors the rewrites above left
        sources = signed_operand_sources(quantized, profile.signed_min_macs)
        bounds = calibrated_absmax(ranges, sources)
        signed_right_operands(quantized, bounds, profile.signed_min_macs)
        # a Split whose outputs are quantized again (K, V to s8) is fed in float by its Gemm:
        # no requantize into a u8 tensor that is only dequantized again
        splits = {
            n.name
            for n in quantized.graph.node
            if n.op_type == "Split" and set(n.output) & set(sources)
        }
        float_inputs(quantized, {"Split"}, splits)


def shared_quantization(model: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    """``names`` and, for each, the tensor whose quantization it shares in ORT's quantizer: up
    through Split/Reshape/Transpose/Squeeze/Unsqueeze to the first other producer. A tensor
    widened to 16 bits (the drift fallback) must be widened there, or its override is lost:
    the outputs of the qkv Split, say, take the qkv Gemm output's scale and type."""
    producers = {out: node for node in model.graph.node for out in node.output}
    roots = []
    for name in names:
        node = producers.get(name)
        while node is not None and node.op_type in SHARED_QUANTIZATION_OPS:
            name = node.input[0]
            node = producers.get(name)
        roots.append(name)
    return list(dict.fromkeys([*names, *roots]))
