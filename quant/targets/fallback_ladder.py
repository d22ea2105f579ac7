"""The int16 fallback's ladder, the same for every target that widens tensors one set at a time
(``quant.ort.target``'s cpu file, ``quant.tflite.mixed``'s imx93 file): how many of the ranked
activations each step widens, which step's file ships, and when widening more cannot help.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from ..measure.bars import Bars
from ..measure.drift import Drift, TensorError

FIRST_FALLBACK_STEP = 4
# ONNX Runtime's CPU kernels have no 16-bit matrix product: a product with an int16 input runs
# in float, on weights dequantized at every call (BERT-base's K and V projections, float by
# mistake before issue 67: 3.7x the int8 time of a projection that size, and 2.6x more for the
# dequantization; benchmarks/results/cpu_vs_litert.md). A tensor whose int16 does that is
# ranked as if its own SQNR were one bit (6.02 dB) higher: it is widened after the cheap
# tensors at most one bit less accurate than it, before the others.
SLOW_INT16_PENALTY_DB = 6.02


def fallback_order(errors: Sequence[TensorError], slow_in_int16: Collection[str]) -> list[str]:
    """The activations in the order the int16 fallback widens them: the least accurate (lowest
    own SQNR, the local rounding error) first, a tensor in ``slow_in_int16`` counted
    ``SLOW_INT16_PENALTY_DB`` more accurate than it is (its speed cost weighed with its error)."""

    def key(error: TensorError) -> float:
        return error.own_sqnr_db + (SLOW_INT16_PENALTY_DB if error.name in slow_in_int16 else 0)

    return [error.name for error in sorted(errors, key=key)]


def fallback_sizes(count: int) -> list[int]:
    """How many of the ``count`` ranked activations each fallback step widens to int16, in the
    order the steps run: the first FIRST_FALLBACK_STEP, then all of them, then the doubling
    between (152 activations: 4, 152, 8, 16, 32, 64, 128)."""
    doubling = [min(FIRST_FALLBACK_STEP, count)]
    while doubling[-1] < count:
        doubling.append(min(2 * doubling[-1], count))
    return doubling[:1] + doubling[-1:] + doubling[1:-1] if len(doubling) > 2 else doubling


def ships_before(step: Drift, size: int, best: Drift, best_size: int, bars: Bars) -> bool:
    """Whether a fallback step's file ships rather than the best one so far (the pure int8
    file first): within the bars before missing them; both within, the fewer int16
    activations; both missing, the fewer samples short of the bars, then the fewer int16
    activations. More int16 tensors are not always closer: a timm-style ViT whose cpu file
    lost its attention scale missed by more with all 66 in int16 (93.8 %) than in pure int8
    (94.2 %)."""
    if step.within(bars) != best.within(bars):
        return step.within(bars)
    if not step.within(bars) and step.samples_short(bars) != best.samples_short(bars):
        return step.samples_short(bars) < best.samples_short(bars)
    return size < best_size


def out_of_reach(ceiling: Drift, bars: Bars) -> bool:
    """Whether a file with every ranked activation in int16 misses the bars by more than a
    smaller set could make up. A smaller set can beat it by a few samples, those near a tie
    that rounding settles either way (the bundled ViT at tests/test_quant_pipeline.py's 0.0 pt
    bar, measured once: 16 activations 100 %, all 74 99.9 %, one sample apart): up to twice
    the square root of its disagreements, the noise of a count, and at least 2. ViT-B/16's
    random weights: 8 disagreements, 7 samples short of 99 %, out of reach."""
    return ceiling.samples_short(bars) > max(2.0, 2.0 * math.sqrt(ceiling.disagreements))


def ceiling_note(count: int, drift: Drift) -> str:
    """The warning of a fallback that stopped because widening every ranked activation missed
    the bars too."""
    return (
        f"the drift fallback stopped: with all {count} ranked activations in int16 the file "
        f"still misses the drift bars ({figures(drift)}) by more than a smaller set could make "
        "up, so none was tried; of the files measured, the one closest to the bars ships"
    )


def figures(drift: Drift) -> str:
    """A file's drift in a warning: its agreement, and its drop where labels give one."""
    drop = "" if drift.top1_drop_pts is None else f", drop {drift.top1_drop_pts:.1f} pt"
    return f"agreement {100 * drift.agreement:.1f} %{drop}"
