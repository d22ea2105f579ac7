"""Pure int8 post-training quantization of a checkpoint with ONNX Runtime, and its accuracy.

The measurement used by benchmarks/finetune.py: fold and export the checkpoint
(``converters.pipeline.convert``, opset 18), then ``quant_pre_process`` and ``quantize_static``
in QDQ format, per-channel int8 weights, symmetric int8 activations, MinMax calibration on the
first 256 samples of the checkpoint's training split; evaluated on its 1000-sample test split
against the fp32 ONNX model (top-1 agreement) and the labels (accuracy drop).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import (
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

import edge_un
from converters.pipeline import convert
from edge_un import data as edge_data
from quant.drift import onnx_runner
from quant.ort_int8 import SamplesReader

CALIBRATION_SAMPLES = 256


def int8_quality(checkpoint: str | Path, work_dir: str | Path | None = None) -> dict[str, Any]:
    """fp32 and pure-int8 ORT accuracy of ``checkpoint`` on its test split, and their agreement."""
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(work_dir or scratch)
        convert(checkpoint, work, opset=18)
        fp32, pre, int8 = work / "model.onnx", work / "model.pre.onnx", work / "model.int8.onnx"
        quant_pre_process(str(fp32), str(pre))
        _, info = edge_un.load_checkpoint(checkpoint)
        train_x, _ = edge_data.checkpoint_split(info, "train")
        test_x, test_y = edge_data.checkpoint_split(info, "test")
        calibration = train_x[:CALIBRATION_SAMPLES].numpy()
        name = ort.InferenceSession(str(pre), providers=["CPUExecutionProvider"]).get_inputs()[0]
        quantize_static(
            str(pre),
            str(int8),
            SamplesReader(name.name, calibration, batch=32),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"ActivationSymmetric": True},
        )
        reference = onnx_runner(fp32)(test_x.numpy())
        quantized = onnx_runner(int8)(test_x.numpy())
    labels = test_y.numpy()
    fp32_accuracy = float((reference.argmax(-1) == labels).mean())
    int8_accuracy = float((quantized.argmax(-1) == labels).mean())
    cos = (reference * quantized).sum(-1) / (
        np.linalg.norm(reference, axis=-1) * np.linalg.norm(quantized, axis=-1) + 1e-12
    )
    return {
        "samples": len(labels),
        "fp32_accuracy": fp32_accuracy,
        "int8_accuracy": int8_accuracy,
        "drop_points": 100.0 * (fp32_accuracy - int8_accuracy),
        "agreement": float((reference.argmax(-1) == quantized.argmax(-1)).mean()),
        "logit_cosine": float(cos.mean()),
    }


if __name__ == "__main__":
    import json
    import sys

    for path in sys.argv[1:]:
        print(path, json.dumps(int8_quality(path)))
