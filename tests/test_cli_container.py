"""What the Docker image relies on from the command line (docker/, docs/service/docker.md): an
output directory the user cannot write is one line that says who, where and what to do; `edge-un
targets` says which targets this installation can build, and `convert` builds those by default.

Run as a user runs it: a subprocess. The tests run as root in CI, where every directory is
writable: the unwritable case runs the child as another uid (setpriv, else ``preexec_fn``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
OTHER_UID = 1234  # no such user needed: setuid takes a number
IN_CONTAINER = Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def run_cli(*args: str, env: dict[str, str] | None = None, as_other_user: bool = False):
    """``edge-un ARGS``; ``as_other_user``: as uid/gid OTHER_UID with no supplementary groups,
    through setpriv (util-linux, what the image's entrypoint uses), else setuid in the child."""
    command = [sys.executable, "-m", "service.cli", *args]
    preexec = None
    if as_other_user and shutil.which("setpriv"):
        ids = [f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
        command = ["setpriv", *ids, *command]
    elif as_other_user:

        def preexec() -> None:  # in the child, before exec
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)

    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env or ENV,
        preexec_fn=preexec,
    )  # fmt: skip


@pytest.fixture
def unwritable_dir() -> Iterator[tuple[Path, bool, int, int]]:
    """A directory the CLI's process may not write: root-owned (mode 755) with the child as
    another uid when the tests run as root, else one of ours made read-only (mode 555).
    Under /tmp, not tmp_path: pytest's base directory is private (0700) to its owner."""
    path = Path(tempfile.mkdtemp(prefix="edge-un-unwritable-", dir="/tmp"))
    as_root = os.getuid() == 0
    path.chmod(0o755 if as_root else 0o555)
    uid, gid = (OTHER_UID, OTHER_UID) if as_root else (os.getuid(), os.getgid())
    try:
        yield path, as_root, uid, gid
    finally:
        path.chmod(0o755)
        shutil.rmtree(path)


@pytest.mark.parametrize(
    ("args", "nested"),
    [
        (("convert", "--target", "cpu", "-o"), False),
        (("convert", "--target", "cpu", "-o"), True),  # DIR/a/b/out: parents that do not exist
        (("export", "--out"), False),
    ],
    ids=["convert", "convert-nested", "export"],
)
def test_unwritable_output_dir_is_one_line_with_the_uid_and_the_fix(
    unwritable_dir, args: tuple[str, ...], nested: bool
) -> None:
    path, as_other_user, uid, gid = unwritable_dir
    out = path / "a" / "b" / "out" if nested else path / "out"
    env = {**ENV, "HOME": str(path)}  # as another uid, root's HOME is not readable
    result = run_cli(*args, str(out), env=env, as_other_user=as_other_user)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback, no warning before it
    assert lines[0].startswith(
        f"edge-un {args[0]}: error: uid {uid} (gid {gid}) cannot write the output directory "
        f"{out}: no write permission on {path} (owned by uid "
    ), lines[0]
    assert f"make {path} writable for uid {uid}" in lines[0]
    if IN_CONTAINER:  # the Docker image: the flag that makes the container run as the owner
        assert 'docker run --user "$(id -u):$(id -g)"' in lines[0]
    assert not out.exists() and not (path / "a").exists()  # nothing created


def test_output_path_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("convert", "--target", "cpu", "-o", str(tmp_path / "file" / "out"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"edge-un convert: error: {tmp_path / 'file'} is not a directory: "
        "choose another output directory"
    )


def without_tflite_env(tmp_path: Path) -> dict[str, str]:
    """The environment of an installation with neither TFLite converter (the edge-un:onnx image)."""
    return {
        **ENV,
        "EDGE_UN_TFLITE_ENV": str(tmp_path / "no-tflite-env"),
        "EDGE_UN_LITERT_TORCH_ENV": str(tmp_path / "no-litert-env"),
    }


def test_targets_says_which_targets_this_installation_can_build(tmp_path: Path) -> None:
    result = run_cli("targets", env=without_tflite_env(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["target", "here", "board,"]
    for name, here in (("cpu", "yes"), ("imx93", "no"), ("imx8mp", "no"), ("tda4vm", "yes")):
        assert any(line.split()[:2] == [name, here] for line in lines), result.stdout
    assert "this installation can build: cpu, tda4vm" in lines
    for name in ("imx93", "imx8mp"):
        reason = next(line for line in lines if line.startswith(f"cannot build {name}: "))
        # both converters named, each with where it was looked for and the command that makes it
        for tool in ("litert-torch, ai-edge-quantizer", "onnx2tf, TensorFlow"):
            assert f"converter ({tool}) environment is missing at {tmp_path}" in reason
        assert "python -m quant.tflite.toolenv litert-torch" in reason and "edge-un:onnx" in reason
    assert all(line == line.rstrip() for line in lines)


def test_targets_with_the_litert_torch_env_alone_can_build_every_target(tmp_path: Path) -> None:
    """The default install (no onnx2tf, no TensorFlow) builds all four targets."""
    from quant.tflite import toolenv

    if not toolenv.LITERT_TORCH.is_ready():
        pytest.skip("this installation has no PyTorch -> LiteRT converter environment")
    result = run_cli("targets", env={**ENV, "EDGE_UN_TFLITE_ENV": str(tmp_path / "no-tflite-env")})
    assert result.returncode == 0, result.stderr
    assert "this installation can build: cpu, imx93, imx8mp, tda4vm" in result.stdout
    assert "cannot build" not in result.stdout


def test_convert_defaults_to_the_targets_this_installation_can_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import convert

    def names(spec: str | None) -> list[str]:
        return [profile.name for profile in convert.targets_here(spec)]

    monkeypatch.setenv("EDGE_UN_TFLITE_ENV", str(tmp_path / "no-tflite-env"))
    monkeypatch.setenv("EDGE_UN_LITERT_TORCH_ENV", str(tmp_path / "no-litert-env"))
    assert names(None) == ["cpu", "tda4vm"]
    note = capsys.readouterr().err.strip()
    assert note.startswith("targets: cpu, tda4vm (not imx93, imx8mp: the PyTorch -> LiteRT"), note
    assert names("tda4vm,cpu") == ["tda4vm", "cpu"]
    assert capsys.readouterr().err == ""  # named targets that can be built: no note


def test_convert_refuses_a_named_target_it_cannot_build_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli("convert", "--target", "cpu,imx93", "-o", str(out),
                     env=without_tflite_env(tmp_path))  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().startswith(
        "edge-un convert: error: this installation cannot build imx93: the PyTorch -> LiteRT "
        "converter (litert-torch, ai-edge-quantizer) environment is missing at "
        f"{tmp_path / 'no-litert-env'}"
    ), result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_the_service_defaults_to_the_targets_this_installation_can_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload's targets are chosen the way `convert` chooses them: the default leaves out
    what the installation cannot build, a named one it cannot build is a 422 before any work."""
    from quant.tflite import toolenv
    from service.errors import UploadRejected
    from service.server import intake
    from service.server.http_status import status_of

    def names(text: str | None) -> list[str]:
        return [profile.name for profile in intake.form_targets(text)]

    if toolenv.ONNX2TF.is_ready():
        assert names(None) == ["cpu", "imx93", "imx8mp", "tda4vm"]
    monkeypatch.setenv("EDGE_UN_TFLITE_ENV", str(tmp_path / "no-tflite-env"))
    monkeypatch.setenv("EDGE_UN_LITERT_TORCH_ENV", str(tmp_path / "no-litert-env"))
    assert names(None) == names("all") == ["cpu", "tda4vm"]
    with pytest.raises(UploadRejected) as refused:
        intake.form_targets("cpu, imx8mp")
    assert status_of(refused.value) == 422
    assert refused.value.detail.startswith("this installation cannot build imx8mp: the PyTorch")
