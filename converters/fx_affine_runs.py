"""Frozen per-channel affines in a torch.export graph wherever they stand, not only in
edge_un's own norm classes: runs of elementwise ops by constants (``x / sqrt(c + eps)`` with
``c`` a buffer is one: its divisor is computed from constants only), in any layout.

The UN authors' ``UN1d`` is one such run between a transpose and reshapes; a norm of edge_un's
written in that layout is one inside its module call. Whether a run is a norm is decided by
:func:`~.affine_chains.chain_affine`, as for ONNX.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from .affine_chains import ChainAffine, Step, chain_affine, is_per_channel
from .graph import AFFINE_OPS, Constants, shape

FxStep = tuple[fx.Node, str, torch.Tensor, bool]  # data input, op, constant, data first


def affine_step(node: fx.Node, constants: Constants) -> FxStep | None:
    """(data input, op, constant, data_first) if ``node`` is ``x op constant`` with a constant
    that varies along one axis at most; else None."""
    op = AFFINE_OPS.get(node.target) if node.op == "call_function" else None  # type: ignore[arg-type]
    if op is None or len(node.args) != 2 or any(k != "alpha" for k in node.kwargs):
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    left, right = node.args
    is_data = [isinstance(a, fx.Node) and not constants.is_const(a) for a in (left, right)]
    if is_data.count(True) != 1 or (op == "div" and not is_data[0]):
        return None
    data, other = (left, right) if is_data[0] else (right, left)
    value = torch.as_tensor(constants.value(other))
    dims = shape(data)  # type: ignore[arg-type]
    float_data = (
        isinstance(data.meta.get("val"), torch.Tensor) and data.meta["val"].is_floating_point()
    )  # type: ignore[union-attr]
    if dims is None or not float_data or not is_per_channel(tuple(value.shape), len(dims)):
        return None
    if value.is_complex() or value.dtype == torch.bool:
        return None
    return data, op, value.to(torch.float64), is_data[0]  # type: ignore[return-value]


def affine_runs(nodes: Iterable[fx.Node], constants: Constants) -> list[tuple[fx.Node, ...]]:
    """Maximal runs of affine steps among ``nodes`` (and only those), each step read only by
    the next."""
    among = list(nodes)
    allowed = set(among)
    runs: list[tuple[fx.Node, ...]] = []
    used: set[fx.Node] = set()
    for node in among:
        if node in used or affine_step(node, constants) is None:
            continue
        run = [node]
        while len(users := list(run[-1].users)) == 1 and users[0] in allowed:
            step = affine_step(users[0], constants)
            if step is None or step[0] is not run[-1]:
                break
            run.append(users[0])
        used.update(run)
        runs.append(tuple(run))
    return runs


def run_affine(run: tuple[fx.Node, ...], constants: Constants) -> tuple[Any, ChainAffine] | None:
    """(data input, its affine) of a run that is a norm, else None."""
    steps = [affine_step(node, constants) for node in run]
    if any(step is None for step in steps):
        return None
    chain: list[Step] = [(op, value, first) for _, op, value, first in steps]  # type: ignore[misc]
    data = steps[0][0]  # type: ignore[index]
    found = chain_affine(chain, shape(data) or ())
    return (data, found) if found is not None else None
