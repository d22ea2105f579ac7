"""The edge-un command line, run as a user runs it: a subprocess (piped, or on a terminal)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from pathlib import Path
from typing import get_args

import pytest

import edge_un
from quant.report import Report
from service.cli import choices
from testbed.servers import free_port

COMMANDS = ("convert", "export", "targets", "report", "info", "train", "migrate", "finetune",
            "serve", "token", "submit", "jobs", "status", "download", "cancel")  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# torch and the pipelines stay out of the process unless a command needs them (and in tests
# torch uses one thread: the machine is shared).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True, text=True, timeout=300, env=env or ENV,
    )  # fmt: skip


def last_line(text: str) -> str:
    return text.rstrip("\n").split("\n")[-1].split("\r")[-1].strip()


def run_in_terminal(*args: str, timeout: float = 600) -> tuple[int, str]:
    """The CLI with a pseudo-terminal (120 columns) as stdout and stderr: what a person sees."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**ENV, "TERM": "xterm-256color"}
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", *args],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            process.kill()
            pytest.fail(f"edge-un {' '.join(args)} did not finish in {timeout} s")
        return process.wait(timeout=60), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


def test_version_and_help() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"edge-un {edge_un.__version__}"
    result = run_cli()  # no command: the help, and a usage exit code
    assert result.returncode == 2
    assert "info" in result.stdout
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert re.search(rf"^\W*{name}\s", result.stdout, re.MULTILINE), (name, result.stdout)
    assert "\x1b" not in result.stdout
    result = run_cli("token", "--help")
    for name in ("create", "list", "revoke"):
        assert re.search(rf"^\W*{name}\s", result.stdout, re.MULTILINE), (name, result.stdout)


def test_light_commands_do_not_import_torch(tmp_path: Path) -> None:
    """--help, --version, targets and report start fast: nothing imports torch (~2 s)."""
    code = (
        "import sys\nfrom service.cli import main\n"
        "codes = [main(argv) for argv in (['--help'], ['--version'], ['targets'], "
        f"['report', {str(tmp_path)!r}])]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert result.stdout.splitlines()[-1] == "[0, 0, 0, 1] False", result.stdout + result.stderr


def test_option_choices_are_edge_uns() -> None:
    """The choices are spelled out in service.cli.choices (no torch import to build --help)."""
    from edge_un import examples, finetune
    from edge_un.data import DATASETS
    from edge_un.training.presets import MODELS
    from quant.targets import TARGET_NAMES

    assert get_args(choices.Model) == tuple(MODELS)
    assert get_args(choices.Dataset) == tuple(DATASETS)
    assert get_args(choices.NormKind) == tuple(edge_un.NORM_KINDS)
    assert get_args(choices.OfflineKind) == tuple(edge_un.OFFLINE_KINDS)
    assert get_args(choices.FinetuneMethod) == tuple(finetune.METHODS)
    assert tuple(examples.names()) == choices.EXAMPLES
    assert tuple(examples.names(hf=True)) == choices.HF_EXAMPLES
    assert tuple(TARGET_NAMES) == choices.TARGETS
    assert choices.DEFAULT_MODEL in choices.EXAMPLES


def test_usage_errors_exit_2_with_the_usage() -> None:
    for args in (
        ["convert", "--max-drift", "lots"],
        ["train", "--model", "rnn", "--out", "x.safetensors"],
        ["migrate", "m.safetensors", "--data", "mnist", "--npz", "d.npz", "--out", "x"],
        ["export"],  # --out is required
        ["frobnicate"],
    ):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Usage: edge-un" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_info_prints_the_checkpoint_config(tmp_path: Path, small_vit) -> None:
    path = edge_un.save_checkpoint(small_vit, tmp_path / "m.safetensors", {"dataset": "x"})
    result = run_cli("info", str(path))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["architecture"] == "VisionTransformer"
    assert summary["norm"]["kind"] == "un"
    assert summary["metadata"] == {"dataset": "x"}
    assert summary["parameters"] == sum(p.numel() for p in small_vit.parameters())


def test_bad_file_is_one_line_and_nonzero_exit(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    result = run_cli("info", str(bad))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("edge-un info: error: bad.safetensors: not a safetensors")
    assert result.stdout == ""


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    result = run_cli("--debug", "info", str(bad))
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert "NotACheckpointError" in result.stderr
    assert last_line(result.stderr).startswith("edge-un info: error: bad.safetensors: not a")


def test_export_defaults_to_the_bundled_example(tmp_path: Path) -> None:
    result = run_cli("export", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "VisionTransformer: 9 offline norms, 9 folded, 0 kept" in result.stdout
    assert "agreement 1.0000 on 1000 samples" in result.stdout
    assert f"wrote {tmp_path / 'model.onnx'}, " in result.stdout  # a path is never wrapped
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"].endswith("vit-mnist-ln-to-un.safetensors")
    assert report["fold"]["fully_integer"] is True
    assert (tmp_path / "model.onnx").stat().st_size > 100_000
    assert result.stderr == ""  # no progress bar redraws in a pipe
    assert "\x1b" not in result.stdout


def test_convert_refuses_a_layernorm_model_in_one_line(tmp_path: Path) -> None:
    result = run_cli("convert", "vit-mnist-ln", "--out", str(tmp_path))
    assert result.returncode == 1
    line = last_line(result.stderr)
    assert line.startswith("edge-un convert: error: online norms cannot fold: blocks.0.norm1")
    assert "--allow-online" in line and "edge-un migrate" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report.json").exists()


def test_targets_is_a_table_with_every_profile_and_its_rules() -> None:
    result = run_cli("targets")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("cpu", "imx93", "imx8mp", "tda4vm"):
        assert any(line.startswith(f"{name} ") for line in lines), result.stdout
    assert "every scale a power of two" in result.stdout  # tda4vm's rule, not wrapped
    assert "\x1b" not in result.stdout
    assert all(line == line.rstrip() for line in lines)  # no padding after the last column


def test_convert_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "calib.npz"
    bad.write_bytes(b"not an archive")
    for args, message in (
        (["--target", "gpu"], "unknown target 'gpu'; choose from cpu, imx93, imx8mp, tda4vm"),
        (["--calib", str(bad)], "calibration data calib.npz: not a readable .npz archive"),
    ):
        result = run_cli("convert", "-o", str(tmp_path / "out"), *args)
        assert result.returncode == 1
        line = last_line(result.stderr)
        assert line.startswith(f"edge-un convert: error: {message}"), result.stderr
        assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One cpu conversion of the UN ViT (~20 s) on a terminal: progress bar and tables."""
    out = tmp_path_factory.mktemp("convert") / "vit"
    code, screen = run_in_terminal("convert", "vit-mnist-un", "--target", "cpu", "-o", str(out))
    return out, code, screen


def test_convert_on_a_terminal_shows_progress_then_the_tables(converted) -> None:
    out, code, screen = converted
    assert code == 0, screen[-3000:]
    assert "convert: load" in screen and "convert: cpu: " in screen  # the bar's stages
    assert "\x1b[" in screen  # drawn with colours and cursor moves
    # what stays on the screen: each line after its last carriage return
    lines = [ANSI.sub("", line).rstrip("\r").split("\r")[-1] for line in screen.split("\n")]
    assert any(line.startswith("  ✓ load") for line in lines)  # each finished stage, timed
    row = next(line for line in lines if line.startswith("cpu "))
    assert row.split()[1] == "ok", row
    assert any(line.startswith("target ") and "p50 ms" in line for line in lines)
    assert "Traceback" not in screen
    assert (out / "report.json").is_file()


def test_report_shows_a_conversion_as_tables(converted) -> None:
    out, code, _ = converted
    assert code == 0
    report = Report.read(out / "report.json")
    result = run_cli("report", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == f"vit-mnist-un (edge-un {report.edge_un_version})"
    drift = report.targets["cpu"].drift
    assert drift is not None
    assert any(
        line.startswith("cpu ") and f"{100 * drift.agreement:.1f} %" in line for line in lines
    ), text
    for heading in ("top-1 fp32 -> int8", "p50 ms", "sha256"):
        assert heading in text
    for artifact in report.targets["cpu"].artifacts:  # every artifact, with its full digest
        assert any(artifact.name in line and artifact.sha256 in line for line in lines)
    assert result.stdout == run_cli("report", str(out / "report.json")).stdout


def test_convert_writes_the_services_report_page(converted) -> None:
    """Issue 21: report.html beside report.md, the page the service serves for the report."""
    from service.report_html import CSP, render_report_html

    out, code, screen = converted
    assert code == 0
    page = (out / "report.html").read_text()
    report = Report.read(out / "report.json")
    assert page.startswith("<!DOCTYPE html>") and f'content="{CSP}"' in page
    assert "<title>edge-un conversion: vit-mnist-un</title>" in page
    # the same page: equal but for the ids matplotlib draws at random in each plot
    random_ids = re.compile(r'(id="|#|href="#)[^"\s)]*')
    assert random_ids.sub("", page) == random_ids.sub("", render_report_html(report))
    assert "report.html" in ANSI.sub("", screen)  # the closing line names it


def test_report_of_a_wrong_directory_is_one_line(tmp_path: Path) -> None:
    result = run_cli("report", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert (
        result.stderr
        == f"edge-un report: error: {tmp_path / 'missing'}: no such file or directory\n"
    )
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "no report.json here" in result.stderr
    (tmp_path / "report.json").write_text('{"schema_version": "1.0", "model": {}}')
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "report.json: not an edge-un report" in result.stderr
    assert "Traceback" not in result.stderr


def service_env(tmp_path: Path) -> dict[str, str]:
    return {**ENV, "EDGE_UN_DATA_DIR": str(tmp_path / "data")}


def test_token_create_list_revoke(tmp_path: Path) -> None:
    env = service_env(tmp_path)
    result = run_cli("token", "list", env=env)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    created = run_cli("token", "create", "ci", env=env)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.splitlines()[-1]
    assert created.stdout == secret + "\n"  # alone: TOKEN=$(edge-un token create ci)
    assert re.fullmatch(r"\S{32,}", secret)
    assert "shown once" in created.stderr
    second = run_cli("token", "create", "alice laptop", env=env).stdout.strip()
    assert second != secret
    # Only a hash is stored: the secret is nowhere in the database file.
    database = tmp_path / "data" / "edge-un.db"
    with sqlite3.connect(database) as connection:
        connection.execute("PRAGMA wal_checkpoint(FULL)")
    assert secret.encode() not in database.read_bytes()

    result = run_cli("token", "revoke", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("revoked token 1 (ci) at ")
    listing = run_cli("token", "list", env=env)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["id", "name", "created", "revoked"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"1", "2"}
    assert " ci " in rows["1"] and rows["1"].count("UTC") == 2  # created and revoked
    assert "alice laptop" in rows["2"] and rows["2"].count("UTC") == 1
    assert secret not in listing.stdout and second not in listing.stdout

    result = run_cli("token", "revoke", "99", env=env)
    assert result.returncode == 1
    assert (
        result.stderr
        == "edge-un token revoke: error: no token with id 99 (see edge-un token list)\n"
    )
    result = run_cli("token", "revoke", "first", env=env)
    assert result.returncode == 2 and "Usage: edge-un token revoke" in result.stderr


def test_serve_answers_healthz_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env(tmp_path),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer in 90 s"
                time.sleep(0.5)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert (tmp_path / "data" / "edge-un.db").is_file()  # it migrated the settings' database
