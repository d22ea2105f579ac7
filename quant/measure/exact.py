"""A QDQ model's exact arithmetic: the graph run as written, its constants computed once.

Exact: ONNX Runtime with its graph optimizations off runs each DequantizeLinear -> float op ->
QuantizeLinear as written, no QDQ group fused into an int8 kernel
(``quant.measure.drift.onnx_runner`` says why that is what a board's integer kernels compute). Run
so, a model also dequantizes every weight on every run, and at batch 1 that is most of a run: 0.32
of 0.4 s a sample for BERT-base (ORT's profiler; 110 M int8 weights, a 128-token sample), and its
exact drift pass over 100 samples went 34-37 -> 18-20 s (measured once, side by side). The weights'
DequantizeLinear outputs (and anything else computed from constants alone) depend on no input, so
here they are computed once, by the same ORT kernels on the same constants, and the model runs
with them as initializers: the same float values reach the same float ops, and the outputs are
the same bit for bit (``tests/test_exact.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from .ort_options import computing_options

# Computed constants are float32: a model whose computed constants would pass this size keeps
# its DequantizeLinear nodes, since a protobuf (the session's source) holds at most 2 GiB.
MAX_COMPUTED_BYTES = 1 << 30


def reads(node: onnx.NodeProto) -> Iterator[str]:
    """Every tensor ``node`` reads: its inputs, and the outer tensors its subgraphs read."""
    yield from (name for name in node.input if name)
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs]:
            for inner in graph.node:
                yield from reads(inner)


def constant_tensors(graph: onnx.GraphProto) -> set[str]:
    """The initializers and every node output computed from them alone (a weight's or a bias's
    DequantizeLinear)."""
    constants = {init.name for init in graph.initializer}
    for node in graph.node:
        if all(name in constants for name in reads(node)):
            constants.update(node.output)
    return constants


def exact_session(
    model: onnx.ModelProto | onnx.GraphProto | bytes,
    like: onnx.ModelProto | None = None,
    threads: int = 0,
) -> ort.InferenceSession:
    """A session of ``model`` in its arithmetic as written (graph optimizations off), on
    ``threads`` threads (0: as many as other work leaves, ``quant.measure.ort_options``). A bare
    graph is a piece of the model ``like`` and takes its opsets and IR version; a serialized model
    (bytes) lets the caller drop the proto before ORT makes its own copy of the weights."""
    if isinstance(model, onnx.GraphProto):
        if like is None:
            raise ValueError("a graph runs with the opsets of the model it comes from: give it")
        model = helper.make_model(
            model, opset_imports=like.opset_import, ir_version=like.ir_version
        )
    source = model if isinstance(model, bytes) else model.SerializeToString()
    options = computing_options(threads, optimize=False)
    # A constant weight would be pre-packed for the GEMM kernel, which sums in another order:
    # off, the float ops compute as they do on a DequantizeLinear's output (bit for bit).
    options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def computed_constants(model: onnx.ModelProto, names: set[str]) -> list[onnx.TensorProto]:
    """The constant tensors among ``names`` (see ``constant_tensors``) as ``model`` holds them
    now: an initializer as it is, a constant node's output computed by its own ORT kernel."""
    initializers = {init.name: init for init in model.graph.initializer}
    constants = constant_tensors(model.graph)
    producers = {out: node for node in model.graph.node for out in node.output if out in constants}
    computed = sorted(name for name in names if name in producers)
    found = [initializers[name] for name in sorted(names) if name in initializers]
    if not computed:
        return found
    nodes: dict[int, onnx.NodeProto] = {}  # id -> node: the constant nodes they need
    read: set[str] = set()
    pending = list(computed)
    while pending:
        node = producers.get(pending.pop())
        if node is not None and id(node) not in nodes:
            nodes[id(node)] = node
            new = set(reads(node)) - read
            read |= new
            pending.extend(new)
    graph = helper.make_graph(
        [node for node in model.graph.node if id(node) in nodes],
        "constants",
        [],
        [onnx.ValueInfoProto(name=name) for name in computed],
        [initializers[name] for name in sorted(read) if name in initializers],
    )
    values = exact_session(graph, model).run(computed, {})
    for name in computed:  # each array dropped once it is a tensor: one more copy at a time
        found.append(numpy_helper.from_array(values.pop(0), name))
    return found


def with_constants_computed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the constants its other nodes read (and the constant graph outputs)
    computed once (``computed_constants``) and held as initializers, the nodes that computed
    them and the initializers nothing reads any more left out; ``model`` itself as it is when
    there is nothing to compute or the computed tensors would pass ``MAX_COMPUTED_BYTES``."""
    constants = constant_tensors(model.graph)
    kept = [node for node in model.graph.node if not all(n in constants for n in reads(node))]
    read = {name for node in kept for name in reads(node)}
    read |= {value.name for value in model.graph.output}
    held = {init.name for init in model.graph.initializer}
    needed = (read & constants) - held
    if not needed or _float_bytes(model, needed) > MAX_COMPUTED_BYTES:
        return model
    result = onnx.ModelProto(ir_version=model.ir_version)
    result.opset_import.extend(model.opset_import)
    result.functions.extend(model.functions)
    graph = result.graph  # filled in place: the computed tensors are copied once, not per step
    graph.name = model.graph.name
    graph.node.extend(kept)
    graph.input.extend(v for v in model.graph.input if v.name not in held or v.name in read)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    graph.initializer.extend(computed_constants(model, read & constants))
    return result


def _float_bytes(model: onnx.ModelProto, names: set[str]) -> int:
    """An upper bound of what the constants ``names`` take as float32: the elements of the
    largest initializer each is computed from (a DequantizeLinear's output is its data's size)."""
    sizes = {init.name: _elements(init) for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    total = 0
    for name in names:
        node = producers.get(name)
        inputs = list(reads(node)) if node is not None else []
        total += 4 * max((sizes.get(n, 1) for n in inputs), default=1)
    return total


def _elements(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count
