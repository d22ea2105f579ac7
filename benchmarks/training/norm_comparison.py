"""The paper's claim at small scale: which norms train a Transformer as well as LayerNorm?

Norms {ln, bn, un, un without outlier filtration, mabn, pn, rbn, on} x tasks {ViT on MNIST-5k
(pre-norm), text Transformer on Rotten Tomatoes pre-norm and post-norm} x seeds, one recipe per
task (the "bench" presets in edge_un/training/presets.py). A run whose loss or outputs become
NaN/Inf is recorded as FAIL, never dropped.

Writes, under benchmarks/results/:
  norm_comparison.json          every run (accuracy, per-epoch history, UN filtered steps)
  norm_comparison_table.md      mean +- std test accuracy, and UN filtered steps by depth
  norm_comparison_<task>.png    training curves per task
  norm_comparison_filtered.png  UN outlier-filtered steps by layer depth (cf. the paper's Fig. 5)

Resumable: runs already in the JSON are skipped, so a killed benchmark loses at most the runs
in flight. Each new run records the date and torch version it ran with. ``--carry-over OLD.json``
adds the runs of an older results file that this one lacks, marked ``carried_over`` (the table
marks every cell holding one with a dagger). Usage:
    python -m benchmarks.training.norm_comparison [--workers 2] [--seeds 0 1 2] \\
        [--carry-over OLD.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS

JSON_PATH = RESULTS / "norm_comparison.json"
TABLE_PATH = RESULTS / "norm_comparison_table.md"

# name -> (norm kind, norm kwargs)
NORMS: dict[str, tuple[str, dict[str, Any]]] = {
    "ln": ("ln", {}),
    "bn": ("bn", {}),
    "un": ("un", {}),
    "un-nofilter": ("un", {"outlier_filtration": False}),
    "mabn": ("mabn", {}),
    "pn": ("pn", {}),
    "rbn": ("rbn", {}),
    "on": ("on", {}),
}
# name -> (model, data, norm_first)
TASKS: dict[str, tuple[str, str, bool]] = {
    "vit-mnist": ("vit", "mnist", True),
    "text-rt-prenorm": ("text", "rt", True),
    "text-rt-postnorm": ("text", "rt", False),
}
PRESET = "bench"

DATASETS: dict[str, Any] = {}  # data name -> the data set, loaded once per process


def one_thread() -> None:
    """One torch thread in this process (each pool process of the comparison runs with it)."""
    import torch

    # One thread per process: two processes on two cores beat one process with two threads.
    torch.set_num_threads(1)


def run_one(task: str, norm_name: str, seed: int) -> dict[str, Any]:
    """Train one (task, norm, seed); a diverged run comes back with status FAIL."""
    from edge_un.data import load_dataset
    from edge_un.training import TrainingDivergedError, fit

    model, data, norm_first = TASKS[task]
    kind, kwargs = NORMS[norm_name]
    if data not in DATASETS:
        DATASETS[data] = load_dataset(data)
    import torch

    record: dict[str, Any] = {"task": task, "norm": norm_name, "seed": seed}
    record["run"] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    start = time.perf_counter()
    try:
        result = fit(
            model, PRESET, kind, data, seed=seed, norm_first=norm_first, norm_kwargs=kwargs,
            dataset=DATASETS[data], progress=False, log=None,
        )  # fmt: skip
    except TrainingDivergedError as error:
        record.update(status="FAIL", error=str(error))
    else:
        record.update(
            status="ok",
            test_accuracy=result.test_accuracy,
            val_accuracy=result.val_accuracy,
            num_filtered=result.num_filtered,
            history=[
                {"epoch": r.epoch, "train_loss": r.train_loss, "val_accuracy": r.val_accuracy}
                for r in result.history
            ],
            recipe=result.metadata["recipe"],
        )
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


# -- bookkeeping -----------------------------------------------------------------------------


def grid_arguments(parser: argparse.ArgumentParser, norms: list[str]) -> None:
    """The runs to make, ``--seeds``, ``--tasks`` and ``--norms`` (of ``norms``), and
    ``--report-only``: this benchmark's and norm_recalibration's."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--norms", nargs="+", default=norms, choices=norms)
    parser.add_argument("--report-only", action="store_true", help="only rewrite table and plots")


def runs_to_do(
    runs: list[dict[str, Any]], seeds: list[int], tasks: list[str], norms: list[str]
) -> list[tuple[str, str, int]]:
    """The (task, norm, seed) runs not in ``runs`` yet, seed-major: a partial benchmark already
    covers every (task, norm) once."""
    done = {(r["task"], r["norm"], r["seed"]) for r in runs}
    return [(t, n, s) for s in seeds for t in tasks for n in norms if (t, n, s) not in done]


def load_runs() -> list[dict[str, Any]]:
    if not JSON_PATH.is_file():
        return []
    return json.loads(JSON_PATH.read_text())["runs"]


def save_runs(runs: list[dict[str, Any]]) -> None:
    from edge_un.training import get_preset

    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "description": "test accuracy per (task, norm, seed); FAIL = NaN/Inf loss or outputs",
        "presets": {
            model: get_preset(model, PRESET).to_dict() for model in {t[0] for t in TASKS.values()}
        },
        "tasks": {
            name: {"model": m, "data": d, "norm_first": f} for name, (m, d, f) in TASKS.items()
        },
        "norms": {name: {"kind": k, "kwargs": kw} for name, (k, kw) in NORMS.items()},
        "runs": sorted(runs, key=lambda r: (r["task"], list(NORMS).index(r["norm"]), r["seed"])),
    }
    tmp = JSON_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(JSON_PATH)


# -- report ----------------------------------------------------------------------------------


def carry_over(runs: list[dict[str, Any]], old_path: Path) -> list[dict[str, Any]]:
    """The runs of an older results file that ``runs`` lacks, marked carried over."""
    have = {(r["task"], r["norm"], r["seed"]) for r in runs}
    old = json.loads(old_path.read_text())["runs"]
    return [
        {**r, "carried_over": True}
        for r in old
        if (r["task"], r["norm"], r["seed"]) not in have and r["norm"] in NORMS
    ]


def cell(runs: list[dict[str, Any]]) -> str:
    """mean +- std of test accuracy in %, or FAIL with how many of the seeds failed; a dagger
    when any of the runs was carried over from an older results file."""
    if not runs:
        return "-"
    mark = " †" if any(r.get("carried_over") for r in runs) else ""
    return _cell(runs) + mark


def _cell(runs: list[dict[str, Any]]) -> str:
    ok = [100 * r["test_accuracy"] for r in runs if r["status"] == "ok"]
    failed = len(runs) - len(ok)
    if failed:
        rest = f", others {statistics.mean(ok):.1f}" if ok else ""
        return f"FAIL ({failed}/{len(runs)}{rest})"
    std = statistics.stdev(ok) if len(ok) > 1 else 0.0
    return f"{statistics.mean(ok):.1f} ± {std:.1f}"


def layer_depth_key(name: str) -> tuple[int, int]:
    # blocks.<i>.norm<j> in depth order, the final norm last.
    parts = name.split(".")
    if parts[0] == "blocks":
        return int(parts[1]), int(parts[2][-1])
    return 10**6, 0


def filtered_by_layer(runs: list[dict[str, Any]], task: str) -> dict[str, float]:
    chosen = [r for r in runs if r["task"] == task and r["norm"] == "un" and r["status"] == "ok"]
    if not chosen:
        return {}
    names = sorted(chosen[0]["num_filtered"], key=layer_depth_key)
    return {n: statistics.mean(r["num_filtered"][n] for r in chosen) for n in names}


def write_table(runs: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        f"Test accuracy (%), mean ± std over seeds {seeds}; FAIL = a seed diverged (NaN/Inf).",
        "",
        "| norm | " + " | ".join(TASKS) + " |",
        "|---|" + "---|" * len(TASKS),
    ]
    for norm in NORMS:
        cells = [cell([r for r in runs if r["task"] == t and r["norm"] == norm]) for t in TASKS]
        lines.append(f"| {norm} | " + " | ".join(cells) + " |")
    carried = [r for r in runs if r.get("carried_over")]
    if carried:
        rerun = len(runs) - len(carried)
        lines += [
            "",
            f"† holds runs carried over from an older results file ({len(carried)} of "
            f"{len(runs)} runs; the other {rerun} were run with the current code). Carried over:",
            "",
        ]
        for task in TASKS:
            for norm in NORMS:
                seeds_old = [r["seed"] for r in carried if r["task"] == task and r["norm"] == norm]
                if seeds_old:
                    lines.append(f"- {task} {norm}: seeds {seeds_old}")
    lines += ["", "UN outlier-filtered training steps per layer (mean over seeds), by depth:", ""]
    for task in TASKS:
        counts = filtered_by_layer(runs, task)
        if counts:
            total = next(r for r in runs if r["task"] == task and r["status"] == "ok")
            steps = total["recipe"]["total_steps"]
            lines.append(f"- {task} ({steps} steps): " + ", ".join(
                f"{name} {value:.1f}" for name, value in counts.items()
            ))  # fmt: skip
    text = "\n".join(lines) + "\n"
    TABLE_PATH.write_text(text)
    return text


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(NORMS, plt.get_cmap("tab10").colors, strict=False))
    for task in TASKS:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
        for norm in NORMS:
            chosen = [r for r in runs if r["task"] == task and r["norm"] == norm]
            ok = [r for r in chosen if r["status"] == "ok"]
            if not ok:
                if chosen:
                    ax_acc.plot([], [], color=colors[norm], label=f"{norm} (FAIL)")
                continue
            epochs = [h["epoch"] for h in ok[0]["history"]]
            loss = [
                statistics.mean(r["history"][i]["train_loss"] for r in ok)
                for i in range(len(epochs))
            ]
            acc = [
                100 * statistics.mean(r["history"][i]["val_accuracy"] for r in ok)
                for i in range(len(epochs))
            ]
            style = "--" if norm == "un-nofilter" else "-"
            label = norm + (f" ({len(chosen) - len(ok)} FAIL)" if len(ok) < len(chosen) else "")
            ax_loss.plot(epochs, loss, style, color=colors[norm], label=label, marker=".")
            ax_acc.plot(epochs, acc, style, color=colors[norm], label=label, marker=".")
        ax_loss.set(xlabel="epoch", ylabel="training loss", title=f"{task}: training loss")
        ax_acc.set(
            xlabel="epoch", ylabel="validation accuracy (%)", title=f"{task}: validation accuracy"
        )
        ax_loss.set_yscale("log")
        ax_acc.legend(fontsize=8, loc="lower right")
        for ax in (ax_loss, ax_acc):
            ax.grid(alpha=0.3)
        fig.suptitle("mean over seeds; each norm trained with the same recipe", fontsize=9)
        fig.tight_layout()
        fig.savefig(RESULTS / f"norm_comparison_{task}.png", dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(TASKS), figsize=(13, 3.8), sharey=False)
    for ax, task in zip(axes, TASKS, strict=True):
        counts = filtered_by_layer(runs, task)
        labels = [n.replace("blocks.", "b").replace(".norm", ".n") for n in counts]
        ax.bar(range(len(counts)), list(counts.values()), color="tab:green")
        ax.set_xticks(range(len(counts)), labels, rotation=45, fontsize=8)
        ax.set(title=task, xlabel="UN layer, shallow → deep", ylabel="filtered steps")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "UN outlier filtration: filtered training steps per layer (mean over seeds)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "norm_comparison_filtered.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="training processes at once")
    grid_arguments(parser, list(NORMS))
    parser.add_argument(
        "--carry-over", type=Path, help="add the runs of this older JSON that are missing here"
    )
    args = parser.parse_args()

    from tqdm import tqdm

    runs = load_runs()
    todo = runs_to_do(runs, args.seeds, args.tasks, args.norms)
    if not args.report_only and todo:
        started = time.perf_counter()
        with ProcessPoolExecutor(args.workers, initializer=one_thread) as pool:
            futures = [pool.submit(run_one, *key) for key in todo]
            bar = tqdm(as_completed(futures), total=len(futures), unit="run")
            for future in bar:
                record = future.result()
                runs.append(record)
                save_runs(runs)
                score = (
                    f"{100 * record['test_accuracy']:.1f}%" if record["status"] == "ok" else "FAIL"
                )
                name = f"{record['task']:17s} {record['norm']:12s} seed {record['seed']}"
                bar.write(f"{name}: {score} ({record['seconds']}s)")
        print(f"wall time {time.perf_counter() - started:.0f}s for {len(todo)} runs")
    if args.carry_over is not None:
        runs += carry_over(runs, args.carry_over)
        save_runs(runs)
    print(write_table(runs))
    plot(runs)


if __name__ == "__main__":
    main()
