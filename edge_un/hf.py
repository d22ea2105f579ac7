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

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

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
)
from .norms import NORM_CLASSES, make_norm
from .swap import _disable_fused_encoder_fast_path

CONFIG_KEY = "edge_un"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
INSTALL_HINT = "pip install edge-un[hf]"
KIND_OF_CLASS = {cls: kind for kind, cls in NORM_CLASSES.items()}


class TransformersUnavailableError(CheckpointError, ModuleNotFoundError):
    """``transformers`` is not installed; the message names the pip command."""


def require_transformers() -> ModuleType:
    """The ``transformers`` module, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise TransformersUnavailableError(
            f"Hugging Face models need transformers; run: {INSTALL_HINT}"
        ) from None
    return transformers


def is_pretrained_model(model: object) -> bool:
    """A ``transformers`` model (saved as a directory), told apart without importing
    transformers: if nothing imported it, no object can be one of its models."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return isinstance(base, type) and isinstance(model, base)


# -- what a model's edge_un norms are -------------------------------------------------------


def norm_record(model: nn.Module) -> dict[str, Any] | None:
    """The edge_un norms in ``model``: kind, constructor kwargs shared by all, swapped module
    paths, and per-module kwargs where they differ (None: no edge_un norm, a plain model)."""
    norms = {name: m for name, m in model.named_modules() if type(m) in KIND_OF_CLASS}
    if not norms:
        return None
    kinds = sorted({KIND_OF_CLASS[type(m)] for m in norms.values()})
    if len(kinds) > 1:
        raise CheckpointError(
            f"the model mixes edge_un norm kinds ({', '.join(kinds)}); a Hugging Face "
            "directory records one kind: swap all LayerNorms with the same kind"
        )
    per_module = {name: _constructor_kwargs(m) for name, m in norms.items()}
    first = next(iter(per_module.values()))
    shared = {k: v for k, v in first.items() if all(kw.get(k) == v for kw in per_module.values())}
    differing = {
        name: {k: v for k, v in kwargs.items() if k not in shared}
        for name, kwargs in per_module.items()
    }
    return {
        "kind": kinds[0],
        "kwargs": shared,
        "modules": list(norms),
        "module_kwargs": {name: kw for name, kw in differing.items() if kw},
    }


def _constructor_kwargs(norm: nn.Module) -> dict[str, Any]:
    """Constructor arguments read back from the layer (each norm stores them as attributes;
    the current values count, e.g. a warm-up rescaled by a fine-tune)."""
    if isinstance(norm, nn.LayerNorm):
        return {
            "eps": norm.eps,
            "elementwise_affine": norm.elementwise_affine,
            "bias": norm.bias is not None,
        }
    kwargs = {}
    for name in inspect.signature(type(norm)).parameters:
        value = getattr(norm, name, None)
        if name != "num_features" and isinstance(value, (bool, int, float, str)):
            kwargs[name] = value
    return kwargs


# -- saving ----------------------------------------------------------------------------------


def save_pretrained(
    model: nn.Module, directory: str | Path, *, metadata: Mapping[str, Any] | None = None
) -> Path:
    """Write a ``transformers`` model (edge_un norms or plain LayerNorm) to ``directory`` as
    ``config.json`` + ``model.safetensors``, with the edge_un record in ``config.json``."""
    transformers = require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise CheckpointError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; save edge_un's own "
            "models with edge_un.save_checkpoint"
        )
    directory = Path(directory)
    record = {
        "format": FORMAT_VERSION,
        "edge_un_version": __version__,
        "norm": norm_record(model),
        "metadata": dict(metadata or {}),
    }
    try:
        json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"metadata must be plain JSON without NaN/Inf ({error})") from None
    # transformers >= 5 always writes safetensors and no longer takes the argument.
    accepts_flag = "safe_serialization" in inspect.signature(model.save_pretrained).parameters
    with _quiet_progress():
        model.save_pretrained(directory, **({"safe_serialization": True} if accepts_flag else {}))
    if not (directory / WEIGHTS_FILE).is_file() and not (directory / WEIGHTS_INDEX_FILE).is_file():
        raise CheckpointError(f"{directory}: save_pretrained wrote no {WEIGHTS_FILE}")
    config_path = directory / CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config[CONFIG_KEY] = record
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


# -- loading ---------------------------------------------------------------------------------


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
    config_dict = _read_config_json(directory)
    store = _open_weights(directory)
    transformers = require_transformers()
    record = _parse_record(config_dict.get(CONFIG_KEY), directory)
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


def _read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise MissingConfigError(f"{directory.name}: no {CONFIG_FILE}; not a Hugging Face model")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MissingConfigError(
            f"{directory.name}: {CONFIG_FILE} is not valid JSON ({_first_line(error)})"
        ) from None
    if not isinstance(config, dict):
        raise MissingConfigError(f"{directory.name}: {CONFIG_FILE} is not a JSON object")
    return config


def _parse_record(raw: Any, directory: Path) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("metadata", {}), Mapping):
        raise ConfigMismatchError(f"{directory.name}: {CONFIG_FILE} '{CONFIG_KEY}' is malformed")
    norm = raw.get("norm")
    if norm is None:
        return dict(raw)
    ok = (
        isinstance(norm, Mapping)
        and norm.get("kind") in NORM_CLASSES
        and isinstance(norm.get("kwargs", {}), Mapping)
        and isinstance(norm.get("modules"), list)
        and all(isinstance(m, str) for m in norm["modules"])
        and isinstance(norm.get("module_kwargs", {}), Mapping)
    )
    if not ok:
        raise ConfigMismatchError(
            f"{directory.name}: {CONFIG_FILE} '{CONFIG_KEY}.norm' must name a kind among "
            f"{', '.join(NORM_CLASSES)}, its kwargs and the swapped modules"
        )
    return dict(raw)


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
            f"{directory.name}: transformers cannot read {CONFIG_FILE} ({_first_line(error)})"
        ) from None


# -- weights files ---------------------------------------------------------------------------


class _Weights:
    """Stored tensor names and shapes (read from the headers only), and a way to read one."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # tensor name -> the safe_open handle of the file holding it
        self.shapes = {
            name: tuple(handle.get_slice(name).get_shape()) for name, handle in handles.items()
        }

    def read(self, name: str) -> Tensor:
        return self.handles[name].get_tensor(name)


def _open_weights(directory: Path) -> _Weights:
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
                f"({_first_line(error)})"
            ) from None
        for name in names:
            if name in handles:
                raise TensorMismatchError(f"{directory.name}: tensor {name!r} stored twice")
            handles[name] = handle
    return _Weights(handles)


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


# -- building and loading --------------------------------------------------------------------


def _build_swapped(cls: type, config: Any, norm: Mapping[str, Any], directory: Path) -> nn.Module:
    """The model as its config builds it, with the recorded LayerNorms replaced."""
    try:
        model = cls(config)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as error:
        raise ConfigMismatchError(
            f"{directory.name}: {CONFIG_FILE} does not build a {cls.__name__} "
            f"({_first_line(error)})"
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
                f"arguments ({_first_line(error)})"
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


def _saved_layout(model: nn.Module) -> list[dict[str, str]]:
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


def _load_swapped(
    cls: type, config: Any, norm: Mapping[str, Any], store: _Weights, directory: Path
) -> nn.Module:
    # First on the meta device: a config that disagrees with the file is refused before any
    # memory is allocated for it.
    with torch.device("meta"):
        skeleton = _build_swapped(cls, config, norm, directory)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    layouts = _saved_layout(skeleton)
    layout = next((lay for lay in layouts if set(lay) == set(store.shapes)), layouts[0])
    _check_shapes({name: expected[key] for name, key in layout.items()}, store.shapes, directory)

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


def _check_shapes(
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


def _load_plain(cls: Any, directory: Path) -> nn.Module:
    """A model without edge_un norms, through transformers' own loader (safetensors only)."""
    try:
        with _quiet_progress():
            model, loading = cls.from_pretrained(
                str(directory), local_files_only=True, use_safetensors=True,
                output_loading_info=True,
            )  # fmt: skip
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, SafetensorError) as error:
        raise TensorMismatchError(
            f"{directory.name}: transformers cannot load it ({_first_line(error)})"
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


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No "Loading weights" / "Writing model shards" progress bars from transformers: reading or
    writing a file is not a task the user follows (and a command's error must stay its one line
    on stderr)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- running a classifier on edge_un's preprocessed inputs -----------------------------------


def pad_token_id(model: nn.Module) -> int:
    """The padding id of a text model (0, edge_un's own, when its config names none)."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def named_inputs(model: nn.Module, inputs: Tensor) -> dict[str, Tensor]:
    """edge_un's preprocessed input as the keyword inputs of a ``transformers`` model.

    ``edge_un.data`` gives images as float (N, 1, H, W) and text as token ids (N, L): they
    become ``pixel_values``, or ``input_ids`` with ``attention_mask`` 1 at real tokens and 0 at
    the model's ``pad_token_id`` (how the bundled hf-* examples were trained).
    """
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        return {"input_ids": inputs, "attention_mask": (inputs != pad_token_id(model)).long()}
    return {name: inputs}


EXAMPLE_SEQUENCE = 128  # tokens of a traced text model whose directory records no data set


def example_inputs(model: nn.Module, batch: int = 2) -> dict[str, Tensor]:
    """Keyword inputs shaped as the model's config says, to trace a model whose directory
    records no data set: images of ``image_size``, or ``EXAMPLE_SEQUENCE`` token ids (fewer if
    its positions end sooner) with their mask. Batch 2: a traced batch of 1 would be fixed."""
    config = model.config
    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return {name: torch.randn(batch, config.num_channels, height, width)}
    if name == "input_ids":
        positions = getattr(config, "max_position_embeddings", None) or EXAMPLE_SEQUENCE
        ids = torch.randint(1, config.vocab_size, (batch, min(positions, EXAMPLE_SEQUENCE)))
        return named_inputs(model, ids)
    raise CheckpointError(
        f"{type(model).__name__} takes {name!r}: only image and text classifiers are known; "
        "export it yourself (torch.export or torch.onnx.export) and convert that file"
    )


class ClassifierLogits(nn.Module):
    """A ``transformers`` classifier as a function of edge_un model input, returning logits.

    The input goes in as :func:`named_inputs` makes it. transformers returns an output
    dataclass; training, evaluation and export want the logits tensor.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.input_name = getattr(model, "main_input_name", "input_ids")
        self.pad_id = pad_token_id(model)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(**named_inputs(self.model, inputs)).logits
