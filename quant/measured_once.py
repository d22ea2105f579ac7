"""A measurement a job's targets share: the same file measured the same way, once per job.

Why: imx93 and imx8mp ship the same pure int8 TFLite file whenever imx93 needs no 16x8
fallback (both take one conversion, ``quant.tflite.target``), and both measure it in LiteRT on
this host: its drift, its per-tensor SQNR and its latency, ~37 s of BERT-base's imx8mp build
(benchmarks/results/hf_scale.md), the same figures twice. The first target to ask measures and
leaves the result in the job's shared directory, keyed by what was measured (the file's sha256
among it); the next one reads it. Targets may build at once, in processes or on machines that
share the job's directory: the first takes a lock on the file system and measures, the others
wait for it; a build killed while measuring releases the lock and leaves no result (it is
written under another name, then renamed), so the next one measures again.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .digest import sha256_file

MEASURED_DIR = "measured"


def file_key(kind: str, path: Path, *details: object) -> str:
    """The key of measuring ``path``'s content as ``kind`` with ``details`` (thread count...)."""
    return "-".join([kind, sha256_file(path)[:32], *(str(detail) for detail in details)])


def measured_once(shared_dir: Path | None, key: str, measure: Callable[[], Any]) -> Any:
    """``measure()``'s result (JSON: lists, dicts, numbers, strings), computed by the first
    build of the job that asks for ``key`` and read back by every later one; with no shared
    directory (a target built alone) simply ``measure()``. A tuple comes back as a list."""
    if shared_dir is None:
        return measure()
    directory = shared_dir / MEASURED_DIR
    directory.mkdir(parents=True, exist_ok=True)
    result = directory / f"{key}.json"
    with (directory / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if result.is_file():
            return json.loads(result.read_text())
        value = measure()
        partial = result.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(value))
        partial.replace(result)
    return json.loads(result.read_text())  # the same types whoever measured it
