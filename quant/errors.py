"""Errors of the quant package: each message is one readable line that says what to do."""

from __future__ import annotations

from converters.errors import plain


class QuantError(ValueError):
    """Base class: bad input to a quantization job (4xx over HTTP, exit 1 on the CLI)."""


class UnknownTargetError(QuantError):
    """A target name no profile has."""


class DataFileError(QuantError):
    """A calibration or evaluation ``.npz`` that cannot be used (shape, dtype, count, NaN...)."""


class RuleViolation(QuantError):
    """An artifact breaks its target's rules (a float op on an NPU, a scale not a power of 2)."""


MAX_LINE_CHARS = 500  # a reason in a report, a job's error, a terminal line


def one_line(error: BaseException) -> str:
    """An error's message as one line: its non-blank lines joined (pydantic and others write
    several, the first alone often says only how many), capped at MAX_LINE_CHARS; the type's
    name when the message is empty, without terminal escape codes (the ONNX exporter colours
    its messages). Every place that shows an error in one line uses this."""
    text = plain(str(error))
    line = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(line) > MAX_LINE_CHARS:
        line = line[: MAX_LINE_CHARS - 3].rstrip() + "..."
    return line or type(error).__name__
