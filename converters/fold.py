"""Fold offline norms into neighbouring Linear/Conv weights (the paper's Algorithm 1).

The model is traced with ``torch.export`` in eval mode; the graph, not attribute names, says what
consumes each norm. In eval every offline norm is ``x * scale + shift`` per channel, and
``edge_un.OfflineNorm.affine()`` is exactly what the traced chain computes, so this module reads
``(scale, shift)`` from the chain itself: that works the same for a live model and for a saved
``.pt2`` program whose classes are never imported. Each norm call then:

1. folds forward when every consumer of its output is a Linear (reached through ops that commute
   with a per-channel affine: mean over tokens, token slicing, channel-preserving reshapes);
2. else folds backward into the Linear/Conv that produces its input, if nothing else reads it,
   or into the embedding tables whose lookups it sums (BERT's embeddings norm,
   :mod:`.embedding_fold`);
3. else becomes one Mul + Add with constant vectors, and the report says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram

from .embedding_fold import embedding_lookups, fold_into_embeddings
from .equations import (
    as_channel_vector,
    compose_affine,
    fold_affine_into_following_linear,
    fold_affine_into_preceding_linear,
)
from .errors import ConversionError, OnlineNormError
from .fold_report import FoldReport, NormFold
from .graph import (
    AFFINE_OPS,
    ASSERT_OPS,
    CONV_OPS,
    IDENTITY_OPS,
    LINEAR_OPS,
    ONLINE_NORM_CLASSES,
    ONLINE_NORM_OPS,
    SHAPE_ONLY_OPS,
    Constants,
    aten,
    fetch_attr,
    keeps_channels_last,
    last_axis,
    module_call,
    module_path,
    normalize_dims,
    offline_norm_classes,
    online_norm_class_names,
    set_attr,
    shape,
)
from .program import program_output_note


@dataclass
class NormCall:
    """One call of an offline norm in the graph, reduced to ``output = input * scale + shift``."""

    path: str
    kind: str
    nodes: list[fx.Node]
    input: fx.Node
    output: fx.Node
    scale: Tensor  # float64, (C,)
    shift: Tensor  # float64, (C,)


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
    gm = program.module()
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


def default_example_inputs(model: nn.Module) -> tuple[Tensor, ...]:
    """Inputs for edge_un's own models, from their config (batch 2: batch stays dynamic)."""
    config = getattr(model, "config", None) or {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if "img_size" in config:
        size = config["img_size"]
        return (torch.randn(2, config.get("in_chans", 1), size, size, dtype=dtype),)
    if "vocab_size" in config:
        return (torch.randint(1, config["vocab_size"], (2, config["max_len"])),)
    raise ConversionError(f"cannot guess the inputs of {type(model).__name__}: pass example_inputs")


def export_eval(model: nn.Module, example_inputs: Any) -> ExportedProgram:
    """``torch.export`` of the eval-mode model with the first (batch) dimension of every tensor
    input left to Dim.AUTO, so the batch stays dynamic where the model allows; the model's own
    training mode is restored afterwards."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    dynamic = tuple(
        {0: torch.export.Dim.AUTO} if isinstance(a, Tensor) and a.dim() else None for a in args
    )
    was_training = model.training
    model.eval()
    try:
        return torch.export.export(model, args, dynamic_shapes=dynamic)
    except Exception as error:  # torch.export raises many types; one line for the user
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(f"cannot trace {type(model).__name__}: {first}") from error
    finally:
        model.train(was_training)


def fold_graph(
    gm: fx.GraphModule, *, source: str, allow_online: bool = False, notes: tuple[str, ...] = ()
) -> FoldReport:
    """Fold every offline-norm call of an exported graph in place; returns the report (with
    ``notes`` from whoever loaded the graph)."""
    online = find_online_norms(gm)
    if online and not allow_online:
        raise OnlineNormError(_online_message(online))
    results = []
    for key in _norm_call_keys(gm):
        call = describe_norm_call(gm, key)
        results.append(fold_norm_call(gm, call))
    _remove_dead_attributes(gm)
    gm.graph.lint()
    gm.recompile()
    notes += ("online norms kept (allow_online=True): the graph is not fully integer",) * bool(
        online
    )
    return FoldReport(tuple(results), source=source, online_norms=tuple(online), notes=notes)


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


def _norm_call_keys(gm: fx.GraphModule) -> list[str]:
    classes = offline_norm_classes()
    keys: dict[str, None] = {}
    for node in gm.graph.nodes:
        call = module_call(node) if node.op == "call_function" else None
        if call and call[2] in classes:
            keys[call[0]] = None
    return list(keys)


def describe_norm_call(gm: fx.GraphModule, key: str) -> NormCall:
    """Find the chain ``input -> (mul/add/... by constants) -> output`` of one norm call."""
    nodes = [
        n for n in gm.graph.nodes if n.op == "call_function" and (module_call(n) or ("",))[0] == key
    ]
    _, path, cls = module_call(nodes[0])  # type: ignore[misc]
    kind = offline_norm_classes()[cls].kind
    scope = set(nodes)
    outputs = [n for n in nodes if any(u not in scope for u in n.users)]
    if len(outputs) != 1:
        raise ConversionError(f"norm {path} has {len(outputs)} outputs in the graph, expected 1")
    consts = Constants(gm)
    chain: list[fx.Node] = []
    node = outputs[0]
    while node in scope:
        chain.append(node)
        data = [a for a in node.all_input_nodes if not consts.is_const(a)]
        if node.op != "call_function" or len(data) != 1:
            raise ConversionError(f"norm {path} is not a per-channel affine (exported in eval?)")
        node = data[0]
    chain.reverse()
    extra = [
        n for n in nodes if not consts.is_const(n) and n not in chain and n.target not in ASSERT_OPS
    ]
    if extra:
        raise ConversionError(f"norm {path} computes more than x * scale + shift: {extra[0]}")
    dims = shape(outputs[0])
    if not dims:
        raise ConversionError(f"norm {path}: no shape recorded for its output")
    scale, shift = chain_affine(chain, node, consts, dims[-1], path)
    return NormCall(path, kind, nodes, node, outputs[0], scale, shift)


def chain_affine(
    chain: list[fx.Node], data: fx.Node, consts: Constants, channels: int, path: str
) -> tuple[Tensor, Tensor]:
    """Compose the chain's elementwise ops into one ``(scale, shift)`` in float64."""
    scale = torch.ones(channels, dtype=torch.float64)
    shift = torch.zeros(channels, dtype=torch.float64)
    for node in chain:
        if node.target in IDENTITY_OPS:
            data = node
            continue
        op = AFFINE_OPS.get(node.target)  # type: ignore[arg-type]
        alpha = node.kwargs.get("alpha", 1)
        if op is None or (op in ("add", "sub") and alpha != 1):
            raise ConversionError(f"norm {path}: {node.target} is not a per-channel affine op")
        data_first = node.args[0] is data
        constant = node.args[1] if data_first else node.args[0]
        value = torch.as_tensor(consts.value(constant)).to(torch.float64)
        try:
            vector = as_channel_vector(value, channels)
            scale, shift = compose_affine(scale, shift, op, vector, data_first)
        except ValueError as error:
            raise ConversionError(f"norm {path}: {error}") from None
        data = node
    return scale, shift


def fold_norm_call(gm: fx.GraphModule, call: NormCall) -> NormFold:
    """Fold one norm call (forward, else backward, else Mul + Add); returns what was done."""
    consumers, forward_reason = linear_consumers(gm, call)
    if consumers is not None:
        for linear in consumers:
            _fold_into_following(gm, linear, call)
        _bypass(gm, call, call.input)
        return NormFold(call.path, call.kind, "folded_forward", _paths(consumers))
    producer, backward_reason = producing_layer(gm, call)
    if producer is not None:
        _fold_into_preceding(gm, producer, call)
        _bypass(gm, call, call.input)
        return NormFold(call.path, call.kind, "folded_backward", (module_path(producer),))
    lookups, embedding_reason = embedding_lookups(gm, call.input, set(call.nodes))
    if lookups is not None:
        fold_into_embeddings(gm, lookups, call.scale, call.shift)
        _bypass(gm, call, call.input)
        return NormFold(call.path, call.kind, "folded_backward", _paths(lookups))
    _replace_with_scale_shift(gm, call)
    reason = f"forward: {forward_reason}; backward: {backward_reason}"
    reason += f"; embeddings: {embedding_reason}" if embedding_reason else ""
    return NormFold(call.path, call.kind, "scale_shift", reason=reason)


def _paths(nodes: list[fx.Node]) -> tuple[str, ...]:
    return tuple(module_path(n) for n in nodes)


def _single_use_weight(gm: fx.GraphModule, layer: fx.Node) -> str | None:
    """None if the layer's weight (and bias) are parameters that this layer alone uses."""
    for arg in layer.args[1:3]:
        if arg is None:
            continue
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return f"{module_path(layer)} has a weight that is not a constant parameter"
        uses = sum(
            len(n.users) for n in gm.graph.nodes if n.op == "get_attr" and n.target == arg.target
        )
        if uses != 1:
            return f"{module_path(layer)} ({arg.target}) is used {uses} times in the graph"
    return None


def linear_consumers(gm: fx.GraphModule, call: NormCall) -> tuple[list[fx.Node] | None, str]:
    """Every Linear fed by the norm's output through affine-commuting ops, or the reason not."""
    channels = call.scale.numel()
    linears: list[fx.Node] = []
    frontier = [call.output]
    while frontier:
        data = frontier.pop()
        if not data.users:
            continue
        for user in data.users:
            if user.op == "output":
                return None, "its output is a model output"
            if user.target in SHAPE_ONLY_OPS:
                continue  # reads the shape only; re-pointed to the norm's input by the fold
            if user.target in LINEAR_OPS and user.args[0] is data:
                if data in user.all_input_nodes[1:]:
                    return None, f"{module_path(user)} uses it as a weight"
                problem = _single_use_weight(gm, user)
                if problem:
                    return None, problem
                linears.append(user)
                continue
            reason = keeps_channels_last(user, data, channels)
            if reason is not None:
                return None, f"it feeds {module_path(user)}: {reason}"
            frontier.append(user)
    if len({id(n) for n in linears}) != len(linears) or not linears:
        return None, "no Linear consumes it"
    return linears, ""


def producing_layer(gm: fx.GraphModule, call: NormCall) -> tuple[fx.Node | None, str]:
    """The Linear/Conv whose output is the norm's input with nothing else reading it in between
    (through transposes/flatten that move the channel axis), or the reason there is none."""
    scope = set(call.nodes)
    node, axis = call.input, last_axis(call.input)
    previous: set[fx.Node] = scope
    while True:
        others = {
            u
            for u in node.users
            if u not in previous and not _is_guard(u) and u.target not in SHAPE_ONLY_OPS
        }
        if others:
            return None, f"its input {node.name} also feeds {next(iter(others))}"
        if node.op != "call_function":
            return None, f"its input comes from {node.op} {node.name}, not a Linear or Conv"
        if node.target in LINEAR_OPS and axis == last_axis(node):
            break
        if node.target in CONV_OPS and axis == 1:
            break
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node):
            return None, f"its input comes from {node.target}"
        rank = len(shape(source) or ())
        if node.target in IDENTITY_OPS:
            pass
        elif node.target == aten.transpose.int:
            d0, d1 = normalize_dims(node.args[1:3], rank)
            axis = d1 if axis == d0 else d0 if axis == d1 else axis
        elif node.target == aten.permute.default:
            axis = normalize_dims(node.args[1], rank)[axis]
        elif node.target == aten.flatten.using_ints and rank:
            start, end = normalize_dims(
                [
                    node.args[1] if len(node.args) > 1 else 0,
                    node.args[2] if len(node.args) > 2 else -1,
                ],
                rank,
            )
            if axis == start and start != end:
                return None, f"{node.name} flattens the channel axis with others"
            axis = axis if axis < start else axis + (end - start)
        else:
            return None, f"its input comes from {module_path(node)} ({node.target})"
        previous, node = {node}, source
    problem = _single_use_weight(gm, node)
    return (None, problem) if problem else (node, "")


def _is_guard(node: fx.Node) -> bool:
    """torch.export's input-shape guard: reads shapes, not values."""
    return node.op == "call_module" and str(node.target).startswith("_guards")


def _weight_and_bias(gm: fx.GraphModule, layer: fx.Node) -> tuple[Tensor, Tensor | None]:
    bias = layer.args[2] if len(layer.args) > 2 else None
    weight = fetch_attr(gm, str(layer.args[1].target))  # type: ignore[union-attr]
    return weight, fetch_attr(gm, str(bias.target)) if isinstance(bias, fx.Node) else None


def _store(gm: fx.GraphModule, layer: fx.Node, weight: Tensor, bias: Tensor) -> None:
    """Write folded weights back (float64 math, original dtype); create the bias if missing."""
    old_weight, _ = _weight_and_bias(gm, layer)
    dtype = old_weight.dtype
    set_attr(gm, str(layer.args[1].target), weight.to(dtype))  # type: ignore[union-attr]
    bias_node = layer.args[2] if len(layer.args) > 2 else None
    if isinstance(bias_node, fx.Node):
        set_attr(gm, str(bias_node.target), bias.to(dtype))
        return
    owner = str(layer.args[1].target).rpartition(".")[0]  # type: ignore[union-attr]
    target = _free_name(gm, f"{owner}.bias" if owner else "bias")
    set_attr(gm, target, bias.to(dtype))
    with gm.graph.inserting_before(layer):
        new_bias = gm.graph.get_attr(target)
    layer.args = (*layer.args[:2], new_bias, *layer.args[3:])


def _fold_into_following(gm: fx.GraphModule, linear: fx.Node, call: NormCall) -> None:
    weight, bias = _weight_and_bias(gm, linear)
    new = fold_affine_into_following_linear(
        weight.double(), None if bias is None else bias.double(), call.scale, call.shift
    )
    _store(gm, linear, *new)


def _fold_into_preceding(gm: fx.GraphModule, layer: fx.Node, call: NormCall) -> None:
    weight, bias = _weight_and_bias(gm, layer)
    new = fold_affine_into_preceding_linear(
        weight.double(), None if bias is None else bias.double(), call.scale, call.shift
    )
    _store(gm, layer, *new)


def _free_name(gm: fx.GraphModule, target: str) -> str:
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    candidate, index = name, 0
    while hasattr(owner, candidate):
        index += 1
        candidate = f"{name}_{index}"
    return f"{owner_path}.{candidate}" if owner_path else candidate


def _bypass(gm: fx.GraphModule, call: NormCall, replacement: fx.Node) -> None:
    """Route the norm's users to ``replacement`` and delete the norm's nodes."""
    scope = set(call.nodes)
    call.output.replace_all_uses_with(replacement, delete_user_cb=lambda u: u not in scope)
    for node in reversed(call.nodes):
        gm.graph.erase_node(node)


def _replace_with_scale_shift(gm: fx.GraphModule, call: NormCall) -> None:
    """One Mul and one Add by constant (C,) vectors: no reduction, no division, no square root."""
    dtype = call.output.meta["val"].dtype
    scale_target = _free_name(gm, f"{call.path}.folded_scale")
    set_attr(gm, scale_target, call.scale.to(dtype))
    shift_target = _free_name(gm, f"{call.path}.folded_shift")
    set_attr(gm, shift_target, call.shift.to(dtype))
    anchor = call.output.next
    with gm.graph.inserting_before(anchor):
        scale = gm.graph.get_attr(scale_target)
        shift = gm.graph.get_attr(shift_target)
        mul = gm.graph.call_function(aten.mul.Tensor, (call.input, scale))
        add = gm.graph.call_function(aten.add.Tensor, (mul, shift))
    for node in (mul, add):  # keep the norm's name on its replacement (ONNX metadata shows it)
        node.meta["nn_module_stack"] = call.output.meta.get("nn_module_stack", {})
        node.meta["val"] = call.output.meta.get("val")
    _bypass(gm, call, add)


def _remove_dead_attributes(gm: fx.GraphModule) -> None:
    """Drop get_attr nodes nothing reads any more, and the norm tensors behind them."""
    dead = [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    for node in dead:
        gm.graph.erase_node(node)
    live = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    norm_classes = tuple(offline_norm_classes().values())
    for node in dead:
        target = str(node.target)
        if target in live:
            continue
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if name in owner._parameters or name in owner._buffers or isinstance(owner, norm_classes):
            delattr(owner, name)
