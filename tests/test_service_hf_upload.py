"""A Hugging Face save_pretrained directory uploaded as one .zip: checked like every upload.

Each case goes through ``service.server.intake.check_files`` (what the route runs after
streaming the files to disk), as ``tests/test_service_uploads.py`` does for the corpus: a good
archive becomes the model's own directory with only ``config.json`` and the safetensors in it; a
traversal, a symbolic link, a pickle-only directory, a LayerNorm model, custom code or two
models in one archive are 422 with what was wrong, and nothing of theirs is extracted. The live
server's run of a zipped directory is in ``tests/test_service_e2e.py``.
"""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from edge_un import examples
from service.errors import UploadRejected
from service.server import intake
from service.server.http_status import status_of
from service.upload_layout import HF_DIRECTORY

UN = "hf-vit-mnist-un"


def zipped(
    path: Path,
    name: str = UN,
    *,
    folder: str = "my-vit/",
    extra: dict[str, bytes] | None = None,
    config: dict | None = None,
    weights: bool = True,
) -> Path:
    """A bundled HF example zipped as ``zip -r`` does (under ``folder``), with ``extra``
    members (name -> bytes, placed as given) and optionally another config."""
    source = examples.path(name)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        text = json.dumps(config) if config is not None else (source / "config.json").read_text()
        archive.writestr(f"{folder}config.json", text)
        if weights:
            archive.write(source / "model.safetensors", f"{folder}model.safetensors")
        for member, data in (extra or {}).items():
            archive.writestr(member, data)
    return path


def check(archive: Path) -> str:
    """The route's checks on an upload directory holding this archive as 'model'."""
    dest = archive.parent / "upload"
    dest.mkdir()
    (dest / "model").write_bytes(archive.read_bytes())
    form = intake.Form(labels={"model": archive.name}, sizes={"model": archive.stat().st_size})
    return intake.check_files(form, dest).format


def test_a_zipped_directory_becomes_the_model_directory(tmp_path: Path) -> None:
    junk = {"my-vit/tokenizer.json": b"{}", "my-vit/README.md": b"# mine", "notes.txt": b"x"}
    archive = zipped(tmp_path / "my-vit.zip", extra=junk)
    assert check(archive) == "hf"
    stored = tmp_path / "upload" / HF_DIRECTORY
    assert sorted(p.name for p in stored.iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "upload" / "model").exists()
    source = examples.path(UN) / "model.safetensors"
    assert (stored / "model.safetensors").read_bytes() == source.read_bytes()


def test_a_directory_zipped_from_inside_works_too(tmp_path: Path) -> None:
    assert check(zipped(tmp_path / "flat.zip", folder="")) == "hf"


def _with_symlink(path: Path) -> Path:
    zipped(path)
    with zipfile.ZipFile(path, "a") as archive:
        link = zipfile.ZipInfo("my-vit/weights.safetensors")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/passwd")
    return path


def _config(name: str = UN, **changes: object) -> dict:
    config = json.loads((examples.path(name) / "config.json").read_text())
    return {**config, **changes}


CASES = {
    "traversal": (
        lambda p: zipped(p, extra={"../../evil.safetensors": b"x"}), "out of the archive"
    ),
    "absolute": (lambda p: zipped(p, extra={"/etc/cron.d/x": b"x"}), "absolute path"),
    "symlink": (_with_symlink, "symbolic link"),
    "pickle-only": (
        lambda p: zipped(p, weights=False, extra={"my-vit/pytorch_model.bin": b"\x80\x04."}),
        "pytorch_model.bin, which edge-un never opens",
    ),
    "layernorm": (lambda p: zipped(p, "hf-vit-mnist-ln"), "edge-un migrate dir"),
    "plain-hf-config": (
        lambda p: zipped(p, config={k: v for k, v in _config().items() if k != "edge_un"}),
        "keeps its layernorms",
    ),
    "custom-code": (
        lambda p: zipped(p, config=_config(auto_map={"AutoModel": "evil.Model"})),
        "custom code",
    ),
    "two-models": (
        lambda p: zipped(p, extra={"other/config.json": b"{}"}),
        "one save_pretrained directory",
    ),
    "config-not-json": (lambda p: zipped(p, config=None) and _replace_config(p), "not json"),
    "weights-not-the-config": (
        lambda p: zipped(p, config=_config(hidden_size=32)),
        "does not load",
    ),
}  # fmt: skip


def _replace_config(path: Path) -> Path:
    source = path.with_suffix(".tmp")
    path.rename(source)
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(path, "w") as new:
        for info in old.infolist():
            data = b"{not json" if info.filename.endswith("config.json") else old.read(info)
            new.writestr(info, data)
    source.unlink()
    return path


def test_a_family_the_converter_cannot_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    """An audio classifier (UN, loads fine) takes ``input_values``: the converter traces image
    and text classifiers; refused at upload with that one line, no traceback, no codes."""
    transformers = pytest.importorskip("transformers")
    import edge_un

    config = transformers.Wav2Vec2Config(
        vocab_size=10, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
        num_labels=2, classifier_proj_size=8,
    )  # fmt: skip
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    edge_un.swap_layernorm(model, kind="un")
    edge_un.save_pretrained(model, tmp_path / "audio")
    archive = tmp_path / "audio.zip"
    with zipfile.ZipFile(archive, "w") as zipped_dir:
        for name in ("config.json", "model.safetensors"):
            zipped_dir.write(tmp_path / "audio" / name, f"audio/{name}")
    with pytest.raises(UploadRejected) as caught:
        check(archive)
    detail = caught.value.detail
    assert status_of(caught.value) == 422 and caught.value.title == "Unsupported model"
    assert detail.startswith("Wav2Vec2ForSequenceClassification takes 'input_values'"), detail
    assert "\n" not in detail and "\x1b" not in detail and "Traceback" not in detail


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_archive_is_refused_with_its_reason(tmp_path: Path, case: str) -> None:
    make, fragment = CASES[case]
    archive = make(tmp_path / "model.zip")
    with pytest.raises(UploadRejected) as caught:
        check(archive)
    assert status_of(caught.value) == 422, caught.value.detail
    assert fragment in caught.value.detail.lower(), caught.value.detail
    extracted = tmp_path / "upload" / HF_DIRECTORY
    names = {p.name for p in extracted.iterdir()} if extracted.exists() else set()
    assert names <= {"config.json", "model.safetensors"}, names  # nothing else ever written
    assert not (tmp_path / "evil.safetensors").exists()
