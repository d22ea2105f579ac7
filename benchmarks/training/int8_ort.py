"""Pure int8 post-training quantization of a checkpoint with ONNX Runtime, and its accuracy.

    python -m benchmarks.training.int8_ort CHECKPOINT ...   # one JSON line per checkpoint

The measurement used by benchmarks.training.finetune: fold and export the checkpoint
(``converters.fold_and_export.convert``, opset 18), then the product's quantizer
(``quant.ort.quantize.quantize_onnx``) with ``PROFILE``: QDQ, per-channel symmetric int8 weights,
symmetric int8 activations, MinMax calibration on the first 256 samples of the checkpoint's
training split, no 16-bit tensor; evaluated on its 1000-sample test split against the fp32 ONNX
model with the product's drift measure (``quant.measure.drift.measure_drift``: top-1 agreement, the
accuracy drop, and the cosine of all logits at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import edge_un
from converters.fold_and_export import convert
from edge_un import data as edge_data
from quant.measure.drift import measure_drift, onnx_runner
from quant.ort.quantize import quantize_onnx
from quant.samples import Samples, as_feeds
from quant.targets import PROFILES

CALIBRATION_SAMPLES = 256
# tda4vm's int8 rules (s8 symmetric activations, 8-bit s8 weights, the graph as exported)
# without its power-of-two scales: ONNX Runtime's quantizer with these options and nothing else.
PROFILE = dataclasses.replace(PROFILES["tda4vm"], power_of_two_scales=False)


def int8_quality(checkpoint: str | Path, work_dir: str | Path | None = None) -> dict[str, Any]:
    """fp32 and pure-int8 ORT accuracy of ``checkpoint`` on its test split, and their agreement."""
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(work_dir or scratch)
        fp32 = convert(checkpoint, work, opset=18).onnx_path
        _, info = edge_un.load_checkpoint(checkpoint)
        train_x, _ = edge_data.checkpoint_split(info, "train")
        test_x, test_y = edge_data.checkpoint_split(info, "test")
        calibration = Samples(
            as_feeds(train_x[:CALIBRATION_SAMPLES].numpy()), None, "checkpoint train split"
        )
        int8 = quantize_onnx(fp32, work / "model.int8.onnx", PROFILE, calibration)
        reference = onnx_runner(fp32)(test_x.numpy())
        quantized = onnx_runner(int8)(test_x.numpy())
    drift = measure_drift(reference, quantized, test_y.numpy())
    return {
        "samples": drift.samples,
        "fp32_accuracy": drift.top1_fp32,
        "int8_accuracy": drift.top1_int8,
        "drop_points": drift.top1_drop_pts,
        "agreement": drift.agreement,
        "cosine": drift.cosine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    for path in parser.parse_args().checkpoints:
        print(path, json.dumps(int8_quality(path)))


if __name__ == "__main__":
    main()
