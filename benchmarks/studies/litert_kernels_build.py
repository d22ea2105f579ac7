"""Builder for benchmarks.studies.litert_kernels; runs in the TFLite converter venv (TensorFlow).

    <converter venv>/bin/python -m benchmarks.studies.litert_kernels_build OUT_DIR

Writes ``<kernel>_int8.tflite`` (full integer, int8 in and out, calibrated on 8 random batches)
and ``<kernel>_fp32.tflite`` for each kernel of a ViT-Tiny block, with its shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tensorflow as tf

TOKENS, DIM, HEADS, HIDDEN = 197, 192, 3, 768
HEAD_DIM = DIM // HEADS


def kernels(rng: np.random.Generator) -> dict:
    """name -> (function, input shapes)."""
    fc1 = tf.constant(rng.standard_normal((DIM, HIDDEN)).astype(np.float32) / 14)
    fc2 = tf.constant(rng.standard_normal((HIDDEN, DIM)).astype(np.float32) / 28)
    return {
        "batch_matmul_scores": (
            tf.matmul,
            [(1, HEADS, TOKENS, HEAD_DIM), (1, HEADS, HEAD_DIM, TOKENS)],
        ),
        "batch_matmul_values": (
            tf.matmul,
            [(1, HEADS, TOKENS, TOKENS), (1, HEADS, TOKENS, HEAD_DIM)],
        ),
        # the same product one head at a time as plain 2-D MatMuls (what onnx2tf's
        # --enable_batchmatmul_unfold writes): does the converter find a faster op for them?
        "batch_matmul_scores_unrolled": (
            lambda q, k: tf.stack([tf.matmul(q[0, h], k[0, h]) for h in range(HEADS)])[None],
            [(1, HEADS, TOKENS, HEAD_DIM), (1, HEADS, HEAD_DIM, TOKENS)],
        ),
        "softmax": (lambda x: tf.nn.softmax(x, -1), [(1, HEADS, TOKENS, TOKENS)]),
        "gelu": (lambda x: tf.nn.gelu(x, approximate=False), [(1, TOKENS, HIDDEN)]),
        "fc1": (lambda x: tf.matmul(tf.reshape(x, (TOKENS, DIM)), fc1), [(1, TOKENS, DIM)]),
        "fc2": (lambda x: tf.matmul(tf.reshape(x, (TOKENS, HIDDEN)), fc2), [(1, TOKENS, HIDDEN)]),
        "add": (tf.add, [(1, TOKENS, DIM), (1, TOKENS, DIM)]),
        "transpose": (lambda x: tf.transpose(x, (0, 2, 1, 3)), [(1, TOKENS, HEADS, HEAD_DIM)]),
    }


def convert(function, shapes: list, int8: bool, rng: np.random.Generator) -> bytes:
    wrapped = tf.function(function)
    concrete = wrapped.get_concrete_function(*[tf.TensorSpec(s, tf.float32) for s in shapes])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], wrapped)
    if int8:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: (
            [rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(8)
        )
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.int8
        converter.inference_output_type = tf.int8
    return converter.convert()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    out = parser.parse_args().out_dir
    rng = np.random.default_rng(0)
    for name, (function, shapes) in kernels(rng).items():
        for kind in ("int8", "fp32"):
            data = convert(function, shapes, kind == "int8", rng)
            (out / f"{name}_{kind}.tflite").write_bytes(data)


if __name__ == "__main__":
    main()
