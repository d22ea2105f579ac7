"""Fold offline norms of a torch model or program into its weights (the paper's Algorithm 1).

The model is traced with ``torch.export`` in eval mode, and the fold rules
(:mod:`.fold_rules`, the same for every format) run on its fx graph (:mod:`.fx_fold_graph`):
each norm folds forward into the Linears that consume it, else backward into the Linear/Conv or
the embedding tables behind it, else becomes one Mul + Add, and the report says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn
from torch.export import ExportedProgram

from .canonical import canonicalize
from .errors import OnlineNormError
from .fold_report import FoldReport
from .fold_rules import fold_all
from .fx_fold_graph import FxFoldGraph
from .graph import (
    ONLINE_NORM_CLASSES,
    ONLINE_NORM_OPS,
    module_call,
    module_path,
    online_norm_class_names,
)
from .program import positional_tensor_inputs, program_output_note
from .trace import default_example_inputs, export_eval


def fold_norms(
    model: nn.Module | ExportedProgram,
    example_inputs: Any = None,
    *,
    allow_online: bool = False,
) -> tuple[fx.GraphModule, FoldReport]:
    """Fold every offline norm of ``model``; returns the folded module (an fx GraphModule with the
    same call signature and outputs) and the FoldReport.

    ``example_inputs`` (a tensor or tuple) is needed to trace models that are not edge_un's own;
    the batch size of the result stays dynamic. Online norms (LayerNorm, RMSNorm, GroupNorm) are
    an error naming them, unless ``allow_online`` (the report then says not fully integer).
    """
    notes: tuple[str, ...] = ()
    if isinstance(model, ExportedProgram):
        program, source = model, "torch.export program"
        notes = tuple(filter(None, [program_output_note(model)]))
    else:
        online = [
            f"{name} ({type(m).__name__})"
            for name, m in model.named_modules()
            if isinstance(m, ONLINE_NORM_CLASSES)
        ]
        if online and not allow_online:
            raise OnlineNormError(_online_message(online))
        args = default_example_inputs(model) if example_inputs is None else example_inputs
        program, source = export_eval(model, args), type(model).__name__
    gm = positional_tensor_inputs(program.module())
    report = fold_graph(gm, source=source, allow_online=allow_online, notes=notes)
    for module in gm.modules():  # an unlifted program refuses .eval(); it is an eval graph
        module.training = False
    return gm, report


def _online_message(online: Sequence[str]) -> str:
    return (
        f"online norms cannot fold: {', '.join(online)}; migrate the model to UN first "
        "(edge-un migrate CHECKPOINT --epochs N --out PATH, or edge_un.migrate: swaps them and "
        "distils the model into the result), or keep them with allow_online=True "
        "(CLI: --allow-online)"
    )


def fold_graph(
    gm: fx.GraphModule, *, source: str, allow_online: bool = False, notes: tuple[str, ...] = ()
) -> FoldReport:
    """Fold every offline-norm call of an exported graph in place; returns the report (with
    ``notes`` from whoever loaded the graph)."""
    online = find_online_norms(gm)
    if online and not allow_online:
        raise OnlineNormError(_online_message(online))
    rewritten = canonicalize(gm)  # in-place ops and composites, as the rules read them
    notes += (f"canonical form: {', '.join(rewritten)}",) * bool(rewritten)
    graph = FxFoldGraph(gm)
    results = fold_all(graph)
    graph.remove_dead_attributes()
    gm.graph.lint()
    gm.recompile()
    notes += ("online norms kept (allow_online=True): the graph is not fully integer",) * bool(
        online
    )
    return FoldReport(results, source=source, online_norms=tuple(online), notes=notes)


def find_online_norms(gm: fx.GraphModule) -> list[str]:
    """Module paths of online norms: by their op (any framework) or their class."""
    online_classes = online_norm_class_names()
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        call = module_call(node)
        if node.target in ONLINE_NORM_OPS or (call and call[2] in online_classes):
            name = call[2].rsplit(".", 1)[-1] if call else str(node.target)
            found[f"{module_path(node)} ({name})"] = None
    return list(found)
