"""The transformers families users bring, converted from every form they come in: ViT, DeiT,
Swin, BERT, DistilBERT, RoBERTa, ALBERT, ELECTRA and GPT-2, each tiny and random, swapped to UN
(:mod:`testbed.hf_families`), as a ``save_pretrained`` directory, a ``torch.export`` program
and a dynamo ONNX file, exported as users export them.

Every family folds the same from every form, its norms where the maths allows (pre-norm
families all of them; post-norm ones all but those that feed a residual, which say so), and
its fp32 file for every target's opset and batch computes what the model does, at the
sequence length or image size of the user's data. The quantized build of every family, form
and target is ``benchmarks/conversion/hf_families.py``; here a few families build the quick targets
(cpu, tda4vm) through the Python API, targets named as strings.

The default suite folds every family from one form (its fp32 files from its ONNX file) and
Swin from every form; the full matrix, every family from every form, is marked slow (``pytest -m
slow``), and ``python -m benchmarks.conversion.hf_families`` runs it quantized for every target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import edge_un.hf
from converters import ConversionError
from converters.errors import root_cause
from converters.fold_and_export import FoldedSource, export_folded, load_and_fold
from quant.errors import one_line
from quant.pipeline import convert
from quant.report.summary import summary_markdown
from quant.samples import sample_shapes
from quant.targets import PROFILES
from testbed import hf_families

from .fold_helpers import relative_diff

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # ONNX Runtime (float32) vs torch, relative to the logits' max abs value
PRE_NORM = ("vit", "deit", "swin", "gpt2")  # every norm folds
POST_NORM = ("bert", "distilbert", "roberta", "albert", "electra")  # 3 of 5 feed a residual
# One form per family for the fp32 files of every target (all three forms are exported and
# folded for every family; the quantized build of each is the benchmark's).
FORM_FOR_FILES = {"vit": "onnx", "deit": "pt2", "swin": "directory", "bert": "pt2",
                  "distilbert": "onnx", "roberta": "directory", "albert": "pt2",
                  "electra": "onnx", "gpt2": "directory"}  # fmt: skip
EXPORTS = sorted({(p.opset, p.static_batch) for p in PROFILES.values()})


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """family -> its model, data and the forms asked for so far, each made once, when first
    asked for; and each form folded once, with the calibration data's shapes (``folded``)."""
    cache: dict[str, dict] = {}

    def make(family: str, *forms: str) -> dict:
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            model = hf_families.build(family)
            calib, evaluation = hf_families.write_data(model, directory)
            cache[family] = {"model": model, "calib": calib, "eval": evaluation,
                             "scratch": directory, "folded": {}}  # fmt: skip
        files = cache[family]
        missing = [form for form in forms if form not in files]
        if missing:
            one = hf_families.user_feeds(files["model"], 1, seed=7)
            files.update(hf_families.export_as_users_do(files["model"], one, files["scratch"],
                                                        forms=missing))  # fmt: skip
        return files

    return make


def folded(made, family: str, form: str) -> FoldedSource:
    files = made(family, form)
    if form not in files["folded"]:
        shapes = sample_shapes(files["calib"])
        files["folded"][form] = load_and_fold(files[form], input_shapes=shapes)
    return files["folded"][form]


def placements(source: FoldedSource) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, n.action, n.into) for n in source.fold.norms]


SLOW = pytest.mark.slow  # the other forms of every family: the full matrix
EVERY_FAMILY = [f if f == "swin" else pytest.param(f, marks=SLOW) for f in hf_families.FAMILIES]


# The form each family folds from in the default suite: the directory (traced at the data's
# shapes, not its 64 positions) for Swin, GPT-2 and ALBERT (whose directories other tests use),
# else the dynamo ONNX file (cheap to export again per opset, where a directory or .pt2 is
# traced again by torch's exporter).
ON_DIRECTORY = ("swin", "gpt2", "albert")
DEFAULT_FORM = {f: "directory" if f in ON_DIRECTORY else "onnx" for f in hf_families.FAMILIES}


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_every_family_folds_its_norms_where_the_maths_allows(made, family: str) -> None:
    """At the data's sequence length or image size: pre-norm families fold every norm;
    post-norm ones all but the three that feed a residual."""
    source = folded(made, family, DEFAULT_FORM[family])
    if not source.is_onnx:  # traced here (an ONNX file was exported at the data's shapes)
        data = {n: a.shape[1:] for n, a in np.load(made(family)["calib"]).items()}
        traced = dict(zip(source.input_names, source.example, strict=True))
        assert {n: t.shape[1:] for n, t in traced.items()} == data  # the data's, not 64
    fold = source.fold
    assert fold.fully_integer and fold.folded, str(fold)
    if family in PRE_NORM:
        assert not fold.kept, str(fold)
    else:
        assert len(fold.norms) == 5 and len(fold.kept) == 3, str(fold)
        for norm in fold.kept:  # post-norm: it is added to the residual stream
            assert "adds it to another tensor (a residual" in norm.reason, str(norm)


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_every_family_folds_the_same_from_every_form(made, family: str) -> None:
    """Swin in the default suite; every other family with ``-m slow``."""
    reports = {form: folded(made, family, form) for form in hf_families.FORMATS}
    first = placements(reports["directory"])
    for form, source in reports.items():
        assert placements(source) == first, (form, str(source.fold))
        assert source.fold.fully_integer, (form, str(source.fold))


def test_swin_folds_every_norm_through_its_window_partition(made) -> None:
    """Each block's layernorm_before reaches q/k/v through a zero-width pad, the cyclic shift
    (a roll in torch, Slice + Concat in ONNX), reshapes and transposes; the last norm reaches
    the classifier through average pooling with its channels on axis 1."""
    for form in hf_families.FORMATS:
        norms = {n.name: n for n in folded(made, "swin", form).fold.norms}
        assert len(norms) == 11, norms
        for name, norm in norms.items():
            if name.endswith("layernorm_before"):
                block = name.removesuffix("layernorm_before")
                wanted = tuple(f"{block}attention.{p}_proj" for p in "qkv")
                assert (norm.action, norm.into) == ("folded_forward", wanted), (form, norm)
        assert norms["swin.layernorm"].into == ("classifier",), form


@pytest.mark.parametrize(
    "form", ["directory", pytest.param("pt2", marks=SLOW), pytest.param("onnx", marks=SLOW)]
)
def test_gpt2_folds_into_its_conv1d_layers(made, form: str) -> None:
    """Traced with its key/value cache off; the config it was saved with keeps it on."""
    config = json.loads((made("gpt2", "directory")["directory"] / "config.json").read_text())
    assert config["use_cache"] is True
    norms = {n.name: n.into for n in folded(made, "gpt2", form).fold.norms}
    assert norms == {
        "transformer.h.0.ln_1": ("transformer.h.0.attn.c_attn",),
        "transformer.h.0.ln_2": ("transformer.h.0.mlp.c_fc",),
        "transformer.h.1.ln_1": ("transformer.h.1.attn.c_attn",),
        "transformer.h.1.ln_2": ("transformer.h.1.mlp.c_fc",),
        "transformer.ln_f": ("score",),
    }, form


def test_albert_reports_each_call_of_its_shared_norms(made) -> None:
    """From its directory; the same names from its .pt2 and ONNX: the slow every-form test."""
    names = [n.name for n in folded(made, "albert", "directory").fold.norms]
    layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    assert names == [
        "albert.embeddings.LayerNorm", f"{layer}.attention.LayerNorm",
        f"{layer}.full_layer_layer_norm", f"{layer}.attention.LayerNorm (call 2)",
        f"{layer}.full_layer_layer_norm (call 2)",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "form", ["onnx", pytest.param("directory", marks=SLOW), pytest.param("pt2", marks=SLOW)]
)  # a directory's or .pt2's file per target is a torch export each: minutes for the nine
@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_the_fp32_file_of_every_target_computes_what_the_model_does(made, family, form) -> None:
    """At each target's opset and batch, at the data's sequence length (32 tokens, where a
    directory used to be traced at its 64 positions) or image size."""
    files = made(family)
    source = folded(made, family, form)
    evaluation = dict(np.load(files["eval"]))
    evaluation.pop("labels")
    expected = hf_families.logits(files["model"], {n: a[:2] for n, a in evaluation.items()})
    for opset, static in EXPORTS:
        path = files["scratch"] / f"{form}_{opset}_{static}.onnx"
        export_folded(source, path, opset=opset, dynamic_batch=not static)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        shapes = {i.name: i.shape for i in session.get_inputs()}
        assert {n: s[1:] for n, s in shapes.items()} == {
            n: list(a.shape[1:]) for n, a in evaluation.items()
        }, (opset, static, shapes)
        rows = [{n: a[i : i + 1] for n, a in evaluation.items()} for i in range(2)]
        actual = np.concatenate([session.run(None, feeds)[0] for feeds in rows])
        assert relative_diff(torch.from_numpy(expected), actual) <= TOLERANCE, (opset, static)


@pytest.mark.parametrize(
    ("family", "form"),
    [("distilbert", "onnx"), pytest.param("swin", "onnx", marks=SLOW),
     pytest.param("gpt2", "directory", marks=SLOW)],
)  # fmt: skip
def test_a_family_builds_the_quick_targets_named_as_strings(made, family, form) -> None:
    """quant.convert takes target names as every peer's API does; the report lists each
    file once and carries no terminal codes; a directory's config stays as written."""
    files = made(family, "directory", form)
    config_before = (files["directory"] / "config.json").read_bytes()
    out = files["scratch"] / f"out_{form}"
    report = convert(files[form], targets=["cpu", "tda4vm"], calib=files["calib"],
                     eval=files["eval"], out_dir=out, latency_runs=3)  # fmt: skip
    assert list(report.targets) == ["cpu", "tda4vm"]
    for target in report.targets.values():
        assert target.status in ("ok", "over_bar"), (target.name, target.error)
        assert target.drift is not None and target.drift.agreement >= 0.9, target.drift
    summary = (out / "report.md").read_text()
    assert "\x1b" not in summary and "\x1b" not in (out / "report.json").read_text()
    assert (files["directory"] / "config.json").read_bytes() == config_before
    # imx93 and imx8mp share one fp32 file: it is listed once, under the first
    cpu_file = report.targets["cpu"].artifacts[-1]
    shared = report.model_copy(update={"targets": {
        "cpu": report.targets["cpu"],
        "tda4vm": report.targets["tda4vm"].model_copy(
            update={"artifacts": [*report.targets["tda4vm"].artifacts, cpu_file]}),
    }})  # fmt: skip
    listed = summary_markdown(shared)
    assert listed.count(f"`{cpu_file.name}`") == 1 and "(also tda4vm's)" in listed


def test_a_tflite_file_that_computes_something_else_is_refused_with_the_reason(
    made, tmp_path: Path
) -> None:
    """onnx2tf guesses which axes are channels; with 32 tokens of 32 channels it guesses wrong
    in its fast and its strict build alike (measured: the logits 0.004 off, of 0.011). Before
    the check, imx93 shipped that file as "ok": random weights, the argmax happened to agree."""
    files = made("distilbert", "onnx")
    report = convert(files["onnx"], targets=["imx93"], calib=files["calib"],
                     eval=files["eval"], out_dir=tmp_path / "out", latency_runs=3)  # fmt: skip
    target = report.targets["imx93"]
    assert target.status == "failed" and not target.artifacts
    assert "onnx2tf's TensorFlow model does not compute what the ONNX model does" in target.error
    assert "(text: use a sequence length other than the hidden size)" in target.error


def test_text_longer_than_the_positions_is_refused_in_one_line(made, tmp_path: Path) -> None:
    files = made("distilbert", "directory")
    long = {"input_ids": np.ones((16, 80), np.int64), "attention_mask": np.ones((16, 80))}
    np.savez(tmp_path / "long.npz", **long)
    with pytest.raises(edge_un.CheckpointError) as refused:
        load_and_fold(files["directory"], input_shapes=sample_shapes(tmp_path / "long.npz"))
    assert str(refused.value) == (
        "'input_ids' has 80 tokens, more than DistilBertForSequenceClassification has "
        "positions for (64): shorten the sequences to 64 tokens"
    )


def test_an_onnx_file_with_an_open_sequence_axis_takes_the_datas_length(tmp_path: Path) -> None:
    """The user's ONNX with a dynamic batch and sequence: every static target's file is fixed
    at the calibration data's length."""
    model = hf_families.build("distilbert")
    feeds = hf_families.user_feeds(model, 2, seed=3)
    edge_un.hf.call_with_names(model, list(feeds))
    args = tuple(torch.from_numpy(a) for a in feeds.values())
    seq = torch.export.Dim("sequence", max=64)
    dims = tuple({0: torch.export.Dim("batch"), 1: seq} for _ in args)
    torch.onnx.export(model, args, tmp_path / "open.onnx", input_names=list(feeds),
                      dynamo=True, dynamic_shapes=dims)  # fmt: skip
    data = hf_families.user_feeds(model, 16, seed=4)
    data = {n: a[:, :20] for n, a in data.items()}
    np.savez(tmp_path / "calib.npz", **data)
    source = load_and_fold(
        tmp_path / "open.onnx", input_shapes=sample_shapes(tmp_path / "calib.npz")
    )
    export_folded(source, tmp_path / "static.onnx", opset=20, dynamic_batch=False)
    inputs = onnx.load(str(tmp_path / "static.onnx")).graph.input
    dims_of = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs}
    assert dims_of == {"input_ids": [1, 20], "attention_mask": [1, 20]}


def test_an_export_failure_says_its_real_cause_in_one_plain_line(tmp_path: Path) -> None:
    """torch's exporter wraps the cause in pages of advice with terminal colours; the error
    names the deepest cause that says something, without them, and one_line strips codes
    from any message."""

    class Eigenvalues(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.eigh(x @ x.transpose(-1, -2))[0]  # no ONNX op computes it

    from converters.export import export_onnx

    with pytest.raises(ConversionError) as failed:
        export_onnx(Eigenvalues(), (torch.randn(2, 3, 3),), tmp_path / "x.onnx", opset=18)
    message = str(failed.value)
    assert message.startswith("ONNX export failed: ") and "\n" not in message
    assert "\x1b" not in message and "This is step" not in message, message
    assert message == f"ONNX export failed: {root_cause(failed.value.__cause__)}"
    assert "No ONNX function found for <OpOverload(op='aten._linalg_eigh'" in message
    coloured = RuntimeError("\x1b[96mThis is step 2/3\x1b[0m of exporting")
    assert one_line(coloured) == "This is step 2/3 of exporting"
