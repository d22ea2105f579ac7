"""Issue 66: the fold reads any exporter's program. A frozen per-channel affine folds wherever
it stands (the UN authors' ``UN1d``: transpose, reshape to ``(B, C, N, 1)``, divide, scale,
shift, and back), from the module, a .pt2, dynamo ONNX and legacy ONNX alike, and the folded
graph computes what the model does; in-place ops are functionalized first (and the report says
so); a fold that leaves norms in the graph says so. Before: 0 of 5 norms found from every
format, and the report was silent.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from converters import FoldReport, fold_norms, fold_onnx, load_program

from .authors_un import AuthorsViT, InPlaceEmbeddings, LaidOutUnifiedNorm, trained_looking
from .fold_helpers import relative_diff

TOLERANCE = 1e-5  # relative to the logits' largest magnitude (float32 ONNX Runtime)
NORMS = ("blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm")


def _onnx(model: nn.Module, x: torch.Tensor, path: Path, dynamo: bool) -> Path:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=dynamo)
    return path


def _run(proto: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy()})[0]


def _norm_ops(proto: onnx.ModelProto) -> list[str]:
    """The ops left that a norm module computed (legacy names, dynamo's metadata say so)."""
    return [node.op_type for node in proto.graph.node if _in_a_norm(node)]


def _in_a_norm(node: onnx.NodeProto) -> bool:
    spaces = "".join(p.value for p in node.metadata_props if p.key == "namespace")
    return "AuthorsUN1d/" in spaces or any("norm" in part for part in node.name.split("/")[:-1])


def folds_by_format(
    model: nn.Module, x: torch.Tensor, directory: Path
) -> dict[str, tuple[FoldReport, np.ndarray, list[str]]]:
    """Report, folded logits and (ONNX) the ops left of the norms, per source format."""
    results = {}
    folded, report = fold_norms(model, (x,))
    results["module"] = (report, folded(x).detach().numpy(), [])
    torch.export.save(torch.export.export(model, (x,)), directory / "model.pt2")
    folded, report = fold_norms(load_program(directory / "model.pt2"))
    results["pt2"] = (report, folded(x).detach().numpy(), [])
    for name, dynamo in (("dynamo", True), ("legacy", False)):
        proto, report = fold_onnx(_onnx(model, x, directory / f"{name}.onnx", dynamo))
        results[name] = (report, _run(proto, x), _norm_ops(proto))
    return results


def test_authors_layout_norms_fold_from_every_format(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = trained_looking(AuthorsViT())
    x = torch.randn(3, 7, 12)
    with torch.no_grad():
        expected = model(x)
        results = folds_by_format(model, x, tmp_path)
    module = results["module"][0]
    placements = {n.name: (n.action, n.into) for n in module.norms}
    assert placements == {
        **{f"blocks.{i}.norm1": ("folded_forward", (f"blocks.{i}.qkv",)) for i in (0, 1)},
        **{f"blocks.{i}.norm2": ("folded_forward", (f"blocks.{i}.fc1",)) for i in (0, 1)},
        "norm": ("folded_forward", ("head",)),
    }, str(module)
    for source, (report, logits, ops) in results.items():
        assert {n.name: (n.action, n.into) for n in report.norms} == placements, (source, report)
        assert relative_diff(expected, logits) <= TOLERANCE, source
        assert not report.warnings, (source, report.warnings)
        # the norms' arithmetic and their layout round trip (Transpose, Reshape) are gone
        assert ops == [], (source, ops)


def test_norm_kept_in_the_authors_layout_stays_one_mul_add(tmp_path: Path) -> None:
    """A norm whose input and output both meet the residual cannot fold: it stays as one
    Mul + Add in its own layout, computes the same, and the report warns and names it."""

    class Exposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = AuthorsViT()

        def forward(self, patches: torch.Tensor) -> torch.Tensor:
            x = self.vit.embed(patches)
            return self.vit.norm(x) + x

    model = trained_looking(Exposed())
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        folded, report = fold_norms(model, (x,))
        assert relative_diff(model(x), folded(x)) <= 1e-6
    proto, onnx_report = fold_onnx(_onnx(model, x, tmp_path / "exposed.onnx", True))
    assert relative_diff(model(x), _run(proto, x)) <= TOLERANCE
    for found in (report, onnx_report):
        assert [(n.name, n.action) for n in found.norms] == [("vit.norm", "scale_shift")]
        assert any("vit.norm" in w for w in found.warnings), found.warnings
        assert "WARNING" in str(found)


def test_in_place_embeddings_fold_from_pt2_as_from_onnx(tmp_path: Path) -> None:
    """The program adds the position rows with ``aten.add_.Tensor``; functionalized, the norm
    folds into both tables as it does from ONNX (before: kept, "its input comes from ...
    add_"), and the report records the rewrite."""
    torch.manual_seed(1)
    model = InPlaceEmbeddings().eval()
    ids = torch.randint(0, 30, (2, 6))
    program = torch.export.export(model, (ids,))
    assert torch.ops.aten.add_.Tensor in {n.target for n in program.graph.nodes}
    torch.export.save(program, tmp_path / "embeddings.pt2")
    folded, report = fold_norms(load_program(tmp_path / "embeddings.pt2"))
    with torch.no_grad():
        assert relative_diff(model(ids), folded(ids)) <= 1e-6
    tables = ("position", "word")
    assert [(n.action, n.into) for n in report.norms] == [("folded_backward", tables)], report
    assert any("aten.add_.Tensor -> aten.add.Tensor (1)" in note for note in report.notes)
    path = tmp_path / "embeddings.onnx"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, (ids,), str(path), input_names=["ids"], dynamo=True)
    _, onnx_report = fold_onnx(path)
    assert [(n.action, n.into) for n in onnx_report.norms] == [("folded_backward", tables)]


@pytest.mark.parametrize("source", ["module", "onnx"])
def test_a_model_with_nothing_folded_is_warned_about(tmp_path: Path, source: str) -> None:
    """Before: "0 offline norms" and nothing else."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(2, 4)
    if source == "module":
        _, report = fold_norms(model, (x,))
    else:
        _, report = fold_onnx(_onnx(model, x, tmp_path / "plain.onnx", True))
    assert report.norms == ()
    assert report.warnings and "no offline norm found" in report.warnings[0]
    assert "WARNING: no offline norm found" in str(report)
    assert tuple(report.as_dict()["warnings"]) == report.warnings


def test_a_conversion_with_nothing_folded_says_so_in_its_summary_and_report(
    tmp_path: Path,
) -> None:
    """Through the pipeline: the summary's norms line and report.md carry the fold's warning
    (before: "0 offline norms", exit 0, nothing else)."""
    from quant.pipeline import convert
    from quant.report.summary import norms_line
    from quant.targets import PROFILES

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    source = _onnx(model, torch.randn(2, 4), tmp_path / "plain.onnx", True)
    inputs = np.random.default_rng(0).standard_normal((128, 4)).astype(np.float32)
    labels = model(torch.from_numpy(inputs)).argmax(1).numpy()
    np.savez(tmp_path / "calib.npz", inputs=inputs)
    np.savez(tmp_path / "eval.npz", inputs=inputs, labels=labels)
    report = convert(
        source, targets=[PROFILES["cpu"]], calib=tmp_path / "calib.npz",
        eval=tmp_path / "eval.npz", out_dir=tmp_path / "out", latency_runs=3,
    )  # fmt: skip
    assert "0 offline norms; WARNING: no offline norm found, nothing folded" in norms_line(report)
    assert "WARNING: no offline norm found" in (tmp_path / "out" / "report.md").read_text()


def test_our_own_norm_written_in_the_authors_layout_folds(tmp_path: Path) -> None:
    """Found by its class, described by the one affine run inside its call (before: "aten.
    permute.default is not a per-channel affine op"), reported as a UN."""
    torch.manual_seed(2)
    model = AuthorsViT(norm=LaidOutUnifiedNorm).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LaidOutUnifiedNorm):
                module.running_var.uniform_(0.2, 3.0)
                module.bias.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 12)
    folded, report = fold_norms(model, (x,))
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "ours.pt2")
    folded_pt2, report_pt2 = fold_norms(load_program(tmp_path / "ours.pt2"))
    with torch.no_grad():
        for result in (folded, folded_pt2):
            assert relative_diff(model(x), result(x)) <= 1e-6
    for found in (report, report_pt2):
        assert [(n.name, n.kind, n.action) for n in found.norms] == [
            (name, "un", "folded_forward") for name in NORMS
        ], str(found)
