"""Hugging Face models with edge_un norms: save/load directories, refusals, bundled examples."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import edge_un
from edge_un import data, examples
from edge_un.hf import ClassifierLogits, TransformersUnavailableError
from edge_un.norms import NORM_CLASSES, UnifiedNorm

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
BUNDLED = {
    # name: (transformers class, norm kind, data set, UN momentum)
    "hf-vit-mnist-ln": ("ViTForImageClassification", "ln", "mnist", None),
    "hf-vit-mnist-un": ("ViTForImageClassification", "un", "mnist", 0.5),
    "hf-bert-rt-ln": ("BertForSequenceClassification", "ln", "rt", None),
    "hf-bert-rt-un": ("BertForSequenceClassification", "un", "rt", 0.9),
}


def tiny_vit(kind: str | None = "un", steps: int = 6, **norm_kwargs: object) -> torch.nn.Module:
    """A small ViT (LayerNorms swapped for ``kind``) trained a few steps, so that every norm
    buffer (running_var, windows, step counters) holds something other than its initial value."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, num_channels=1, patch_size=4, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=3,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config)
    if kind is not None:
        edge_un.swap_layernorm(model, kind=kind, **norm_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(steps):
        loss = model(pixel_values=torch.randn(8, 1, 8, 8)).logits.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


@pytest.fixture(scope="module")
def saved_un_vit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "un-vit"
    edge_un.save_pretrained(
        tiny_vit("un", momentum=0.5, warmup_iters=2), directory, metadata={"dataset": "mnist"}
    )
    return directory


@pytest.fixture
def un_dir(saved_un_vit: Path, tmp_path: Path) -> Path:
    """A fresh copy of a saved UN ViT directory, for a test to tamper with."""
    return Path(shutil.copytree(saved_un_vit, tmp_path / "un-vit"))


# -- round trip ------------------------------------------------------------------------------


def test_un_round_trip_is_bit_identical(tmp_path: Path) -> None:
    model = tiny_vit("un", momentum=0.5, warmup_iters=2)
    assert int(model.vit.layernorm.num_steps) == 6  # the buffers really moved
    metadata = {"dataset": "mnist", "split": {"seed": 0}, "test_accuracy": 0.5}
    edge_un.save_pretrained(model, tmp_path / "m", metadata=metadata)
    loaded, info = edge_un.load_pretrained(tmp_path / "m")

    assert not loaded.training
    pixels = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels).logits, loaded(pixel_values=pixels).logits)
    saved, restored = model.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == restored[name].dtype, name
        assert torch.equal(tensor, restored[name]), name
    norms = [m for m in loaded.modules() if isinstance(m, UnifiedNorm)]
    assert len(norms) == 5  # 2 per block + the final one
    assert {(m.momentum, m.warmup_iters, m.eps) for m in norms} == {(0.5, 2, 1e-12)}
    assert (info.architecture, info.norm_kind, info.metadata) == (
        "ViTForImageClassification", "un", metadata,
    )  # fmt: skip
    assert info.norm_kwargs["momentum"] == 0.5


def test_config_json_records_the_norms_and_metadata(un_dir: Path) -> None:
    config = json.loads((un_dir / "config.json").read_text())
    record = config["edge_un"]
    assert record["edge_un_version"] == edge_un.__version__
    assert record["metadata"] == {"dataset": "mnist"}
    norm = record["norm"]
    assert norm["kind"] == "un"
    assert norm["kwargs"] == {
        "window_size": 4, "warmup_iters": 2, "outlier_filtration": True, "momentum": 0.5,
        "eps": 1e-12,
    }  # fmt: skip
    assert norm["modules"] == [
        "vit.layers.0.layernorm_before", "vit.layers.0.layernorm_after",
        "vit.layers.1.layernorm_before", "vit.layers.1.layernorm_after", "vit.layernorm",
    ]  # fmt: skip
    assert config["architectures"] == ["ViTForImageClassification"]
    assert sorted(p.name for p in un_dir.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(un_dir / "model.safetensors"), "pt") as handle:
        assert "vit.layernorm.window_x2" in handle.keys()  # noqa: SIM118


@pytest.mark.parametrize("kind", [k for k in NORM_CLASSES if k != "un"])
def test_every_norm_kind_round_trips(tmp_path: Path, kind: str) -> None:
    model = tiny_vit(kind, steps=3)
    edge_un.save_pretrained(model, tmp_path / kind)
    loaded, info = edge_un.load_pretrained(tmp_path / kind)
    assert info.norm_kind == kind
    assert {type(m) for m in loaded.modules() if hasattr(m, "kind")} == {NORM_CLASSES[kind]}
    pixels = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels).logits, loaded(pixel_values=pixels).logits)


def test_plain_layernorm_model_loads_through_from_pretrained(tmp_path: Path) -> None:
    model = tiny_vit(None, steps=2)
    edge_un.save_pretrained(model, tmp_path / "ln", metadata={"test_accuracy": 0.25})
    loaded, info = edge_un.load_pretrained(tmp_path / "ln")
    assert type(loaded.vit.layernorm) is torch.nn.LayerNorm
    assert (info.norm_kind, info.metadata) == ("ln", {"test_accuracy": 0.25})
    pixels = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels).logits, loaded(pixel_values=pixels).logits)
    # a directory saved by transformers alone (no edge_un record) loads too
    model.save_pretrained(tmp_path / "hf-only")
    assert edge_un.load_pretrained(tmp_path / "hf-only")[1].metadata == {}


def test_weights_under_the_models_own_names_load_too(tmp_path: Path) -> None:
    # save_pretrained writes transformers' "original format" (ViT's q_proj is stored as
    # attention.query); save_original_format=False keeps the module's own names. Both load.
    model = tiny_vit("un", steps=3, warmup_iters=1)
    edge_un.save_pretrained(model, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as handle:
        assert "vit.encoder.layer.0.attention.attention.query.weight" in handle.keys()  # noqa: SIM118
    own = {name: t.contiguous() for name, t in model.state_dict().items()}
    assert "vit.layers.0.attention.q_proj.weight" in own
    save_file(own, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = edge_un.load_pretrained(tmp_path / "m")
    pixels = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels).logits, loaded(pixel_values=pixels).logits)


def test_save_refuses_what_it_cannot_record(tmp_path: Path) -> None:
    from edge_un.models import VisionTransformer

    with pytest.raises(edge_un.CheckpointError, match="save_checkpoint") as error:
        edge_un.save_pretrained(VisionTransformer(img_size=8, patch_size=4), tmp_path / "x")
    one_line(error)
    with pytest.raises(edge_un.CheckpointError, match="NaN") as error:
        edge_un.save_pretrained(tiny_vit(steps=0), tmp_path / "y", metadata={"acc": float("nan")})
    one_line(error)


# -- refusals --------------------------------------------------------------------------------


class CreatesFileWhenUnpickled:
    """Unpickling this calls open(path, "w"): the file appears iff the pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_pickle_only_directory_is_refused_and_never_unpickled(tmp_path: Path, un_dir: Path) -> None:
    marker = tmp_path / "unpickled.txt"
    payload = pickle.dumps({"state": CreatesFileWhenUnpickled(marker)})
    # The payload is live: loading it elsewhere does create its file.
    probe = tmp_path / "probe.txt"
    pickle.loads(pickle.dumps(CreatesFileWhenUnpickled(probe))).close()
    assert probe.is_file()

    (un_dir / "model.safetensors").unlink()
    (un_dir / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(edge_un.UnsafeCheckpointError) as error:
        edge_un.load_pretrained(un_dir)
    message = one_line(error)
    assert "pytorch_model.bin" in message
    assert "model.save_pretrained(dir, safe_serialization=True)" in message
    assert "trusts the file" in message
    assert not marker.exists()


Tamper = Callable[[dict[str, torch.Tensor]], str]


def _rewrite(directory: Path, change: Tamper) -> str:
    """Rewrite model.safetensors with ``change(tensors)`` applied; returns the changed name."""
    file = directory / "model.safetensors"
    with safe_open(str(file), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    name = change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return name


def _running_var(tensors: dict[str, torch.Tensor]) -> str:
    return next(name for name in sorted(tensors) if name.endswith("layernorm_after.running_var"))


def _drop(tensors: dict[str, torch.Tensor]) -> str:
    name = _running_var(tensors)
    del tensors[name]
    return name


def _reshape(tensors: dict[str, torch.Tensor]) -> str:
    name = "classifier.weight"
    tensors[name] = torch.zeros(4, 16)
    return name


def _poison(tensors: dict[str, torch.Tensor]) -> str:
    name = _running_var(tensors)
    tensors[name][3] = float("nan")
    return name


def _extra(tensors: dict[str, torch.Tensor]) -> str:
    tensors["vit.backdoor"] = torch.zeros(2)
    return "vit.backdoor"


@pytest.mark.parametrize(
    ("change", "error_type", "words"),
    [
        (_drop, edge_un.TensorMismatchError, "missing"),
        (_reshape, edge_un.TensorMismatchError, "shape [4, 16]"),
        (_poison, edge_un.NonFiniteTensorError, "NaN"),
        (_extra, edge_un.TensorMismatchError, "unexpected"),
    ],
)
def test_tampered_weights_are_refused(
    un_dir: Path, change: Tamper, error_type: type, words: str
) -> None:
    name = _rewrite(un_dir, change)
    with pytest.raises(error_type) as error:
        edge_un.load_pretrained(un_dir)
    message = one_line(error)
    assert name in message and words in message


def test_broken_directories_are_refused_with_one_line(tmp_path: Path, un_dir: Path) -> None:
    cases = []
    with pytest.raises(edge_un.NotACheckpointError) as error:
        edge_un.load_pretrained(tmp_path / "nowhere")
    cases.append(error)
    config = json.loads((un_dir / "config.json").read_text())
    config["architectures"] = ["EvilModelFromTheHub"]
    (un_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(edge_un.UnknownArchitectureError, match="remote code") as error:
        edge_un.load_pretrained(un_dir)
    cases.append(error)
    truncated = un_dir / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(edge_un.NotACheckpointError, match="truncated") as error:
        edge_un.load_pretrained(un_dir)
    cases.append(error)
    for error in cases:
        one_line(error)


def test_config_that_disagrees_with_the_weights_is_refused(un_dir: Path) -> None:
    config = json.loads((un_dir / "config.json").read_text())
    config["edge_un"]["norm"]["modules"].append("vit.layers.0.mlp")
    (un_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(edge_un.ConfigMismatchError, match=r"vit\.layers\.0\.mlp") as error:
        edge_un.load_pretrained(un_dir)
    one_line(error)
    config["edge_un"]["norm"]["modules"].pop()
    config["hidden_size"] = 32
    (un_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(edge_un.TensorMismatchError, match="expects") as error:
        edge_un.load_pretrained(un_dir)
    one_line(error)


# -- edge_un without transformers ------------------------------------------------------------


def test_edge_un_imports_without_transformers() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # any import of it now fails\n"
        "import edge_un\n"
        "from edge_un import examples\n"
        "try:\n"
        "    edge_un.load_pretrained(examples.path('hf-vit-mnist-un'))\n"
        "except edge_un.CheckpointError as error:\n"
        "    print(type(error).__name__, '|', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"{TransformersUnavailableError.__name__} | Hugging Face models need transformers; "
        "run: pip install edge-un[hf]"
    )


def test_importing_edge_un_does_not_import_transformers() -> None:
    code = "import sys, edge_un, edge_un.hf; print('transformers' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.stdout.strip() == "False", result.stderr


# -- bundled examples ------------------------------------------------------------------------


def test_bundled_hf_examples_are_listed_and_small() -> None:
    assert examples.names(hf=True) == list(BUNDLED)
    assert not set(examples.names()) & set(BUNDLED)  # the checkpoint list stays as it was
    sizes = [f.stat().st_size for n in BUNDLED for f in examples.path(n).iterdir()]
    assert sum(sizes) < 8 * 2**20


@pytest.mark.parametrize("name", list(BUNDLED))
def test_bundled_hf_example_reaches_its_recorded_test_accuracy(name: str) -> None:
    architecture, kind, dataset, momentum = BUNDLED[name]
    model, info = edge_un.load_pretrained(examples.path(name))
    assert (info.architecture, info.norm_kind, info.metadata["dataset"]) == (
        architecture, kind, dataset,
    )  # fmt: skip
    assert info.metadata["split"]["seed"] == 0
    assert info.metadata["command"].endswith(f"--out edge_un/examples/{name}")
    if momentum is not None:
        norms = [m for m in model.modules() if isinstance(m, UnifiedNorm)]
        assert norms and {m.momentum for m in norms} == {momentum}
        assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    inputs, labels = data.checkpoint_split(info, "test")
    assert len(labels) == {"mnist": 1000, "rt": 2562}[dataset]  # the whole held-out split
    classifier = ClassifierLogits(model)
    with torch.no_grad():
        predictions = torch.cat([classifier(inputs[i : i + 500]).argmax(-1)
                                 for i in range(0, len(inputs), 500)])  # fmt: skip
    accuracy = (predictions == labels).double().mean().item()
    assert accuracy == pytest.approx(info.metadata["test_accuracy"], abs=1e-9)
    assert accuracy >= {"mnist": 0.95, "rt": 0.72}[dataset]


def test_the_example_builder_writes_a_directory_that_scores_what_it_records(tmp_path) -> None:
    """``python -m tools.make_hf_examples`` (what regenerates the hf-* examples), cut to
    one epoch: it trains through edge_un's training loop, writes a directory that loads back
    with UN warm-up scaled to the run, and exits 0 only if the reloaded model scores the test
    accuracy it recorded."""
    out = tmp_path / "hf-vit-un"
    argv = ["--model", "vit", "--norm", "un", "--epochs", "1", "--threads", "1", "--no-progress"]
    command = [sys.executable, "-m", "tools.make_hf_examples", *argv, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    model, info = edge_un.load_pretrained(out)
    meta = info.metadata
    assert result.stdout.strip().endswith(
        f"wrote {out} (test accuracy {meta['test_accuracy']:.4f}, un)"
    )
    assert meta["command"].startswith("python -m tools.make_hf_examples --model vit --norm un")
    assert [h["epoch"] for h in meta["history"]] == [1]
    assert meta["recipe"]["total_steps"] == 55  # 3500 training images in batches of 64
    assert meta["recipe"]["augmentation"] == "random shift up to 1 px"
    assert info.norm_kwargs == {**info.norm_kwargs, "warmup_iters": 4, "momentum": 0.5}  # 8 %
    norms = [m for m in model.modules() if isinstance(m, UnifiedNorm)]
    assert len(norms) == 9 and {(m.warmup_iters, m.momentum) for m in norms} == {(4, 0.5)}
    assert meta["test_accuracy"] > 0.15  # chance is 0.1; 0.21 here after one epoch
