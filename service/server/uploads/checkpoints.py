"""Checkpoints of edge_un models: .safetensors, or a torch state dict with a config. The
config's implied size is checked before anything is built; the checkpoint is then read with
edge_un's own safe loader, and every problem it names becomes an UploadRejected."""

from __future__ import annotations

import inspect as pyinspect  # the standard library's (absolute import)
import json
import math
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from quant.errors import one_line

from ...errors import UploadRejected
from ...settings import DEFAULT_MAX_PARAMETERS
from . import sniff
from .model_upload import MIGRATE_ADVICE, ModelUpload, check_size, reject


def implied_parameters(config: Mapping[str, Any]) -> int | None:
    """The weights (Linear, Conv, embeddings; a lower bound) that ``config`` asks to build, from
    its numbers alone; None when they are not numbers (the loader then names the problem)."""
    from edge_un.models import ARCHITECTURES

    name = config.get("architecture")
    cls = ARCHITECTURES.get(name) if isinstance(name, str) else None
    arguments = config.get("arguments") or {}
    if cls is None or not isinstance(arguments, Mapping):
        return None
    defaults = {n: p.default for n, p in pyinspect.signature(cls).parameters.items()}
    values = {**defaults, **arguments}
    needed = ["dim", "depth", "mlp_ratio", "num_classes"]
    needed += ["img_size", "patch_size", "in_chans"] if "img_size" in defaults else []
    needed += ["vocab_size", "max_len"] if "vocab_size" in defaults else []
    if not all(type(values.get(k)) in (int, float) for k in needed):
        return None
    if not all(math.isfinite(values[k]) and values[k] >= 0 for k in needed):
        return None  # not sizes: the constructor refuses them
    # Exact arithmetic on Python's unbounded ints: a forged 1e308 is just a very large count.
    n = {k: Fraction(values[k]) for k in needed}
    dim, hidden = n["dim"], math.floor(n["dim"] * n["mlp_ratio"])
    total = n["depth"] * (4 * dim * dim + 2 * dim * hidden) + dim * n["num_classes"]
    if "img_size" in n:
        patch = max(n["patch_size"], 1)
        total += n["in_chans"] * patch * patch * dim + (n["img_size"] // patch) ** 2 * dim
    if "vocab_size" in n:
        total += (n["vocab_size"] + n["max_len"]) * dim
    return math.floor(total)


def check_checkpoint(
    path: Path,
    fmt: Literal["safetensors", "pt"],
    raw: Any,
    config: dict | None,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> ModelUpload:
    import edge_un
    from converters.graph import ONLINE_NORM_CLASSES

    parsed = _parse_raw_config(raw)
    implied = implied_parameters(parsed) if parsed is not None else None
    if implied is not None:
        check_size(implied, "the config asks for a model of at least", max_parameters)
    try:
        model, info = edge_un.load_checkpoint(path, config=config, format=fmt)
    except edge_un.CheckpointError as error:
        raise _checkpoint_rejection(error, path.name) from None
    except MemoryError:
        raise
    except Exception as error:  # a config's values can break a constructor in many ways
        raise reject(
            "Config does not match the weights",
            f"the config does not build a model ({type(error).__name__}: {one_line(error)})",
        ) from None
    online = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, ONLINE_NORM_CLASSES)
    ]
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the model has {len(online)} online norms "
            f"(kind {info.norm_kind!r}: {', '.join(online[:3])}...), which compute "
            f"statistics at run time and cannot fold; {MIGRATE_ADVICE}",
        )
    parameters = sum(p.numel() for p in model.parameters())
    return ModelUpload(
        fmt, parameters, info.norm_kind or None, architecture_inputs(info.architecture)
    )


def architecture_inputs(architecture: str) -> tuple[str, ...] | None:
    """The forward() argument names of an edge_un architecture (what its export calls its
    inputs), from the class's signature alone: nothing is built."""
    from edge_un.checkpoint import ARCHITECTURES

    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        return None
    parameters = list(pyinspect.signature(cls.forward).parameters.values())[1:]  # not self
    kinds = (pyinspect.Parameter.POSITIONAL_ONLY, pyinspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds) or None


def _parse_raw_config(raw: Any) -> dict | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw, parse_constant=sniff.no_json_constant)
        except (ValueError, RecursionError):
            raise reject(
                "Bad config",
                "the config in the checkpoint's metadata is not valid "
                "JSON (NaN/Infinity are not numbers there either)",
            ) from None
    return raw if isinstance(raw, dict) else None


def _checkpoint_title(error: Exception) -> str:
    """A short title for a checkpoint loader's error, by its class."""
    import edge_un

    titles = (
        (edge_un.NotACheckpointError, "Not a readable checkpoint"),
        (edge_un.UnsafeCheckpointError, "Code-execution payload refused"),
        (edge_un.MissingConfigError, "Missing config"),
        (edge_un.UnknownArchitectureError, "Unknown architecture"),
        (edge_un.ConfigMismatchError, "Config does not match the weights"),
        (edge_un.TensorMismatchError, "Config does not match the weights"),
        (edge_un.NonFiniteTensorError, "Non-finite weights"),
    )
    return next((title for kind, title in titles if isinstance(error, kind)), "Bad checkpoint")


def _checkpoint_rejection(error: Exception, name: str) -> UploadRejected:
    """The loader's one line, without the (server-chosen) file name it starts with."""
    title = _checkpoint_title(error)
    line = one_line(error).removeprefix(f"{name}: ")
    advice = {
        "Config does not match the weights": "; send the config the checkpoint was saved with",
        "Non-finite weights": "; the model diverged in training or the file is damaged",
    }.get(title, "")
    prefix = {
        "Config does not match the weights": "the config does not match the weights: ",
        "Non-finite weights": "the model's ",
    }.get(title, "the model: ")
    return reject(title, f"{prefix}{line}{advice}")
