"""Build a norm layer by its short name."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import InputError
from .base import OfflineNorm
from .batch import BatchNorm, RegularizedBN
from .layer import LayerNorm
from .mabn import MABN
from .online import OnlineNorm
from .power import PowerNormStar
from .unified import UnifiedNorm

NORM_CLASSES: dict[str, type[nn.Module]] = {
    "ln": LayerNorm,
    "bn": BatchNorm,
    "mabn": MABN,
    "pn": PowerNormStar,
    "rbn": RegularizedBN,
    "un": UnifiedNorm,
    "on": OnlineNorm,
}
NORM_KINDS: tuple[str, ...] = tuple(NORM_CLASSES)
OFFLINE_KINDS: tuple[str, ...] = tuple(
    kind for kind, cls in NORM_CLASSES.items() if issubclass(cls, OfflineNorm)
)


def make_norm(kind: str, num_features: int, **kwargs: Any) -> nn.Module:
    """A norm over the last dimension: ``"ln"`` (LayerNorm, online) or an offline kind
    (``"bn"``, ``"mabn"``, ``"pn"``, ``"rbn"``, ``"un"``, ``"on"``). kwargs go to its
    constructor."""
    try:
        cls = NORM_CLASSES[kind]
    except KeyError:
        raise InputError(
            f"unknown norm kind {kind!r}; expected one of {', '.join(NORM_KINDS)}"
        ) from None
    return cls(num_features, **kwargs)
