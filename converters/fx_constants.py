"""Input-free subgraphs of a torch program computed once, kept as constants.

A program can build tensors from nothing but constants on every call: Swin's shifted-window
attention mask (``zeros``, slices filled with a window's number, ``masked_fill``), a mask built
from ``arange``. ONNX exporters and onnx2tf fold those; litert-torch keeps them as ops, and an
Ethos-U65 leaves the boolean ones (SELECT_V2, BROADCAST_TO) to the Cortex-A. Here each such
subgraph is computed once and its value stored in the module as a buffer read where it was
used; a subgraph that reads an input, a weight or a buffer is left as it is.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

# A constant this large stays computed: folding it would store it in the file (an expand of a
# small mask to every head and position, say), at a cost the ops it saves do not repay.
MAX_FOLDED_ELEMENTS = 1 << 20
# Ops whose value differs per call: never input-free, whatever their arguments.
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial")


def input_free_nodes(graph: Graph) -> set[Node]:
    """The nodes of ``graph`` that read no input and no weight: tensor constants (a
    program's lifted literals; not a Parameter) and the ops that read only those, other such
    ops and Python values (one pass: a graph's nodes are in topological order). None in a graph
    that writes a tensor in place (``fill_`` into a slice): a value read early could change
    later. The programs prepare converts are functional (torch.export's decompositions)."""
    free: set[Node] = set()
    if any(_mutates(node) for node in graph.nodes):
        return free
    for node in graph.nodes:
        if node.op == "get_attr":
            if not isinstance(_attribute(node), torch.nn.Parameter):
                free.add(node)
        elif (
            node.op == "call_function"
            and not any(word in str(node.target) for word in _RANDOM)
            and all(arg in free for arg in node.all_input_nodes)
        ):
            free.add(node)
    return free


def constant_value(node: Node, free: set[Node] | None = None) -> torch.Tensor | None:
    """The value of ``node`` when it is an input-free op (``free``: input_free_nodes of its
    graph), computed here; None otherwise."""
    free = input_free_nodes(node.graph) if free is None else free
    if node not in free or node.op != "call_function":
        return None
    needed, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in needed:
                needed.add(arg)
                stack.append(arg)
    values: dict[Node, object] = {}
    for current in node.graph.nodes:  # in order: every argument computed before its user
        if current not in needed:
            continue
        if current.op == "get_attr":
            values[current] = _attribute(current)
            continue
        args = torch.fx.node.map_arg(current.args, values.__getitem__)
        kwargs = torch.fx.node.map_arg(current.kwargs, values.__getitem__)
        values[current] = current.target(*args, **kwargs)
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def fold_constant_subgraphs(module: GraphModule) -> int:
    """Store the value of each input-free op that another kind of node reads (the last op of
    each input-free subgraph) as a buffer of ``module``, in place; how many were folded."""
    graph = module.graph
    free = input_free_nodes(graph)
    ends = [
        node
        for node in graph.nodes
        if node in free and node.op == "call_function" and any(u not in free for u in node.users)
    ]
    values = {node: constant_value(node, free) for node in ends}  # all before any is replaced
    folded = 0
    for node, value in values.items():
        if value is None or value.numel() > MAX_FOLDED_ELEMENTS:
            continue
        name = f"_folded_constant_{folded}"
        module.register_buffer(name, value.detach().clone(), persistent=False)
        with graph.inserting_before(node):
            constant = graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        graph.lint()
        module.recompile()
    return folded


def _attribute(node: Node) -> object:
    value = node.graph.owning_module
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable
