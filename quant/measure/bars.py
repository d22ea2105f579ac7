"""The drift bars: how much an int8 file may differ from the fp32 model and still ship.

One name for the drop bar everywhere a person sets it (``--max-drift``, the HTTP form's
``max_drift``, ``convert(max_drift=...)``, ``Bars.max_drift``); the report writes it as
``max_drift_pts``, with the unit every figure in points carries there. The defaults are the
project's, defined here and only here (the HTTP API and the command line read them without
torch or ONNX Runtime: this module imports nothing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bars:
    """Top-1 points an artifact may lose against fp32 (``max_drift``) and the top-1 agreement
    with fp32 it must keep at least."""

    max_drift: float = 0.5
    min_agreement: float = 0.99


DEFAULT_BARS = Bars()
DEFAULT_MAX_DRIFT = DEFAULT_BARS.max_drift
DEFAULT_MIN_AGREEMENT = DEFAULT_BARS.min_agreement
