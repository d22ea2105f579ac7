"""What the fold rules (:mod:`.fold_rules`) see of a graph: its ops classified into
:class:`Kind`, its offline norms as :class:`Norm`, and the :class:`FoldGraph` interface that
torch.fx (:mod:`.fx_fold_graph`) and ONNX (:mod:`.onnx_fold_graph`) each implement: one
classification of their ops (data, not logic), the weight I/O of their layers, and the edits.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from torch import Tensor


class Kind(Enum):
    """What an op does, as far as a per-channel affine on its data input is concerned."""

    LINEAR = "linear"  # x @ W (+ b); data is input 0
    CONV = "conv"  # channels on axis 1
    LOOKUP = "lookup"  # rows of a table: input 0 is the table
    ADD = "add"  # a sum of two tensors
    SUB = "sub"  # a difference of two tensors
    MUL = "mul"  # a product (or quotient) of two tensors
    IDENTITY = "identity"  # the same values (copies, dropout in eval, casts)
    RESHAPE = "reshape"  # row-major reshape
    TRANSPOSE = "transpose"  # axes: the permutation
    SELECT = "select"  # picks or reorders positions along ``axes`` (slice, gather, roll)
    MEAN = "mean"  # mean over ``axes``
    PAD = "pad"  # constant ``fill`` at new positions along ``axes`` (those padded)
    CONCAT = "concat"  # every input joined along ``axes[0]``
    SHAPE = "shape"  # reads the shape only, which a per-channel affine never changes
    OTHER = "other"


@dataclass(frozen=True)
class Op:
    """One node of the graph, classified: ``inputs[0]`` is its data input (a CONCAT's inputs
    are all data)."""

    kind: Kind
    inputs: tuple[Any, ...]
    output: Any
    axes: tuple[int, ...] = ()
    fill: float | None = None  # PAD: the value written at new positions (None: not a constant)


@dataclass(frozen=True)
class Norm:
    """One offline norm, reduced to ``output = input * scale + shift`` (float64, ``(C,)``), the
    channels on ``axis`` of input and output alike (counted from the end: -1, the last, for
    every norm written channels-last; -3 for the UN authors' ``(B, C, N, 1)`` layout)."""

    name: str
    kind: str
    nodes: tuple[Any, ...]
    input: Any
    output: Any
    scale: Tensor
    shift: Tensor
    axis: int = -1


@dataclass(frozen=True)
class Term:
    """One term of a summed embedding: input ``index`` of ``node`` holds the values to scale
    (a lookup's table, or a constant added in)."""

    node: Any
    index: int
    is_lookup: bool


class FoldGraph(Protocol):
    """What the rules need of a graph. Values are what flows along edges (an fx node, an ONNX
    value), nodes what computes them; weights cross in torch's ``(out, in, ...)`` layout."""

    def norm_sites(self) -> list[Hashable]: ...  # one per norm call, described when its turn comes
    def describe_norm(self, site: Hashable) -> Norm | None: ...
    def op(self, node: Any) -> Op: ...
    def readers(self, value: Any) -> list[Any]: ...
    def producer(self, value: Any) -> Any | None: ...  # None for a graph input
    def is_output(self, value: Any) -> bool: ...
    def is_constant(self, value: Any) -> bool: ...
    def shape(self, value: Any) -> tuple[Any, ...] | None: ...
    def name(self, value: Any) -> str: ...
    def describe(self, node: Any) -> str: ...  # a node in a message
    def layer_name(self, node: Any) -> str: ...  # a layer or lookup in the report
    def term_name(self, term: Term) -> str: ...  # "" when the file does not say
    def layer_problem(self, node: Any) -> str: ...  # "" if its weights (table) are its own
    def weights(self, layer: Any) -> tuple[Tensor, Tensor | None]: ...
    def set_weights(self, layer: Any, weight: Tensor, bias: Tensor) -> None: ...
    def term_values(self, term: Term) -> Tensor: ...
    def set_term_values(self, term: Term, values: Tensor) -> None: ...
    def bypass(self, norm: Norm) -> None: ...  # its readers read its input; its nodes go
    def keep_as_scale_shift(self, norm: Norm) -> None: ...
    # value's readers read the replacement (same values); the nodes nothing reads any more go
    def reroute(self, value: Any, replacement: Any) -> None: ...
