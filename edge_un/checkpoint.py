"""Checkpoints that are safe to load: one .safetensors file, config as JSON in its metadata.

Loading never executes anything from the file. The model is first built on the meta device, so
a config that disagrees with the stored tensors is refused before any memory is allocated for it.
"""

from __future__ import annotations

import inspect
import json
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from ._version import __version__
from .errors import InputError
from .models import ARCHITECTURES
from .norms.authors import authors_prefixes, renamed, reshaped

METADATA_KEY = "edge_un"
FORMAT_VERSION = 1
PICKLE_SUFFIXES = (".pt", ".pth")
# How a checkpoint's tensors are stored: a safetensors file, or a pickled torch state dict.
CheckpointFormat = Literal["safetensors", "pt"]


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded; the message is one readable line."""


class NotACheckpointError(CheckpointError):
    """Not a safetensors / torch file, or a truncated one."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle that needs code to run to load; refused, the code never runs."""


class MissingConfigError(CheckpointError):
    """No edge_un config in the file and none given."""


class UnknownArchitectureError(CheckpointError):
    """The config names an architecture edge_un does not have."""


class ConfigMismatchError(CheckpointError):
    """The config's arguments disagree with the architecture or with the stored tensors."""


class TensorMismatchError(CheckpointError):
    """A tensor is missing, unexpected, or of the wrong shape."""


class NonFiniteTensorError(CheckpointError):
    """A tensor holds NaN or Inf."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about itself."""

    path: Path
    architecture: str
    arguments: dict[str, Any]
    edge_un_version: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def norm_kind(self) -> str:
        return self.arguments.get("norm", "")

    @property
    def norm_kwargs(self) -> dict[str, Any]:
        return dict(self.arguments.get("norm_kwargs") or {})

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "architecture": self.architecture,
            "arguments": self.arguments,
            "norm": {"kind": self.norm_kind, "kwargs": self.norm_kwargs},
            "edge_un_version": self.edge_un_version,
            "metadata": self.metadata,
        }


def architecture_name(model: nn.Module) -> str:
    for name, cls in ARCHITECTURES.items():
        if type(model) is cls:
            return name
    raise CheckpointError(
        f"{type(model).__name__} is not an edge_un architecture "
        f"({', '.join(ARCHITECTURES)}); save its state_dict and rebuild it in your own code"
    )


def save_checkpoint(
    model: nn.Module, path: str | Path, metadata: Mapping[str, Any] | None = None
) -> Path:
    """Write ``model`` (weights, norm statistics and config) to one ``.safetensors`` file."""
    path = Path(path)
    name = architecture_name(model)
    info = CheckpointInfo(
        path=path,
        architecture=name,
        arguments=dict(model.config),
        edge_un_version=__version__,
        metadata=dict(metadata or {}),
    )
    header = json.dumps(info.to_dict(), sort_keys=True, allow_nan=False)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={METADATA_KEY: header})
    return path


def load_checkpoint(
    path: str | Path,
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    format: CheckpointFormat | None = None,
) -> tuple[nn.Module, CheckpointInfo]:
    """Rebuild a model in eval mode from a checkpoint, executing nothing from the file.

    ``path`` is an edge_un safetensors file, or a torch state dict read with
    ``torch.load(weights_only=True)``: ``format`` says which ("safetensors" or "pt"; default:
    "pt" for a ``.pt``/``.pth`` name, else "safetensors"). ``config`` (a JSON file, or a dict
    as in the checkpoint's metadata) is required for a state dict and overrides the file's own
    config. Every failure raises a :class:`CheckpointError` subclass with a one-line message.
    """
    path = Path(path)
    if not path.is_file():
        raise NotACheckpointError(f"{path}: no such file")
    if format is None:
        format = "pt" if path.suffix in PICKLE_SUFFIXES else "safetensors"
    if format == "pt":
        tensors = _read_torch_state_dict(path)
        header = None
    else:
        tensors, header = _open_safetensors(path)
    raw = _read_config(config) if config is not None else header
    if raw is None:
        raise MissingConfigError(
            f"{path.name}: no edge_un config in the file; pass config= (a JSON file with "
            "'architecture' and 'arguments')"
        )
    info = _parse_config(raw, path)
    tensors = _as_unified_norms(tensors)
    model = _build_on_meta(info, tensors)
    state = _materialize(tensors, path)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), info


# -- reading files ---------------------------------------------------------------------------


class _LazyTensors:
    """Names and shapes of stored tensors, and a way to read one, without reading all."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Any) -> None:
        self.shapes = shapes
        self.read = read


def _as_unified_norms(tensors: _LazyTensors) -> _LazyTensors:
    """The UN authors' ``UN1d`` layers stored in it, read as UnifiedNorm's state
    (:mod:`.norms.authors`); every other tensor as stored."""
    prefixes = authors_prefixes(set(tensors.shapes))
    if not prefixes:
        return tensors
    stored = dict(tensors.shapes)
    names = {renamed(name, prefixes): name for name in stored}

    def shape(name: str) -> tuple[int, ...]:
        meta = torch.empty(stored[name], device="meta")
        return tuple(reshaped(name, meta, prefixes, stored).shape)

    def read(name: str) -> Tensor:
        return reshaped(names[name], tensors.read(names[name]), prefixes, stored)

    return _LazyTensors({new: shape(old) for new, old in names.items()}, read)


def _open_safetensors(path: Path) -> tuple[_LazyTensors, str | None]:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise NotACheckpointError(
            f"{path.name}: not a safetensors checkpoint or truncated ({first_line})"
        ) from None
    return _LazyTensors(shapes, handle.get_tensor), metadata.get(METADATA_KEY)


def _read_torch_state_dict(path: Path) -> _LazyTensors:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # The weights-only unpickler refuses any global outside its allow-list before calling
        # it; garbage bytes fail in the same exception type, so tell the two apart.
        refused = _refused_global(error)
        if refused:
            raise UnsafeCheckpointError(
                f"{path.name}: refused, loading it would run code ({refused})"
            ) from None
        raise NotACheckpointError(f"{path.name}: not a torch state dict or truncated") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise NotACheckpointError(
            f"{path.name}: not a torch state dict or truncated ({first_line})"
        ) from None
    state = _unwrap_state_dict(loaded, path)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    return _LazyTensors(shapes, state.__getitem__)


def _refused_global(error: Exception) -> str | None:
    """The line of torch's message naming the global a pickle wanted to call, if any."""
    for line in str(error).splitlines():
        if "global" in line.lower():
            return line.strip()
    return None


def _unwrap_state_dict(loaded: Any, path: Path) -> dict[str, Tensor]:
    """Accept a plain state dict or the common {"state_dict": ...} / {"model": ...} wrappers."""
    if isinstance(loaded, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
    ):
        raise NotACheckpointError(f"{path.name}: holds no state dict of named tensors")
    return dict(loaded)


def _read_config(config: str | Path | Mapping[str, Any]) -> str | Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    config_path = Path(config)
    try:
        return config_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise MissingConfigError(f"cannot read config {config_path}: {error}") from None


def _parse_config(raw: str | Mapping[str, Any], path: Path) -> CheckpointInfo:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise MissingConfigError(f"{path.name}: config is not valid JSON ({error})") from None
    if not isinstance(raw, Mapping) or "architecture" not in raw:
        raise MissingConfigError(f"{path.name}: config has no 'architecture'")
    name = raw["architecture"]
    if name not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"{path.name}: unknown architecture {name!r}; edge_un has {', '.join(ARCHITECTURES)}"
        )
    arguments = raw.get("arguments", {})
    if not isinstance(arguments, Mapping):
        raise ConfigMismatchError(f"{path.name}: config 'arguments' must be an object")
    return CheckpointInfo(
        path=path,
        architecture=name,
        arguments=dict(arguments),
        edge_un_version=str(raw.get("edge_un_version", "unknown")),
        metadata=dict(raw.get("metadata") or {}),
    )


# -- building and checking -------------------------------------------------------------------


def _build_on_meta(info: CheckpointInfo, tensors: _LazyTensors) -> nn.Module:
    cls = ARCHITECTURES[info.architecture]
    accepted = set(inspect.signature(cls).parameters)
    unknown = sorted(set(info.arguments) - accepted)
    if unknown:
        raise ConfigMismatchError(
            f"{info.path.name}: {info.architecture} takes no argument(s) {', '.join(unknown)}"
        )
    _check_depth(info, tensors)
    try:
        with torch.device("meta"):
            model = cls(**info.arguments)
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigMismatchError(
            f"{info.path.name}: config does not build a model ({error})"
        ) from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _check_shapes(expected, tensors.shapes, info.path)
    return model


def _check_depth(info: CheckpointInfo, tensors: _LazyTensors) -> None:
    # Building cost grows with depth even on the meta device; a forged depth of millions must
    # fail here, against the number of blocks actually stored, not after minutes of building.
    depth = info.arguments.get("depth")
    stored = {name.split(".")[1] for name in tensors.shapes if name.startswith("blocks.")}
    if depth is not None and (not isinstance(depth, int) or depth != len(stored)):
        raise ConfigMismatchError(
            f"{info.path.name}: config says depth={depth!r} but the file stores "
            f"{len(stored)} blocks"
        )


def _check_shapes(
    expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], path: Path
) -> None:
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise TensorMismatchError(f"{path.name}: tensor(s) missing: {', '.join(missing[:5])}")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise TensorMismatchError(f"{path.name}: unexpected tensor(s): {', '.join(unexpected[:5])}")
    for name, shape in expected.items():
        if stored[name] != shape:
            raise TensorMismatchError(
                f"{path.name}: tensor {name!r} has shape {list(stored[name])} in the file but the "
                f"config expects {list(shape)} ({math.prod(shape):,} values)"
            )


def _materialize(tensors: _LazyTensors, path: Path) -> dict[str, Tensor]:
    state = {}
    for name in tensors.shapes:
        tensor = tensors.read(name)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise NonFiniteTensorError(f"{path.name}: tensor {name!r} contains NaN or Inf")
        state[name] = tensor
    return state
