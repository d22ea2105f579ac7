"""The job process: a conversion's work, in a process of its own, and what both queue modes
share around it.

Either queue forks it (the local queue from its fork server, ``child_main``; a Celery pool
process itself) and it starts the same way (:func:`enter`): it dies with its parent
(PR_SET_PDEATHSIG), writes its output to the job's log, caps its own address space
(EDGE_UN_JOB_MEMORY_MB), then runs its step (``service.worker.steps``: the whole conversion in
the local queue; in Celery mode one of a run's steps: prepare it, build one target, report),
recording its progress in the database as the pipeline's events come (at most every
``progress_interval_s``, and at each new stage). Every write is conditional on the job still
running this attempt, so a cancelled or superseded run changes nothing.

A job process that dies of a signal records nothing; whoever started it (the local queue, or a
Celery pool process) names the reason with :func:`exit_message`, from the evidence it has: the
signal, the process's peak address space against EDGE_UN_JOB_MEMORY_MB, the memory words in
the job's log (where faulthandler also writes the Python stack of a crash), the stage it was in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import importlib
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from converters.progress import ProgressEvent
from quant.isolation import die_with_parent as quant_die_with_parent
from quant.isolation import signal_name

from .. import jobs
from ..db import session_scope
from ..job_states import FINISHED
from ..jobs import Claim
from ..settings import Settings, get_settings
from ..storage import ArtifactStore

log = logging.getLogger("edge_un.job_process")
# Imported once by whoever forks job processes (the local queue's fork server, a Celery
# worker): each job process is a fork of it, so a job starts in milliseconds instead of
# re-importing torch, ONNX and the pipeline (seconds each time). Also what a conversion loads
# anyway whose native code must not start under the job's memory limit: scipy's OpenBLAS
# (scikit-learn's data splits load it) loops forever when an allocation fails as it starts.
PRELOAD = ("service.worker.job_process", "quant.pipeline", "sklearn.model_selection")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Signals of a crash in native code. RLIMIT_AS makes an allocation fail, which some libraries
# answer with abort() (C++'s uncaught std::bad_alloc) or a fault; so can any native bug.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS})
# What allocators and runtimes write to stderr when memory runs out (lower case).
MEMORY_WORDS = (
    "out of memory",
    "bad_alloc",
    "cannot allocate memory",
    "failed to allocate",
    "failed to map segment",
    "memoryerror",
)
LOG_TAIL_BYTES = 64 * 1024  # the end of a job's log, where a crash's last words are


def die_with_parent(parent: int) -> None:
    """Be killed (SIGKILL) when ``parent`` dies (not Linux: the queue's recovery still cleans
    up); exit at once if it already has."""
    quant_die_with_parent()
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        sys.exit(3)


def limit_memory(megabytes: int) -> None:
    if megabytes > 0:
        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def preload() -> None:
    """Import PRELOAD (scikit-learn is the optional data extra: without it, no data splits)."""
    for module in PRELOAD:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(module)


def limit_threads(settings: Settings) -> None:
    """EDGE_UN_JOB_THREADS for the math libraries: set before torch loads (the preload), as
    OpenMP reads it once."""
    if settings.job_threads:
        for name in THREAD_VARIABLES:
            os.environ.setdefault(name, str(settings.job_threads))


def timeout_message(settings: Settings) -> str:
    return (
        f"the conversion timed out after {settings.job_timeout_s:g} s (EDGE_UN_JOB_TIMEOUT_S) "
        "and was stopped"
    )


def clean_leftovers(settings: Settings, store: ArtifactStore, job_id: str) -> None:
    """A finished (or cancelled) job's leftovers: what its runs staged, and its uploads. A job
    still queued or running keeps them."""
    with session_scope(settings) as session:
        state = jobs.state_of(session, job_id)
    if state is None or state[0] in FINISHED:
        attempts = state[1] if state else 0
        for attempt in range(1, attempts + 1):
            store.discard_run(job_id, attempt)
        store.delete_uploads(job_id)


Record = Callable[[Session, ProgressEvent], bool]  # False: the step no longer runs


class ProgressRecorder:
    """The pipeline's ``progress``: its events into the job's records (throttled) by ``record``
    (the job's, or a target's and its job's), and how long each stage took (for the
    stage-duration metrics)."""

    def __init__(self, settings: Settings, record: Record) -> None:
        self.settings = settings
        self.record = record
        self.interval = settings.progress_interval_s
        self.last_label: str | None = None
        self.last_write = 0.0
        self.stage: str | None = None
        self.stage_started = time.monotonic()
        self.durations: list[tuple[str, float]] = []

    def __call__(self, event: ProgressEvent) -> None:
        now = time.monotonic()
        if event.stage != self.stage:
            if self.stage is not None:
                self.durations.append((self.stage, now - self.stage_started))
            self.stage, self.stage_started = event.stage, now
        if event.label != self.last_label or now - self.last_write >= self.interval:
            self.last_label, self.last_write = event.label, now
            # False when cancelled meanwhile: nothing to do, the queue kills this process.
            # A database away (restarting) loses a progress line, not the conversion: the
            # heartbeat, not this, says whether the step still runs.
            try:
                with session_scope(self.settings) as session:
                    self.record(session, event)
            except (OperationalError, InterfaceError) as error:
                log.warning("progress not recorded (the database is away): %s", error)

    def finish(self) -> list[tuple[str, float]]:
        if self.stage not in (None, "done"):  # "done" is the end marker, not a stage
            self.durations.append((self.stage, time.monotonic() - self.stage_started))
            self.stage = None
        return self.durations


def out_of_memory(error: BaseException, limit_mb: int) -> bool:
    """Did ``error`` come from the address-space limit? ONNX Runtime's arena and torch's
    allocator say "memory", C++ "bad_alloc", the dynamic loader "failed to map segment"; not
    every library says it (oneDNN: "could not create a primitive"), so it also counts when this
    process came within ``NEAR_LIMIT`` of the limit (a bug there is then reported as memory)."""
    text = str(error).lower()
    reasons = ("memory", "bad_alloc", "failed to map segment")
    if any(reason in text for reason in reasons):
        return True
    return near_limit(peak_address_space_mb(), limit_mb)


NEAR_LIMIT = 0.8  # a failed allocation is not counted in the peak: leave room for its size


def near_limit(peak_mb: float, limit_mb: int) -> bool:
    """Whether a process that peaked at ``peak_mb`` came within NEAR_LIMIT of the limit (0: no
    limit, never near it)."""
    return limit_mb > 0 and peak_mb >= NEAR_LIMIT * limit_mb


def peak_address_space_mb(pid: int | None = None) -> float:
    """The peak virtual memory (VmPeak, what RLIMIT_AS caps) of process ``pid`` (default: this
    one), 0 if unknown (gone, or not Linux). A dead process has none: sample it while it runs."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        status = Path(f"/proc/{pid or 'self'}/status").read_text(encoding="ascii")
        for line in status.splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) / 1024
    return 0.0


def job_log_path(settings: Settings, job_id: str, attempt: int, step: str | None = None) -> Path:
    """Where a run's output goes (both queue modes): under the data directory's logs/; a
    Celery run's later steps (a target's build, its report) each in a log of its own."""
    name = f"{job_id}-{attempt}" + (f".{step}" if step else "")
    return settings.data_dir.resolve() / "logs" / f"{name}.log"


def log_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log as text ("" if there is none)."""
    with contextlib.suppress(OSError), path.open("rb") as stream:
        stream.seek(max(path.stat().st_size - size, 0))
        return stream.read().decode("utf-8", "replace")
    return ""


def exit_message(
    code: int, *, stage: str | None, peak_mb: float, log_path: Path, limit_mb: int
) -> str:
    """Why a job process that ended with ``code`` (negative: killed by that signal) without
    recording an outcome failed its job. A crash by SIGSEGV, SIGABRT or SIGBUS counts as out of
    memory only on evidence, as :func:`out_of_memory` does: a peak within NEAR_LIMIT of the
    limit, or memory words in its log; else it is a crash in native code, named with the stage
    it was in and the log that has its stack."""
    if code >= 0:
        return f"the conversion process exited with code {code} before it finished"
    number = -code
    name = signal_name(number)
    if number == signal.SIGKILL:  # the kernel's OOM killer, an operator: nothing tells which
        return (
            f"the conversion process was killed by {name} before it finished: it may have run "
            "out of memory, or been stopped by an operator; submit it again"
        )
    if number not in CRASH_SIGNALS:
        return f"the conversion process was killed by {name} before it finished"
    during = f"during its stage {stage!r}" if stage else "before it reported a stage"
    text = log_tail(log_path).lower()
    if near_limit(peak_mb, limit_mb) or any(word in text for word in MEMORY_WORDS):
        peak = f"it peaked at {peak_mb:,.0f} MB; " if peak_mb else ""
        limit = f"the limit is {limit_mb} MB" if limit_mb else "no limit is set"
        return (
            f"the conversion process was killed by {name} {during}: it ran out of memory "
            f"({peak}{limit}, EDGE_UN_JOB_MEMORY_MB); try a smaller model, or ask for a "
            "higher limit"
        )
    return (
        f"the conversion process crashed with {name} {during} (a native library aborted or "
        f"faulted); the job's log, logs/{log_path.name} in the server's data directory, has "
        "the details"
    )


def memory_message(settings: Settings) -> str:
    return (
        f"the conversion ran out of memory (the limit is {settings.job_memory_mb} MB, "
        "EDGE_UN_JOB_MEMORY_MB); try a smaller model, or ask for a higher limit"
    )


def jobs_state(settings: Settings, job_id: str) -> tuple[str, int] | None:
    with session_scope(settings) as session:
        return jobs.state_of(session, job_id)


Step = Callable[[], int]  # a step's work in the job process; its exit code


def enter(settings: Settings, log_path: Path, parent: int, step: Step) -> int:
    """The job process's start in both queue modes, once forked from ``parent``: die with it,
    write everything to the job's log, then :func:`run_job_process`."""
    die_with_parent(parent)
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(descriptor, stream)
    os.close(descriptor)
    return run_job_process(settings, log_path.stem, step)


def child_main(job_id: str, attempt: int, environ: dict[str, str], log_path: str) -> None:
    """The job process as the local queue starts it: a fork of the (preloaded) fork server,
    handed its settings as EDGE_UN_* variables; it runs the whole conversion."""
    from .steps import run

    parent = os.getppid()
    os.setsid()  # its own process group: a timeout or cancel kills all it started
    os.environ.update(environ)
    settings = get_settings()
    step = functools.partial(run, settings, Claim(job_id, attempt))
    sys.exit(enter(settings, Path(log_path), parent, step))


def run_job_process(settings: Settings, name: str, step: Step) -> int:
    """The job process's work, once its output goes to the job's log: its limits, then the
    step. A crash in native code leaves the Python stack of every thread in the log."""
    limit_memory(settings.job_memory_mb)
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no stderr with a file
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s job {name}: %(message)s")
    if settings.job_threads:
        import torch

        torch.set_num_threads(settings.job_threads)
    return step()
