"""The search a QDQ ONNX target (cpu, tda4vm) runs for a file within the bars: the int8 recipe
ladder, then the int16 fallback, each step a quantization and an exact drift pass, within the
build's time (``quant.deadline``). ``quant.ort.target`` says why it searches this way; this
module holds the search's state (:class:`Search`) and its two loops."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..deadline import NO_DEADLINE, SearchStopped, cut_note, stop_note, watching
from ..measure.bars import Bars
from ..measure.drift import SQNR_SAMPLES, Drift, TensorError, measure_drift, onnx_runner
from ..targets.builder import TargetJob
from ..targets.fallback_ladder import (
    ceiling_note,
    fallback_order,
    fallback_sizes,
    out_of_reach,
    ships_before,
)
from ..targets.profiles import TargetProfile
from .quantize import Preprocessed, preprocess_once, quantize_onnx

# What a build runs after its search, in samples' worth of its last exact drift pass (that pass's
# time over its sample count), each part by what its cost grows with: the shipped file's
# per-tensor SQNR, an fp32 and an int8 run of at most SQNR_SAMPLES samples keeping every
# activation (each of its samples costs FINISH_SQNR_SAMPLE of the pass's: BERT-base's cpu target
# 27.0 s for 64 samples after a 100-sample pass of 18-20 s, 2.2; the trained BERT-base's tda4vm
# file 26 s after a 2562-sample pass of ~335 s, 3.1); the latency runs, a fixed number of calls
# (73 and 145 samples' worth there); the drift pass on this host's kernels, where the profile has
# one, over every sample (0.68 of the exact pass). FINISH_MARGIN over their sum also covers the
# second SQNR run of a file with int16 tensors. As a fixed 4 passes
# it asked 1340 s of that tda4vm build for ~45 s of checks, and stopped its ladder after one
# recipe with 1083 s left.
FINISH_SQNR_SAMPLE = 3.0
FINISH_LATENCY_SAMPLES = 150
FINISH_HOST_PASS = 0.7
FINISH_MARGIN = 1.5


def finish_estimate(pass_s: float, samples: int, host_pass: bool) -> float:
    """Seconds a build runs after its search, from its last exact drift pass of ``samples``
    samples (``pass_s``), with or without the pass on this host's kernels."""
    work = FINISH_SQNR_SAMPLE * min(SQNR_SAMPLES, samples) + FINISH_LATENCY_SAMPLES
    if host_pass:
        work += FINISH_HOST_PASS * samples
    return FINISH_MARGIN * work * pass_s / max(samples, 1)


@dataclass(frozen=True)
class FallbackStep:
    tensors: tuple[str, ...]
    drift: Drift


@dataclass(frozen=True)
class TriedRecipe:
    """One recipe of the int8 ladder and the drift of its pure int8 file."""

    profile: TargetProfile
    drift: Drift


@dataclass
class Search:
    """One build's search state: where it writes its file, what it measured, how long its steps
    take, and why it stopped short of the bars (``stopped``: the report's warnings)."""

    job: TargetJob
    artifact: Path
    preparation_dir: Path
    stopped: list[str] = field(default_factory=list)
    step_s: float = 0.0  # how long the last quantize-and-measure step took
    unwatched_s: float = 0.0  # the longest it ran between two deadline checks
    passes: list[float] = field(default_factory=list)  # each exact drift pass's seconds
    preparation: Preprocessed | None = None  # the fp32 graph and ranges every step shares

    def measure(self, exact: bool) -> Drift:
        """The file's drift on the evaluation data: exact arithmetic, or this host's kernels."""
        outputs = onnx_runner(self.artifact, exact=exact)(self.job.evaluation.feeds)
        return measure_drift(self.job.reference, outputs, self.job.evaluation.labels)

    def quantize_and_measure(self, recipe: TargetProfile, int16: tuple[str, ...]) -> Drift:
        job = self.job
        if self.preparation is None:  # in the first quantize stage: the recipes share it
            self.preparation = preprocess_once(
                job.fp32_path, recipe, job.calibration, self.preparation_dir
            )
        quantize_onnx(job.fp32_path, self.artifact, recipe, job.calibration, int16,
                      self.preparation)  # fmt: skip
        started = time.monotonic()
        drift = self.measure(exact=True)
        self.passes.append(time.monotonic() - started)
        return drift

    def finish_s(self) -> float:
        """How long the build takes after its search, from the last drift pass it measured
        (none yet: as long as the last step)."""
        if not self.passes:
            return self.step_s
        samples, host_pass = len(self.job.evaluation), self.job.profile.host_kernel_drift
        return finish_estimate(self.passes[-1], samples, host_pass)

    def fits(self) -> bool:
        """Whether a step can start: the time left holds what runs after the search and what
        the step runs before it can first be stopped."""
        return self.job.deadline.allows(self.unwatched_s, self.finish_s())

    def step(self, recipe: TargetProfile, int16: tuple[str, ...], first: bool) -> Drift | None:
        """quantize_and_measure, stopped part way (None) at its first check that would leave
        less than ``finish_s`` after it; the first step runs to its end (nothing to ship
        without it) and only measures how long it runs unwatched."""
        deadline = self.job.deadline
        limit = NO_DEADLINE if first else deadline.less(self.finish_s() + self.unwatched_s)
        started = time.monotonic()
        try:
            with watching(limit) as watch:
                drift = self.quantize_and_measure(recipe, int16)
        except SearchStopped:
            return None
        self.step_s, self.unwatched_s = time.monotonic() - started, watch.longest_gap_s
        return drift

    def stop(self, done: str, next_step: str) -> None:
        """Not started: ``next_step`` would not leave time for what follows."""
        left = self.job.deadline.left()
        self.stopped.append(
            stop_note(done, next_step, self.unwatched_s, left, self.finish_s(), watched=True)
        )

    def cut(self, done: str, next_step: str) -> None:
        """Started, then stopped part way."""
        self.stopped.append(cut_note(done, next_step, self.finish_s()))


def kept_recipe(trials: list[TriedRecipe], bars: Bars) -> TriedRecipe:
    """The first recipe within the bars; when none is, the one with the highest agreement (the
    smaller drop, then the earlier recipe, breaks a tie): the pure int8 file closest to them."""
    for trial in trials:
        if trial.drift.within(bars):
            return trial
    # max keeps the first of equals: the earlier (cheaper) recipe
    return max(trials, key=lambda t: (t.drift.agreement, -(t.drift.top1_drop_pts or 0.0)))


def climb_recipes(search: Search) -> tuple[list[TriedRecipe], TriedRecipe]:
    """The int8 ladder: each recipe of the profile in turn until one is within the bars (or
    time runs out); every recipe tried, and the one whose file is left in ``search.artifact``."""
    job = search.job
    trials: list[TriedRecipe] = []
    with tempfile.TemporaryDirectory() as scratch:
        missed: list[Path] = []  # each missing recipe's file, in case it is the one kept
        for number, recipe in enumerate(job.profile.int8_recipes):
            step = f"int8 recipe {number + 1}"
            if number and not search.fits():
                search.stop(f"{number} int8 recipe(s)", step)
                break
            job.stage("quantize", 0.1, "ONNX Runtime" if not number else step)
            drift = search.step(recipe, (), first=not number)
            if drift is None:
                search.cut(f"{number} int8 recipe(s)", step)
                break
            trials.append(TriedRecipe(recipe, drift))
            if drift.within(job.bars):
                break
            kept_file = Path(scratch) / f"recipe_{number}.onnx"
            missed.append(Path(shutil.copy(search.artifact, kept_file)))
        kept = kept_recipe(trials, job.bars)
        if kept is not trials[-1] or search.stopped:  # on disk: the last tried, or one cut short
            shutil.copy(missed[trials.index(kept)], search.artifact)
    return trials, kept


def widen_to_int16(
    search: Search,
    profile: TargetProfile,
    pure: Drift,
    errors: list[TensorError],
    slow: set[str],
) -> tuple[tuple[str, ...], Drift, list[FallbackStep]]:
    """The int16 fallback from the pure int8 file of ``profile``: the most sensitive tensors
    (``errors``, ranked with ``slow``, the tensors a product reads) widened in doubling steps
    until the bars are met, out of reach or out of time. Returns the tensors the shipped file
    widens (none: the pure file ships), its drift and every step tried; the shipped file is
    left in ``search.artifact``."""
    job = search.job
    ranked = fallback_order(errors, slow)
    sizes = fallback_sizes(len(ranked))
    int16: tuple[str, ...] = ()
    drift = pure
    steps: list[FallbackStep] = []
    with tempfile.TemporaryDirectory() as scratch:
        best = Path(scratch) / "best.onnx"  # the file that ships if the search ends now
        shutil.copy(search.artifact, best)
        for size in sizes:
            step = f"{size} tensors to int16"
            if not search.fits():
                search.stop(f"{len(steps)} fallback step(s)", step)
                break
            job.stage("fallback", 0.4, step)
            widened = tuple(ranked[:size])
            widened_drift = search.step(profile, widened, first=False)
            if widened_drift is None:
                search.cut(f"{len(steps)} fallback step(s)", step)
                break
            steps.append(FallbackStep(widened, widened_drift))
            if ships_before(widened_drift, size, drift, len(int16), job.bars):
                int16, drift = widened, widened_drift
                shutil.copy(search.artifact, best)
            if widened_drift.within(job.bars) and size < len(ranked):
                break  # the fewest within the bars: the first step, or one after all of them
            if size == len(ranked) and size != sizes[-1] and out_of_reach(widened_drift, job.bars):
                search.stopped.append(ceiling_note(size, widened_drift))
                break
        shutil.copy(best, search.artifact)
    return int16, drift, steps
