"""Normalization layers: LayerNorm (online baseline) and the offline norms."""

from .base import OfflineNorm
from .batch import BatchNorm, RegularizedBN, regularization_loss
from .factory import NORM_CLASSES, NORM_KINDS, OFFLINE_KINDS, make_norm
from .layer import LayerNorm
from .mabn import MABN
from .online import OnlineNorm
from .power import PowerNormStar
from .unified import UnifiedNorm

__all__ = [
    "MABN",
    "NORM_CLASSES",
    "NORM_KINDS",
    "OFFLINE_KINDS",
    "BatchNorm",
    "LayerNorm",
    "OfflineNorm",
    "OnlineNorm",
    "PowerNormStar",
    "RegularizedBN",
    "UnifiedNorm",
    "make_norm",
    "regularization_loss",
]
