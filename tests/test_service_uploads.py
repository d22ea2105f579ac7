"""Upload handling of the service: streaming with a limit, file-name labels, content checks.

Every case of the bad-upload corpus (``tests/upload_corpus.py``) goes through the same steps a
route takes (label, stream to disk, parse targets, ``service.server.intake.check_files``: config,
model with its external data, data against the model's inputs) and must stop with its status
and message; good uploads of every format pass. The HTTP tests replay the same corpus against
a real server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_un import examples
from quant.errors import UnknownTargetError
from quant.targets import parse_targets
from service.errors import UploadRejected
from service.server import intake
from service.server.http_status import status_of
from service.server.uploads.checks import (
    DEFAULT_MAX_PARAMETERS,
    implied_parameters,
    inspect_model,
    inspect_npz,
)
from service.server.uploads.checks import inspect_config as read_config
from service.server.uploads.files import data_file_name, safe_label, save_upload
from service.server.uploads.model_upload import check_size
from service.settings import Settings

from .upload_corpus import (
    CASE_NAMES,
    GOOD_MODEL,
    UploadCase,
    bad_cases,
    example_config,
    forged_config,
    good_calib,
    good_cases,
    npz_bytes,
    tiny_onnx,
    with_external_data,
)

LIMIT = 4 << 20  # every good example fits


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[UploadCase]:
    return bad_cases(tmp_path_factory.mktemp("uploads"), LIMIT)


async def _chunks(path: Path, size: int = 64 << 10) -> AsyncIterator[bytes]:
    with path.open("rb") as stream:
        while block := stream.read(size):
            yield block


def submit(case: UploadCase, workdir: Path) -> tuple[int, str]:
    """What a route does with an upload: (202, "") if accepted, else (status, detail)."""
    workdir.mkdir(parents=True, exist_ok=True)
    form = intake.Form()
    try:
        for field, (name, source) in case.files.items():
            form.labels[field] = safe_label(name, field)
            dest = workdir / field  # server-chosen names
            form.sizes[field] = asyncio.run(save_upload(_chunks(source), dest, LIMIT, field))
        for name, source in case.data_files:  # stored under the names the model references
            stored = data_file_name(name, intake.DATA_FIELD, intake.STORED_NAMES)
            size = asyncio.run(save_upload(_chunks(source), workdir / stored, LIMIT, "model_data"))
            form.data_files[stored] = size
        parse_targets(case.form.get("targets"))
        intake.check_files(form, workdir)
    except UploadRejected as error:
        return status_of(error), error.detail
    except UnknownTargetError as error:
        return 422, str(error)
    return 202, ""


def test_corpus_covers_the_issue(corpus: list[UploadCase]) -> None:
    assert [case.name for case in corpus] == list(CASE_NAMES)
    required = {
        "pickle-payload-torch-zip", "truncated-safetensors", "config-mismatch",
        "forged-config-1e9-parameters", "layernorm-model", "nan-weights", "oversize",
        "empty-model", "zip-bomb-model", "non-zip-pt2", "malformed-npz", "pickled-npz",
        "path-traversal-name", "unknown-target", "unknown-content",
    }  # fmt: skip
    assert required <= set(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_upload_is_refused_with_its_message(
    corpus: list[UploadCase], name: str, tmp_path: Path
) -> None:
    case = next(case for case in corpus if case.name == name)
    status, detail = submit(case, tmp_path)
    assert (status, case.fragment in detail.lower()) == (case.status, True), (case.name, detail)
    assert len(detail.splitlines()) == 1 and len(detail) < 600, detail
    if case.marker is not None:
        assert not case.marker.exists(), "the pickle payload ran"
    if status == 413:
        assert not (tmp_path / "model").exists(), "the partial upload was left on disk"


def test_payloads_are_live(corpus: list[UploadCase], tmp_path: Path) -> None:
    """The corpus' pickles really run code when unpickled unsafely (so the tests above could
    fail): load each in a child process the unsafe way and see the marker appear."""
    for case in corpus:
        if not case.name.startswith("pickle-payload"):
            continue
        assert case.marker is not None
        source = case.files["model"][1]
        loader = (
            f"import torch; torch.load({str(source)!r}, weights_only=False)"
            if case.name.endswith("torch-zip")
            else f"import pickle; pickle.load(open({str(source)!r}, 'rb'))"
        )
        subprocess.run([sys.executable, "-c", loader], check=False, capture_output=True)
        assert case.marker.exists(), f"{case.name}: the payload did not run when unpickled"
        case.marker.unlink()


def test_forged_config_is_refused_before_building(tmp_path: Path) -> None:
    config = forged_config(1e9)
    implied = implied_parameters(config)
    assert implied is not None and 0.9e9 < implied < 1.2e9
    limit = r"over the service limit of 200,000,000 \(EDGE_UN_MAX_PARAMETERS\)"
    with pytest.raises(UploadRejected, match=limit) as caught:
        inspect_model(examples.path(GOOD_MODEL), config)
    assert status_of(caught.value) == 422
    # Before building: 1e9 float32 weights would take 4 GB. Measured in a fresh process (its
    # peak RSS is its own; this one's is an all-time peak that earlier tests set), not by
    # wall-clock time, which a loaded machine stretches and a fast one shrinks.
    child = (
        "import json, resource, sys\n"
        "from edge_un import examples\n"
        "from service.server.uploads.checks import inspect_model\n"
        "from service.server.http_status import status_of\n"
        "from service.errors import UploadRejected\n"
        "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024\n"
        "before = peak()\n"
        "try:\n"
        "    inspect_model(examples.path(sys.argv[1]), json.loads(sys.argv[2]))\n"
        "except UploadRejected as error:\n"
        "    print(status_of(error), peak() - before)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child, GOOD_MODEL, json.dumps(config)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    status, grown_mb = map(int, result.stdout.split())
    assert status == 422 and grown_mb < 1000, (result.stdout, result.stderr[-2000:])


def test_a_config_larger_than_a_config_can_be_is_content_too_large(tmp_path: Path) -> None:
    """Over 1 MB of JSON is refused by its size before it is parsed: 413, as for a model over
    the upload limit."""
    big = tmp_path / "config"
    big.write_text('{"architecture": "vit", "pad": "' + "x" * (1 << 20) + '"}')
    with pytest.raises(UploadRejected) as caught:
        read_config(big)
    assert status_of(caught.value) == 413 and caught.value.title == "Config too large"
    assert f"{big.stat().st_size:,} bytes" in caught.value.detail


def test_implied_parameters_bound_the_real_count() -> None:
    """The estimate is a lower bound close to the truth, so the limit is about real size."""
    for name in ("vit-mnist-un", "text-rt-un"):
        upload = inspect_model(examples.path(name), None)
        implied = implied_parameters(example_config(name))
        assert upload.parameters is not None and implied is not None
        assert 0.9 * upload.parameters <= implied <= upload.parameters, name


def test_parameter_limit_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """EDGE_UN_MAX_PARAMETERS: a model over it is refused with the setting's name (and what to
    do); the default is what Settings and the checks use when nothing is set."""
    monkeypatch.setenv("EDGE_UN_MAX_PARAMETERS", "100000")
    assert Settings().max_parameters == 100_000
    monkeypatch.delenv("EDGE_UN_MAX_PARAMETERS")
    assert Settings().max_parameters == DEFAULT_MAX_PARAMETERS == 200_000_000
    with pytest.raises(UploadRejected) as caught:
        inspect_model(examples.path(GOOD_MODEL), None, max_parameters=100_000)
    assert status_of(caught.value) == 422
    assert "144,668 parameters, over the service limit of 100,000" in caught.value.detail
    assert "EDGE_UN_MAX_PARAMETERS" in caught.value.detail
    assert inspect_model(examples.path(GOOD_MODEL), None, max_parameters=144_668).parameters


@pytest.mark.parametrize(
    ("architecture", "arguments", "low", "high"),
    [
        # BERT-base: 12 x 768, MLP 3072, a 30,522-token vocabulary, 512 positions (110 M)
        ("TextTransformer", {"vocab_size": 30522, "max_len": 512}, 105e6, 115e6),
        # ViT-B/16 at 224 x 224 (86 M)
        ("VisionTransformer", {"img_size": 224, "patch_size": 16, "in_chans": 3}, 84e6, 88e6),
    ],
)
def test_default_limits_admit_the_boards_real_models(architecture, arguments, low, high) -> None:
    """The default parameter limit admits BERT-base and ViT-B/16, by the count their configs
    imply (nothing is built), and the default upload limit their fp32 weights."""
    base = {"dim": 768, "depth": 12, "heads": 12, "mlp_ratio": 4.0, "num_classes": 2}
    config = {"architecture": architecture, "arguments": {**base, **arguments}}
    implied = implied_parameters(config)
    assert implied is not None and low < implied < high, implied
    check_size(implied, "the config asks for a model of at least")  # the default limit
    fp32_bytes = 4 * implied
    assert fp32_bytes < 0.5 * Settings().max_upload_bytes  # room for the header, and to grow


@pytest.mark.parametrize("name", [n for n in examples.names() if not n.endswith("-ln")])
def test_bundled_un_examples_pass(name: str) -> None:
    upload = inspect_model(examples.path(name), None)
    assert (upload.format, upload.norm) == ("safetensors", "un")
    assert upload.parameters and upload.parameters > 100_000


def test_good_cases_pass(tmp_path: Path) -> None:
    for case in good_cases(tmp_path):
        assert submit(case, tmp_path / case.name) == (202, ""), case.name


def test_state_dict_with_config_passes(tmp_path: Path) -> None:
    pt = tmp_path / "sd"
    torch.save({"state_dict": dict(torch.load(_example_pt(tmp_path), weights_only=True))}, pt)
    config = tmp_path / "config"
    config.write_text(json.dumps(example_config()))
    upload = inspect_model(pt, read_config(config))
    assert (upload.format, upload.norm) == ("pt", "un")


def _example_pt(tmp_path: Path) -> Path:
    from .upload_corpus import state_dict_pt

    return state_dict_pt(tmp_path / "example.pt")


def test_exported_onnx_passes(tmp_path: Path) -> None:
    from converters.fold_and_export import export_folded, load_and_fold

    path = tmp_path / "exported"  # no suffix: the format comes from the content
    export_folded(load_and_fold(examples.path(GOOD_MODEL)), path)
    upload = inspect_model(path, None)
    assert (upload.format, upload.inputs) == ("onnx", ("images",))
    assert inspect_model(tiny_onnx(tmp_path / "tiny"), None).format == "onnx"


def test_onnx_with_external_data_passes_and_each_reference_is_checked(tmp_path: Path) -> None:
    """The model's references are checked against the uploaded files before any is read: all
    present, all used, each tensor inside its file; its weights are then checked as usual."""
    split = with_external_data(tiny_onnx(tmp_path / "tiny.onnx"), tmp_path / "model")
    data = tmp_path / "model.onnx.data"
    upload = inspect_model(split, None, external={"model.onnx.data": data})
    assert (upload.format, upload.inputs) == ("onnx", ("x",))
    with pytest.raises(UploadRejected, match="not referenced by the ONNX model"):
        inspect_model(split, None, external={"model.onnx.data": data, "more.data": data})
    with pytest.raises(UploadRejected, match=r"'model\.onnx\.data', which was not uploaded"):
        inspect_model(split, None)
    nan = with_external_data(
        tiny_onnx(tmp_path / "nan.onnx", weight=np.full((4, 4), np.nan, np.float32)),
        tmp_path / "nan",
        location="nan.data",
    )
    with pytest.raises(UploadRejected, match="tensor 'W' contains NaN"):
        inspect_model(nan, None, external={"nan.data": tmp_path / "nan.data"})
    data.write_bytes(data.read_bytes() + b"\0" * 4)  # longer is fine: offsets are within it
    inspect_model(split, None, external={"model.onnx.data": data})


def test_torch_export_program_passes(tmp_path: Path) -> None:
    from edge_un import load_checkpoint

    model, _ = load_checkpoint(examples.path(GOOD_MODEL))
    program = torch.export.export(model, (torch.randn(2, 1, 28, 28),))
    path = tmp_path / "program"
    torch.export.save(program, path)
    upload = inspect_model(path, None)
    assert upload.format == "pt2" and upload.parameters == sum(
        p.numel() for p in model.parameters()
    )
    assert upload.inputs == ("images",)  # the program's user inputs, from its signature
    with pytest.raises(UploadRejected, match="without a 'config'"):
        inspect_model(path, example_config())


def test_npz_arrays_are_checked_against_the_model_inputs(tmp_path: Path) -> None:
    """Where the model's input names are known at upload, a data file's arrays must be them
    ('inputs' for a one-input model), plus optional labels; the detail names what is expected."""
    rows = np.zeros((20, 8), np.int64)
    path = tmp_path / "calib"
    two = ("input_ids", "attention_mask")
    path.write_bytes(npz_bytes(input_ids=rows, attention_mask=rows, labels=np.zeros(20, int)))
    inspect_npz(path, "calib", two)
    with pytest.raises(UploadRejected, match="unexpected array 'attention_mask'") as extra:
        inspect_npz(path, "calib", ("input_ids",))
    assert "the model's input is input_ids" in extra.value.detail
    path.write_bytes(npz_bytes(input_ids=rows))
    with pytest.raises(UploadRejected, match="no array 'attention_mask'") as missing:
        inspect_npz(path, "calib", two)
    assert "numpy.savez(path, input_ids=..., attention_mask=..., labels=...)" in (
        missing.value.detail
    )
    path.write_bytes(npz_bytes(inputs=rows))
    inspect_npz(path, "calib", ("token_ids",))  # the one input's array may be called inputs
    with pytest.raises(UploadRejected, match="no array 'input_ids'"):
        inspect_npz(path, "calib", two)


def test_model_inputs_are_read_without_running_anything(tmp_path: Path) -> None:
    from service.server.uploads.checkpoints import architecture_inputs

    assert architecture_inputs("VisionTransformer") == ("images",)
    assert architecture_inputs("TextTransformer") == ("token_ids",)
    assert architecture_inputs("NoSuchThing") is None
    assert inspect_model(examples.path("text-rt-un"), None).inputs == ("token_ids",)


def test_real_npz_passes(tmp_path: Path) -> None:
    inspect_npz(good_calib(tmp_path / "calib", count=16), "calib")
    ids = np.random.default_rng(0).integers(1, 8000, (120, 48))
    (tmp_path / "eval").write_bytes(npz_bytes(inputs=ids, labels=np.zeros(120, np.int64)))
    inspect_npz(tmp_path / "eval", "eval")
    with pytest.raises(UploadRejected, match="at least 100 needed"):
        inspect_npz(good_calib(tmp_path / "few", count=50), "eval")


def test_save_upload_streams_and_counts(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.write_bytes(os.urandom(300_000))
    count = asyncio.run(save_upload(_chunks(source, 4096), tmp_path / "dest", 300_000, "model"))
    assert count == 300_000 and (tmp_path / "dest").read_bytes() == source.read_bytes()
    with pytest.raises(UploadRejected, match=r"limit of 0\.25 MB.*EDGE_UN_MAX_UPLOAD_MB") as big:
        asyncio.run(save_upload(_chunks(source), tmp_path / "big", 1 << 18, "model"))
    assert status_of(big.value) == 413 and not (tmp_path / "big").exists()
    with pytest.raises(FileExistsError):  # never overwrites (nor deletes) an existing file
        asyncio.run(save_upload(_chunks(source), tmp_path / "dest", 1 << 20, "model"))
    assert (tmp_path / "dest").exists()


def test_save_upload_removes_the_partial_file_when_the_client_goes(tmp_path: Path) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 1000
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(save_upload(broken(), tmp_path / "part", 1 << 20, "model"))
    assert not (tmp_path / "part").exists()


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "a\\b", "..", "x\x00y", "tab\there", "\u202egnp.exe", " ", "a" * 256],
)
def test_unsafe_labels_are_refused(name: str) -> None:
    with pytest.raises(UploadRejected) as caught:
        safe_label(name, "calib")
    assert status_of(caught.value) == 400 and "'calib'" in caught.value.detail


@pytest.mark.parametrize(
    "name",
    [None, "", "../model.onnx.data", "/abs/model.onnx.data", "a\\b", "..", ".", "x\x00y",
     "\u202egnp.exe", "é" * 200, "model", "config", "model.hf", "calib"],
)  # fmt: skip
def test_unsafe_external_data_names_are_refused(name: str | None) -> None:
    with pytest.raises(UploadRejected) as caught:
        data_file_name(name, intake.DATA_FIELD, intake.STORED_NAMES)
    assert status_of(caught.value) == 400 and "'model_data'" in caught.value.detail


def test_external_data_names_are_kept_exactly() -> None:
    for name in ("model.onnx.data", "weights.bin", "Model.ONNX", "modèle.data", "a b.data"):
        assert data_file_name(name, intake.DATA_FIELD, intake.STORED_NAMES) == name


def test_plain_labels_are_kept() -> None:
    assert safe_label("vit mnist (v2).safetensors", "model") == "vit mnist (v2).safetensors"
    assert safe_label("modèle.onnx", "model") == "modèle.onnx"
    assert safe_label(None, "model") == "model"
    assert safe_label("", "eval") == "eval"


def test_damaged_files_only_ever_raise_upload_rejected(tmp_path: Path) -> None:
    """Random damage to each format (header bytes flipped, cut anywhere) is a clear 4xx, never
    another exception (which the server would turn into a 500), and never accepted: every one of
    these 20 damaged files per format breaks its structure (the safetensors header, a zip
    member's CRC, the ONNX protobuf), while the undamaged file passes the same check."""
    rng = np.random.default_rng(0)
    sources = {
        "safetensors": examples.path(GOOD_MODEL).read_bytes(),
        "pt": _example_pt(tmp_path).read_bytes(),
        "onnx": tiny_onnx(tmp_path / "t.onnx").read_bytes(),
        "npz": good_calib(tmp_path / "c.npz").read_bytes(),
    }
    config = read_config(_write_json(tmp_path / "config", example_config()))

    def check(kind: str, path: Path) -> None:
        if kind == "npz":
            inspect_npz(path, "calib")
        else:
            inspect_model(path, config if kind == "pt" else None)

    rejected = {kind: 0 for kind in sources}
    for kind, data in sources.items():
        (tmp_path / f"{kind}-intact").write_bytes(data)
        check(kind, tmp_path / f"{kind}-intact")  # raises nothing
        for trial in range(20):
            damaged = bytearray(data)
            if trial % 2:
                damaged = damaged[: int(rng.integers(1, len(data)))]
            else:
                for position in rng.integers(0, min(len(data), 4096), 6):
                    damaged[position] = int(rng.integers(0, 256))
            path = tmp_path / f"{kind}-{trial}"
            path.write_bytes(bytes(damaged))
            with pytest.raises(UploadRejected) as error:
                check(kind, path)
            assert 400 <= status_of(error.value) < 500 and error.value.detail
            assert len(error.value.detail.splitlines()) == 1
            rejected[kind] += 1
    assert rejected == {kind: 20 for kind in sources}


def _write_json(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value))
    return path
