"""The job process: one conversion, in its own process, started by the queue.

The queue forks it from its fork server (``child_main``; settings from the EDGE_UN_*
variables it is handed). It dies with its parent (PR_SET_PDEATHSIG), caps its own address
space (EDGE_UN_JOB_MEMORY_MB), runs ``quant.pipeline.convert`` into a staging directory, writes
its progress to the database at most every ``progress_interval_s`` (and at each new stage),
then publishes the artifacts and records the outcome. Every write is conditional on the job
still running this attempt, so a cancelled or superseded run changes nothing.

A job process that dies of a signal records nothing; whoever started it (the local queue, or a
Celery pool process) names the reason with :func:`exit_message`, from the evidence it has: the
signal, the process's peak address space against EDGE_UN_JOB_MEMORY_MB, the memory words in
the job's log (where faulthandler also writes the Python stack of a crash), the stage it was in.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from sqlalchemy import select

from . import jobs
from .db import Job, session_scope
from .jobs import Claim
from .settings import Settings, get_settings
from .storage import LocalArtifactStore

log = logging.getLogger("edge_un.worker")
PR_SET_PDEATHSIG = 1
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
    """Be killed (SIGKILL) when ``parent`` dies; exit at once if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the queue's recovery still cleans up
        pass
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        sys.exit(3)


def limit_memory(megabytes: int) -> None:
    if megabytes > 0:
        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Progress:
    """``progress(stage, fraction)`` for the pipeline: throttled writes, stage durations."""

    def __init__(self, settings: Settings, claim: Claim) -> None:
        self.settings = settings
        self.claim = claim
        self.interval = settings.progress_interval_s
        self.stage: str | None = None
        self.stage_key: str | None = None
        self.stage_started = time.monotonic()
        self.last_write = 0.0
        self.durations: list[tuple[str, float]] = []

    def __call__(self, stage: str, fraction: float) -> None:
        now = time.monotonic()
        key = stage_key(stage)
        if key != self.stage_key:
            if self.stage_key is not None:
                self.durations.append((self.stage_key, now - self.stage_started))
            self.stage_key, self.stage_started = key, now
        if stage != self.stage or now - self.last_write >= self.interval:
            self.stage, self.last_write = stage, now
            # False when cancelled meanwhile: nothing to do, the queue kills this process
            with session_scope(self.settings) as session:
                jobs.progress(session, self.claim, stage, 100 * fraction)

    def finish(self) -> list[tuple[str, float]]:
        if self.stage_key not in (None, "done"):  # "done" is the end marker, not a stage
            self.durations.append((self.stage_key, time.monotonic() - self.stage_started))
            self.stage_key = None
        return self.durations


def stage_key(stage: str) -> str:
    """A stage name without its details, for metrics: "cpu: fallback: 8 tensors" -> "fallback"."""
    from quant.targets import TARGET_NAMES

    head, _, rest = stage.partition(": ")
    name = rest if rest and head in TARGET_NAMES else stage
    return name.split(":")[0].split("(")[0].strip()[:64] or "unknown"


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def run(settings: Settings, job_id: str, attempt: int) -> int:
    from quant.errors import QuantError

    claim = jobs.Claim(job_id, attempt)
    store = LocalArtifactStore(settings.data_dir)
    with session_scope(settings) as session:
        row = session.scalar(select(Job).where(Job.id == job_id))
    if row is None or (row.state, row.attempts) != ("running", attempt):
        log.warning("job %s attempt %s is not running it any more: nothing to do", job_id, attempt)
        return 0
    uploads = store.upload_dir(job_id)
    staging = store.staging_dir(job_id, attempt)
    progress = Progress(settings, claim)
    error: str | None = None
    try:
        from quant.pipeline import convert  # heavy (torch, onnx): inside the memory limit's try

        report = convert(
            uploads / f"model.{row.model_format}",
            targets=row.targets or None,
            calib=uploads / "calib.npz" if row.calib_label else None,
            eval=uploads / "eval.npz" if row.eval_label else None,
            out_dir=staging,
            max_drift=row.max_drift,
            progress=progress,
            config=uploads / "config.json" if row.config_label else None,
            latency_runs=settings.latency_runs,
            # the user's file name, as `convert` names a model (uploads are stored as model.*)
            model_name=Path(row.model_label).stem or None,
        )
        failed = [t for t in report.targets.values() if t.status == "failed"]
        if failed and len(failed) == len(report.targets):
            error = "every target failed: " + "; ".join(f"{t.name}: {t.error}" for t in failed)
    except (MemoryError, ImportError) as caught:  # an import that cannot map its libraries
        if isinstance(caught, ImportError) and not _out_of_memory(caught, settings.job_memory_mb):
            raise
        error = _memory_message(settings)
    except (QuantError, ValueError, OSError) as caught:  # bad input: checkpoint, data, targets
        error = one_line(caught)
    except Exception as caught:  # a bug: say what, keep the traceback in the job's log
        traceback.print_exc()
        if _out_of_memory(caught, settings.job_memory_mb):  # a native library could not allocate
            error = _memory_message(settings)
        else:
            error = f"internal error during the conversion ({type(caught).__name__}: "
            error += f"{one_line(caught)}); the server's job log has the details"
    durations = progress.finish()
    if error is not None and not (staging / "report.json").exists():
        store.discard_run(job_id, attempt)
        with session_scope(settings) as session:
            if jobs.fail(session, claim, error):
                jobs.record_stages(session, job_id, durations)
        store.delete_uploads(job_id)
        return 1
    store.commit(job_id, staging)
    with session_scope(settings) as session:
        done = jobs.fail(session, claim, error) if error else jobs.succeed(session, claim)
        if done:
            jobs.record_stages(session, job_id, durations)
    if not done:  # cancelled (or superseded) while it ran: publish nothing
        still = jobs_state(settings, job_id)
        if still is None or still[0] == "cancelled":
            store.delete(job_id)
        return 0
    store.delete_uploads(job_id)
    return 0 if error is None else 1


def _out_of_memory(error: BaseException, limit_mb: int) -> bool:
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


def job_log_path(settings: Settings, job_id: str, attempt: int) -> Path:
    """Where a run's output goes (both queue modes): under the data directory's logs/."""
    return settings.data_dir.resolve() / "logs" / f"{job_id}-{attempt}.log"


def log_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log as text ("" if there is none)."""
    with contextlib.suppress(OSError), path.open("rb") as stream:
        stream.seek(max(path.stat().st_size - size, 0))
        return stream.read().decode("utf-8", "replace")
    return ""


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_message(
    code: int, *, stage: str | None, peak_mb: float, log_path: Path, limit_mb: int
) -> str:
    """Why a job process that ended with ``code`` (negative: killed by that signal) without
    recording an outcome failed its job. A crash by SIGSEGV, SIGABRT or SIGBUS counts as out of
    memory only on evidence, as :func:`_out_of_memory` does: a peak within NEAR_LIMIT of the
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


def _memory_message(settings: Settings) -> str:
    return (
        f"the conversion ran out of memory (the limit is {settings.job_memory_mb} MB, "
        "EDGE_UN_JOB_MEMORY_MB); try a smaller model, or ask for a higher limit"
    )


def jobs_state(settings: Settings, job_id: str) -> tuple[str, int] | None:
    with session_scope(settings) as session:
        return jobs.state_of(session, job_id)


def child_main(job_id: str, attempt: int, environ: dict[str, str], log_path: str) -> None:
    """The job process as the local queue starts it: a fork of the (preloaded) fork server."""
    parent = os.getppid()
    _release_fork_server()
    os.setsid()  # its own process group: a timeout or cancel kills all it started
    die_with_parent(parent)
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(descriptor, stream)
    os.close(descriptor)
    os.environ.update(environ)
    sys.exit(_start(job_id, attempt))


def _release_fork_server() -> None:
    """Close this process's copy of the fork server's "alive" pipe. The fork server exits when
    every copy is closed, which must mean "the server died", not "and its jobs ended too": its
    exit is what kills the jobs (PR_SET_PDEATHSIG). (CPython hands each forked child a copy.)"""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _start(job_id: str, attempt: int) -> int:
    return run_job_process(get_settings(), job_id, attempt)


def run_job_process(settings: Settings, job_id: str, attempt: int) -> int:
    """The job process's work, once its output goes to the job's log: its limits, then
    :func:`run`. A crash in native code leaves the Python stack of every thread in the log."""
    limit_memory(settings.job_memory_mb)
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no stderr with a file
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s job {job_id}: %(message)s")
    if settings.job_threads:
        import torch

        torch.set_num_threads(settings.job_threads)
    return run(settings, job_id, attempt)
