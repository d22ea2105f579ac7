"""Errors of the converters: each message is one readable line."""

from __future__ import annotations


class ConversionError(ValueError):
    """A model the converters cannot fold or export; the message says why in one line."""


class OnlineNormError(ConversionError):
    """The model still has norms that compute statistics from the input (LayerNorm, ...)."""


class NotAProgramError(ConversionError):
    """Not a readable torch.export program (.pt2), or one that would need code to run to load."""


class NotAnOnnxModelError(ConversionError):
    """Not a readable ONNX model."""


class OpsetError(ConversionError):
    """The requested opset cannot be produced."""
