"""One conversion as it is asked for: the model, its targets, their data and the bars.

The library (``quant.convert``), the command line and the service's workers ask for a conversion
with this one value, and ``quant.prepare.prepare`` takes it as it is; :func:`conversion_request`
builds it from what a person writes (a path, target names, a comma-separated list). Its checks
run when it is made, before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.source import ModelSource

from .errors import QuantError
from .measure.bars import DEFAULT_BARS, DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT, Bars
from .targets.profiles import TargetProfile, resolve_targets


@dataclass(frozen=True, kw_only=True)
class ConversionRequest:
    """Convert ``model`` for ``targets`` within ``bars``, calibrated on ``calib`` and measured
    on ``eval`` (None: the data set the checkpoint records). ``quant.pipeline.convert`` says
    what each of the others means."""

    model: ModelSource
    targets: tuple[TargetProfile, ...]
    calib: Path | None = None
    eval: Path | None = None  # the evaluation data (--eval)
    config: Path | Mapping[str, Any] | None = None
    bars: Bars = DEFAULT_BARS
    allow_online: bool = False
    latency_runs: int = 100
    recalibrate_batches: int = 0

    def __post_init__(self) -> None:
        if not self.targets:
            raise QuantError("no targets to build: name at least one")
        if self.bars.max_drift < 0:
            raise QuantError(f"max_drift must be >= 0 points, got {self.bars.max_drift}")
        if self.recalibrate_batches < 0:
            raise QuantError(f"recalibrate_batches must be >= 0, got {self.recalibrate_batches}")


def conversion_request(
    model: ModelSource | str | Path,
    targets: str | Sequence[TargetProfile | str] | None = None,
    calib: str | Path | None = None,
    eval: str | Path | None = None,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    max_drift: float = DEFAULT_MAX_DRIFT,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    allow_online: bool = False,
    latency_runs: int = 100,
    recalibrate_batches: int = 0,
) -> ConversionRequest:
    """The request for what a person wrote: a model path read in the format its name says
    (:meth:`ModelSource.from_path`), targets as profiles or names (default: every profile)."""
    return ConversionRequest(
        model=model if isinstance(model, ModelSource) else ModelSource.from_path(model),
        targets=resolve_targets(targets),
        calib=_path(calib),
        eval=_path(eval),
        config=config if isinstance(config, Mapping) else _path(config),
        bars=Bars(max_drift, min_agreement),
        allow_online=allow_online,
        latency_runs=latency_runs,
        recalibrate_batches=recalibrate_batches,
    )


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
