"""What every target builder gets: one conversion job for one target (the builders' interface)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

import numpy as np

from ..deadline import NO_DEADLINE, Deadline
from ..measure.bars import Bars
from ..samples import Samples
from .profiles import TargetProfile

__all__ = ["StageCallback", "TargetJob", "TargetSettings"]


class StageCallback(Protocol):
    """How a builder reports a stage of its target: ``stage("fallback", 0.4, "8 tensors to
    int16")``; the fraction is of the target's own build."""

    def __call__(self, name: str, fraction: float, detail: str | None = None) -> None: ...


@dataclass(frozen=True, kw_only=True)
class TargetSettings:
    """A target's build as plain values: build ``profile``'s artifacts from the folded fp32
    ONNX file into ``target_dir``, naming them relative to ``out_dir``, within ``bars``. This
    part crosses to the build child as it is (``quant.isolation.BuildOrder``)."""

    profile: TargetProfile
    bars: Bars
    fp32_path: Path
    target_dir: Path
    out_dir: Path
    latency_runs: int
    shared_dir: Path | None = None
    # the folded torch program for the TFLite direct route, or why there is none
    program: Path | None = None
    no_program: str | None = None


@dataclass(frozen=True, kw_only=True)
class TargetJob(TargetSettings):
    """The settings and what the build works on: measured against ``reference`` (the fp32
    outputs on ``evaluation``); ``stage`` reports progress within the target; its search for a
    file within the bars stops in time for ``deadline`` (quant.deadline)."""

    calibration: Samples
    evaluation: Samples
    reference: np.ndarray
    stage: StageCallback
    deadline: Deadline = NO_DEADLINE

    @classmethod
    def given(
        cls,
        settings: TargetSettings,
        *,
        calibration: Samples,
        evaluation: Samples,
        reference: np.ndarray,
        stage: StageCallback,
        deadline: Deadline = NO_DEADLINE,
    ) -> TargetJob:
        plain = {field.name: getattr(settings, field.name) for field in fields(TargetSettings)}
        return cls(
            **plain, calibration=calibration, evaluation=evaluation, reference=reference,
            stage=stage, deadline=deadline,
        )  # fmt: skip
