"""The cpu target's ONNX Runtime file against LiteRT's int8 file of the same model, at BERT-base
and ViT-B/16 size, one thread: how far apart they are, and where the ONNX Runtime time goes.

    .venv/bin/python -m benchmarks.speed.cpu_vs_litert                # ~20 min on 2 cores
    # some models only (';'-separated), their rows replaced in the committed JSON
    EDGE_UN_BENCH_MODELS="vit-b16, 32 x 32;bert-base, 24 tokens" \
        .venv/bin/python -m benchmarks.speed.cpu_vs_litert
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.speed.cpu_vs_litert --report-only

Random weights (``benchmarks.speed.hf_scale``'s BERT-base at 128 tokens and ViT-B/16 at 224 x 224,
and both at the shapes of ``hf_scale_trained``'s rows: BERT-base at 24 tokens, ViT-B/16 on one
channel of 32 x 32, 4 patches and the class token; UN in place of LayerNorm): speed only, so
each target's first recipe, pure int8 (the file a model within the bars ships; bars off). Each
model is saved as a Hugging Face directory and converted by ``quant.convert`` for cpu and imx93
(LiteRT's file from the direct litert-torch route). Two earlier forms of the cpu file are
quantized beside it from the same fp32 export and calibration samples, to say what each change of
issue 67 bought:

* ``before``: the recipe at c076d8d: each s8 attention operand clipped by one Clip, which ORT's
  QDQ selectors take into the K or V projection's node group and then refuse to fuse (the
  projection runs as a float Gemm on weights dequantized at every call); a text model's masked
  scores requantized for an integer Add and an integer Softmax;
* ``+ clip as Max, Min``: the same bounds as a Max and a Min, which ORT leaves alone;
* ``cpu``: the shipped file, with the masked scores fed in float as well (``MASK_OPS``);
* ``cpu, last recipe``: the file the cpu ladder's last rung makes (biases corrected, u8 weights in
  8 bits on ORT's U8U8 kernels), which a model that misses the bars on the first two ships:
  hf_scale's random-weight BERT-base did (93.6 ms at 9a72885 against LiteRT's 31.9).

Timed in one process, batch 1: round-robin over the files for ``ROUNDS`` rounds of ``CALLS``
calls; one thread: the calling thread's CPU time per call (a 1-thread call's whole work); two
threads: the wall time (run it on an otherwise idle machine); medians, on the first evaluation
sample. ORT's profiler gives each ORT file's kernel time by op type (one thread).
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import onnx
import torch
from onnx import helper

import edge_un
import quant
import quant.ort.graph
from benchmarks.common.results import RESULTS, ROOT, benchmark_main, git_commit, save_figure
from benchmarks.speed.hf_scale import CALIBRATION, bert_base, vit_base
from benchmarks.speed.ort_speed import WORK as PROFILES_DIR
from benchmarks.speed.ort_speed import feed, op_profile, session
from edge_un.hf.record import save_pretrained
from quant.host import describe_host
from quant.ort.quantize import quantize_onnx
from quant.report import Host
from quant.samples import Samples
from quant.targets import PROFILES
from quant.tflite.litert import sample_runner

NAME = "cpu_vs_litert"
ROUNDS, CALLS = 15, 3
NO_BARS = {"max_drift": 100.0, "min_agreement": 0.0}
FILES = ("before", "+ clip as Max, Min", "cpu", "cpu, last recipe", "imx93 (LiteRT)")
LAST_RECIPE = PROFILES["cpu"].int8_recipes[-1]
MODELS = {
    "bert-base": bert_base, "vit-b16": vit_base,
    "bert-base, 24 tokens": partial(bert_base, 24),  # hf_scale_trained's bert-base-rt
    "vit-b16, 32 x 32": partial(vit_base, 32, 1, 10),  # hf_scale_trained's vit-b16-mnist
}  # fmt: skip
ONLY = [m for m in os.environ.get("EDGE_UN_BENCH_MODELS", "").split(";") if m]  # ';'-separated
WORK = ROOT / "build" / "cpu-vs-litert"


def convert(name: str) -> dict[str, Path]:
    """The model's cpu and imx93 files through ``quant.convert``, and the cpu file's two
    earlier forms from the same fp32 export; their paths, by ``FILES`` key."""
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, data = MODELS[name]()
    edge_un.swap_layernorm(model, kind="un")
    save_pretrained(model.eval(), work / "model")
    count = len(next(iter(data.values())))
    calibration = {key: value[:CALIBRATION] for key, value in data.items()}
    np.savez(work / "calib.npz", **calibration)
    np.savez(work / "eval.npz", **{key: value[CALIBRATION:] for key, value in data.items()},
             labels=np.zeros(count - CALIBRATION, np.int64))  # fmt: skip
    started = time.perf_counter()
    quant.convert(
        work / "model", ["cpu", "imx93"], calib=work / "calib.npz", eval=work / "eval.npz",
        out_dir=work / "out", latency_runs=5, **NO_BARS,
    )  # fmt: skip
    print(f"{name}: converted in {time.perf_counter() - started:.0f} s", flush=True)
    fp32 = next((work / "out" / "fp32").glob("*_dynamic.onnx"))
    samples = Samples(calibration, None, "calibration")
    max_min = work / "max_min.onnx"
    with mock.patch.object(quant.ort.graph, "MASK_OPS", frozenset()):  # c076d8d's chains
        quantize_onnx(fp32, max_min, PROFILES["cpu"], samples)
    before = work / "before.onnx"
    onnx.save(as_one_clip(onnx.load(str(max_min))), str(before))
    last = work / "last_recipe.onnx"
    quantize_onnx(fp32, last, LAST_RECIPE, samples)
    return {
        "before": before, "+ clip as Max, Min": max_min, "cpu": work / "out/cpu/model_int8.onnx",
        "cpu, last recipe": last, "imx93 (LiteRT)": work / "out/imx93/model_int8.tflite",
    }  # fmt: skip


def as_one_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each s8 operand's Max and Min (``quant.ort.attention``) as the one Clip it was before."""
    producers = {out: node for node in model.graph.node for out in node.output}
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        floor = producers.get(node.input[0]) if node.op_type == "Min" else None
        if floor is None or floor.op_type != "Max":
            nodes.append(node)
            continue
        nodes.remove(floor)
        nodes.append(helper.make_node("Clip", [floor.input[0], floor.input[1], node.input[1]],
                                      list(node.output), name=f"{node.name}_clip"))  # fmt: skip
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def timed(
    files: dict[str, Path], evaluation: dict[str, np.ndarray], threads: int = 1
) -> dict[str, float]:
    """p50 ms of each file, batch 1, round-robin: one thread's CPU time, or the wall time."""
    first = {key: value[:1] for key, value in evaluation.items() if key != "labels"}
    clock = time.thread_time if threads == 1 else time.perf_counter
    calls = {}
    for key, path in files.items():
        if path.suffix == ".onnx":
            sess = session(path, threads)
            inputs = feed(sess, first, 1)
            calls[key] = lambda sess=sess, inputs=inputs: sess.run(None, inputs)
        else:
            runner = sample_runner(path, first, threads)
            calls[key] = lambda runner=runner: runner(0)
    times: dict[str, list[float]] = {key: [] for key in files}
    for call in calls.values():
        call()
    for round_ in range(ROUNDS):
        keys = list(calls)[round_ % len(calls) :] + list(calls)[: round_ % len(calls)]
        for key in keys:
            for _ in range(CALLS):
                start = clock()
                calls[key]()
                times[key].append(clock() - start)
    return {key: round(1e3 * float(np.median(values)), 2) for key, values in times.items()}


def run() -> dict[str, Any]:
    """Each model of ``MODELS`` (or of ``ONLY``) measured; the committed rows of the others kept."""
    PROFILES_DIR.mkdir(parents=True, exist_ok=True)  # ORT's profiler writes its traces there
    committed = RESULTS / f"{NAME}.json"
    results = json.loads(committed.read_text()) if committed.exists() else {"models": {}}
    for name in [m for m in MODELS if m in ONLY] if ONLY else MODELS:
        files = convert(name)
        evaluation = dict(np.load(WORK / name / "eval.npz"))
        p50 = timed(files, evaluation)
        two = {"cpu": files["cpu"], "imx93 (LiteRT)": files["imx93 (LiteRT)"]}
        p50_two_threads = timed(two, evaluation, threads=2)
        first = {key: value[:1] for key, value in evaluation.items() if key != "labels"}
        profiles = {key: op_profile(path, first) for key, path in files.items()
                    if path.suffix == ".onnx"}  # fmt: skip
        results["models"][name] = {
            "host": describe_host().model_dump(), "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "p50_ms": p50, "p50_ms_2_threads": p50_two_threads, "op_ms": profiles,
        }  # fmt: skip
        print(name, p50, p50_two_threads, flush=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# The cpu file against LiteRT's, BERT-base and ViT-B/16 size, one thread", "",
        "Made by `python -m benchmarks.speed.cpu_vs_litert` (each row: the commit, date and host "
        "below the table). Random weights, each target's first recipe (pure int8); batch 1, one "
        f"thread, median thread CPU time of {ROUNDS} round-robin rounds x {CALLS} calls, the "
        "files of a row timed side by side in one process. Goal (issue 67): cpu <= 1.1x "
        "LiteRT. `before`: the file at c076d8d; `cpu, last recipe`: what the cpu ladder's "
        "last rung makes (biases corrected, u8 weights in 8 bits on ORT's U8U8 kernels), the "
        "file a model that misses the bars on the first two ships. 2 threads: wall time. "
        + results.get("note", ""), "",
        "| model | " + " | ".join(f"{key} ms" for key in FILES)
        + " | cpu / LiteRT | before / cpu | 2 threads: cpu / LiteRT ms |",
        "|---|" + "---|" * (len(FILES) + 3),
    ]  # fmt: skip
    for name, model in results["models"].items():
        p50, two = model["p50_ms"], model.get("p50_ms_2_threads")
        ratio = p50["cpu"] / p50["imx93 (LiteRT)"]
        pair = "-" if two is None else f"{two['cpu']:.1f} / {two['imx93 (LiteRT)']:.1f}"
        cells = " | ".join(_ms(p50.get(key)) for key in FILES)
        speedup = p50["before"] / p50["cpu"]
        lines.append(f"| {name} | {cells} | {ratio:.2f}x | {speedup:.2f}x | {pair} |")
    lines += [""] + [
        f"- {name}: at {model['commit']}, {model['date']}, on "
        f"{Host.model_validate(model['host']).label()}"
        for name, model in results["models"].items()
    ]
    lines += [
        "",
        "ONNX Runtime's kernel time by op type (ms an inference, its profiler's, top 8):",
        "",
    ]
    for name, model in results["models"].items():
        for key, ops in model["op_ms"].items():
            top = sorted(ops.items(), key=lambda item: -item[1])[:8]
            total = sum(ops.values())
            lines.append(f"- {name}, {key}: total {total:.1f}: "
                         + ", ".join(f"{op} {ms:.1f}" for op, ms in top))  # fmt: skip
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"  # a file the run did not time


def plot(results: dict[str, Any]) -> None:
    models = list(results["models"])
    figure, axis = plt.subplots(figsize=(8, 3.2))
    height = 0.8 / len(FILES)
    for index, key in enumerate(FILES):
        values = [results["models"][name]["p50_ms"].get(key, 0.0) for name in models]
        positions = np.arange(len(models)) + index * height
        axis.barh(positions, values, height, label=key)
    axis.set_yticks(np.arange(len(models)) + 0.4 - height / 2, models)
    axis.invert_yaxis()
    axis.set_xlabel("p50 ms, batch 1, one thread")
    axis.legend(fontsize=8)
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
