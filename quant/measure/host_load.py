"""How many of this process's cores other work kept busy over a stretch of time.

Why: a report's latency is one process timing a file on this host, and a conversion may build
several targets at once (``edge-un convert --parallel``, Celery workers on one machine), each
quantizing or measuring at full speed. A file timed then runs on what the others leave it:
BERT-base's int8 file at 1 thread took 162 ms on the quiet 2-core host and 342 ms beside two
other builds' work (benchmarks/results/latency_contention.md). So a timing says how busy the
host was: the CPU time this process's cores spent on anything but this process, per second of
the stretch (``quant.quiet_latency`` times a busy figure again once the builds are done).

Read from the kernel's per-CPU counters (``/proc/stat``, Linux only: elsewhere there is no
figure), over the CPUs this process may run on, so a shared machine's other cores do not count.
Their resolution is one clock tick (10 ms), so a stretch shorter than ``MIN_WINDOW_S`` is
measured until it has lasted that long: a small model's 100 timed runs can take 30 ms.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# 25 ticks per core at 100 Hz: the figure is within ~0.05 of a core
MIN_WINDOW_S = 0.25
# /proc/stat's columns: user nice system idle iowait irq softirq steal (guest is within user);
# a core is busy with anything but idling or waiting for I/O, or running another VM (steal)
IDLE_COLUMNS = (3, 4)
COUNTED_COLUMNS = 8


@dataclass(frozen=True)
class _Counters:
    wall_s: float
    busy_s: float | None  # the process's cores, all their work; None: no per-CPU counters
    own_s: float  # this process's CPU time, all its threads


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU time the ``cpus`` spent working since boot, in seconds; None off Linux."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *columns = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        counted = [int(value) for value in columns[:COUNTED_COLUMNS]]
        ticks += sum(counted) - sum(counted[i] for i in IDLE_COLUMNS)
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def _now() -> _Counters:
    return _Counters(time.perf_counter(), _busy_seconds(_cpus()), time.process_time())


class HostLoad:
    """Started when made; ``others_busy_cores()`` ends the stretch and says how many cores
    (0 to this process's cores) other work kept busy on average over it, or None (no counters)."""

    def __init__(self) -> None:
        self.start = _now()

    def others_busy_cores(self) -> float | None:
        left = MIN_WINDOW_S - (time.perf_counter() - self.start.wall_s)
        if left > 0:
            time.sleep(left)  # the counters' ticks are too coarse for a shorter stretch
        end = _now()
        if self.start.busy_s is None or end.busy_s is None:
            return None
        others = (end.busy_s - self.start.busy_s) - (end.own_s - self.start.own_s)
        cores = len(_cpus()) or 1
        return round(min(max(others / (end.wall_s - self.start.wall_s), 0.0), cores), 2)


# A question asked this long after the last one is answered over a fresh stretch, since the
# stretch since then may have ended long ago; one asked sooner is answered over that stretch.
RECENT_S = 5.0


class CoresLeft:
    """How many of this process's cores other work leaves it now, at least one: the cores less
    those the others kept busy (rounded) over the stretch since the last question. Asked sooner
    than ``MIN_WINDOW_S`` after it, the last answer; later than ``RECENT_S``, or the first time,
    over the next ``MIN_WINDOW_S``.

    Why: a session that computes (``quant.measure.ort_options``) takes one thread per core by
    default, and builds at once each take that many. Three exact drift passes of BERT-base's int8
    file (48 samples) at once on 2 cores took 26.8-28.0 s at 2 threads each, 23.2-23.3 s at one
    thread each; alone, 8.8 s at 2 threads, 16.2 s at one (measured once, side by side): a
    build alone keeps both cores, one beside others takes one. Its outputs are the same bit for
    bit at either count (BERT-base's exact int8 and fp32 passes, measured)."""

    def __init__(self) -> None:
        self._load: HostLoad | None = None
        self._answer = 0
        self._pid = os.getpid()

    def __call__(self) -> int:
        if self._pid != os.getpid():  # forked: the stretch began with the parent's CPU time
            self._load, self._pid = None, os.getpid()
        since = None if self._load is None else time.perf_counter() - self._load.start.wall_s
        if since is not None and since < MIN_WINDOW_S:  # answered with the stretch just begun
            return self._answer
        load = HostLoad() if since is None or since > RECENT_S else self._load
        busy = load.others_busy_cores()  # a fresh stretch waits MIN_WINDOW_S here
        self._load = HostLoad()
        cores = len(_cpus()) or os.cpu_count() or 1
        self._answer = cores if busy is None else max(1, cores - round(busy))
        return self._answer


cores_left = CoresLeft()  # one per process: the stretch since this process last asked
