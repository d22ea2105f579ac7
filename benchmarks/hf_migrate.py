"""Hugging Face LayerNorm models to int8 on every target: migrate -> int8-ready -> convert.

    .venv/bin/python benchmarks/hf_migrate.py                # ~45 min on 2 cores
    .venv/bin/python benchmarks/hf_migrate.py --report-only  # Markdown and plot from the JSON

A small ``ViTForImageClassification`` (MNIST-5k) and ``BertForSequenceClassification`` (Rotten
Tomatoes), trained with LayerNorm on the data that ships in wheels
(``python -m edge_un.examples.make_hf``; seed 0 is the bundled ``hf-*-ln``), then, as a user
would, through the command line with its defaults: ``edge-un migrate DIR`` (to UN, distilled
from the frozen LN teacher), ``edge-un finetune --int8-ready`` (README's recipe: ``decay 1e-3``
for the ViT, ``range 32`` for the text model) and ``edge-un convert`` for every target, for
seeds 0, 1, 2. Recorded: fp32 test accuracy at each step (held-out test split) and each target's
pure int8 drift (before any 16-bit fallback) in the target's arithmetic. The two models' chains
run side by side, one thread each.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from results_main import RESULTS, benchmark_main

import edge_un
from edge_un import examples
from quant.host import describe_host
from quant.report import Report
from quant.targets import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT, TARGET_NAMES

NAME = "hf_migrate"
SEEDS = (0, 1, 2)
MODELS = {
    "vit": {"teacher": "hf-vit-mnist-ln", "int8_ready": ["--method", "decay", "--weight", "1e-3"]},
    "bert": {"teacher": "hf-bert-rt-ln", "int8_ready": ["--method", "range", "--target", "32"]},
}
CLI = [sys.executable, "-m", "service.cli"]


def step(command: list[str], log: Path) -> float:
    """Run one command (its output to ``log``); its wall time in seconds."""
    start = time.perf_counter()
    with log.open("w") as stream:
        subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def chain(model: str, seed: int, work: Path) -> dict[str, Any]:
    """Teacher -> migrated -> int8-ready -> converted, for one model and seed."""
    spec = MODELS[model]
    teacher = work / f"{model}-ln-{seed}"
    seconds = {}
    if seed == 0:
        teacher = examples.path(spec["teacher"])
    else:
        seconds["train LN"] = step(
            [sys.executable, "-m", "edge_un.examples.make_hf", "--model", model, "--norm", "ln",
             "--seed", str(seed), "--threads", "1", "--out", str(teacher)],
            work / f"{model}-{seed}-train.log",
        )  # fmt: skip
    migrated, ready = work / f"{model}-un-{seed}", work / f"{model}-un8-{seed}"
    seconds["migrate"] = step(
        [*CLI, "migrate", str(teacher), "--seed", str(seed), "--threads", "1", "--out",
         str(migrated)], work / f"{model}-{seed}-migrate.log",
    )  # fmt: skip
    seconds["int8-ready"] = step(
        [*CLI, "finetune", str(migrated), "--int8-ready", *spec["int8_ready"], "--seed",
         str(seed), "--threads", "1", "--out", str(ready)], work / f"{model}-{seed}-ready.log",
    )  # fmt: skip
    out = work / f"{model}-out-{seed}"
    start = time.perf_counter()
    convert = subprocess.run([*CLI, "convert", str(ready), "-o", str(out)], capture_output=True)
    seconds["convert"] = time.perf_counter() - start  # exit 1 when a target failed: recorded
    report = Report.read(out / "report.json")
    accuracy = {
        name: edge_un.load_pretrained(path)[1].metadata["test_accuracy"]
        for name, path in (("teacher", teacher), ("migrated", migrated), ("int8_ready", ready))
    }
    targets = {}
    for name, target in report.targets.items():
        pure = target.pure_int8_drift or target.drift
        targets[name] = {
            "status": target.status,
            "error": target.error,
            "pure_agreement": None if pure is None else pure.agreement,
            "pure_drop_pts": None if pure is None else pure.top1_drop_pts,
            "pure_within_bar": None if pure is None else pure.within_bar,
            "arithmetic": None if pure is None else pure.arithmetic,
        }
    print(f"{model} seed {seed}: {accuracy}, exit {convert.returncode}", flush=True)
    return {"accuracy": accuracy, "targets": targets, "seconds": seconds,
            "convert_exit": convert.returncode}  # fmt: skip


def run() -> dict[str, Any]:
    results: dict[str, Any] = {"host": describe_host().model_dump(), "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)

        def all_seeds(model: str) -> dict[str, Any]:
            return {str(seed): chain(model, seed, work) for seed in SEEDS}

        with ThreadPoolExecutor(max_workers=len(MODELS)) as pool:
            runs = dict(zip(MODELS, pool.map(all_seeds, MODELS), strict=True))
    results["runs"] = runs
    return results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def markdown(results: dict[str, Any]) -> str:
    from quant.report import Host

    host = Host.model_validate(results["host"])
    lines = [
        "# Hugging Face LayerNorm models through migrate, int8-ready and convert",
        "",
        f"Made by `benchmarks/hf_migrate.py` on {host.label()}. fp32 top-1 on the held-out test "
        "split; pure int8 = the file before any 16-bit fallback, top-1 agreement with fp32 / "
        "top-1 drop, in each target's arithmetic. Bars: migrated within 0.5 pt of its teacher; "
        f"int8 drop <= {DEFAULT_MAX_DRIFT} pt and agreement >= "
        f"{100 * DEFAULT_MIN_AGREEMENT:.0f} %.",
        "",
        "| model | seed | LN teacher | migrated (UN) | int8-ready | "
        + " | ".join(f"{t} pure int8" for t in TARGET_NAMES)
        + " | wall: migrate / int8-ready / convert |",
        "|---|---|---|---|---|" + "---|" * len(TARGET_NAMES) + "---|",
    ]
    for model, runs in results["runs"].items():
        for seed, run in runs.items():
            acc = run["accuracy"]
            cells = []
            for name in TARGET_NAMES:
                t = run["targets"].get(name, {})
                if t.get("pure_agreement") is None:
                    cells.append(f"failed: {t.get('error')}")
                    continue
                mark = "" if t["pure_within_bar"] else " (over)"
                cells.append(f"{_pct(t['pure_agreement'])} / {t['pure_drop_pts']:.1f}{mark}")
            gap = 100 * (acc["migrated"] - acc["teacher"])
            lines.append(
                f"| {model} | {seed} | {_pct(acc['teacher'])} | {_pct(acc['migrated'])} "
                f"({gap:+.1f}) | {_pct(acc['int8_ready'])} | "
                + " | ".join(cells)
                + f" | {run['seconds']['migrate']:.0f} / {run['seconds']['int8-ready']:.0f} / "
                f"{run['seconds']['convert']:.0f} s |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    figure, axes = plt.subplots(1, len(results["runs"]), figsize=(6 * len(results["runs"]), 4))
    for axis, (model, runs) in zip(np.atleast_1d(axes), results["runs"].items(), strict=True):
        for seed, run in runs.items():
            values = [100 * (run["targets"][t]["pure_agreement"] or 0) for t in TARGET_NAMES]
            axis.plot(TARGET_NAMES, values, marker="o", label=f"seed {seed}")
        axis.axhline(100 * DEFAULT_MIN_AGREEMENT, color="k", linestyle="--", linewidth=0.8)
        axis.set_title(f"HF {model}: pure int8 agreement after int8-ready")
        axis.set_ylabel("top-1 agreement with fp32 (%)")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / f"{NAME}.png", dpi=120)


def main() -> None:
    benchmark_main(NAME, __doc__.splitlines()[0], run, markdown, plot)


if __name__ == "__main__":
    main()
