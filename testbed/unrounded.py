"""A QDQ model's function without its rounding: what a graph rewrite must keep.

A rewrite of a quantized file (a factor folded into a scale, a Q/DQ pair dropped so that an op
reads float) changes where the file rounds, by design; it must not change what the file
computes apart from that. Each activation's QuantizeLinear -> DequantizeLinear here becomes
its affine map without rounding or saturation (``x / s + z``, then ``(y - z') * s'``), so a pair
is the identity where its scales agree and a factor where one was folded in; the weights stay
dequantized as they are. Two files that differ only by rewrites must then give the same outputs,
to float rounding, on any input inside the calibrated ranges (a rewrite may clip to those, the
s8 operands do). For the tests (tests/test_attention_forms.py) and the benchmark
(benchmarks/conversion/attention_forms.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization.calibrate import load_tensors_data

from quant.measure.exact import constant_tensors, exact_session
from quant.ort.quantize import preprocess_once, quantize_onnx
from quant.ort.rewrites import apply_ort_rewrites
from quant.samples import Samples
from quant.targets import PROFILES

# the cpu recipe with none of its QDQ rewrites: the file they start from
UNREWRITTEN_CPU = dataclasses.replace(
    PROFILES["cpu"],
    float_inputs=frozenset(),
    fold_factors=False,
    signed_right_operands=False,
    shapes_of_quantized=False,
)


def without_rounding(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose activations' QuantizeLinear / DequantizeLinear nodes compute
    their affine maps in float (a weight's DequantizeLinear, computed from constants, stays)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    constants = constant_tensors(graph)
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        is_qdq = node.op_type in ("QuantizeLinear", "DequantizeLinear")
        if not is_qdq or node.input[0] in constants:
            nodes.append(node)
            continue
        out, scale = node.output[0], node.input[1]
        zero_name = f"{out}_zero_point_float"
        zero = values[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros(())
        graph.initializer.append(numpy_helper.from_array(zero.astype(np.float32), zero_name))
        if node.op_type == "QuantizeLinear":  # x / s + z
            nodes += [
                helper.make_node("Div", [node.input[0], scale], [f"{out}_unscaled"]),
                helper.make_node("Add", [f"{out}_unscaled", zero_name], [out]),
            ]
        else:  # (y - z) * s
            nodes += [
                helper.make_node("Sub", [node.input[0], zero_name], [f"{out}_centred"]),
                helper.make_node("Mul", [f"{out}_centred", scale], [out]),
            ]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]  # the quantized tensors are float now
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``model``'s outputs on ``feeds``, its float ops as written: ONNX Runtime's optimizer
    would turn a weight's DequantizeLinear and its MatMul into an integer kernel that
    quantizes the activation on the fly (the bundled ViT's logits moved 1.3 %)."""
    session = exact_session(model, threads=1)
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})


def cpu_rewrites_gap(fp32: Path, feeds: dict[str, np.ndarray], scratch: Path) -> float:
    """How far the cpu recipe's QDQ rewrites move ``fp32``'s int8 logits, rounding taken out:
    the largest difference on ``feeds`` (calibration samples: they set the ranges the s8
    operands clip to), over the largest logit. The file as ``quantize_static`` wrote it
    against the same file after ``apply_ort_rewrites``."""
    samples = Samples(feeds, None, "calibration")
    preparation = preprocess_once(fp32, UNREWRITTEN_CPU, samples, scratch)
    int8 = scratch / "int8.onnx"
    quantized = quantize_onnx(fp32, int8, UNREWRITTEN_CPU, samples, (), preparation)
    before, after = onnx.load(str(quantized)), onnx.load(str(quantized))
    apply_ort_rewrites(after, PROFILES["cpu"], load_tensors_data(preparation.ranges))
    return relative_gap(without_rounding(before), without_rounding(after), feeds)


def relative_gap(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> float:
    """The largest difference of the two models' first outputs over the largest of ``before``'s."""
    expected, actual = run(before, feeds)[0], run(after, feeds)[0]
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
