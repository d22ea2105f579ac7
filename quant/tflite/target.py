"""A full-integer TFLite target (imx93, imx8mp): conversion, LiteRT measurements, Vela.

One conversion (``quant.tflite.routes``: litert-torch from a torch program, else onnx2tf) yields
the pure int8 file, which ships unless its drift misses the bars. Then, where the target runs
int16 activations: first the fewest ops with int16 activations that meet the bars, within its
NPU's rules (``quant.tflite.mixed``: direct route only), and last, every activation int16 (16x8:
int8 weights, int16 activations), costed in Vela cycles and in the ops Vela then leaves to the
CPU. The i.MX 8M Plus's VX delegate runs no int16 tensor on its NPU: no fallback there.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import onnx

from ..deadline import SearchStopped, cut_note, stop_note, watching
from ..measure.drift import SQNR_SAMPLES, Drift, TensorError, measure_drift
from ..measure.latency import MIN_RUNS, WARMUP, Timing, thread_counts
from ..measured_once import file_key, measured_once
from ..report import schema
from ..report.records import (
    artifact_record,
    drift_record,
    latency_record,
    worst_layers,
)
from ..sources import (
    Source,
    derived_sources,
    label_of,
    onnx_sources,
    placed_ops,
    scoped_sources,
)
from ..targets.builder import TargetJob
from ..targets.fallback_ladder import ships_before
from ..targets.rules import unsupported_ops
from .direct import requantize
from .flatbuffer import OpRef, TfliteInfo, check_full_integer, inspect_tflite
from .litert import (
    input_name,
    latency_tflite,
    onnx_names,
    op_graph,
    run_tflite,
    sample_runner,
    tensor_sqnr_tflite,
    xnnpack_ops,
)
from .mixed import MIXED_NAME as MIXED
from .mixed import mixed_ladder
from .onnx2tf import convert_int16x8, int16x8_blocker
from .routes import Converted, convert_for_target
from .tool_sandbox import TfliteConversionError
from .vela import VelaResult, compile_vela, cpu_op_name

WHOLE_MODEL = 1 << 30  # the 16x8 file's "size" in ships_before: more int16 than any op set
# One sample of a 16x8 file in LiteRT, at least this many times one of the float32 file on the
# builtin kernels (XNNPACK takes no int16 op, so the 16x8 file runs on those too): 3.5-4.5 for
# the bundled ViTs and ViT-B/16 (benchmarks/results/litert_16x8.md). The int8 file is no guide:
# the ratio to it grows with the model (20x for the bundled ViTs, 77x for ViT-B/16).
WIDE_PER_FLOAT_SAMPLE = 3.0
# What a shipped 16x8 file runs after its drift pass, in one-sample runs: its SQNR pass (up to
# SQNR_SAMPLES, beside the float32 file's) and its latency (warm-up and at least 20 timed runs at
# each thread count, ``quant.measure.latency``).
WIDE_RUNS_AFTER_DRIFT = SQNR_SAMPLES + len(thread_counts()) * (WARMUP + MIN_RUNS)


def tflite_inputs(info: TfliteInfo) -> list[schema.ModelInput]:
    """A TFLite file's inputs as its runtime takes them (quantization of int8 ones)."""
    inputs = []
    for tensor in info.inputs:
        quantized = tensor.dtype in ("int8", "uint8", "int16")
        inputs.append(
            schema.ModelInput(
                name=input_name(tensor.name),
                shape=list(tensor.shape[1:]),
                dtype=tensor.dtype,
                scale=tensor.scale if quantized else None,
                zero_point=tensor.zero_point if quantized else None,
            )
        )
    return inputs


def build_tflite_target(job: TargetJob) -> schema.TargetResult:
    """What a TFLite target made and measured; its files go to ``target_dir``."""
    profile, bars, stage = job.profile, job.bars, job.stage
    target_dir, out_dir = job.target_dir, job.out_dir
    stage("convert", 0.05, "LiteRT converter")
    work = target_dir / "work"
    converted = convert_for_target(job, work)
    int8 = _keep(converted.int8, target_dir / "model_int8.tflite")
    check_full_integer(inspect_tflite(int8), io_dtype="int8")
    stage("drift", 0.45, "LiteRT")
    started = time.monotonic()
    pure = _drift(int8, job)
    # what the build runs after a wider file's own runs: about a conversion and a drift pass
    step_s = converted.quantize_s + time.monotonic() - started
    shipped, drift, excluded, vela_pure, stopped = int8, pure, [], None, []
    out_of_time = False  # the per-op fallback ended for the deadline: 16x8 would cost more
    if profile.fallback == "int16_ops" and not pure.within(bars):
        if converted.direct is None:
            stopped.append("no per-op int16 fallback on the onnx2tf route: 16x8 next")
        else:
            measure = lambda path: _drift(path, job)  # noqa: E731
            mixed = mixed_ladder(converted.direct, int8, job, pure, measure, stopped, step_s)
            excluded.extend(mixed.steps)
            out_of_time = mixed.out_of_time
            if mixed.file is not None:
                shipped, drift = mixed.file, mixed.drift
    wide_allowed = profile.fallback in ("int16_model", "int16_ops")
    wide_file: Path | None = None
    wanted = wide_allowed and not drift.within(bars) and not out_of_time
    if wanted and wide_fits(converted, job, step_s, stopped):
        stage("fallback", 0.5, "16x8: every activation int16")
        wide_file = _wide(converted, job, target_dir / "model_16x8.tflite", stopped)
    wide: Drift | None = None
    if wide_file is not None:
        check_full_integer(inspect_tflite(wide_file), io_dtype=None)
        wide = wide_drift(wide_file, job, step_s, stopped)
        if wide is None:
            wide_file.unlink()
    if wide is not None:
        if ships_before(wide, WHOLE_MODEL, drift, _int16_count(shipped, int8), bars):
            if "vela" in profile.artifacts:  # the pure file's figures, to cost the fallback
                stage("Vela", 0.55, "pure int8, for the cost")
                vela_pure = compile_vela(int8, work / "vela_int8")
            excluded.append(_exclusion(wide, len(excluded) + 1))
            if shipped != int8:
                shipped.unlink()
            shipped, drift = wide_file, wide
        else:
            wide_file.unlink()
    if shipped != int8:
        int8.unlink()
    name = shipped.relative_to(out_dir).as_posix()
    stage("per-tensor SQNR", 0.6)
    sources = tflite_sources(shipped, converted, job.fp32_path)
    # LiteRT's pass measures each tensor's accumulated error only: no own SQNR (NaN: none)
    errors = _sqnr(shipped, converted.float32, job)
    worst = worst_layers((TensorError(t, op, db, math.nan) for t, op, db in errors), sources)
    description = {
        "model_16x8.tflite": "16x8 TFLite: int8 weights, int16 activations (drift fallback)",
        "model_mixed.tflite": "TFLite, int8 weights, int8 activations but for the ops the drift "
        "fallback gave int16 activations; int8 input and output",
    }.get(shipped.name, "full-int8 TFLite: int8 weights and activations, int8 input and output")
    artifacts = [artifact_record(shipped, out_dir, "tflite", description)]
    fallback_ops = unsupported_ops(inspect_tflite(shipped).ops, profile)
    vela_record = vela_pure_record = vela_cpu_ops = None
    if "vela" in profile.artifacts:
        stage("Vela", 0.7)
        vela = compile_vela(shipped, target_dir / "vela")
        artifacts.append(
            artifact_record(vela.path, out_dir, "vela_tflite", "compiled by Vela for the NPU")
        )
        vela_record = _vela_record(vela)
        vela_cpu_ops = sorted(set(vela.cpu_operators), key=cpu_op_name)
        fallback_ops = [cpu_op_name(op) for op in vela_cpu_ops]
        if vela_pure is not None:
            vela_pure_record = _vela_record(vela_pure)
            excluded[-1] = excluded[-1].model_copy(update={"est_cost": _vela_cost(vela, vela_pure)})
    shutil.rmtree(work, ignore_errors=True)
    stage("latency", 0.85, "LiteRT")
    return schema.TargetResult(
        artifacts=artifacts,
        inputs=tflite_inputs(inspect_tflite(shipped)),
        drift=drift_record(drift, name, worst, bars, "litert"),
        pure_int8_drift=(drift_record(pure, name, [], bars, "litert") if shipped != int8 else None),
        latency=[_latency(shipped, name, threads, job) for threads in thread_counts()],
        fallback_ops=fallback_ops,
        fallback_op_sources=fallback_sources(shipped, fallback_ops, sources, vela_cpu_ops),
        matmul_operands=(
            [
                schema.SymmetricOperand.model_validate(group, from_attributes=True)
                for group in converted.matmul_operands
            ]
            if shipped == int8
            else []
        ),
        excluded=excluded,
        int16_tensors=list(inspect_tflite(shipped).int16_tensors) if shipped.name == MIXED else [],
        tflite_route=converted.route,
        warnings=stopped,
        vela=vela_record,
        vela_pure_int8=vela_pure_record,
    )


def tflite_sources(tflite: Path, converted: Converted, fp32: Path) -> dict[str, Source]:
    """{TFLite tensor: source}. The direct route's names are the torch module scopes; the
    onnx2tf route's go through its tensor map to the ONNX tensor, then to its module
    (quant.sources). The model's output tensor (``PartitionedCall:0``, no map entry) is
    paired with the ONNX output when both files have one. No map: no names (never an error)."""
    graph = op_graph(tflite)
    tensor_map = converted.tensor_map
    if tensor_map is None:
        return scoped_sources(graph, converted.module_paths)
    names = [name for _, _, outs in graph for name in outs]
    has_map = tensor_map.is_file()
    renamed = onnx_names(names, tensor_map) if has_map else {}
    model = onnx.load(str(fp32), load_external_data=False)
    outputs = [o.name for o in model.graph.output]
    ends = [name for name in names if name.startswith("PartitionedCall")]
    if len(outputs) == 1 and len(ends) == 1:
        renamed.setdefault(ends[0], outputs[0])
    return derived_sources(graph, onnx_sources(model), renamed)


def fallback_sources(
    shipped: Path,
    fallback_ops: list[str],
    sources: dict[str, Source],
    vela_cpu_ops: Sequence[OpRef] | None,
) -> list[schema.OpSource]:
    """Each op behind ``fallback_ops`` with its module: with Vela, the ops it leaves to the CPU
    (``vela_cpu_ops``, which ``fallback_ops`` names); the VX delegate's list is of op types,
    found in the shipped file."""
    if vela_cpu_ops is not None:
        return [
            schema.OpSource(op=op.op, name=op.output, module=label_of(sources, op.output))
            for op in vela_cpu_ops
        ]
    return [
        schema.OpSource(op=op, name=name, module=module)
        for op, name, module in placed_ops(op_graph(shipped), sources, set(fallback_ops))
    ]


def wide_fits(converted: Converted, job: TargetJob, rest_s: float, stopped: list[str]) -> bool:
    """Whether the 16x8 file can be made and measured in the job's time, costed before
    TensorFlow converts it: a conversion as long as the int8 file's, then a drift pass and the
    runs after it at ``WIDE_PER_FLOAT_SAMPLE`` times one float32 sample on the builtin kernels,
    then ``rest_s``. Without this, ViT-B/16's 16x8 file took 216 s to convert, three builds at
    once, before one sample of its own costed its drift pass at 1118 s and it was dropped. Not
    (and why, in ``stopped``) when they would not end in time; no budget, nothing to cost."""
    if job.deadline.at is None:
        return True
    sample_s = WIDE_PER_FLOAT_SAMPLE * _builtin_sample_s(converted.float32, job)
    make_s = converted.quantize_s + sample_s * len(job.evaluation)
    after_s = sample_s * WIDE_RUNS_AFTER_DRIFT + rest_s
    if job.deadline.allows(make_s, after_s):
        return True
    left = job.deadline.left()
    next_step = "the 16x8 file (its conversion and drift pass)"
    stopped.append(stop_note("the pure int8 file", next_step, make_s, left, after_s))
    return False


def _builtin_sample_s(path: Path, job: TargetJob) -> float:
    """One batch-1 run of ``path`` on LiteRT's builtin kernels, after one that allocates."""
    run = sample_runner(path, job.evaluation.rows(0, 1), builtin=True)
    run(0)
    started = time.monotonic()
    run(0)
    return time.monotonic() - started


def _wide(converted: Converted, job: TargetJob, out: Path, stopped: list[str]) -> Path | None:
    """The 16x8 file (every activation int16) made now, in the job's time, by the route that
    made the int8 one; a conversion that fails is a note in ``stopped``, not the target's
    failure: the int8 file is still there to ship."""
    timeout_s = min(job.deadline.left(), 900)
    try:
        if converted.direct is not None:
            return requantize(converted.direct, out, all_int16=True, timeout_s=timeout_s)
        if (blocked := int16x8_blocker(converted.onnx2tf)) is not None:
            stopped.append(f"no 16x8 fallback: {blocked}")
            return None
        made = convert_int16x8(converted.onnx2tf, timeout_s=timeout_s)
    except TfliteConversionError as exc:
        stopped.append(f"no 16x8 fallback: {exc}")
        return None
    if made.int16x8 is None:
        stopped.append(f"no 16x8 fallback: {made.notes[-1]}")
        return None
    return _keep(made.int16x8, out)


def _int16_count(shipped: Path, int8: Path) -> int:
    return 0 if shipped == int8 else len(inspect_tflite(shipped).int16_tensors)


# Each LiteRT measurement below is made once per job for a file (quant.measured_once): imx8mp
# then reads imx93's figures for the same int8 file. Keyed by the file alone: every target of a
# job has the same evaluation samples and fp32 reference.


def _drift(path: Path, job: TargetJob) -> Drift:
    def measure() -> dict:
        outputs = run_tflite(path, job.evaluation.feeds)
        return dataclasses.asdict(measure_drift(job.reference, outputs, job.evaluation.labels))

    return Drift(**measured_once(job.shared_dir, file_key("litert-drift", path), measure))


def wide_drift(path: Path, job: TargetJob, rest_s: float, stopped: list[str]) -> Drift | None:
    """The 16x8 file's drift, or None (and why, in ``stopped``) when its measurements would not
    end in time. LiteRT runs a 16x8 file far slower than its int8 one: ViT-B/16's 16x8 drift
    pass ran over 5 min, three builds at once, where the int8 file's took seconds, and the job
    ran past its timeout. So its runs are costed from one sample of its own, then the pass runs
    watching the deadline, less what would follow it."""
    started = time.monotonic()
    run_tflite(path, job.evaluation.rows(0, 1))
    sample_s = time.monotonic() - started
    after_s = sample_s * WIDE_RUNS_AFTER_DRIFT + rest_s
    drift_s = sample_s * len(job.evaluation)
    if not job.deadline.allows(drift_s, after_s):
        left = job.deadline.left()
        stopped.append(
            stop_note("the pure int8 file", "the 16x8 file's drift pass", drift_s, left, after_s)
        )
        return None
    try:
        with watching(job.deadline.less(after_s)):
            return _drift(path, job)
    except SearchStopped:
        stopped.append(cut_note("the pure int8 file", "the 16x8 file's drift pass", after_s))
        return None


def _sqnr(shipped: Path, float32: Path, job: TargetJob) -> list[tuple[str, str, float]]:
    def measure() -> list[tuple[str, str, float]]:
        return tensor_sqnr_tflite(shipped, float32, job.evaluation.feeds)

    key = file_key("litert-sqnr", shipped)
    return [tuple(error) for error in measured_once(job.shared_dir, key, measure)]


def _latency(shipped: Path, name: str, threads: int, job: TargetJob) -> schema.Latency:
    def measure() -> dict:
        sample = job.evaluation.rows(0, 1)
        timing = latency_tflite(shipped, sample, threads, runs=job.latency_runs)
        return {"timing": dataclasses.asdict(timing), "ops": xnnpack_ops(shipped, threads)}

    key = file_key("litert-latency", shipped, threads, job.latency_runs)
    measured = measured_once(job.shared_dir, key, measure)
    ops = {op: tuple(counts) for op, counts in measured["ops"].items()}
    return latency_record(Timing(**measured["timing"]), "litert", name, ops)


def _keep(produced: Path, destination: Path) -> Path:
    shutil.move(str(produced), destination)
    return destination


def _exclusion(wide: Drift, step: int) -> schema.Exclusion:
    return schema.Exclusion(
        step=step,
        action="16-bit activations for the whole model (16x8: int8 weights, int16 activations)",
        tensors=["all activations"],
        top1_drop_pts=wide.top1_drop_pts,
        agreement=wide.agreement,
    )


def _vela_record(vela: VelaResult) -> schema.Vela:
    return schema.Vela(
        accelerator=vela.accelerator,
        system_config=vela.system_config,
        memory_mode=vela.memory_mode,
        npu_ops=vela.npu_ops,
        cpu_ops=list(vela.cpu_ops),
        sram_kib=vela.sram_kib,
        dram_kib=vela.dram_kib,
        cycles=vela.cycles,
        est_ms=vela.est_ms,
    )


def _vela_cost(wide: VelaResult, pure: VelaResult) -> str:
    moved = len(wide.cpu_ops) - len(pure.cpu_ops)
    return (
        f"Vela: {wide.cycles:,} NPU cycles ({wide.est_ms:.3f} ms) vs {pure.cycles:,} "
        f"({pure.est_ms:.3f} ms) for pure int8, and {moved} more ops on the CPU "
        "(Ethos-U takes int16 BATCH_MATMUL/GELU inputs only from int8)"
    )
