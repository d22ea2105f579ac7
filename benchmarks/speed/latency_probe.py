"""One configuration of benchmarks.speed.latency, in a process of its own (its peak RSS is its own).

    python -m benchmarks.speed.latency_probe KIND MODEL INPUTS.npy

KIND is ``torch`` (an edge_un checkpoint, eager fp32), ``ort`` (an ONNX file, ONNX Runtime CPU
provider, the session options of ``quant.measure.latency.onnx_latency``) or ``litert`` (a TFLite
file, LiteRT with XNNPACK: ``quant.tflite.litert.sample_runner``, what
``quant.tflite.litert.latency_tflite`` times). The parent sends one JSON command a line on stdin and
reads one JSON reply a line on stdout:

    {"threads": 1, "batch": 1, "budget_s": 0.5, "warmup": 3}  ->  {"samples_ms": [...], ...}
    {"rss": true}                                                ->  {"maxrss_mb": ...}
    {"xnnpack": true}       ->  {"xnnpack": {op type: [ops, ops XNNPACK took]}} (LiteRT; else {})

A run warms up, then times ``quant.measure.latency.time_calls`` for as many calls as fit the
budget (``min_runs``, default 5, to 400); every single call's time is returned, so the parent
pools them over rounds: wall time (``samples_ms``) and the calling thread's CPU time
(``cpu_ms``: all of a 1-thread call's work, whatever else shares the cores).
A batch of N (at most the samples given) is one call with N samples (torch, ORT: dynamic
batch) or N invokes of the static batch-1 TFLite file (LiteRT).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from quant.measure.latency import time_calls

MIN_RUNS, MAX_RUNS = 5, 400


def _maxrss_mb() -> float:
    """This process's peak RSS (VmHWM: per address space, so not inherited from the parent the
    way ``ru_maxrss`` is across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def torch_runner(path: str, inputs: np.ndarray) -> Callable[[int, int], Callable[[], object]]:
    import torch

    import edge_un

    torch.set_num_interop_threads(1)
    model, _ = edge_un.load_checkpoint(path)
    model.eval()

    def make(threads: int, batch: int) -> Callable[[], object]:
        torch.set_num_threads(threads)
        feed = torch.from_numpy(np.ascontiguousarray(inputs[:batch]))

        def call() -> object:
            with torch.inference_mode():
                return model(feed)

        return call

    return make


def ort_runner(path: str, inputs: np.ndarray) -> Callable[[int, int], Callable[[], object]]:
    import onnxruntime as ort

    sessions: dict[int, ort.InferenceSession] = {}

    def make(threads: int, batch: int) -> Callable[[], object]:
        if threads not in sessions:
            options = ort.SessionOptions()  # as quant.measure.latency.onnx_latency
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            sessions[threads] = ort.InferenceSession(
                path, options, providers=["CPUExecutionProvider"]
            )
        session = sessions[threads]
        feed = {session.get_inputs()[0].name: np.ascontiguousarray(inputs[:batch])}
        return lambda: session.run(None, feed)

    return make


def litert_runner(path: str, inputs: np.ndarray) -> Callable[[int, int], Callable[[], object]]:
    from quant.tflite.litert import sample_runner

    runners: dict[int, Callable[[int], np.ndarray]] = {}

    def make(threads: int, batch: int) -> Callable[[], object]:
        if threads not in runners:  # one interpreter per thread count, the inputs prepared once
            runners[threads] = sample_runner(path, inputs, threads)
        run = runners[threads]

        def call() -> None:  # the file is batch 1: a batch is that many invokes
            for i in range(batch):
                run(i)

        return call

    return make


RUNNERS = {"torch": torch_runner, "ort": ort_runner, "litert": litert_runner}


def delegated_ops(kind: str, path: str) -> dict[str, list[int]]:
    """A TFLite file's {op type: [ops, ops XNNPACK's delegate took]}; nothing for the others."""
    if kind != "litert":
        return {}
    from quant.tflite.litert import xnnpack_ops

    return {op: list(counts) for op, counts in xnnpack_ops(path).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=list(RUNNERS))
    parser.add_argument("model", help="the checkpoint, ONNX or TFLite file")
    parser.add_argument("inputs", help="a .npy of 32 samples")
    args = parser.parse_args()
    kind, path = args.kind, args.model
    inputs = np.load(args.inputs)
    base = _maxrss_mb()  # imports only (the runtime's module is imported by the runner)
    make = RUNNERS[kind](path, inputs)
    print(json.dumps({"ready": True, "base_rss_mb": base, "maxrss_mb": _maxrss_mb()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        if command.get("rss"):
            print(json.dumps({"maxrss_mb": _maxrss_mb()}), flush=True)
            continue
        if command.get("xnnpack"):
            print(json.dumps({"xnnpack": delegated_ops(kind, path)}), flush=True)
            continue
        key = (command["threads"], command["batch"])
        call = make(*key)  # sessions are cached; torch's thread count is set here, every time
        start = time.perf_counter()
        for _ in range(max(1, command["warmup"])):
            call()
        per_call = (time.perf_counter() - start) / max(1, command["warmup"])
        least = command.get("min_runs", MIN_RUNS)
        runs = int(np.clip(command["budget_s"] / max(per_call, 1e-6), least, MAX_RUNS))
        samples: list[float] = []
        cpu: list[float] = []  # this thread's CPU time: all of a 1-thread call's work

        def timed(
            call: Callable[[], object] = call,
            samples: list[float] = samples,
            cpu: list[float] = cpu,
        ) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            call()
            samples.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)

        time_calls(timed, key[0], runs=runs, warmup=0, budget_s=None)
        reply = {"samples_ms": samples, "cpu_ms": cpu, "maxrss_mb": _maxrss_mb()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
