"""onnx2tf's TensorFlow model of an ONNX file as a plain saved_model. Runs INSIDE the tool env.

Invoked by path with the tool environment's python (``quant.tflite.onnx2tf`` does it), never
imported by the main venv. Why not the ``onnx2tf`` command: once it has built the model it writes a
float32 and a float16 TFLite file through TensorFlow's Keras converter path, which first serialises
the Keras config of every layer to JSON; onnx2tf hands each weight to its layer as a constant
argument, so that config holds every weight as a JSON list of floats. On a BERT-base-sized model
(110 M parameters, 2 cores) the float32 file alone took over 14 min at 9 GB resident, and the
float16 file, which we never use, would have taken as long again. Here the model's function is
saved as a saved_model with no Keras metadata (81 s at 4.2 GB for the same model), which
``tf_convert.py`` then converts (float32 26 s, int8 72 s).

    python onnx_to_saved_model.py MODEL.onnx SAVED_MODEL_DIR CALIB.npz

The model is built by ``onnx2tf.convert`` with the command's defaults (onnxsim first, the same
per-node log on stdout, which ``quant.tflite.onnx2tf_log`` reads the tensor map from), except that
it is first built without onnx2tf's strict mode and checked against ONNX Runtime instead.
Strict mode runs a TensorFlow model up to many a MatMul, Reshape or Add to choose among the
layouts that fit the shapes. On BERT-base this script took 77-91 s strict and 55-60 s fast,
the check included (three runs each, alone on the 2-core host), and both builds' outputs were
5.4e-8 from ONNX Runtime's on 32 evaluation samples. A model that needs the choice comes out
wrong, not failing (a 16-token, 16-channel text model does), so the fast build's outputs on
the first calibration samples (CALIB.npz, as ``tf_convert.py`` reads it) are compared with
ONNX Runtime's, and a model that disagrees is built again in strict mode. A model wrong in both
builds is refused (exit 1, one line on stderr) rather than converted into a file that computes
something else: onnx2tf takes an axis for channels where two are as long, as in a text model
with as many tokens as channels (HF BERT with 32 of each: its logits 0.004 off, of 0.011).

The saved_model has one signature, ``serving_default``, whose input keys are the ONNX input
names, as onnx2tf's own saved_model has.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import onnx2tf
import onnxruntime as ort
import tensorflow as tf
import tf_keras  # onnx2tf's Keras

# A sibling script of the tool env (this one is run by path, so its directory is on sys.path):
# the calibration samples reach both TensorFlow steps the same way.
from tf_convert import calibration_for, to_saved_model_layout

SIGNATURE = "serving_default"
CHECK_SAMPLES = 4
# A wrong transposition changes the function (a weight used transposed, a sequence read as
# channels): errors of the outputs' own size. TensorFlow's and ONNX Runtime's float32 kernels
# differ by ~1e-7 of it (BERT-base: 5.4e-8 on logits of ~4).
AGREEMENT_RTOL = 1e-3


def onnx_outputs(onnx_path: str, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs on the first ``CHECK_SAMPLES`` samples, one batch-1 run each,
    every output concatenated over the samples."""
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = calibration_for(names, arrays)
    count = min(CHECK_SAMPLES, *(len(a) for a in feeds.values()))
    runs = [session.run(None, {n: feeds[n][i : i + 1] for n in names}) for i in range(count)]
    return [np.concatenate(outputs) for outputs in zip(*runs, strict=True)]


def tf_outputs(
    model: tf_keras.Model, arrays: dict[str, np.ndarray], count: int
) -> list[np.ndarray]:
    """The built model's outputs on the same samples, in its own layout."""
    keys = [t.name.split(":")[0] for t in model.inputs]
    feeds = [
        tf.constant(to_saved_model_layout(array[:count], tuple(t.shape), key), dtype=t.dtype)
        for (key, array), t in zip(calibration_for(keys, arrays).items(), model.inputs, strict=True)
    ]
    runs = []
    for i in range(count):
        out = model([feed[i : i + 1] for feed in feeds])
        runs.append([np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])])
    return [np.concatenate(outputs) for outputs in zip(*runs, strict=True)]


def disagreement(built: list[np.ndarray], reference: list[np.ndarray]) -> str | None:
    """Why the built model's outputs are not ONNX Runtime's (None when they are): the first
    output whose largest error exceeds ``AGREEMENT_RTOL`` of its largest value, or whose shape
    differs even read channels-first (onnx2tf makes image tensors channels-last)."""
    if len(built) != len(reference):
        return f"{len(built)} outputs, the ONNX model has {len(reference)}"
    for index, (got, want) in enumerate(zip(built, reference, strict=True)):
        if got.shape != want.shape and got.ndim >= 3:
            got = np.moveaxis(got, -1, 1)
        if got.shape != want.shape:
            return f"output {index} has shape {list(got.shape)}, ONNX's {list(want.shape)}"
        scale = max(float(np.abs(want).max()), 1e-6)
        error = float(np.abs(got.astype(np.float64) - want).max())
        if not error <= AGREEMENT_RTOL * scale:
            return f"output {index} is {error:.3g} off (its largest value {scale:.3g})"
    return None


def build(onnx_path: str, out_dir: str, *, strict: bool) -> tf_keras.Model:
    return onnx2tf.convert(
        input_onnx_file_path=onnx_path,
        output_folder_path=out_dir,
        disable_model_save=True,  # build only: we save it below, without the Keras path
        disable_strict_mode=not strict,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("onnx")
    parser.add_argument("saved_model")
    parser.add_argument("calib", help="the calibration samples, as tf_convert.py takes them")
    args = parser.parse_args()

    with np.load(args.calib, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    # Before the build: onnx2tf saves its simplified model over its input.
    reference = onnx_outputs(args.onnx, arrays)
    model = build(args.onnx, args.saved_model, strict=False)
    reason = disagreement(tf_outputs(model, arrays, len(reference[0])), reference)
    if reason is not None:
        # The tensor map is read from the last "Model conversion started" on (onnx2tf_log).
        print(f"the fast build disagrees with ONNX Runtime ({reason}); strict mode", flush=True)
        del model
        gc.collect()
        model = build(args.onnx, args.saved_model, strict=True)
        reason = disagreement(tf_outputs(model, arrays, len(reference[0])), reference)
    if reason is not None:
        print(  # one line under tool_sandbox's 300 characters
            f"error: onnx2tf's TensorFlow model does not compute what the ONNX model does "
            f"({reason}): onnx2tf takes an axis for channels where two are as long (text: use "
            "a sequence length other than the hidden size)",
            file=sys.stderr,
        )
        return 1
    print("the TensorFlow model agrees with ONNX Runtime", flush=True)
    serve = tf.function(
        lambda *inputs: model(inputs),
        input_signature=[tf.TensorSpec(t.shape, t.dtype, t.name) for t in model.inputs],
    )
    module = tf.Module()
    module.serve = serve  # tracked, so the saved_model holds the function's constants
    # The model's variables are tracked too (onnx2tf gives a LayerNormalization Keras variables
    # for its gamma and beta): untracked, saving a LayerNorm model fails ("an 'untracked'
    # resource"). The variables, not the Keras model: a tracked Keras model brings its Keras
    # metadata back (every layer's config as JSON, weights included), the path this script
    # exists to avoid; on BERT-base that was 7.6 min and 21 GB resident instead of 81 s and 4 GB.
    module.model_variables = list(model.variables)
    tf.saved_model.save(
        module, args.saved_model, signatures={SIGNATURE: serve.get_concrete_function()}
    )
    print(f"saved_model written: {args.saved_model}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
