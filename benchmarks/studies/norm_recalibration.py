"""Precise inference statistics on the norm comparison: does recalibration help, and does TID
predict by how much?

For every offline norm of ``norm_comparison.NORMS`` (all but ``ln``, whose statistics are per
token and never stored), every task of ``norm_comparison.TASKS`` and seeds 0-2, the model is
trained exactly as the norm comparison trains it (its own ``run_one``, called unchanged; the
trained model is taken from the ``fit`` call it makes). Then, on the trained model:

1. test and validation accuracy with the statistics training left (``before``);
2. ``edge_un.recalibrate(model, train_inputs, batches=N, batch_size=<the recipe's>)``: every
   offline norm's inference statistics recomputed layer by layer, weights frozen, over N
   seeded batches of the training split; per-layer TID (training-inference discrepancy: the
   mean over those batches of ``||sigma_B - sigma|| / ||sigma||`` plus, for centred norms,
   ``||mu_B - mu|| / ||sigma||``) before and after;
3. test and validation accuracy again (``after``).

Writes, under benchmarks/results/:
  norm_recalibration.json       every run (accuracy before/after, per-layer TID, training record)
  norm_recalibration.md         the generated tables between the GENERATED markers (text around
                                them is kept)
  norm_recalibration_tid.png    per-layer TID before vs after, by depth, per task
  norm_recalibration_effect.png TID before vs accuracy change (the RBN paper's claim)

Resumable: runs already in the JSON are skipped. One process, one torch thread. Usage:
    python -m benchmarks.studies.norm_recalibration [--batches 20] [--seeds 0 1 2] [--tasks ...]
        [--norms ...] [--report-only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common.results import RESULTS
from benchmarks.training import norm_comparison as nc
from benchmarks.training.finetune_report import mean_std

JSON_PATH = RESULTS / "norm_recalibration.json"
MD_PATH = RESULTS / "norm_recalibration.md"
BEGIN, END = "<!-- GENERATED: norm_recalibration.py -->", "<!-- END GENERATED -->"
OFFLINE_NORMS = [name for name, (kind, _) in nc.NORMS.items() if kind != "ln"]
DEFAULT_BATCHES = 20


@contextlib.contextmanager
def capture_fit() -> Iterator[list[Any]]:
    """While active, ``edge_un.training.fit`` (which ``nc.run_one`` imports at call time) also
    hands its result to the yielded list, so the trained model can be used after ``run_one``."""
    import edge_un.training as training

    original = training.fit
    results: list[Any] = []

    def fit(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        results.append(result)
        return result

    training.fit = fit
    try:
        yield results
    finally:
        training.fit = original


def run_one(task: str, norm_name: str, seed: int, batches: int) -> dict[str, Any]:
    """Train one (task, norm, seed) as the norm comparison does, then recalibrate it."""
    from edge_un import recalibrate
    from edge_un.finetune import inference_statistics
    from edge_un.training import get_preset
    from edge_un.training.evaluation import accuracy

    with capture_fit() as captured:
        record = nc.run_one(task, norm_name, seed)
    record["train_seconds"] = record.pop("seconds")
    if record["status"] != "ok":
        return record
    (result,) = captured
    model = result.model
    data = nc.DATASETS[nc.TASKS[task][1]]
    train_x, _ = data.part("train")
    batch_size = get_preset(nc.TASKS[task][0], nc.PRESET).batch_size
    start = time.perf_counter()
    stored = inference_statistics(model)
    report = recalibrate(model, train_x, batches=batches, batch_size=batch_size, seed=seed)
    layers = report.as_dict()["layers"]
    shift = statistics_shift(stored, inference_statistics(model))
    record.update(
        test_before=record["test_accuracy"],
        val_before=record["val_accuracy"],
        test_after=accuracy(model, *data.part("test")),
        val_after=accuracy(model, *data.part("val")),
        test_samples=len(data.part("test")[1]),
        recalibration={"batches": report.batches, "samples": report.samples,
                       "batch_size": batch_size, "seed": seed},
        tid=layers,
        tid_before=statistics.mean(v["tid_before"] for v in layers.values()),
        tid_after=statistics.mean(v["tid_after"] for v in layers.values()),
        shift=shift,
        mean_shift=statistics.mean(shift.values()),
        recalibrate_seconds=round(time.perf_counter() - start, 1),
    )  # fmt: skip
    return record


def statistics_shift(stored: dict[str, Any], recalibrated: dict[str, Any]) -> dict[str, float]:
    """Per layer, how far recalibration moved the inference statistics, in TID's form:
    ``||sigma_stored - sigma_new|| / ||sigma_new||`` (+ the same for the mean if centred)."""
    shifts = {}
    for key, var in recalibrated.items():
        if not key.endswith(".running_var"):
            continue
        layer = key.removesuffix(".running_var")
        std = var.sqrt()
        gap = (stored[key].sqrt() - std).norm() / std.norm()
        if f"{layer}.running_mean" in recalibrated:
            mean = f"{layer}.running_mean"
            gap = gap + (stored[mean] - recalibrated[mean]).norm() / std.norm()
        shifts[layer] = float(gap)
    return shifts


# -- bookkeeping -----------------------------------------------------------------------------


def load_runs() -> list[dict[str, Any]]:
    if not JSON_PATH.is_file():
        return []
    return json.loads(JSON_PATH.read_text())["runs"]


def save_runs(runs: list[dict[str, Any]], batches: int) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "description": (
            "per (task, norm, seed): the norm comparison's training run, then test/val accuracy "
            "before and after edge_un.recalibrate over N training batches, per-layer TID before "
            "and after (measured on those batches); FAIL = training diverged"
        ),
        "batches": batches,
        "tasks": {n: {"model": m, "data": d, "norm_first": f} for n, (m, d, f) in nc.TASKS.items()},
        "norms": {n: {"kind": k, "kwargs": kw} for n, (k, kw) in nc.NORMS.items() if k != "ln"},
        "runs": sorted(
            runs, key=lambda r: (list(nc.TASKS).index(r["task"]), OFFLINE_NORMS.index(r["norm"]),
                                 r["seed"]),
        ),
    }  # fmt: skip
    tmp = JSON_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(JSON_PATH)


# -- report ----------------------------------------------------------------------------------


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation (ties averaged); NaN when either side is constant."""
    if len(x) < 3:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    try:
        return statistics.correlation(rx, ry)
    except statistics.StatisticsError:
        return math.nan


def ok_runs(runs: list[dict[str, Any]], task: str, norm: str) -> list[dict[str, Any]]:
    return [r for r in runs if r["task"] == task and r["norm"] == norm and r["status"] == "ok"]


def generated_text(runs: list[dict[str, Any]], batches: int) -> str:
    seeds = sorted({r["seed"] for r in runs})
    failed = [r for r in runs if r["status"] != "ok"]
    lines = [
        f"{len(runs)} runs ({len(failed)} FAIL), seeds {seeds}, N = {batches} batches of the "
        "recipe's batch size (ViT 32, text 64) from the training split. Accuracy in %, mean ± "
        "std over seeds; change = after - before per seed, then mean ± std. TID = mean over "
        "layers of the per-layer TID (on the recalibration batches); shift = mean over layers of "
        "how far recalibration moved the statistics (TID's form, stored vs recalibrated).",
        "",
        "| task | norm | runs | test before | test after | change | val change "
        "| TID before | TID after | shift |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in nc.TASKS:
        for norm in OFFLINE_NORMS:
            chosen = [r for r in runs if r["task"] == task and r["norm"] == norm]
            ok = [r for r in chosen if r["status"] == "ok"]
            if not chosen:
                continue
            count = f"{len(ok)}" + (f" (+{len(chosen) - len(ok)} FAIL)" if len(ok) < len(chosen)
                                    else "")  # fmt: skip
            lines.append(
                f"| {task} | {norm} | {count} "
                f"| {mean_std([r['test_before'] for r in ok], 100)} "
                f"| {mean_std([r['test_after'] for r in ok], 100)} "
                f"| {mean_std([r['test_after'] - r['test_before'] for r in ok], 100, 2)} "
                f"| {mean_std([r['val_after'] - r['val_before'] for r in ok], 100, 2)} "
                f"| {mean_std([r['tid_before'] for r in ok], 1, 3)} "
                f"| {mean_std([r['tid_after'] for r in ok], 1, 3)} "
                f"| {mean_std([r['mean_shift'] for r in ok], 1, 3)} |"
            )
    ok = [r for r in runs if r["status"] == "ok"]
    if ok:
        tid = [r["tid_before"] for r in ok]
        change = [r["test_after"] - r["test_before"] for r in ok]
        reproduced = _reproduced(ok)
        better = sum(c > 0 for c in change)
        worse = sum(c < 0 for c in change)
        lines += [
            "",
            f"Over all {len(ok)} runs: test accuracy changed by "
            f"{100 * statistics.mean(change):+.2f} points on average (better in {better}, worse "
            f"in {worse}, unchanged in {len(ok) - better - worse}); largest gain "
            f"{100 * max(change):+.1f}, largest loss {100 * min(change):+.1f}. Mean TID "
            f"{statistics.mean(tid):.3f} before, "
            f"{statistics.mean(r['tid_after'] for r in ok):.3f} after.",
            "",
            "Does TID predict the change? Spearman rank correlation over runs of the test-accuracy "
            "change with: the mean TID before recalibration; the part of it recalibration removed "
            "(TID before - after); the statistics shift; and the absolute change with the shift:",
            "",
            "| runs | TID before | TID removed | shift | abs(change) vs shift |",
            "|---|---|---|---|---|",
        ]
        for task in [None, *nc.TASKS]:
            sub = [r for r in ok if task is None or r["task"] == task]
            delta = [r["test_after"] - r["test_before"] for r in sub]
            shift = [r["mean_shift"] for r in sub]
            lines.append(
                f"| {task or 'all'} ({len(sub)}) "
                f"| {spearman([r['tid_before'] for r in sub], delta):+.2f} "
                f"| {spearman([r['tid_before'] - r['tid_after'] for r in sub], delta):+.2f} "
                f"| {spearman(shift, delta):+.2f} "
                f"| {spearman(shift, [abs(d) for d in delta]):+.2f} |"
            )
        lines += [
            "",
            f"Before-recalibration test accuracy equal to the committed norm_comparison.json "
            f"run of the same (task, norm, seed): {reproduced[0]} of {reproduced[1]}.",
        ]
    lines += ["", "Per-layer TID (mean over seeds), before -> after, in execution order:", ""]
    for task in nc.TASKS:
        for norm in OFFLINE_NORMS:
            chosen = ok_runs(runs, task, norm)
            if not chosen:
                continue
            names = list(chosen[0]["tid"])
            cells = ", ".join(
                f"{_short(n)} {statistics.mean(r['tid'][n]['tid_before'] for r in chosen):.3f}"
                f"->{statistics.mean(r['tid'][n]['tid_after'] for r in chosen):.3f}"
                for n in names
            )
            lines.append(f"- {task} {norm}: {cells}")
    seconds = sum(r.get("train_seconds", 0) + r.get("recalibrate_seconds", 0) for r in runs)
    recal = [r["recalibrate_seconds"] for r in ok]
    lines += [
        "",
        f"Time: {seconds / 60:.0f} min in all (training {sum(r['train_seconds'] for r in runs) / 60:.0f} "  # noqa: E501
        f"min; recalibration {statistics.mean(recal) if recal else 0:.1f} s per run on average).",
    ]
    return "\n".join(lines) + "\n"


def _short(name: str) -> str:
    return name.replace("blocks.", "b").replace(".norm", ".n")


def _reproduced(ok: list[dict[str, Any]]) -> tuple[int, int]:
    if not nc.JSON_PATH.is_file():
        return 0, 0
    committed = {(r["task"], r["norm"], r["seed"]): r for r in nc.load_runs()}
    pairs = [(r, committed.get((r["task"], r["norm"], r["seed"]))) for r in ok]
    pairs = [(r, c) for r, c in pairs if c is not None and c["status"] == "ok"]
    return sum(r["test_before"] == c["test_accuracy"] for r, c in pairs), len(pairs)


def write_markdown(runs: list[dict[str, Any]], batches: int) -> str:
    text = generated_text(runs, batches)
    block = f"{BEGIN}\n{text}{END}"
    if MD_PATH.is_file() and BEGIN in (old := MD_PATH.read_text()) and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        MD_PATH.write_text(head + block + tail)
    else:
        title = "# Precise inference statistics on the norm comparison"
        MD_PATH.write_text(f"{title} (`benchmarks/studies/norm_recalibration.py`)\n\n{block}\n")
    return text


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    colors = dict(zip(OFFLINE_NORMS, plt.get_cmap("tab10").colors, strict=False))
    fig, grid = plt.subplots(2, len(nc.TASKS), figsize=(15, 8), sharey="row")
    for column, task in enumerate(nc.TASKS):
        top, bottom = grid[0, column], grid[1, column]
        for norm in OFFLINE_NORMS:
            chosen = ok_runs(runs, task, norm)
            if not chosen:
                continue
            names = list(chosen[0]["tid"])
            for key, style in (("tid_before", "-"), ("tid_after", ":")):
                values = [statistics.mean(r["tid"][n][key] for r in chosen) for n in names]
                label = norm if key == "tid_before" else None
                top.plot(range(len(names)), values, style, color=colors[norm], marker=".",
                         label=label)  # fmt: skip
            shifts = [statistics.mean(r["shift"][n] for r in chosen) for n in names]
            bottom.plot(range(len(names)), shifts, color=colors[norm], marker=".", label=norm)
            for ax in (top, bottom):
                ax.set_xticks(range(len(names)), [_short(n) for n in names], rotation=45,
                              fontsize=8)  # fmt: skip
        top.set(title=f"{task}: TID before (solid), after (dotted)", yscale="log")
        bottom.set(title=f"{task}: shift of the statistics", yscale="log",
                   xlabel="norm layer, execution order")  # fmt: skip
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    grid[0, 0].set_ylabel("TID (mean over seeds)")
    grid[1, 0].set_ylabel("shift (TID form: stored vs recalibrated)")
    grid[0, 0].legend(fontsize=8)
    fig.suptitle(
        f"per-layer TID on the {runs[0]['recalibration']['batches'] if runs else '?'} "
        "recalibration batches, and how far recalibration moved each layer's statistics",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "norm_recalibration_tid.png", dpi=110)
    plt.close(fig)

    markers = dict(zip(nc.TASKS, "os^", strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, label in (
        (axes[0], "tid_before", "mean TID before recalibration"),
        (axes[1], "mean_shift", "mean shift of the statistics (stored vs recalibrated)"),
    ):
        for run in runs:
            if run["status"] != "ok":
                continue
            change = 100 * (run["test_after"] - run["test_before"])
            ax.scatter(run[key], change, color=colors[run["norm"]],
                       marker=markers[run["task"]], s=30, alpha=0.8)  # fmt: skip
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel=label)
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    for norm in OFFLINE_NORMS:
        axes[0].scatter([], [], color=colors[norm], label=norm)
    for task, marker in markers.items():
        axes[0].scatter([], [], color="gray", marker=marker, label=task)
    axes[0].set_ylabel("test accuracy change by recalibration (points)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Does TID predict what recalibration changes? One point per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "norm_recalibration_effect.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    nc.grid_arguments(parser, OFFLINE_NORMS)
    args = parser.parse_args()

    nc.one_thread()  # as the norm comparison's training processes
    runs = load_runs()
    if runs and (previous := json.loads(JSON_PATH.read_text())["batches"]) != args.batches:
        parser.error(f"{JSON_PATH.name} holds runs with --batches {previous}")
    todo = nc.runs_to_do(runs, args.seeds, args.tasks, args.norms)  # seed-major, as there
    if not args.report_only and todo:
        started = time.perf_counter()
        for index, key in enumerate(todo, 1):
            record = run_one(*key, batches=args.batches)
            runs.append(record)
            save_runs(runs, args.batches)
            if record["status"] == "ok":
                score = (
                    f"{100 * record['test_before']:.1f} -> {100 * record['test_after']:.1f}%, "
                    f"TID {record['tid_before']:.3f} -> {record['tid_after']:.3f}"
                )
            else:
                score = "FAIL"
            seconds = record["train_seconds"] + record.get("recalibrate_seconds", 0)
            print(f"[{index}/{len(todo)}] {key[0]:17s} {key[1]:12s} seed {key[2]}: {score} "
                  f"({seconds:.0f}s)", flush=True)  # fmt: skip
        print(f"wall time {time.perf_counter() - started:.0f}s for {len(todo)} runs")
    print(write_markdown(runs, args.batches))
    plot(runs)


if __name__ == "__main__":
    main()
