"""Names for the FoldReport from an ONNX graph: what the torch exporter recorded, if anything.

The dynamo exporter stores each node's module path and class in its metadata; the legacy one
encodes the module path in node names (``/vit/layers.0/layernorm_before/Mul``); files from other
frameworks may have neither, and then a node's name or output name is all there is.
"""

from __future__ import annotations

import ast

import onnx_ir as ir

from .graph import offline_norm_classes
from .onnx_metadata import CLASS_HIERARCHY, FOLDED_FROM, NAME_SCOPES


def _metadata_list(node: ir.Node | ir.Value, key: str) -> list[str]:
    try:
        value = ast.literal_eval(node.metadata_props.get(key, "[]"))
    except (ValueError, SyntaxError):
        return []
    return value if isinstance(value, list) else []


def norm_name(first: ir.Node, output: ir.Value) -> tuple[str, str]:
    """(name, kind) of the norm whose chain starts at ``first``: the torch module path and
    norm kind when the dynamo exporter recorded them (a module not edge_un's, such as the UN
    authors' ``UN1d``: its path and "affine"), else a path or name and "affine"."""
    scopes, classes = _metadata_list(first, NAME_SCOPES), _metadata_list(first, CLASS_HIERARCHY)
    norms = offline_norm_classes()
    if len(classes) >= 2 and classes[-2] in norms and len(scopes) >= 2:
        return scopes[-2], norms[classes[-2]].kind
    if len(scopes) >= 2 and scopes[-2]:
        return scopes[-2], "affine"
    name = first.name
    return scope_path(name or "") or name or output.name or "affine", "affine"


def layer_name(node: ir.Node) -> str:
    """The module path of a MatMul/Gemm/Conv, else its name (or op and output)."""
    scopes = _metadata_list(node, NAME_SCOPES)
    return scopes[-2] if len(scopes) >= 2 else scope_path(node.name or "") or label(node)


def folded_table_name(value: ir.Value) -> str:
    """The module of the one table (a ``.weight``) a folded constant was computed from, when
    the optimizer recorded it (BERT's position rows: ``bert.embeddings.position_embeddings``);
    else ""."""
    tables = [v for v in _metadata_list(value, FOLDED_FROM) if v.endswith(".weight")]
    return tables[0].removesuffix(".weight") if len(tables) == 1 else ""


def scope_path(name: str) -> str | None:
    """The module path in a legacy exporter's node name: ``/vit/layers.0/norm/Mul`` ->
    ``vit.layers.0.norm`` (None for other names)."""
    parts = name.split("/")
    return ".".join(parts[1:-1]) if len(parts) >= 3 and not parts[0] else None


def label(node: ir.Node) -> str:
    """A node's name, or its op and output when the file has no node names."""
    return node.name or f"{node.op_type}({node.outputs[0].name})"
