"""LiteRT int8 attention on XNNPACK: ViT-Tiny's int8 TFLite file before and after its
BATCH_MATMUL right operands are made symmetric (issue 32), against fp32; Vela cycles per op.

    .venv/bin/python -m benchmarks.studies.litert_attention                # ~10 min on 2 cores
    # table and plot from the JSON
    .venv/bin/python -m benchmarks.studies.litert_attention --report-only

Models: ViT-Tiny (``benchmarks.speed.latency.TINY``: 224x224 RGB, dim 192, depth 12, 3 heads, random
weights, seed 0) folded (UN) and its LayerNorm twin (LN), exported at opset 20 with batch 1 and
converted by ``quant.tflite.onnx2tf.convert_tflite`` with ``symmetric_matmul=False``: the
converter's own int8 file ("asymmetric"). ``quant.tflite.symmetric`` makes the "symmetric" file from
it, which is what ``convert_tflite`` ships by default (the imx93 and imx8mp files). For each file:
the ops XNNPACK's delegate took, read from the interpreter (``quant.tflite.litert.xnnpack_ops``);
batch-1 latency on one thread, the two int8 files and the fp32 file of a model each in its own
interpreter, in interleaved rounds (every round runs each file in turn, the order rotating),
medians over every timed invoke; the cosine of each int8 file's logits with the fp32 file's on
32 random inputs; Vela's cycles per op type (imx93's Ethos-U65-256 config, ``quant.tflite.vela``).
Writes results/litert_attention.json, .md and .png.
"""

from __future__ import annotations

import os
import shutil
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.common.results import ROOT, benchmark_main, save_figure
from benchmarks.speed.latency import model_files
from converters.fold_and_export import export_folded, load_and_fold
from quant.host import describe_host
from quant.tflite.litert import run_tflite, sample_runner, xnnpack_ops
from quant.tflite.onnx2tf import convert_tflite
from quant.tflite.symmetric import make_matmul_operands_symmetric
from quant.tflite.vela import compile_vela

NAME = "litert_attention"
WORK = ROOT / "build" / "litert-attention"
MODELS = ("vit-tiny-un", "vit-tiny-ln")
FILES = ("int8 asymmetric", "int8 symmetric", "fp32")
ROUNDS, CALLS = 20, 25
TOP_OPS = ("BatchMatMul", "Softmax", "FullyConnected")


def build(name: str) -> tuple[dict[str, Path], np.ndarray, dict[str, Any]]:
    """The model's three TFLite files, its 32 timing inputs, and what the rewrite changed."""
    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    checkpoint, calib, inputs = model_files(name, WORK)
    onnx_path = out / "fp32_opset20_b1.onnx"
    folded = load_and_fold(checkpoint, allow_online=name.endswith("-ln"))
    export_folded(folded, onnx_path, opset=20, dynamic_batch=False)
    start = time.perf_counter()
    converted = convert_tflite(
        onnx_path, calib, out / "tflite", smoke_run=False, symmetric_matmul=False
    )
    convert_s = time.perf_counter() - start
    symmetric = out / "tflite" / "model_int8_symmetric.tflite"
    start = time.perf_counter()
    groups = make_matmul_operands_symmetric(converted.int8, symmetric)
    rewrite_s = time.perf_counter() - start
    files = {FILES[0]: converted.int8, FILES[1]: symmetric, FILES[2]: converted.float32}
    changed = {
        "groups": len(groups),
        "left": sum(g.new_scale is None for g in groups),
        "zero_points": sorted({g.zero_point for g in groups}),
        "max_step_increase_pct": round(
            100 * max((g.new_scale / g.scale - 1 for g in groups if g.new_scale), default=0.0), 2
        ),
        "convert_s": round(convert_s, 1),
        "rewrite_s": round(rewrite_s, 2),
    }
    return files, inputs, changed


def timed(files: dict[str, Path], inputs: np.ndarray) -> dict[str, Any]:
    """p50/p90 ms of each file, batch 1, one thread, in interleaved rounds, and the load
    average before and after (other processes on this machine slow every file alike)."""
    load_before = os.getloadavg()[0]
    runners = {key: sample_runner(path, inputs[:1], threads=1) for key, path in files.items()}
    samples: dict[str, list[float]] = {key: [] for key in runners}
    keys = list(runners)
    for r in range(ROUNDS):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            run = runners[key]
            run(0)  # the first call of a turn is not timed (caches)
            for _ in range(CALLS):
                start = time.perf_counter()
                run(0)
                samples[key].append(1e3 * (time.perf_counter() - start))
    timings: dict[str, Any] = {
        key: {
            "p50_ms": round(float(np.median(s)), 3),
            "p90_ms": round(float(np.percentile(s, 90)), 3),
            "runs": len(s),
        }
        for key, s in samples.items()
    }
    timings["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return timings


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return round(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))), 5)


def measure(name: str) -> dict[str, Any]:
    files, inputs, changed = build(name)
    placement = {key: xnnpack_ops(path) for key, path in files.items()}
    logits = {key: run_tflite(path, inputs) for key, path in files.items()}
    vela = {}
    for key in FILES[:2]:
        result = compile_vela(files[key], WORK / name / "vela" / key.replace(" ", "_"))
        vela[key] = {
            "cycles": result.cycles,
            "npu_cycles": result.npu_cycles,
            "est_ms": result.est_ms,
            "npu_ops": result.npu_ops,
            "cpu_ops": len(result.cpu_ops),
            "cycles_by_op": result.cycles_by_op,
        }
    return {
        "changed": changed,
        "latency": timed(files, inputs),
        "xnnpack": {
            key: {op: {"ops": n, "delegated": d} for op, (n, d) in ops.items()}
            for key, ops in placement.items()
        },
        "cosine_vs_fp32": {key: cosine(logits[key], logits[FILES[2]]) for key in FILES[:2]},
        "vela": vela,
    }


def run() -> dict[str, Any]:
    host = describe_host()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    results = {name: measure(name) for name in MODELS}
    return {
        "started_utc": started,
        "host": {
            "label": host.label(),
            "cpu": host.cpu,
            "machine": host.machine,
            "cores": host.cores,
            "isa": host.int8_features,
        },
        "versions": {name: version(name) for name in ("ai-edge-litert", "ethos-u-vela")},
        "settings": {"threads": 1, "batch": 1, "rounds": ROUNDS, "calls_per_round": CALLS},
        "models": results,
    }


def _matmuls(entry: dict[str, Any], key: str) -> str:
    bmm = entry["xnnpack"][key].get("BATCH_MATMUL", {"ops": 0, "delegated": 0})
    return f"{bmm['delegated']} / {bmm['ops']}"


def _left(entry: dict[str, Any], key: str) -> str:
    left = {op: c["ops"] - c["delegated"] for op, c in entry["xnnpack"][key].items()}
    return ", ".join(f"{op} x{n}" for op, n in sorted(left.items()) if n) or "none"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        "# LiteRT int8 attention on XNNPACK: symmetric BATCH_MATMUL right operands (ViT-Tiny)",
        "",
        f"Made by `.venv/bin/python -m {__spec__.name}`, {results['started_utc']} UTC, on "
        f"{results['host']['label']} ({results['host']['machine']}); ai-edge-litert "
        f"{results['versions']['ai-edge-litert']}, Vela {results['versions']['ethos-u-vela']}. "
        f"ViT-Tiny, random weights, batch {s['batch']}, {s['threads']} thread; p50/p90 of "
        f"{s['rounds']} interleaved rounds x {s['calls_per_round']} invokes per file. "
        "'asymmetric' is TensorFlow's converter's int8 file; 'symmetric' the same file with each "
        "BATCH_MATMUL right operand requantized to zero point 0 by the op that computes it "
        "(`quant.tflite.symmetric`, what the imx93/imx8mp targets ship).",
        "",
        "| model | file | p50 ms | p90 ms | speed vs fp32 | BATCH_MATMUL on XNNPACK "
        "| ops XNNPACK left | cosine vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["models"].items():
        fp32 = entry["latency"]["fp32"]["p50_ms"]
        for key in FILES:
            t = entry["latency"][key]
            cos = entry["cosine_vs_fp32"].get(key)
            lines.append(
                f"| {name} | {key} | {t['p50_ms']:.2f} | {t['p90_ms']:.2f} | "
                f"{fp32 / t['p50_ms']:.2f}x | {_matmuls(entry, key)} | {_left(entry, key)} | "
                f"{'-' if cos is None else f'{cos:.4f}'} |"
            )
    loads = ", ".join(
        f"{name} {e['latency']['load_average'][0]} -> {e['latency']['load_average'][1]}"
        for name, e in results["models"].items()
    )
    lines += [
        "",
        f"Load average (1 min) before -> after each model's timing: {loads}, on "
        f"{results['host']['cores']} cores: other processes shared them, slowing every file of "
        "a round alike; compare files within a model, not with runs on a quiet machine.",
        "",
        "What the rewrite changed: "
        + "; ".join(
            f"{name}: {e['changed']['groups']} producers, zero points "
            f"{e['changed']['zero_points']} -> 0, int8 step up to "
            f"+{e['changed']['max_step_increase_pct']} %, {e['changed']['left']} left, "
            f"{e['changed']['rewrite_s']} s"
            for name, e in results["models"].items()
        )
        + ".",
        "",
        "## Vela (Ethos-U65-256, Ethos_U65_High_End, Dedicated_Sram_384KB): cycles per op type",
        "",
        "| model | file | total cycles | est ms | "
        + " | ".join(TOP_OPS)
        + " | other | NPU ops | CPU ops |",
        "|---|---|---|---|" + "---|" * (len(TOP_OPS) + 3),
    ]
    for name, entry in results["models"].items():
        for key, v in entry["vela"].items():
            by_op = v["cycles_by_op"]
            other = v["cycles"] - sum(by_op.get(op, 0) for op in TOP_OPS)
            cells = " | ".join(f"{by_op.get(op, 0):,}" for op in TOP_OPS)
            lines.append(
                f"| {name} | {key} | {v['cycles']:,} | {v['est_ms']:.3f} | {cells} | "
                f"{other:,} | {v['npu_ops']} | {v['cpu_ops']} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    models = list(results["models"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, key in enumerate(FILES):
        values = [results["models"][m]["latency"][key]["p50_ms"] for m in models]
        bars = left.bar(np.arange(len(models)) + (i - 1) * width, values, width, label=key)
        left.bar_label(bars, fmt="%.1f", fontsize=8)
    left.set_xticks(np.arange(len(models)), models)
    left.set_ylabel("LiteRT p50 ms (batch 1, 1 thread)")
    left.set_title("ViT-Tiny on XNNPACK")
    left.legend()
    labels, bottoms = [], []
    columns = [(m, key) for m in models for key in FILES[:2]]
    for m, key in columns:
        labels.append(f"{m.removeprefix('vit-tiny-')}\n{key.removeprefix('int8 ')}")
        bottoms.append(0.0)
    for op in (*TOP_OPS, "other"):
        heights = []
        for m, key in columns:
            v = results["models"][m]["vela"][key]
            by_op = v["cycles_by_op"]
            rest = v["cycles"] - sum(by_op.get(o, 0) for o in TOP_OPS)
            heights.append((rest if op == "other" else by_op.get(op, 0)) / 1e6)
        right.bar(labels, heights, bottom=bottoms, label=op)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    right.set_ylabel("Vela cycles (millions)")
    right.set_title("Ethos-U65-256 (Vela estimate), per TFLite op type")
    right.legend(fontsize=8)
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
