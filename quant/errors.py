"""Errors of the quant package, and the one rule that says whose fault an error is.

Each message is one readable line that says what to do. :func:`blame` sorts any error into
the user's input, a tool that failed, this host, or a bug of ours; the pipeline (a target's
reason), the build child (its reason) and the service (a job's error) all go by it, so a bug
never reaches a user as their mistake, nor their mistake as a bug.
"""

from __future__ import annotations

import sys
from enum import Enum

from converters.errors import ConversionError, plain


class QuantError(ValueError):
    """Base class: bad input to a quantization job (4xx over HTTP, exit 1 on the CLI)."""


class ToolError(RuntimeError):
    """A converter, runtime or target build that failed and says why (onnx2tf, litert-torch,
    Vela, a converter environment, a build child that died)."""


class UnknownTargetError(QuantError):
    """A target name no profile has."""


class DataFileError(QuantError):
    """A calibration or evaluation ``.npz`` that cannot be used (shape, dtype, count, NaN...)."""


class RuleViolation(QuantError):
    """An artifact breaks its target's rules (a float op on an NPU, a scale not a power of 2)."""


MAX_LINE_CHARS = 500  # a reason in a report, a job's error, a terminal line


def one_line(error: BaseException) -> str:
    """An error's message as one line: its non-blank lines joined (pydantic and others write
    several, the first alone often says only how many), capped at MAX_LINE_CHARS; the type's
    name when the message is empty, without terminal escape codes (the ONNX exporter colours
    its messages). Every place that shows an error in one line uses this."""
    text = plain(str(error))
    line = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(line) > MAX_LINE_CHARS:
        line = line[: MAX_LINE_CHARS - 3].rstrip() + "..."
    return line or type(error).__name__


class Blame(Enum):
    """Whose an error is: what a user is told, and whether it has a traceback worth keeping."""

    INPUT = "input"  # the user's model, data, targets or settings: they can fix it
    TOOL = "tool"  # a converter, runtime or build failed, saying why
    HOST = "host"  # this machine: a file, a disk, a permission, a package not installed
    BUG = "bug"  # anything else: ours to fix


def _input_errors() -> tuple[type[BaseException], ...]:
    # edge_un's errors derive from edge_un.errors.InputError; edge_un imports torch, so it is
    # looked up only if loaded: an error it raised means it is.
    edge_un_errors = sys.modules.get("edge_un.errors")
    loaded = (edge_un_errors.InputError,) if edge_un_errors is not None else ()
    return (ConversionError, QuantError, *loaded)


def _tool_errors() -> tuple[type[BaseException], ...]:
    # quant.tflite.toolenv also runs as a script, on the standard library alone (the Docker image's
    # first layer builds the onnx2tf environment before the code is copied): its errors cannot
    # derive from ToolError, and are looked up only if it is loaded.
    toolenv = sys.modules.get("quant.tflite.toolenv")
    loaded = (toolenv.ToolEnvError, toolenv.ToolEnvMissingError) if toolenv is not None else ()
    return (ToolError, *loaded)


def blame(error: BaseException) -> Blame:
    """Whose ``error`` is, by its type: each package raises typed errors for what it was given
    (edge_un's ``InputError``, converters' ``ConversionError``, :class:`QuantError`) and for a
    tool's failure (:class:`ToolError`); a plain ValueError (numpy's, say) is a bug."""
    if isinstance(error, _input_errors()):
        return Blame.INPUT
    if isinstance(error, _tool_errors()):
        return Blame.TOOL
    if isinstance(error, OSError | ModuleNotFoundError):
        return Blame.HOST
    return Blame.BUG


def reason(error: BaseException) -> str:
    """``error`` as a failure's one-line reason: its own message, or for a bug its type too,
    marked as ours."""
    if blame(error) is not Blame.BUG:
        return one_line(error)
    said = f": {one_line(error)}" if str(error).strip() else ""
    return f"internal error: {type(error).__name__}{said}"
