"""The job process: a conversion's work, in a process of its own, and what both queue modes
share around it.

Either queue forks it (the local queue from its fork server, ``queue.child_main``; a Celery
pool process itself) and it starts the same way (:func:`enter`): it dies with its parent
(PR_SET_PDEATHSIG), writes its output to the job's log, caps its own address space
(EDGE_UN_JOB_MEMORY_MB), then runs its step (``service.worker.steps``: the whole conversion in
the local queue; in Celery mode one of a run's steps: prepare it, build one target, report),
recording its progress in the database as the pipeline's events come
(``steps.ProgressRecorder``: at most every ``progress_interval_s``, and at each new stage).
Every write is conditional on the job still running this attempt, so a cancelled or
superseded run changes nothing.

A job process that dies of a signal records nothing; whoever started it (the local queue, or a
Celery pool process) names the reason with ``failures.exit_message``, from the evidence it has: the
signal, the process's peak address space against EDGE_UN_JOB_MEMORY_MB, the memory words in
the job's log (where faulthandler also writes the Python stack of a crash), the stage it was in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import logging
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

from quant.isolation import die_with_parent as quant_die_with_parent

from .. import jobs
from ..db import session_scope
from ..job_states import FINISHED
from ..settings import Settings
from ..storage import ArtifactStore

log = logging.getLogger("edge_un.job_process")
# Imported once by whoever forks job processes (the local queue's fork server, a Celery
# worker): each job process is a fork of it, so a job starts in milliseconds instead of
# re-importing torch, ONNX and the pipeline (seconds each time). Also what a conversion loads
# anyway whose native code must not start under the job's memory limit: scipy's OpenBLAS
# (scikit-learn's data splits load it) loops forever when an allocation fails as it starts.
PRELOAD = ("service.worker.steps", "quant.pipeline", "sklearn.model_selection")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


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


def job_log_path(settings: Settings, job_id: str, attempt: int, step: str | None = None) -> Path:
    """Where a run's output goes (both queue modes): under the data directory's logs/; a
    Celery run's later steps (a target's build, its report) each in a log of its own."""
    name = f"{job_id}-{attempt}" + (f".{step}" if step else "")
    return settings.data_dir.resolve() / "logs" / f"{name}.log"


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
