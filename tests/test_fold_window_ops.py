"""The fold across what windowed and decoder Transformers put between a norm and its Linears,
from torch (fx) and from ONNX alike, each exact: Swin's window partition (a pad, a cyclic roll,
reshapes and transposes), its classifier pooling (channels moved to axis 1 and averaged over
tokens), GPT-2's Conv1D (``addmm`` with an (in, out) weight) and ALBERT's shared norm, called
once per layer. A pad that adds positions folds only where it is exact: when the norm's shift
is zero (the padded zeros stay zeros); otherwise the norm stays one Mul + Add and says why.

The unshifted and double-shift windows and the pooling are marked slow: a real HF Swin's
unshifted and shifted blocks and its pooled classifier fold from every form in the default
suite (tests/test_hf_families_convert.py).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import edge_un
from converters import FoldReport, fold_norms, fold_onnx

from .fold_helpers import randomize_norm_state, relative_diff

TOLERANCE = 1e-5  # float32, relative to the output's max abs value
C = 8


class Window(nn.Module):
    """Swin's attention input: norm, (B, 4, 4, C) map, pad to the window, cyclic shift, 2 x 2
    windows of tokens, q/k/v."""

    def __init__(self, pad: int, shift: int) -> None:
        super().__init__()
        self.pad, self.shift = pad, shift
        self.norm = edge_un.make_norm("un", C)
        self.q, self.k, self.v = (nn.Linear(C, C) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[0]
        h = self.norm(x).view(batch, 4, 4, C)
        h = F.pad(h, (0, 0, 0, self.pad, 0, self.pad))
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        side = 4 + self.pad
        windows = h.view(batch, side // 2, 2, side // 2, 2, C).transpose(2, 3).reshape(-1, 4, C)
        return self.q(windows) * self.k(windows) + self.v(windows)


class Pooled(nn.Module):
    """Swin's classifier: norm, tokens averaged with channels on axis 1, flattened, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.make_norm("un", C)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(C, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.pool(self.norm(x).transpose(1, 2)), 1))


class Conv1DBlock(nn.Module):
    """GPT-2's pre-norm MLP: ln_2 -> Conv1D (x @ W + b, W stored (in, out)) -> GELU -> Conv1D."""

    def __init__(self) -> None:
        super().__init__()
        conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
        self.norm = edge_un.make_norm("un", C)
        self.fc, self.proj = conv1d(2 * C, C), conv1d(C, 2 * C)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Shared(nn.Module):
    """ALBERT's shared layer, applied twice: a post-norm residual block with one norm; the last
    call's output feeds only the head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.make_norm("un", C)
        self.fc = nn.Linear(C, C)
        self.head = nn.Linear(C, 3)

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(2):
            x = self.norm(x + self.fc(x))
        return self.head(x)


def zero_shift(model: nn.Module) -> nn.Module:
    """The norm's x * s + t with t = 0 (no bias, nothing subtracted), s as trained."""
    with torch.no_grad():
        model.norm.bias.zero_()
        if model.norm.centered:
            model.norm.running_mean.zero_()
    return model


def folded_both_ways(model: nn.Module, x: Tensor, tmp_path: Path) -> list[FoldReport]:
    """The fold from torch and from the model's dynamo ONNX file, each checked against the
    model's own output."""
    with torch.no_grad():
        expected = model(x)
    folded, report = fold_norms(model, (x,))
    assert relative_diff(expected, folded(x)) <= TOLERANCE
    path = tmp_path / "model.onnx"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=True)
    proto, onnx_report = fold_onnx(path)
    (actual,) = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x.numpy()})
    assert relative_diff(expected, actual) <= TOLERANCE
    return [report, onnx_report]


def placements(report: FoldReport) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, n.action, n.into) for n in report.norms]


SLOW = pytest.mark.slow  # HF Swin's blocks (unshifted, shifted) fold in the default suite


@pytest.mark.parametrize(
    ("pad", "shift"), [pytest.param(0, 0, marks=SLOW), (0, 1), pytest.param(0, 2, marks=SLOW)]
)
def test_a_window_partition_that_pads_nothing_folds_into_q_k_v(
    pad: int, shift: int, tmp_path: Path
) -> None:
    model = randomize_norm_state(Window(pad, shift), 1)
    for report in folded_both_ways(model, torch.randn(2, 16, C), tmp_path):
        assert placements(report) == [("norm", "folded_forward", ("q", "k", "v"))], str(report)


def test_a_pad_that_adds_zeros_is_exact_only_without_a_shift(tmp_path: Path) -> None:
    """With a shift t, the padded positions would read t after the fold where the model reads
    0 (they are not masked: they are keys and values of their windows): the norm stays."""
    x = torch.randn(2, 16, C)
    shifted = randomize_norm_state(Window(pad=2, shift=1), 1)
    for report in folded_both_ways(shifted, x, tmp_path):
        (norm,) = report.norms
        assert norm.action == "scale_shift", str(report)
        assert "pads axes [1, 2] with 0" in norm.reason and "not be exact" in norm.reason
    unshifted = zero_shift(randomize_norm_state(Window(pad=2, shift=1), 1))
    for report in folded_both_ways(unshifted, x, tmp_path):
        assert placements(report) == [("norm", "folded_forward", ("q", "k", "v"))], str(report)


@SLOW  # HF Swin's last norm folds into its classifier in tests/test_hf_families_convert.py
def test_pooling_with_channels_on_axis_1_folds_into_the_head(tmp_path: Path) -> None:
    model = randomize_norm_state(Pooled(), 2)
    for report in folded_both_ways(model, torch.randn(3, 5, C), tmp_path):
        assert placements(report) == [("norm", "folded_forward", ("head",))], str(report)


def test_a_gpt2_conv1d_takes_the_fold_in_its_transposed_weight(tmp_path: Path) -> None:
    model = randomize_norm_state(Conv1DBlock(), 3)
    for report in folded_both_ways(model, torch.randn(2, 5, C), tmp_path):
        assert placements(report) == [("norm", "folded_forward", ("fc",))], str(report)


def test_a_shared_norm_folds_per_call_and_reports_each(tmp_path: Path) -> None:
    model = randomize_norm_state(Shared(), 4)
    for report in folded_both_ways(model, torch.randn(2, 5, C), tmp_path):
        (first, second) = report.norms
        assert (first.name, first.action) == ("norm", "scale_shift"), str(report)
        # its readers: the shared fc (ONNX sees its weight used twice) and the residual
        assert "a residual" in first.reason or "shares its weight" in first.reason
        assert (second.name, second.action, second.into) == (
            "norm (call 2)", "folded_forward", ("head",)
        ), str(report)  # fmt: skip


def test_the_fold_of_one_call_leaves_the_other_calls_constants(tmp_path: Path) -> None:
    """torch.export computes a shared norm's constants once, in its first call; folding that
    call must not delete what the second still reads."""
    model = randomize_norm_state(Shared(), 5)
    x = torch.randn(2, 5, C)
    folded, report = fold_norms(model, (x,))
    with torch.no_grad():
        assert relative_diff(model(x), folded(x)) <= TOLERANCE
    assert np.isfinite(folded(x).detach().numpy()).all() and len(report.norms) == 2
