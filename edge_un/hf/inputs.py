"""Running a ``transformers`` classifier on edge_un's preprocessed inputs: its keyword inputs,
example inputs for tracing, and a module that returns plain logits."""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ..checkpoint import CheckpointError


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


EXAMPLE_SEQUENCE = 128  # tokens of a traced text model when neither data nor a data set says


def max_sequence_length(model: nn.Module) -> int | None:
    """The most tokens the model's position table covers: ``max_position_embeddings`` (GPT-2's
    ``n_positions``), less the rows RoBERTa-style models skip (their positions start after the
    padding index: RoBERTa's 514 positions take 512 tokens); None when the config does not
    say."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    skipped = getattr(table, "padding_idx", None)
    return positions - (skipped + 1) if isinstance(skipped, int) else positions


def example_inputs(
    model: nn.Module, batch: int = 2, shapes: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Tensor]:
    """Keyword inputs to trace a model with: shaped as ``shapes`` says (one sample of each
    input, no batch axis: the user's data), else as its config does (images of
    ``image_size``; ``EXAMPLE_SEQUENCE`` token ids, fewer if its positions end sooner). A
    sequence longer than the model's positions is refused. Batch 2: a traced batch of 1 would
    be fixed."""
    config = model.config
    name = getattr(model, "main_input_name", "input_ids")
    given = tuple((shapes or {}).get(name, ()))
    if name == "pixel_values":
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        sample = given or (config.num_channels, height, width)
        return {name: torch.randn(batch, *sample)}
    if name == "input_ids":
        limit = max_sequence_length(model)
        length = given[-1] if given else min(limit or EXAMPLE_SEQUENCE, EXAMPLE_SEQUENCE)
        if limit is not None and length > limit:
            raise CheckpointError(
                f"'input_ids' has {length} tokens, more than {type(model).__name__} has "
                f"positions for ({limit}): shorten the sequences to {limit} tokens"
            )
        ids = torch.randint(1, config.vocab_size, (batch, length))
        return named_inputs(model, ids)
    raise CheckpointError(
        f"{type(model).__name__} takes {name!r}: only image and text classifiers are known; "
        "export it yourself (torch.export or torch.onnx.export) and convert that file"
    )


def call_with_names(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """``model`` called positionally with ``names`` (its inputs, in the order a converted
    file takes them) passes them by keyword, its key/value cache off; returns ``model``.

    Positions in ``forward`` differ between families (GPT-2's second is ``past_key_values``),
    and a decoder's cache is on by default; a trace wants neither. Only this object's
    ``forward`` changes: its class and config stay as the user wrote them."""
    forward = type(model).forward
    takes_cache = "use_cache" in inspect.signature(forward).parameters
    options = {"use_cache": False} if takes_cache else {}

    def by_name(self: nn.Module, *tensors: Tensor) -> object:
        return forward(self, **dict(zip(names, tensors, strict=True)), **options)

    parameter = inspect.Parameter.POSITIONAL_OR_KEYWORD
    by_name.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, parameter) for name in ("self", *names)]
    )  # what torch.export names the graph's inputs after
    model.forward = types.MethodType(by_name, model)  # a copy of the model calls itself
    return model


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
