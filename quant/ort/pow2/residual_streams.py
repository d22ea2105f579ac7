"""Residual streams of an fp32 ONNX graph: tensors that can all be scaled by one factor c > 0
with the model's outputs unchanged.

A folded UN Transformer computes its residual stream with linear operations only: it is
written by Linears and constants (patch/word embeddings, position tables, attention and MLP
output projections), carried by Adds, reshapes and slices, and read only by Linears (the
folded norms sit in their weights). Multiplying every writer's weights and biases by c and
dividing every reader's weights by c scales the whole stream by c and leaves everything else
as it was. With power-of-two scales (TIDL) that factor matters: a tensor whose range falls
just above a power of two loses almost a bit to the rounding; a factor in [1, 2) moves the
stream's ranges along the power-of-two grid (``quant.ort.pow2.grid`` chooses it).

``find_streams`` grows each stream from a residual Add (an Add of two computed tensors) over
scale-equivariant operations and gives up on a stream that reaches anything else (a
LayerNorm, a Softmax, a graph output, a weight shared with another node): such a stream is not
scalable, and is not listed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

# Every input and output of these carries the same scale (a constant input too).
_JOINING = {"Add", "Sub", "Concat", "Sum"}
# Input 0 and every output carry the same scale; the other inputs are shapes, indices, axes.
_PASSING = {
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice", "Split",
    "Gather", "GatherND", "GatherElements", "Expand", "ReduceMean", "ReduceSum", "Tile",
}  # fmt: skip
# Products: one operand (a Div's numerator) and the output share the scale, when the other
# operand is a constant or a tensor outside the stream (a mask, a count); a MatMul by a
# constant weight is a Linear instead (below).
_PRODUCTS = {"Mul", "Div", "MatMul"}
# Linear layers with a constant weight (input 1); Gemm's and Conv's bias is input 2.
_WEIGHTED = {"MatMul", "Gemm", "Conv"}
# Readers of a tensor's shape only (the legacy exporter's shape arithmetic): a factor is nothing
# to them.
_SHAPE_READERS = {"Shape", "Size"}


class NotScalable(Exception):
    """The stream reaches an operation that does not commute with a scale factor."""


@dataclass(frozen=True)
class ResidualStream:
    """The tensors scaled together, and each constant's power of the factor: +1 for a writer's
    weight, bias or added constant, -1 for a reader's weight (0 never listed)."""

    seed: str  # the residual Add's output it was grown from: the stream's name in the report
    tensors: frozenset[str]
    powers: tuple[tuple[str, int], ...]


def find_streams(model: onnx.ModelProto) -> list[ResidualStream]:
    """Every scalable residual stream of ``model``, in the order of their first residual Add."""
    graph = _Graph(model)
    streams: list[ResidualStream] = []
    seen: set[str] = set()
    for node in model.graph.node:
        if node.op_type != "Add" or node.output[0] in seen:
            continue
        if any(name in graph.constants or not name for name in node.input):
            continue
        try:
            stream = graph.grow(node.output[0])
        except NotScalable as error:
            seen.update(error.args[0] if error.args else ())
            continue
        seen.update(stream.tensors)
        streams.append(stream)
    return streams


def scale_stream(model: onnx.ModelProto, stream: ResidualStream, factor: float) -> None:
    """Multiply ``stream``'s tensors by ``factor``, in place, by rewriting its constants."""
    initializers = {init.name: init for init in model.graph.initializer}
    for name, power in stream.powers:
        values = numpy_helper.to_array(initializers[name])
        scaled = (values.astype(np.float64) * factor**power).astype(values.dtype)
        initializers[name].CopyFrom(numpy_helper.from_array(scaled, name))


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.constants = {
            init.name
            for init in model.graph.initializer
            if np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type), np.floating)
        }
        self.integer_constants = {init.name for init in model.graph.initializer} - self.constants
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        self.uses: dict[str, int] = defaultdict(int)
        for node in model.graph.node:
            for output in node.output:
                self.producer[output] = node
            for name in node.input:
                self.consumers[name].append(node)
                self.uses[name] += 1
        self.outputs = {value.name for value in model.graph.output}

    def grow(self, seed: str) -> ResidualStream:
        """The stream through ``seed``; NotScalable (with the tensors reached) if there is none."""
        tensors: set[str] = set()
        # constant -> the powers it takes: a set, as a node is reached once from each of its
        # stream tensors; a weight both read from and written to the stream takes +1 and -1
        powers: dict[str, set[int]] = defaultdict(set)
        outside: set[str] = set()  # products' other operands: must stay out of the stream
        queue = [seed]

        def join(name: str) -> None:
            if not name or name in self.integer_constants:
                return
            if name in self.constants:
                self._constant(name, +1, powers)
            elif name not in tensors:
                queue.append(name)

        try:
            while queue:
                name = queue.pop()
                if name in tensors:
                    continue
                tensors.add(name)
                if name in self.outputs or name not in self.producer:
                    raise NotScalable  # a graph output or input: its scale is the user's
                self._producer(self.producer[name], join, powers, tensors, outside)
                for node in self.consumers[name]:
                    self._consumer(node, name, join, powers, outside)
            if outside & tensors:
                raise NotScalable  # a product of two stream tensors scales by c squared
        except NotScalable:
            raise NotScalable(tensors) from None
        kept = tuple((name, sum(taken)) for name, taken in sorted(powers.items()) if sum(taken))
        return ResidualStream(seed, frozenset(tensors), kept)

    def _constant(self, name: str, power: int, powers: dict[str, set[int]]) -> None:
        if self.uses[name] != 1:
            raise NotScalable  # shared with another node, which would see it scaled too
        powers[name].add(power)

    def _producer(self, node, join, powers, tensors, outside) -> None:
        op = node.op_type
        if op in _JOINING:
            for value in node.input:
                join(value)
        elif op == "Where":
            join(node.input[1])
            join(node.input[2])
        elif op in _PASSING:
            join(node.input[0])
            for value in node.output:
                join(value)
        elif op in _WEIGHTED and self._weight_of(node):
            self._constant(node.input[1], +1, powers)
            if len(node.input) > 2 and node.input[2]:
                if node.input[2] not in self.constants:
                    raise NotScalable
                self._constant(node.input[2], +1, powers)
        elif op in _PRODUCTS:
            scaled = self._scaled_operand(node, tensors)
            outside.update(value for value in node.input[:2] if value != scaled)
            join(scaled)
        else:
            raise NotScalable

    def _consumer(self, node, name, join, powers, outside) -> None:
        op = node.op_type
        if op in _SHAPE_READERS:
            return
        if op in _JOINING:
            for value in [*node.input, *node.output]:
                join(value)
        elif op == "Where" and name in node.input[1:]:
            join(node.input[1])
            join(node.input[2])
            join(node.output[0])
        elif op in _PASSING and node.input[0] == name and name not in node.input[1:]:
            for value in node.output:
                join(value)
        elif op in _WEIGHTED and node.input[0] == name and self._weight_of(node):
            self._constant(node.input[1], -1, powers)
        elif op in _PRODUCTS and name in node.input[:2] and (op != "Div" or node.input[1] != name):
            outside.update(value for value in node.input[:2] if value != name)
            join(node.output[0])
        else:
            raise NotScalable

    def _scaled_operand(self, node: onnx.NodeProto, tensors: set[str]) -> str:
        """Which operand of a product carries the scale of its output: the computed one beside
        a constant, or one already in the stream (a Div's numerator only)."""
        operands = node.input[:2] if node.op_type != "Div" else node.input[:1]
        computed = [value for value in operands if value not in self.constants]
        if node.op_type == "Div" and node.input[0] in self.constants:
            raise NotScalable
        if len(computed) == 1:
            return computed[0]
        reached = [value for value in computed if value in tensors]
        if len(reached) == 1:
            return reached[0]
        raise NotScalable  # two computed operands, neither known to carry the scale

    def _weight_of(self, node: onnx.NodeProto) -> bool:
        if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
            return False
        return len(node.input) > 1 and node.input[1] in self.constants
