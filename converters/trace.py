"""A torch model as an eval-mode graph: the example inputs it is traced with, and the trace.

``torch.export`` records every op the model runs (with its module, ``nn_module_stack``) on the
example inputs; the folds read that graph, and it is what a ``.pt2`` program holds.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from .errors import ConversionError, root_cause


def default_example_inputs(model: nn.Module) -> tuple[Tensor, ...]:
    """Inputs for edge_un's own models, from their config (batch 2: batch stays dynamic)."""
    config = getattr(model, "config", None) or {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if "img_size" in config:
        size = config["img_size"]
        return (torch.randn(2, config.get("in_chans", 1), size, size, dtype=dtype),)
    if "vocab_size" in config:
        return (torch.randint(1, config["vocab_size"], (2, config["max_len"])),)
    raise ConversionError(f"cannot guess the inputs of {type(model).__name__}: pass example_inputs")


def forward_input_names(model: nn.Module, example_inputs: tuple[Tensor, ...]) -> tuple[str, ...]:
    """The names ``torch.export`` gives the inputs of ``model`` called with ``example_inputs``
    positionally: its forward's parameters, in order (what its fold's graph and every export
    name them, known before the trace: a conversion reads its data by them first)."""
    parameters = list(inspect.signature(model.forward).parameters.values())
    return tuple(parameter.name for parameter in parameters[: len(example_inputs)])


def export_eval(model: nn.Module, example_inputs: Any) -> ExportedProgram:
    """``torch.export`` of the eval-mode model with the first (batch) dimension of every tensor
    input left to Dim.AUTO, so the batch stays dynamic where the model allows; the model's own
    training mode is restored afterwards."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    dynamic = tuple(
        {0: torch.export.Dim.AUTO} if isinstance(a, Tensor) and a.dim() else None for a in args
    )
    was_training = model.training
    model.eval()
    try:
        return torch.export.export(model, args, dynamic_shapes=dynamic)
    except Exception as error:  # torch.export raises many types; one line for the user
        why = root_cause(error)
        raise ConversionError(f"cannot trace {type(model).__name__}: {why}") from error
    finally:
        model.train(was_training)
