"""Markdown tables and plots for benchmarks.training.finetune (kept apart: the runner stays
small)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

AGREEMENT_BAR, DROP_BAR, FP32_BAR = 0.99, 0.5, 0.2  # int8-ready bars (issue 10)


def mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``scale * values`` as "mean ± std" (std 0 for one value; "-" for none)."""
    if not values:
        return "-"
    values = [scale * v for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def _seeds(runs: list[dict[str, Any]]) -> str:
    return ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))


def _group(runs: dict[str, dict[str, Any]], stage: str, key: tuple[str, ...]) -> dict:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for run in runs.values():
        if run["stage"] == stage:
            groups[tuple(run.get(k) for k in key)].append(run)
    return dict(sorted(groups.items(), key=lambda item: str(item[0])))


def _migration_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "## Migration: LayerNorm teacher -> UN student",
        "",
        "Test accuracy (%) on the 1000-sample test split, mean ± std over seeds; agreement = "
        "top-1 agreement with the LN teacher on the test split; int8 = pure int8 ORT QDQ of the "
        "migrated model (agreement with its fp32 ONNX / top-1 drop in points).",
        "",
        "| task | loss | epochs | lr | seeds | student | teacher | agreement | before "
        "fine-tune | int8 agreement | int8 drop (pt) | time / run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (task, mode, epochs, lr), group in _group(
        runs, "migrate", ("task", "mode", "epochs", "lr")
    ).items():
        loss = "KL + labels" if mode == "distill" else "labels only"
        lines.append(
            f"| {task} | {loss} | {epochs} | {lr:g} | {_seeds(group)} "
            f"| {mean_std([r['test_accuracy'] for r in group])} "
            f"| {mean_std([r['teacher_test_accuracy'] for r in group])} "
            f"| {mean_std([r['test_agreement_with_teacher'] for r in group])} "
            f"| {mean_std([r['initial_agreement'] for r in group])} "
            f"| {mean_std([r['int8_ort']['agreement'] for r in group])} "
            f"| {mean_std([r['int8_ort']['drop_points'] for r in group], scale=1.0, digits=2)} "
            f"| {statistics.mean(r['seconds'] for r in group):.0f} |"
        )
    zero = [r for r in runs.values() if r["stage"] == "zero"]
    if zero:
        lines += ["", "No fine-tuning at all (swap + statistics measured on 20 training batches, "
                  "the starting point of every migration above):", ""]  # fmt: skip
        for run in sorted(zero, key=lambda r: r["task"]):
            lines.append(
                f"- {run['task']}: test accuracy {100 * run['test_accuracy']:.1f} % (teacher "
                f"{100 * run['teacher_test_accuracy']:.1f} %), agreement "
                f"{100 * run['test_agreement_with_teacher']:.1f} %, pure int8 agreement "
                f"{100 * run['int8_ort']['agreement']:.1f} %, drop "
                f"{run['int8_ort']['drop_points']:.2f} pt"
            )
    scratch = _group(runs, "scratch", ("task", "epochs"))
    if scratch:
        lines += ["", "From-scratch UN with the example recipe (the cost a migration avoids):", ""]
        for (task, epochs), group in scratch.items():
            lines.append(
                f"- {task}, {epochs} epochs, seeds {_seeds(group)}: test accuracy "
                f"{mean_std([r['test_accuracy'] for r in group])} %, "
                f"{statistics.mean(r['seconds'] for r in group):.0f} s / run"
            )
    return lines


def _int8_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "## int8-ready fine-tune",
        "",
        f"Bars: fp32 test accuracy within {FP32_BAR} pt of the source, pure int8 ORT agreement "
        f">= {100 * AGREEMENT_BAR:.0f} %, top-1 drop <= {DROP_BAR} pt. Residual abs max = the "
        "largest norm input over 256 training samples (the int8 input of qkv/fc1 once folded).",
        "",
    ]
    for run in runs.values():
        if run["stage"] == "baseline" and "int8_ort" in run:
            q = run["int8_ort"]
            lines.append(
                f"- baseline {run['model']}: fp32 {100 * q['fp32_accuracy']:.1f} %, int8 "
                f"agreement {100 * q['agreement']:.1f} %, drop {q['drop_points']:.2f} pt, "
                f"residual abs max {max(run['ranges'].values()):.0f}"
            )
    lines += [
        "",
        "| source | method | weight | target | epochs | lr | seeds | fp32 (source) | fp32 change "
        "(pt) | int8 agreement | int8 drop (pt) | residual abs max after | bars met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("source", "method", "weight", "target", "epochs", "lr")
    for key, group in _group(runs, "int8", keys).items():
        source, method, weight, target, epochs, lr = key
        change = [100 * (r["test_accuracy"] - r["source_test_accuracy"]) for r in group]
        agreements = [r["int8_ort"]["agreement"] for r in group]
        drops = [r["int8_ort"]["drop_points"] for r in group]
        met = sum(
            a >= AGREEMENT_BAR and d <= DROP_BAR and c >= -FP32_BAR
            for a, d, c in zip(agreements, drops, change, strict=True)
        )
        lines.append(
            f"| {source} | {method} | {weight:g} | {'' if target is None else f'{target:g}'} "
            f"| {epochs} | {lr:g} | {_seeds(group)} "
            f"| {mean_std([r['test_accuracy'] for r in group])} "
            f"({100 * group[0]['source_test_accuracy']:.1f}) "
            f"| {mean_std(change, scale=1.0, digits=2)} | {mean_std(agreements)} "
            f"| {mean_std(drops, scale=1.0, digits=2)} "
            f"| {statistics.mean(max(r['ranges_after'].values()) for r in group):.1f} "
            f"| {met}/{len(group)} |"
        )
    return lines


def _recal_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    chosen = [r for r in runs.values() if r["stage"] == "recal"]
    if not chosen:
        return []
    lines = [
        "## Precise inference statistics (edge_un.recalibrate)",
        "",
        "Inference statistics recomputed layer by layer in eval mode over N training batches of "
        "32 (weights untouched). TID = mean over those batches of ||sqrt(var_B) - sqrt(var)|| / "
        "||sqrt(var)||, against the stored statistics (before) and the recomputed ones (after).",
        "",
        "| model | batches | test acc before (%) | after (%) | TID before, per layer | "
        "TID after, per layer |",
        "|---|---|---|---|---|---|",
    ]
    for run in sorted(chosen, key=lambda r: (r["source"], r["batches"])):
        tids = run["layers"]
        before = ", ".join(f"{v['tid_before']:.3f}" for v in tids.values())
        after = ", ".join(f"{v['tid_after']:.3f}" for v in tids.values())
        lines.append(
            f"| {run['source']} | {run['batches']} | {100 * run['test_accuracy_before']:.1f} "
            f"| {100 * run['test_accuracy_after']:.1f} | {before} | {after} |"
        )
    return lines


def _plot_migration(runs: dict[str, dict[str, Any]], results: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    groups = _group(runs, "migrate", ("task", "mode", "epochs", "lr"))
    for (task, mode, epochs, lr), group in groups.items():
        if task != "vit-mnist":  # text: 1 epoch, a point, not a curve (see the table)
            continue
        length = min(len(r["history"]) for r in group)
        acc = [100 * statistics.mean(r["history"][i]["val_accuracy"] for r in group)
               for i in range(length)]  # fmt: skip
        label = f"{task} migrate, {'KL + labels' if mode == 'distill' else 'labels only'}"
        ax.plot(range(1, length + 1), acc, marker=".",
                label=f"{label} ({epochs} ep, lr {lr:g}, {len(group)} seed(s))")  # fmt: skip
    for (task, epochs), group in _group(runs, "scratch", ("task", "epochs")).items():
        if task != "vit-mnist":
            continue
        length = min(len(r["history"]) for r in group)
        acc = [100 * statistics.mean(r["history"][i]["val_accuracy"] for r in group)
               for i in range(length)]  # fmt: skip
        ax.plot(range(1, length + 1), acc, "--", label=f"{task} UN from scratch ({epochs} ep)")
    for task in ("vit-mnist",):
        history = _bundled_un_history(task)
        if history:
            acc = [100 * h["val_accuracy"] for h in history]
            ax.plot(range(1, len(acc) + 1), acc, ":", color="gray",
                    label=f"{task}-un from scratch (bundled example, {len(acc)} ep)")  # fmt: skip
    ax.set(xlabel="epoch", ylabel="validation accuracy (%)", ylim=(80, 100), xlim=(0, 60),
           title="ViT, MNIST-5k, LN -> UN: accuracy vs fine-tune epochs")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(results / "finetune_migration.png", dpi=110)
    plt.close(fig)


def _bundled_un_history(task: str) -> list[dict[str, Any]]:
    """The bundled from-scratch UN example's per-epoch validation record (seed 0)."""
    import edge_un
    from edge_un import examples

    name = f"{task}-un"
    if name not in examples.names():
        return []
    _, info = edge_un.load_checkpoint(examples.path(name))
    return list(info.metadata.get("history", []))


def _plot_ranges(runs: dict[str, dict[str, Any]], results: Path) -> None:
    import matplotlib.pyplot as plt

    curves: dict[str, dict[str, float]] = {}
    for run in runs.values():
        if run["stage"] == "baseline" and run["task"] == "vit-mnist":
            curves[run["model"].removesuffix(".safetensors")] = run["ranges"]
    best = _best_int8(runs)
    if best is not None:
        label = (
            f"vit-mnist-un after int8-ready ({best['method']} {best['weight']:g}, "
            f"seed {best['seed']}, int8 agreement {100 * best['int8_ort']['agreement']:.1f} %)"
        )
        curves[label] = best["ranges_after"]
    on_un = [r for r in runs.values() if r["stage"] == "int8" and r["source"] == "vit-mnist-un"]
    if on_un:
        narrow = min(on_un, key=lambda r: max(r["ranges_after"].values()))
        change = 100 * (narrow["test_accuracy"] - narrow["source_test_accuracy"])
        label = (
            f"vit-mnist-un after int8-ready ({narrow['method']} {narrow['weight']:g}, "
            f"fp32 {change:+.1f} pt, int8 agreement {100 * narrow['int8_ort']['agreement']:.1f} %)"
        )
        curves[label] = narrow["ranges_after"]
    migrated = [
        r for r in runs.values()
        if r["stage"] == "migrate" and r["mode"] == "distill" and r["task"] == "vit-mnist"
    ]  # fmt: skip
    if migrated:
        curves[f"migrated LN -> UN (seed {migrated[0]['seed']})"] = migrated[0]["ranges"]
    if not curves:
        return
    fig, ax = plt.subplots(figsize=(11.5, 4.2))
    for label, ranges in curves.items():
        names = list(ranges)
        ax.plot(range(len(names)), list(ranges.values()), marker="o", label=label)
    ax.set_xticks(range(len(names)), [n.replace("blocks.", "b") for n in names], rotation=45)
    ax.set(yscale="log", ylabel="abs max of the norm input", xlabel="norm, shallow -> deep",
           title="Residual stream range per block (256 training samples)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(results / "finetune_residual_ranges.png", dpi=110)
    plt.close(fig)


def _best_int8(runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    chosen = [
        r for r in runs.values() if r["stage"] == "int8" and r["source"] == "vit-mnist-un"
    ]  # fmt: skip
    if not chosen:
        return None
    return max(chosen, key=lambda r: (r["int8_ort"]["agreement"], r["test_accuracy"]))


def write_report(runs: dict[str, dict[str, Any]], md_path: Path, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    lines = [
        "# Fine-tuning for deployment (benchmarks/training/finetune.py)",
        "",
        "Every number below comes from benchmarks/results/finetune.json (one record per run, "
        "one torch thread each, one training at a time on a 2-core machine shared with other "
        "jobs: the times are wall times under that load, not clean speed measurements). Test "
        "splits: 1000 images (MNIST), 2562 sentences (Rotten Tomatoes). Where a row has fewer "
        "than 3 seeds, the compute budget did not allow more.",
        "",
        *_migration_table(runs),
        "",
        *_int8_table(runs),
        "",
        *_recal_table(runs),
        "",
        "Plots: `finetune_migration.png` (accuracy against fine-tune epochs), "
        "`finetune_residual_ranges.png` (residual stream range per block).",
    ]
    md_path.write_text("\n".join(lines) + "\n")
    _plot_migration(runs, results)
    _plot_ranges(runs, results)
