"""Latency on this machine: warm-up, then timed single runs; p50/p90/p99 in milliseconds.

These are the numbers a report quotes for the CPU runtimes (ONNX Runtime, LiteRT with XNNPACK).
Timing is of one batch-1 inference at a time, the edge case; throughput is the benchmarks' job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..samples import as_feeds, feed_for
from .host_load import HostLoad

WARMUP = 10
RUNS = 100
# A large model's timed runs stop after this many seconds, once MIN_RUNS have run: BERT-base's
# 100 runs at two thread counts for the int8 and the fp32 file were 29 s of its cpu target, and
# a median of 20+ runs moves by well under its own run-to-run spread (the report says how many ran).
TIME_BUDGET_S = 3.0
MIN_RUNS = 20


@dataclass(frozen=True)
class Timing:
    threads: int
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    # how many of this process's cores other work kept busy while the runs were timed (other
    # targets building at once): the figures are this process's, slowed by that much contention
    others_busy_cores: float | None = None


def time_calls(
    call: Callable[[], object],
    threads: int,
    runs: int = RUNS,
    warmup: int = WARMUP,
    budget_s: float | None = TIME_BUDGET_S,
) -> Timing:
    """Run ``call`` ``warmup`` times untimed, then up to ``runs`` times timed one by one,
    stopping early once ``budget_s`` seconds of timed calls have passed and ``MIN_RUNS`` (or
    ``runs``, if fewer) have run; None times all ``runs``. Says how busy other work kept the
    host meanwhile (``quant.measure.host_load``)."""
    for _ in range(warmup):
        call()
    least = min(MIN_RUNS, runs)
    samples: list[float] = []
    load = HostLoad()
    began = time.perf_counter()
    while len(samples) < runs:
        start = time.perf_counter()
        call()
        end = time.perf_counter()
        samples.append(end - start)
        if budget_s is not None and len(samples) >= least and end - began >= budget_s:
            break
    others = load.others_busy_cores()
    p50, p90, p99 = np.percentile(np.array(samples) * 1e3, [50, 90, 99])
    return Timing(threads, len(samples), float(p50), float(p90), float(p99), others)


def thread_counts() -> tuple[int, ...]:
    """One thread (the edge-board-like figure) and every core this process may use."""
    cores = len(os.sched_getaffinity(0))
    return (1,) if cores == 1 else (1, cores)


def onnx_latency(
    path: Path, sample: np.ndarray | Mapping[str, np.ndarray], threads: int, runs: int = RUNS
) -> Timing:
    """Batch-1 latency of an ONNX model in ONNX Runtime's CPU provider, on the first row of
    ``sample`` (one array per input, by name; a bare array for a single-input model)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    feed = {name: array[:1] for name, array in feed_for(names, as_feeds(sample)).items()}
    return time_calls(lambda: session.run(None, feed), threads, runs)
