"""Each target's rules, enforced on the ONNX files it ships (TFLite: :mod:`.tflite_flatbuffer`).

A profile states its rules (:mod:`quant.targets`); these checks read them back from the file
produced, so an artifact that a board would reject never leaves the pipeline as "ok".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import RuleViolation
from .profiles import TargetProfile

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def file_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def check_onnx_artifact(path: Path, profile: TargetProfile) -> None:
    """Raise RuleViolation naming the first broken rule of ``profile`` in the QDQ file."""
    model = onnx.load(str(path))
    name = f"{profile.name}: {path.name}"
    opset = file_opset(model)
    if opset != profile.opset:
        raise RuleViolation(f"{name}: opset {opset}, the target needs {profile.opset}")
    if profile.static_batch:
        for value in model.graph.input:
            dims = value.type.tensor_type.shape.dim
            if not dims or not dims[0].HasField("dim_value") or dims[0].dim_value != 1:
                raise RuleViolation(f"{name}: input {value.name} is not static batch 1")
    initializers = {init.name: init for init in model.graph.initializer}
    qdq = [node for node in model.graph.node if node.op_type in QDQ_OPS]
    if not qdq:
        raise RuleViolation(f"{name}: no QuantizeLinear/DequantizeLinear: not quantized")
    for node in qdq:
        scale = _constant(initializers, node.input[1], f"{name}: scale of {node.name}")
        zero_point = (
            _constant(initializers, node.input[2], f"{name}: zero point of {node.name}")
            if len(node.input) > 2 and node.input[2]
            else np.zeros((), np.int8)
        )
        if profile.symmetric_activations and np.any(zero_point != 0):
            raise RuleViolation(f"{name}: {node.name} has a non-zero zero point (asymmetric)")
        if profile.symmetric_activations and zero_point.dtype.kind == "u":
            raise RuleViolation(f"{name}: {node.name} is unsigned; the target needs signed")
        if profile.power_of_two_scales and not is_power_of_two(scale):
            raise RuleViolation(f"{name}: {node.name} has a scale that is not a power of two")
    _check_weights(model, profile, name)
    _check_signed_activations(model, profile, name)


# ORT's x86 u8s8 kernels without VNNI add pairs of u8 x s8 products in int16 (VPMADDUBSW):
# 2 x 255 x 64 = 32640 fits, 2 x 255 x 128 does not. The largest s8 weight of a 7-bit file.
SEVEN_BIT_MAX = 64


def _check_weights(model: onnx.ModelProto, profile: TargetProfile, name: str) -> None:
    """The weights' type and range the profile promises (what keeps a cpu file from saturating
    the int8 kernels of an x86 without VNNI): s8 constants within 7 bits when it says 7 bits;
    none at all when its weights are u8 (U8U8 kernels)."""
    if profile.weight_bits != 7 and profile.weight_type != "uint8":
        return
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in initializers:
            continue
        values = numpy_helper.to_array(initializers[node.input[0]])
        if values.dtype != np.int8:
            continue
        if profile.weight_type == "uint8":
            raise RuleViolation(f"{name}: {node.input[0]} is s8; the target's weights are u8")
        if np.abs(values.astype(np.int16)).max(initial=0) > SEVEN_BIT_MAX:
            raise RuleViolation(
                f"{name}: {node.input[0]} exceeds 7 bits ([-{SEVEN_BIT_MAX}, {SEVEN_BIT_MAX}]): "
                "it can saturate int8 kernels without VNNI"
            )


def _check_signed_activations(model: onnx.ModelProto, profile: TargetProfile, name: str) -> None:
    """A profile with s8 attention operands (``signed_right_operands``) keeps them in 7 bits
    for the reason its weights are: each s8 activation is clipped to [-64, 64] steps of its
    scale before it is quantized, whatever the data."""
    if not profile.signed_right_operands:
        return
    initializers = {init.name: init for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or len(node.input) < 3:
            continue
        zero = _constant(initializers, node.input[2], f"{name}: zero point of {node.name}")
        if zero.dtype != np.int8:
            continue
        bound_names = _clip_bounds(node.input[0], producers)
        if bound_names is None:
            raise RuleViolation(f"{name}: s8 activation {node.output[0]} is not clipped")
        scale = _constant(initializers, node.input[1], f"{name}: scale of {node.name}")
        bounds = [_constant(initializers, i, f"{name}: bound of {node.name}") for i in bound_names]
        steps = max(abs(float(b.reshape(-1)[0])) for b in bounds) / float(scale.reshape(-1)[0])
        if steps + float(np.abs(zero).max()) > SEVEN_BIT_MAX + 1e-3:
            raise RuleViolation(
                f"{name}: s8 activation {node.output[0]} exceeds 7 bits ({steps:.1f} steps): "
                "it can saturate int8 kernels without VNNI"
            )


def _clip_bounds(tensor: str, producers: dict[str, onnx.NodeProto]) -> list[str] | None:
    """The names of the bounds ``tensor`` is clipped to: a Clip's, or a Max's and a Min's (how
    quant.ort.attention writes it); None if it is not clipped."""
    clip = producers.get(tensor)
    if clip is not None and clip.op_type == "Clip" and len(clip.input) >= 3:
        return list(clip.input[1:3])
    if clip is None or clip.op_type != "Min" or len(clip.input) != 2:
        return None
    floor = producers.get(clip.input[0])
    if floor is None or floor.op_type != "Max" or len(floor.input) != 2:
        return None
    return [floor.input[1], clip.input[1]]


def _constant(initializers: dict[str, onnx.TensorProto], name: str, what: str) -> np.ndarray:
    if name not in initializers:
        raise RuleViolation(f"{what} is computed at run time, not a constant")
    return numpy_helper.to_array(initializers[name])


def is_power_of_two(values: np.ndarray) -> bool:
    mantissa, _ = np.frexp(np.asarray(values, dtype=np.float64))
    return bool(np.all(mantissa == 0.5))


def onnx_op_histogram(path: Path) -> Counter[str]:
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def unsupported_ops(ops: Iterable[str], profile: TargetProfile) -> list[str]:
    """Ops of an artifact that the target's accelerator does not run (empty = runs them all)."""
    if not profile.accelerator_ops:
        return []
    return sorted({op for op in ops if op not in profile.accelerator_ops})
