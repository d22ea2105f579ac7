"""Rebuilding a ``transformers`` model from its directory, running nothing from it: a model with
edge_un norms from its config, swapped as recorded and loaded strictly from safetensors; a plain
LayerNorm model through transformers' own loader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from ..checkpoint import (
    CheckpointInfo,
    ConfigMismatchError,
    NonFiniteTensorError,
    NotACheckpointError,
    TensorMismatchError,
    UnknownArchitectureError,
)
from ..norms import make_norm
from ..swap import _disable_fused_encoder_fast_path
from .library import first_line, quiet_progress, require_transformers
from .record import (
    CONFIG_FILE,
    CONFIG_KEY,
    KIND_OF_CLASS,
    WEIGHTS_FILE,
    parse_record,
    read_config_json,
)
from .weights import Weights, check_shapes, open_weights, saved_layout


def load_pretrained(directory: str | Path) -> tuple[nn.Module, CheckpointInfo]:
    """Rebuild a ``transformers`` model in eval mode from ``directory``, running nothing from it.

    With an ``"edge_un"`` record in ``config.json``: the model is built from its config, its
    LayerNorms swapped as recorded, and ``model.safetensors`` loaded strictly (every tensor
    present, none extra, shapes equal, all finite). Without one: ``from_pretrained`` of the class
    named in ``architectures``. Every failure is a :class:`CheckpointError` with one line.
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file" if directory.is_file() else "does not exist"
        raise NotACheckpointError(
            f"{directory} {what}; a Hugging Face model is a directory with {CONFIG_FILE} and "
            f"{WEIGHTS_FILE}"
        )
    config_dict = read_config_json(directory)
    store = open_weights(directory)
    transformers = require_transformers()
    record = parse_record(config_dict.get(CONFIG_KEY), directory)
    cls = _architecture_class(transformers, config_dict, directory)
    config = _load_config(transformers, directory)
    if not isinstance(config, cls.config_class):
        raise ConfigMismatchError(
            f"{directory.name}: {cls.__name__} needs a {cls.config_class.__name__}, but "
            f"{CONFIG_FILE} describes model_type {config_dict.get('model_type')!r}"
        )
    norm = record.get("norm") if record else None
    if norm:
        model = _load_swapped(cls, config, norm, store, directory)
    else:
        model = _load_plain(cls, directory)
    info = CheckpointInfo(
        path=directory,
        architecture=cls.__name__,
        arguments={
            "norm": norm["kind"] if norm else "ln",
            "norm_kwargs": dict(norm["kwargs"]) if norm else {},
            "norm_modules": list(norm["modules"]) if norm else [],
            "model_type": config_dict.get("model_type"),
        },
        edge_un_version=str(record.get("edge_un_version", "unknown")) if record else "unknown",
        metadata=dict(record.get("metadata") or {}) if record else {},
    )
    return model.eval(), info


def _architecture_class(
    transformers: ModuleType, config: Mapping[str, Any], directory: Path
) -> type:
    """The class named in ``architectures``, only if transformers itself defines it."""
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise UnknownArchitectureError(
            f"{directory.name}: {CONFIG_FILE} must name exactly one class in 'architectures'"
        )
    name = names[0]
    try:
        cls = getattr(transformers, name, None) if name.isidentifier() else None
    except (ImportError, RuntimeError):  # a lazily imported class whose backend is missing
        cls = None
    is_model = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
    if not is_model or not cls.__module__.startswith("transformers."):
        raise UnknownArchitectureError(
            f"{directory.name}: {name!r} is not a model class of transformers "
            f"{transformers.__version__} (remote code is never run)"
        )
    return cls


def _load_config(transformers: ModuleType, directory: Path) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigMismatchError(
            f"{directory.name}: transformers cannot read {CONFIG_FILE} ({first_line(error)})"
        ) from None


def _build_swapped(cls: type, config: Any, norm: Mapping[str, Any], directory: Path) -> nn.Module:
    """The model as its config builds it, with the recorded LayerNorms replaced."""
    try:
        model = cls(config)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as error:
        raise ConfigMismatchError(
            f"{directory.name}: {CONFIG_FILE} does not build a {cls.__name__} ({first_line(error)})"
        ) from None
    module_kwargs = norm.get("module_kwargs", {})
    for path in norm["modules"]:
        channels = _channels(_submodule(model, path))
        if channels is None:
            raise ConfigMismatchError(
                f"{directory.name}: {CONFIG_FILE} records an edge_un norm at {path!r}, but "
                f"{cls.__name__} has no LayerNorm over one dimension there"
            )
        kwargs = {**norm.get("kwargs", {}), **module_kwargs.get(path, {})}
        try:
            replacement = make_norm(norm["kind"], channels, **kwargs)
        except (TypeError, ValueError) as error:
            raise ConfigMismatchError(
                f"{directory.name}: norm {norm['kind']!r} at {path!r} rejects its recorded "
                f"arguments ({first_line(error)})"
            ) from None
        parent_name, _, child_name = path.rpartition(".")
        setattr(_submodule(model, parent_name) if parent_name else model, child_name, replacement)
    _disable_fused_encoder_fast_path(model)
    return model


def _channels(module: nn.Module | None) -> int | None:
    """Channels of the norm to put in place of ``module``: a LayerNorm over one dimension, or a
    norm edge_un already built there (a model whose own code uses edge_un norms)."""
    if isinstance(module, nn.LayerNorm):
        return module.normalized_shape[0] if len(module.normalized_shape) == 1 else None
    if type(module) in KIND_OF_CLASS:
        return int(module.num_features)
    return None


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _load_swapped(
    cls: type, config: Any, norm: Mapping[str, Any], store: Weights, directory: Path
) -> nn.Module:
    # First on the meta device: a config that disagrees with the file is refused before any
    # memory is allocated for it.
    with torch.device("meta"):
        skeleton = _build_swapped(cls, config, norm, directory)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    layouts = saved_layout(skeleton)
    layout = next((lay for lay in layouts if set(lay) == set(store.shapes)), layouts[0])
    check_shapes({name: expected[key] for name, key in layout.items()}, store.shapes, directory)

    model = _build_swapped(cls, config, norm, directory)
    dtype = _config_dtype(config)
    if dtype is not None:
        model.to(dtype)  # norm statistics stay float32 (OfflineNorm keeps them)
    state = {}
    for name, key in layout.items():
        tensor = store.read(name)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise NonFiniteTensorError(f"{directory.name}: tensor {name!r} contains NaN or Inf")
        state[key] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Keys left out are tied aliases: they share storage with a loaded tensor.
    tied = set(model.state_dict()) - set(layout.values())
    if unexpected or set(missing) - tied:
        raise TensorMismatchError(
            f"{directory.name}: tensors do not fit the model "
            f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    return model


def _config_dtype(config: Any) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != torch.float32:
        return dtype
    return None


def _load_plain(cls: Any, directory: Path) -> nn.Module:
    """A model without edge_un norms, through transformers' own loader (safetensors only)."""
    try:
        with quiet_progress():
            model, loading = cls.from_pretrained(
                str(directory), local_files_only=True, use_safetensors=True,
                output_loading_info=True,
            )  # fmt: skip
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, SafetensorError) as error:
        raise TensorMismatchError(
            f"{directory.name}: transformers cannot load it ({first_line(error)})"
        ) from None
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        problems = sorted(str(item) for item in loading.get(what) or ())
        if problems:
            label = what.replace("_keys", "").replace("mismatched", "misshapen")
            raise TensorMismatchError(
                f"{directory.name}: {label} tensor(s) in {WEIGHTS_FILE}: {', '.join(problems[:5])}"
            )
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise NonFiniteTensorError(f"{directory.name}: tensor {name!r} contains NaN or Inf")
    return model
