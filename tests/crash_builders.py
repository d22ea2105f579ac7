"""Target builders that fail the way native code does, for the isolation tests: each reports a
stage like a real builder, then aborts the process or raises. Imported by the child process
that ``quant.isolation`` starts (``tests.crash_builders:NAME``)."""

from __future__ import annotations

import os

from quant.report import TargetResult
from quant.target_job import TargetJob


def abort_in_drift(job: TargetJob) -> TargetResult:
    job.stage("drift", 0.45, "LiteRT")
    print("LiteRT: tensor type mismatch (a native assertion)", flush=True)
    os.abort()  # SIGABRT, as a failed C++ assertion in LiteRT does


def raise_value_error(job: TargetJob) -> TargetResult:
    job.stage("convert", 0.05, "onnx2tf + TFLite converter")
    raise ValueError("the converter refused the model: op Foo has no int8 kernel")


def raise_key_error(job: TargetJob) -> TargetResult:
    raise KeyError("missing")
