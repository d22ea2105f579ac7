"""Running a ``transformers`` classifier on edge_un's preprocessed inputs: its keyword inputs,
example inputs for tracing, and a module that returns plain logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..checkpoint import CheckpointError


def pad_token_id(model: nn.Module) -> int:
    """The padding id of a text model (0, edge_un's own, when its config names none)."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def max_sequence_length(model: nn.Module) -> int | None:
    """How many tokens a text model takes: its ``max_position_embeddings``, less the positions
    a RoBERTa-style model skips (its position ids start after the padding index, which its
    position embedding holds as ``padding_idx``: RoBERTa's 514 positions take 512 tokens)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is None:
        return None
    skipped = [
        module.padding_idx + 1
        for name, module in model.named_modules()
        if name.endswith("position_embeddings")
        and isinstance(module, nn.Embedding)
        and module.padding_idx is not None
    ]
    return int(positions) - max(skipped, default=0)


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
