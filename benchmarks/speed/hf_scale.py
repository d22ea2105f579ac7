"""Converting the Hugging Face models people deploy: BERT-base and ViT-B/16 sizes, every target.

    .venv/bin/python -m benchmarks.speed.hf_scale                # ~40 min on 2 cores
    .venv/bin/python -m benchmarks.speed.hf_scale --report-only  # Markdown and plot from the JSON
    EDGE_UN_BENCH_MODELS=vit-b16 .venv/bin/python -m benchmarks.speed.hf_scale  # one model again
    EDGE_UN_BENCH_BARS=on .venv/bin/python -m benchmarks.speed.hf_scale  # + a run with the bars on

Run for a subset, the other models keep their committed entries; each entry names the commit
that measured it.

Random weights (timing and memory only; accuracy needs trained models): a
``BertForSequenceClassification`` of BERT-base's size (hidden 768, 12 layers, 12 heads, FFN
3072, vocab 30522, 110 M parameters, sequence 128, inputs ``input_ids`` + ``attention_mask``) and
a ``ViTForImageClassification`` of ViT-B/16's (224 x 224 RGB, patch 16, 86 M parameters), each
with UN in place of LayerNorm (``edge_un.swap_layernorm``), exported as users do
(``torch.onnx.export`` defaults, batch 1), converted by ``edge-un convert`` for every target
with the HTTP service's default job limits: address space ``EDGE_UN_JOB_MEMORY_MB`` and wall
time ``EDGE_UN_JOB_TIMEOUT_S`` (``service.settings``). Each conversion runs in
``benchmarks.speed.latency_stages`` (a process of its own): stage wall times from the progress
callback, peak RSS of the process tree sampled every 0.2 s. Each model is converted twice: its
targets built one at a time (the stage table), then ``PARALLEL`` at once (``edge-un convert
--parallel``; the same files, each target's span instead of stages).

With ``EDGE_UN_BENCH_BARS=on`` each model is converted once more instead, ``PARALLEL`` at once
(or ``EDGE_UN_BENCH_BARS_PARALLEL``),
with the pipeline's default drift bars and the time budget the service gives a job's builds
(``EDGE_UN_JOB_TIMEOUT_S`` less the share kept for the report): random weights miss the bars,
so every target climbs its int8 ladder and its 16-bit fallback until the budget stops the
search and ships the best file measured so far (``over_bar``). That run is added to the
committed entries, which keep theirs (a run with the bars off replaces a model's entry).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

import edge_un
from benchmarks.common.results import RESULTS, ROOT, benchmark_main, save_figure
from converters.log_levels import loggers_at
from quant.deadline import STOPPED
from quant.host import describe_host
from service.settings import Settings
from service.worker.steps import REPORT_RESERVE

NAME = "hf_scale"
STAGES = [sys.executable, "-m", "benchmarks.speed.latency_stages"]  # one conversion, timed
CALIBRATION, EVALUATION = 64, 100  # the pipeline's minimum for evaluation is 100
# Random weights have no accuracy to keep: their near-tied logits would send every target through
# its ladder and 16-bit fallback (cpu: 4 tensors, then every one, each step a new quantization and
# exact evaluation). Bars off, so each target is built and measured once, as a model that passes is.
NO_BARS = ["--max-drift", "100", "--min-agreement", "0"]
SEQUENCE = 128
PARALLEL = 2  # targets at once in the second conversion: one per core here
BARS_ON = os.environ.get("EDGE_UN_BENCH_BARS") == "on"
# targets at once in the bars-on run (EDGE_UN_BENCH_BARS_PARALLEL, default PARALLEL): more
# than the cores keeps both busy while one long search ends the job
BARS_PARALLEL = int(os.environ.get("EDGE_UN_BENCH_BARS_PARALLEL", PARALLEL))
BARS_ON_SUFFIX = ", bars on"  # a bars-on run's key in a model's runs: "2, bars on"
BARS_ON_RUN = f"{BARS_PARALLEL}{BARS_ON_SUFFIX}"


def bert_base(sequence: int = SEQUENCE) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(num_labels=2))  # BERT-base's defaults
    rng = np.random.default_rng(0)
    count = CALIBRATION + EVALUATION
    ids = rng.integers(1000, 30000, (count, sequence))
    lengths = rng.integers(min(16, sequence), sequence + 1, count)
    mask = (np.arange(sequence)[None, :] < lengths[:, None]).astype(np.int64)
    return model, {"input_ids": ids * mask, "attention_mask": mask}


def vit_base(
    side: int = 224, channels: int = 3, labels: int = 1000
) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=side, num_channels=channels, num_labels=labels)  # ViT-B/16's
    model = ViTForImageClassification(config)
    rng = np.random.default_rng(0)
    shape = (CALIBRATION + EVALUATION, channels, side, side)
    images = rng.standard_normal(shape, dtype=np.float32)
    return model, {"pixel_values": images}


MODELS = {"bert-base": bert_base, "vit-b16": vit_base}
ONLY = [m for m in os.environ.get("EDGE_UN_BENCH_MODELS", "").split(",") if m]  # a subset


def prepare(name: str, work: Path) -> tuple[Path, Path, Path, int]:
    """(ONNX file, calibration .npz, evaluation .npz, parameters) of one model."""
    torch.manual_seed(0)
    model, data = MODELS[name]()
    edge_un.swap_layernorm(model, kind="un")
    model.eval()
    parameters = sum(p.numel() for p in model.parameters())
    example = tuple(torch.from_numpy(array[:1]) for array in data.values())
    onnx_path = work / f"{name}.onnx"
    # quiet as the pipeline's own export: onnxscript logs each node constant folding leaves
    with contextlib.redirect_stdout(io.StringIO()), loggers_at(logging.ERROR):
        torch.onnx.export(model, example, onnx_path, input_names=list(data))
    labels = np.zeros(CALIBRATION + EVALUATION, np.int64)
    calib, evaluation = work / f"{name}-calib.npz", work / f"{name}-eval.npz"
    np.savez(calib, **{k: v[:CALIBRATION] for k, v in data.items()})
    np.savez(evaluation, **{k: v[CALIBRATION:] for k, v in data.items()},
             labels=labels[CALIBRATION:])  # fmt: skip
    return onnx_path, calib, evaluation, parameters


def convert(
    onnx_path: Path,
    calib: Path | None,
    evaluation: Path | None,
    work: Path,
    settings: Settings,
    parallel: int,
    budget_s: float | None = None,
) -> dict:
    """One conversion, all targets, ``parallel`` at once, under the service's job limits; the
    drift bars off, or (``budget_s``: the builds' time budget) the pipeline's own. No ``calib``
    and ``evaluation``: a model directory that records its data set (its splits are used)."""
    tag = f"{onnx_path.stem}-{parallel}{'' if budget_s is None else '-bars'}"
    result = work / f"{tag}-stages.json"
    limit = settings.job_memory_mb * 1024 * 1024
    bars = NO_BARS if budget_s is None else ["--budget-s", str(budget_s)]
    data = [] if calib is None else ["--calib", str(calib), "--eval", str(evaluation)]

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [*STAGES, str(onnx_path), str(work / f"{tag}-out"), str(result), *data, *bars,
             "--parallel", str(parallel)],
            preexec_fn=limits, capture_output=True, text=True, timeout=settings.job_timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired as timed_out:
        lines = (timed_out.stderr or b"").decode(errors="replace").strip().splitlines()
        return {"error": f"over the job timeout ({settings.job_timeout_s} s)",
                "wall_s": time.perf_counter() - start, "log_tail": lines[-40:]}  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        lines = proc.stderr.strip().splitlines() or ["no output"]
        return {"error": f"exit {proc.returncode}: {lines[-1]}", "wall_s": wall,
                "log_tail": lines[-40:]}  # fmt: skip
    return {**json.loads(result.read_text()), "wall_s": wall}


def run() -> dict[str, Any]:
    settings = Settings()
    results: dict[str, Any] = {
        "host": describe_host().model_dump(),
        "limits": {
            "job_memory_mb": settings.job_memory_mb,
            "job_timeout_s": settings.job_timeout_s,
        },
        "models": {},
    }
    committed = RESULTS / f"{NAME}.json"
    if (ONLY or BARS_ON) and committed.exists():  # what is not run again keeps its entries
        kept = json.loads(committed.read_text())
        results["models"] = {n: e for n, e in kept["models"].items() if BARS_ON or n not in ONLY}
        if BARS_ON:  # the limits the kept runs had; the bars-on run records its own
            results["limits"] = kept["limits"]
    commit = subprocess.check_output(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True
    ).strip()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for name in [m for m in MODELS if m in ONLY] if ONLY else MODELS:
            print(f"{name}: export", flush=True)
            onnx_path, calib, evaluation, parameters = prepare(name, work)
            files = [onnx_path, onnx_path.with_name(onnx_path.name + ".data")]
            if BARS_ON:
                budget = settings.job_timeout_s * (1 - REPORT_RESERVE)  # the service's
                print(f"{name}: convert, bars on, {budget:.0f} s budget", flush=True)
                run = convert(onnx_path, calib, evaluation, work, settings, BARS_PARALLEL, budget)
                run.update(commit=commit, budget_s=budget, job_timeout_s=settings.job_timeout_s)
                entry = results["models"].setdefault(name, {"runs": {}})
                entry.update(parameters=parameters, onnx_mb=_size_mb(files))
                entry["runs"][BARS_ON_RUN] = run
                print(f"{name}: {run.get('wall_s', 0):.0f} s, {run.get('error', 'ok')}", flush=True)
                continue
            entry: dict[str, Any] = {
                "parameters": parameters,
                "onnx_mb": _size_mb(files),
                "commit": commit,
                "runs": {},
            }
            for parallel in (1, PARALLEL):
                print(f"{name}: convert, {parallel} target(s) at once", flush=True)
                run = convert(onnx_path, calib, evaluation, work, settings, parallel)
                entry["runs"][str(parallel)] = run
                print(f"{name}: {run.get('wall_s', 0):.0f} s, {run.get('error', 'ok')}", flush=True)
            results["models"][name] = entry
    return results


def _trained_chain(trained: dict[str, Any]) -> str:
    """A trained row's models and their fp32 test accuracy, in the order they were made."""
    accuracy = {key: f"{100 * value:.1f} %" for key, value in trained["test_accuracy"].items()}
    text = (f"LN teacher {accuracy['teacher']}, UN twin {accuracy['migrated']} "
            f"({trained['migrate_epochs']} migrate epochs)")  # fmt: skip
    if "int8_ready" in accuracy:
        text += f", int8-ready ({' '.join(trained['int8_ready'])}) {accuracy['int8_ready']}"
    return text


def markdown(results: dict[str, Any]) -> str:
    from quant.report import Host

    host = Host.model_validate(results["host"])
    limits = results["limits"]
    lines = [
        "# Converting BERT-base- and ViT-B/16-sized Hugging Face models, every target",
        "",
        f"Made by `python -m benchmarks.speed.hf_scale` on {host.label()}, random weights (but the "
        "`(trained)` rows: see below), UN in "
        f"place of LayerNorm, `torch.onnx.export` defaults, batch 1; {CALIBRATION} calibration and "
        f"{EVALUATION} evaluation samples; drift bars off (random weights have no accuracy to "
        "keep: each target is built and measured once, with no 16-bit fallback; one fallback "
        "step costs about what a target's quantize stage costs); under the service's default "
        f"job limits (address space {limits['job_memory_mb']} MB, {limits['job_timeout_s']} s). "
        "Each model converted with its targets built one at a time, then "
        f"{PARALLEL} at once (`edge-un convert --parallel {PARALLEL}`), one run after the other.",
        "",
        "| model | commit | parameters | ONNX MB | targets at once | all targets, wall "
        "| peak RSS: process tree | largest one process | pipeline's own "
        "| largest address space, one process | status per target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["models"].items():
        for parallel, run in entry["runs"].items():
            head = (
                f"| {name} | {run.get('commit', entry.get('commit', '-'))} | "
                f"{entry['parameters']:,} | {entry['onnx_mb']:.0f} | {parallel} |"
            )
            if "error" in run:
                lines.append(f"{head} - | - | - | - | - | failed: {run['error']} |")
                continue
            detail = parallel.endswith(BARS_ON_SUFFIX)
            statuses = ", ".join(_status(t, v, detail) for t, v in run["targets"].items())
            lines.append(
                f"{head} {run['wall_s'] / 60:.1f} min | {_mb(run.get('peak_tree_rss_mb'))} | "
                f"{_mb(run.get('peak_child_rss_mb'))} | {_mb(run.get('peak_rss_mb'))} | "
                f"{_mb(run.get('peak_address_space_mb'))} | {statuses} |"
            )
    bars_on = [
        (f"{n}, {k.removesuffix(BARS_ON_SUFFIX)} at once", r)
        for n, e in results["models"].items()
        for k, r in e["runs"].items()
        if k.endswith(BARS_ON_SUFFIX)
    ]
    if bars_on:
        budgets = ", ".join(
            f"{n}: {r['budget_s']:.0f} s of a {r['job_timeout_s']} s job limit"
            for n, r in bars_on
            if "budget_s" in r
        )
        lines += [
            "",
            f"The `N{BARS_ON_SUFFIX}` rows (`EDGE_UN_BENCH_BARS=on`, N from "
            "`EDGE_UN_BENCH_BARS_PARALLEL`): N targets at once with the pipeline's default "
            "drift bars and the time budget the service gives a "
            f"job's builds ({budgets}: the limit less the share kept for the report). "
            "A target that misses them climbs its int8 ladder (cpu: up to 3 recipes; a TFLite "
            "target has none) and its 16-bit fallback (cpu: tensor by tensor; imx93: op by op, "
            "then the whole model in 16x8; imx8mp and tda4vm have none; rows before c9a0319: "
            "imx93 16x8 only) "
            "until its file is within the bars, nothing is left to try, or the budget stops the "
            "search and the best file measured so far ships (`over_bar`). Each target: its "
            "status, agreement, the recipes and fallback steps it measured, and whether the "
            "budget stopped it. Random weights and labels that are all 0: a drop of 1 sample "
            "in 100 is over the bar whatever the agreement.",
        ]
    trained = {n: e["trained"] for n, e in results["models"].items() if "trained" in e}
    if trained:
        lines += ["", "The `(trained)` rows (`python -m benchmarks.speed.hf_scale_trained`): "
                  "trained here from the shipped data, an LN teacher and its UN twin by `edge-un "
                  "migrate` (then, where the row says so, `edge-un finetune --int8-ready`); the "
                  "last of them converted, calibrated on its training split and measured on its "
                  "held-out test split. fp32 test accuracy:"]  # fmt: skip
        lines += [f"- {name}: {t['model']} on {t['data']}: {_trained_chain(t)}"
                  for name, t in trained.items()]  # fmt: skip
    timed = [(n, k, r) for n, e in results["models"].items() for k, r in e["runs"].items()
             if any(t.get("latency") for t in r.get("targets", {}).values())]  # fmt: skip
    if timed:
        lines += [
            "",
            "## Latency in the report, targets built at once",
            "",
            "Each target's p50 (ms, batch 1) at 1 and 2 threads as its report gives it; `busy`: "
            "the cores other work kept busy while it was timed (`others_busy_cores`); `again`: "
            "the figure was timed on a busy host during the builds and timed again when the "
            "report was assembled (`quant.quiet_latency`).",
            "",
            "| model | run | target | threads | p50 ms | busy | again |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, key, run in timed:
            for target, record in run["targets"].items():
                for timing in record.get("latency", []):
                    busy = timing.get("others_busy_cores")
                    lines.append(
                        f"| {name} | {_run_label(key)} | {target} | {timing['threads']} | "
                        f"{timing['p50_ms']:.1f} | {'-' if busy is None else f'{busy:.2f}'} | "
                        f"{'yes' if timing.get('retimed') else 'no'} |"
                    )
    lines += ["", "## Stage times, one target at a time (s)", ""]
    for name, entry in results["models"].items():
        run = entry["runs"].get("1", {})
        if "stages" not in run:
            continue
        lines += [f"### {name}", "", "| stage | s |", "|---|---|"]
        lines += [f"| {s['stage']} | {s['seconds']:.1f} |" for s in run["stages"]]
        lines.append("")
    lines += [
        f"## Each target's span, {PARALLEL} at once (s from the start)",
        "",
        "From the target's first progress event to its last: a target with an fp32 export of its "
        "own (cpu, imx93, tda4vm) starts with that export, during the preparation; imx8mp takes "
        "imx93's.",
        "",
    ]
    for name, entry in results["models"].items():
        spans = entry["runs"].get(str(PARALLEL), {}).get("target_spans_s", {})
        if spans:
            lines += [f"### {name}", "", "| target | first event | last event |", "|---|---|---|"]
            lines += [f"| {t} | {a:.0f} | {b:.0f} |" for t, (a, b) in spans.items()]
            lines.append("")
    return "\n".join(lines + _target_stages(results)) + "\n"


def _target_stages(results: dict[str, Any]) -> list[str]:
    """Each target's own stages in the runs that built targets at once and kept its events:
    where each target's time went while the others ran beside it."""
    runs = [
        (name, key, run)
        for name, entry in results["models"].items()
        for key, run in entry["runs"].items()
        if key != "1" and run.get("target_events_s")
    ]
    if not runs:
        return []
    lines = [
        "## Each target's stages, targets built at once (s from the start)",
        "",
        "A stage lasts until the target's next event; its last one until its build ended, which "
        "no event marks (`-`). Repeated events of one stage are one row.",
        "",
    ]
    for name, key, run in runs:
        lines += [f"### {name}, {_run_label(key)}", "", "| target | stage | start | s |"]
        lines.append("|---|---|---|---|")
        for target, events in run["target_events_s"].items():
            merged = [e for i, e in enumerate(events) if not i or e[0] != events[i - 1][0]]
            ends = [start for _, start in merged[1:]] + [None]
            for (stage, start), end in zip(merged, ends, strict=True):
                length = "-" if end is None else f"{end - start:.0f}"
                lines.append(f"| {target} | {stage} | {start:.0f} | {length} |")
        lines.append("")
    return lines


def _run_label(key: str) -> str:
    """A run's key ("1", "2", "2, bars on") as the plot's lanes name it."""
    if key.endswith(BARS_ON_SUFFIX):
        return f"{key.removesuffix(BARS_ON_SUFFIX)} at once, bars on"
    return f"{key} at once"


def _status(target: str, run: dict[str, Any], detail: bool) -> str:
    """A target's outcome in one run: its status, why it failed, and with ``detail`` (the
    bars-on run) its agreement, the int8 recipes and fallback steps it measured, and whether
    the time budget stopped its search."""
    said = f"{target}: {run['status']}"
    if run["error"]:
        return f"{said} ({run['error']})"
    if not detail or run.get("agreement") is None:
        return said
    stopped = any(w.startswith(STOPPED) for w in run.get("warnings", []))
    return (
        f"{said} ({100 * run['agreement']:.1f} %, {run.get('recipes_tried', 0)} recipe(s), "
        f"{run['excluded_steps']} fallback step(s){', stopped for time' if stopped else ''})"
    )


def _size_mb(files: list[Path]) -> float:
    return sum(f.stat().st_size for f in files if f.exists()) / 2**20


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"  # not measured before it was recorded


def plot(results: dict[str, Any]) -> None:
    """One lane per target and run: from the target's first progress event (its fp32 export,
    during the preparation, for a target that has one of its own) to its last."""
    models = [n for n, e in results["models"].items() if "target_spans_s" in e["runs"].get("1", {})]
    if not models:
        return
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for axis, name in zip(axes[0], models, strict=True):
        labels: list[str] = []
        for run_index, (parallel, run) in enumerate(results["models"][name]["runs"].items()):
            for target, (first, last) in run.get("target_spans_s", {}).items():
                axis.barh(len(labels), last - first, left=first, color=f"C{run_index}")
                labels.append(f"{_run_label(parallel)}: {target}")
            axis.axvline(run["wall_s"], color=f"C{run_index}", linestyle="--", linewidth=1)
        axis.set_yticks(range(len(labels)), labels)
        axis.invert_yaxis()
        axis.set_xlabel("seconds from the start (dashed: the conversion's end)")
        axis.set_title(f"{name}: each target's first to last event")
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
