"""A QDQ ONNX target (cpu, tda4vm): quantize, measure, fall back tensor by tensor, check, time.

Drift is measured in the target's arithmetic, not the conversion host's: the QDQ graph run as
written (``onnx_runner(exact=True)``), which is what a board's integer kernels compute and does
not depend on the CPU that converted it. For the cpu target, whose runtime the host also is, the
shipped file is measured on the host's own int8 kernels too, and a gap is reported; the drift
bars and the fallback act on the exact figure only (a host's kernel quirk is not the file's).

Before any 16-bit tensor, a profile's int8 ladder (``TargetProfile.int8_recipes``) is climbed:
while the pure int8 file misses the bars, the next recipe is quantized and measured (cpu: 7-bit
s8 weights, then biases corrected, then U8U8 weights; tda4vm: biases corrected). The first
within the bars ships; when none is, the one with the highest agreement is kept. Each recipe
takes its parameters from the calibration data only; the evaluation data only says, as for the
fallback below, whether the bars are met.

The drift fallback then widens the most sensitive activations to 16 bits, doubling how many
each step (4, 8, 16, ... then all), until the drift fits the bars or nothing is left. All of
them is measured second, right after the first 4 miss: it is about as close to the bars as the
fallback gets, so when it misses them by more than a few samples no smaller set is tried
(``out_of_reach``); otherwise the doubling looks for the fewest that are within them. When no
file is within them, the one closest to them ships, pure int8 included (``ships_before``): more
int16 tensors are usually, not always, closer. ViT-B/16 with random weights, whose
files never meet the bars, took 7 steps and 256 s to reach the same file of all 152
activations (92 % agreement) in doubling order (hf_scale's run at 9a72885, committed in d623d55).
Sensitivity is each tensor's own quantization SQNR in the pure int8 model (its local rounding
error): measured on the trained examples, ranking by it converges in fewer steps than ranking by
the accumulated error, which blames the softmax outputs for noise that arises upstream. Speed is
weighed with it (``fallback_order``): a tensor a matrix product reads would take that product
off ONNX Runtime's integer kernels, so it counts one bit more accurate than it is.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from . import report as schema
from .deadline import NO_DEADLINE, SearchStopped, cut_note, stop_note, watching
from .drift import Drift, kernel_gap, measure_drift, onnx_runner, tensor_sqnr
from .fallback_ladder import (
    ceiling_note,
    fallback_order,
    fallback_sizes,
    figures,
    out_of_reach,
    ships_before,
)
from .latency import onnx_latency, thread_counts
from .ort_graph import product_operands
from .ort_int8 import Preparation, prepare_once, quantize_onnx
from .pow2_grid import GridSearch, align_streams
from .pow2_record import recorded_choices
from .records import (
    WORST_LAYERS,
    artifact_record,
    drift_record,
    finite,
    latency_record,
    onnx_inputs,
)
from .rules import check_onnx_artifact, onnx_op_histogram, unsupported_ops
from .sources import Source, derived_sources, label_of, onnx_graph, onnx_sources, placed_ops
from .target_job import Bars, TargetJob
from .targets import TargetProfile

KERNEL_GAP_PTS = 0.2  # exact vs host kernels: a larger gap is reported as a warning
# What a build does after its search (the shipped file's SQNR: an fp32 and an int8 pass; the
# host-kernel drift pass; latency; checks), in exact drift passes of the last file, which the
# build measured: BERT-base's cpu target 27.0 + 12.9 + 13.8 s after a pass of 18-20 s (one
# target at a time, benchmarks/results/hf_scale.md), 2.7-3.0 passes; 4 leaves a margin, and a
# file with int16 tensors runs its SQNR again.
FINISH_PASSES = 4.0


@dataclass(frozen=True)
class FallbackStep:
    tensors: tuple[str, ...]
    drift: Drift


@dataclass(frozen=True)
class RecipeTrial:
    """One recipe of the int8 ladder and the drift of its pure int8 file."""

    profile: TargetProfile
    drift: Drift


def build_onnx_target(job: TargetJob) -> schema.TargetResult:
    """int8 QDQ ONNX for ``profile`` in ``target_dir/model_int8.onnx``; what was made and
    measured (artifacts, drift, fallback steps, latency...), named relative to ``out_dir``.

    A power-of-two target first scales the fp32 model's residual streams onto the grid
    (``quant.pow2_grid``); everything after, the int8 ladder, SQNR and fallback, works on that
    file, which computes what the exported one does."""
    profile = job.profile
    with tempfile.TemporaryDirectory() as scratch:
        grid = GridSearch(())
        if profile.power_of_two_scales and profile.stream_factors:
            scaled = Path(scratch) / "fp32_streams_scaled.onnx"
            job.stage("power-of-two grid", 0.05, "residual stream factors")
            first = profile.int8_recipes[0]

            def quantize(fp32: Path, out: Path) -> Path:
                return quantize_onnx(fp32, out, first, job.calibration)

            grid = align_streams(job.fp32_path, scaled, quantize, job.calibration, job.deadline)
            if grid.scaled:
                job = replace(job, fp32_path=scaled)
        preparation_dir = Path(scratch) / "preparation"
        preparation_dir.mkdir()
        return _build(job, grid, preparation_dir)


def _build(job: TargetJob, grid: GridSearch, preparation_dir: Path) -> schema.TargetResult:
    profile, bars, stage = job.profile, job.bars, job.stage
    target_dir, out_dir, evaluation = job.target_dir, job.out_dir, job.evaluation
    artifact = target_dir / "model_int8.onnx"

    def measure(exact: bool) -> Drift:
        outputs = onnx_runner(artifact, exact=exact)(evaluation.feeds)
        return measure_drift(job.reference, outputs, evaluation.labels)

    shared: list[Preparation] = []  # the fp32 graph and ranges every quantization below uses
    passes: list[float] = []  # how long each exact drift pass took

    def quantize_and_measure(recipe: TargetProfile, int16: tuple[str, ...]) -> Drift:
        if not shared:  # in the first quantize stage: the recipes share gemm_linears
            shared.append(prepare_once(job.fp32_path, recipe, job.calibration, preparation_dir))
        quantize_onnx(job.fp32_path, artifact, recipe, job.calibration, int16, shared[0])
        started = time.monotonic()
        drift = measure(exact=True)
        passes.append(time.monotonic() - started)
        return drift

    def finish_s() -> float:
        """How long the build takes after its search, from the last drift pass it measured
        (none yet: as long as the last step)."""
        return FINISH_PASSES * passes[-1] if passes else step_s

    trials: list[RecipeTrial] = []
    # why the search stopped short of the bars: time ran out, or the fallback's ceiling missed
    stopped: list[str] = []
    step_s = 0.0  # how long the last quantize-and-measure step took
    unwatched_s = 0.0  # the longest it ran between two deadline checks (quant.deadline)

    def fits() -> bool:
        """Whether a step can start: the time left holds what runs after the search and what
        the step runs before it can first be stopped."""
        return job.deadline.allows(unwatched_s, finish_s())

    def search_step(recipe: TargetProfile, int16: tuple[str, ...], first: bool) -> Drift | None:
        """quantize_and_measure, stopped part way (None) at its first check that would leave
        less than ``finish_s`` after it; the first step runs to its end (nothing to ship
        without it) and only measures how long it runs unwatched."""
        nonlocal step_s, unwatched_s
        limit = NO_DEADLINE if first else job.deadline.less(finish_s() + unwatched_s)
        started = time.monotonic()
        try:
            with watching(limit) as watch:
                drift = quantize_and_measure(recipe, int16)
        except SearchStopped:
            return None
        step_s, unwatched_s = time.monotonic() - started, watch.longest_gap_s
        return drift

    def stop(done: str, next_step: str) -> None:
        left = job.deadline.left()
        stopped.append(stop_note(done, next_step, unwatched_s, left, finish_s(), watched=True))

    with tempfile.TemporaryDirectory() as scratch:
        missed: list[Path] = []  # each missing recipe's file, in case it is the one kept
        for number, recipe in enumerate(profile.int8_recipes):
            step = f"int8 recipe {number + 1}"
            if number and not fits():
                stop(f"{number} int8 recipe(s)", step)
                break
            stage("quantize", 0.1, "ONNX Runtime" if not number else step)
            drift = search_step(recipe, (), first=not number)
            if drift is None:
                stopped.append(cut_note(f"{number} int8 recipe(s)", step, finish_s()))
                break
            trials.append(RecipeTrial(recipe, drift))
            if trials[-1].drift.within(bars):
                break
            missed.append(Path(shutil.copy(artifact, Path(scratch) / f"recipe_{number}.onnx")))
        kept = kept_recipe(trials, bars)
        if kept is not trials[-1] or stopped:  # on disk: the last one tried, or one cut short
            shutil.copy(missed[trials.index(kept)], artifact)
    profile = kept.profile
    pure = drift = kept.drift
    stage("per-tensor SQNR", 0.3)
    errors = tensor_sqnr(job.fp32_path, artifact, evaluation)
    int16: tuple[str, ...] = ()
    steps: list[FallbackStep] = []
    if not drift.within(bars) and profile.fallback != "none" and not stopped:
        slow = product_operands(onnx.load(str(job.fp32_path), load_external_data=False))
        ranked = fallback_order(errors, slow)
        sizes = fallback_sizes(len(ranked))
        with tempfile.TemporaryDirectory() as scratch:
            best = Path(scratch) / "best.onnx"  # the file that ships if the search ends now
            shutil.copy(artifact, best)
            for size in sizes:
                step = f"{size} tensors to int16"
                if not fits():
                    stop(f"{len(steps)} fallback step(s)", step)
                    break
                stage("fallback", 0.4, step)
                widened = tuple(ranked[:size])
                widened_drift = search_step(profile, widened, first=False)
                if widened_drift is None:
                    stopped.append(cut_note(f"{len(steps)} fallback step(s)", step, finish_s()))
                    break
                steps.append(FallbackStep(widened, widened_drift))
                if ships_before(widened_drift, size, drift, len(int16), bars):
                    int16, drift = widened, widened_drift
                    shutil.copy(artifact, best)
                if widened_drift.within(bars) and size < len(ranked):
                    break  # the fewest within the bars: the first step, or one after all of them
                if size == len(ranked) and size != sizes[-1] and out_of_reach(widened_drift, bars):
                    stopped.append(ceiling_note(size, widened_drift))
                    break
            shutil.copy(best, artifact)
        if int16:  # the shipped file's own error profile, for the report
            errors = tensor_sqnr(job.fp32_path, artifact, evaluation)
    check_onnx_artifact(artifact, profile)
    host = None
    if profile.host_kernel_drift:
        stage("drift on this host's kernels", 0.75)
        host = measure(exact=False)
    stage("latency", 0.8, "ONNX Runtime")
    name = artifact.relative_to(out_dir).as_posix()
    sample = evaluation.rows(0, 1)
    sources = onnx_sources(job.fp32_path)  # errors name fp32 tensors (the int8 file keeps them)
    worst = [
        schema.LayerError(
            name=e.name,
            op=e.op,
            sqnr_db=finite(e.sqnr_db),
            own_sqnr_db=finite(e.own_sqnr_db),
            module=label_of(sources, e.name),
        )
        for e in errors[:WORST_LAYERS]
    ]
    fallback_ops = unsupported_ops(onnx_op_histogram(artifact), profile)
    description = "int8 QDQ ONNX" + (f", {len(int16)} activations int16" if int16 else "")

    def record(
        figure: Drift, layers: list[schema.LayerError], arithmetic: schema.Arithmetic
    ) -> schema.Drift:
        return drift_record(figure, name, layers, bars, arithmetic)

    return schema.TargetResult(
        artifacts=[artifact_record(artifact, out_dir, "onnx", description)],
        inputs=onnx_inputs(artifact),
        drift=record(drift, worst, "exact"),
        pure_int8_drift=record(pure, [], "exact") if int16 else None,
        host_drift=None if host is None else record(host, [], "onnxruntime"),
        warnings=recipe_warnings(trials, kept)
        + ([] if host is None else kernel_warnings(drift, host))
        + ([grid.note] if grid.note else [])
        + stopped,
        latency=[
            latency_record(onnx_latency(artifact, sample, t, job.latency_runs), "onnxruntime", name)
            for t in thread_counts()
        ],
        fallback_ops=fallback_ops,
        fallback_op_sources=fallback_sources(artifact, fallback_ops, sources),
        int16_tensors=list(int16),
        int8_recipe=profile.recipe,
        power_of_two_scales=recorded_choices(artifact),
        stream_factors=[
            schema.StreamFactor(
                stream=found.stream.seed,
                tensors=len(found.stream.tensors),
                factor=found.factor,
                logits_mse_at_one=found.error_at_one,
                logits_mse=found.error,
            )
            for found in grid.factors
        ],
        recipes_tried=[
            schema.RecipeTrial(
                recipe=trial.profile.recipe,
                top1_drop_pts=trial.drift.top1_drop_pts,
                agreement=trial.drift.agreement,
                within_bar=trial.drift.within(bars),
            )
            for trial in trials
        ],
        excluded=[
            schema.Exclusion(
                step=number,
                action=f"the {len(step.tensors)} most sensitive activations to int16",
                tensors=list(step.tensors),
                top1_drop_pts=step.drift.top1_drop_pts,
                agreement=step.drift.agreement,
                est_cost="the latency rows: ORT computes around int16 tensors in float",
            )
            for number, step in enumerate(steps, start=1)
        ],
    )


def kept_recipe(trials: list[RecipeTrial], bars: Bars) -> RecipeTrial:
    """The first recipe within the bars; when none is, the one with the highest agreement (the
    smaller drop, then the earlier recipe, breaks a tie): the pure int8 file closest to them."""
    for trial in trials:
        if trial.drift.within(bars):
            return trial
    # max keeps the first of equals: the earlier (cheaper) recipe
    return max(trials, key=lambda t: (t.drift.agreement, -(t.drift.top1_drop_pts or 0.0)))


def recipe_warnings(trials: list[RecipeTrial], kept: RecipeTrial) -> list[str]:
    """A sentence when the shipped file's int8 recipe is not the target's first one."""
    if kept is trials[0]:
        return []
    first = trials[0]
    return [
        f"the first int8 recipe ({first.profile.recipe}) missed the drift bars "
        f"({figures(first.drift)}); the file uses {kept.profile.recipe} "
        f"({figures(kept.drift)} in pure int8)"
    ]


def fallback_sources(
    artifact: Path, fallback_ops: list[str], sources: dict[str, Source]
) -> list[schema.OpSource]:
    """Each node of the int8 file whose op the accelerator leaves to the CPU, with its module
    (the file keeps the fp32 tensor names; its Q/DQ nodes take their neighbours')."""
    if not fallback_ops:
        return []
    graph = onnx_graph(onnx.load(str(artifact), load_external_data=False))
    named = derived_sources(graph, sources)
    return [
        schema.OpSource(op=op, name=name, module=module)
        for op, name, module in placed_ops(graph, named, set(fallback_ops))
    ]


def kernel_warnings(exact: Drift, host: Drift) -> list[str]:
    """A sentence when this host's int8 kernels and the file's exact arithmetic disagree by
    more than ``KERNEL_GAP_PTS`` (top-1 or agreement, in points)."""
    gap = kernel_gap(exact, host)
    if gap <= KERNEL_GAP_PTS:
        return []
    top1 = ""
    if exact.top1_drop_pts is not None and host.top1_drop_pts is not None:
        top1 = f", top-1 drop {host.top1_drop_pts:.1f} vs {exact.top1_drop_pts:.1f} pt"
    return [
        f"this host's ONNX Runtime int8 kernels differ from the file's exact arithmetic by "
        f"{gap:.1f} pt (agreement {100 * host.agreement:.1f} vs {100 * exact.agreement:.1f} %"
        f"{top1}): the drift figures are the exact ones; CPUs with this host's int8 kernels "
        "(see the report's host) compute like the host"
    ]
