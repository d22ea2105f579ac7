"""Run inside the litert-torch environment (``quant.tflite.toolenv.LITERT_TORCH``), never imported
by edge-un: the three steps of the direct route, each a command of its own
(``quant.tflite.direct``).

    convert   PROGRAM.pt2 SAMPLE.npz FLOAT.tflite
        litert-torch converts the folded torch program to a float .tflite; SAMPLE.npz holds one
        sample of each input, in the program's order.
    calibrate FLOAT.tflite CALIBRATION.npz RANGES.npz
        ai-edge-quantizer runs the float file over the calibration samples and keeps every
        tensor's min and max over all of them. Its default update is a moving average of each
        sample's (factor 0.95), which clips the rare large activations a transformer's residual
        stream has: on the bundled ViT the logits' SQNR fell to 13.6 dB and agreement to 99.7 %;
        with the plain min/max 99.8 %, cosine 0.9995, as TensorFlow's converter gives. Min/max
        is all it needs, so the interpreter's own profiler tracks them (its profiler-based
        mode) instead of Python copying out every tensor, weights included, after each sample
        (its default mode): the bundled ViT's 256 samples 11.6 s -> 0.65 s, the same ranges
        and the same int8 file, byte for byte, on the bundled ViT, text model and HF BERT.
    quantize  FLOAT.tflite RANGES.npz PLAN.json OUT.tflite
        static quantization from those ranges: per-channel int8 weights, per-tensor activations
        int8, the ops PLAN names (by output tensor) with int16 activations, or every op with
        int16 activations (``{"all_int16": true}``: the 16x8 file). One calibration serves every
        plan: ranges are of the float model, whatever the precision of each tensor.

Errors go to stderr as one line; the caller keeps the whole output as the step's log.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np


def convert(program: Path, sample: Path, out: Path) -> None:
    import litert_torch
    import torch

    program_module = torch.export.load(str(program)).module()
    with np.load(sample, allow_pickle=False) as arrays:
        inputs = {name: torch.from_numpy(arrays[name]) for name in arrays.files}

    if len(inputs) == 1:  # a single input needs no name (and keeps the modules' scopes)
        edge = litert_torch.convert(program_module, tuple(inputs.values()))
    else:  # named, so that the file's signature says which input is which
        try:
            edge = litert_torch.convert(program_module, sample_args=(), sample_kwargs=inputs)
        except (TypeError, ValueError):  # positional inputs: name them through a wrapper
            # (TypeError: a forward(*inputs); ValueError: a program exported with positional
            # arguments, e.g. a user's .pt2 of a text model, refuses keywords)
            edge = litert_torch.convert(
                _named(torch)(program_module, list(inputs)), sample_args=(), sample_kwargs=inputs
            )
    edge.export(str(out))


def _named(torch):
    class Named(torch.nn.Module):
        """A program taking its inputs by name (its scopes then start with this wrapper)."""

        def __init__(self, program, names: list[str]) -> None:
            super().__init__()
            self.program, self.names = program, names

        def forward(self, **named):
            return self.program(*(named[name] for name in self.names))

    return Named


def _signature_inputs(float_file: Path) -> tuple[str, list[str], dict[str, np.dtype]]:
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(str(float_file))
    key, signature = next(iter(interpreter.get_signature_list().items()))
    details = interpreter.get_signature_runner(key).get_input_details()
    return key, list(signature["inputs"]), {k: np.dtype(v["dtype"]) for k, v in details.items()}


def calibrate(float_file: Path, calibration: Path, ranges: Path) -> None:
    from ai_edge_quantizer import calibrator, quantizer, recipe
    from ai_edge_quantizer.utils import qsv_utils

    key, names, dtypes = _signature_inputs(float_file)
    with np.load(calibration, allow_pickle=False) as arrays:
        columns = {name: arrays[name] for name in arrays.files}
    if set(names) != set(columns):
        # a one-input program is converted positionally (its signature says args_0): the
        # calibration arrays are then taken in their saved order
        columns = dict(zip(names, columns.values(), strict=True))
    count = len(next(iter(columns.values())))
    # token ids arrive as int64; the converted program takes int32 (its default)
    samples = [
        {name: columns[name][i : i + 1].astype(dtypes[name]) for name in names}
        for i in range(count)
    ]
    plan = quantizer.Quantizer(str(float_file))
    plan.load_quantization_recipe(recipe.static_wi8_ai8())
    run = calibrator.Calibrator(
        plan._float_model_buffer,
        num_threads=1,
        mode=calibrator.CalibrationMode.CALIBRATION_PROFILER_BASED,
        qsv_update_func=qsv_utils.min_max_update,
    )
    run.calibrate({key: samples}, plan._recipe_manager)
    found = run.get_model_qsvs()
    ranks = _tensor_ranks(float_file)
    tensors = sorted(name for name, qsv in found.items() if qsv)
    arrays = {"names": np.array(tensors)}
    for index, name in enumerate(tensors):
        # as the default mode keeps them (float32, one element per axis), so that the
        # quantizer's arithmetic, and so the file, is the same whichever mode calibrated
        keep = (1,) * ranks[name]
        arrays[f"min{index}"] = np.asarray(found[name]["min"], np.float32).reshape(keep)
        arrays[f"max{index}"] = np.asarray(found[name]["max"], np.float32).reshape(keep)
    np.savez(ranges, **arrays)


def _tensor_ranks(float_file: Path) -> dict[str, int]:
    from ai_edge_litert.interpreter import Interpreter

    return {d["name"]: len(d["shape"]) for d in Interpreter(str(float_file)).get_tensor_details()}


def quantize(float_file: Path, ranges: Path, plan_file: Path, out: Path) -> None:
    from ai_edge_quantizer import qtyping, quantizer, recipe

    plan = json.loads(plan_file.read_text())
    with np.load(ranges, allow_pickle=False) as arrays:
        qsvs = {
            str(name): {"min": arrays[f"min{i}"], "max": arrays[f"max{i}"]}
            for i, name in enumerate(arrays["names"])
        }
    quantizing = quantizer.Quantizer(str(float_file))
    everything = recipe.static_wi8_ai16() if plan.get("all_int16") else recipe.static_wi8_ai8()
    quantizing.load_quantization_recipe(everything)
    for tensor in plan.get("int16", []):
        # an op's scope is its output names joined by ";", with a trailing ";"
        scope = f"^{re.escape(tensor)};$"
        quantizing.add_static_config(scope, qtyping.TFLOperationName.ALL_SUPPORTED, 16, 8)
    quantizing.quantize(qsvs, enable_progress_report=False).export_model(str(out), overwrite=True)


STEPS = {"convert": convert, "calibrate": calibrate, "quantize": quantize}


def main(argv: list[str]) -> int:
    step, *paths = argv
    started = time.monotonic()
    try:
        STEPS[step](*(Path(p) for p in paths))
    except Exception as error:  # the caller reads the last line; the log keeps the traceback
        import traceback

        traceback.print_exc()
        print(f"error: {step}: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps({"step": step, "seconds": round(time.monotonic() - started, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
