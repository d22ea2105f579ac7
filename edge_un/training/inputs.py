"""A model's inputs as the training loop sees them: named, batch-first tensors.

Every model the loop trains, or a fine-tune measures, is called on a mapping of input names to
tensors that share their first (sample) dimension: batching, shuffling, validation and
recalibration take the same rows of every tensor. edge_un's own models take one tensor,
positionally: that is the one-input case, a bare tensor or the single name ``inputs`` (what its
``.npz`` array is called).
A Hugging Face model takes keyword arguments (``pixel_values``; ``input_ids``,
``attention_mask``, ``token_type_ids``) and returns an output object whose ``logits`` are what
distillation compares: :func:`logits_of` is the one place that knows it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError

# The name a one-input model's tensor travels under; such a model is called positionally.
SINGLE_INPUT = "inputs"

Inputs = dict[str, Tensor]  # one batch-first tensor per model input, by name
ModelInputs = Tensor | Mapping[str, Tensor]  # what the public functions take


def named(inputs: ModelInputs) -> Inputs:
    """``inputs`` as named tensors (a bare tensor is the one-input case), checked to be
    batch-first tensors with one sample count."""
    tensors = dict(inputs) if isinstance(inputs, Mapping) else {SINGLE_INPUT: inputs}
    if not tensors:
        raise InputError("no model inputs given")
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor) or tensor.ndim == 0:
            raise InputError(f"model input {name!r} must be a batch-first tensor")
    counts = {name: len(tensor) for name, tensor in tensors.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise InputError(f"the model inputs have different sample counts ({listed})")
    return tensors


def count(inputs: Inputs) -> int:
    """How many samples (rows) the inputs hold."""
    return len(next(iter(inputs.values())))


def rows(inputs: Inputs, index: Tensor | slice) -> Inputs:
    """The same rows of every input: a batch keeps each sample's tensors together."""
    return {name: tensor[index] for name, tensor in inputs.items()}


def head(inputs: Inputs, size: int) -> Inputs:
    return rows(inputs, slice(0, size))


def batches(inputs: Inputs, size: int) -> Iterator[Inputs]:
    """Consecutive batches of ``size`` rows, in order."""
    for start in range(0, count(inputs), size):
        yield rows(inputs, slice(start, start + size))


def call(model: nn.Module, batch: Inputs) -> Any:
    """Run ``model`` on one batch: positionally for the one-input case, by keyword otherwise."""
    if set(batch) == {SINGLE_INPUT}:
        return model(batch[SINGLE_INPUT])
    return model(**batch)


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: the tensor itself, or the ``logits`` of a Hugging Face
    output object (a ``ModelOutput``, which is also a mapping)."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, Tensor):
        raise TypeError(
            f"the model returned {type(output).__name__}, neither logits nor an output with "
            "'logits'"
        )
    return logits


def forward(model: nn.Module, batch: Inputs) -> Tensor:
    """``model``'s logits for one batch."""
    return logits_of(call(model, batch))


def is_image(tensor: Tensor) -> bool:
    """A float (N, C, H, W) tensor: what an image augmentation may move."""
    return tensor.ndim == 4 and torch.is_floating_point(tensor)
