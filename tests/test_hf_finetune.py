"""Hugging Face models on the training side: `edge-un migrate` / `finetune --int8-ready` take a
save_pretrained directory and write one; the data are named after the model's inputs.

Tiny random transformers models, one short epoch on a few hundred samples: the tests check the
directories, records, refusals and that named inputs stay together, not accuracy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import edge_un
from edge_un import data
from edge_un.finetune import FinetuneRecipe
from quant.report import Report
from service.cli import main as cli_main

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

ONE_EPOCH = ["--epochs", "1", "--batch-size", "32", "--quiet", "--threads", "1"]
PAD = 0
SEQ = 12  # token positions in the BERT npz


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, num_channels=1, patch_size=4, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=10,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config).eval()


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).eval()


def token_batch(count: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids padded at the end to lengths 3..SEQ, their mask, and labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 50, size=(count, SEQ))
    lengths = rng.integers(3, SEQ + 1, size=count)
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    ids[~mask] = PAD
    return {"input_ids": ids, "attention_mask": mask.astype(np.int64),
            "labels": (lengths > SEQ // 2).astype(np.int64)}  # fmt: skip


def only_un_norms(model: nn.Module) -> bool:
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm | edge_un.OfflineNorm)]
    return bool(norms) and all(isinstance(m, edge_un.UnifiedNorm) for m in norms)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def reported(out: str, name: str) -> float:
    """A score from the CLI's last line, as printed (4 decimals)."""
    match = re.search(rf"{name} (\d\.\d{{4}})", out.strip().splitlines()[-1])
    assert match, out
    return float(match.group(1))


@torch.no_grad()
def predictions(model: nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
    return model(**inputs).logits.argmax(-1)


def share(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).double().mean())


# -- sources ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit_dir(digits: data.Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LayerNorm ViT whose edge_un record names its data set (digits), as the bundled hf-*
    examples do."""
    directory = tmp_path_factory.mktemp("sources") / "vit-ln"
    metadata = {
        "dataset": "digits", "split": digits.split, "preprocessing": digits.preprocessing,
        "model_inputs": {"pixel_values": "the preprocessed images"}, "test_accuracy": 0.1,
        "command": "made by the test",
    }  # fmt: skip
    return edge_un.save_pretrained(tiny_vit(), directory, metadata=metadata)


@pytest.fixture(scope="module")
def vit_npz(digits: data.Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    x, y = digits.part("train")
    vx, vy = digits.part("val")
    path = tmp_path_factory.mktemp("npz") / "digits.npz"
    np.savez(path, pixel_values=x[:320].numpy(), labels=y[:320].numpy(),
             val_pixel_values=vx[:100].numpy(), val_labels=vy[:100].numpy())  # fmt: skip
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LayerNorm BERT saved by transformers alone (no edge_un record, no data set)."""
    directory = tmp_path_factory.mktemp("sources") / "bert-ln"
    tiny_bert().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bert_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    train, val = token_batch(320, seed=1), token_batch(100, seed=2)
    path = tmp_path_factory.mktemp("npz") / "tokens.npz"
    np.savez(path, **train, **{f"val_{name}": array for name, array in val.items()})
    return path


# -- round trips -----------------------------------------------------------------------------


def test_vit_directory_migrates_and_records_the_finetune(vit_dir, vit_npz, tmp_path, capsys):
    out = tmp_path / "vit-un"
    argv = ["migrate", str(vit_dir), "--npz", str(vit_npz), *ONE_EPOCH, "--out", str(out)]
    code, stdout, err = run(argv, capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    student, info = edge_un.load_pretrained(out)
    assert info.architecture == "ViTForImageClassification" and info.norm_kind == "un"
    assert only_un_norms(student)
    meta = info.metadata
    source = edge_un.load_pretrained(vit_dir)[1].metadata
    for key in ("dataset", "split", "preprocessing", "model_inputs"):  # the converter's data
        assert meta[key] == source[key]
    assert meta["finetune"]["purpose"] == "migrate"
    assert meta["finetune"]["source"] == str(vit_dir)
    assert meta["finetune"]["data"] == "digits.npz (320 samples: pixel_values)"
    assert [h["epoch"] for h in meta["finetune"]["history"]] == [1]
    assert meta["recipe"]["epochs"] == 1 and meta["recipe"]["batch_size"] == 32
    assert meta["source"] == {"path": str(vit_dir), "test_accuracy": 0.1,
                              "command": "made by the test"}  # fmt: skip
    assert meta["command"].startswith(f"edge-un migrate {vit_dir} --kind un --npz ")

    # What the CLI reported is what the written directory computes.
    teacher, _ = edge_un.load_pretrained(vit_dir)
    with np.load(vit_npz) as arrays:
        pixels, labels = torch.from_numpy(arrays["val_pixel_values"]), arrays["val_labels"]
    mine = predictions(student, pixel_values=pixels)
    assert share(mine, predictions(teacher, pixel_values=pixels)) == pytest.approx(
        meta["val_agreement_with_teacher"], abs=1e-12
    )
    assert share(mine, torch.from_numpy(labels)) == pytest.approx(meta["val_accuracy"], abs=1e-12)
    assert reported(stdout, "validation agreement with the teacher") == round(
        meta["val_agreement_with_teacher"], 4
    )

    # ... and the written directory converts as it is (its recorded data set: digits' test split)
    code, _, err = run(["convert", str(out), "--target", "cpu", "-o", str(tmp_path / "int8")],
                       capsys)  # fmt: skip
    assert code == 0, err
    report = Report.read(tmp_path / "int8" / "report.json")
    assert report.model.source_format == "hf" and report.model.inputs[0].name == "pixel_values"
    norms = report.fold["norms"]
    assert len(norms) == 5 and all(n["action"] != "scale_shift" for n in norms), norms
    assert report.targets["cpu"].status != "failed" and report.targets["cpu"].drift is not None


def test_int8_ready_on_a_directory_uses_its_recorded_data_set(vit_dir, vit_npz, tmp_path, capsys):
    migrated = tmp_path / "vit-un"
    argv = ["migrate", str(vit_dir), "--npz", str(vit_npz), *ONE_EPOCH, "--out", str(migrated)]
    assert run(argv, capsys)[0] == 0
    ready = tmp_path / "vit-un-int8"
    argv = ["finetune", str(migrated), "--int8-ready", *ONE_EPOCH, "--out", str(ready)]
    code, stdout, err = run(argv, capsys)  # no --npz: the digits split recorded in config.json
    assert code == 0, err

    model, info = edge_un.load_pretrained(ready)
    assert only_un_norms(model)
    meta = info.metadata
    assert meta["finetune"]["purpose"] == "int8-ready" and meta["finetune"]["method"] == "decay"
    assert meta["finetune"]["data"].startswith("digits (train ")
    assert meta["dataset"] == "digits" and meta["source"]["path"] == str(migrated)
    inputs, labels = data.checkpoint_split(info, "test")
    accuracy = share(predictions(model, pixel_values=inputs), labels)
    assert accuracy == pytest.approx(meta["test_accuracy"], abs=1e-12)
    assert reported(stdout, "test accuracy") == round(accuracy, 4)
    assert f"wrote {ready} (test accuracy" in stdout


def test_bert_migrates_from_named_arrays(bert_dir, bert_npz, tmp_path, capsys):
    out = tmp_path / "bert-un"
    argv = ["migrate", str(bert_dir), "--npz", str(bert_npz), *ONE_EPOCH, "--out", str(out)]
    code, stdout, err = run(argv, capsys)
    assert code == 0, err

    student, info = edge_un.load_pretrained(out)
    assert info.architecture == "BertForSequenceClassification"
    assert only_un_norms(student)
    meta = info.metadata
    assert meta["finetune"]["data"] == "tokens.npz (320 samples: input_ids, attention_mask)"
    assert "dataset" not in meta  # the source recorded none
    teacher, _ = edge_un.load_pretrained(bert_dir)
    with np.load(bert_npz) as arrays:
        feeds = {name: torch.from_numpy(arrays[f"val_{name}"])
                 for name in ("input_ids", "attention_mask")}  # fmt: skip
        labels = torch.from_numpy(arrays["val_labels"])
    mine = predictions(student, **feeds)
    assert share(mine, predictions(teacher, **feeds)) == pytest.approx(
        meta["val_agreement_with_teacher"], abs=1e-12
    )
    assert share(mine, labels) == pytest.approx(meta["val_accuracy"], abs=1e-12)
    assert reported(stdout, "validation accuracy") == round(meta["val_accuracy"], 4)


def test_named_inputs_stay_together_through_the_engine(bert_npz) -> None:
    """Every forward (recalibration, teacher, student, validation) gets each sample's ids with
    its own mask, through shuffling and batching; make_int8_ready takes the same inputs."""
    with np.load(bert_npz) as arrays:
        inputs = {name: torch.from_numpy(arrays[name]) for name in ("input_ids", "attention_mask")}
        labels = torch.from_numpy(arrays["labels"])
    calls: list[bool] = []

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        calls.append(not args and torch.equal(mask, (ids != PAD).long()))

    teacher = tiny_bert()
    handle = teacher.register_forward_pre_hook(check, with_kwargs=True)  # copied to the student
    recipe = FinetuneRecipe(epochs=1, batch_size=32, lr=1e-3)
    result = edge_un.migrate(teacher, inputs, labels, recipe=recipe, progress=False, log=None)
    assert len(calls) > 2 * 10 and all(calls)  # 10 training steps, each teacher + student
    ready = edge_un.make_int8_ready(
        result.model, inputs, labels, method="range", target=4.0, recipe=recipe,
        progress=False, log=None,
    )  # fmt: skip
    handle.remove()
    assert all(calls) and ready.extras["ranges_after"]
    assert only_un_norms(ready.model)


def tiny_deit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.DeiTConfig(
        image_size=8, num_channels=1, patch_size=4, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=3,
    )  # fmt: skip
    return transformers.DeiTForImageClassification(config), {
        "pixel_values": torch.randn(96, 1, 8, 8)
    }


def tiny_distilbert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.DistilBertConfig(
        vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=16,
        num_labels=3,
    )  # fmt: skip
    batch = token_batch(96, seed=3)
    return transformers.DistilBertForSequenceClassification(config), {
        name: torch.from_numpy(batch[name]) for name in ("input_ids", "attention_mask")
    }


@pytest.mark.parametrize("build", [tiny_deit, tiny_distilbert])
def test_deit_and_distilbert_migrate_and_get_int8_ready(build, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, inputs = build()
    labels = torch.randint(0, 3, (96,))
    recipe = FinetuneRecipe(epochs=1, batch_size=32)
    migrated = edge_un.migrate(
        model.eval(), inputs, labels, recipe=recipe, progress=False, log=None
    )
    assert migrated.extras["swapped"] == 5 and only_un_norms(migrated.model)
    # decay finds the residual branches' output projections under this model's own names
    ready = edge_un.make_int8_ready(
        migrated.model, inputs, labels, method="decay", recipe=recipe, progress=False, log=None
    )
    edge_un.save_pretrained(ready.model, tmp_path / "m")
    loaded, info = edge_un.load_pretrained(tmp_path / "m")
    assert info.norm_kind == "un" and only_un_norms(loaded)
    with torch.no_grad():
        assert torch.equal(ready.model(**inputs).logits, loaded(**inputs).logits)


# -- refusals --------------------------------------------------------------------------------


def _pickle_only(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")


def _no_config(directory: Path) -> None:
    (directory / "config.json").unlink()


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        (_pickle_only, ["only pytorch_model.bin", "save_pretrained(dir, safe_serialization=True)"]),
        (_no_config, ["no config.json; not a Hugging Face model"]),
    ],
)
def test_unsafe_or_incomplete_directories_are_refused(
    bert_dir: Path, bert_npz: Path, tmp_path: Path, capsys, tamper: Callable[[Path], None],
    words: list[str],
) -> None:  # fmt: skip
    source = tmp_path / "source"
    source.mkdir()
    for file in bert_dir.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    tamper(source)
    out = tmp_path / "out"
    code, _, err = run(["migrate", str(source), "--npz", str(bert_npz), *ONE_EPOCH,
                        "--out", str(out)], capsys)  # fmt: skip
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert all(word in err for word in words), err
    assert not out.exists()


VIT_TAKES = "expected pixel_values float (N, 1, 8, 8), labels int (N,) (optional)"
BERT_TAKES = "expected input_ids int (N, L<=16), attention_mask int (N, L) (optional)"


@pytest.mark.parametrize(
    ("model", "arrays", "words"),
    [
        ("vit", {"labels": np.zeros(4, np.int64)}, ["no 'pixel_values' array", VIT_TAKES]),
        ("vit", {"images": np.zeros((4, 1, 8, 8), np.float32)},
         ["unexpected array 'images'", VIT_TAKES]),
        ("vit", {"pixel_values": np.zeros((4, 1, 9, 9), np.float32)},
         ["'pixel_values' has shape (4, 1, 9, 9)", VIT_TAKES]),
        ("vit", {"pixel_values": np.zeros((4, 1, 8, 8), np.uint8)},
         ["'pixel_values' has dtype uint8; pixel_values holds floats", VIT_TAKES]),
        ("vit", {"pixel_values": np.zeros((4, 1, 8, 8), np.float32), "labels": np.zeros(3, int)},
         ["mismatched sample counts (labels 3, pixel_values 4)"]),
        ("vit", {"pixel_values": np.zeros((4, 1, 8, 8), np.float32),
                 "val_labels": np.zeros(4, np.int64)},
         ["'val_labels' without 'val_pixel_values'"]),
        ("bert", {"input_ids": np.ones((4, SEQ), np.int64),
                  "attention_mask": np.ones((4, SEQ - 1), np.int64)},
         ["'attention_mask' has shape (4, 11), not that of 'input_ids' (4, 12)", BERT_TAKES]),
        ("bert", {"input_ids": np.ones((4, 20), np.int64)},
         ["'input_ids' has 20 positions, the model takes at most 16"]),
        ("bert", {"input_ids": np.full((4, SEQ), 50)},
         ["'input_ids' holds 50 to 50, outside [0, 50)"]),
        ("bert", {"input_ids": np.ones((4, SEQ), np.int64), "val_input_ids": np.ones((3, SEQ)),
                  "val_labels": np.zeros(3, np.int64)},
         ["'val_input_ids' has dtype float64; input_ids holds integers"]),
    ],
)  # fmt: skip
def test_bad_npz_is_one_line_naming_the_array(
    vit_dir, bert_dir, tmp_path, capsys, model: str, arrays: dict, words: list[str]
) -> None:
    npz = tmp_path / "bad.npz"
    np.savez(npz, **arrays)
    out = tmp_path / "out"
    source = vit_dir if model == "vit" else bert_dir
    code, _, err = run(["migrate", str(source), "--npz", str(npz), *ONE_EPOCH,
                        "--out", str(out)], capsys)  # fmt: skip
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("edge-un migrate: error: bad.npz: ")
    assert all(word in err for word in words), err
    assert not out.exists()


def test_a_directory_without_data_or_a_file_out_is_refused(bert_dir, bert_npz, tmp_path, capsys):
    code, _, err = run(["migrate", str(bert_dir), *ONE_EPOCH, "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "records no data set: pass --npz FILE with its inputs (input_ids, attention_mask" in err
    code, _, err = run(["migrate", str(bert_dir), "--npz", str(bert_npz), *ONE_EPOCH,
                        "--out", str(tmp_path / "x.safetensors")], capsys)  # fmt: skip
    assert code == 1 and "is written as a directory" in err
    code, _, err = run(["migrate", str(bert_dir), "--npz", str(bert_npz), *ONE_EPOCH,
                        "--out", str(bert_dir)], capsys)  # fmt: skip
    assert code == 1 and "is the source itself" in err
