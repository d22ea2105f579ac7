"""Bad (and good) uploads for the conversion service, as data any test can replay.

``bad_cases(workdir, max_upload_bytes)`` writes each bad upload under ``workdir`` and returns
:class:`UploadCase` records: the multipart files (field -> client file name, file on disk; the
repeatable ``model_data`` parts apart, in order) and form fields to send to ``POST
/v1/conversions``, and the expected status and a fragment of the problem's ``detail`` (lower
case). ``tests/test_service_uploads.py`` runs them through ``service.server.uploads.files`` /
``service.server.intake`` / ``service.server.uploads.checks`` directly; the HTTP tests send the
same cases to a real server. ``good_cases`` are uploads that must be accepted.

Replaying over HTTP::

    for case in bad_cases(tmp_path, settings.max_upload_bytes):
        answer = client.post("/v1/conversions", files=case.parts(), data=case.form)
        assert answer.status_code == case.status
        assert case.fragment in answer.json()["detail"].lower()
        assert case.marker is None or not case.marker.exists()
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edge_un import examples

GOOD_MODEL = "vit-mnist-un"
# The names of bad_cases(), in order: parametrize tests by these (pytest ids).
CASE_NAMES: tuple[str, ...] = (
    "pickle-payload-torch-zip",
    "pickle-payload-raw",
    "pickle-payload-protocol-0",
    "legacy-torch-pickle",
    "truncated-safetensors",
    "config-mismatch",
    "config-mismatch-pt",
    "forged-config-1e9-parameters",
    "forged-metadata-1e9-parameters",
    "layernorm-model",
    "layernorm-onnx",
    "nan-weights",
    "nan-weights-onnx",
    "onnx-external-data",
    "onnx-external-data-missing",
    "onnx-external-data-unreferenced",
    "onnx-external-data-beyond-file",
    "model-data-traversal-name",
    "model-data-absolute-name",
    "model-data-taken-name",
    "model-data-without-onnx",
    "oversize",
    "empty-model",
    "zip-bomb-model",
    "zip-bomb-npz",
    "non-zip-pt2",
    "unknown-content",
    "malformed-npz",
    "npz-without-inputs",
    "pickled-npz",
    "pickle-as-npz",
    "path-traversal-name",
    "path-traversal-backslash",
    "control-character-name",
    "config-not-an-object",
    "config-not-json",
    "pt-without-config",
    "unknown-target",
)


@dataclass(frozen=True)
class UploadCase:
    name: str
    files: dict[str, tuple[str, Path]]  # multipart field -> (client file name, file to send)
    status: int
    fragment: str  # lower case; must occur in the problem detail (lower-cased)
    form: dict[str, str] = field(default_factory=dict)
    marker: Path | None = None  # a file the payload would create: must not exist afterwards
    data_files: tuple[tuple[str, Path], ...] = ()  # model_data parts: (client file name, file)

    def __str__(self) -> str:  # pytest ids
        return self.name

    def parts(self) -> list[tuple[str, tuple[str, bytes]]]:
        """The multipart files as httpx takes them (a list: model_data may repeat)."""
        named = [*self.files.items(), *(("model_data", data) for data in self.data_files)]
        return [(f, (name, path.read_bytes())) for f, (name, path) in named]


class CodePayload:
    """Unpickling this runs a shell command that creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def example_config(name: str = GOOD_MODEL) -> dict:
    """The edge_un config stored in a bundled example's metadata."""
    with safe_open(str(examples.path(name)), "pt") as handle:
        return json.loads(handle.metadata()["edge_un"])


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def _resave(source: Path, dest: Path, *, config: dict | None = None, nan: str | None = None):
    """A copy of a checkpoint with another config in its metadata and/or a NaN in a tensor."""
    tensors = load_file(str(source))
    with safe_open(str(source), "pt") as handle:
        metadata = dict(handle.metadata())
    if config is not None:
        metadata["edge_un"] = json.dumps(config)
    if nan is not None:
        tensors[nan] = tensors[nan].clone()
        tensors[nan].view(-1)[0] = float("nan")
    save_file(tensors, str(dest), metadata=metadata)
    return dest


def forged_config(parameters: float = 1e9) -> dict:
    """The good example's config asking for a model of about ``parameters`` weights (its depth
    kept, so only the width gives it away)."""
    config = example_config()
    args = config["arguments"]
    # ViT weights per block ~ 4 d^2 (attention) + 2 d * ratio d (MLP)
    per_dim2 = args["depth"] * (4 + 2 * args["mlp_ratio"])
    dim = int((parameters / per_dim2) ** 0.5) // args["heads"] * args["heads"]
    config["arguments"] = {**args, "dim": dim}
    return config


def zip_bomb(path: Path, member: str, expanded: int) -> Path:
    """A zip whose one member inflates ``expanded`` bytes of zeros from a few kB."""
    chunk = bytes(1 << 20)
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive,
        archive.open(member, "w", force_zip64=True) as stream,
    ):
        for _ in range(expanded >> 20):
            stream.write(chunk)
    return path


def tiny_onnx(path: Path, *, op: str = "MatMul", weight: np.ndarray | None = None) -> Path:
    """A one-node fp32 ONNX model: y = x @ W (or an online norm of x)."""
    weight = np.eye(4, dtype=np.float32) if weight is None else weight
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    inits = [onnx.numpy_helper.from_array(weight, "W")]
    if op == "LayerNormalization":
        inits.append(onnx.numpy_helper.from_array(np.zeros(4, np.float32), "B"))
        node = helper.make_node(op, ["x", "W", "B"], ["y"], name="encoder.ln", axis=-1)
        inits[0] = onnx.numpy_helper.from_array(np.ones(4, np.float32), "W")
    else:
        node = helper.make_node(op, ["x", "W"], ["y"], name="dense")
    graph = helper.make_graph([node], "tiny", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save_model(model, str(path))
    return path


def onnx_with_external_data(path: Path) -> Path:
    model = onnx.load(str(tiny_onnx(path)))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../../../etc/passwd"), ("offset", "0"), ("length", "64")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path.write_bytes(model.SerializeToString())
    return path


def with_external_data(source: Path, dest: Path, location: str = "model.onnx.data") -> Path:
    """``source`` saved again as ``dest`` with every tensor in the external data file
    ``location`` beside it (what torch.onnx.export writes by default)."""
    model = onnx.load(str(source))
    onnx.save_model(
        model, str(dest), save_as_external_data=True, location=location, size_threshold=0
    )
    return dest


def state_dict_pt(path: Path, name: str = GOOD_MODEL) -> Path:
    """A bundled example as a plain torch state dict (zip format), without its config."""
    torch.save(load_file(str(examples.path(name))), path)
    return path


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def good_calib(path: Path, count: int = 32) -> Path:
    rng = np.random.default_rng(0)
    inputs = rng.random((count, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, count)
    return _write(path, npz_bytes(inputs=inputs, labels=labels))


def bad_cases(workdir: Path, max_upload_bytes: int) -> list[UploadCase]:
    """Every bad upload of the issue's corpus (and a few more), written under ``workdir``."""
    d = workdir / "corpus"
    d.mkdir(parents=True, exist_ok=True)
    good = examples.path(GOOD_MODEL)
    model = ("model.safetensors", good)
    config = example_config()

    def case(name: str, files: dict, status: int, fragment: str, **extra) -> UploadCase:
        return UploadCase(name, files, status, fragment, **extra)

    marker = d / "payload-ran"
    payload = CodePayload(marker)
    torch.save(payload, d / "payload.pt")  # torch's zip format, data.pkl calls posix.system
    _write(d / "payload.pkl", pickle.dumps(payload, protocol=5))
    _write(d / "payload0.pkl", pickle.dumps(payload, protocol=0))
    legacy = d / "legacy.pt"
    torch.save(load_file(str(good)), legacy, _use_new_zipfile_serialization=False)
    truncated = _write(d / "cut.safetensors", good.read_bytes()[: good.stat().st_size // 2])
    smaller = {**config, "arguments": {**config["arguments"], "dim": 32}}
    forged = forged_config(1e9)
    _write(d / "oversize.bin", bytes(max_upload_bytes + 1))
    _write(d / "empty.safetensors", b"")
    zip_bomb(d / "bomb.pt", "archive/data/0", 256 << 20)
    zip_bomb(d / "bomb.npz", "inputs.npy", 256 << 20)
    state_dict = state_dict_pt(d / "vit.pt")
    object_inputs = np.empty(20, dtype=object)
    object_inputs[:] = [{"x": i} for i in range(20)]
    external = d / "external"  # a model and its external data, as torch.onnx.export writes them
    external.mkdir(exist_ok=True)
    split = with_external_data(tiny_onnx(d / "tiny.onnx"), external / "model.onnx")
    weights = ("model.onnx.data", external / "model.onnx.data")
    cut = _write(d / "cut.onnx.data", weights[1].read_bytes()[:10])
    cases = [
        case("pickle-payload-torch-zip", {"model": ("model.pt", d / "payload.pt")}, 422,
             "code-execution payload", marker=marker),
        case("pickle-payload-raw", {"model": ("model.pt", d / "payload.pkl")}, 422,
             "code-execution payload", marker=marker),
        case("pickle-payload-protocol-0", {"model": ("model.pth", d / "payload0.pkl")}, 422,
             "code-execution payload", marker=marker),
        case("legacy-torch-pickle", {"model": ("model.pt", legacy)}, 422, "raw pickle"),
        case("truncated-safetensors", {"model": ("model.safetensors", truncated)}, 422,
             "truncated"),
        case("config-mismatch", {"model": model, "config": (
             "config.json", _write(d / "smaller.json", json.dumps(smaller)))}, 422,
             "config does not match the weights"),
        case("config-mismatch-pt", {"model": ("model.pt", state_dict),
             "config": ("config.json", _write(d / "text.json",
                                              json.dumps(example_config("text-rt-un"))))},
             422, "config does not match the weights"),
        case("forged-config-1e9-parameters", {"model": model, "config": (
             "config.json", _write(d / "forged.json", json.dumps(forged)))}, 422,
             "over the service limit"),
        case("forged-metadata-1e9-parameters", {"model": ("model.safetensors", _resave(
             good, d / "forged.safetensors", config=forged))}, 422, "over the service limit"),
        case("layernorm-model", {"model": ("vit-ln.safetensors", examples.path("vit-mnist-ln"))},
             422, "edge-un migrate"),
        case("layernorm-onnx", {"model": ("ln.onnx", tiny_onnx(d / "ln.onnx",
             op="LayerNormalization"))}, 422, "edge-un migrate"),
        case("nan-weights", {"model": ("model.safetensors", _resave(
             good, d / "nan.safetensors", nan="head.weight"))}, 422,
             "tensor 'head.weight' contains nan"),
        case("nan-weights-onnx", {"model": ("model.onnx", tiny_onnx(
             d / "nan.onnx", weight=np.full((4, 4), np.inf, np.float32)))}, 422,
             "tensor 'w' contains nan or inf"),
        case("onnx-external-data", {"model": ("model.onnx", onnx_with_external_data(
             d / "external.onnx"))}, 422, "external"),
        case("onnx-external-data-missing", {"model": ("model.onnx", split)}, 422,
             "'model.onnx.data', which was not uploaded"),
        case("onnx-external-data-unreferenced", {"model": ("model.onnx", split)}, 422,
             "'extra.data' is not referenced by the onnx model",
             data_files=(weights, ("extra.data", weights[1]))),
        case("onnx-external-data-beyond-file", {"model": ("model.onnx", split)}, 422,
             "beyond the end of the uploaded file", data_files=(("model.onnx.data", cut),)),
        case("model-data-traversal-name", {"model": ("model.onnx", split)}, 400,
             "'model_data' upload '../model.onnx.data' contains a path separator",
             data_files=(("../model.onnx.data", weights[1]),)),
        case("model-data-absolute-name", {"model": ("model.onnx", split)}, 400,
             "contains a path separator", data_files=(("/etc/passwd", weights[1]),)),
        case("model-data-taken-name", {"model": ("model.onnx", split)}, 400,
             "one the server stores the other uploads under",
             data_files=(("calib", weights[1]),)),
        case("model-data-without-onnx", {"model": model}, 422,
             "the 'model' upload is a .safetensors checkpoint", data_files=(weights,)),
        case("oversize", {"model": ("big.safetensors", d / "oversize.bin")}, 413,
             "edge_un_max_upload_mb"),
        case("empty-model", {"model": ("model.safetensors", d / "empty.safetensors")}, 400,
             "empty"),
        case("zip-bomb-model", {"model": ("model.pt", d / "bomb.pt")}, 422, "zip bomb"),
        case("zip-bomb-npz", {"model": model, "calib": ("calib.npz", d / "bomb.npz")}, 422,
             "zip bomb"),
        case("non-zip-pt2", {"model": ("model.pt2", _write(d / "fake.pt2",
             b"this is not a zip archive\n" * 20))}, 422, "not a model file"),
        case("unknown-content", {"model": ("model.onnx", _write(d / "image.png",
             b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8))}, 422, "not a model file"),
        case("malformed-npz", {"model": model, "calib": ("calib.npz", _write(
             d / "malformed.npz", b"PK\x03\x04" + b"\x00garbage" * 50))}, 422, "not an .npz"),
        case("npz-without-inputs", {"model": model, "eval": ("eval.npz", _write(
             d / "noinputs.npz", npz_bytes(x=np.zeros((100, 3)))))}, 422,
             "no array 'images' (found: x)"),
        case("pickled-npz", {"model": model, "calib": ("calib.npz", _write(
             d / "pickled.npz", npz_bytes(inputs=object_inputs)))}, 422, "pickled"),
        case("pickle-as-npz", {"model": model, "eval": ("eval.npz", d / "payload.pkl")}, 422,
             "pickle", marker=marker),
        case("path-traversal-name", {"model": ("../../etc/passwd", good)}, 400,
             "path separator"),
        case("path-traversal-backslash", {"model": ("..\\..\\model.safetensors", good)}, 400,
             "path separator"),
        case("control-character-name", {"model": ("model\x1b[2J.safetensors", good)}, 400,
             "control characters"),
        case("config-not-an-object", {"model": model, "config": ("config.json", _write(
             d / "list.json", "[1, 2, 3]"))}, 422, "must be a json object"),
        case("config-not-json", {"model": model, "config": ("config.json", _write(
             d / "nan.json", '{"architecture": "VisionTransformer", "arguments": '
             '{"mlp_ratio": NaN}}'))}, 422, "not valid json"),
        case("pt-without-config", {"model": ("model.pt", state_dict)}, 422,
             "upload its json config"),
        case("unknown-target", {"model": model}, 422, "unknown target 'nosuchboard'",
             form={"targets": "cpu,nosuchboard"}),
    ]  # fmt: skip
    return cases


def good_cases(workdir: Path) -> list[UploadCase]:
    """Uploads the service must accept (status 202 over HTTP): every bundled UN example, a torch
    state dict with its config, one with calibration data, and a tiny ONNX model with its
    weights in external data (and data named as its input). (Exported ONNX and .pt2 sources
    take seconds to build: see ``tests/test_service_uploads.py``.)"""
    d = workdir / "good"
    d.mkdir(parents=True, exist_ok=True)
    cases = [
        UploadCase(f"example-{name}", {"model": (f"{name}.safetensors", examples.path(name))},
                   202, "")
        for name in examples.names()
        if not name.endswith("-ln")
    ]  # fmt: skip
    config = _write(d / "config.json", json.dumps(example_config()))
    pt = state_dict_pt(d / "vit.pt")
    files = {"model": ("vit.pt", pt), "config": ("config.json", config)}
    cases.append(UploadCase("pt-with-config", files, 202, ""))
    calib = good_calib(d / "calib.npz")
    files = {"model": ("m.safetensors", examples.path(GOOD_MODEL)), "calib": ("calib.npz", calib)}
    cases.append(UploadCase("with-calib", files, 202, ""))
    (d / "external").mkdir(exist_ok=True)
    split = with_external_data(tiny_onnx(d / "tiny.onnx"), d / "external" / "model.onnx")
    data = (("model.onnx.data", d / "external" / "model.onnx.data"),)
    rows = np.random.default_rng(0).random((16, 4), dtype=np.float32)
    x_calib = _write(d / "x-calib.npz", npz_bytes(x=rows))  # the tiny model's input is x
    files = {"model": ("model.onnx", split), "calib": ("calib.npz", x_calib)}
    cases.append(UploadCase("onnx-with-external-data", files, 202, "", data_files=data))
    return cases
