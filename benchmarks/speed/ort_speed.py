"""The cpu target's int8 recipe for ONNX Runtime, change by change: predicted and measured effect,
and where the time goes at 1 and 2 threads, batch 1 and 8.

    .venv/bin/python -m benchmarks.speed.ort_speed                # ~15 min on 2 cores
    .venv/bin/python -m benchmarks.speed.ort_speed --report-only  # Markdown and plot from the JSON

Each step adds one change to the one before (``STEPS``; the last is the cpu target's profile,
``quant.targets.PROFILES["cpu"]``); every step's file is made by
``quant.ort.quantize.quantize_onnx`` from the same fp32 ONNX and calibration samples. Models:
ViT-Tiny UN and LN (random weights, the inputs of ``benchmarks.speed.latency``: timing only) and the
bundled trained examples, the Hugging Face ones included (timing, and drift on their held-out test
split against the fp32 ONNX, in the file's exact arithmetic, on which the drift bars act, and on
this host's int8 kernels).

Latency, batch 1, one thread: all steps of a model (and its fp32 file) in one process,
round-robin for ``ROUNDS`` rounds so that machine drift hits all alike; median and p90 of every
call. ``ALTERNATIVES``: levers measured the same way and not taken (there). Threads and
batch: ViT-Tiny LN fp32 torch eager, UN fp32 ORT, and the UN int8 files before and after this
issue's levers, each in a ``benchmarks.speed.latency_probe`` process, round-robin over batch 1 and 8
at 1 and 2 threads. The same run times this machine's int8 GEMM peak (1024^3,
``latency_ops.peak_graphs``) and profiles the ViT-Tiny files with ORT's profiler (kernel time
by op type, at every thread count and batch), which locates what is left. Predictions were
written before each step was measured, from the op profile of the step before and, for the
attention products, from the kernels timed alone at ViT-Tiny's shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.common.results import benchmark_main
from benchmarks.speed.latency import SCRATCH, Probe, clock_of, model_files
from benchmarks.speed.latency import interleaved as probe_rounds
from benchmarks.speed.latency_ops import count_macs, peak_graphs
from benchmarks.speed.ort_speed_report import markdown, plot, summary
from converters.attention_masks import bound_attention_masks
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from quant.host import describe_host
from quant.measure.bars import DEFAULT_BARS
from quant.measure.drift import measure_drift, onnx_runner
from quant.measure.emulation import NON_VNNI_CPU, QEMU, qemu_available
from quant.ort.quantize import quantize_onnx
from quant.prepare import input_specs
from quant.samples import CALIBRATION_SAMPLES, Feeds, Samples, as_feeds, checkpoint_samples
from quant.targets import PROFILES, TargetProfile

NAME = "ort_speed"
TINY = ("vit-tiny-un", "vit-tiny-ln")
EXAMPLES = (
    "vit-mnist-un", "vit-mnist-ln", "vit-mnist-ln-to-un", "text-rt-un", "text-rt-ln",
    "hf-vit-mnist-un", "hf-bert-rt-un",
)  # fmt: skip
ROUNDS, CALLS, PROFILE_CALLS = 30, 10, 30  # many short rounds: this VM drifts over seconds
SETTINGS = ((1, 1), (2, 1), (1, 8), (2, 8))  # (threads, batch) of the threads-and-batch table
PROBE_ROUNDS = 6
WORK = SCRATCH / "ort-speed"


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    gemm_linears: bool
    float_inputs: tuple[str, ...]
    fold_factors: bool  # with shapes_of_quantized: work done only to be thrown away
    signed_right_operands: bool
    predicted_pct: float | None  # latency change vs the step before, % of step 0
    why: str


STEPS = (
    Step("QDQ as quantize_static writes it", False, (), False, False, None,
         "the recipe before issue 9"),
    Step("+ Linear as Gemm (bias in QGemm)", True, (), False, False, -7.0,
         "48 of the 73 QLinearAdd (10 % of kernel time) are biases; they move into QGemm's int32 "
         "bias; the 96 Reshapes added are views"),
    Step("+ Softmax fed in float", True, ("Softmax",), False, False, -16.0,
         "QLinearSoftmax is 21 % of kernel time (~2.6 ns a value); ORT's float Softmax of the "
         "same 1.4 M values should cost about a fifth; the score MatMul writes float instead"),
    Step("+ GELU fed in float", True, ("Softmax", "Gelu"), False, False, -3.0,
         "skips fc1's requantize and the DequantizeLinear before each GELU (2.8 % of kernel "
         "time for all DequantizeLinear)"),
    Step("+ q scale folded into a dequantize scale; Shape of the quantized image", True,
         ("Softmax", "Gelu"), True, False, -1.5,
         "the 12 QLinearMul of q * 0.125 are 1.3 % of kernel time; the image's DequantizeLinear, "
         "kept only for a Shape, 0.3 % (1.3 % at batch 8, on one thread)"),
    Step("+ K, V s8 in 7 bits (u8 x s8 attention products)", True, ("Softmax", "Gelu"), True,
         True, -8.0,
         "the 24 attention products (MatMulIntegerToFloat, QLinearMatMul: 20 % of kernel time) "
         "run on ORT's U8U8 kernels; timed alone at ViT-Tiny's shapes, u8 x s8 is 1.8x faster "
         "(VNNI); the Clip and QuantizeLinear of K and V after a float Split cost ~1 %. Only "
         "products of >= 1 M multiply-adds a sample (ViT-Tiny's: 7.4 M; the bundled examples': "
         "0.15-0.26 M, left as they are: see their not-taken row)"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A lever measured like the steps, on top of ``STEPS[base]``, and not taken."""

    label: str
    base: int
    kind: str
    models: tuple[str, ...]


ALTERNATIVES = (
    Alternative("attention as com.microsoft MultiHeadAttention (float; onnxscript's fusion)", 3,
                "mha", ("vit-tiny-un",)),
    Alternative("K, V s8 however small the product (signed_min_macs = 0)", len(STEPS) - 1,
                "every_product_signed", EXAMPLES),
)  # fmt: skip
BEFORE_ISSUE_32 = 3  # the cpu file of issue 9, beside the cpu file in the threads table


def profile_of(step: Step) -> TargetProfile:
    return dataclasses.replace(
        PROFILES["cpu"],
        gemm_linears=step.gemm_linears,
        float_inputs=frozenset(step.float_inputs),
        fold_factors=step.fold_factors,
        shapes_of_quantized=step.fold_factors,
        signed_right_operands=step.signed_right_operands,
    )


assert profile_of(STEPS[-1]) == PROFILES["cpu"], "the last step is the cpu target's profile"


@dataclasses.dataclass(frozen=True)
class ModelData:
    fp32: Path
    calibration: Samples
    evaluation: Samples | None  # None: random weights, timing only
    timing: Feeds  # 32 rows (ViT-Tiny) or one


def model_data(name: str) -> ModelData:
    """The fp32 ONNX (opset 21, dynamic batch, masks bounded as the pipeline bounds them) and
    the samples of one model."""
    directory = WORK / name
    directory.mkdir(parents=True, exist_ok=True)
    fp32 = directory / "fp32.onnx"
    if name in TINY:
        checkpoint, calib, inputs = model_files(name, SCRATCH)
        if not fp32.exists():
            folded = load_and_fold(checkpoint, allow_online=name.endswith("-ln"))
            export_folded(folded, fp32, opset=21, dynamic_batch=True)
        return ModelData(fp32, Samples(as_feeds(calib), None, "random"), None, as_feeds(inputs))
    folded = load_and_fold(examples.path(name), allow_online=name.endswith("-ln"))
    specs = input_specs(folded)
    if not fp32.exists():
        export_folded(folded, fp32, opset=21, dynamic_batch=True)
        proto = onnx.load(str(fp32))
        bound_attention_masks(proto)
        onnx.save_model(proto, str(fp32))
    evaluation = checkpoint_samples(folded.info, "test", specs=specs)
    calibration = checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES, specs)
    return ModelData(fp32, calibration, evaluation, evaluation.rows(0, 1))


def session(path: Path, threads: int = 1, profile: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.enable_profiling = profile
    if profile:
        options.profile_file_prefix = str(WORK / "profile")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feed(sess: ort.InferenceSession, feeds: Feeds, batch: int) -> dict[str, np.ndarray]:
    names = [value.name for value in sess.get_inputs()]
    values = list(feeds.values())
    if len(names) == 1 and len(values) == 1:
        return {names[0]: np.ascontiguousarray(values[0][:batch])}
    return {name: np.ascontiguousarray(feeds[name][:batch]) for name in names}


def op_profile(path: Path, feeds: Feeds, threads: int = 1, batch: int = 1) -> dict[str, float]:
    """Kernel time per op type, ms per inference (ORT's profiler adds its own overhead)."""
    return profile_trace(path, feeds, threads, batch)[0]


def profile_trace(
    path: Path, feeds: Feeds, threads: int, batch: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(kernel time per op type in ms per inference, the share of each op type's nodes that
    handed work to ORT's thread pool: the profiler's ``thread_scheduling_stats``, which do not
    depend on how busy the machine is)."""
    sess = session(path, threads, profile=True)
    inputs = feed(sess, feeds, batch)
    calls = max(5, PROFILE_CALLS // batch)
    for _ in range(calls):
        sess.run(None, inputs)
    trace = Path(sess.end_profiling())
    totals: Counter = Counter()
    nodes: Counter = Counter()
    pooled: Counter = Counter()
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            totals[op] += event["dur"]
            nodes[op] += 1
            pooled[op] += _used_the_pool(event["args"].get("thread_scheduling_stats"))
    trace.unlink()
    times = {op: round(us / calls / 1e3, 4) for op, us in totals.most_common()}
    return times, {op: round(pooled[op] / nodes[op], 3) for op in times}


def _used_the_pool(stats: object) -> bool:
    """Whether a node's scheduling stats (a dict, or its JSON text) show parallel work."""
    if isinstance(stats, str):
        stats = json.loads(stats) if stats.strip().startswith("{") else {}
    main = stats.get("main_thread", {}) if isinstance(stats, dict) else {}
    return bool(main.get("block_size"))


def in_process_rounds(files: dict[str, Path], feeds: Feeds) -> dict[str, dict[str, float]]:
    """p50/p90 ms of each file, batch 1, one thread, round-robin over ``ROUNDS`` rounds: the
    calling thread's CPU time (``CLOCK``), and the wall time's p50 beside it."""
    sessions = {key: session(path) for key, path in files.items()}
    inputs = {key: feed(sess, feeds, 1) for key, sess in sessions.items()}
    cpu: dict[str, list[float]] = {key: [] for key in files}
    wall: dict[str, list[float]] = {key: [] for key in files}
    keys = list(sessions)
    for round_ in range(ROUNDS):
        for key in keys[round_ % len(keys) :] + keys[: round_ % len(keys)]:
            for _ in range(3):
                sessions[key].run(None, inputs[key])
            for _ in range(CALLS):
                start, start_cpu = time.perf_counter(), time.thread_time()
                sessions[key].run(None, inputs[key])
                cpu[key].append(time.thread_time() - start_cpu)
                wall[key].append(time.perf_counter() - start)
    return {
        key: {
            "p50_ms": round(1e3 * float(np.median(v)), 4),
            "p90_ms": round(1e3 * float(np.percentile(v, 90)), 4),
            "wall_p50_ms": round(1e3 * float(np.median(wall[key])), 4),
        }
        for key, v in cpu.items()
    }


def int8_peak() -> dict[str, dict[str, float]]:
    """GMAC/s of the 1024^3 integer products (the latency benchmark's peak graphs), 1 and 2
    threads, the median of ``ROUNDS`` calls each (1 thread: its CPU time, as the models')."""
    peaks: dict[str, dict[str, float]] = {}
    for label, (path, inputs, dtype) in peak_graphs(WORK / "peak").items():
        if dtype != "int8":
            continue
        for threads in (1, 2):
            sess = session(path, threads)
            inputs_ = {sess.get_inputs()[0].name: np.load(inputs)}
            sess.run(None, inputs_)
            times = []
            clock = time.thread_time if threads == 1 else time.perf_counter  # as the models'
            for _ in range(ROUNDS):
                start = clock()
                sess.run(None, inputs_)
                times.append(clock() - start)
            gmacs = 1024**3 / float(np.median(times)) / 1e9
            peaks.setdefault(label, {})[f"t{threads}"] = round(gmacs, 1)
    return peaks


def drift_record(evaluation: Samples, path: Path, reference: np.ndarray) -> dict[str, Any]:
    """Drift in the file's exact arithmetic (the bars act on it) and on this host's kernels."""
    drifts = {
        arithmetic: measure_drift(
            reference, onnx_runner(path, exact=exact)(evaluation.feeds), evaluation.labels
        )
        for arithmetic, exact in (("exact", True), ("host", False))
    }
    return {
        **{arithmetic: dataclasses.asdict(drift) for arithmetic, drift in drifts.items()},
        "within_bars": drifts["exact"].within(DEFAULT_BARS),
    }


def step_files(name: str, data: ModelData) -> dict[str, Path]:
    files = {}
    for number, step in enumerate(STEPS):
        path = WORK / name / f"step{number}.onnx"
        quantize_onnx(data.fp32, path, profile_of(step), data.calibration)
        files[f"step{number}"] = path
    return files


def alternative_file(alternative: Alternative, name: str, data: ModelData) -> Path:
    """The model through an alternative lever, on top of ``STEPS[alternative.base]``."""
    path = WORK / name / f"alternative_{alternative.kind}.onnx"
    profile = profile_of(STEPS[alternative.base])
    if alternative.kind == "every_product_signed":
        quantize_onnx(data.fp32, path, dataclasses.replace(profile, signed_min_macs=0),
                      data.calibration)  # fmt: skip
        return path
    assert alternative.kind == "mha", alternative.kind
    import onnx_ir as ir
    from onnx_ir.passes.common import ShapeInferencePass
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions.mha import fuse_mha1, fuse_mha2
    from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa

    model = ir.load(str(data.fp32))
    ShapeInferencePass()(model)
    optimize(model)
    fused = fuse_sdpa(model, apply_shape_inference=True) and fuse_mha1(model) + fuse_mha2(model)
    assert fused, "onnxscript fused no attention"
    fp32 = WORK / name / "fp32_mha.onnx"
    ir.save(model, str(fp32))
    quantize_onnx(fp32, path, profile, data.calibration)
    return path


def run_model(name: str) -> dict[str, Any]:
    data = model_data(name)
    files = {"fp32": data.fp32, **step_files(name, data)}
    alternatives = [a for a in ALTERNATIVES if name in a.models]
    files |= {f"alt:{a.kind}": alternative_file(a, name, data) for a in alternatives}
    evaluation = data.evaluation
    reference = None if evaluation is None else onnx_runner(data.fp32)(evaluation.feeds)
    steps: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    for key, path in files.items():
        if key == "fp32":
            continue
        label = STEPS[int(key[4:])].name if key.startswith("step") else key
        record: dict[str, Any] = {"step": label, "file_kib": round(path.stat().st_size / 1024)}
        if evaluation is not None and reference is not None:
            record["drift"] = drift_record(evaluation, path, reference)
        (steps if key.startswith("step") else others).append(record)
    latency = in_process_rounds(files, data.timing)
    for number, record in enumerate(steps):
        record["latency"] = latency[f"step{number}"]
    for alternative, record in zip(alternatives, others, strict=True):
        record |= {"step": alternative.label, "base": alternative.base,
                   "latency": latency[f"alt:{alternative.kind}"]}  # fmt: skip
    result: dict[str, Any] = {
        "macs": count_macs(data.fp32),
        "fp32_latency": latency["fp32"],
        "steps": steps,
        "alternatives": others,
    }
    if name in TINY:
        last = f"step{len(STEPS) - 1}"
        result["op_profile"] = {key: op_profile(files[key], data.timing) for key in ("step0", last)}
    return result


def threads_and_batch() -> dict[str, Any]:
    """ViT-Tiny at batch 1 and 8, 1 and 2 threads: LN fp32 torch eager, UN fp32 ORT, the UN
    int8 file before this issue's levers and the cpu file, each in a probe process, round-robin;
    and each ORT file's kernel time per op type at every setting."""
    un = model_data("vit-tiny-un")
    inputs = WORK / "vit-tiny-inputs.npy"
    np.save(inputs, next(iter(un.timing.values())))
    last = len(STEPS) - 1
    files = {
        "UN folded fp32 ORT": un.fp32,
        f"UN int8 ORT, step {BEFORE_ISSUE_32}": WORK
        / "vit-tiny-un"
        / f"step{BEFORE_ISSUE_32}.onnx",
        "UN int8 ORT, cpu file": WORK / "vit-tiny-un" / f"step{last}.onnx",
    }
    probes = {
        "LN fp32 torch eager": Probe(
            "torch", str(model_files("vit-tiny-ln", SCRATCH)[0]), str(inputs)
        )
    }
    probes |= {label: Probe("ort", str(path), str(inputs)) for label, path in files.items()}
    settings = [(t, b, 0.6 if b == 1 else 2.0, 3 if b == 1 else 1) for t, b in SETTINGS]
    try:
        pooled = probe_rounds(probes, settings, PROBE_ROUNDS, min_runs=3, clock=clock_of)
    finally:
        for probe in probes.values():
            probe.close()
    timings = {
        label: {
            key: {
                "p50_ms": round(float(np.median(v)), 3),
                "clock": clock_of(int(key.rsplit("_t", 1)[1])),
                "runs": len(v),
            }
            for key, v in per.items()
        }
        for label, per in pooled.items()
    }
    profiles: dict[str, dict[str, Any]] = {}
    pool: dict[str, dict[str, Any]] = {}
    for label, path in files.items():
        for threads, batch in SETTINGS:
            key = f"b{batch}_t{threads}"
            times, shares = profile_trace(path, un.timing, threads, batch)
            profiles.setdefault(label, {})[key] = times
            if threads > 1:
                pool.setdefault(label, {})[key] = shares
    return {"timings": timings, "op_profiles": profiles, "thread_pool_share": pool}


# Runs under QEMU: the graph ONNX Runtime makes of a file on the emulated CPU, written to a file.
_OPTIMIZE = """
import sys
import onnxruntime as ort
options = ort.SessionOptions()
options.optimized_model_filepath = sys.argv[2]
options.log_severity_level = 3
ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
"""


def integer_products(model: onnx.ModelProto) -> dict[str, int]:
    """How many of each integer kernel the optimized graph holds, by its right operand's type."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    types |= {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    zero_points = {"QGemm": 5, "MatMulIntegerToFloat": 5, "QLinearMatMul": 5, "QLinearConv": 5}
    found: Counter = Counter()
    for node in model.graph.node:
        if node.op_type in zero_points:
            kind = onnx.helper.tensor_dtype_to_np_dtype(
                types[node.input[zero_points[node.op_type]]]
            )
            found[f"{node.op_type} x {np.dtype(kind).name}"] += 1
    return dict(sorted(found.items()))


def kernels_here_and_without_vnni(path: Path) -> dict[str, Any]:
    """The integer kernels of the file's optimized graph on this host and, when QEMU is
    installed, on an emulated Haswell (AVX2, no VNNI): what runs there, not how fast."""
    result = {}
    with tempfile.TemporaryDirectory() as scratch:
        here, there = Path(scratch) / "here.onnx", Path(scratch) / "haswell.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(here)
        options.log_severity_level = 3
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        result["this host"] = integer_products(onnx.load(str(here)))
        if qemu_available():
            command = [QEMU, "-cpu", NON_VNNI_CPU, sys.executable, "-c", _OPTIMIZE, str(path),
                       str(there)]  # fmt: skip
            subprocess.run(command, capture_output=True, check=True, timeout=600)
            result[f"QEMU {NON_VNNI_CPU}"] = integer_products(onnx.load(str(there)))
    return result


def run() -> dict[str, Any]:
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "host": describe_host().label(),
        "onnxruntime": ort.__version__,
        "rounds": ROUNDS,
        "calls": CALLS,
        "steps": [dataclasses.asdict(step) for step in STEPS],
        "alternatives": [dataclasses.asdict(a) for a in ALTERNATIVES],
        "models": {},
    }
    first_peak = int8_peak()
    for name in (*TINY, *EXAMPLES):
        print(f"[{time.time() - started:5.0f} s] {name}", flush=True)
        result["models"][name] = run_model(name)
    print(f"[{time.time() - started:5.0f} s] threads and batch", flush=True)
    result["threads_and_batch"] = threads_and_batch()
    result["kernels"] = {
        f"step{number}": kernels_here_and_without_vnni(WORK / "vit-tiny-un" / f"step{number}.onnx")
        for number in (BEFORE_ISSUE_32, len(STEPS) - 1)
    }
    # measured before and after the models: the higher of the two, the less disturbed
    last_peak = int8_peak()
    result["int8_peak_gmacs"] = {
        label: {key: max(value, last_peak[label][key]) for key, value in peaks.items()}
        for label, peaks in first_peak.items()
    }
    result["int8_peak_gmacs_runs"] = [first_peak, last_peak]
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["summary"] = summary(result)
    result["total_s"] = round(time.time() - started, 1)
    return result


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
