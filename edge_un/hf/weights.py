"""The safetensors files of a Hugging Face directory: which tensors they hold (read from the
headers only), in which layout ``save_pretrained`` names them, and whether they fit a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from ..checkpoint import NotACheckpointError, TensorMismatchError, UnsafeCheckpointError
from .library import first_line
from .record import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE

PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class Weights:
    """Stored tensor names and shapes (read from the headers only), and a way to read one."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # tensor name -> the safe_open handle of the file holding it
        self.shapes = {
            name: tuple(handle.get_slice(name).get_shape()) for name, handle in handles.items()
        }

    def read(self, name: str) -> Tensor:
        return self.handles[name].get_tensor(name)


def open_weights(directory: Path) -> Weights:
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = _shard_files(index, directory)
    else:
        pickles = [name for name in PICKLE_FILES if (directory / name).is_file()]
        if pickles:
            raise UnsafeCheckpointError(
                f"{directory.name}: only {pickles[0]} (a pickle, which can run code; never "
                f"loaded here) and no {WEIGHTS_FILE}; re-save it as safetensors in an environment "
                "that trusts the file: model.save_pretrained(dir, safe_serialization=True)"
            )
        raise NotACheckpointError(f"{directory.name}: no {WEIGHTS_FILE}")
    handles: dict[str, Any] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as error:
            raise NotACheckpointError(
                f"{directory.name}: {file.name} is not safetensors or is truncated "
                f"({first_line(error)})"
            ) from None
        for name in names:
            if name in handles:
                raise TensorMismatchError(f"{directory.name}: tensor {name!r} stored twice")
            handles[name] = handle
    return Weights(handles)


def _shard_files(index: Path, directory: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise NotACheckpointError(f"{directory.name}: {index.name} is malformed") from None
    # Shard names come from the file: only plain names inside the directory, never a path.
    bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n.startswith(".")]
    if bad or not names:
        raise NotACheckpointError(f"{directory.name}: {index.name} names invalid shard files")
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise NotACheckpointError(f"{directory.name}: shard file(s) missing: {', '.join(missing)}")
    return [directory / n for n in names]


def saved_layout(model: nn.Module) -> list[dict[str, str]]:
    """How save_pretrained names the model's tensors: {name in the file: state_dict key}.

    transformers may rename tensors on saving (its "original format", e.g. ViT's q_proj is
    written as attention.query) and drops tied aliases. Two layouts are accepted: that one
    (save_pretrained's default) and the state_dict's own names (save_original_format=False).
    """
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # another transformers version: only the model's own names
        return [{key: key for key in state}]
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    own = {key: key for key in kept}
    key_of = {id(tensor): key for key, tensor in kept.items()}
    try:
        reverted = revert_weight_conversion(model, dict(kept))
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError):
        # a conversion that needs real values (not meta tensors): only the model's own names
        return [own]
    # Renaming keeps the tensor objects; a conversion that builds new ones cannot be mapped.
    original = {name: key_of.get(id(tensor)) for name, tensor in reverted.items()}
    if None in original.values() or len(set(original.values())) != len(original):
        return [own]
    return [original, own] if original != own else [own]


def check_shapes(
    expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], directory: Path
) -> None:
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise TensorMismatchError(
            f"{directory.name}: tensor(s) missing from {WEIGHTS_FILE}: {', '.join(missing[:5])}"
        )
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise TensorMismatchError(
            f"{directory.name}: unexpected tensor(s) in {WEIGHTS_FILE}: {', '.join(unexpected[:5])}"
        )
    for name, shape in expected.items():
        if stored[name] != shape:
            raise TensorMismatchError(
                f"{directory.name}: tensor {name!r} has shape {list(stored[name])} in the file "
                f"but the model built from {CONFIG_FILE} expects {list(shape)}"
            )
