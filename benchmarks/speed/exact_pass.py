"""How fast the exact drift pass runs a batch-1 file: one call at a time on every thread, or as
many calls at once as there are threads, one thread each (``quant.measure.drift.exact_workers``).

    .venv/bin/python -m benchmarks.speed.exact_pass  # ~2 min on 2 cores; ~15 more with BERT-base

The exact pass (the QDQ graph as written, ONNX Runtime's optimizations off) is what the
search measures every recipe and fallback step with; tda4vm's files have a fixed batch of 1,
so the pass makes one call a sample. Each model is converted for tda4vm by the pipeline, and
its file run over the first ``SAMPLES`` samples of its held-out split both ways, alternately,
``REPEATS`` times; both ways must give the same logits bit for bit. The bundled examples
always; BERT-base (``benchmarks.speed.hf_scale_trained``'s migrated twin) when
``EDGE_UN_BENCH_TEACHERS`` holds it (its tda4vm file is kept there and reused).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import edge_un
import quant
from benchmarks.common.results import benchmark_main, git_commit, save_figure
from benchmarks.training.hf_migrate import TEACHERS
from edge_un import examples
from quant.host import describe_host
from quant.measure.drift import onnx_runner
from quant.measure.exact import exact_session, with_constants_computed
from quant.measure.host_load import cores_left
from quant.ort.target import onnx_inputs
from quant.samples import Feeds, InputSpec, Samples, checkpoint_samples

NAME = "exact_pass"
SAMPLES = 600
REPEATS = 3
# in EDGE_UN_BENCH_TEACHERS, as hf_scale_trained leaves it: the migrated twin the committed
# figure was measured on (the directory it converts since b8c5db1 is the int8-ready -un8-0)
TRAINED = "bert-base-un-0"


def tda4vm_file(model: Path, out: Path) -> Path:
    """The pipeline's tda4vm file of ``model`` (made into ``out`` once)."""
    artifact = out / "tda4vm" / "model_int8.onnx"
    if not artifact.exists():
        print(f"converting {model.name} for tda4vm ...", flush=True)
        quant.convert(model, targets="tda4vm", out_dir=out)
    return artifact


def held_out_samples(model: Path, artifact: Path) -> Samples:
    _, info = edge_un.load_pretrained(model) if model.is_dir() else edge_un.load_checkpoint(model)
    specs = [InputSpec(i.name, tuple(i.shape), i.dtype) for i in onnx_inputs(artifact)]
    return checkpoint_samples(info, "test", specs=specs).head(SAMPLES)


def one_call_at_a_time(artifact: Path, threads: int) -> Callable[[Feeds], np.ndarray]:
    """The pass before ``exact_workers``: every call on all ``threads``."""
    session = exact_session(
        with_constants_computed(onnx.load(str(artifact))).SerializeToString(), threads=threads
    )
    return lambda feeds: np.concatenate(
        [session.run(None, one)[0] for one in Samples(feeds, None, "").batches(1)]
    )


def measure(name: str, model: Path, out: Path, threads: int) -> dict[str, Any]:
    artifact = tda4vm_file(model, out)
    samples = held_out_samples(model, artifact)
    ways = {
        "one call at a time": one_call_at_a_time(artifact, threads),
        "calls side by side": onnx_runner(artifact, threads, exact=True),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    logits: dict[str, np.ndarray] = {}
    for repeat in range(REPEATS):
        for way, run in ways.items():
            started = time.perf_counter()
            logits[way] = run(samples.feeds)
            seconds[way].append(time.perf_counter() - started)
        print(f"{name} {repeat + 1}/{REPEATS}: " + ", ".join(
            f"{way} {s[-1]:.1f} s" for way, s in seconds.items()), flush=True)  # fmt: skip
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    before, after = medians.values()
    return {
        "samples": len(samples),
        "file_mb": artifact.stat().st_size / 2**20,
        "seconds": seconds,
        "ms_per_sample": {way: 1000 * median / len(samples) for way, median in medians.items()},
        "speedup": before / after,
        "same_logits": bool(np.array_equal(*logits.values())),
    }


def run() -> dict[str, Any]:
    threads = cores_left()
    models = {name: examples.path(name) for name in ("hf-bert-rt-un", "hf-vit-mnist-un")}
    if TEACHERS is not None and (TEACHERS / TRAINED).is_dir():
        models["bert-base-rt (trained)"] = TEACHERS / TRAINED
    results: dict[str, Any] = {"host": describe_host().model_dump(), "threads": threads,
                               "commit": git_commit(), "models": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        for name, model in models.items():
            kept = model.parent / f"{model.name}-tda4vm" if name.endswith("(trained)") else None
            out = kept or Path(work) / name
            results["models"][name] = measure(name, model, out, threads)
    return results


def markdown(results: dict[str, Any]) -> str:
    host = results["host"]
    lines = [
        "# The exact drift pass of a batch-1 file (tda4vm's): calls one at a time or side by side",
        "",
        f"Commit {results['commit']}; {host['cpu']}, {results['threads']} threads; medians of "
        f"{REPEATS} alternating runs over each model's held-out samples. "
        "`python -m benchmarks.speed.exact_pass`.",
        "",
        "| model | samples | one call at a time, ms/sample | calls side by side (1 thread "
        "each), ms/sample | speed-up | same logits |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["models"].items():
        before, after = row["ms_per_sample"].values()
        same = "yes" if row["same_logits"] else "NO"
        lines.append(
            f"| {name} | {row['samples']} | {before:.1f} | {after:.1f} | {row['speedup']:.2f}x "
            f"| {same} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    names = list(results["models"])
    figure, axis = plt.subplots(figsize=(7, 3))
    for offset, way in ((-0.2, "one call at a time"), (0.2, "calls side by side")):
        values = [results["models"][n]["ms_per_sample"][way] for n in names]
        axis.barh([i + offset for i in range(len(names))], values, height=0.4, label=way)
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("exact pass, ms per sample (median)")
    axis.legend()
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
