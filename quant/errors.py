"""Errors of the quant package: each message is one readable line that says what to do."""

from __future__ import annotations


class QuantError(ValueError):
    """Base class: bad input to a quantization job (4xx over HTTP, exit 1 on the CLI)."""


class UnknownTargetError(QuantError):
    """A target name no profile has."""


class DataFileError(QuantError):
    """A calibration or evaluation ``.npz`` that cannot be used (shape, dtype, count, NaN...)."""


class RuleViolation(QuantError):
    """An artifact breaks its target's rules (a float op on an NPU, a scale not a power of 2)."""
