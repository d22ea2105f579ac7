"""What a Hugging Face directory records about edge_un in its ``config.json``: the norms (kind,
constructor arguments, swapped modules) and the user's metadata; writing it with the model."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from .._version import __version__
from ..checkpoint import CheckpointError, ConfigMismatchError, MissingConfigError
from ..norms import NORM_CLASSES
from .library import first_line, quiet_progress, require_transformers

CONFIG_KEY = "edge_un"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
KIND_OF_CLASS = {cls: kind for kind, cls in NORM_CLASSES.items()}


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
    with quiet_progress():
        model.save_pretrained(directory, **({"safe_serialization": True} if accepts_flag else {}))
    if not (directory / WEIGHTS_FILE).is_file() and not (directory / WEIGHTS_INDEX_FILE).is_file():
        raise CheckpointError(f"{directory}: save_pretrained wrote no {WEIGHTS_FILE}")
    config_path = directory / CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config[CONFIG_KEY] = record
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise MissingConfigError(f"{directory.name}: no {CONFIG_FILE}; not a Hugging Face model")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MissingConfigError(
            f"{directory.name}: {CONFIG_FILE} is not valid JSON ({first_line(error)})"
        ) from None
    if not isinstance(config, dict):
        raise MissingConfigError(f"{directory.name}: {CONFIG_FILE} is not a JSON object")
    return config


def parse_record(raw: Any, directory: Path) -> dict[str, Any] | None:
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
