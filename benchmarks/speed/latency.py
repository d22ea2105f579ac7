"""Latency, memory and conversion time of UN vs its LayerNorm twin, and this machine's limit.

    .venv/bin/python -m benchmarks.speed.latency            # everything, ~25 min on 2 cores
    .venv/bin/python -m benchmarks.speed.latency --quick    # vit-mnist only, fewer rounds (a test)
    .venv/bin/python -m benchmarks.speed.latency --report-only   # Markdown and plots from the JSON
    .venv/bin/python -m benchmarks.speed.latency --pairs vit-tiny --no-stages   # a part of it

A run of only some pairs, or without the pipeline stages, or ``--quick``, writes its own files
(``latency_vit-tiny_no-stages.json``...; ``results_name``), never over the whole run's.

Models: ViT-Tiny (224x224 RGB, patch 16, dim 192, depth 12, heads 3, random weights: timing
only) as an LN twin and a UN model, and the bundled examples vit-mnist-ln/-un, text-rt-ln/-un.
Artifacts are made with the project's own code: ``converters.fold_and_export`` (fold, export at
opset 21 with a dynamic batch for ONNX Runtime, opset 20 batch 1 for TFLite), ``quant.ort.quantize``
(the ``cpu`` target's settings: QDQ, per-channel s8 weights, u8 activations, MinMax),
``quant.tflite.onnx2tf.convert_tflite`` (onnx2tf + TensorFlow's converter, full int8 and its fp32
file) and ``quant.tflite.vela`` (imx93's Ethos-U65-256 config).

Each configuration runs in a probe process of its own (``latency_probe``), all probes of a
model alive at once; the parent goes round-robin over configurations for several rounds, so
drift of the machine hits all alike: batch 1 with 1 and 2 threads first, then each probe's
peak RSS is read, then batch 32 with 2 threads. The int8 and fp32 matrix-multiply peaks (a
1024^3 MatMul / MatMulInteger / QLinearMatMul through ONNX Runtime, 1 and 2 threads) are
measured the same way before and after the models. Then ``quant.pipeline.convert`` (all
targets) runs on each UN model in a fresh process, timed stage by stage (``latency_stages``).
Writes benchmarks/results/latency.json, latency.md and latency_*.png (``latency_report``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import edge_un
from benchmarks.common.results import RESULTS, ROOT
from benchmarks.speed.latency_ops import PEAK_SIZE, count_macs, peak_graphs
from benchmarks.speed.latency_report import write_report
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from edge_un.models import VisionTransformer
from quant.host import describe_host
from quant.measure.latency import thread_counts
from quant.ort.quantize import quantize_onnx
from quant.samples import CALIBRATION_SAMPLES, Samples, as_feeds, checkpoint_samples
from quant.targets import PROFILES
from quant.tflite.onnx2tf import convert_tflite
from quant.tflite.vela import compile_vela

SCRATCH = ROOT / "build" / "latency-bench"
PROBE = [sys.executable, "-m", "benchmarks.speed.latency_probe"]
STAGES = [sys.executable, "-m", "benchmarks.speed.latency_stages"]
TINY = {
    "img_size": 224,
    "in_chans": 3,
    "patch_size": 16,
    "dim": 192,
    "depth": 12,
    "heads": 3,
    "mlp_ratio": 4.0,
    "num_classes": 1000,
    "pool": "cls",
}
PAIRS = {
    "vit-tiny": ("vit-tiny-ln", "vit-tiny-un"),
    "vit-mnist": ("vit-mnist-ln", "vit-mnist-un"),
    "text-rt": ("text-rt-ln", "text-rt-un"),
}
# (name, norm, runtime kind, artifact key): the configurations, in table order.
CONFIGS = (
    ("LN fp32 torch eager", "ln", "torch", "checkpoint"),
    ("LN fp32 ORT", "ln", "ort", "fp32_onnx"),
    ("UN folded fp32 ORT", "un", "ort", "fp32_onnx"),
    ("LN int8 ORT", "ln", "ort", "int8_onnx"),
    ("UN int8 ORT", "un", "ort", "int8_onnx"),
    ("LN int8 LiteRT", "ln", "litert", "int8_tflite"),
    ("UN int8 LiteRT", "un", "litert", "int8_tflite"),
    ("LN fp32 LiteRT", "ln", "litert", "fp32_tflite"),
    ("UN fp32 LiteRT", "un", "litert", "fp32_tflite"),
)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- artifacts


def model_files(name: str, work: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """(checkpoint, calibration inputs, timing inputs: 32 samples) of one model."""
    if name.startswith("vit-tiny"):
        path = work / f"{name}.safetensors"
        if not path.exists():
            torch_seed = 0
            import torch

            torch.manual_seed(torch_seed)
            model = VisionTransformer(**TINY, norm=name.rsplit("-", 1)[1]).eval()
            edge_un.save_checkpoint(model, path, metadata={"note": "random weights, timing only"})
        rng = np.random.default_rng(0)
        calib = rng.standard_normal((32, 3, 224, 224), dtype=np.float32)
        return path, calib, rng.standard_normal((32, 3, 224, 224), dtype=np.float32)
    path = examples.path(name)
    _, info = edge_un.load_checkpoint(path)
    calib = checkpoint_samples(info, "train", CALIBRATION_SAMPLES).inputs
    return path, calib, checkpoint_samples(info, "test").inputs[:32]


def build_artifacts(name: str, work: Path, reuse: bool) -> dict[str, Any]:
    """Fold/export, int8 ONNX, int8 and fp32 TFLite, Vela, for one model; times each step."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    checkpoint, calib, inputs = model_files(name, work)
    np.save(out / "inputs.npy", inputs)
    files = {
        "checkpoint": checkpoint,
        "fp32_onnx": out / "fp32_opset21_dynamic.onnx",
        "fp32_b1_onnx": out / "fp32_opset20_b1.onnx",
        "int8_onnx": out / "int8_cpu.onnx",
        "int8_tflite": out / "tflite" / "model_int8.tflite",
        "fp32_tflite": out / "tflite" / "model_float32.tflite",
    }
    seconds: dict[str, float] = {}
    if not (reuse and all(p.exists() for p in files.values())):
        t0 = time.perf_counter()
        folded = load_and_fold(checkpoint, allow_online=name.endswith("-ln"))
        export_folded(folded, files["fp32_onnx"], opset=21, dynamic_batch=True)
        export_folded(folded, files["fp32_b1_onnx"], opset=20, dynamic_batch=False)
        t1 = time.perf_counter()
        quantize_onnx(
            files["fp32_onnx"],
            files["int8_onnx"],
            PROFILES["cpu"],
            Samples(as_feeds(calib), None, "calibration"),
        )
        t2 = time.perf_counter()
        # No LiteRT smoke run: the probes run the int8 and fp32 files.
        convert_tflite(files["fp32_b1_onnx"], calib, out / "tflite", smoke_run=False)
        seconds = {
            "fold_export": t1 - t0,
            "ort_quantize": t2 - t1,
            "tflite": time.perf_counter() - t2,
        }
    vela = compile_vela(files["int8_tflite"], out / "vela")
    return {
        "files": {k: str(v) for k, v in files.items()},
        "inputs": str(out / "inputs.npy"),
        "size_kib": {k: round(v.stat().st_size / 1024, 1) for k, v in files.items()},
        "prep_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "macs": count_macs(files["fp32_onnx"]),
        "vela": {
            "cycles": vela.cycles,
            "npu_cycles": vela.npu_cycles,
            "est_ms": vela.est_ms,
            "npu_ops": vela.npu_ops,
            "cpu_ops": len(vela.cpu_ops),
            "macs": vela.macs,
            "sram_kib": vela.sram_kib,
            "dram_kib": vela.dram_kib,
            "system_config": vela.system_config,
            "memory_mode": vela.memory_mode,
            "accelerator": vela.accelerator,
        },
    }


# ---------------------------------------------------------------- interleaved timing


class Probe:
    """One configuration's ``latency_probe`` process, asked one JSON command at a time."""

    def __init__(self, kind: str, model: str, inputs: str) -> None:
        self.proc = subprocess.Popen(
            [*PROBE, kind, model, inputs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self.read()

    def read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"probe {self.proc.args[len(PROBE) : len(PROBE) + 2]} died")
        return json.loads(line)

    def ask(self, **command: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.write('{"exit": true}\n')
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def summarize(samples: list[float], batch: int) -> dict[str, float]:
    p50, p90 = np.percentile(samples, [50, 90])
    return {
        "p50_ms": round(float(p50), 4),
        "p90_ms": round(float(p90), 4),
        "throughput_per_s": round(1e3 * batch / float(p50), 2),
        "runs": len(samples),
    }


def clock_of(threads: int) -> str:
    """The probe's figure a setting is read from: 1 thread, the calling thread's CPU time (all
    of the work, whatever else shares the cores); 2 threads, wall time."""
    return "cpu_ms" if threads == 1 else "samples_ms"


def interleaved(
    probes: dict[str, Probe],
    settings: list[tuple[int, int, float, int]],
    rounds: int,
    min_runs: int = 5,
    clock: Callable[[int], str] = lambda threads: "samples_ms",
) -> dict[str, dict[str, list[float]]]:
    """Round-robin: in each round every setting, in it every probe (the order rotates).
    ``clock``: which of the probe's figures to pool for a thread count (wall time, or
    ``cpu_ms``)."""
    pooled: dict[str, dict[str, list[float]]] = {name: {} for name in probes}
    names = list(probes)
    for r in range(rounds):
        for threads, batch, budget, warmup in settings:
            key = f"b{batch}_t{threads}"
            for name in names[r % len(names) :] + names[: r % len(names)]:
                first = warmup if r == 0 else 1
                reply = probes[name].ask(
                    threads=threads, batch=batch, budget_s=budget, warmup=first, min_runs=min_runs
                )
                pooled[name].setdefault(key, []).extend(reply[clock(threads)])
    return pooled


def measure_peaks(graphs: dict[str, tuple[Path, Path, str]], rounds: int) -> dict[str, Any]:
    probes = {name: Probe("ort", str(p), str(i)) for name, (p, i, _) in graphs.items()}
    try:
        settings = [(t, 1, 0.4, 2) for t in thread_counts()]
        pooled = interleaved(probes, settings, rounds, clock=clock_of)  # the models' clocks
    finally:
        for probe in probes.values():
            probe.close()
    macs = PEAK_SIZE**3
    result: dict[str, Any] = {}
    for name, per in pooled.items():
        for key, samples in per.items():
            p50 = float(np.median(samples))
            result.setdefault(name, {})[key] = {
                "p50_ms": round(p50, 3),
                "gmacs": round(macs / p50 / 1e6, 1),
            }
    return result


def measure_pair(
    pair: str, artifacts: dict[str, dict], rounds: int, budget: float, b32_budget: float
) -> dict[str, Any]:
    ln, un = PAIRS[pair]
    names = {"ln": ln, "un": un}
    probes: dict[str, Probe] = {}
    try:
        for label, norm, kind, key in CONFIGS:
            art = artifacts[names[norm]]
            probes[label] = Probe(kind, art["files"][key], art["inputs"])
        b1_settings = [(t, 1, budget, 5) for t in thread_counts()]
        b1 = interleaved(probes, b1_settings, rounds, clock=clock_of)
        rss_b1 = {n: p.ask(rss=True)["maxrss_mb"] for n, p in probes.items()}
        b32_settings = [(t, 32, b32_budget, 1) for t in thread_counts()]
        b32 = interleaved(probes, b32_settings, max(2, rounds - 2), 2, clock=clock_of)
        rss_all = {n: p.ask(rss=True)["maxrss_mb"] for n, p in probes.items()}
        # the ops XNNPACK's delegate took in each TFLite file, read from the probe's interpreter
        xnnpack = {n: p.ask(xnnpack=True)["xnnpack"] for n, p in probes.items()}
    finally:
        for probe in probes.values():
            probe.close()
    rows = {}
    for label, norm, kind, key in CONFIGS:
        art = artifacts[names[norm]]
        timings = {k: summarize(v, 1) for k, v in b1[label].items()}
        timings.update({k: summarize(v, 32) for k, v in b32[label].items()})
        rows[label] = {
            "model": names[norm],
            "runtime": kind,
            "artifact": Path(art["files"][key]).name,
            "size_kib": art["size_kib"][key],
            "macs": art["macs"],
            "timing": timings,
            "rss_imports_mb": round(probes[label].ready["base_rss_mb"], 1),
            "peak_rss_b1_mb": round(rss_b1[label], 1),
            "peak_rss_mb": round(rss_all[label], 1),
            "xnnpack_ops": xnnpack[label],
        }
    return rows


# ---------------------------------------------------------------- pipeline stages


def pipeline_stages(name: str, work: Path, calib: np.ndarray) -> dict[str, Any]:
    """``quant.pipeline.convert`` with every target on one UN model, in a fresh process."""
    out, result = work / "convert" / name, work / "convert" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*STAGES, str(model_files(name, work)[0]), str(out), str(result)]
    if name.startswith("vit-tiny"):  # random weights: no data set, drift bars meaningless
        rng = np.random.default_rng(1)
        np.savez(work / "tiny_calib.npz", inputs=calib)
        np.savez(
            work / "tiny_eval.npz", inputs=rng.standard_normal((100, 3, 224, 224), dtype=np.float32)
        )
        cmd += [
            "--calib",
            str(work / "tiny_calib.npz"),
            "--eval",
            str(work / "tiny_eval.npz"),
            "--max-drift",
            "100",
            "--min-agreement",
            "0",
        ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        why = "killed (SIGKILL: out of memory?)" if proc.returncode == -9 else proc.stderr[-300:]
        return {
            "error": f"exit {proc.returncode}: {why}",
            "wall_s": round(time.perf_counter() - start, 1),
        }
    data = json.loads(result.read_text())
    data["wall_s"] = round(time.perf_counter() - start, 1)
    return data


# ---------------------------------------------------------------- main


def results_name(pairs: list[str], stages: bool, quick: bool) -> str:
    """``latency`` for the whole run; a part of it names what it left out or shortened."""
    parts = [] if pairs == list(PAIRS) else list(pairs)
    parts += ([] if stages else ["no-stages"]) + (["quick"] if quick else [])
    return "_".join(["latency", *parts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vit-mnist only, fewer rounds")
    parser.add_argument("--pairs", nargs="+", choices=list(PAIRS), help="only these models")
    parser.add_argument("--no-stages", action="store_true", help="no pipeline stage timing")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep artifacts already built")
    args = parser.parse_args()

    pairs = args.pairs or (["vit-mnist"] if args.quick else list(PAIRS))
    stem = results_name(pairs, not args.no_stages, args.quick)
    json_path = RESULTS / f"{stem}.json"
    if args.report_only:
        write_report(json.loads(json_path.read_text()), RESULTS, stem)
        return
    rounds, budget, b32_budget = (2, 0.15, 0.3) if args.quick else (5, 0.5, 1.0)
    started, load_before = time.time(), load_average()
    host = describe_host()
    result: dict[str, Any] = {
        # int8 speed depends on the CPU's int8 kernels (VNNI or not): say which host this was
        "host": host.model_dump(),
        "machine": {
            "cpu": host.label(),
            "cores": host.cores,
            "threads": list(thread_counts()),
            "python": platform.python_version(),
        },
        "quick": args.quick,
        "arguments": sys.argv[1:],
        "clock": {"1": clock_of(1), "2": clock_of(2)},
        "rounds": rounds,
        "load_average_before": load_before,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
    }
    for package in ("torch", "onnxruntime", "ai_edge_litert", "onnx"):
        try:
            from importlib.metadata import version

            result["machine"][package] = version(package.replace("_", "-"))
        except Exception:
            pass
    SCRATCH.mkdir(parents=True, exist_ok=True)
    artifacts = {}
    for pair in pairs:
        for name in PAIRS[pair]:
            print(f"[{time.time() - started:6.0f} s] artifacts {name}", flush=True)
            artifacts[name] = build_artifacts(name, SCRATCH, args.reuse)
    result["artifacts"] = artifacts
    graphs = peak_graphs(SCRATCH / "peak")
    print(f"[{time.time() - started:6.0f} s] peaks", flush=True)
    peaks_before = measure_peaks(graphs, 2)
    result["latency"] = {}
    for pair in pairs:
        print(f"[{time.time() - started:6.0f} s] latency {pair}", flush=True)
        result["latency"][pair] = measure_pair(pair, artifacts, rounds, budget, b32_budget)
    print(f"[{time.time() - started:6.0f} s] peaks", flush=True)
    result["peaks"] = {"before": peaks_before, "after": measure_peaks(graphs, 2)}
    result["peak_clock"] = result["clock"]
    result["load_average_after_latency"] = load_average()
    result["stages"] = {}
    for pair in [] if args.no_stages else pairs:
        name = PAIRS[pair][1]
        print(f"[{time.time() - started:6.0f} s] pipeline stages {name}", flush=True)
        calib = model_files(name, SCRATCH)[1]
        result["stages"][name] = pipeline_stages(name, SCRATCH, calib)
    result["load_average_after"] = load_average()
    result["total_s"] = round(time.time() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    write_report(result, RESULTS, stem)
    print(
        f"done in {result['total_s']:.0f} s; load average {load_before} -> "
        f"{result['load_average_after']}"
    )


if __name__ == "__main__":
    main()
