"""The TFLite targets' two routes: litert-torch from the folded torch program (the default for a
torch source), onnx2tf for an ONNX upload and when the direct route fails, with the failed tool's
log kept where the error says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_un import examples
from quant.report import SUMMARY_FILE
from quant.samples import Samples
from quant.tflite.depthwise import depthwise_as_conv
from quant.tflite.direct import convert_direct
from quant.tflite.flatbuffer import check_full_integer, inspect_tflite
from quant.tflite.routes import keep_logs
from quant.tflite.tool_sandbox import TfliteConversionError


def test_a_torch_source_takes_the_direct_route_full_int8_and_all_on_the_npu(
    tmp_path: Path,
) -> None:
    """The bundled ViT on imx93: litert-torch makes a full-int8 file (int8 I/O, no float op)
    within the bars, and Vela places every op on the NPU (its 4x4 stride-4 patch embedding
    written back from DEPTHWISE_CONV_2D as the CONV_2D it is)."""
    from quant.pipeline import convert

    out = tmp_path / "out"
    report = convert(examples.path("vit-mnist-ln-to-un"), targets="imx93", out_dir=out,
                     latency_runs=3)  # fmt: skip
    imx93 = report.targets["imx93"]
    assert imx93.status == "ok", imx93.error
    assert imx93.tflite_route.name == "litert-torch"
    assert imx93.drift.agreement >= 0.99 and imx93.drift.within_bar
    shipped = out / "imx93" / "model_int8.tflite"
    info = inspect_tflite(shipped)
    check_full_integer(info, io_dtype="int8")
    assert "DEPTHWISE_CONV_2D" not in info.op_histogram and info.op_histogram["CONV_2D"] == 1
    assert imx93.vela.cpu_ops == [] and imx93.fallback_ops == []
    # the route's two steps are timed, and the summary says which route made the file and why
    route = imx93.tflite_route
    assert route.convert_s > 0 and route.quantize_s > 0
    summary = (out / SUMMARY_FILE).read_text()
    assert f"TFLite route: litert-torch (to float {route.convert_s:.0f} s, " in summary
    assert route.reason in summary
    shown = subprocess.run([sys.executable, "-m", "service.cli", "report", str(out)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "imx93: TFLite route: litert-torch (to float " in shown


def test_an_onnx_source_takes_the_onnx2tf_route_and_says_why(tmp_path: Path) -> None:
    from converters.fold_and_export import convert as export
    from quant.pipeline import convert

    onnx_file = export(examples.path("vit-mnist-un"), tmp_path / "fp32").onnx_path
    calib, evaluation = _split_npz(tmp_path, "train"), _split_npz(tmp_path, "test")
    report = convert(onnx_file, targets="imx8mp", out_dir=tmp_path / "out", latency_runs=3,
                     calib=calib, eval=evaluation)  # fmt: skip
    imx8mp = report.targets["imx8mp"]
    assert imx8mp.status == "ok", imx8mp.error
    assert imx8mp.tflite_route.name == "onnx2tf"
    assert "ONNX source has no torch program" in imx8mp.tflite_route.reason
    assert imx8mp.tflite_route.convert_s > 0 and imx8mp.tflite_route.quantize_s > 0


def _folded():
    from converters.fold_and_export import load_and_fold

    return load_and_fold(examples.path("vit-mnist-un"))


def _split_npz(tmp_path: Path, split: str) -> Path:
    from quant.prepare import input_specs
    from quant.samples import checkpoint_samples

    folded = _folded()
    count = 256 if split == "train" else None
    samples = checkpoint_samples(folded.info, split, count, input_specs(folded))
    path = tmp_path / f"{split}.npz"
    np.savez(path, labels=samples.labels, **samples.feeds)
    return path


def test_a_failed_conversion_names_its_log_and_the_log_is_where_it_says(tmp_path: Path) -> None:
    """litert-torch given a file that is no torch program: the step fails with one line that
    names its log; the target keeps that log in <target>/logs/ and the error names it there."""
    program = tmp_path / "not-a-program.pt2"
    program.write_bytes(b"not a zip archive")
    calibration = Samples({"images": np.zeros((2, 1, 28, 28), np.float32)}, None, "zeros")
    work = tmp_path / "work"
    with pytest.raises(TfliteConversionError, match=r"litert-torch convert failed") as failed:
        convert_direct(program, calibration, work)
    logs = tmp_path / "imx93" / "logs"
    error = keep_logs(str(failed.value), work, logs)
    named = Path(error.split("(log: ")[1].rstrip(")"))
    assert named.parent == logs and named.is_file()
    assert "not-a-program.pt2" in named.read_text()


def test_a_one_channel_depthwise_conv_becomes_the_same_conv(tmp_path: Path) -> None:
    """litert-torch writes the bundled ViT's patch embedding (one input channel, 4x4, stride 4)
    as DEPTHWISE_CONV_2D; written back as CONV_2D the float file computes the same logits."""
    from quant.prepare import tflite_program
    from quant.targets import parse_targets
    from quant.tflite.direct import convert_float
    from quant.tflite.litert import run_tflite

    program, why = tflite_program(_folded(), parse_targets("imx93"), tmp_path)
    assert program is not None, why
    sample = tmp_path / "sample.npz"
    np.savez(sample, images=np.zeros((1, 1, 28, 28), np.float32))
    depthwise = convert_float(program, sample, tmp_path / "depthwise.tflite")
    assert inspect_tflite(depthwise).op_histogram["DEPTHWISE_CONV_2D"] == 1
    conv = tmp_path / "conv.tflite"
    conv.write_bytes(depthwise.read_bytes())
    assert depthwise_as_conv(conv) == 1
    histogram = inspect_tflite(conv).op_histogram
    assert "DEPTHWISE_CONV_2D" not in histogram and histogram["CONV_2D"] == 1
    images = {"images": np.random.default_rng(0).random((8, 1, 28, 28), dtype=np.float32)}
    np.testing.assert_allclose(run_tflite(conv, images), run_tflite(depthwise, images),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_every_candidate_op_in_int16_keeps_ethos_u_int8_inputs_and_int8_io(
    tmp_path: Path,
) -> None:
    """The per-op ladder's widest file: every candidate op with int16 activations, a strict
    subset of the file's ops; no BATCH_MATMUL or GELU reads an int16 tensor, I/O stays int8."""
    from quant.prepare import tflite_program
    from quant.targets import PROFILES, parse_targets
    from quant.tflite.direct import requantize
    from quant.tflite.mixed import candidates, int16_inputs_of

    program, why = tflite_program(_folded(), parse_targets("imx93"), tmp_path)
    assert program is not None, why
    images = np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32)
    converted = convert_direct(program, Samples({"images": images}, None, "random"), tmp_path / "w")
    rule = PROFILES["imx93"].int8_input_ops
    chosen = candidates(converted.int8, rule)
    ops = inspect_tflite(converted.int8).n_ops
    assert 0 < len(chosen) < ops
    mixed = requantize(converted, tmp_path / "mixed.tflite", int16=tuple(t for _, t in chosen))
    info = inspect_tflite(mixed)
    assert len(info.int16_tensors) >= len(chosen)
    assert int16_inputs_of(mixed, rule) == []
    assert info.input_dtypes == ("int8",) and info.output_dtypes == ("int8",)
    check_full_integer(info, io_dtype="int8")


def test_text_models_take_the_direct_route_with_an_int8_embedding_table(tmp_path: Path) -> None:
    """The bundled text model and the HF BERT: their embedding lookups read int8 tables (the
    quantizer leaves them float; quant.tflite.embedding puts them on the grid they are read
    at), their boolean attention masks become bounded additive ones (quant.prepare, before the
    ONNX export decomposes them): full int8, within the bars, on the direct route."""
    from quant.pipeline import convert

    for name in ("text-rt-un", "hf-bert-rt-un"):
        out = tmp_path / name
        report = convert(examples.path(name), targets="imx93", out_dir=out, latency_runs=3)
        imx93 = report.targets["imx93"]
        assert imx93.status == "ok", (name, imx93.error)
        assert imx93.tflite_route.name == "litert-torch", imx93.tflite_route.reason
        assert imx93.drift.within_bar and imx93.drift.agreement >= 0.99
        info = inspect_tflite(out / "imx93" / "model_int8.tflite")
        check_full_integer(info, io_dtype="int8")
        assert info.op_histogram["EMBEDDING_LOOKUP"] >= 1


def test_a_boolean_sdpa_mask_becomes_a_bounded_additive_one() -> None:
    import torch

    from converters.attention_masks import MASK_PENALTY
    from converters.fold_and_export import load_and_fold
    from converters.fx_attention_masks import bound_program_masks

    folded = load_and_fold(examples.path("hf-bert-rt-un"))
    example = tuple(a[:2] for a in folded.example)
    assert not bool(example[1].all())  # padding in the example: the mask matters
    before = folded.folded(*example).logits
    assert bound_program_masks(folded.folded) == 2  # one SDPA per layer
    wheres = [n for n in folded.folded.graph.nodes if n.target == torch.ops.aten.where.Scalar]
    assert len(wheres) == 2 and all(n.args[2] == MASK_PENALTY for n in wheres)
    torch.testing.assert_close(folded.folded(*example).logits, before, rtol=1e-5, atol=1e-5)


def test_a_mask_that_masks_nothing_is_dropped() -> None:
    """transformers 5's ViT hands every SDPA a boolean mask built from ``arange >= 0``: no input
    in it, every entry True. litert-torch kept it as BROADCAST_TO and SELECT_V2, which Vela
    leaves to the Cortex-A; it is computed here and, masking nothing, dropped."""
    import torch

    from converters.fold_and_export import load_and_fold
    from converters.fx_attention_masks import bound_program_masks

    folded = load_and_fold(examples.path("hf-vit-mnist-un"))
    example = tuple(a[:2] for a in folded.example)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    attentions = [n for n in folded.folded.graph.nodes if n.target == sdpa]
    assert attentions and all(len(n.args) > 3 and n.args[3] is not None for n in attentions)
    before = folded.folded(*example).logits
    assert bound_program_masks(folded.folded) == len(attentions)
    attentions = [n for n in folded.folded.graph.nodes if n.target == sdpa]
    assert all((n.args[3:4] or [None])[0] is None for n in attentions)
    ops = {n.target for n in folded.folded.graph.nodes}
    assert torch.ops.aten.where.Scalar not in ops and torch.ops.aten.arange.default not in ops
    torch.testing.assert_close(folded.folded(*example).logits, before, rtol=1e-5, atol=1e-5)


def test_a_users_program_of_a_text_model_takes_the_direct_route(tmp_path: Path) -> None:
    """The HF BERT as a user's ``torch.export`` file: a program that takes its two inputs by
    position, which refuses them by name (litert-torch then gets them through a wrapper that
    names them): full int8, within the bars, its signature naming both inputs."""
    import torch

    import edge_un
    from quant.pipeline import convert
    from quant.samples import InputSpec, checkpoint_samples

    model, info = edge_un.load_pretrained(examples.path("hf-bert-rt-un"))
    length = info.metadata["preprocessing"]["tokenizer"]["max_len"]
    specs = tuple(InputSpec(n, (length,), "int64") for n in ("input_ids", "attention_mask"))
    calib = checkpoint_samples(info, "train", 64, specs)
    evaluation = checkpoint_samples(info, "test", specs=specs).head(200)
    np.savez(tmp_path / "calib.npz", **calib.feeds)
    np.savez(tmp_path / "eval.npz", **evaluation.feeds, labels=evaluation.labels)
    example = tuple(torch.from_numpy(a[:1]) for a in evaluation.feeds.values())
    torch.export.save(torch.export.export(model, example), tmp_path / "model.pt2")
    report = convert(tmp_path / "model.pt2", targets="imx93", out_dir=tmp_path / "out",
                     calib=tmp_path / "calib.npz", eval=tmp_path / "eval.npz",
                     latency_runs=3)  # fmt: skip
    imx93 = report.targets["imx93"]
    assert imx93.status == "ok", imx93.error
    assert imx93.tflite_route.name == "litert-torch", imx93.tflite_route.reason
    assert imx93.drift.within_bar and imx93.drift.agreement >= 0.99
    info8 = inspect_tflite(tmp_path / "out" / "imx93" / "model_int8.tflite")
    check_full_integer(info8, io_dtype="int8")
    assert [i.name for i in imx93.inputs] == ["input_ids", "attention_mask"]


def test_an_integer_argmax_becomes_a_top1_and_a_float_one_stays(tmp_path: Path) -> None:
    """converters.fx_integer_argmax on a program with both kinds: no integer argmax left, the
    same indices in torch; and LiteRT's TOPK_V2, which runs it on the board, gives the first of
    equal values as argmax does (torch's own topk need not: the ties are checked on LiteRT)."""
    import torch
    from ai_edge_litert.interpreter import Interpreter

    from converters.fx_integer_argmax import integer_argmax_as_top1
    from quant.tflite.direct import convert_float

    class LastToken(torch.nn.Module):
        def forward(self, ids: torch.Tensor, scores: torch.Tensor) -> tuple:
            positions = torch.arange(ids.shape[-1])
            last = (positions * (ids != 0).to(torch.int32)).argmax(-1)
            return last, scores.argmax(-1, keepdim=True), (ids > 5).to(torch.int64).argmax(1)

    ids = torch.tensor([[3, 7, 9, 0, 0], [9, 0, 1, 6, 0], [4, 0, 8, 8, 1]])
    scores = torch.randn(3, 4)
    module = torch.export.export(LastToken(), (ids, scores)).module()
    before = module(ids, scores)
    assert integer_argmax_as_top1(module) == 2
    targets = [n.target for n in module.graph.nodes]
    assert targets.count(torch.ops.aten.argmax.default) == 1  # the float one
    for got, expected in zip(module(ids, scores), before, strict=True):
        torch.testing.assert_close(got, expected)

    ties = torch.tensor([[0, 0, 0, 0, 0], [7, 0, 0, 9, 8], [1, 1, 0, 0, 0]])  # equal values
    program = torch.export.export(module, (ties, torch.zeros(3, 4)))
    torch.export.save(program, tmp_path / "program.pt2")
    np.savez(tmp_path / "sample.npz", ids=ties.numpy(), scores=np.zeros((3, 4), np.float32))
    tflite = convert_float(tmp_path / "program.pt2", tmp_path / "sample.npz", tmp_path / "f.tflite")
    runner = Interpreter(str(tflite)).get_signature_runner()
    got = runner(ids=ties.numpy().astype(np.int32), scores=np.zeros((3, 4), np.float32))
    expected = LastToken()(ties, torch.zeros(3, 4))
    assert sorted(got) == ["output_0", "output_1", "output_2"]
    for index in (0, 2):
        assert got[f"output_{index}"].tolist() == expected[index].tolist(), (index, got)


def test_a_gpt2_classifier_compiles_for_the_ethos_u_on_the_direct_route(tmp_path: Path) -> None:
    """HF's GPT-2 classifier finds the last real token with an integer argmax; as an int32
    ARG_MAX Vela compiled nothing. On the direct route it is a TOPK_V2 the Cortex-A runs:
    imx93 ok, and what Vela leaves to the CPU names no ARG_MAX."""
    from quant.pipeline import convert
    from testbed import hf_families

    model = hf_families.build("gpt2")
    calib, evaluation = hf_families.write_data(model, tmp_path)
    feeds = hf_families.user_feeds(model, 1, 7)
    source = hf_families.export_as_users_do(model, feeds, tmp_path, ["directory"])["directory"]
    report = convert(source, targets="imx93", out_dir=tmp_path / "out", calib=calib,
                     eval=evaluation, latency_runs=3)  # fmt: skip
    imx93 = report.targets["imx93"]
    assert imx93.status == "ok", imx93.error
    assert imx93.tflite_route.name == "litert-torch", imx93.tflite_route.reason
    cpu = [op.split()[0] for op in imx93.vela.cpu_ops]
    assert "TOPK_V2" in cpu and "ARG_MAX" not in cpu
