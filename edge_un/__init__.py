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
from .errors import InputError
from .finetune import FinetuneRecipe, make_int8_ready, migrate, recalibrate

# Hugging Face models: edge_un.hf imports transformers inside its functions only, so this import
# works without it (pip install edge-un[hf] adds it).
from .hf import load_pretrained, save_pretrained
from .norms import (
    MABN,
    NORM_KINDS,
    OFFLINE_KINDS,
    BatchNorm,
    LayerNorm,
    OfflineNorm,
    OnlineNorm,
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
    "FinetuneRecipe",
    "InputError",
    "LayerNorm",
    "MissingConfigError",
    "NonFiniteTensorError",
    "NormSwapError",
    "NotACheckpointError",
    "OfflineNorm",
    "OnlineNorm",
    "PowerNormStar",
    "RegularizedBN",
    "TensorMismatchError",
    "UnifiedNorm",
    "UnknownArchitectureError",
    "UnsafeCheckpointError",
    "__version__",
    "load_checkpoint",
    "load_pretrained",
    "make_int8_ready",
    "make_norm",
    "migrate",
    "recalibrate",
    "regularization_loss",
    "save_checkpoint",
    "save_pretrained",
    "swap_layernorm",
]
