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

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from ..measure.drift import Drift, TensorError, kernel_gap, tensor_sqnr
from ..measure.latency import onnx_latency, thread_counts
from ..report import schema
from ..report.records import (
    artifact_record,
    drift_record,
    latency_record,
    worst_layers,
)
from ..sources import Source, derived_sources, onnx_graph, onnx_sources, placed_ops
from ..targets.builder import TargetJob
from ..targets.fallback_ladder import figures
from ..targets.profiles import TargetProfile
from ..targets.rules import check_onnx_artifact, onnx_op_histogram, unsupported_ops
from .graph import product_operands
from .pow2.grid import GridSearch, align_streams
from .pow2.record import recorded_choices
from .quantize import quantize_onnx
from .search import (
    FallbackStep,
    Search,
    TriedRecipe,
    climb_recipes,
    widen_to_int16,
)

KERNEL_GAP_PTS = 0.2  # exact vs host kernels: a larger gap is reported as a warning


def onnx_inputs(path: Path) -> list[schema.ModelInput]:
    """An ONNX file's inputs, batch axis dropped (-1 where the file leaves a size open)."""
    model = onnx.load(str(path), load_external_data=False)
    constants = {init.name for init in model.graph.initializer}
    inputs = []
    for value in (v for v in model.graph.input if v.name not in constants):
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.dim_value > 0 else -1 for d in tensor_type.shape.dim]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).name
        inputs.append(schema.ModelInput(name=value.name, shape=dims[1:], dtype=dtype))
    return inputs


def build_onnx_target(job: TargetJob) -> schema.TargetResult:
    """int8 QDQ ONNX for ``profile`` in ``target_dir/model_int8.onnx``; what was made and
    measured (artifacts, drift, fallback steps, latency...), named relative to ``out_dir``.

    A power-of-two target first scales the fp32 model's residual streams onto the grid
    (``quant.ort.pow2.grid``); everything after, the int8 ladder, SQNR and fallback, works on that
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
    """The search (``quant.ort.search``: recipes, then int16 tensors), the shipped file's
    checks and measurements, and the result."""
    search = Search(job, job.target_dir / "model_int8.onnx", preparation_dir)
    trials, kept = climb_recipes(search)
    profile, pure = kept.profile, kept.drift
    job.stage("per-tensor SQNR", 0.3)
    errors = tensor_sqnr(job.fp32_path, search.artifact, job.evaluation)
    int16: tuple[str, ...] = ()
    drift, steps = pure, []
    if not pure.within(job.bars) and profile.fallback != "none" and not search.stopped:
        slow = product_operands(onnx.load(str(job.fp32_path), load_external_data=False))
        int16, drift, steps = widen_to_int16(search, profile, pure, errors, slow)
        if int16:  # the shipped file's own error profile, for the report
            errors = tensor_sqnr(job.fp32_path, search.artifact, job.evaluation)
    check_onnx_artifact(search.artifact, profile)
    host = None
    if profile.host_kernel_drift:
        job.stage("drift on this host's kernels", 0.75)
        host = search.measure(exact=False)
    job.stage("latency", 0.8, "ONNX Runtime")
    shipped = Shipped(profile, drift, pure if int16 else None, host, int16, errors)
    return _result(job, search, grid, shipped, trials, kept, steps)


@dataclass(frozen=True)
class Shipped:
    """The file the search left: its recipe, drift (exact; pure int8 when it widens tensors;
    on this host's kernels), int16 tensors and per-tensor errors."""

    profile: TargetProfile
    drift: Drift
    pure: Drift | None
    host: Drift | None
    int16: tuple[str, ...]
    errors: list[TensorError]


def _result(
    job: TargetJob,
    search: Search,
    grid: GridSearch,
    shipped: Shipped,
    trials: list[TriedRecipe],
    kept: TriedRecipe,
    steps: list[FallbackStep],
) -> schema.TargetResult:
    """What the build made and measured, for the report (the file timed here)."""
    artifact, bars, evaluation = search.artifact, job.bars, job.evaluation
    profile, int16 = shipped.profile, shipped.int16
    name = artifact.relative_to(job.out_dir).as_posix()
    sample = evaluation.rows(0, 1)
    sources = onnx_sources(job.fp32_path)  # errors name fp32 tensors (the int8 file keeps them)
    worst = worst_layers(shipped.errors, sources)
    fallback_ops = unsupported_ops(onnx_op_histogram(artifact), profile)
    description = "int8 QDQ ONNX" + (f", {len(int16)} activations int16" if int16 else "")

    def record(
        figure: Drift, layers: list[schema.LayerError], arithmetic: schema.Arithmetic
    ) -> schema.Drift:
        return drift_record(figure, name, layers, bars, arithmetic)

    host = shipped.host
    return schema.TargetResult(
        artifacts=[artifact_record(artifact, job.out_dir, "onnx", description)],
        inputs=onnx_inputs(artifact),
        drift=record(shipped.drift, worst, "exact"),
        pure_int8_drift=None if shipped.pure is None else record(shipped.pure, [], "exact"),
        host_drift=None if host is None else record(host, [], "onnxruntime"),
        warnings=recipe_warnings(trials, kept)
        + ([] if host is None else kernel_warnings(shipped.drift, host))
        + ([grid.note] if grid.note else [])
        + search.stopped,
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


def recipe_warnings(trials: list[TriedRecipe], kept: TriedRecipe) -> list[str]:
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
