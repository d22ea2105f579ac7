"""Where a tensor comes from in the user's model: the torch module path behind a graph name.

The report's worst layers and ops off the accelerator are tensors of the exported graph
(``softmax_3``, ``linear_13``) or of onnx2tf's TFLite file
(``model_92/tf.nn.softmax_7/node_softmax_3``); the user knows ``blocks.3.attn``. The fp32 ONNX
file the targets start from says which: torch's dynamo exporter records each node's module stack
in its ``metadata_props`` (``pkg.torch.onnx.name_scopes`` and ``class_hierarchy``, or the older
``namespace`` string); the legacy exporter encodes the same path in node names
(``/blocks.3/attn/Softmax``). A TFLite tensor is mapped back to its ONNX tensor through
onnx2tf's tensor map (``quant.tflite.litert.onnx_names``), then to that tensor's module.

Some tensors have no record: nodes the ONNX optimizer made (a qkv ``Split``), quantization's
Q/DQ nodes, the layout TRANSPOSEs and SPLITs onnx2tf inserted. Each of those takes the module
its neighbours share (the longest common module path of the tensors it reads and of the tensors
its consumers write), with its own op: a Split between ``blocks.3.attn.qkv`` and
``blocks.3.attn`` is ``blocks.3.attn.split``. A file with no records at all gets no names.

Kept free of torch and onnx_ir (the metadata keys come from ``converters.onnx_metadata``, which
imports neither): this runs in every target's builder process.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from converters.onnx_metadata import CLASS_HIERARCHY, NAME_SCOPES, NAMESPACE

TORCH_LAYERS = "torch.nn.modules."  # a built-in layer: its one op is the module itself
INFER_ROUNDS = 8  # a chain of unrecorded nodes longer than this stays unnamed
_COUNTER = re.compile(r"_\d+$")

# (op type, input tensor names, output tensor names) of each node, in graph order
Graph = Sequence[tuple[str, Sequence[str], Sequence[str]]]


@dataclass(frozen=True)
class Source:
    """A tensor's place in the user's model."""

    module: str  # dotted torch module path; "" for the model's own forward
    op: str  # the op inside it (torch's: softmax, matmul; the graph's when inferred)
    leaf: bool  # a torch.nn layer (Linear, GELU, Conv2d) whose op this is: its path says it all

    def label(self) -> str:
        """``blocks.3.attn.softmax``; a Linear's MatMul and Add are ``blocks.3.attn.qkv``."""
        if self.leaf or not self.op:
            return self.module or self.op
        return f"{self.module}.{self.op}" if self.module else self.op


def _literal_list(text: str | None) -> list[str]:
    if not text:
        return []
    try:
        value = ast.literal_eval(text)
    except Exception:  # an uploaded file's metadata: whatever it holds, no names
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _torch_op(target: str) -> str:
    """``aten.softmax.int`` -> ``softmax``; ``aten._unsafe_view.default`` -> ``view`` (torch's
    internal variants read as the op the user wrote)."""
    parts = target.split(".")
    op = parts[1] if len(parts) >= 3 and parts[0] in ("aten", "prims") else parts[-1]
    return op.lstrip("_").removeprefix("unsafe_")


def node_source(node: onnx.NodeProto) -> Source | None:
    """What the exporter recorded for one node, if anything."""
    props = {p.key: p.value for p in node.metadata_props}
    scopes = _literal_list(props.get(NAME_SCOPES))
    classes = _literal_list(props.get(CLASS_HIERARCHY))
    if not scopes and props.get(NAMESPACE):  # older torch: one "/"-joined string of both
        pairs = [part.split(": ", 1) for part in props[NAMESPACE].split("/")]
        scopes = [p[0].strip() for p in pairs]
        classes = [p[1].strip() if len(p) > 1 else "" for p in pairs]
    # One scope is the node's own name and no module stack (torch records none for nodes it
    # makes itself): unrecorded, so that it takes its neighbours' module, not the model's root.
    if len(scopes) >= 2:
        module = scopes[-2]
        op = _torch_op(classes[-1]) if classes else _COUNTER.sub("", scopes[-1])
        leaf = len(classes) >= 2 and classes[-2].startswith(TORCH_LAYERS)
        return Source(module, op, leaf)
    parts = node.name.split("/")  # the legacy exporter: /blocks.3/attn/Softmax
    if len(parts) >= 3 and not parts[0]:
        return Source(".".join(parts[1:-1]), node.op_type.lower(), False)
    return None


def _common_module(paths: Iterable[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def infer(graph: Graph, seeds: Mapping[str, Source]) -> dict[str, Source]:
    """``seeds`` and a source for every unrecorded node output with a recorded neighbour (see the
    module docstring). Each round reads only what the previous rounds knew, so the result does
    not depend on node order."""
    known = dict(seeds)
    if not known:
        return known
    consumers: dict[str, list[int]] = defaultdict(list)
    for index, (_, inputs, _) in enumerate(graph):
        for name in inputs:
            consumers[name].append(index)
    for _ in range(INFER_ROUNDS):
        found: dict[str, Source] = {}
        for op, inputs, outputs in graph:
            missing = [name for name in outputs if name and name not in known]
            if not missing:
                continue
            near = [known[name].module for name in inputs if name in known]
            near += [
                known[name].module
                for out in outputs
                for index in consumers.get(out, ())
                for name in graph[index][2]
                if name in known
            ]
            if near:
                source = Source(_common_module(near), op.lower(), False)
                found.update(dict.fromkeys(missing, source))
        if not found:
            break
        known.update(found)
    return known


def onnx_graph(model: onnx.ModelProto) -> list[tuple[str, list[str], list[str]]]:
    return [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def onnx_sources(model: onnx.ModelProto | str | Path) -> dict[str, Source]:
    """{tensor name: source} for every node output of an ONNX model (main graph)."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    seeds: dict[str, Source] = {}
    for node in model.graph.node:
        source = node_source(node)
        if source is not None:
            seeds.update(dict.fromkeys([o for o in node.output if o], source))
    return infer(onnx_graph(model), seeds)


def derived_sources(
    graph: Graph, original: Mapping[str, Source], renamed: Mapping[str, str] | None = None
) -> dict[str, Source]:
    """Sources for a graph derived from the recorded one (the int8 QDQ file, which keeps the
    fp32 tensor names; a TFLite file, whose names ``renamed`` maps back to ONNX ones)."""
    outputs = [name for _, _, names in graph for name in names]
    if renamed is None:
        seeds = {name: original[name] for name in outputs if name in original}
    else:
        seeds = {
            name: original[renamed[name]]
            for name in outputs
            if name in renamed and renamed[name] in original
        }
    return infer(graph, seeds)


def label_of(sources: Mapping[str, Source], name: str) -> str | None:
    source = sources.get(name)
    return None if source is None else source.label() or None


def placed_ops(
    graph: Graph, sources: Mapping[str, Source], ops: Collection[str]
) -> list[tuple[str, str, str | None]]:
    """(op type, its first output, its module) of each op of ``graph`` whose type is in
    ``ops``: where in the user's model the ops a target's accelerator leaves to the CPU are."""
    return [
        (op, outputs[0], label_of(sources, outputs[0]))
        for op, _, outputs in graph
        if op in ops and outputs
    ]


def program_module_paths(nodes: Iterable, drop: str = "") -> dict[str, str]:
    """{scope chain: module path} of a torch program's nodes (an ExportedProgram's graph
    nodes), the key spelt as litert-torch spells each node's module stack in its tensor names
    (``edge_un.models.blocks.Block_3/edge_un.models.blocks.Attention_attn``: each module but the
    root, ``Class_attribute``), the value its full path (``blocks.3.attn``), ``drop`` (a
    wrapper's attribute, ``model.``) taken off its front. The names alone cannot say it: they
    keep a container's item (``Block_3``) but not the container (``blocks``). A chain two
    modules share (``enc[0]`` and ``dec[0]``, both ``Block_0``) is left out: it names neither."""
    paths: dict[str, str | None] = {}
    for node in nodes:
        stack = [(path, cls) for path, cls in node.meta.get("nn_module_stack", {}).values() if path]
        if not stack:
            continue
        chain = "/".join(f"{cls}_{path.rsplit('.', 1)[-1]}" for path, cls in stack)
        path = stack[-1][0].removeprefix(drop)
        paths[chain] = path if paths.get(chain, path) == path else None
    return {chain: path for chain, path in paths.items() if path is not None}


def scoped_sources(
    graph: Graph, module_paths: Mapping[str, str] | None = None
) -> dict[str, Source]:
    """Sources read off a graph whose tensor names are torch module scopes, as litert-torch
    names them: ``edge_un.models.vision.VisionTransformer/edge_un.models.blocks.Block_0/
    edge_un.models.blocks.Attention_attn/torch.nn.modules.linear.Linear_qkv;2`` (each scope
    ``Class_attribute``, the root's class first, ``;N`` counting its ops) is
    ``blocks.0.attn.qkv``: the longest tail of its scopes that ``module_paths``
    (program_module_paths) knows; without one, ``Block[0].attn.qkv`` (a container's item keeps
    its class, the container's own name is not in the scopes). A tensor of two fused ops
    (``a;;b``) takes the first one's scope."""
    module_paths = module_paths or {}
    sources = {}
    for op, _, outputs in graph:
        for name in outputs:
            scopes = name.split(";;")[0].split(";")[0].split("/")
            if len(scopes) < 2 and ";" not in name:
                continue
            leaf = len(scopes) > 1 and scopes[-1].startswith(TORCH_LAYERS)
            module = _known_path(scopes, module_paths)
            if module is None:
                module = ".".join(_scope_part(scope) for scope in scopes[1:])
            sources[name] = Source(module=module, op=op.lower(), leaf=leaf)
    return sources


def _known_path(scopes: Sequence[str], module_paths: Mapping[str, str]) -> str | None:
    """The path of the longest tail of ``scopes`` below the root (a converter's wrapper may
    stand above the program's own root) that ``module_paths`` has; the root alone is ""."""
    if len(scopes) == 1:
        return ""
    for start in range(1, len(scopes)):
        if (path := module_paths.get("/".join(scopes[start:]))) is not None:
            return path
    return None


def _scope_part(scope: str) -> str:
    cls, _, attribute = scope.rsplit(".", 1)[-1].partition("_")
    return f"{cls}[{attribute}]" if attribute.isdigit() else attribute
