"""What a benchmark records of one conversion, per target: its figures
(``hf_migrate.target_figures``: status, pure int8 drift, recipe), the shipped file's drift,
Vela's NPU / CPU split, the ops off the accelerator, the file's inputs, and the wall time the
conversion spent on that target (from the pipeline's progress events)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from benchmarks.training.hf_migrate import target_figures
from converters.progress import ProgressEvent
from quant.pipeline import convert
from quant.report import Report, TargetReport


class TargetClock:
    """A progress callback that notes when each event came: the targets are built one after
    the other, so a target's time runs from its first event to the next event of another
    target (or the report); what comes before the first target is the load, fold and fp32
    export."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.marks: list[tuple[str | None, float]] = []

    def __call__(self, event: ProgressEvent) -> None:
        self.marks.append((event.target, time.perf_counter()))

    def per_target(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        marks = [*self.marks, (None, time.perf_counter())]
        for (target, at), (_, after) in itertools.pairwise(marks):
            if target is not None:
                spent[target] = spent.get(target, 0.0) + after - at
        return spent

    def before_targets(self) -> float:
        first = next((at for target, at in self.marks if target is not None), None)
        return (first or time.perf_counter()) - self.started


def timed_convert(source: Path, out: Path, **options: Any) -> tuple[Report, TargetClock]:
    """``quant.pipeline.convert(source, out_dir=out, **options)`` with its clock."""
    clock = TargetClock()
    report = convert(source, out_dir=out, progress=clock, latency_runs=5, **options)
    return report, clock


def target_record(target: TargetReport, seconds: float | None) -> dict[str, Any]:
    """One target of a report as a benchmark's row: ``target_figures`` and the shipped
    file's agreement, Vela's split of the shipped file (and of the pure int8 one when a
    16-bit fallback shipped), the ops off the accelerator, the inputs, the seconds spent."""
    drift, vela, pure_vela = target.drift, target.vela, target.vela_pure_int8
    return {
        **target_figures(target),
        "agreement": None if drift is None else drift.agreement,
        "samples": None if drift is None else drift.samples,
        "npu_ops": None if vela is None else vela.npu_ops,
        "cpu_ops": None if vela is None else list(vela.cpu_ops),
        "pure_cpu_ops": None if pure_vela is None else list(pure_vela.cpu_ops),
        "fallback_ops": target.fallback_ops,
        "inputs": {i.name: i.shape for i in target.inputs},
        "target_s": seconds,
    }


def cpu_op_types(cpu_ops: list[str] | None) -> list[str]:
    """The op types of Vela's CPU ops ("OP_TYPE tensor" each)."""
    return sorted({op.split()[0] for op in cpu_ops or []})
