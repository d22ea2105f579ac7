"""Equalization at fold time and bias correction on the UN ViT's pure int8 (issue 7).

    python -m benchmarks.studies.quant_equalize  # ~8-15 min on 1 core (3 calibration draws)
    python -m benchmarks.studies.quant_equalize --report   # only rewrite the .md from the .json

Two quantization-engineering steps not yet measured by ``quant_recipes.py``, each applied to the
folded fp32 ONNX model before the baseline recipe of that benchmark (ONNX Runtime QDQ, MinMax,
s8 symmetric activations, per-channel s8 weights, 256 calibration samples of the train split),
then measured on the test split against the unmodified fp32 model:

* equalization (SmoothQuant / cross-layer-equalization style): a norm ``a*x + b`` folded into
  the next Linear is split as ``W(a*x + b) = (W diag(s)) ((a/s) * x) + W b``, the per-channel
  ``a/s`` kept as a Mul before the Linear, ``s_j = max|a_j x_j|^alpha / max|W_:,j|^(1-alpha)``.
  On the folded graph (weights ``W' = W diag(a)``) that is the same as a Mul by ``1/t`` and
  rows of ``W'`` times ``t``, ``t_j = max|x_j|^alpha / max|W'_j,:|^(1-alpha)``: done here for
  every Linear a norm was folded into (qkv, fc1, head). The Mul's constant is snapped to the
  int8 per-tensor grid it will be quantized to and the weights absorb the snapped value, so the
  fp32 model stays exact and the constant quantizes without error;
* bias correction (Nagel et al. 2019, empirical): layer by layer in graph order, quantize, run
  the fp32 and the int8 model on the calibration data and add to the layer's fp32 bias the mean
  (over samples and tokens) of fp32 minus int8 output of that layer, so that the int8 model's
  expected error there is zero; the next layer is corrected on the re-quantized model.

Results: ``benchmarks/results/quant_equalize.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper

from benchmarks.common.results import RESULTS
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from quant.measure.drift import measure_drift, onnx_runner, sqnr_db
from quant.ort.quantize import quantize_onnx
from quant.samples import Samples, checkpoint_samples
from quant.targets import PROFILES

OLD_VIT = Path(os.environ.get("EDGE_UN_OLD_VIT", "/tmp/vit-mnist-un.old.safetensors"))
CALIBRATION_SAMPLES = 256
SQNR_SAMPLES = 128  # test samples for the per-Linear output SQNR diagnostic
ALPHAS = (0.5, 0.75)
CALIBRATION_SEEDS = (0, 1, 2)  # three draws of the calibration set: the noise floor of a row
BASELINE_RECIPE = "baseline (MinMax, s8 symmetric)"
BASELINE = replace(PROFILES["cpu"], activation_type="int8", symmetric_activations=True)


class _OneThread(ort.SessionOptions):
    """Every ONNX Runtime session, the quantizer's calibration ones included, on one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.intra_op_num_threads = 1
        self.inter_op_num_threads = 1
        self.log_severity_level = 3


@dataclass(frozen=True)
class Linear:
    """A Linear/Conv of the folded graph: weight and bias initializers, input and output names
    (``output`` is after the bias Add for a MatMul), the weight's input-channel axis and the
    output's channel axis."""

    op: str
    input: str
    weight: str
    bias: str
    output: str
    weight_in_axis: int
    channel_axis: int


def linears(model: onnx.ModelProto) -> list[Linear]:
    """Every Linear (MatMul + bias Add, Gemm) and Conv with constant weights, in graph order."""
    inits = {i.name for i in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            after = consumers.get(node.output[0], [])
            if len(after) == 1 and after[0].op_type == "Add":
                bias = next(n for n in after[0].input if n != node.output[0])
                if bias in inits:
                    found.append(
                        Linear(
                            "MatMul", node.input[0], node.input[1], bias, after[0].output[0], 0, -1
                        )
                    )
        elif node.op_type == "Gemm" and len(node.input) > 2 and node.input[1] in inits:
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            found.append(
                Linear(
                    "Gemm",
                    node.input[0],
                    node.input[1],
                    node.input[2],
                    node.output[0],
                    1 if trans_b else 0,
                    -1,
                )
            )
        elif node.op_type == "Conv" and len(node.input) > 2 and node.input[1] in inits:
            found.append(
                Linear("Conv", node.input[0], node.input[1], node.input[2], node.output[0], 1, 1)
            )
    return found


def folded_norm_linears(model: onnx.ModelProto) -> list[Linear]:
    """The Linears a norm was folded into: their input is the residual stream (an Add's output)
    or its mean over tokens (the head), not another Linear's or an activation's output."""
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    return [
        layer
        for layer in linears(model)
        if layer.op != "Conv" and producer.get(layer.input) in ("Add", "ReduceMean")
    ]


def graph_outputs(path: Path, names: list[str], inputs: np.ndarray, batch: int = 64):
    """The named tensors of the model at ``path`` on ``inputs`` (added as graph outputs)."""
    model = onnx.load(str(path))
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing:
            model.graph.output.append(
                helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    session = ort.InferenceSession(
        model.SerializeToString(), _OneThread(), providers=["CPUExecutionProvider"]
    )
    first = session.get_inputs()[0].name
    chunks = [
        session.run(names, {first: inputs[i : i + batch]}) for i in range(0, len(inputs), batch)
    ]
    return {name: np.concatenate([c[k] for c in chunks]) for k, name in enumerate(names)}


def per_channel(values: np.ndarray, axis: int, reduce) -> np.ndarray:
    moved = np.moveaxis(values, axis, -1)
    return reduce(moved.reshape(-1, moved.shape[-1]).astype(np.float64), axis=0)


def int8_grid(values: np.ndarray) -> np.ndarray:
    """Positive values snapped to the symmetric per-tensor int8 grid ORT quantizes them to
    (scale = max/127), at least one step each: the snapped constant dequantizes exactly."""
    step = values.max() / 127.0
    return np.maximum(np.round(values / step), 1.0) * step


def equalize(model: onnx.ModelProto, absmax: dict[str, np.ndarray], alpha: float):
    """A copy of the folded model with a per-channel Mul before each folded-norm Linear and the
    Linear's input rows rescaled (exact in fp32); returns (model, notes per layer)."""
    model = copy.deepcopy(model)
    inits = {i.name: i for i in model.graph.initializer}
    notes = []
    for index, layer in enumerate(folded_norm_linears(model)):
        weight = numpy_helper.to_array(inits[layer.weight]).astype(np.float64)
        rows = np.moveaxis(weight, layer.weight_in_axis, 0)  # (in, out) view
        w_max = np.maximum(np.abs(rows).max(axis=1), 1e-12)
        x_max = np.maximum(absmax[layer.input], 1e-12)
        t = x_max**alpha / w_max ** (1.0 - alpha)
        multiplier = int8_grid(1.0 / t)  # the Mul's constant, exactly representable in int8
        rows = rows / multiplier[:, None]
        new = np.moveaxis(rows, 0, layer.weight_in_axis).astype(np.float32)
        inits[layer.weight].CopyFrom(numpy_helper.from_array(new, layer.weight))
        constant, scaled = f"equalize_{index}_scale", f"equalize_{index}_out"
        model.graph.initializer.append(
            numpy_helper.from_array(multiplier.astype(np.float32), constant)
        )
        for position, node in enumerate(model.graph.node):
            if layer.weight in node.input and layer.input in node.input:
                node.input[list(node.input).index(layer.input)] = scaled
                mul = helper.make_node(
                    "Mul", [layer.input, constant], [scaled], name=f"equalize_{index}"
                )
                model.graph.node.insert(position, mul)
                break
        x_eq = x_max * multiplier
        notes.append(
            {
                "linear": layer.bias.removesuffix(".bias"),
                "input": layer.input,
                "input_absmax_ratio_before": float(x_max.max() / np.median(x_max)),
                "input_absmax_ratio_after": float(x_eq.max() / np.median(x_eq)),
                "weight_row_ratio_before": float(w_max.max() / np.median(w_max)),
                "weight_row_ratio_after": float(
                    (w_max / multiplier).max() / np.median(w_max / multiplier)
                ),
            }
        )
    onnx.checker.check_model(model)
    return model, notes


def int8_name(model: onnx.ModelProto, name: str) -> str:
    """The int8 QDQ model's tensor holding fp32 tensor ``name`` as the next op sees it."""
    dq = f"{name}_DequantizeLinear_Output"
    return dq if any(dq in n.output for n in model.graph.node) else name


def bias_correct(model: onnx.ModelProto, calibration: Samples, scratch: Path):
    """Sequential empirical bias correction of every Linear/Conv bias of the fp32 ``model``;
    returns (corrected fp32 model, notes per layer)."""
    model = copy.deepcopy(model)
    layers = linears(model)
    fp32_path = scratch / "bc_fp32.onnx"
    onnx.save_model(model, str(fp32_path))
    reference = graph_outputs(fp32_path, [layer.output for layer in layers], calibration.inputs)
    target = {
        layer.output: per_channel(reference[layer.output], layer.channel_axis, np.mean)
        for layer in layers
    }
    del reference
    inits = {i.name: i for i in model.graph.initializer}
    notes = []
    for layer in layers:
        onnx.save_model(model, str(fp32_path))
        int8_path = quantize_onnx(fp32_path, scratch / "bc_int8.onnx", BASELINE, calibration)
        name = int8_name(onnx.load(str(int8_path)), layer.output)
        quantized = graph_outputs(int8_path, [name], calibration.inputs)[name]
        shift = target[layer.output] - per_channel(quantized, layer.channel_axis, np.mean)
        bias = numpy_helper.to_array(inits[layer.bias]).astype(np.float64)
        inits[layer.bias].CopyFrom(
            numpy_helper.from_array((bias + shift).astype(np.float32), layer.bias)
        )
        notes.append(
            {
                "layer": layer.bias.removesuffix(".bias"),
                "mean_abs_shift": float(np.abs(shift).mean()),
                "max_abs_shift": float(np.abs(shift).max()),
                "bias_absmax": float(np.abs(bias).max()),
                "output_rms": float(np.sqrt(max(float(np.mean(np.square(quantized))), 0.0))),
            }
        )
    return model, notes


def residual_stream(fp32: Path, model: onnx.ModelProto, inputs: np.ndarray) -> list[dict]:
    """Each residual tensor read by a folded-norm Linear, on the calibration data: is its int8
    range set by a few outlier channels (equalization's case), by a per-channel offset, or by
    the whole stream being large?"""
    names = sorted({layer.input for layer in folded_norm_linears(model)})
    values = graph_outputs(fp32, names, inputs)
    found = []
    for name in names:
        flat = values[name].reshape(-1, values[name].shape[-1]).astype(np.float64)
        channel_max = np.abs(flat).max(axis=0)
        centered = flat - flat.mean(axis=0)
        found.append(
            {
                "tensor": name,
                "absmax": float(channel_max.max()),
                "channel_absmax_max_over_median": float(channel_max.max() / np.median(channel_max)),
                "centered_absmax": float(np.abs(centered).max()),
                "rms": float(np.sqrt(np.mean(np.square(flat)))),
            }
        )
    return found


def calibration_draw(folded, seed: int) -> Samples:
    """CALIBRATION_SAMPLES of the train split, drawn with ``seed`` (seed 0 is exactly the draw
    every other benchmark calibrates on)."""
    return checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES, seed=seed)


def run_model(label: str, source: Path, scratch: Path) -> tuple[list[dict], dict]:
    folded = load_and_fold(source)
    fp32 = scratch / "fp32.onnx"
    export_folded(folded, fp32, opset=21)
    base = onnx.load(str(fp32))
    evaluation = checkpoint_samples(folded.info, "test")
    reference = onnx_runner(fp32, threads=1)(evaluation.inputs)
    probe = evaluation.inputs[:SQNR_SAMPLES]
    targets = folded_norm_linears(base)
    probed = [
        n.output[0]
        for n in base.graph.node
        if n.op_type in ("MatMul", "Gemm") and n.input[1] in {t.weight for t in targets}
    ]
    fp32_probe = graph_outputs(fp32, probed, probe)
    rows: list[dict] = []
    details: dict = {"source": str(source), "equalize": {}, "bias_correction": {}}

    def record(recipe: str, fp32_model: onnx.ModelProto, seed: int, calibration: Samples) -> None:
        path = scratch / "variant.onnx"
        onnx.save_model(fp32_model, str(path))
        fp32_logits = onnx_runner(path, threads=1)(evaluation.inputs)
        int8 = quantize_onnx(path, scratch / "variant.int8.onnx", BASELINE, calibration)
        drift = measure_drift(
            reference, onnx_runner(int8, threads=1)(evaluation.inputs), evaluation.labels
        )
        int8_model = onnx.load(str(int8))
        names = [int8_name(int8_model, n) for n in probed]
        got = graph_outputs(int8, names, probe)
        sqnr = [sqnr_db(fp32_probe[n], got[q]) for n, q in zip(probed, names, strict=True)]
        rows.append(
            {
                "model": label,
                "recipe": recipe,
                "calibration_samples": len(calibration),
                "calibration_seed": seed,
                "agreement": drift.agreement,
                "top1_drop_pts": drift.top1_drop_pts,
                "cosine": drift.cosine,
                "top1_fp32": drift.top1_fp32,
                "top1_int8": drift.top1_int8,
                "fp32_variant_max_abs_diff": float(np.abs(fp32_logits - reference).max()),
                "fp32_variant_agreement": float(
                    (fp32_logits.argmax(-1) == reference.argmax(-1)).mean()
                ),
                "folded_linear_output_sqnr_db": dict(zip(probed, sqnr, strict=True)),
                "mean_folded_linear_output_sqnr_db": float(np.mean(sqnr)),
            }
        )
        print(
            f"{label:34s} seed {seed} {recipe:42s} agreement {drift.agreement:.3f} drop "
            f"{drift.top1_drop_pts:5.2f} cosine {drift.cosine:.4f} qkv/fc1/head SQNR "
            f"{np.mean(sqnr):5.1f} dB",
            flush=True,
        )

    for seed in CALIBRATION_SEEDS:
        calibration = calibration_draw(folded, seed)
        inputs = graph_outputs(fp32, sorted({t.input for t in targets}), calibration.inputs)
        absmax = {
            name: per_channel(v, -1, lambda a, axis: np.abs(a).max(axis=axis))
            for name, v in inputs.items()
        }
        del inputs
        if seed == CALIBRATION_SEEDS[0]:
            details["residual_stream"] = residual_stream(fp32, base, calibration.inputs)
        record(BASELINE_RECIPE, base, seed, calibration)
        equalized = {}
        for alpha in ALPHAS:
            equalized[alpha], notes = equalize(base, absmax, alpha)
            details["equalize"].setdefault(str(alpha), {})[seed] = notes
            record(f"equalization alpha={alpha}", equalized[alpha], seed, calibration)
        corrected, notes = bias_correct(base, calibration, scratch)
        details["bias_correction"].setdefault("none", {})[seed] = notes
        record("bias correction", corrected, seed, calibration)
        for alpha in ALPHAS:
            both, notes = bias_correct(equalized[alpha], calibration, scratch)
            details["bias_correction"].setdefault(str(alpha), {})[seed] = notes
            record(f"equalization alpha={alpha} + bias correction", both, seed, calibration)
    return rows, details


PREDICTION = """\
## Predicted (written before the first run)

The residual stream x stays one per-tensor int8 tensor: the residual Add's output, whose scale
grows to ~17 in the last block of the old model. Equalization inserts its Mul *after* that
tensor is quantized, so the rounding of x is already done when x/t is formed: it can only
change the weight side of qkv/fc1/head (the folded rows W' = W diag(a) are tiny where the norm
divided a large channel) and the requantization of x/t, not the Add. `quant_recipes.md` already
says the weight side is not where the 2 points go (A16W8, int8 weights and 16-bit activations:
99.7 %). Expected: equalization within noise of the baseline (98.0 %), possibly slightly worse
(one more rounding step); bias correction a small gain (it can remove the mean of the error the
noisy Softmax and weight rounding leave, not its variance), well under the 1 point needed for
99 %. Neither should close the gap; on the bundled model (already 99.4 %) nothing to win.
"""


def _stats(values: list[float]) -> str:
    return f"{np.mean(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def write_markdown(rows: list[dict], details: dict) -> str:
    seeds = sorted({row["calibration_seed"] for row in rows})
    lines = [
        "# Equalization at fold time and bias correction: UN ViT, pure int8 (ONNX Runtime QDQ)",
        "",
        "Made by `python -m benchmarks.studies.quant_equalize` (issue 7). Every row: the folded "
        "fp32",
        "model, transformed, then quantized with the baseline recipe of `quant_recipes.md`",
        "(MinMax, s8 symmetric activations, per-channel s8 weights, 256 calibration samples of",
        "the train split) and measured on the test split (1000 samples) against the unmodified",
        f"fp32 model. Each recipe ran on {len(seeds)} calibration draws (seeds "
        f"{', '.join(map(str, seeds))}; seed 0 is the draw of every other benchmark): mean",
        "(min-max). SQNR: mean over the folded-norm Linears (qkv, fc1, head) of their int8 output",
        f"vs fp32 on {SQNR_SAMPLES} test samples. Disagreements: test samples whose int8 top-1",
        "differs from fp32 (of 1000), the unit the agreement moves in.",
        "",
        "| model | recipe | agreement % | disagreements | drop (pt) | cosine | SQNR (dB) |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["recipe"]), []).append(row)
    for (model, recipe), group in groups.items():
        agreement = [100 * r["agreement"] for r in group]
        disagree = [round(1000 * (1 - r["agreement"])) for r in group]
        lines.append(
            f"| {model} | {recipe} | {_stats(agreement)} | "
            f"{np.mean(disagree):.1f} ({min(disagree)}-{max(disagree)}) | "
            f"{_stats([r['top1_drop_pts'] for r in group])} | "
            f"{np.mean([r['cosine'] for r in group]):.4f} | "
            f"{_stats([r['mean_folded_linear_output_sqnr_db'] for r in group])} |"
        )
    lines += ["", PREDICTION, "## Measured", "", MEASURED.strip(), "", "## Why (from the JSON)", ""]
    for model, detail in details.items():
        stream = detail.get("residual_stream", [])
        if stream:
            last = max(stream, key=lambda r: r["absmax"])
            ratios = [r["channel_absmax_max_over_median"] for r in stream]
            lines.append(
                f"- {model}: residual tensors read by qkv/fc1/head: largest abs max "
                f"{last['absmax']:.0f} ({last['tensor']}), with its per-channel mean removed "
                f"{last['centered_absmax']:.0f}, rms {last['rms']:.0f}; per-channel abs max, "
                f"max/median {min(ratios):.1f}-{max(ratios):.1f}: no strong outlier channels, no "
                "per-channel offset: the whole stream is large (the highest ratio is in the "
                "smallest, first tensors)."
            )
        for key, per_seed in detail.get("bias_correction", {}).items():
            first = per_seed[min(per_seed, key=int)]
            worst = max(first, key=lambda n: n["mean_abs_shift"] / max(n["output_rms"], 1e-12))
            label = "bias correction" if key == "none" else f"alpha={key} + bias correction"
            share = 100 * worst["mean_abs_shift"] / worst["output_rms"]
            lines.append(
                f"- {model}, {label} (seed 0): largest correction {worst['layer']}, mean |shift| "
                f"{worst['mean_abs_shift']:.3g} = {share:.1f} % "
                f"of its output rms (its fp32 bias abs max was {worst['bias_absmax']:.3g})."
            )
    for model, detail in details.items():
        notes = detail["equalize"]
        for alpha, per_seed in notes.items():
            first = per_seed[min(per_seed, key=int)] if isinstance(per_seed, dict) else per_seed
            before = [n["input_absmax_ratio_before"] for n in first]
            after = [n["input_absmax_ratio_after"] for n in first]
            w_before = [n["weight_row_ratio_before"] for n in first]
            w_after = [n["weight_row_ratio_after"] for n in first]
            lines.append(
                f"- {model}, alpha={alpha}: per-channel abs max of the Linear inputs, max/median "
                f"{np.mean(before):.1f} -> {np.mean(after):.1f} (mean over the 9 Linears); "
                f"weight rows max/median {np.mean(w_before):.1f} -> {np.mean(w_after):.1f}."
            )
    return "\n".join(lines) + "\n"


MEASURED = """\
(Written after the run.) Noise first: the same model under another calibration draw, or any
transform that only re-rolls the roundings, moves agreement by about 3-5 samples of 1000 (old
model: baseline 17-20 disagreements; its 18 rows span 97.6-98.8 %). Paired with the baseline
of the same draw, in samples of 1000 (draws 0, 1, 2):

| | old: equal. 0.5 | equal. 0.75 | bias corr. | both, 0.5 | both, 0.75 |
|---|---|---|---|---|---|
| vs baseline | -4, -2, +1 | 0, -5, +1 | +3, +3, -1 | +4, +2, +4 | +8, +1, +7 |

- Equalization alone, as predicted: no gain. Old model 97.9 % (alpha 0.5) and 98.0 % (0.75)
  against 98.1 %, cosine identical, qkv/fc1/head output SQNR +0.1 dB. It did what it is built
  for (weight rows' max/median 9 -> 2, inputs' 2.8 -> 1.3-1.7, below), but that was not the
  error that costs agreement: the residual stream has no outlier channels to balance (below),
  and the Mul reads x after its int8 rounding. Bundled model: 99.5 % vs 99.2 % (+0 to +5
  samples) with cosine and SQNR flat or slightly lower: its baseline draws sit low (99.0-99.4
  %), every variant there lands 99.4-99.6 %.
- Bias correction: a small real effect on the logits, the only one here: cosine up on every
  draw of the bundled model (0.9987 -> 0.9989) and, combined with equalization, of the old
  one (0.9944 -> 0.9946-0.9947; alone there it stays 0.9944 on average). Agreement: old 98.3
  % alone (+3, +3, -1: inside the noise), 98.4 % / 98.6 % combined with equalization alpha
  0.5 / 0.75 (the only rows above the baseline on every draw), bundled 99.4-99.6 %. As
  predicted: it removes the mean of the error, not its variance, and the variance (the
  Softmax fed by int8 residuals, see `quant_recipes.md`: 16-bit activations give 99.7 %) is
  what costs the old model. At best +0.5 point (best of five variants, three draws): the old
  model stays 1.4 points under the 99 % bar.
- Verdict: neither goes into the product. Equalization costs a Mul and a requantization per
  folded Linear on every target for nothing measurable. Bias correction costs one
  quantize-and-run per Linear per target (18 here) for at most half a point on the model that
  needs it and nothing on the one that passes; the int8-ready finetune (bundled: 99.2 %
  baseline) and the int16 fallback already deliver the bar with margin.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only rewrite the .md from the .json")
    if parser.parse_args().report:  # rewrite the Markdown from the JSON (no measuring)
        out = json.loads((RESULTS / "quant_equalize.json").read_text())
        (RESULTS / "quant_equalize.md").write_text(write_markdown(out["rows"], out["details"]))
        return
    torch.set_num_threads(1)
    ort.SessionOptions = _OneThread  # the quantizer's calibration sessions too
    models = [("vit-mnist-un (bundled)", examples.path("vit-mnist-un"))]
    if OLD_VIT.is_file():
        models.insert(0, ("vit-mnist-un, momentum 0.9 (old)", OLD_VIT))
    else:
        print(f"{OLD_VIT} not found: only the bundled model is measured")
    rows, details = [], {}
    for label, source in models:
        with tempfile.TemporaryDirectory() as scratch:
            found, details[label] = run_model(label, source, Path(scratch))
            rows += found
    RESULTS.mkdir(exist_ok=True)
    out = {"rows": rows, "details": details}
    (RESULTS / "quant_equalize.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "quant_equalize.md").write_text(write_markdown(rows, details))
    print(f"wrote {RESULTS / 'quant_equalize.md'}")


if __name__ == "__main__":
    main()
