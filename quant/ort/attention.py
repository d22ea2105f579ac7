"""QDQ rewrites that let ONNX Runtime's x86 int8 kernels run a cpu file's attention fast.

Measured on ViT-Tiny (``benchmarks/results/ort_speed.md``), what ONNX Runtime made of the
attention products of the straight QDQ file decides their speed:

* both operands of Q.K^T and P.V are activations, u8 like every activation of the cpu file, so
  ONNX Runtime runs them with its U8U8 kernels, which widen both operands to 16 bits: about half
  the speed of the u8 x s8 kernels its weights get (VNNI on a VNNI core). An s8 right operand
  written as a plain QuantizeLinear -> DequantizeLinear pair does not help: on x86 ONNX Runtime
  turns an s8 pair whose Q has one reader back into u8 (``qdq_s8_to_u8.cc``). Written as
  QuantizeLinear -> the operand's Reshape/Transpose -> DequantizeLinear, the s8 tensor reaches
  the MatMul as it is: ``signed_right_operands``. Its values are clipped to 7 bits
  ([-64, 64], scale = calibrated absolute maximum / 64), for the reason the cpu file's weights
  are: x86 cores without VNNI add pairs of u8 x s8 products in int16 (VPMADDUBSW), which
  8-bit values can saturate; the clip (a Max and a Min) makes that a property of the file, not
  of the data.

A factor folded into a DequantizeLinear on the way (``quant.ort.graph.fold_constant_factors``,
the attention's ``q * head_dim**-0.5``) is carried into the new DequantizeLinear's scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization.calibrate import TensorsData

from ..targets.profiles import SIGNED_MIN_MACS
from .graph import (
    SHAPE_OPS,
    constant_values,
    consumers_of,
    drop_unused_initializers,
    pair_factor,
    replace_nodes,
    tensor_shapes,
)
from .multiply_adds import node_multiply_adds

# x86 without VNNI adds pairs of u8 x s8 products in int16: 2 x 255 x 64 fits, 2 x 255 x 128
# does not (the same bound as the cpu file's 7-bit weights, quant.targets.rules.SEVEN_BIT_MAX)
SIGNED_OPERAND_MAX = 64
TINY_BOUND = 1e-12  # an operand that is zero on every calibration sample still needs a scale


def signed_operand_sources(model: onnx.ModelProto, min_macs: int = SIGNED_MIN_MACS) -> list[str]:
    """The float tensors ``signed_right_operands`` would quantize to s8, in graph order."""
    return [chain.source for chain in _right_operand_chains(model, min_macs)]


def signed_right_operands(
    model: onnx.ModelProto,
    bounds: Mapping[str, float] | None = None,
    min_macs: int = SIGNED_MIN_MACS,
) -> int:
    """Each MatMul of two activations takes its right operand as a 7-bit s8 tensor: the float
    tensor it is computed from is clipped to +-bound, quantized to s8 with scale bound / 64
    and zero point 0, moved by the operand's shape ops in s8, and dequantized just before the
    MatMul. ``bounds``: per source tensor (``signed_operand_sources``), calibrated
    (``calibrated_absmax``); without one, the absolute maximum of the range the QuantizeLinear it
    replaces was calibrated to. In place; returns how many operands. Left alone: a product of
    fewer than ``min_macs`` multiply-adds a sample (or of unknown shape), an operand whose path
    holds another op, or a tensor that something other than a Shape op also reads."""
    bounds = bounds or {}
    constants = constant_values(model)
    inserted: dict[int, list[onnx.NodeProto]] = {}  # id(MatMul) -> the nodes before it
    dropped: set[int] = set()
    chains = _right_operand_chains(model, min_macs)
    for chain in chains:
        bound = bounds.get(chain.source) or _calibrated_absmax(chain.pairs[-1][0], constants)
        initializers, nodes = _s8_operand(chain, max(bound, TINY_BOUND), constants)
        model.graph.initializer.extend(initializers)
        inserted[id(chain.matmul)] = nodes
        dropped |= {id(op) for op, _ in chain.moves}
        dropped |= {id(node) for pair in chain.pairs for node in pair}
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        nodes += inserted.get(id(node), [])
        if id(node) not in dropped:
            nodes.append(node)
    replace_nodes(model, _topological(model, nodes))  # a rewired Shape may now come early
    drop_unused_initializers(model)
    _drop_value_info(model, {out for node in model.graph.node for out in node.output})
    return len(chains)


def _s8_operand(
    chain: _OperandChain, bound: float, constants: dict[str, np.ndarray]
) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """The constants and nodes of one s8 right operand: its clip (Max, Min), QuantizeLinear,
    the chain's shape ops on s8 (its Shape readers moved along), DequantizeLinear into the
    MatMul. Shape readers are rewired in place."""
    prefix = f"{chain.matmul.name}_b_s8"
    scale = bound / SIGNED_OPERAND_MAX
    names = {key: f"{prefix}_{key}" for key in ("min", "max", "scale", "dq_scale", "zero")}
    initializers = [
        numpy_helper.from_array(np.array(-bound, np.float32), names["min"]),
        numpy_helper.from_array(np.array(bound, np.float32), names["max"]),
        numpy_helper.from_array(np.array(scale, np.float32), names["scale"]),
        # a factor folded into a DequantizeLinear on the way stays in the last one's scale
        numpy_helper.from_array(
            np.array(scale * _folded_factor(chain, constants), np.float32), names["dq_scale"]
        ),
        numpy_helper.from_array(np.array(0, np.int8), names["zero"]),
    ]
    # Max then Min, not one Clip: ONNX Runtime's QDQ selectors read a Clip (or Relu) that is
    # its producer's only reader as part of that producer's node group (a Clip that the
    # QuantizeLinear after it makes redundant); this one is not redundant, so the K or V
    # projection computing the source would not fuse at all and would run as a float Gemm on
    # weights dequantized at every call (BERT-base: 24 of its 74 Linears, 2/5 of its time:
    # benchmarks/results/cpu_vs_litert.md)
    nodes = [
        helper.make_node("Max", [chain.source, names["min"]], [f"{prefix}_floor"]),
        helper.make_node("Min", [f"{prefix}_floor", names["max"]], [f"{prefix}_clip"]),
        helper.make_node(
            "QuantizeLinear", [f"{prefix}_clip", names["scale"], names["zero"]], [prefix]
        ),
    ]
    current = prefix
    for reader in chain.source_readers:
        reader.input[0] = current
    for op, shape_readers in chain.moves:  # the same moves, on the s8 tensor
        moved = helper.make_node(
            op.op_type, [current, *op.input[1:]], [f"{op.output[0]}_s8"], name=f"{op.name}_s8"
        )
        moved.attribute.extend(op.attribute)
        nodes.append(moved)
        current = moved.output[0]
        for reader in shape_readers:  # a Shape reads the same shape from the s8 tensor
            reader.input[0] = current
    for reader in chain.operand_readers:
        reader.input[0] = current
    nodes.append(
        helper.make_node(
            "DequantizeLinear", [current, names["dq_scale"], names["zero"]], [chain.matmul.input[1]]
        )
    )
    for number, node in enumerate(nodes):
        node.name = node.name or f"{prefix}_{number}"
    return initializers, nodes


@dataclass(frozen=True)
class _OperandChain:
    """The path of a MatMul's right operand from the float tensor it is computed from."""

    matmul: onnx.NodeProto
    source: str
    moves: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]]  # shape op, Shape ops reading it
    pairs: list[tuple[onnx.NodeProto, onnx.NodeProto]]  # (Q, DQ), from the MatMul up
    source_readers: list[onnx.NodeProto]  # Shape ops reading the source (quantized or not)
    operand_readers: list[onnx.NodeProto]  # Shape ops reading the MatMul's operand, quantized


def calibrated_absmax(ranges: TensorsData, names: Sequence[str]) -> dict[str, float]:
    """The largest absolute value each named float tensor took on the calibration data, the
    bound ``signed_right_operands`` clips to: read off the range ORT's MinMax calibration
    measured for it, the graph run as written (max |x| = max(-min, max): the same number as a
    pass of its own, tested; the pass this replaced ran ORT's fusions, which moved BERT-base's
    bounds in the last bit). A name without a range is left out. Not tighter:
    clipping the rare largest keys and values to round the rest finer lowered each tensor's
    squared error but raised the logits' (vit-mnist-un: RMS 0.33 -> 0.39 with the best of 1 to
    0.5 x the maximum)."""
    bounds = {}
    for name in names:
        if name in ranges:
            lowest, highest = ranges[name].range_value
            bounds[name] = float(max(np.abs(lowest).max(), np.abs(highest).max(), 0.0))
    return bounds


def _right_operand_chains(model: onnx.ModelProto, min_macs: int) -> list[_OperandChain]:
    constants = constant_values(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers = consumers_of(model.graph.node)
    shapes = tensor_shapes(model) if min_macs > 0 else {}
    chains = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or not _activations(node, producers, constants):
            continue
        if min_macs > 0 and _macs_per_sample(node, shapes) < min_macs:
            continue
        chain = _operand_chain(node, producers, consumers, constants)
        if chain is not None:
            chains.append(chain)
    return chains


def _macs_per_sample(matmul: onnx.NodeProto, shapes: dict[str, list[int]]) -> int:
    """Multiply-adds of one sample of a batched MatMul (the first axis is the batch, whatever
    it is, dynamic included), 0 when a shape is unknown."""
    out = shapes.get(matmul.output[0])
    if not out or len(out) < 3:
        return 0
    one_sample = {**shapes, matmul.output[0]: [1, *out[1:]]}
    return node_multiply_adds(matmul, one_sample) or 0


def _activations(
    matmul: onnx.NodeProto, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]
) -> bool:
    """Both inputs are dequantized activations (not weights)."""
    for name in matmul.input[:2]:
        node = producers.get(name)
        if node is None or node.op_type != "DequantizeLinear" or node.input[0] in constants:
            return False
    return True


def _operand_chain(
    matmul: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    constants: dict[str, np.ndarray],
) -> _OperandChain | None:
    """The right operand's path up through Q/DQ pairs and shape ops to the first tensor that
    is not a shape op's output, or None when the path holds another op or a tensor with a
    reader elsewhere (a Shape may read any of its tensors, quantized or not: it moves to the
    s8 tensor in its place)."""
    pairs: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    moves: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]] = []
    operand_readers: list[onnx.NodeProto] = []
    dequantize, reader = producers[matmul.input[1]], matmul
    while True:
        quantize = producers.get(dequantize.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear":
            return None
        others = [r for r in consumers[dequantize.output[0]] if r is not reader]
        quantized_readers = [r for r in consumers[quantize.output[0]] if r is not dequantize]
        if any(r.op_type != "Shape" for r in [*others, *quantized_readers]):
            return None
        if not _per_tensor_pair(quantize, dequantize, constants):
            return None
        if reader is matmul:  # the MatMul's own input: its DequantizeLinear keeps its name
            operand_readers, rewire = quantized_readers, []
        else:
            rewire = others + quantized_readers
        pairs.append((quantize, dequantize))
        moved = producers.get(quantize.input[0])
        if moved is None or moved.op_type not in SHAPE_OPS:
            return _OperandChain(matmul, quantize.input[0], moves, pairs, rewire, operand_readers)
        if len(consumers[moved.output[0]]) != 1:
            return None
        previous = producers.get(moved.input[0])
        if previous is None or previous.op_type != "DequantizeLinear":
            return None
        moves.insert(0, (moved, rewire))
        dequantize, reader = previous, moved


def _per_tensor_pair(
    quantize: onnx.NodeProto, dequantize: onnx.NodeProto, constants: dict[str, np.ndarray]
) -> bool:
    """An 8-bit Q/DQ pair with one constant scale each and the same constant zero point (a
    16-bit one is the drift fallback's: it stays as it is)."""
    if len(quantize.input) < 3 or quantize.input[2] not in constants:
        return False
    eight_bits = constants[quantize.input[2]].dtype in (np.uint8, np.int8)
    return eight_bits and pair_factor(quantize, dequantize, constants) is not None


def _folded_factor(chain: _OperandChain, constants: dict[str, np.ndarray]) -> float:
    """The product of the chain's Q/DQ pairs' factors (``pair_factor``): 1 unless a constant
    factor was folded into one."""
    factor = 1.0
    for quantize, dequantize in chain.pairs:
        factor *= pair_factor(quantize, dequantize, constants) or 1.0  # checked per tensor
    return factor


def _calibrated_absmax(quantize: onnx.NodeProto, constants: dict[str, np.ndarray]) -> float:
    """The largest absolute value a QuantizeLinear's scale and zero point represent."""
    scale = float(constants[quantize.input[1]].reshape(-1)[0])
    zero = constants[quantize.input[2]] if len(quantize.input) > 2 else np.zeros((), np.uint8)
    info = np.iinfo(zero.dtype)
    z = float(zero.reshape(-1)[0])
    return max(abs(info.min - z), abs(info.max - z)) * scale


def _topological(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each comes after what it reads (stable: a node moves only
    behind the producers it waits for)."""
    ready = {value.name for value in model.graph.input} | {i.name for i in model.graph.initializer}
    ready.add("")  # an omitted optional input
    waiting, ordered = list(nodes), []
    while waiting:
        left = []
        for node in waiting:
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                left.append(node)
        if len(left) == len(waiting):
            raise ValueError(f"{len(left)} nodes wait for tensors nothing produces")
        waiting = left
    return ordered


def _drop_value_info(model: onnx.ModelProto, produced: set[str]) -> None:
    """Shape/type records of tensors that no longer exist or changed type are dropped."""
    kept = [v for v in model.graph.value_info if v.name in produced]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
