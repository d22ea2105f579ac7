"""What every target builder gets: one conversion job for one target (the builders' interface)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import Samples
from .targets import TargetProfile


@dataclass(frozen=True)
class Bars:
    """The drift an artifact may show: top-1 drop in points and top-1 agreement with fp32."""

    max_drop_pts: float
    min_agreement: float


@dataclass(frozen=True)
class TargetJob:
    """Build ``profile``'s artifacts from the folded fp32 ONNX file into ``target_dir``, naming
    them relative to ``out_dir``, measured against ``reference`` (the fp32 outputs on
    ``evaluation``); ``stage(name, fraction)`` reports progress within the target."""

    profile: TargetProfile
    fp32_path: Path
    target_dir: Path
    out_dir: Path
    calibration: Samples
    evaluation: Samples
    reference: np.ndarray
    bars: Bars
    stage: Callable[[str, float], None]
    latency_runs: int
    shared_dir: Path | None = None
