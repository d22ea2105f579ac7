"""Checkpoints: exact round trips, and every refusal with its own error and one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import edge_un
from edge_un.norms import NORM_KINDS

from .builders import model_inputs, trained_small_model


def _header(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()["edge_un"])


def _rewrite(path: Path, out: Path, tensors=None, header=None) -> Path:
    save_file(
        load_file(str(path)) if tensors is None else tensors,
        str(out),
        metadata=None if header is False else {"edge_un": json.dumps(header or _header(path))},
    )
    return out


@pytest.fixture
def saved(tmp_path: Path, small_vit) -> Path:
    return edge_un.save_checkpoint(small_vit, tmp_path / "vit.safetensors", {"accuracy": 0.97})


@pytest.mark.parametrize("kind", NORM_KINDS)
@pytest.mark.parametrize("family", ["vit", "text"])
def test_round_trip_is_bit_exact(tmp_path: Path, family: str, kind: str) -> None:
    model = trained_small_model(family, kind)
    path = edge_un.save_checkpoint(
        model, tmp_path / "m.safetensors", {"classes": ["a", "b"], "test_accuracy": 0.5}
    )
    loaded, info = edge_un.load_checkpoint(path)
    x = model_inputs(model)
    assert not loaded.training
    assert torch.equal(loaded(x), model(x))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert info.architecture == type(model).__name__
    assert info.norm_kind == kind
    assert info.edge_un_version == edge_un.__version__
    assert info.metadata == {"classes": ["a", "b"], "test_accuracy": 0.5}


def test_header_holds_architecture_arguments_norm_and_version(saved: Path) -> None:
    header = _header(saved)
    assert header["architecture"] == "VisionTransformer"
    assert header["arguments"]["dim"] == 16
    assert header["norm"] == {"kind": "un", "kwargs": {"warmup_iters": 1}}
    assert header["edge_un_version"] == edge_un.__version__
    assert header["metadata"] == {"accuracy": 0.97}


@pytest.mark.parametrize("zip_format", [True, False])
def test_pt_state_dict_with_config_file(tmp_path: Path, small_vit, saved: Path, zip_format) -> None:
    torch.save(
        {"state_dict": small_vit.state_dict()},
        tmp_path / "weights.pt",
        _use_new_zipfile_serialization=zip_format,
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_header(saved)))
    loaded, info = edge_un.load_checkpoint(tmp_path / "weights.pt", config=config)
    x = model_inputs(small_vit)
    assert torch.equal(loaded(x), small_vit(x))
    assert info.metadata == {"accuracy": 0.97}


class _RunsCode:
    """Unpickling this calls os.system, which would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path: Path, saved: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"weight": torch.zeros(2), "payload": _RunsCode(marker)}, tmp_path / "evil.pt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_header(saved)))
    with pytest.raises(edge_un.UnsafeCheckpointError, match=r"refused.*run code") as error:
        edge_un.load_checkpoint(tmp_path / "evil.pt", config=config)
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_not_a_checkpoint(tmp_path: Path) -> None:
    junk = tmp_path / "model.safetensors"
    junk.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(edge_un.NotACheckpointError, match=r"not a safetensors checkpoint"):
        edge_un.load_checkpoint(junk)
    with pytest.raises(edge_un.NotACheckpointError, match=r"no such file"):
        edge_un.load_checkpoint(tmp_path / "missing.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"\x00\x01garbage")
    with pytest.raises(edge_un.NotACheckpointError, match=r"not a torch state dict"):
        edge_un.load_checkpoint(tmp_path / "junk.pt", config={"architecture": "TextTransformer"})


def test_truncated_file(tmp_path: Path, saved: Path) -> None:
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    with pytest.raises(edge_un.NotACheckpointError, match=r"truncated"):
        edge_un.load_checkpoint(truncated)


def test_no_config(tmp_path: Path, saved: Path, small_vit) -> None:
    with pytest.raises(edge_un.MissingConfigError, match=r"no edge_un config"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "bare.safetensors", header=False))
    torch.save(small_vit.state_dict(), tmp_path / "weights.pth")
    with pytest.raises(edge_un.MissingConfigError, match=r"pass config="):
        edge_un.load_checkpoint(tmp_path / "weights.pth")


def test_unknown_architecture(tmp_path: Path, saved: Path) -> None:
    header = {**_header(saved), "architecture": "ResNet50"}
    with pytest.raises(edge_un.UnknownArchitectureError, match=r"'ResNet50'"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "x.safetensors", header=header))


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path: Path, saved: Path) -> None:
    tensors = load_file(str(saved))
    missing = {k: v for k, v in tensors.items() if k != "head.bias"}
    with pytest.raises(edge_un.TensorMismatchError, match=r"missing: head.bias"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "a.safetensors", tensors=missing))
    extra = {**tensors, "head.extra": torch.zeros(3)}
    with pytest.raises(edge_un.TensorMismatchError, match=r"unexpected tensor.*head.extra"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "b.safetensors", tensors=extra))
    wrong = {**tensors, "head.weight": torch.zeros(10, 17)}
    with pytest.raises(edge_un.TensorMismatchError, match=r"'head.weight' has shape \[10, 17\]"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "c.safetensors", tensors=wrong))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_tensor_is_named(tmp_path: Path, saved: Path, value: float) -> None:
    tensors = load_file(str(saved))
    tensors["blocks.1.mlp.fc1.weight"][0, 0] = value
    with pytest.raises(edge_un.NonFiniteTensorError, match=r"'blocks.1.mlp.fc1.weight'"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "nan.safetensors", tensors=tensors))


FORGED_CONFIGS = [
    {"dim": 32768, "heads": 2},  # ~13 billion parameters in the MLPs and qkv
    {"img_size": 2**16, "patch_size": 2},  # a billion-entry position embedding
    {"depth": 10**7},  # ten million blocks: costly to build even on the meta device
]

# Loads each file given in a child forked from a fresh interpreter that has imported edge_un:
# a forked child's peak RSS starts at its parent's current RSS (not at any earlier peak), so
# ru_maxrss after the load minus before it is what the load itself took. Address space is
# capped 1 GiB above the start, so a load that did allocate fails fast instead of swapping.
_LOAD_IN_FRESH_PROCESS = """
import json, os, resource, sys
import edge_un

for path in sys.argv[1:]:
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            edge_un.load_checkpoint(path)
            error = None
        except BaseException as caught:
            error = [type(caught).__name__, str(caught)]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        os.write(write, json.dumps({"error": error, "peak_kib": peak}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        print(stream.read() or json.dumps({"error": ["child died", ""], "peak_kib": -1}))
    os.wait()
"""


@pytest.fixture(scope="module")
def forged_loads(tmp_path_factory) -> list[dict]:
    """load_checkpoint of each FORGED_CONFIGS file, measured in one fresh interpreter (this
    process's all-time peak RSS, set by earlier tests, could not move)."""
    folder = tmp_path_factory.mktemp("forged")
    saved = edge_un.save_checkpoint(trained_small_model("vit", "un"), folder / "vit.safetensors")
    paths = []
    for index, forged in enumerate(FORGED_CONFIGS):
        header = _header(saved)
        header["arguments"].update(forged)
        paths.append(str(_rewrite(saved, folder / f"forged{index}.safetensors", header=header)))
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_FRESH_PROCESS, *paths],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize("index", range(len(FORGED_CONFIGS)))
def test_forged_config_is_refused_before_allocating(forged_loads, index: int) -> None:
    load = forged_loads[index]
    assert load["error"] is not None, FORGED_CONFIGS[index]
    kind, message = load["error"]
    assert kind in ("TensorMismatchError", "ConfigMismatchError"), load
    assert message.startswith(f"forged{index}.safetensors: ") and "\n" not in message
    assert 0 <= load["peak_kib"] < 256 * 1024, load  # the load itself took < 256 MiB


def test_config_with_arguments_the_architecture_does_not_take(tmp_path: Path, saved) -> None:
    header = _header(saved)
    header["arguments"]["__class__"] = "os.system"
    with pytest.raises(edge_un.ConfigMismatchError, match=r"takes no argument.*__class__"):
        edge_un.load_checkpoint(_rewrite(saved, tmp_path / "args.safetensors", header=header))


def test_save_refuses_models_it_cannot_rebuild(tmp_path: Path) -> None:
    with pytest.raises(edge_un.CheckpointError, match=r"not an edge_un architecture"):
        edge_un.save_checkpoint(torch.nn.Linear(2, 2), tmp_path / "x.safetensors")
