"""A latency figure timed on a busy host, timed again once the conversion's builds are done.

Why: targets built at once (``edge-un convert --parallel``, Celery workers on one machine) time
their files while the other builds quantize and measure, and a Transformer at batch 1 is then
much slower than it is: BERT-base's int8 file in ONNX Runtime, 108 ms at 2 threads on a quiet
2-core host, 312 ms beside one other build and 384 ms beside two
(benchmarks/results/latency_contention.md). Each timing says how busy the host was
(``Latency.others_busy_cores``); when the report is assembled the builds have ended, so a
figure timed on a busy host (``Latency.contended``) is timed again, the same way, and the
report keeps whichever of the two had the quieter host (``retimed`` says it was timed again).

Within the time left: each timing is estimated from the first (its runs, at most the timing
budget, plus the warm-up, at the figure's own p50, which a busy host only made slower) and one
that would end past the builds' deadline is not run, so the report's own share of the job's
time stays its own. A file that cannot be timed again keeps its first figure (it has its
note). The same file (by its sha256) at the same thread count is timed once: imx93's and
imx8mp's int8 TFLite files are one file in two directories.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .measure.latency import TIME_BUDGET_S, WARMUP, Timing, onnx_latency
from .report import schema
from .report.records import latency_record
from .samples import Feeds

log = logging.getLogger(__name__)

# Loading the file (a session, an interpreter with XNNPACK) before its runs, with a margin:
# BERT-base's int8 ONNX session took 0.4 s here (measured once, beside other work).
LOAD_S = 3.0

Key = tuple[str, str, int]  # the file's sha256, runtime, threads


def estimated_s(timing: schema.Latency) -> float:
    """How long timing ``timing``'s file again takes at most, read from its first timing."""
    run_s = timing.p50_ms / 1e3
    return LOAD_S + WARMUP * run_s + min(timing.runs * run_s, TIME_BUDGET_S + run_s)


def time_again(path: Path, timing: schema.Latency, sample: Feeds, runs: int) -> Timing:
    """``path`` timed as its first figure was: same runtime, threads and runs."""
    if timing.runtime == "litert":
        from .tflite.litert import latency_tflite  # LiteRT only where a TFLite file needs it

        return latency_tflite(path, sample, timing.threads, runs=runs)
    return onnx_latency(path, sample, timing.threads, runs)


def retime_contended(
    reports: Mapping[str, schema.TargetReport],
    out_dir: Path,
    sample: Callable[[], Feeds],
    runs: int,
    deadline: float | None = None,
) -> dict[str, schema.TargetReport]:
    """``reports`` with each contended latency figure timed again, where the time until
    ``deadline`` (``time.time()``; None: no limit) allows; ``sample()`` gives the batch-1 input
    (read only if a figure is timed again), ``runs`` the report's timed runs."""
    again: dict[Key, schema.Latency] = {}
    result = {}
    for name, target in reports.items():
        digests = {artifact.name: artifact.sha256 for artifact in target.artifacts}
        latency = []
        for timing in target.latency:
            if timing.contended():
                # by content: imx8mp's file is a copy of imx93's, timed once for both
                content = digests.get(timing.artifact, timing.artifact)
                key = (content, timing.runtime, timing.threads)
                if key not in again:
                    again[key] = _quieter(timing, out_dir, sample, runs, deadline)
                timing = again[key].model_copy(update={"artifact": timing.artifact})
            latency.append(timing)
        result[name] = target.model_copy(update={"latency": latency})
    return result


def _quieter(
    first: schema.Latency,
    out_dir: Path,
    sample: Callable[[], Feeds],
    runs: int,
    deadline: float | None,
) -> schema.Latency:
    """``first``, or its file timed again if that ran on a quieter host."""
    if deadline is not None and time.time() + estimated_s(first) > deadline:
        return first
    try:
        timing = time_again(out_dir / first.artifact, first, sample(), runs)
    except Exception as error:  # any: the first figure stands, with its note
        log.warning("timing %s again failed: %s", first.artifact, error)
        return first
    second = latency_record(timing, first.runtime, first.artifact, first.xnnpack_ops)
    busy = first.others_busy_cores or 0.0
    if second.others_busy_cores is not None and second.others_busy_cores < busy:
        return second.model_copy(update={"retimed": True})
    return first
