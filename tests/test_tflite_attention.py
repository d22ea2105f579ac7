"""LiteRT's XNNPACK runs the int8 attention of the bundled ViT's TFLite file (issue 32).

XNNPACK's delegate (LiteRT >= 2.1.3) refuses an int8 BATCH_MATMUL whose right operand has a
zero point other than 0, and TensorFlow's converter gives K and V asymmetric zero points: every
attention product fell to TFLite's reference kernel. ``quant.tflite.symmetric`` requantizes
each right operand where it is computed. One conversion of the bundled trained UN ViT (the
imx93/imx8mp export, ~25 s) gives the converter's file and the symmetric one; the bundled HF
BERT's files are checked where tests/test_hf_convert.py converts it.
"""

from __future__ import annotations

import numpy as np
import pytest

from quant.measure.bars import DEFAULT_BARS
from quant.measure.drift import measure_drift, onnx_runner
from quant.tflite.flatbuffer import check_full_integer, inspect_tflite
from quant.tflite.litert import run_tflite, xnnpack_ops
from quant.tflite.onnx2tf import convert_tflite
from quant.tflite.symmetric import make_matmul_operands_symmetric

MATMULS = 8  # the bundled ViT: 4 blocks, Q.K^T and P.V in each


@pytest.fixture(scope="module")
def files(vit_onnx: dict) -> dict:
    """The converter's int8 file (``converted.int8``) and the symmetric one made from it, the
    way ``convert_tflite`` makes it by default, with what changed (``groups``)."""
    work = vit_onnx["dir"] / "tflite"
    converted = convert_tflite(
        vit_onnx["fp32"]["imx93"], vit_onnx["calibration"].feeds, work, symmetric_matmul=False
    )
    symmetric = work / "model_int8_symmetric.tflite"
    groups = make_matmul_operands_symmetric(converted.int8, symmetric)
    return {"converted": converted, "symmetric": symmetric, "groups": groups}


def test_xnnpack_leaves_every_matmul_of_the_converters_file(files: dict) -> None:
    """The cause, as the interpreter reports it: none of the products is delegated."""
    asymmetric = files["converted"].int8
    assert inspect_tflite(asymmetric).op_histogram["BATCH_MATMUL"] == MATMULS
    assert xnnpack_ops(asymmetric)["BATCH_MATMUL"] == (MATMULS, 0)


def test_xnnpack_takes_every_matmul_of_the_symmetric_file(files: dict) -> None:
    info = inspect_tflite(files["symmetric"])
    check_full_integer(info, io_dtype="int8")  # nothing float was inserted
    assert info.op_histogram == inspect_tflite(files["converted"].int8).op_histogram
    assert xnnpack_ops(files["symmetric"])["BATCH_MATMUL"] == (MATMULS, MATMULS)
    # K and V of each block come from one qkv FULLY_CONNECTED through SPLIT, RESHAPE and
    # TRANSPOSE: that producer now writes zero point 0, its chain follows
    groups = files["groups"]
    assert len(groups) == 4 and sum(group.matmuls for group in groups) == MATMULS
    for group in groups:
        assert group.reason is None and group.producer == "FULLY_CONNECTED", group
        assert group.zero_point != 0 and group.tensors > 3
        low = (-128 - group.zero_point) * group.scale
        high = (127 - group.zero_point) * group.scale
        assert group.new_scale == pytest.approx(max(-low, high) / 127, rel=1e-6)
    # made once, nothing is left to change
    again = files["symmetric"].with_name("again.tflite")
    assert make_matmul_operands_symmetric(files["symmetric"], again) == ()


def test_the_symmetric_file_stays_within_the_drift_bars_on_the_test_split(
    files: dict, vit_onnx: dict
) -> None:
    test = vit_onnx["test"]
    reference = onnx_runner(vit_onnx["fp32"]["cpu"])(test.feeds)
    symmetric = run_tflite(files["symmetric"], test.feeds)
    drift = measure_drift(reference, symmetric, test.labels)
    assert drift.within(DEFAULT_BARS), drift
    # and it computes what the converter's file computes, up to the coarser K and V steps
    before = run_tflite(files["converted"].int8, test.feeds)
    assert np.mean(before.argmax(1) == symmetric.argmax(1)) >= 0.99
