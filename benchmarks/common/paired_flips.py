"""Which held-out samples each target's pure int8 file flips, and whether two targets' files
differ by more than the test split can tell.

A pure int8 file's agreement with fp32 on a 1000-sample test split moves in steps of 0.1 pt,
and two files flip mostly different samples near fp32's own decision boundary: 99.2 % against
99.5 % is 8 flips against 5. Whether such a gap says one file is worse is a paired question,
answered on the samples the two files disagree about: McNemar's exact test (the samples only
one of the two flips, split between them as a fair coin would under the hypothesis that both
files flip at the same rate). ``benchmarks.training.hf_migrate`` records the flipped samples of
every target of each conversion and sets tda4vm's beside each other target's.

The files are run as the report measured them: the artifact its pure int8 drift names, in the
arithmetic it names (``exact``: the QDQ graph as written; ``onnxruntime``: the host's kernels;
``litert``: LiteRT), on the model's held-out test split, against the fp32 export. A target
whose shipped file is not its pure int8 one (a 16-bit fallback replaced it) is left out, and
each recomputed agreement must equal the report's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from converters.fold_and_export import load_and_fold
from quant.measure.drift import onnx_runner
from quant.prepare import input_specs
from quant.report import REPORT_FILE, Report
from quant.samples import checkpoint_samples
from quant.tflite.litert import run_tflite


def held_out_reference(model: Path, out_dir: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The model's held-out test split (its feeds) and the logits on it of the fp32 file that
    ``convert`` wrote for ``model`` under ``out_dir``."""
    folded = load_and_fold(model)
    evaluation = checkpoint_samples(folded.info, "test", specs=input_specs(folded))
    (fp32,) = (out_dir / "fp32").glob("model_opset17_*.onnx")
    return evaluation.feeds, onnx_runner(fp32)(evaluation.feeds)


@dataclass(frozen=True)
class PairedFlips:
    """Two files' flips on the same samples: those only ``a`` flips, those only ``b`` flips,
    and McNemar's exact two-sided p-value of the difference."""

    only_a: int
    only_b: int
    p_value: float


def held_out_flips(model: Path, out_dir: Path) -> dict[str, list[int]]:
    """target -> the held-out test samples (indices) whose top-1 its pure int8 file, as
    ``edge-un convert`` wrote it for ``model`` under ``out_dir``, changes from fp32's."""
    report = Report.read(out_dir / REPORT_FILE)
    feeds, logits = held_out_reference(model, out_dir)
    reference = logits.argmax(axis=1)
    flips = {}
    for name, target in report.targets.items():
        if target.drift is None or target.pure_int8_drift is not None:
            continue  # failed, or the pure file gave way to a 16-bit one
        drift = target.drift
        top1 = _outputs(out_dir / drift.artifact, drift.arithmetic, feeds).argmax(1)
        flipped = np.flatnonzero(top1 != reference)
        agreement = 1 - len(flipped) / len(reference)
        if abs(agreement - drift.agreement) > 1e-9:
            raise RuntimeError(f"{name}: {drift.artifact} agrees on {agreement:.4f} here, "
                               f"{drift.agreement:.4f} in the report")  # fmt: skip
        flips[name] = flipped.tolist()
    return flips


def _outputs(path: Path, arithmetic: str | None, feeds: dict[str, np.ndarray]) -> np.ndarray:
    if arithmetic == "litert":
        return run_tflite(path, feeds)
    if arithmetic in ("exact", "onnxruntime"):
        return onnx_runner(path, exact=arithmetic == "exact")(feeds)
    raise ValueError(f"{path.name}: no runner for arithmetic {arithmetic!r}")


def paired(a: list[int], b: list[int]) -> PairedFlips:
    """McNemar's exact test on two files' flipped samples (of the same test split)."""
    only_a, only_b = len(set(a) - set(b)), len(set(b) - set(a))
    discordant = only_a + only_b
    p_value = 1.0 if discordant == 0 else binomtest(only_a, discordant, 0.5).pvalue
    return PairedFlips(only_a, only_b, float(p_value))
