"""The UN authors' ``UN1d`` state, read as :class:`~.unified.UnifiedNorm`'s.

The paper's released layer keeps the same algorithm's state under other names and shapes:
``weight``, ``bias``, ``running_var`` and ``ema_gz`` as ``(1, C, 1, 1)`` (it computes on
``(B, C, N, 1)``), the step counter ``iters``, the ring buffers ``buffer_x2`` and ``buffer_gz``
(one row per window slot) and ``skip_counter`` (steps the outlier filter fired). Each maps onto
one of UnifiedNorm's (``shared/docs/unified-norm.md``, State): the affine and ``running_var``
flattened to ``(C,)`` (there is no running mean: UN subtracts none), ``ema_gz`` -> ``ema_g``,
``iters`` -> ``num_steps``, ``buffer_x2`` -> ``window_x2``, ``buffer_gz`` -> ``window_g``,
``skip_counter`` -> ``num_filtered``, so a model trained with the authors' code goes on
training as ours, warm-up and window where they were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor

# Authors' name -> ours, and what ours is shaped as: "C" (C,), "MC" (window, C), "()" a count.
AUTHORS_UN1D = {
    "weight": ("weight", "C"),
    "bias": ("bias", "C"),
    "running_var": ("running_var", "C"),
    "ema_gz": ("ema_g", "C"),
    "iters": ("num_steps", "()"),
    "buffer_x2": ("window_x2", "MC"),
    "buffer_gz": ("window_g", "MC"),
    "skip_counter": ("num_filtered", "()"),
}
# Names only the authors' layer has: a prefix holding all of them (and the rest) is a UN1d.
MARKERS = ("ema_gz", "iters", "buffer_x2", "buffer_gz", "skip_counter")


def authors_prefixes(names: Mapping[str, object] | set[str]) -> list[str]:
    """The prefixes (``"blocks.0.norm1."``) under which a state dict holds an authors' UN1d."""
    prefixes = {name[: -len("ema_gz")] for name in names if name.endswith("ema_gz")}
    found = [p for p in prefixes if all(f"{p}{key}" in names for key in AUTHORS_UN1D)]
    return sorted(found, key=len, reverse=True)  # the innermost first: "a.b." before "a."


def renamed(name: str, prefixes: list[str]) -> str:
    """A state-dict name as UnifiedNorm calls it (unchanged outside an authors' UN1d)."""
    for prefix in prefixes:
        key = name[len(prefix) :] if name.startswith(prefix) else None
        if key in AUTHORS_UN1D:
            return prefix + AUTHORS_UN1D[key][0]
    return name


def reshaped(
    name: str, tensor: Tensor, prefixes: list[str], shapes: Mapping[str, tuple[int, ...]]
) -> Tensor:
    """An authors' UN1d tensor in UnifiedNorm's shape; any other tensor as it is. ``shapes``:
    the stored shapes (the layer's channels are its weight's size)."""
    for prefix in prefixes:
        key = name[len(prefix) :] if name.startswith(prefix) else None
        if key in AUTHORS_UN1D:
            layout = AUTHORS_UN1D[key][1]
            if layout == "()":
                return tensor.reshape(())
            if layout == "C":
                return tensor.reshape(-1)
            return tensor.reshape(-1, channels_of(prefix, shapes))
    return tensor


def channels_of(prefix: str, shapes: Mapping[str, tuple[int, ...]]) -> int:
    return math.prod(shapes[f"{prefix}weight"])

