"""What other builds running beside it do to a report's latency, and whether the report can tell.

    .venv/bin/python -m benchmarks.studies.latency_contention                 # ~10 min on 2 cores
    .venv/bin/python -m benchmarks.studies.latency_contention --report-only   # table and plot again

A conversion may build its targets at once (``edge-un convert --parallel N``, Celery workers on
one machine), and each target times its file while the others quantize and measure. This times
the files a report times, with the report's own functions (``quant.measure.latency.onnx_latency``,
``quant.tflite.litert.latency_tflite``: p50 over up to 100 batch-1 runs), on a quiet host and beside
1 and 2 processes doing what a build spends most of its time on: the exact QDQ arithmetic of the
same int8 model over batches of 32 samples (drift, SQNR and bias-correction passes; ONNX Runtime
with ``quant.measure.ort_options.computing_options``). Each timing also records what the report now
records, ``others_busy_cores`` (``quant.measure.host_load``): how many of the host's cores other
work kept busy meanwhile.

Files: the bundled ``vit-mnist-un`` converted for cpu (int8 ONNX) and imx93 (full-int8 TFLite),
and a BERT-base-sized model (random weights, ``benchmarks.speed.hf_scale``'s, 128 tokens) converted
for cpu with the drift bars off. Rounds: in each, every load level in turn (its processes started,
then every file timed at 1 and 2 threads, then stopped), so the host's drift hits all alike; the
median over rounds is quoted. Writes results/latency_contention.{json,md,png}.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.results import ROOT, benchmark_main, save_figure

NAME = "latency_contention"
SCRATCH = ROOT / "build" / "latency-contention"  # the files timed, kept for a run again
ROUNDS = 5
LOADS = (0, 1, 2)  # other processes running builds' work while the files are timed
LOAD_BATCH = 32
THREADS = (1, 2)
LOADER = [sys.executable, "-m", "benchmarks.studies.latency_contention", "--load"]


def load_loop(model: str, inputs: str) -> None:
    """A loader process: the exact QDQ arithmetic of ``model`` over one batch, again and again,
    as a build's drift and bias-correction passes run it; says ``ready`` once running."""
    import onnxruntime as ort

    from quant.measure.ort_options import computing_options
    from quant.samples import Samples, feed_for

    session = ort.InferenceSession(
        model, computing_options(optimize=False), providers=["CPUExecutionProvider"]
    )
    with np.load(inputs) as archive:
        arrays = {key: archive[key][:LOAD_BATCH] for key in archive.files}
    batch = session.get_inputs()[0].shape[0]  # a fixed batch (BERT-base's files: 1), or a name
    samples = Samples(feed_for([i.name for i in session.get_inputs()], arrays), None, "load")
    batches = list(samples.batches(batch if isinstance(batch, int) else LOAD_BATCH))
    session.run(None, batches[0])
    print("ready", flush=True)
    while True:
        for feeds in batches:
            session.run(None, feeds)


def _start_loads(count: int, model: Path, inputs: Path) -> list[subprocess.Popen]:
    loaders = [
        subprocess.Popen([*LOADER, str(model), str(inputs)], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for loader in loaders:
        assert loader.stdout is not None and loader.stdout.readline().strip() == "ready"
    return loaders


def _stop(loaders: list[subprocess.Popen]) -> None:
    for loader in loaders:
        loader.kill()
        loader.wait()


def _files(work: Path) -> list[dict[str, Any]]:
    """Every file timed (model, runtime, file, timing inputs .npz, the file its load runs),
    made in ``work``, or found there from an earlier run."""
    import edge_un
    from benchmarks.speed import hf_scale
    from edge_un import examples
    from quant.pipeline import convert
    from quant.samples import checkpoint_samples

    work.mkdir(parents=True, exist_ok=True)
    vit_inputs, bert_inputs = work / "vit-inputs.npz", work / "bert-inputs.npz"
    if not (work / "vit" / "report.json").is_file():
        _, info = edge_un.load_checkpoint(examples.path("vit-mnist-un"))
        np.savez(vit_inputs, input=checkpoint_samples(info, "test").inputs[:LOAD_BATCH])
        print("converting vit-mnist-un for cpu and imx93", flush=True)
        convert(examples.path("vit-mnist-un"), "cpu,imx93", out_dir=work / "vit")
    if not (work / "bert" / "report.json").is_file():
        print("exporting and converting a BERT-base-sized model for cpu", flush=True)
        onnx_path, calib, evaluation, _ = hf_scale.prepare("bert-base", work)
        with np.load(evaluation) as archive:
            np.savez(bert_inputs, **{k: archive[k] for k in archive.files if k != "labels"})
        convert(onnx_path, "cpu", calib, evaluation, work / "bert", max_drift=100, min_agreement=0)
    vit_int8 = work / "vit" / "cpu" / "model_int8.onnx"
    return [
        {"model": "vit-mnist-un", "runtime": "onnxruntime", "file": vit_int8,
         "inputs": vit_inputs, "load": vit_int8},
        {"model": "vit-mnist-un", "runtime": "litert",
         "file": work / "vit" / "imx93" / "model_int8.tflite", "inputs": vit_inputs,
         "load": vit_int8},
        {"model": "bert-base", "runtime": "onnxruntime",
         "file": work / "bert" / "cpu" / "model_int8.onnx", "inputs": bert_inputs,
         "load": work / "bert" / "cpu" / "model_int8.onnx"},
    ]  # fmt: skip


def _time(entry: dict[str, Any], threads: int) -> tuple[float, float | None]:
    from quant.measure.latency import onnx_latency
    from quant.tflite.litert import latency_tflite

    with np.load(entry["inputs"]) as archive:
        sample = {key: archive[key][:1] for key in archive.files}
    if entry["runtime"] == "litert":
        timing = latency_tflite(entry["file"], sample, threads)
    else:
        timing = onnx_latency(entry["file"], sample, threads)
    return timing.p50_ms, timing.others_busy_cores


def run() -> dict[str, Any]:
    from quant.host import describe_host

    samples: dict[tuple[str, str, int, int], list[tuple[float, float | None]]] = {}
    files = _files(SCRATCH)
    for round_ in range(ROUNDS):
        for load in LOADS:
            for entry in files:  # each model's own work as the load
                loaders = _start_loads(load, entry["load"], entry["inputs"])
                try:
                    for threads in THREADS:
                        key = (entry["model"], entry["runtime"], threads, load)
                        samples.setdefault(key, []).append(_time(entry, threads))
                finally:
                    _stop(loaders)
        print(f"round {round_ + 1} of {ROUNDS} done", flush=True)
    rows = []
    for (model, runtime, threads, load), measured in samples.items():
        p50s = [p50 for p50, _ in measured]
        busy = [others for _, others in measured if others is not None]
        rows.append({
            "model": model, "runtime": runtime, "threads": threads, "other_processes": load,
            "p50_ms": statistics.median(p50s), "p50_ms_rounds": p50s,
            "others_busy_cores": statistics.median(busy) if busy else None,
            "others_busy_cores_rounds": busy,
        })  # fmt: skip

    def config(row: dict[str, Any]) -> tuple[str, str, int]:
        return row["model"], row["runtime"], row["threads"]

    quiet = {config(row): row["p50_ms"] for row in rows if not row["other_processes"]}
    for row in rows:
        row["slowdown"] = row["p50_ms"] / quiet[config(row)]
    return {"host": describe_host().model_dump(), "rounds": ROUNDS, "rows": rows}


def markdown(results: dict[str, Any]) -> str:
    from quant.report import CONTENDED_CORES, Host

    host = Host.model_validate(results["host"])
    lines = [
        "# Latency beside other builds, and what the report says about it",
        "",
        f"Made by `python -m benchmarks.studies.latency_contention` on {host.label()}: each file "
        "timed "
        "as a report times it (p50 of up to 100 batch-1 runs), on a quiet host and beside 1 and "
        "2 processes running the same int8 model's exact QDQ arithmetic over batches of "
        f"{LOAD_BATCH} (a build's drift and bias-correction passes); median over "
        f"{results['rounds']} rounds, the load levels taken in turn in each round. `others busy` "
        "is the report's `others_busy_cores`: how many of the host's cores other work kept busy "
        f"while the file was timed. The summary flags a figure from {CONTENDED_CORES} on.",
        "",
        "| model | runtime | threads | other processes | p50 ms | vs quiet | others busy (cores) "
        "| flagged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(results["rows"], key=lambda r: (r["model"], r["runtime"], r["threads"],
                                                      r["other_processes"])):  # fmt: skip
        busy = row["others_busy_cores"]
        flagged = "-" if busy is None else ("yes" if busy >= CONTENDED_CORES else "no")
        lines.append(
            f"| {row['model']} | {row['runtime']} | {row['threads']} | {row['other_processes']} "
            f"| {row['p50_ms']:.3f} | {row['slowdown']:.2f}x | "
            f"{'-' if busy is None else f'{busy:.2f}'} | {flagged} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quant.report import CONTENDED_CORES

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        label = f"{row['model']}, {row['runtime']}, {row['threads']} thr"
        series.setdefault(label, []).append(row)
    for label, rows in sorted(series.items()):
        rows.sort(key=lambda r: r["other_processes"])
        loads = [r["other_processes"] for r in rows]
        left.plot(loads, [r["slowdown"] for r in rows], marker="o", label=label)
        right.plot(loads, [r["others_busy_cores"] or 0 for r in rows], marker="o", label=label)
    left.set(xlabel="other processes running a build's work", ylabel="p50 / p50 on a quiet host",
             title="Latency beside other builds")  # fmt: skip
    right.axhline(CONTENDED_CORES, color="grey", linestyle="--", label="flagged from here")
    right.set(xlabel="other processes running a build's work", ylabel="cores",
              title="What the report records: others_busy_cores")  # fmt: skip
    for axis in (left, right):
        axis.set_xticks(list(LOADS))
        axis.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    save_figure(figure, NAME)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--load":
        load_loop(sys.argv[2], sys.argv[3])
        return
    benchmark_main(NAME, __doc__ or NAME, run, markdown, plot)


if __name__ == "__main__":
    main()
