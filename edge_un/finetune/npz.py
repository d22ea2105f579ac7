"""Fine-tuning data from an ``.npz``: one array per model input, named as the model names it.

A Hugging Face model's arrays are named after its forward arguments (``pixel_values``;
``input_ids``, ``attention_mask``, ``token_type_ids``), edge_un's own models' one array is
``inputs`` (a one-input Hugging Face model accepts that name too); ``labels`` are optional, and
``val_`` before any of these names gives the validation split. Every array is checked against
what the model takes before any training starts: a missing, unexpected, misshapen or mistyped
array, or mismatched sample counts, is a :class:`FinetuneDataError` whose one line names the
array and what was expected. The file is read with ``allow_pickle=False``.
"""

from __future__ import annotations

import inspect
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import InputError
from ..hf import is_pretrained_model, max_sequence_length
from ..training.inputs import SINGLE_INPUT, Inputs

LABELS = "labels"
VAL = "val_"  # prefix of the validation split's arrays


class FinetuneDataError(InputError):
    """No usable data for a fine-tune; the message says what to pass."""


@dataclass(frozen=True)
class InputSpec:
    """One model input as its array must hold it: the shape of one sample (``None`` for a
    dimension of any size; no shape: unchecked), integer or float values (``None``: either),
    whether it may be left out, and the bounds the model has."""

    name: str
    shape: tuple[int | None, ...] | None
    integer: bool | None
    required: bool = True
    max_length: int | None = None  # longest last dimension (a text model's positions)
    below: int | None = None  # integer values lie in [0, below) (token ids, a 0/1 mask)
    like: str | None = None  # has the shape of this other input (a mask of input_ids)

    def describe(self) -> str:
        """``pixel_values float (N, 1, 28, 28)``, ``input_ids int (N, L<=48)``."""
        kind = {True: "int", False: "float", None: "numbers"}[self.integer]
        dims = ["N", *(str(d or "L") for d in self.shape)] if self.shape else ["N", "..."]
        if self.max_length is not None:
            dims[-1] += f"<={self.max_length}"
        return f"{self.name} {kind} ({', '.join(dims)})" + ("" if self.required else " (optional)")


@dataclass(frozen=True)
class NpzData:
    """Training inputs and labels, and the validation split's, as tensors by input name."""

    inputs: Inputs
    labels: Tensor | None
    val_inputs: Inputs | None
    val_labels: Tensor | None


# -- what a model takes ----------------------------------------------------------------------


def input_specs(model: nn.Module | None) -> list[InputSpec]:
    """The inputs ``model`` takes: a Hugging Face model's forward arguments, or the one input
    of an edge_un model (shape from its config; no model: one input, unchecked)."""
    if is_pretrained_model(model):
        return _hf_specs(model)
    config = getattr(model, "config", None)
    config = config if isinstance(config, Mapping) else {}
    if "img_size" in config:  # VisionTransformer
        side = int(config["img_size"])
        shape = (int(config.get("in_chans", 1)), side, side)
        return [InputSpec(SINGLE_INPUT, shape, integer=False)]
    if "max_len" in config:  # TextTransformer: token ids
        return [
            InputSpec(SINGLE_INPUT, (None,), integer=True, max_length=int(config["max_len"]),
                      below=config.get("vocab_size"))
        ]  # fmt: skip
    return [InputSpec(SINGLE_INPUT, None, integer=None)]


def _hf_specs(model: nn.Module) -> list[InputSpec]:
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = getattr(config, "image_size", None)
        height, width = (size, size) if isinstance(size, int) else tuple(size or (None, None))
        channels = getattr(config, "num_channels", None)
        return [InputSpec(main, (channels, height, width), integer=False)]
    if main != "input_ids":
        return [InputSpec(main, None, integer=None)]
    accepted = inspect.signature(model.forward).parameters
    vocab = getattr(config, "vocab_size", None)
    specs = [
        InputSpec("input_ids", (None,), integer=True, max_length=max_sequence_length(model),
                  below=vocab)
    ]  # fmt: skip
    # Optional: without a mask every position counts, without token types all are type 0. A
    # model without type_vocab_size that takes token types (GPT-2) embeds them as tokens.
    types = getattr(config, "type_vocab_size", None) or vocab
    bounds = {"attention_mask": 2, "token_type_ids": types}
    specs += [
        InputSpec(name, (None,), integer=True, required=False, below=below, like="input_ids")
        for name, below in bounds.items()
        if name in accepted
    ]
    return specs


def num_classes(model: nn.Module | None) -> int | None:
    """How many classes the model's logits have, as its config says (labels must be below)."""
    config = getattr(model, "config", None)
    if isinstance(config, Mapping):
        return config.get("num_classes")
    return getattr(config, "num_labels", None)


# -- reading and checking --------------------------------------------------------------------


def load_npz(path: Path, model: nn.Module | None) -> NpzData:
    """The arrays of ``path`` checked against what ``model`` takes, as tensors."""
    check = _Checker(path.name, input_specs(model), _read_arrays(path), num_classes(model))
    train = check.split("")
    if train is None:
        raise check.error(f"no {check.specs[0].name!r} array")
    val = check.split(VAL)
    if val is None and VAL + LABELS in check.arrays:
        raise check.error(f"'{VAL}{LABELS}' without '{VAL}{check.specs[0].name}'")
    return NpzData(*train, *(val or (None, None)))


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise FinetuneDataError(f"{path}: a single .npy array, not an .npz archive")
            return {name: archive[name] for name in archive.files}
    except FinetuneDataError:
        raise
    except FileNotFoundError:
        raise FinetuneDataError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise FinetuneDataError(f"{path}: not a readable .npz file ({error})") from None


class _Checker:
    """One archive checked against one model's inputs: each failure is one line that names the
    array and ends with what the model takes."""

    def __init__(
        self, where: str, specs: Sequence[InputSpec], arrays: dict[str, np.ndarray],
        classes: int | None,
    ) -> None:  # fmt: skip
        self.where, self.specs, self.arrays, self.classes = where, specs, arrays, classes
        # A one-input model's array may also be called "inputs" (edge_un's name, the service's).
        self.aliases = {SINGLE_INPUT: specs[0].name} if len(specs) == 1 else {}
        self.assigned = self._assign()

    def error(self, problem: str) -> FinetuneDataError:
        takes = ", ".join([s.describe() for s in self.specs] + [f"{LABELS} int (N,) (optional)"])
        return FinetuneDataError(f"{self.where}: {problem}; expected {takes}; {VAL}* to validate")

    def _assign(self) -> dict[str, dict[str, str]]:
        """Split prefix -> {model input: its array}; an array that is neither an input nor
        labels is unexpected (most likely a misnamed input)."""
        assigned: dict[str, dict[str, str]] = {"": {}, VAL: {}}
        inputs = {spec.name for spec in self.specs}
        for array in sorted(self.arrays):
            if array in (LABELS, VAL + LABELS):
                continue
            prefix = VAL if array.startswith(VAL) else ""
            name = self.aliases.get(array[len(prefix) :], array[len(prefix) :])
            if name not in inputs:
                raise self.error(f"unexpected array {array!r}")
            if name in assigned[prefix]:
                raise self.error(f"both {assigned[prefix][name]!r} and {array!r} hold {name}")
            assigned[prefix][name] = array
        return assigned

    def split(self, prefix: str) -> tuple[Inputs, Tensor | None] | None:
        """Inputs and labels of one split (training: no prefix, validation: ``val_``), checked;
        None if the archive has no input of that split."""
        arrays = self.assigned[prefix]
        if not arrays:
            return None
        inputs: Inputs = {}
        for spec in self.specs:
            if spec.name not in arrays:
                if spec.required:
                    raise self.error(f"no '{prefix}{spec.name}' array")
                continue
            value = self.arrays[arrays[spec.name]]
            self._check_input(spec, arrays[spec.name], value, arrays)
            inputs[spec.name] = _tensor(value)
        counts = {arrays[name]: len(tensor) for name, tensor in inputs.items()}
        labels = self._labels(prefix + LABELS)
        if labels is not None:
            counts[prefix + LABELS] = len(labels)
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{array} {count}" for array, count in sorted(counts.items()))
            raise self.error(f"mismatched sample counts ({listed})")
        return inputs, labels

    def _check_input(
        self, spec: InputSpec, array: str, value: np.ndarray, arrays: Mapping[str, str]
    ) -> None:
        if value.dtype.kind not in "biuf":
            raise self.error(f"{array!r} has dtype {value.dtype}, not numbers")
        if spec.integer is not None and (value.dtype.kind == "f") == spec.integer:
            holds = "integers" if spec.integer else "floats (the preprocessed input)"
            raise self.error(f"{array!r} has dtype {value.dtype}; {spec.name} holds {holds}")
        if value.ndim == 0 or (spec.shape is not None and not _fits(value.shape, spec.shape)):
            raise self.error(f"{array!r} has shape {tuple(value.shape)}")
        like = arrays.get(spec.like) if spec.like else None
        if like is not None and value.shape != self.arrays[like].shape:
            raise self.error(
                f"{array!r} has shape {tuple(value.shape)}, not that of {like!r} "
                f"{tuple(self.arrays[like].shape)}"
            )
        if spec.max_length is not None and value.shape[-1] > spec.max_length:
            raise self.error(
                f"{array!r} has {value.shape[-1]} positions, the model takes at most "
                f"{spec.max_length}"
            )
        if spec.integer and not _within(value, spec.below):
            raise self.error(
                f"{array!r} holds {value.min()} to {value.max()}, outside [0, {spec.below})"
            )
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise self.error(f"{array!r} holds {int((~np.isfinite(value)).sum())} NaN/Inf values")

    def _labels(self, array: str) -> Tensor | None:
        value = self.arrays.get(array)
        if value is None:
            return None
        if value.dtype.kind not in "iu" or value.ndim != 1:
            raise self.error(
                f"{array!r} has dtype {value.dtype} and shape {tuple(value.shape)}, not integer "
                "class ids (N,)"
            )
        if not _within(value, self.classes):
            raise self.error(
                f"{array!r} holds classes {value.min()} to {value.max()}, the model has "
                f"{self.classes}"
            )
        return torch.from_numpy(value.astype(np.int64))


def _fits(shape: tuple[int, ...], sample: tuple[int | None, ...]) -> bool:
    return len(shape) == len(sample) + 1 and all(
        want is None or want == got for want, got in zip(sample, shape[1:], strict=True)
    )


def _within(value: np.ndarray, bound: int | None) -> bool:
    """Integer values in [0, bound) (no bound: not negative)."""
    if value.size == 0:
        return True
    return int(value.min()) >= 0 and (bound is None or int(value.max()) < int(bound))


def _tensor(value: np.ndarray) -> Tensor:
    """Floats as float32, integers (ids, masks) as int64: what the models' layers take."""
    dtype = np.float32 if value.dtype.kind == "f" else np.int64
    return torch.from_numpy(np.ascontiguousarray(value, dtype=dtype))
