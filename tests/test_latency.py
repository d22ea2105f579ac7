"""quant.latency.time_calls: a large model's timed runs stop at the time budget, never before
MIN_RUNS; a small model's run all of them."""

from __future__ import annotations

import time

from quant.latency import MIN_RUNS, time_calls


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
