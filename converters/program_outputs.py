"""A serialized program's output structure, reduced to its logits without importing its types.

``torch.export`` records the Python structure a model returns as a pytree spec (JSON) that names
the structure's classes, e.g. ``transformers.modeling_outputs.ImageClassifierOutput``. torch's
deserializer refuses a class that is not registered in this process, and registering it would
mean importing (trusting) the library that defines it. The graph itself only returns tensors, so
the spec is read here as plain JSON instead: the output named ``logits`` (else the first tensor)
is kept, the others are dropped, and the program then returns that one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from torch._export.serde import schema

from .errors import NotAProgramError

LOGITS = "logits"
LEAF: dict[str, Any] = {"type": None, "context": None, "children_spec": []}
LeafPath = tuple[str, ...]  # field/key names down to a leaf; "[i]" where the structure names none


def is_leaf(spec: Mapping[str, Any]) -> bool:
    return spec.get("type") is None and not spec.get("children_spec")


def child_names(
    spec: Mapping[str, Any], count: int, namedtuples: Mapping[str, Sequence[str]]
) -> list[str]:
    """Names of a node's children when its context records them (dict keys, dataclass or
    ModelOutput fields, namedtuple fields), else their positions."""
    try:
        context = json.loads(spec["context"]) if isinstance(spec.get("context"), str) else None
    except json.JSONDecodeError:
        context = None
    if isinstance(context, str):  # a namedtuple's context is its serialized type name
        context = list(namedtuples.get(context, ()))
    if isinstance(context, list) and context and isinstance(context[0], list):
        context = context[0]  # register_dataclass: (field names, names of None fields)
    if (
        isinstance(context, list)
        and len(context) == count
        and all(isinstance(n, str) for n in context)
    ):
        return context
    return [f"[{i}]" for i in range(count)]


def leaf_paths(spec: Mapping[str, Any], namedtuples: Mapping[str, Sequence[str]]) -> list[LeafPath]:
    """The path of every leaf, in pytree flattening order (the graph's user-output order)."""
    if is_leaf(spec):
        return [()]
    children = spec.get("children_spec") or []
    names = child_names(spec, len(children), namedtuples)
    return [
        (name, *path)
        for name, child in zip(names, children, strict=True)
        for path in leaf_paths(child, namedtuples)
    ]


def choose_output(paths: Sequence[LeafPath], is_tensor: Sequence[bool]) -> int | None:
    """The leaf named ``logits`` (the deepest name on its path), else the first tensor."""
    tensors = [i for i, tensor in enumerate(is_tensor) if tensor]
    named = [i for i in tensors if paths[i] and paths[i][-1] == LOGITS]
    return (named or tensors or [None])[0]


def type_name(spec: Mapping[str, Any]) -> str:
    """``ImageClassifierOutput`` for ``transformers.modeling_outputs.ImageClassifierOutput``."""
    return str(spec.get("type") or "tensor").rsplit(".", 1)[-1]


def reduce_to_logits(program: schema.ExportedProgram, name: str) -> str | None:
    """Make the (not yet deserialized) program return one tensor: its logits. Returns a note
    saying which output was kept, or None when it already returns a single tensor."""
    module = program.graph_module
    root = next((e for e in module.module_call_graph if e.fqn == ""), None)
    if root is None or root.signature is None:
        return None
    protocol, spec = json.loads(root.signature.out_spec)
    if is_leaf(spec):
        return None
    namedtuples = {k: v.field_names for k, v in module.treespec_namedtuple_fields.items()}
    paths = leaf_paths(spec, namedtuples)
    specs = module.signature.output_specs
    user = [i for i, s in enumerate(specs) if s.type == "user_output"]
    if len(paths) != len(user) or len(specs) != len(module.graph.outputs):
        raise NotAProgramError(f"{name}: its output structure does not match its graph outputs")
    is_tensor = [specs[i].user_output.arg.type == "as_tensor" for i in user]
    chosen = choose_output(paths, is_tensor)
    if chosen is None:
        raise NotAProgramError(f"{name}: the program returns no tensor")
    dropped = {i for i in user if i != user[chosen]}
    module.graph.outputs = [o for i, o in enumerate(module.graph.outputs) if i not in dropped]
    module.signature.output_specs = [s for i, s in enumerate(specs) if i not in dropped]
    if len(root.signature.outputs) == len(user):
        root.signature.outputs = [root.signature.outputs[chosen]]
    root.signature.out_spec = json.dumps([protocol, LEAF])
    shown = ".".join(paths[chosen]) or "[0]"
    count = f"{len(paths)} output{'s' * (len(paths) != 1)}"
    return f"the program returns {type_name(spec)} ({count}); kept {shown!r} as the model output"
