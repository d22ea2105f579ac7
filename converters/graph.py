"""Reading a torch.export (aten-level) fx graph: module scopes, constants, layout-preserving ops.

Every node of a graph from ``torch.export`` carries ``nn_module_stack``: the module call it came
from. That, not attribute names, is how norms and Linears are found, so any model works.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, fx, nn

from edge_un.norms import OfflineNorm

aten = torch.ops.aten

LINEAR_OPS = {aten.linear.default}
CONV_OPS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
ONLINE_NORM_OPS = {
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.group_norm.default,
    aten.native_group_norm.default,
    aten.rms_norm.default,
    aten._fused_rms_norm.default,
}
ONLINE_NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
# Ops that are the identity on values in eval mode.
IDENTITY_OPS = {
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.dropout.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.detach.default,
}
RESHAPE_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}
AFFINE_OPS = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
}
# Nodes with no output that only check metadata; they belong to whatever they check.
ASSERT_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
# Ops that read only a tensor's shape, which a per-channel affine never changes.
SHAPE_ONLY_OPS = {
    aten.sym_size.int,
    aten.sym_numel.default,
    aten.sym_stride.int,
    aten.sym_storage_offset.default,
}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from subclasses(sub)


def offline_norm_classes() -> dict[str, type[OfflineNorm]]:
    """Every OfflineNorm subclass by its dotted name, as nn_module_stack records it."""
    return {class_name(c): c for c in subclasses(OfflineNorm)}


def online_norm_class_names() -> set[str]:
    return {class_name(c) for base in ONLINE_NORM_CLASSES for c in subclasses(base)}


def module_call(node: fx.Node) -> tuple[str, str, str] | None:
    """The innermost module call of a node: (call key, module path, class name)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    key, (path, cls) = list(stack.items())[-1]
    return key, path, cls if isinstance(cls, str) else class_name(cls)


def module_path(node: fx.Node) -> str:
    """The module a node belongs to, for messages (the root module is "the model's forward")."""
    call = module_call(node)
    return (call[1] or "the model's forward") if call else node.name


def fetch_attr(gm: fx.GraphModule, target: str) -> Tensor:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def set_attr(gm: fx.GraphModule, target: str, tensor: Tensor) -> None:
    """Replace (or create) the tensor at a dotted attribute path, as a frozen parameter."""
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name in owner._buffers:
        owner._buffers[name] = tensor.detach()
    else:
        if hasattr(owner, name) and name not in owner._parameters:
            delattr(owner, name)
        owner._parameters[name] = nn.Parameter(tensor.detach(), requires_grad=False)


class Constants:
    """Which nodes depend on parameters/constants only, and their values (evaluated once)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._is_const: dict[fx.Node, bool] = {}
        self._values: dict[fx.Node, Any] = {}

    def is_const(self, node: fx.Node) -> bool:
        if node not in self._is_const:
            if node.op == "get_attr":
                result = True
            elif node.op == "call_function" and node.target not in ASSERT_OPS:
                result = all(self.is_const(a) for a in node.all_input_nodes)
            else:
                result = False
            self._is_const[node] = result
        return self._is_const[node]

    def value(self, arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg not in self._values:
            if arg.op == "get_attr":
                self._values[arg] = fetch_attr(self.gm, str(arg.target))
            else:
                args = fx.node.map_arg(arg.args, self.value)
                kwargs = fx.node.map_arg(arg.kwargs, self.value)
                with torch.no_grad():
                    self._values[arg] = arg.target(*args, **kwargs)  # type: ignore[operator]
        return self._values[arg]


def shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, Tensor) else None


def normalize_dims(dims: Any, rank: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return [d % rank for d in dims]
