"""One model, any source format, one fold: the bundled models, both Hugging Face examples, a
BERT with token-type embeddings and the other transformers families users bring (DeiT, Swin,
DistilBERT, RoBERTa, ALBERT, ELECTRA, GPT-2: tiny, random, UN; :mod:`testbed.hf_families`), as
an nn.Module (a checkpoint or save_pretrained directory), a ``torch.export`` program (.pt2), a
dynamo ONNX file and a legacy ONNX file, fold the same norms into the same layers, and each
folded file computes what the model does.

(Before the one fold engine, the ONNX route named only the word table for BERT's embeddings
norm, the .pt2 route all three.) Drift per format on every target: tests/test_hf_convert.py.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import Tensor, nn

import edge_un
import edge_un.hf
from converters import FoldReport, fold_norms, fold_onnx, load_program
from converters.trace import default_example_inputs
from edge_un import examples
from testbed import hf_families

from .fold_helpers import randomize_norm_state, relative_diff

transformers = pytest.importorskip("transformers")

BUNDLED = ("vit-mnist-un", "vit-mnist-ln-to-un", "text-rt-un", "text-rt-ln-to-un")
HF = ("hf-vit-mnist-un", "hf-bert-rt-un")
FAMILIES = ("deit", "swin", "distilbert", "roberta", "albert", "electra", "gpt2")
TOLERANCE = 1e-4  # ONNX Runtime (float32) vs torch, relative to the logits' max abs value


def bert_with_token_types() -> tuple[nn.Module, dict[str, Tensor]]:
    """A BERT whose token-type embeddings are used (two segments), UN with trained-looking
    statistics."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    assert edge_un.swap_layernorm(model, kind="un") == 5
    randomize_norm_state(model, 3)
    ids = torch.randint(1, 60, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    return model.eval(), {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def model_and_inputs(name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    if name == "bert-token-types":
        return bert_with_token_types()
    if name in FAMILIES:  # called positionally as a converted file is: inputs by name, no cache
        model = hf_families.build(name)
        feeds = {n: torch.from_numpy(a) for n, a in hf_families.user_feeds(model, 3, 4).items()}
        return edge_un.hf.call_with_names(model, list(feeds)), feeds
    if name in HF:
        model, _ = edge_un.load_pretrained(examples.path(name))
        return model.eval(), edge_un.hf.example_inputs(model)
    model, _ = edge_un.load_checkpoint(examples.path(name))
    (example,) = default_example_inputs(model)
    return model.eval(), {"images" if example.is_floating_point() else "tokens": example}


def folded_by_format(
    model: nn.Module, inputs: dict[str, Tensor], directory: Path
) -> dict[str, tuple[FoldReport, np.ndarray]]:
    """The fold report and the folded model's logits on ``inputs``, per source format."""
    args, names = tuple(inputs.values()), list(inputs)
    results = {}
    folded, report = fold_norms(model, args)
    results["module"] = (report, _logits(folded(*args)))
    torch.export.save(torch.export.export(model, args), directory / "model.pt2")
    folded, report = fold_norms(load_program(directory / "model.pt2"))
    results["pt2"] = (report, _logits(folded(*args)))
    for export, dynamo in (("dynamo", True), ("legacy", False)):
        path = directory / f"{export}.onnx"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch.onnx.export(model, args, str(path), input_names=names, dynamo=dynamo)
        proto, report = fold_onnx(path)
        session = ort.InferenceSession(proto.SerializeToString())
        feeds = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
        results[export] = (report, session.run(None, feeds)[0])
    return results


def _logits(output: object) -> np.ndarray:
    logits = output.logits if hasattr(output, "logits") else output  # type: ignore[attr-defined]
    return logits.detach().numpy()


def placements(report: FoldReport) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {norm.name: (norm.action, norm.into) for norm in report.norms}


# Swin and GPT-2 from every format here; the other families (their directory, .pt2 and dynamo
# ONNX folds: tests/test_hf_families_convert.py) with -m slow.
QUICK_FAMILIES = ("swin", "gpt2")


@pytest.mark.parametrize(
    "name",
    [*BUNDLED, *HF, "bert-token-types", *QUICK_FAMILIES]
    + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f not in QUICK_FAMILIES],
)
def test_every_source_format_folds_the_same_norms_into_the_same_layers(
    name: str, tmp_path: Path
) -> None:
    model, inputs = model_and_inputs(name)
    with torch.no_grad():
        expected = _logits(model(*inputs.values()))
        results = folded_by_format(model, inputs, tmp_path)
    module_report = results["module"][0]
    assert module_report.folded, str(module_report)  # the comparison is not of empty reports
    for source, (report, logits) in results.items():
        assert placements(report) == placements(module_report), (source, str(report))
        assert relative_diff(torch.from_numpy(expected), torch.from_numpy(logits)) <= TOLERANCE


def test_bert_embeddings_norm_folds_into_all_three_tables_from_every_format(
    tmp_path: Path,
) -> None:
    """The case the two folds disagreed on: the dynamo exporter has already folded the
    position and token-type lookups into constants; the report still names their tables."""
    model, inputs = bert_with_token_types()
    with torch.no_grad():
        results = folded_by_format(model, inputs, tmp_path)
    tables = tuple(f"bert.embeddings.{t}_embeddings" for t in ("position", "token_type", "word"))
    for source, (report, _) in results.items():
        embeddings = next(n for n in report.norms if n.name == "bert.embeddings.LayerNorm")
        assert (embeddings.action, embeddings.into) == ("folded_backward", tables), source


def test_folding_an_onnx_file_says_nothing_on_stderr(tmp_path: Path) -> None:
    """What a user converting an ONNX file sees: onnxscript's log of each node constant folding
    leaves ("Evaluation failed: cannot reshape ...") and torch's warning about read-only
    arrays were printed to the terminal in the middle of the CLI's output. A process of its
    own: torch warns once per process."""
    model, inputs = model_and_inputs("hf-bert-rt-un")
    path = tmp_path / "bert.onnx"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, tuple(inputs.values()), str(path), input_names=list(inputs))
    fold = f"from converters import fold_onnx; print(fold_onnx({str(path)!r})[1].folded)"
    result = subprocess.run(
        [sys.executable, "-c", fold], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() not in ("", "()"), "nothing was folded: the test proves nothing"
    assert result.stderr == ""
