"""Running one step of a converter's tool environment (``quant.tflite.toolenv``) as a sandboxed
subprocess: a deadline, a log of everything it printed, and one line that says why it failed.

The subprocess gets a scratch working directory, a minimal environment (tool env first on PATH,
no proxies, HOME inside the scratch directory) and, where the kernel allows it, no network at
all (``unshare -rn``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import ToolError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOG = re.compile(r"^[IWEF]\d{4} ")  # TensorFlow's C++ log lines: noise for a one-line error


class TfliteConversionError(ToolError):
    """onnx2tf or the quantizing converter failed; one line, the full log is kept in work_dir."""


def strip_ansi(text: str) -> str:
    """The text without terminal colour codes (onnx2tf colours its log)."""
    return _ANSI.sub("", text)


def _tool_environment(env_dir: Path, scratch: Path) -> dict[str, str]:
    """A minimal environment: nothing of the caller's (proxies, PYTHONPATH, CUDA) leaks in."""
    return {
        "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
        "HOME": str(scratch),  # keras and TF write config/cache under HOME
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TF_CPP_MIN_LOG_LEVEL": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "VIRTUAL_ENV": str(env_dir),
    }


@functools.cache
def _unshare() -> str | None:
    """`unshare`, if it can start a process without network here (not in every container)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    try:
        proc = subprocess.run(
            [unshare, "-rn", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return unshare if proc.returncode == 0 else None


def network_isolation(requested: bool | None) -> bool:
    """Whether the tool runs without network: None when the kernel allows it, True required
    (TfliteConversionError if it cannot be), False never."""
    if requested is False:
        return False
    if _unshare() is not None:
        return True
    if requested:
        raise TfliteConversionError(
            "network isolation was required but `unshare -rn` does not "
            "work here (no unshare, or user namespaces are disabled)"
        )
    return False


def run_tool(
    cmd: Sequence[str],
    cwd: Path,
    env_dir: Path,
    deadline: float,
    log: Path,
    what: str,
    isolate: bool,
) -> str:
    """Run one tool-env step with a deadline; log everything; return its stdout.

    The process gets its own session, so on timeout the whole group (onnx2tf starts onnxsim
    subprocesses) is killed, not just the parent.
    """
    if isolate:
        cmd = [_unshare() or "unshare", "-rn", *cmd]
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TfliteConversionError(f"{what} not started: the conversion's time limit is spent")
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_tool_environment(env_dir, cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _write_log(log, cmd, out, err, None)
        raise TfliteConversionError(
            f"{what} timed out after {remaining:.0f} s (full log: {log})"
        ) from None
    _write_log(log, cmd, out, err, proc.returncode)
    if proc.returncode != 0:
        raise TfliteConversionError(
            f"{what} failed: {last_meaningful_line(out, err)} (full log: {log})"
        )
    return strip_ansi(out)


def _write_log(log: Path, cmd: Sequence[str], out: str, err: str, code: int | None) -> None:
    status = "killed (timeout)" if code is None else f"exit code {code}"
    log.write_text(
        f"$ {' '.join(cmd)}\n# {status}\n\n## stdout\n{strip_ansi(out)}\n"
        f"## stderr\n{strip_ansi(err)}\n"
    )


def last_meaningful_line(stdout: str, stderr: str) -> str:
    """The line that says why a tool failed: the last error-looking line of stderr, then of
    stdout (onnx2tf prints its errors there), else the last line that is not TF log noise."""
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in strip_ansi(text).splitlines()]
        lines = [ln for ln in lines if ln and not _GLOG.match(ln)]
        for line in reversed(lines):
            if re.search(r"error|exception|failed", line, re.IGNORECASE):
                return line[:300]
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in strip_ansi(text).splitlines()]
        lines = [ln for ln in lines if ln and not _GLOG.match(ln)]
        if lines:
            return lines[-1][:300]
    return "no output"
