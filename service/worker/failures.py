"""Why a job failed, from the evidence: a job process killed by a signal (its peak address
space against EDGE_UN_JOB_MEMORY_MB, the memory words in its log, the stage it was in), an
error that means memory ran out, a run past its time limit. Whoever watched the process (the
local queue, a Celery pool process) or caught the error (``steps.failure``) names the reason
with these; the job's log keeps the details."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

from quant.isolation import signal_name

from ..settings import Settings

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


def timeout_message(settings: Settings) -> str:
    return (
        f"the conversion timed out after {settings.job_timeout_s:g} s (EDGE_UN_JOB_TIMEOUT_S) "
        "and was stopped"
    )


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
