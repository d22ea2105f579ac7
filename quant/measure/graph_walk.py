"""Run an ONNX graph piece by piece over a fixed set of samples, keeping between the pieces only
the tensors a later piece reads.

Why: a search that decides one constant of the graph at a time, in graph order, each decision
measured with every earlier one applied (``quant.ort.bias_correction``: one int32 bias after the
other), would otherwise run the whole graph once per decision: 73 passes over the calibration
data for BERT-base. Walked in order, a piece ends at the tensor the next decision measures and
the next piece starts by re-running that tensor's node, so a constant changed in between (the
bias just corrected) reaches everything downstream; each node runs once, or twice where a
decision is measured. Each piece is a model of its own, built when it runs, so it reads the
constants as they are then.

The arithmetic is the graph's as written (graph optimizations off), the same kernels on the
same inputs as one run of the whole model: a tensor measured here is the one the whole model
computes with the same constants.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ..samples import Samples, feed_for
from .exact import computed_constants, constant_tensors, exact_session, reads


def static_batch(model: onnx.ModelProto) -> int | None:
    """The fixed batch size of the inputs (they share it), or None when it is dynamic."""
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    return dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None


def graph_input_names(model: onnx.ModelProto) -> list[str]:
    """The model's inputs (an initializer listed as an input is a constant, not one)."""
    constants = {init.name for init in model.graph.initializer}
    return [value.name for value in model.graph.input if value.name not in constants]


class GraphWalk:
    """``model`` run over ``samples`` in batches of ``batch`` (``pad``: the last one filled up
    with copies of its last row, for a model whose batch is fixed), one piece at a time.

    ``advance_to(tensor)`` runs the nodes up to the one computing ``tensor`` and returns it, one
    array per batch; ``batches`` says how many rows each was fed and how many are samples. The
    next piece starts at that node again: change its constants in ``model`` in between (in
    place) and the change reaches everything after it. Tensors advanced to must come in graph
    order. Between pieces the walk holds, for every sample at once, the tensors a later node
    reads (for a Transformer: the residual stream and the next Linear's input)."""

    def __init__(self, model: onnx.ModelProto, samples: Samples, batch: int, *, pad: bool) -> None:
        self.model = model
        constants = constant_tensors(model.graph)
        self.nodes = [
            node for node in model.graph.node if not all(name in constants for name in reads(node))
        ]
        self.producer = {out: index for index, node in enumerate(self.nodes) for out in node.output}
        self.last_read: dict[str, int] = {}  # tensor -> the last node that reads it
        for index, node in enumerate(self.nodes):
            for name in reads(node):
                self.last_read[name] = index
        names = graph_input_names(model)
        self.live = [feed_for(names, chunk) for chunk in samples.batches(batch, pad=pad)]
        # (rows fed, of which samples) per batch: the rest of a padded one repeats its last row
        self.batches = [
            (len(next(iter(feeds.values()))), min(batch, len(samples) - start))
            for start, feeds in zip(range(0, len(samples), batch), self.live, strict=True)
        ]
        self.start = 0  # the first node of the next piece

    def advance_to(self, tensor: str) -> list[np.ndarray]:
        end = self.producer[tensor]
        if end < self.start:
            raise ValueError(f"{tensor} is computed before where the walk stands: not in order")
        piece = self.nodes[self.start : end + 1]
        # kept for later pieces: what they read; the node at ``end`` runs again first, so its
        # inputs are kept and its outputs are not
        recomputed = set(self.nodes[end].output)
        produced = [
            out
            for node in piece
            for out in node.output
            if out not in recomputed and self.last_read.get(out, -1) >= end
        ]
        session = self.session(piece, set(self.live[0]), [tensor, *produced])
        inputs = [value.name for value in session.get_inputs()]
        values = []
        for index, live in enumerate(self.live):
            measured, *outputs = session.run([tensor, *produced], {n: live[n] for n in inputs})
            values.append(measured)
            kept = {n: value for n, value in live.items() if self.last_read.get(n, -1) >= end}
            self.live[index] = kept | dict(zip(produced, outputs, strict=True))
        self.start = end
        return values

    def session(
        self, piece: list[onnx.NodeProto], carried: set[str], outputs: list[str]
    ) -> ort.InferenceSession:
        """A model of ``piece``: the ``carried`` tensors it reads as its inputs (typed as held),
        the constants it reads as its initializers (computed now, once: with a batch of 1 a piece
        would otherwise dequantize each weight once per sample), ``outputs`` returned."""
        read = {name for node in piece for name in reads(node)}
        held = self.live[0]
        graph = helper.make_graph(
            piece,
            "piece",
            [
                helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(held[name].dtype), None
                )
                for name in sorted(carried & read)
            ],
            [onnx.ValueInfoProto(name=name) for name in outputs],
            computed_constants(self.model, read - carried),
        )
        return exact_session(graph, self.model)
