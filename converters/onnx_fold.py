"""Fold the offline norms of an fp32 ONNX model from any framework into its weights.

After constant folding (onnxscript), an offline norm in eval is a chain of Mul/Add/Sub/Div by
per-channel constants; the fold rules (:mod:`.fold_rules`, the same for every format) run on
the graph (:mod:`.onnx_fold_graph`): forward into the MatMul/Gemm that consume it, else
backward into the MatMul/Gemm/Conv or the embedding tables behind it, else one Mul + Add (a
longer chain collapsed), and the report says why.

Table lookups are kept as Gathers until the fold (not folded into constants when their indices
are constant, like BERT's position rows), so the report names every table a norm folds into, as
the torch route does; constant folding then runs again. External data is read with path checks
(:mod:`.onnx_load`); ``x[:, 0, :]`` becomes a slice (:mod:`.onnx_rewrites`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import NameFixPass, RemoveUnusedNodesPass, ShapeInferencePass

from .edge_rewrites import for_edge_runtimes
from .errors import OnlineNormError
from .fold_report import FoldReport
from .fold_rules import fold_all
from .log_levels import loggers_at
from .onnx_fold_graph import OnnxFoldGraph
from .onnx_load import load_onnx
from .onnx_rewrites import constant, constant_lookups, is_default_op

ONLINE_NORM_OPS = {
    "LayerNormalization", "GroupNormalization", "RMSNormalization", "InstanceNormalization",
    "MeanVarianceNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
}  # fmt: skip

SMALL_CONSTANT = 1024  # elements: a ConstantOfShape this small is worth folding

__all__ = ["ONLINE_NORM_OPS", "fold_onnx", "load_onnx"]


def fold_onnx(
    model: str | Path | onnx.ModelProto, *, allow_online: bool = False
) -> tuple[onnx.ModelProto, FoldReport]:
    """Fold every per-channel affine chain; returns the new model (checked) and the report."""
    source = Path(model).name if isinstance(model, (str, Path)) else "ONNX model"
    proto = load_onnx(model) if isinstance(model, (str, Path)) else model
    ir_model = ir.from_proto(proto)
    # onnxscript logs each node its evaluator cannot fold ("Evaluation failed: cannot reshape
    # ..."); such a node stays as it is, which the fold handles
    with loggers_at(logging.ERROR):
        onnxscript.optimizer.fold_constants(ir_model, should_fold=_keep_table_lookups)
    RemoveUnusedNodesPass()(ir_model)
    ShapeInferencePass()(ir_model)
    graph = ir_model.graph
    for_edge_runtimes(graph)  # x[:, 0, :] as a slice (no GATHER for an NPU); no zero pads
    online = [f"{n.name} ({n.op_type})" for n in graph.all_nodes() if n.op_type in ONLINE_NORM_OPS]
    if online and not allow_online:
        raise OnlineNormError(
            f"online norms cannot fold: {', '.join(online)}; keep them with allow_online=True "
            "(CLI: --allow-online)"
        )
    results = fold_all(OnnxFoldGraph(graph))
    constant_lookups(graph)  # position rows: constants again, as constant folding made them
    RemoveUnusedNodesPass()(ir_model)
    NameFixPass()(ir_model)  # unique names for the nodes added here
    out = ir.to_proto(ir_model)
    onnx.checker.check_model(out, full_check=True)
    notes = ("online norms kept (allow_online=True): not fully integer",) * bool(online)
    return out, FoldReport(results, source, tuple(online), notes)


def _keep_table_lookups(node: ir.Node) -> bool | None:
    """Lookups stay (the fold names and scales their tables); a small ConstantOfShape is folded
    (onnxscript leaves every one, but the legacy exporter computes Pad widths with them); the
    rest as onnxscript decides."""
    table = constant(node.inputs[0]) if is_default_op(node, "Gather") else None
    if table is not None and table.ndim == 2:
        return False
    shape = constant(node.inputs[0]) if is_default_op(node, "ConstantOfShape") else None
    return True if shape is not None and int(np.prod(shape)) <= SMALL_CONSTANT else None
