"""edge_un: Unified Normalization and its offline peers, for Transformers that fold to int8."""

from ._version import __version__
from .checkpoint import (
    CheckpointError,
    CheckpointInfo,
    ConfigMismatchError,
    MissingConfigError,
    NonFiniteTensorError,
    NotACheckpointError,
    TensorMismatchError,
    UnknownArchitectureError,
    UnsafeCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from .norms import (
    MABN,
    NORM_KINDS,
    OFFLINE_KINDS,
    BatchNorm,
    LayerNorm,
    OfflineNorm,
    PowerNormStar,
    RegularizedBN,
    UnifiedNorm,
    make_norm,
    regularization_loss,
)
from .swap import NormSwapError, swap_layernorm

__all__ = [
    "MABN",
    "NORM_KINDS",
    "OFFLINE_KINDS",
    "BatchNorm",
    "CheckpointError",
    "CheckpointInfo",
    "ConfigMismatchError",
    "LayerNorm",
    "MissingConfigError",
    "NonFiniteTensorError",
    "NormSwapError",
    "NotACheckpointError",
    "OfflineNorm",
    "PowerNormStar",
    "RegularizedBN",
    "TensorMismatchError",
    "UnifiedNorm",
    "UnknownArchitectureError",
    "UnsafeCheckpointError",
    "__version__",
    "load_checkpoint",
    "make_norm",
    "regularization_loss",
    "save_checkpoint",
    "swap_layernorm",
]
