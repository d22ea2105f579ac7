"""One ``quant.pipeline.convert`` run, timed stage by stage, in a process of its own.

    python -m benchmarks.speed.latency_stages MODEL OUT_DIR RESULT.json [--calib F --eval F
        --max-drift X --min-agreement Y --targets T --parallel N --budget-s S]

Stage wall times are the time between successive ``progress(event)`` calls (a stage lasts until
the next one starts), each stage named by its event's ``label`` (``cpu: quantize (ONNX
Runtime)``); targets built at once interleave their events, so each target's own events are
kept too (``target_events_s``). Peak memory: this process's own peak RSS (the pipeline in Python,
ONNX Runtime, LiteRT; VmHWM), the largest RSS of any one tool subprocess (onnx2tf, TensorFlow's
converter, Vela) and of the whole process tree (what the machine had to hold at once), both
sampled every 0.2 s with psutil; and the largest address space any one process of the tree
reached (its VmPeak, read at each sample), which is what the service's
``EDGE_UN_JOB_MEMORY_MB`` caps. ``--budget-s``: the targets' builds must end that many seconds
after the start (the service's job deadline): a search for a file within the bars ships its best
file when time runs out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # the pipeline's modules are imported inside the timed run, not before
    from converters.progress import ProgressEvent


def tree_memory(process: psutil.Process) -> tuple[int, int, int]:
    """(RSS of the whole tree, largest RSS of one descendant, largest VmPeak (peak address
    space) of the tree's processes), in bytes, from one walk of the tree."""
    tree = largest = address_space = 0
    for proc in [process, *process.children(recursive=True)]:
        with contextlib.suppress(OSError, psutil.Error):
            rss = proc.memory_info().rss
            tree += rss
            if proc is not process:  # a descendant: the tool processes the pipeline starts
                largest = max(largest, rss)
            status = Path(f"/proc/{proc.pid}/status").read_text()
            # a zombie (a tool that exited, not yet reaped) has no VmPeak line
            for line in (ln for ln in status.splitlines() if ln.startswith("VmPeak:")):
                address_space = max(address_space, int(line.split()[1]) * 1024)
    return tree, largest, address_space


def _hwm_mb() -> float:
    """This process's peak RSS (VmHWM; ``ru_maxrss`` would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out_dir")
    parser.add_argument("result")
    parser.add_argument("--calib")
    parser.add_argument("--eval")
    parser.add_argument("--targets", help='"cpu,imx93" (default: every target)')
    # default: the pipeline's own bars (quant.targets.DEFAULT_BARS)
    parser.add_argument("--max-drift", type=float)
    parser.add_argument("--min-agreement", type=float)
    parser.add_argument("--parallel", type=int, default=1, help="targets built at once")
    parser.add_argument("--budget-s", type=float, help="seconds the builds may take in all")
    args = parser.parse_args()

    peak = {"tree": 0, "child": 0, "address_space": 0}
    done = threading.Event()
    me = psutil.Process()

    failed: list[BaseException] = []

    def sample() -> None:
        try:
            while not done.wait(0.2):
                for key, value in zip(peak, tree_memory(me), strict=True):
                    peak[key] = max(peak[key], value)
        except Exception as error:  # a sampler that stopped would report too low a peak
            failed.append(error)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    events: list[tuple[str, float]] = []
    spans: dict[str, list[float]] = {}  # each target's first and last event
    by_target: dict[str, list[tuple[str, float]]] = {}  # each target's events, in order

    def progress(event: ProgressEvent) -> None:
        now = time.perf_counter() - start
        events.append((event.label, now))
        if event.target:
            spans.setdefault(event.target, [now, now])[1] = now
            stage = event.label.removeprefix(f"{event.target}: ")
            by_target.setdefault(event.target, []).append((stage, now))

    from quant.pipeline import convert  # imported inside the timed process, not before
    from quant.targets import parse_targets

    events.append(("import", 0.0))
    bars = {"max_drift": args.max_drift, "min_agreement": args.min_agreement}
    report = convert(
        args.model,
        targets=parse_targets(args.targets) if args.targets else None,
        calib=args.calib,
        eval=args.eval,
        out_dir=args.out_dir,
        progress=progress,
        parallel=args.parallel,
        deadline=deadline,
        **{name: value for name, value in bars.items() if value is not None},
    )
    total = time.perf_counter() - start
    done.set()
    sampler.join()
    if failed:
        raise SystemExit(f"memory sampling stopped during the run: {failed[0]!r}")
    # A stage lasts until the next event: true of targets built one at a time only (at once,
    # their events interleave; each target's span is kept instead).
    stages = [
        {"stage": name, "start_s": round(t, 3), "seconds": round(nxt - t, 3)}
        for (name, t), (_, nxt) in zip(events, [*events[1:], ("end", total)], strict=True)
    ]
    result = {
        "total_s": round(total, 2),
        "parallel": args.parallel,
        **({"stages": stages} if args.parallel == 1 else {}),
        "target_spans_s": {name: [round(a, 1), round(b, 1)] for name, (a, b) in spans.items()},
        # a target's stage lasts until its next event (its last one: until its build ended,
        # which sends none)
        "target_events_s": {
            name: [[label, round(t, 1)] for label, t in target_events]
            for name, target_events in by_target.items()
        },
        "peak_rss_mb": round(_hwm_mb(), 1),
        "peak_child_rss_mb": round(peak["child"] / 2**20, 1),
        "peak_tree_rss_mb": round(peak["tree"] / 2**20, 1),
        "peak_address_space_mb": round(max(peak["address_space"], tree_memory(me)[2]) / 2**20, 1),
        "targets": {
            name: {
                "status": target.status,
                "error": target.error,
                "excluded_steps": len(target.excluded),
                "int16_tensors": len(target.int16_tensors),
                "recipes_tried": len(target.recipes_tried),
                "agreement": None if target.drift is None else target.drift.agreement,
                "warnings": target.warnings,
                "latency": [
                    timing.model_dump(include={"threads", "p50_ms", "others_busy_cores", "retimed"})
                    for timing in target.latency
                ],
            }
            for name, target in report.targets.items()
        },
    }
    Path(args.result).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
