"""What int8 cost: the quantized model's outputs against the fp32 model's, on held-out data.

``measure_drift`` compares two sets of logits (top-1 with labels, agreement, cosine, max abs
error); ``tensor_sqnr`` finds WHERE the error arises: every activation of the int8 ONNX model
against the same tensor of the fp32 model (paired by ONNX Runtime's ``qdq_loss_debug``), as SQNR
in dB.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.qdq_loss_debug import create_activation_matching

from ..deadline import check
from ..samples import Feeds, Samples, as_feeds, feed_for, padded
from .bars import Bars
from .exact import exact_session, with_constants_computed
from .graph_walk import static_batch
from .host_load import cores_left
from .ort_options import computing_options
from .saved_tensors import SavedTensors, stream_batch

EVAL_BATCH = 256
# The per-tensor SQNR ranks tensors, it does not measure accuracy: 64 samples, fewer for a model
# whose activations are large (BERT-base at 128 tokens has ~25 M values a sample, and the pass's
# time grows with samples x values), but never under 16 (for BERT-base, 2,048 token positions
# per tensor). Streamed, so only one batch is in memory at a time.
SQNR_SAMPLES = 64
MIN_SQNR_SAMPLES = 16
SQNR_VALUES = 2**28  # activation values one pass compares, summed over its samples
# Named arrays, one per model input; a bare array is the one input of a single-input model.
Inputs = np.ndarray | Mapping[str, np.ndarray]
Runner = Callable[[Inputs], np.ndarray]


@dataclass(frozen=True)
class Drift:
    top1_fp32: float | None
    top1_int8: float | None
    top1_drop_pts: float | None
    agreement: float
    cosine: float
    max_abs_err: float
    samples: int

    def within(self, bars: Bars) -> bool:
        drop_ok = self.top1_drop_pts is None or self.top1_drop_pts <= bars.max_drift
        return drop_ok and self.agreement >= bars.min_agreement

    @property
    def disagreements(self) -> int:
        """Samples whose top-1 differs from fp32's."""
        return round((1.0 - self.agreement) * self.samples)

    def samples_short(self, bars: Bars) -> int:
        """By how many samples the bars are missed: the more of the agreements lacking and the
        drop's excess, in samples (0 within them)."""
        needed = math.ceil(bars.min_agreement * self.samples - 1e-9)
        agreement_short = needed - (self.samples - self.disagreements)
        drop = self.top1_drop_pts
        drop_short = 0 if drop is None else round((drop - bars.max_drift) * self.samples / 100)
        return max(agreement_short, drop_short, 0)


@dataclass(frozen=True)
class TensorError:
    """One activation: SQNR of the int8 model's value vs fp32 (accumulated error, ``sqnr_db``)
    and of its own quantize-dequantize step alone (``own_sqnr_db``, the local rounding)."""

    name: str
    op: str
    sqnr_db: float
    own_sqnr_db: float


def measure_drift(reference: np.ndarray, quantized: np.ndarray, labels: np.ndarray | None) -> Drift:
    ref_top1, q_top1 = reference.argmax(-1), quantized.argmax(-1)
    flat_ref, flat_q = reference.ravel().astype(np.float64), quantized.ravel().astype(np.float64)
    norm = np.linalg.norm(flat_ref) * np.linalg.norm(flat_q)
    top1_fp32 = top1_int8 = drop = None
    if labels is not None:
        top1_fp32 = float((ref_top1 == labels).mean())
        top1_int8 = float((q_top1 == labels).mean())
        drop = round(100.0 * (top1_fp32 - top1_int8), 4)
    return Drift(
        top1_fp32=top1_fp32,
        top1_int8=top1_int8,
        top1_drop_pts=drop,
        agreement=float((ref_top1 == q_top1).mean()),
        cosine=float(flat_ref @ flat_q / norm) if norm > 0 else 1.0,
        max_abs_err=float(np.abs(flat_ref - flat_q).max()),
        samples=len(reference),
    )


def onnx_runner(path: Path, threads: int = 0, *, exact: bool = False) -> Runner:
    """inputs -> first output of an ONNX model, batched to its static batch if it has one.

    ``exact``: run a QDQ model as written, with ONNX Runtime's graph optimizations off, so no
    QDQ group is fused into an int8 kernel: DequantizeLinear -> float op -> QuantizeLinear. The
    float op computes on the dequantized int8 values, whose products and sums float32 holds
    exactly (bit for bit with power-of-two scales; otherwise within float32 rounding of the
    scales, ~1e-7 relative, far below one int8 step): what an integer kernel that does not
    saturate computes, on any host. Without ``exact`` the host's int8 kernels run, and on x86
    without VNNI they can saturate (see quant.host)."""
    workers = 1  # batches run at once, each on the session's own threads
    if exact:  # its constants (the weights' DequantizeLinear) computed once, not per run
        proto = with_constants_computed(onnx.load(str(path)))
        workers, threads = exact_workers(proto, threads)
        model = proto.SerializeToString()
        del proto
        session = exact_session(model, threads=threads)
    else:
        options = computing_options(threads)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    first = session.get_inputs()[0]
    static = isinstance(first.shape[0], int)  # a file exported with a fixed batch runs at it
    batch = first.shape[0] if static else EVAL_BATCH

    def run_batch(feeds: Feeds) -> np.ndarray:
        return session.run(None, feeds)[0]

    def run(inputs: Inputs) -> np.ndarray:
        samples = Samples(feed_for(names, as_feeds(inputs)), None, "")
        batches = samples.batches(batch, pad=static)
        outputs: list[np.ndarray] = []
        with ThreadPoolExecutor(workers) as pool:  # ORT runs one session on several threads
            while group := list(itertools.islice(batches, workers)):
                check()  # a search step's drift pass stops between two batches when time is up
                outputs.extend(pool.map(run_batch, group))
        return np.concatenate(outputs)[: len(samples)]

    return run


def exact_workers(model: onnx.ModelProto, threads: int = 0) -> tuple[int, int]:
    """(batches run at once, threads each) for the exact pass of ``model`` on ``threads``
    threads (0: the cores other work leaves, ``quant.measure.host_load.cores_left``). A file
    of a fixed batch of 1 (tda4vm's) runs one sample a call, whose unfused ops are too small to
    keep several threads busy: its calls run side by side on one thread each instead.
    The trained BERT-base's tda4vm file on 2 cores: 2 threads one call at a time 58.7 ms a
    sample, 2 calls at once on 1 thread each 48.1 ms (1.22x); the bundled examples' 2.0-2.1x
    (``benchmarks/results/exact_pass.md``)."""
    threads = threads or cores_left()
    if static_batch(model) == 1 and threads > 1:
        return threads, 1
    return 1, threads


def kernel_gap(exact: Drift, host: Drift) -> float:
    """The larger of the top-1 and agreement differences between two figures, in points."""
    gaps = [100.0 * abs(exact.agreement - host.agreement)]
    if exact.top1_drop_pts is not None and host.top1_drop_pts is not None:
        gaps.append(abs(exact.top1_drop_pts - host.top1_drop_pts))
    return max(gaps)


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    return sqnr_of_sums(*square_sums(reference, actual))


def sqnr_sample_count(values_per_sample: int, available: int) -> int:
    """How many samples the per-tensor SQNR runs, for a model whose compared activations hold
    ``values_per_sample`` values a sample (see ``SQNR_VALUES``)."""
    fit = SQNR_VALUES // max(values_per_sample, 1)
    return min(available, max(MIN_SQNR_SAMPLES, min(SQNR_SAMPLES, fit)))


def tensor_sqnr(fp32_path: Path, int8_path: Path, samples: Samples) -> list[TensorError]:
    """Every quantized activation of an int8 QDQ ONNX model, worst (lowest SQNR) first, over
    the first ``sqnr_sample_count`` samples.

    Streamed: both models run one batch at a time, hand over only the tensors compared, and
    each tensor keeps only its sums of squares, because every activation of a ViT-Tiny sample
    alone is ~200 MB."""
    subset = samples.head(SQNR_SAMPLES)
    fp32_model = onnx.load(str(fp32_path))
    ops = {out: node.op_type for node in fp32_model.graph.node for out in node.output}
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
        run_fp32 = SavedTensors(fp32_path, Path(scratch) / "fp32.onnx")
        run_int8 = SavedTensors(int8_path, Path(scratch) / "int8.onnx")
        # graph inputs have no producing op (not a layer); tensors the int8 graph renamed or
        # fused away have no fp32 twin
        pairs = {n: p for n, p in _matched(run_int8.names, run_fp32.names).items() if n in ops}
        int8_wanted = sorted({name for _, pre, post in pairs.values() for name in (pre, post)})
        fp32_wanted = sorted({reference for reference, _, _ in pairs.values()})
        sums = {name: np.zeros(4) for name in pairs}
        fixed = static_batch(fp32_model) is not None
        batch, start, limit = stream_batch(fp32_model), 0, len(subset)
        while start < limit:
            rows = subset.rows(start, min(start + batch, limit))
            chunk = padded(rows, batch) if fixed else rows
            fp32, int8 = run_fp32(chunk, fp32_wanted), run_int8(chunk, int8_wanted)
            for name, (reference, pre_qdq, post_qdq) in pairs.items():
                sums[name] += np.concatenate(
                    [
                        square_sums(fp32[reference], int8[post_qdq]),
                        square_sums(int8[pre_qdq], int8[post_qdq]),
                    ]
                )
            if not start:  # the first batch tells how large this model's activations are
                values = sum(int8[post].size for _, _, post in pairs.values())
                limit = sqnr_sample_count(values // len(next(iter(chunk.values()))), limit)
            start += batch
            del fp32, int8  # before the next batch's tensors arrive
    found = [
        TensorError(name, ops[name], sqnr_of_sums(*total[:2]), sqnr_of_sums(*total[2:]))
        for name, total in sums.items()
    ]
    # ties (a Reshape and the Transpose after it carry the same values) by name: the order of
    # the tensors a run returns depends on the process's string hashing, and the report (and
    # the drift fallback's ranking) must be the same in every process
    return sorted(found, key=lambda e: (e.sqnr_db, e.name))


def _matched(int8: Iterable[str], fp32: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """Activation -> (its fp32 tensor, its int8 tensor before Q/DQ, after), by ORT's own naming
    rules: ``create_activation_matching`` pairs whatever values it is given, so it is given the
    tensor names."""
    matching = create_activation_matching({n: n for n in int8}, {n: n for n in fp32})
    return {
        name: (match["float"], match["pre_qdq"], match["post_qdq"])
        for name, match in matching.items()
        if "float" in match
    }


def square_sums(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """[sum reference^2, sum (reference - actual)^2]: SQNR over all samples is the ratio of
    these totals, so a batch contributes its two sums (added up in float64) and nothing else.

    A batch's sums are float32, by numpy's own single-threaded loop (the same order on every
    run, unlike a threaded BLAS): ~1e-6 relative, 1e-5 dB, and 5-16x faster than a float64
    copy of every tensor, which was half the time of the SQNR pass on BERT-sized models. A
    tensor whose squares overflow float32 (float32-min mask fills) is summed in float64."""
    sums = _square_sums(reference, actual, np.float32)
    if not np.isfinite(sums).all():
        sums = _square_sums(reference, actual, np.float64)
    return sums


def _square_sums(reference: np.ndarray, actual: np.ndarray, dtype: type) -> np.ndarray:
    noise = np.subtract(reference, actual, dtype=dtype)  # one rounding of exact inputs
    return np.array([_sum_of_squares(reference, dtype), _sum_of_squares(noise, dtype)])


def _sum_of_squares(values: np.ndarray, dtype: type) -> float:
    flat = np.ravel(values).astype(dtype, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is retried in float64
        return float(np.einsum("i,i->", flat, flat))


def sqnr_of_sums(signal_sq: float, noise_sq: float) -> float:
    """SQNR in dB from the two sums; never a math error: a tensor holding float32-min fills
    (an attention mask left unbounded) overflows to inf, and a zero tensor has no signal."""
    if noise_sq == 0.0 or math.isnan(noise_sq):
        return math.inf if noise_sq == 0.0 else -math.inf
    if math.isinf(noise_sq):
        return -math.inf
    if math.isinf(signal_sq):
        return math.inf
    return 20.0 * math.log10(max(math.sqrt(signal_sq), 1e-30) / math.sqrt(noise_sq))
