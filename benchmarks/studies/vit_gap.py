"""Why does UN trail LayerNorm on ViT/MNIST? One training configuration per hypothesis.

Same task and recipe as the norm comparison's ``vit-mnist`` row (the ViT "bench" preset: 4
pre-norm blocks, dim 48, patch 7, MNIST-5k, 12 epochs, AdamW lr 2e-3, UN warm-up 8 % of the run),
3 seeds each; exactly one thing changes per configuration:

  (a) window size M: 2 and 8 (default 4); "M = 1" is not a valid UnifiedNorm argument, but it is
      exactly UN with a warm-up longer than the run (forward: this batch's x^2; backward: the
      momentum average of mean(dz * z); the filter cannot fire), which is what runs;
  (b) warm-up: 0 (the window is used from step M + 1) and 25 % of the run (default 8 %);
  (c) momentum (running_var and the gradient statistic's average): 0.99 and 0.5 (default 0.9),
      and, added after 0.5 had closed the gap, 0, and 0.5 and 0 with lr 4e-3 (against LN at
      4e-3);
  (d) outlier filter off;
  (e) learning rate 1e-3 and 4e-3 (default 2e-3), for UN and, as the control, for LN;
  (f) the uncentred-mean hypothesis, twice: a centred UN (this batch's mean subtracted and
      back-propagated exactly, as in BN; the variance of the centred input through UN's window,
      geometric mean, filter and smoothed gradient statistic; defined here, not in edge_un), and
      inputs with the per-pixel training mean removed (MNIST's constant background becomes 0),
      for UN and for LN.

Each run also records two diagnostics of the trained model: per norm layer, the share of the
per-channel quadratic mean E[x^2] that is the squared mean (E[x])^2 (over 1000 training
images), and for offline norms the test accuracy after recalibrating every frozen statistic to
its exact training-set value (layer by layer, shallow to deep): if that differs from the plain
test accuracy, the frozen inference statistics, not the training, cost accuracy.

Then the change that closed the gap is run on the norm comparison's two text tasks (3 seeds
each, same bench preset), to see whether it holds beyond vision (``--no-text`` skips this).

Writes benchmarks/results/vit_gap.json (every run), vit_gap.md (table and one verdict line per
hypothesis; hand-written text after the ``<!-- notes -->`` line is kept) and vit_gap.png.
Resumable: configurations already in the JSON are skipped. Usage:
    python -m benchmarks.studies.vit_gap [--seeds 0 1 2] [--only NAME ...] [--no-text] \\
        [--report-only]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common.results import RESULTS
from edge_un.norms import UnifiedNorm

JSON_PATH = RESULTS / "vit_gap.json"
MD_PATH = RESULTS / "vit_gap.md"
PNG_PATH = RESULTS / "vit_gap.png"
COMPARISON_JSON = RESULTS / "norm_comparison.json"
NOTES_MARK = "<!-- notes -->"
TOTAL_STEPS = 1320  # the bench preset on MNIST-5k: 12 epochs x 110 steps


class CentredUnifiedNorm(UnifiedNorm):
    """UN with the batch mean subtracted (and its gradient removed exactly, as BatchNorm does);
    the variance of the centred input goes through UN's window, geometric mean, outlier filter
    and smoothed gradient statistic unchanged. Inference: frozen ``running_mean`` and
    ``running_var``, still a per-channel affine."""

    centered = True

    def forward_statistics(
        self, batch_mean: Tensor | None, batch_var: Tensor, count: Tensor
    ) -> tuple[Tensor | None, Tensor, Any]:
        assert batch_mean is not None
        _, var_hat, step = super().forward_statistics(None, batch_var, count)
        self._update_running(self.running_mean, batch_mean)
        return batch_mean, var_hat, step

    def backward_statistics(
        self, grad_mean: Tensor | None, grad_var: Tensor, step: Any
    ) -> tuple[Tensor | None, Tensor]:
        _, psi = super().backward_statistics(None, grad_var, step)
        return grad_mean, psi


@dataclasses.dataclass(frozen=True)
class Config:
    hypothesis: str  # "baseline", "a".."f"
    label: str
    norm: str = "un"  # "un", "ln" or "un-centred"
    norm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    lr: float | None = None  # None: the preset's 2e-3
    inputs: str = "standardised"  # or "pixel-mean removed"
    pair: str = "ln"  # the LN configuration this one is compared with
    base: str = "un"  # the UN configuration this one changes (paired differences, gap before)
    # The same run as this norm_comparison.py row (same preset, code and machine, so the same
    # numbers): taken from norm_comparison.json when it is there, without the diagnostics.
    reuse: str | None = None


# In priority order (expected information per core-minute): a cut budget drops the last ones.
CONFIGS: dict[str, Config] = {
    "ln": Config("baseline", "LN (the committed recipe)", norm="ln", pair="ln"),
    "un": Config("baseline", "UN (the committed recipe)"),
    "un-centred": Config("f", "UN, centred (batch mean subtracted)", norm="un-centred"),
    "un-momentum0.5": Config("c", "UN, momentum 0.5", norm_kwargs={"momentum": 0.5}),
    "un-pixelmean": Config(
        "f", "UN, per-pixel mean removed from the inputs", inputs="pixel-mean removed",
        pair="ln-pixelmean",
    ),
    "un-window1": Config(
        "a", "UN, window 1 (= warm-up longer than the run: batch x^2 every step)",
        norm_kwargs={"warmup_iters": TOTAL_STEPS + 1},
    ),
    "un-momentum0.99": Config("c", "UN, momentum 0.99", norm_kwargs={"momentum": 0.99}),
    "un-lr4e-3": Config("e", "UN, lr 4e-3", lr=4e-3, pair="ln-lr4e-3"),
    "un-lr1e-3": Config("e", "UN, lr 1e-3", lr=1e-3, pair="ln-lr1e-3"),
    "un-window2": Config("a", "UN, window 2", norm_kwargs={"window_size": 2}),
    "un-window8": Config("a", "UN, window 8", norm_kwargs={"window_size": 8}),
    "un-warmup0": Config("b", "UN, warm-up 0 (window from step M + 1)",
                         norm_kwargs={"warmup_iters": 0}),
    "un-warmup25": Config("b", "UN, warm-up 25 % of the run (330 steps)",
                          norm_kwargs={"warmup_iters": 330}),
    "un-nofilter": Config("d", "UN, outlier filter off",
                          norm_kwargs={"outlier_filtration": False}, reuse="un-nofilter"),
    "ln-pixelmean": Config(
        "f", "LN, per-pixel mean removed from the inputs (control)", norm="ln",
        inputs="pixel-mean removed", pair="ln-pixelmean",
    ),
    "ln-lr4e-3": Config("e", "LN, lr 4e-3 (control)", norm="ln", lr=4e-3, pair="ln-lr4e-3"),
    "ln-lr1e-3": Config("e", "LN, lr 1e-3 (control)", norm="ln", lr=1e-3, pair="ln-lr1e-3"),
    # Follow-up once momentum 0.5 had closed the gap: is less averaging still better?
    "un-momentum0": Config("c", "UN, momentum 0 (psi = window mean of g)",
                           norm_kwargs={"momentum": 0.0}),
    # ... and does it let UN use the higher learning rate that helps LN (lr 4e-3)?
    "un-momentum0.5-lr4e-3": Config("c", "UN, momentum 0.5 and lr 4e-3",
                                    norm_kwargs={"momentum": 0.5}, lr=4e-3, pair="ln-lr4e-3",
                                    base="un-lr4e-3"),
    "un-momentum0-lr4e-3": Config("c", "UN, momentum 0 and lr 4e-3",
                                  norm_kwargs={"momentum": 0.0}, lr=4e-3, pair="ln-lr4e-3",
                                  base="un-lr4e-3"),
}  # fmt: skip
# The change that closed the ViT gap, checked on the comparison's two text tasks (norm_comparison
# rows, same bench preset), so that a default change would not be made on vision alone.
TEXT_CHECK: dict[str, tuple[str, dict[str, Any]]] = {"un-momentum0.5": ("un", {"momentum": 0.5})}
TEXT_TASKS = ("text-rt-prenorm", "text-rt-postnorm")
HYPOTHESES = {
    "a": "window size",
    "b": "warm-up length",
    "c": "momentum",
    "d": "outlier filter",
    "e": "learning rate",
    "f": "uncentred mean",
}


# -- one run ---------------------------------------------------------------------------------


@contextlib.contextmanager
def norm_class(kind: str) -> Iterator[str]:
    """The kind to hand to fit(); "un-centred" builds CentredUnifiedNorm wherever "un" would."""
    if kind != "un-centred":
        yield kind
        return
    from edge_un.norms import factory

    saved = factory.NORM_CLASSES["un"]
    factory.NORM_CLASSES["un"] = CentredUnifiedNorm
    try:
        yield "un"
    finally:
        factory.NORM_CLASSES["un"] = saved


def pixel_mean_removed(dataset: Any) -> Any:
    """Every part minus the training part's per-pixel mean (in standardised units)."""
    mean = dataset.inputs["train"].mean(dim=0, keepdim=True)
    inputs = {part: x - mean for part, x in dataset.inputs.items()}
    return dataclasses.replace(dataset, inputs=inputs)


def norm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from edge_un.norms import OfflineNorm
    from edge_un.norms.layer import LayerNorm

    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, OfflineNorm | LayerNorm)
    ]


@torch.no_grad()
def mean_share(model: nn.Module, images: Tensor) -> dict[str, float]:
    """Per norm layer: mean over channels of (E[x_c])^2 / E[x_c^2] of the layer's input."""
    sums: dict[str, list[Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, args, name=name: sums.setdefault(name, []).append(args[0].detach())
        )
        for name, m in norm_layers(model)
    ]
    model.eval()
    try:
        model(images)
    finally:
        for hook in hooks:
            hook.remove()
    share = {}
    for name, (x,) in sums.items():
        flat = x.reshape(-1, x.shape[-1]).double()
        share[name] = float((flat.mean(0) ** 2 / (flat * flat).mean(0)).mean())
    return share


@torch.no_grad()
def recalibrated_accuracy(model: nn.Module, train_x: Tensor, test: tuple[Tensor, Tensor]) -> float:
    """Test accuracy after setting every offline norm's frozen statistics to their exact value
    over the training set, shallow to deep (each layer sees the recalibrated ones before it)."""
    from edge_un.norms import OfflineNorm
    from edge_un.training.evaluation import EVAL_BATCH, accuracy

    model = copy.deepcopy(model).eval()
    for _, norm in norm_layers(model):
        if not isinstance(norm, OfflineNorm):
            continue
        total = torch.zeros(3, norm.num_features, dtype=torch.float64)

        def collect(_m: nn.Module, args: tuple[Tensor, ...], total: Tensor = total) -> None:
            flat = args[0].reshape(-1, args[0].shape[-1]).double()
            total[0] += flat.sum(0)
            total[1] += (flat * flat).sum(0)
            total[2] += flat.shape[0]

        hook = norm.register_forward_pre_hook(collect)
        for start in range(0, len(train_x), EVAL_BATCH):
            model(train_x[start : start + EVAL_BATCH])
        hook.remove()
        mean, square = total[0] / total[2], total[1] / total[2]
        if norm.centered:
            norm.running_mean.copy_(mean)
            norm.running_var.copy_(square - mean * mean)
        else:
            norm.running_var.copy_(square)
    return accuracy(model, *test)


def run_one(name: str, seed: int, dataset: Any) -> dict[str, Any]:
    from edge_un.training import TrainingDivergedError, fit

    config = CONFIGS[name]
    if config.inputs == "pixel-mean removed":
        dataset = pixel_mean_removed(dataset)
    record: dict[str, Any] = {"config": name, "seed": seed}
    start = time.perf_counter()
    try:
        with norm_class(config.norm) as kind:
            result = fit(
                "vit", "bench", kind, "mnist", seed=seed, lr=config.lr,
                norm_kwargs=config.norm_kwargs, dataset=dataset, progress=False, log=None,
            )  # fmt: skip
    except TrainingDivergedError as error:
        record.update(status="FAIL", error=str(error))
    else:
        train_x = dataset.part("train")[0]
        record.update(
            status="ok",
            test_accuracy=result.test_accuracy,
            val_accuracy=result.val_accuracy,
            num_filtered=result.num_filtered,
            history=result.metadata["history"],
            recipe=result.metadata["recipe"],
            mean_share=mean_share(result.model, train_x[:1000]),
        )
        if config.norm != "ln":
            record["recalibrated_test_accuracy"] = recalibrated_accuracy(
                result.model, train_x, dataset.part("test")
            )
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


# -- bookkeeping -----------------------------------------------------------------------------


def load_runs(key: str = "runs") -> list[dict[str, Any]]:
    if not JSON_PATH.is_file():
        return []
    return json.loads(JSON_PATH.read_text()).get(key, [])


def save_runs(runs: list[dict[str, Any]], text_runs: list[dict[str, Any]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "description": "ViT/MNIST bench preset, one change per configuration; see vit_gap.py",
        "configs": {name: dataclasses.asdict(c) for name, c in CONFIGS.items()},
        "runs": sorted(runs, key=lambda r: (list(CONFIGS).index(r["config"]), r["seed"])),
        "text_check": {name: {"kind": k, "kwargs": kw} for name, (k, kw) in TEXT_CHECK.items()},
        "text_runs": sorted(text_runs, key=lambda r: (r["task"], r["norm"], r["seed"])),
    }
    tmp = JSON_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(JSON_PATH)


def reused_runs(names: list[str], seeds: list[int], done: set) -> list[dict[str, Any]]:
    """Runs of configurations that norm_comparison.py already trained (see Config.reuse)."""
    if not COMPARISON_JSON.is_file():
        return []
    comparison = json.loads(COMPARISON_JSON.read_text())["runs"]
    reused = []
    for name in names:
        row = CONFIGS[name].reuse
        for seed in seeds:
            if row is None or (name, seed) in done:
                continue
            for r in comparison:
                if (r["task"], r["norm"], r["seed"]) == ("vit-mnist", row, seed):
                    keep = {k: v for k, v in r.items() if k not in ("task", "norm")}
                    reused.append({"config": name, **keep, "source": "norm_comparison.json"})
    return reused


# -- report ----------------------------------------------------------------------------------


def accuracies(runs: list[dict[str, Any]], name: str, key: str = "test_accuracy") -> list[float]:
    chosen = sorted((r for r in runs if r["config"] == name), key=lambda r: r["seed"])
    return [
        100 * r[key] if r["status"] == "ok" else float("nan")
        for r in chosen
        if r["status"] != "ok" or key in r
    ]


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1f} ± {std:.1f}"


def verdict(runs: list[dict[str, Any]], name: str) -> str:
    """Closed / partly / not, from the share of the LN-UN gap that the configuration recovers:
    the gap of the UN configuration it changes (``base``, against that one's LN pair) before, its
    own gap against its LN pair after."""
    config = CONFIGS[name]
    mine, base = accuracies(runs, name), accuracies(runs, config.base)
    pair = accuracies(runs, config.pair)
    ln = accuracies(runs, CONFIGS[config.base].pair)
    committed = accuracies(runs, "un")
    if not mine:
        return "not run (budget)"
    if not (base and pair and ln and committed):
        named = ((config.base, base), (config.pair, pair), (CONFIGS[config.base].pair, ln))
        missing = [n for n, v in (*named, ("un", committed)) if not v]
        return f"{mean_std(mine)}; no verdict: {', '.join(missing)} not run"
    m, b, p, n = (statistics.mean(v) for v in (mine, base, pair, ln))
    gap_before, gap_after = n - b, p - m
    closed = (gap_before - gap_after) / gap_before if gap_before > 0 else float("nan")
    paired = [x - y for x, y in zip(mine, base, strict=False)]
    spread = statistics.stdev(paired) if len(paired) > 1 else 0.0
    if closed >= 0.75:
        word = "**closed** the gap"
    elif closed >= 0.25:
        word = "**partly** closed the gap"
    elif closed > -0.25:
        word = "did **not** close the gap"
    else:
        word = "**widened** the gap"
    pair_text = "" if config.pair == "ln" else f" (its LN control {config.pair}: {p:.1f})"
    signs = {d > 0 for d in paired if d != 0}
    agree = "every seed moves the same way" if len(signs) == 1 else "the seeds disagree"
    caveat = ""
    if m < statistics.mean(committed) - 1.0:
        caveat = "; not a fix: below UN with the committed recipe"
    base_text = "UN" if config.base == "un" else config.base
    return (
        f"{word}: {m:.1f} vs {base_text} {b:.1f} "
        f"(per seed {', '.join(f'{d:+.1f}' for d in paired)}; "
        f"paired {statistics.mean(paired):+.1f} ± {spread:.1f}, {agree}); gap to LN "
        f"{gap_after:.1f} points{pair_text} vs {gap_before:.1f} ({100 * closed:.0f} % closed)"
        f"{caveat}"
    )


def text_section(text_runs: list[dict[str, Any]]) -> list[str]:
    """The text check next to the norm comparison's ln and un rows (same preset and code)."""
    if not text_runs:
        return []
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ("ln", "un", *TEXT_CHECK)}
    if COMPARISON_JSON.is_file():
        for r in json.loads(COMPARISON_JSON.read_text())["runs"]:
            if r["task"] in TEXT_TASKS and r["norm"] in ("ln", "un"):
                rows[r["norm"]].append(r)
    for r in text_runs:
        rows[r["norm"]].append(r)
    lines = [
        "",
        "## Does the change transfer to text?",
        "",
        "The change that closed the ViT gap, on the norm comparison's two text tasks (same bench "
        "preset); ln and un from `norm_comparison.json` (a dagger: carried over from an older "
        "run there). Test accuracy (%), per seed and mean ± std:",
        "",
        "| norm | " + " | ".join(TEXT_TASKS) + " |",
        "|---|" + "---|" * len(TEXT_TASKS),
    ]
    for name, chosen in rows.items():
        cells = []
        for task in TEXT_TASKS:
            mine = sorted((r for r in chosen if r["task"] == task), key=lambda r: r["seed"])
            acc = [100 * r["test_accuracy"] for r in mine if r["status"] == "ok"]
            fails = len(mine) - len(acc)
            mark = " †" if any(r.get("carried_over") for r in mine) else ""
            text = ", ".join(f"{a:.1f}" for a in acc) + (f", {fails} FAIL" if fails else "")
            cells.append(f"{text} ({mean_std(acc)}){mark}" if mine else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(runs: list[dict[str, Any]], text_runs: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in runs})
    total_seconds = sum(r["seconds"] for r in runs)
    reused = sum(1 for r in runs if r.get("source") == "norm_comparison.json")
    lines = [
        "# The ViT gap: UN vs LayerNorm on ViT/MNIST (`benchmarks/studies/vit_gap.py`)",
        "",
        "Task and recipe of the norm comparison's `vit-mnist` row (ViT bench preset: 4 pre-norm "
        "blocks, dim 48, patch 7, MNIST-5k, 12 epochs = 1320 steps, AdamW lr 2e-3, UN warm-up "
        "8 % = 106 steps); one change per configuration, seeds "
        f"{seeds}, 1 CPU thread. {len(runs)} runs ({reused} of them taken from "
        f"`norm_comparison.json`), {total_seconds / 60:.0f} min of training in all. Test "
        "accuracy in % (1000 test images; one image is 0.1 point).",
        "",
        "| hyp. | configuration | test accuracy per seed | mean ± std | recalibrated stats "
        "| mean share, first / last norm |",
        "|---|---|---|---|---|---|",
    ]
    for name, config in CONFIGS.items():
        chosen = [r for r in runs if r["config"] == name]
        if not chosen:
            lines.append(f"| {config.hypothesis} | {config.label} | not run (budget) | | | |")
            continue
        acc = accuracies(runs, name)
        recal = mean_std(accuracies(runs, name, "recalibrated_test_accuracy"))
        ok = [r for r in chosen if r["status"] == "ok" and "mean_share" in r]
        share = "-"
        if ok:
            names = list(ok[0]["mean_share"])
            first = statistics.mean(r["mean_share"][names[0]] for r in ok)
            last = statistics.mean(r["mean_share"][names[-1]] for r in ok)
            share = f"{first:.2f} / {last:.2f}"
        per_seed = ", ".join("FAIL" if a != a else f"{a:.1f}" for a in acc)
        lines.append(
            f"| {config.hypothesis} | {config.label} | {per_seed} | {mean_std(acc)} | {recal} "
            f"| {share} |"
        )
    lines += [
        "",
        "*Recalibrated stats*: test accuracy after setting every frozen statistic to its exact "
        "training-set value. *Mean share*: over channels, (E[x])^2 / E[x^2] of the norm's input "
        "(0: centred, 1: a constant), for the first norm (blocks.0.norm1) and the final one.",
        "",
        "## Verdicts, one per hypothesis",
        "",
        "Gap = LN mean minus the UN configuration's mean (for (e) and the input change in (f): "
        "minus its LN control trained the same way); baseline gap = LN minus UN with the "
        "committed recipe (for the two lr 4e-3 momentum runs: LN minus UN, both at lr 4e-3). "
        "Per-seed differences are paired with the same seed of that baseline UN. *Closed*: at "
        "least 75 % of the baseline gap recovered; *partly*: "
        "25-75 %; *not*: less. With 3 seeds and a seed spread of about 1 point, differences "
        "under about 1 point are within noise.",
        "",
    ]
    for name, config in CONFIGS.items():
        if config.hypothesis == "baseline" or config.norm == "ln":
            continue
        lines.append(
            f"- ({config.hypothesis}, {HYPOTHESES[config.hypothesis]}) {config.label}: "
            f"{verdict(runs, name)}"
        )
    lines += text_section(text_runs)
    text = "\n".join(lines) + "\n"
    notes = ""
    if MD_PATH.is_file() and NOTES_MARK in MD_PATH.read_text():
        notes = MD_PATH.read_text().split(NOTES_MARK, 1)[1]
    MD_PATH.write_text(text + "\n" + NOTES_MARK + notes)
    return text


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["baseline", *HYPOTHESES]  # grouped by hypothesis, priority order within a group
    names = sorted(
        (n for n in CONFIGS if any(r["config"] == n for r in runs)),
        key=lambda n: order.index(CONFIGS[n].hypothesis),
    )
    colors = {"baseline": "black", "a": "tab:blue", "b": "tab:orange", "c": "tab:green",
              "d": "tab:red", "e": "tab:purple", "f": "tab:brown"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(12, 4.8))
    for i, name in enumerate(names):
        config = CONFIGS[name]
        acc = [a for a in accuracies(runs, name) if a == a]
        color = colors[config.hypothesis]
        marker = "s" if config.norm == "ln" else "o"
        ax.scatter([i] * len(acc), acc, color=color, marker=marker, alpha=0.6, s=22)
        if acc:
            mean = statistics.mean(acc)
            ax.plot([i - 0.3, i + 0.3], [mean, mean], color=color, lw=2)
            ax.vlines(i, min(acc), max(acc), color=color, lw=1)
    for name, style in (("ln", "--"), ("un", ":")):
        acc = accuracies(runs, name)
        if acc:
            ax.axhline(statistics.mean(acc), color="gray", ls=style, lw=1,
                       label=f"{name} (committed recipe) mean")  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        "ViT/MNIST bench preset: test accuracy per configuration "
        "(dots: seeds, bar: mean, line: seed range; squares: LN)",
        fontsize=9,
    )
    names_of = {"baseline": "baseline", **{h: f"{h}: {text}" for h, text in HYPOTHESES.items()}}
    handles = [
        plt.Line2D([], [], color=c, marker="o", ls="", label=names_of[h]) for h, c in colors.items()
    ]
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7, loc="lower left",
              ncol=3)  # fmt: skip
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(PNG_PATH, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--report-only", action="store_true", help="only rewrite report and plot")
    parser.add_argument("--no-text", action="store_true", help="skip the text-task check")
    args = parser.parse_args()

    torch.set_num_threads(1)  # deterministic for a seed on one machine and thread count
    runs = load_runs()
    done = {(r["config"], r["seed"]) for r in runs}
    text_runs = load_runs("text_runs")
    reused = reused_runs(args.only, args.seeds, done)
    if reused:
        runs += reused
        save_runs(runs, text_runs)
    done = {(r["config"], r["seed"]) for r in runs}
    todo = [(n, s) for n in args.only for s in args.seeds if (n, s) not in done]
    if not args.report_only and todo:
        from edge_un.data import load_dataset

        dataset = load_dataset("mnist")
        started = time.perf_counter()
        for name, seed in todo:
            record = run_one(name, seed, dataset)
            runs.append(record)
            save_runs(runs, text_runs)
            score = f"{100 * record['test_accuracy']:.1f}%" if record["status"] == "ok" else "FAIL"
            print(f"{name:16s} seed {seed}: {score} ({record['seconds']}s)", flush=True)
        print(f"wall time {time.perf_counter() - started:.0f}s for {len(todo)} runs")
    text_done = {(r["task"], r["norm"], r["seed"]) for r in text_runs}
    text_todo = [
        (t, n, s)
        for n in TEXT_CHECK
        for s in args.seeds
        for t in TEXT_TASKS
        if (t, n, s) not in text_done
    ]
    if not (args.report_only or args.no_text) and text_todo:
        from benchmarks.training import norm_comparison

        norm_comparison.NORMS.update(TEXT_CHECK)
        for task, name, seed in text_todo:
            record = norm_comparison.run_one(task, name, seed)
            text_runs.append(record)
            save_runs(runs, text_runs)
            score = f"{100 * record['test_accuracy']:.1f}%" if record["status"] == "ok" else "FAIL"
            print(f"{task} {name} seed {seed}: {score} ({record['seconds']}s)", flush=True)
    print(write_markdown(runs, text_runs))
    plot(runs)


if __name__ == "__main__":
    main()
