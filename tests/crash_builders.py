"""Target builders that fail the way native code does, for the isolation tests: each reports a
stage like a real builder, then aborts the process or raises. Imported by the child process
that ``quant.isolation`` starts (``tests.crash_builders:NAME``)."""

from __future__ import annotations

import os

import numpy as np

from quant.report import TargetResult
from quant.targets.builder import TargetJob
from quant.tflite.tool_sandbox import TfliteConversionError


def abort_in_drift(job: TargetJob) -> TargetResult:
    job.stage("drift", 0.45, "LiteRT")
    print("LiteRT: tensor type mismatch (a native assertion)", flush=True)
    os.abort()  # SIGABRT, as a failed C++ assertion in LiteRT does


def raise_tool_error(job: TargetJob) -> TargetResult:
    job.stage("convert", 0.05, "onnx2tf + TFLite converter")
    raise TfliteConversionError("the converter refused the model: op Foo has no int8 kernel")


def raise_numpy_error(job: TargetJob) -> TargetResult:
    """A bug of ours that numpy reports as a ValueError: not the user's mistake."""
    np.zeros(3).reshape(2, 2)
    raise AssertionError("numpy reshaped 3 values to 2 x 2")


def raise_key_error(job: TargetJob) -> TargetResult:
    raise KeyError("missing")
