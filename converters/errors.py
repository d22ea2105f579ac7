"""Errors of the converters: each message is one readable line."""

from __future__ import annotations

import re

# Terminal colour and cursor codes (the ONNX exporter colours its messages): never in a report,
# a command's line or an HTTP body.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


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


def plain(text: str) -> str:
    """``text`` without terminal escape codes."""
    return ANSI_ESCAPE.sub("", text)


def root_cause(error: BaseException) -> str:
    """The first line of the deepest exception behind ``error`` that says something (torch's
    exporters wrap the real cause, "Cannot view a tensor ... as ...", in pages of advice whose
    first line is only "Failed to decompose the FX graph..."), without escape codes; the
    type's name when none says anything."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        context = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or context
    for cause in reversed(chain):
        lines = [line.strip() for line in plain(str(cause)).splitlines() if line.strip()]
        if lines:
            return lines[0]
    return type(error).__name__
