"""Replace the LayerNorms of any model with another norm kind."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import InputError
from .norms import make_norm


class NormSwapError(InputError):
    """A LayerNorm that cannot be replaced by a per-channel norm."""


def swap_layernorm(model: nn.Module, kind: str = "un", **norm_kwargs: Any) -> int:
    """Replace every ``nn.LayerNorm`` over the last dimension of ``model`` in place.

    Weight and bias are copied (a LayerNorm without them gets ones and zeros); its eps is kept
    unless ``eps`` is given. Returns how many were replaced. Raises :class:`NormSwapError`, before
    changing anything, if a LayerNorm normalises over more than one dimension.
    """
    if isinstance(model, nn.LayerNorm):
        raise NormSwapError("the model itself is a LayerNorm: wrap it in a module first")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    multi_dim = [name for name, m in targets if len(m.normalized_shape) != 1]
    if multi_dim:
        raise NormSwapError(
            "cannot replace LayerNorm over more than one dimension (a per-channel norm covers "
            f"only the last): {', '.join(multi_dim)}"
        )
    for name, layernorm in targets:
        replacement = _replacement_for(layernorm, kind, norm_kwargs)
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, replacement)
    _disable_fused_encoder_fast_path(model)
    return len(targets)


def _replacement_for(layernorm: nn.LayerNorm, kind: str, norm_kwargs: dict[str, Any]) -> nn.Module:
    kwargs = {"eps": layernorm.eps, **norm_kwargs}
    norm = make_norm(kind, layernorm.normalized_shape[0], **kwargs)
    with torch.no_grad():
        if layernorm.weight is not None:
            norm.weight.copy_(layernorm.weight)
        if layernorm.bias is not None:
            norm.bias.copy_(layernorm.bias)
    if layernorm.weight is not None:
        # Parameters follow the model's dtype; statistics buffers stay float32.
        norm.to(device=layernorm.weight.device)
        for parameter in norm.parameters():
            parameter.data = parameter.data.to(layernorm.weight.dtype)
    norm.train(layernorm.training)
    return norm


def _disable_fused_encoder_fast_path(model: nn.Module) -> None:
    # nn.TransformerEncoderLayer has an inference fast path that calls one fused kernel with
    # LayerNorm math built in, reading only norm1/norm2's weight, bias and eps: after a swap it
    # would silently compute LayerNorm again. Any forward hook on the layer turns that path off.
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and not module._forward_pre_hooks:
            module.register_forward_pre_hook(_keep_unfused)


def _keep_unfused(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A no-op whose presence keeps nn.TransformerEncoderLayer off its fused fast path."""
    return None
