"""What every target builder gets: one conversion job for one target (the builders' interface)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .data import Samples
from .deadline import NO_DEADLINE, Deadline
from .targets import Bars, TargetProfile

__all__ = ["Bars", "StageCallback", "TargetJob"]


class StageCallback(Protocol):
    """How a builder reports a stage of its target: ``stage("fallback", 0.4, "8 tensors to
    int16")``; the fraction is of the target's own build."""

    def __call__(self, name: str, fraction: float, detail: str | None = None) -> None: ...


@dataclass(frozen=True)
class TargetJob:
    """Build ``profile``'s artifacts from the folded fp32 ONNX file into ``target_dir``, naming
    them relative to ``out_dir``, measured against ``reference`` (the fp32 outputs on
    ``evaluation``); ``stage`` reports progress within the target; its search for a file
    within the bars stops in time for ``deadline`` (quant.deadline)."""

    profile: TargetProfile
    fp32_path: Path
    target_dir: Path
    out_dir: Path
    calibration: Samples
    evaluation: Samples
    reference: np.ndarray
    bars: Bars
    stage: StageCallback
    latency_runs: int
    shared_dir: Path | None = None
    deadline: Deadline = NO_DEADLINE
    # the folded torch program for the TFLite direct route, or why there is none
    program: Path | None = None
    no_program: str | None = None
