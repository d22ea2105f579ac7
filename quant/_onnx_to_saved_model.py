"""onnx2tf's TensorFlow model of an ONNX file as a plain saved_model. Runs INSIDE the tool env.

Invoked by path with the tool environment's python (``quant.tflite`` does it), never imported by
the main venv. Why not the ``onnx2tf`` command: once it has built the model it writes a float32
and a float16 TFLite file through TensorFlow's Keras converter path, which first serialises the
Keras config of every layer to JSON; onnx2tf hands each weight to its layer as a constant
argument, so that config holds every weight as a JSON list of floats. On a BERT-base-sized model
(110 M parameters, 2 cores) the float32 file alone took over 14 min at 9 GB resident, and the
float16 file, which we never use, would have taken as long again. Here the model's function is
saved as a saved_model with no Keras metadata (81 s at 4.2 GB for the same model), which
``_tf_convert.py`` then converts (float32 26 s, int8 72 s).

    python _onnx_to_saved_model.py MODEL.onnx SAVED_MODEL_DIR

The model is built by ``onnx2tf.convert`` with the command's defaults (onnxsim first, the same
per-node log on stdout, which ``quant.onnx2tf_log`` reads the tensor map from). The saved_model
has one signature, ``serving_default``, whose input keys are the ONNX input names, as onnx2tf's
own saved_model has.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import onnx2tf
import tensorflow as tf

SIGNATURE = "serving_default"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("onnx")
    parser.add_argument("saved_model")
    args = parser.parse_args()

    model = onnx2tf.convert(
        input_onnx_file_path=args.onnx,
        output_folder_path=args.saved_model,
        disable_model_save=True,  # build only: we save it below, without the Keras path
    )
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
