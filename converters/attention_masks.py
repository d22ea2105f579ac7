"""Attention masks int8 can carry: a bounded additive mask in place of float32-min fills.

Hugging Face models add ``(1 - mask) * finfo(float32).min`` (or -1e9, -1e4, -inf through
``Where``) to the attention scores before the softmax. In int8 that tensor's scale must span
3.4e38, so every real score rounds to zero and attention turns uniform; a statistic taken over it
takes logs of zero; and the ops that build it (Cast, GatherND, And, bool Where, IsNaN guards) are
float or bool work an NPU cannot place. A penalty of ``MASK_PENALTY`` (-30) instead leaves the
softmax unchanged in fp32 (a masked key weighs e^-30 ~ 1e-13 of an unmasked one at equal score)
and costs the scores' int8 range a few units, as the bundled text model was trained to.

``bound_attention_masks`` finds each float tensor that an Add feeds into a Softmax's input and
that is computed from the model's integer inputs and constants alone (the additive mask), and:

* when it is a padding mask of one integer input (checked by evaluating its subgraph with ONNX
  Runtime on padding patterns: 0 where the input is non-zero, <= -1e4 where it is zero), replaces
  it by ``Where(input == 0, MASK_PENALTY, 0)`` broadcast the same way: one EQUAL and one SELECT on
  integer data, which TFLite keeps integer;
* otherwise keeps it and bounds it: ``Where(mask <= -1e4, MASK_PENALTY, mask)``;

and drops ``Where(IsNaN(p), 0, p)`` guards on softmax outputs (PyTorch's SDPA adds them for
fully masked rows, which a finite penalty cannot produce). Nodes nothing reads any more go.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from .shape_inference import infer_graph_shapes

MASK_PENALTY = -30.0
MASKED_AT_MOST = -1e4  # an additive mask value at or below this masks its key
PATTERN_SEQUENCES = 6  # padding patterns tried per batch row when checking a mask
# A mask is made by comparing, casting, indexing and selecting between scalars; the activations
# are made with weights (an embedding table, a Linear): a float constant larger than this, or
# one of these ops, on the way from an input means the tensor is not a mask.
MAX_MASK_CONSTANT = 16
WEIGHTED_OPS = frozenset({"MatMul", "Gemm", "Conv", "Einsum", "MatMulInteger", "ConvInteger"})


@dataclass(frozen=True)
class MaskRewrite:
    """What was done to one additive mask tensor (one line for a report)."""

    tensor: str
    source: str  # the integer input it is computed from ("" when several or none)
    canonical: bool

    def __str__(self) -> str:
        if self.canonical:
            return (
                f"attention mask {self.tensor} rewritten as Where({self.source} == 0, "
                f"{MASK_PENALTY:g}, 0): int8 keeps the scores' range, the NPU an integer SELECT"
            )
        return (
            f"attention mask {self.tensor} bounded at {MASK_PENALTY:g} (was <= {MASKED_AT_MOST:g})"
        )


@dataclass(frozen=True)
class AttentionRewrites:
    """What ``bound_attention_masks`` changed: each mask, and the NaN guards dropped."""

    masks: tuple[MaskRewrite, ...]
    nan_guards: int

    def __bool__(self) -> bool:
        return bool(self.masks or self.nan_guards)

    def lines(self) -> list[str]:
        guard = (
            f"{self.nan_guards} NaN guards after Softmax dropped (PyTorch SDPA's, for fully "
            "masked rows, which a finite mask cannot make)"
        )
        return [str(mask) for mask in self.masks] + ([guard] if self.nan_guards else [])


def bound_attention_masks(model: onnx.ModelProto) -> AttentionRewrites:
    """Rewrite ``model`` in place as the module says; what was rewritten."""
    graph = model.graph
    integer_inputs = _integer_inputs(graph)
    constant = _constant_names(graph)
    producers = {out: node for node in graph.node for out in node.output}
    derived = _mask_like(graph, integer_inputs, constant)
    rewrites = []
    for mask in _additive_masks(graph, derived, producers):
        sources = _sources(mask, producers, integer_inputs)
        source = sources[0] if len(sources) == 1 else ""
        kind = _kind_of_mask(model, mask, source, producers) if source else "unknown"
        if kind == "bounded":  # already a small penalty (edge_un's own text models): fine
            continue
        canonical = kind == "padding"
        new = _canonical_mask(model, mask, source) if canonical else _bounded_mask(graph, mask)
        _redirect(graph, mask, new, skip_producer_of=new)
        rewrites.append(MaskRewrite(mask, source, canonical))
    guards = _drop_nan_guards(graph)
    if rewrites or guards:
        _remove_dead_nodes(graph)
    return AttentionRewrites(tuple(rewrites), guards)


# -- finding masks ---------------------------------------------------------------------------


def _integer_inputs(graph: onnx.GraphProto) -> set[str]:
    constants = {init.name for init in graph.initializer}
    integer = {TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL, TensorProto.INT8,
               TensorProto.UINT8, TensorProto.INT16}  # fmt: skip
    return {
        value.name
        for value in graph.input
        if value.name not in constants and value.type.tensor_type.elem_type in integer
    }


def _constant_names(graph: onnx.GraphProto) -> dict[str, int]:
    """Tensor -> its size (-1 unknown) for initializers, Constant nodes and whatever is computed
    from those alone (graph nodes are topologically sorted)."""
    sizes = {
        init.name: int(np.prod(init.dims))
        for init in graph.initializer
        if init.data_type == TensorProto.FLOAT or init.data_type == TensorProto.FLOAT16
    }
    sizes |= {init.name: 0 for init in graph.initializer if init.name not in sizes}  # integer
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if all(name in sizes for name in inputs):  # a Constant, or made of constants only
            for out in node.output:
                sizes[out] = _constant_size(node)
    return sizes


def _constant_size(node: onnx.NodeProto) -> int:
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.t.data_type == TensorProto.FLOAT:
            return int(np.prod(attribute.t.dims))
    return 0  # integer, or small enough that computing it from scalars made it


def _mask_like(
    graph: onnx.GraphProto, integer_inputs: set[str], constant: dict[str, int]
) -> set[str]:
    """Tensors computed from integer inputs and small constants, with no weighted op on the
    way: what a mask is made of (an activation passes through an embedding table or a Linear)."""
    derived = set(integer_inputs)
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type in WEIGHTED_OPS or not any(name in derived for name in inputs):
            continue
        small = all(
            name in derived or (name in constant and constant[name] <= MAX_MASK_CONSTANT)
            for name in inputs
        )
        if small:
            derived.update(node.output)
    return derived


def masked_softmax_inputs(model: onnx.ModelProto) -> set[str]:
    """The Softmax inputs an additive attention mask is added into, by tensor name: the Adds
    ``bound_attention_masks`` finds its masks at (after it, the mask holds ``MASK_PENALTY``)."""
    graph = model.graph
    derived = _mask_like(graph, _integer_inputs(graph), _constant_names(graph))
    producers = {out: node for node in graph.node for out in node.output}
    return {add.output[0] for add, _ in _masked_adds(graph, derived, producers)}


def _additive_masks(
    graph: onnx.GraphProto, derived: set[str], producers: dict[str, onnx.NodeProto]
) -> list[str]:
    """Mask tensors: an input-derived operand of an Add whose result a Softmax reads."""
    masks: list[str] = []
    for _, operand in _masked_adds(graph, derived, producers):
        if operand not in masks:
            masks.append(operand)
    return masks


def _masked_adds(
    graph: onnx.GraphProto, derived: set[str], producers: dict[str, onnx.NodeProto]
) -> list[tuple[onnx.NodeProto, str]]:
    """Each Add whose result a Softmax reads, with each of its input-derived operands."""
    softmax_inputs = {node.input[0] for node in graph.node if node.op_type == "Softmax"}
    return [
        (node, operand)
        for node in graph.node
        if node.op_type == "Add" and node.output[0] in softmax_inputs
        for operand in node.input
        if operand in derived and operand in producers
    ]


def _ancestors(tensor: str, producers: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes ``tensor`` is computed by, in graph order."""
    seen: dict[int, onnx.NodeProto] = {}
    stack = [tensor]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(name for name in node.input if name)
    order = {id(node): index for index, node in enumerate(producers.values())}
    return sorted(seen.values(), key=lambda node: order[id(node)])


def _sources(
    tensor: str, producers: dict[str, onnx.NodeProto], integer_inputs: set[str]
) -> list[str]:
    read = {name for node in _ancestors(tensor, producers) for name in node.input}
    return sorted(read & integer_inputs)


# -- checking a mask by evaluating it --------------------------------------------------------


def _kind_of_mask(
    model: onnx.ModelProto, mask: str, source: str, producers: dict[str, onnx.NodeProto]
) -> str:
    """What ``mask`` computes from ``source`` over the padding patterns tried: "padding" (0 where
    ``source`` is non-zero, <= MASKED_AT_MOST where it is zero, along its last axis), "bounded"
    (never below MASKED_AT_MOST), else "unknown" (also when it cannot be evaluated)."""
    value = next(v for v in model.graph.input if v.name == source)
    dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
    if len(dims) != 2:
        return "unknown"  # (batch, sequence): the padding masks we know
    # a dynamic size is tried at a small one (the check is of the function, not of a shape)
    batch, length = (size if size > 0 else fill for size, fill in zip(dims, (2, 8), strict=True))
    try:
        session = ort.InferenceSession(
            _subgraph(model, mask, source, producers).SerializeToString(),
            providers=["CPUExecutionProvider"],
        )
    except Exception:  # a subgraph ORT cannot build on its own: not one we can check
        return "unknown"
    dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
    padding, lowest = True, np.inf
    for pattern in _padding_patterns(batch, length):
        try:
            (out,) = session.run([mask], {source: pattern.astype(dtype)})
        except Exception:
            return "unknown"
        lowest = min(lowest, float(np.min(out)))
        padding = padding and _is_padding(out, pattern)
    if padding:
        return "padding"
    return "bounded" if lowest > MASKED_AT_MOST else "unknown"


def _is_padding(out: np.ndarray, pattern: np.ndarray) -> bool:
    batch, length = pattern.shape
    if out.ndim < 2 or out.shape[-1] != length or out.shape[0] not in (1, batch):
        return False
    shape = (batch, *out.shape[1:])
    keep = np.broadcast_to(pattern.reshape(batch, *([1] * (out.ndim - 2)), length) != 0, shape)
    values = np.broadcast_to(out, shape)
    return bool(np.all(values[keep] == 0) and np.all(values[~keep] <= MASKED_AT_MOST))


def _padding_patterns(batch: int, length: int) -> Iterable[np.ndarray]:
    """All keys kept, a padded tail of each length, and random holes (the first key kept)."""
    rng = np.random.default_rng(0)
    yield np.ones((batch, length), np.int64)
    for _ in range(PATTERN_SEQUENCES):
        lengths = rng.integers(1, length + 1, batch)
        yield (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        holes = (rng.random((batch, length)) < 0.7).astype(np.int64)
        holes[:, 0] = 1
        yield holes


def _subgraph(
    model: onnx.ModelProto, mask: str, source: str, producers: dict[str, onnx.NodeProto]
) -> onnx.ModelProto:
    nodes = _ancestors(mask, producers)
    read = {name for node in nodes for name in node.input}
    initializers = [init for init in model.graph.initializer if init.name in read]
    source_value = next(v for v in model.graph.input if v.name == source)
    output = onnx.ValueInfoProto(name=mask)  # type left to the runtime's inference
    graph = helper.make_graph(nodes, "mask", [source_value], [output], initializers)
    sub = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return sub


# -- rewriting -------------------------------------------------------------------------------


def _fresh(graph: onnx.GraphProto, base: str) -> str:
    taken = {name for node in graph.node for name in (*node.input, *node.output)}
    taken |= {init.name for init in graph.initializer}
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    return name


def _scalar(graph: onnx.GraphProto, base: str, value: np.ndarray) -> str:
    name = _fresh(graph, base)
    graph.initializer.append(numpy_helper.from_array(value, name))
    return name


def _mask_rank(model: onnx.ModelProto, mask: str) -> int:
    inferred = infer_graph_shapes(model.graph, model)
    for value in inferred.graph.value_info:
        if value.name == mask and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return 4  # (batch, heads, queries, keys): what attention masks broadcast as


def _insert_after(graph: onnx.GraphProto, mask: str, nodes: list[onnx.NodeProto]) -> None:
    """Put ``nodes`` right after the node producing ``mask`` (graph order stays topological)."""
    position = next(i for i, node in enumerate(graph.node) if mask in node.output)
    for offset, node in enumerate(nodes, start=1):
        graph.node.insert(position + offset, node)


def _canonical_mask(model: onnx.ModelProto, mask: str, source: str) -> str:
    """``Where(source == 0, MASK_PENALTY, 0)``, shaped (batch, 1, ..., keys) like ``mask``."""
    graph = model.graph
    rank = _mask_rank(model, mask)
    zero = _scalar(graph, f"{source}_pad_id", np.array(0, dtype=_dtype_of(graph, source)))
    axes = _scalar(graph, f"{source}_mask_axes", np.arange(1, rank - 1, dtype=np.int64))
    penalty = _scalar(graph, "mask_penalty", np.array(MASK_PENALTY, np.float32))
    kept = _scalar(graph, "mask_kept", np.array(0.0, np.float32))
    padded, spread, new = (_fresh(graph, f"{source}_{n}") for n in ("is_pad", "is_pad_nd", "bias"))
    nodes = [helper.make_node("Equal", [source, zero], [padded], name=padded)]
    if rank > 2:
        nodes.append(helper.make_node("Unsqueeze", [padded, axes], [spread], name=spread))
    else:
        spread = padded
    nodes.append(helper.make_node("Where", [spread, penalty, kept], [new], name=new))
    _insert_after(graph, mask, nodes)
    return new


def _bounded_mask(graph: onnx.GraphProto, mask: str) -> str:
    """``Where(mask <= MASKED_AT_MOST, MASK_PENALTY, mask)``."""
    limit = _scalar(graph, "mask_masked_at_most", np.array(MASKED_AT_MOST, np.float32))
    penalty = _scalar(graph, "mask_penalty", np.array(MASK_PENALTY, np.float32))
    masked, new = _fresh(graph, f"{mask}_masked"), _fresh(graph, f"{mask}_bounded")
    _insert_after(graph, mask, [
        helper.make_node("LessOrEqual", [mask, limit], [masked], name=masked),
        helper.make_node("Where", [masked, penalty, mask], [new], name=new),
    ])  # fmt: skip
    return new


def _dtype_of(graph: onnx.GraphProto, name: str) -> np.dtype:
    value = next(v for v in graph.input if v.name == name)
    return np.dtype(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def _redirect(graph: onnx.GraphProto, old: str, new: str, skip_producer_of: str) -> None:
    """Every reader of ``old`` reads ``new`` (but the nodes that compute ``new`` from it)."""
    producers = {out: node for node in graph.node for out in node.output}
    own = {id(node) for node in _ancestors(skip_producer_of, producers)}
    for node in graph.node:
        if id(node) in own:
            continue
        for index, name in enumerate(node.input):
            if name == old:
                node.input[index] = new


def _drop_nan_guards(graph: onnx.GraphProto) -> int:
    """``Where(IsNaN(p), 0, p)`` on a Softmax output ``p`` -> ``p``; returns how many."""
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {value.name for value in graph.output}
    count = 0
    for node in graph.node:
        if node.op_type != "Where" or node.output[0] in outputs:
            continue
        condition = producers.get(node.input[0])
        value = node.input[2]
        if (
            condition is not None
            and condition.op_type == "IsNaN"
            and condition.input[0] == value
            and getattr(producers.get(value), "op_type", None) == "Softmax"
        ):
            _redirect(graph, node.output[0], value, skip_producer_of=value)
            count += 1
    return count


def _remove_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nothing reads (repeatedly), then unused initializers."""
    outputs = {value.name for value in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        alive = [node for node in graph.node if any(out in read for out in node.output)]
        if len(alive) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(alive)
    read = {name for node in graph.node for name in node.input} | outputs
    kept = [init for init in graph.initializer if init.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
