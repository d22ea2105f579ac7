"""quant.measure.latency.time_calls: a large model's timed runs stop at the time budget, never
before MIN_RUNS; a small model's run all of them; each timing says how busy other work kept the
host's cores meanwhile (``quant.measure.host_load``), with real processes spinning beside it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from quant.measure import ort_options
from quant.measure.host_load import MIN_WINDOW_S, CoresLeft
from quant.measure.latency import MIN_RUNS, time_calls
from quant.report import CONTENDED_CORES


def test_a_slow_call_stops_at_the_budget_after_the_minimum_runs() -> None:
    calls: list[float] = []

    def slow() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.03)  # MIN_RUNS calls take 0.6 s, past the 0.2 s budget

    timing = time_calls(slow, threads=1, runs=100, warmup=2, budget_s=0.2)
    assert timing.runs == MIN_RUNS and len(calls) == 2 + MIN_RUNS
    assert 30 <= timing.p50_ms <= timing.p90_ms <= timing.p99_ms


def test_no_budget_or_a_fast_call_times_every_run() -> None:
    assert time_calls(lambda: time.sleep(0.001), 1, runs=30, warmup=0, budget_s=None).runs == 30
    assert time_calls(lambda: None, 1, runs=100, warmup=0).runs == 100
    assert time_calls(lambda: time.sleep(0.03), 1, runs=5, warmup=0, budget_s=0.01).runs == 5


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """``count`` other processes, each spinning on a core of its own, until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.3)  # started and spinning
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_the_timing_says_how_busy_other_work_kept_the_cores() -> None:
    """A process spinning on each of this process's cores: the timing says that other work kept
    at least half a core busy (the report's threshold for calling its figures contended). The
    spinners share the cores with this process (and pytest's other worker), so not all of each."""
    cores = len(os.sched_getaffinity(0))
    with busy_cores(cores):
        timing = time_calls(lambda: sum(range(20_000)), threads=1, runs=50, warmup=2)
    assert timing.others_busy_cores is not None
    assert CONTENDED_CORES <= timing.others_busy_cores <= cores


def test_the_timing_process_own_work_is_not_counted_as_other_work() -> None:
    """The timed call keeps every core busy itself (threads hashing, which releases the GIL): had
    its own CPU time not been subtracted, the figure would be about every core."""
    cores = len(os.sched_getaffinity(0))
    block = os.urandom(8 * 2**20)

    def hash_on_every_core() -> None:
        with ThreadPoolExecutor(cores) as pool:
            list(pool.map(lambda _: hashlib.sha256(block).digest(), range(2 * cores)))

    timing = time_calls(hash_on_every_core, threads=cores, runs=20, warmup=1, budget_s=None)
    assert timing.others_busy_cores is not None
    # pytest's other worker may take its share of the cores meanwhile, not all of them
    assert timing.others_busy_cores < cores - 0.5


def test_a_short_timing_is_measured_over_the_counters_resolution() -> None:
    """100 runs of a trivial call take well under a millisecond: the host's counters tick every
    10 ms, so the stretch is extended to MIN_WINDOW_S rather than divided by almost nothing."""
    began = time.perf_counter()
    timing = time_calls(lambda: None, threads=1, runs=100, warmup=0)
    assert time.perf_counter() - began >= MIN_WINDOW_S
    assert timing.others_busy_cores is not None
    assert 0.0 <= timing.others_busy_cores <= len(os.sched_getaffinity(0))


def test_a_computing_session_takes_the_cores_other_work_leaves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a process spinning on each core, a session that computes takes one thread, not one
    per core (builds at once would each take every core); a count asked for is kept."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: a session takes one thread whatever the load")
    monkeypatch.setattr(ort_options, "cores_left", CoresLeft())  # its first question: from now
    with busy_cores(cores):
        assert ort_options.computing_options().intra_op_num_threads == 1
        assert CoresLeft()() == 1
    assert ort_options.computing_options(threads=cores + 1).intra_op_num_threads == cores + 1
