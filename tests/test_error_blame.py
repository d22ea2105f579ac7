"""Whose an error is (quant.errors.blame), as the pipeline, the build child, the worker and the
command line tell the user: each error below is raised by the real code path that raises it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import edge_un
from converters.source import ModelSource
from quant.errors import Blame, blame, one_line, reason
from quant.targets import get_profile
from quant.tflite import toolenv
from quant.tflite.vela import compile_vela
from service.settings import Settings
from service.worker.steps import failure


def _raised(call: Callable[[], object]) -> Exception:
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def _garbage_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"garbage")
    return path


CASES: dict[str, tuple[Callable[[Path], object], Blame]] = {
    "a checkpoint that is not one": (
        lambda tmp: edge_un.load_checkpoint(_garbage_checkpoint(tmp)), Blame.INPUT,
    ),
    "a norm argument out of range": (lambda _: edge_un.UnifiedNorm(8, momentum=1.5), Blame.INPUT),
    "a model format nobody reads": (lambda tmp: ModelSource(tmp / "m", "zip"), Blame.INPUT),  # type: ignore[arg-type]
    "a target no profile has": (lambda _: get_profile("imx95"), Blame.INPUT),
    "a tool that failed": (lambda tmp: compile_vela(tmp / "missing.tflite", tmp), Blame.TOOL),
    "a converter environment not made": (
        lambda tmp: replace(toolenv.ONNX2TF, env_var="EDGE_UN_TEST_NO_SUCH_ENV",
                            default_dir=str(tmp / "no-env")).require(),
        Blame.TOOL,
    ),
    "a file this host lacks": (lambda tmp: (tmp / "missing.npz").read_bytes(), Blame.HOST),
    "numpy refusing our call": (lambda _: np.zeros(3).reshape(2, 2), Blame.BUG),
    "a key we did not put": (lambda _: {}["scale"], Blame.BUG),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_error_is_blamed_on_what_caused_it(case: str, tmp_path: Path) -> None:
    call, expected = CASES[case]
    error = _raised(lambda: call(tmp_path))
    assert blame(error) is expected
    if expected is Blame.BUG:
        assert reason(error) == f"internal error: {type(error).__name__}: {one_line(error)}"
    else:
        assert reason(error) == one_line(error)


def test_edge_uns_input_errors_are_still_value_errors_for_python_callers() -> None:
    """The typed errors keep their base: code that caught ValueError still catches them."""
    with pytest.raises(ValueError, match="momentum must be in"):
        edge_un.UnifiedNorm(8, momentum=1.5)
    assert issubclass(edge_un.CheckpointError, edge_un.InputError)


def test_the_worker_says_a_bug_is_ours_and_an_input_error_is_the_users(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, job_memory_mb=0)  # 0: no limit to be near
    bad_input = _raised(lambda: edge_un.load_checkpoint(_garbage_checkpoint(tmp_path)))
    assert failure(bad_input, settings) == one_line(bad_input)
    bug = _raised(lambda: np.zeros(3).reshape(2, 2))
    said = failure(bug, settings)
    assert said.startswith("internal error during the conversion (ValueError: cannot reshape")
    assert said.endswith("the server's job log has the details")


def test_the_command_line_shows_a_bug_as_unexpected_not_as_the_users_mistake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A numpy ValueError inside a command (a bug planted in the checkpoint loader) is not
    worded as bad input; the checkpoint error beside it is."""
    from service.cli.app import main

    checkpoint = _garbage_checkpoint(tmp_path)
    assert main(["info", str(checkpoint)]) == 1
    assert capsys.readouterr().err.startswith("edge-un info: error: bad.safetensors: not a")

    monkeypatch.setattr(edge_un, "load_checkpoint", lambda *_, **__: np.zeros(3).reshape(2, 2))
    assert main(["info", str(checkpoint)]) == 1
    printed = " ".join(capsys.readouterr().err.split())
    assert "unexpected error" in printed and "ValueError: cannot reshape" in printed
    assert "--debug" in printed


def test_toolenv_still_runs_as_a_script_on_the_standard_library_alone() -> None:
    """The Docker image's first layer runs quant/tflite/toolenv.py by itself (no package, no
    site-packages): it may import nothing of quant, errors included."""
    script = Path(toolenv.__file__)
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(script), "no-such-env"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("toolenv: error: unknown environment 'no-such-env'")
