"""The edge-un command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import edge_un


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_version_and_help() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"edge-un {edge_un.__version__}"
    result = run_cli()
    assert result.returncode != 0
    assert "info" in result.stdout


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


def test_export_defaults_to_the_bundled_example(tmp_path: Path) -> None:
    result = run_cli("export", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "VisionTransformer: 9 offline norms, 9 folded, 0 kept" in result.stdout
    assert "agreement 1.0000 on 1000 samples" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"].endswith("vit-mnist-ln-to-un.safetensors")
    assert report["fold"]["fully_integer"] is True
    assert (tmp_path / "model.onnx").stat().st_size > 100_000
    assert "Traceback" not in result.stderr


def test_convert_refuses_a_layernorm_model_in_one_line(tmp_path: Path) -> None:
    result = run_cli("convert", "vit-mnist-ln", "--out", str(tmp_path))
    assert result.returncode == 1
    last_line = result.stderr.rstrip("\n").split("\n")[-1].split("\r")[-1].strip()
    assert last_line.startswith("edge-un convert: error: online norms cannot fold: blocks.0.norm1")
    assert "--allow-online" in last_line and "edge-un migrate" in last_line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report.json").exists()


def test_targets_lists_every_profile_with_its_rules() -> None:
    result = run_cli("targets")
    assert result.returncode == 0, result.stderr
    for name in ("cpu", "imx93", "imx8mp", "tda4vm"):
        assert f"{name}: " in result.stdout
    assert "every scale a power of two" in result.stdout  # tda4vm's rule


def test_convert_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "calib.npz"
    bad.write_bytes(b"not an archive")
    for args, message in (
        (["--target", "gpu"], "unknown target 'gpu'; choose from cpu, imx93, imx8mp, tda4vm"),
        (["--calib", str(bad)], "calibration data calib.npz: not a readable .npz archive"),
    ):
        result = run_cli("convert", "-o", str(tmp_path / "out"), *args)
        assert result.returncode == 1
        last_line = result.stderr.rstrip("\n").split("\n")[-1].split("\r")[-1].strip()
        assert last_line.startswith(f"edge-un convert: error: {message}"), result.stderr
        assert "Traceback" not in result.stderr
