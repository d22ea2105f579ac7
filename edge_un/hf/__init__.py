"""Hugging Face ``transformers`` models with edge_un norms, as directories users already share.

A model whose LayerNorms were replaced with :func:`edge_un.swap_layernorm` is saved with its own
``save_pretrained`` (``config.json`` + ``model.safetensors``, which holds the norms' buffers too);
``config.json`` then records under ``"edge_un"`` what rebuilding needs: the norm kind, its
constructor arguments, which modules were swapped, and your metadata (data set, split,
preprocessing, accuracy: the keys edge_un checkpoints carry, so :mod:`edge_un.data` helpers work).

Loading never runs code from the directory: no ``trust_remote_code``, no pickle (a directory with
only ``pytorch_model.bin`` is refused), no network (``local_files_only=True``). A model with edge_un
norms is rebuilt from its config, swapped, and loaded strictly from safetensors; a plain LayerNorm
model goes through ``from_pretrained``. ``transformers`` is imported inside the functions only, so
``import edge_un`` never needs it.
"""

from .inputs import (
    EXAMPLE_SEQUENCE,
    ClassifierLogits,
    call_with_names,
    example_inputs,
    max_sequence_length,
    named_inputs,
    pad_token_id,
)
from .library import (
    INSTALL_HINT,
    TransformersUnavailableError,
    is_pretrained_model,
    require_transformers,
)
from .load import load_pretrained
from .record import (
    CONFIG_FILE,
    CONFIG_KEY,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    norm_record,
    save_pretrained,
)

__all__ = [
    "CONFIG_FILE",
    "CONFIG_KEY",
    "EXAMPLE_SEQUENCE",
    "FORMAT_VERSION",
    "INSTALL_HINT",
    "WEIGHTS_FILE",
    "ClassifierLogits",
    "TransformersUnavailableError",
    "call_with_names",
    "example_inputs",
    "is_pretrained_model",
    "load_pretrained",
    "max_sequence_length",
    "named_inputs",
    "norm_record",
    "pad_token_id",
    "require_transformers",
    "save_pretrained",
]
