"""A target's time budget (``quant.deadline``), on the bundled trained UN ViT and its own data:
a search for a file within the drift bars that cannot finish in the time left stops and ships
its best file so far, over the bar, with its figures and a warning that says why, instead of
running the whole job into its timeout."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_un import examples
from quant.deadline import NO_DEADLINE, STOPPED, Deadline, SearchStopped, watching
from quant.measure.bars import Bars
from quant.measure.drift import Drift, measure_drift, onnx_runner
from quant.ort.bias_correction import correct_biases
from quant.ort.quantize import preprocess_once, quantize_onnx
from quant.ort.search import finish_estimate
from quant.ort.target import build_onnx_target
from quant.pipeline import convert
from quant.targets import PROFILES, TargetProfile
from quant.targets.builder import TargetJob
from quant.tflite.mixed import MixedResult

from .deadlines import StartsButCannotRun


def test_a_search_out_of_time_ships_its_first_file_over_the_bar(tmp_path: Path) -> None:
    """At a 0.0-point bar the cpu target climbs its int8 ladder, then widens tensors to int16
    (tests/test_quant_pipeline.py). With one second left when the conversion starts, its first
    recipe still runs (there is nothing to ship without it), then the search stops."""
    out = tmp_path / "out"
    report = convert(
        examples.path("vit-mnist-un"), targets=[PROFILES["cpu"]], out_dir=out, max_drift=0.0,
        latency_runs=3, deadline=time.time() + 1,
    )  # fmt: skip
    cpu = report.targets["cpu"]
    assert cpu.status == "over_bar" and cpu.drift is not None and not cpu.drift.within_bar
    assert [trial.recipe for trial in cpu.recipes_tried] == [PROFILES["cpu"].recipe]
    assert cpu.excluded == [] and cpu.int16_tensors == []  # no fallback step started
    # the file shipped is the one measured: its figures are the first recipe's
    first = cpu.recipes_tried[0]
    assert (cpu.drift.agreement, cpu.drift.top1_drop_pts) == (first.agreement, first.top1_drop_pts)
    (stopped,) = [w for w in cpu.warnings if "stopped" in w]
    assert "stopped after 1 int8 recipe(s)" in stopped and "int8 recipe 2" in stopped
    assert "s of checks after it" in stopped  # estimated from the drift pass it measured
    assert "EDGE_UN_JOB_TIMEOUT_S" in stopped and "best measured so far" in stopped
    (artifact,) = [a for a in cpu.artifacts if a.name == "cpu/model_int8.onnx"]
    assert hashlib.sha256((out / artifact.name).read_bytes()).hexdigest() == artifact.sha256
    assert stopped in " ".join((out / "report.md").read_text().split())


def test_bias_correction_stops_between_its_passes_once_the_deadline_passed(vit_onnx) -> None:
    """A ladder step already started (bias correction: one bias after another) stops before its
    next bias when the deadline it watches has passed, before it changed a bias; with time
    left it corrects them all."""
    cpu = PROFILES["cpu"]
    fp32_path = vit_onnx["fp32"]["cpu"]
    quantized = vit_onnx["dir"] / "cpu_int8.onnx"
    quantize_onnx(fp32_path, quantized, cpu, vit_onnx["calibration"])
    model, fp32 = onnx.load(str(quantized)), onnx.load(str(fp32_path))
    before = model.SerializeToString()
    with watching(Deadline(time.time() - 1)), pytest.raises(SearchStopped):
        correct_biases(model, fp32, vit_onnx["calibration"])
    assert model.SerializeToString() == before
    with watching(Deadline(time.time() + 3600)):
        assert correct_biases(model, fp32, vit_onnx["calibration"]) > 0
    assert model.SerializeToString() != before


def test_a_quantization_stops_after_its_preparation_and_between_calibration_batches(
    vit_onnx: dict, tmp_path: Path
) -> None:
    """A step's quantization checks its deadline when ORT's pre-processing ends and before each
    batch of ORT's MinMax calibration (a first recipe without bias correction checked nowhere:
    its whole quantization was one unwatched stretch, which made the budget hold back the next
    step by all of it). Past the deadline it stops there, before writing its file."""
    cpu, calibration = PROFILES["cpu"], vit_onnx["calibration"]
    fp32_path = vit_onnx["fp32"]["cpu"]
    assert not cpu.bias_correction  # the first recipe: no bias correction, whose loop checks
    (tmp_path / "stopped").mkdir()
    with watching(Deadline(time.time() - 1)), pytest.raises(SearchStopped):
        preprocess_once(fp32_path, cpu, calibration, tmp_path / "stopped")
    preparation = preprocess_once(fp32_path, cpu, calibration, tmp_path)
    out = tmp_path / "cpu_int8.onnx"
    with watching(Deadline(time.time() - 1)), pytest.raises(SearchStopped):
        quantize_onnx(fp32_path, out, cpu, calibration, preparation=preparation)
    assert not out.exists() and not preparation.ranges.exists()  # stopped before any range
    with watching(Deadline(time.time() + 3600)):
        quantize_onnx(fp32_path, out, cpu, calibration, preparation=preparation)
    assert out.exists() and preparation.ranges.exists()


def test_a_step_starts_only_if_it_and_the_rest_of_the_build_fit() -> None:
    now = time.time()
    assert Deadline().allows(1e9)  # no deadline
    assert Deadline(now + 100).allows(40)  # 40 s step, 40 s after it: fits in 100
    assert not Deadline(now + 100).allows(60)
    # what follows the search as the builder measured it: a 60 s step and 30 s after it fit
    assert Deadline(now + 100).allows(60, 30) and not Deadline(now + 100).allows(60, 45)
    assert Deadline(now + 100).less(30).left() < 71


def test_a_drift_pass_stops_between_two_batches_and_the_watch_measures_the_step(
    vit_onnx: dict,
) -> None:
    fp32, evaluation = vit_onnx["fp32"]["tda4vm"], vit_onnx["evaluation"]  # batch 1: 300 runs
    run = onnx_runner(fp32)
    with watching(Deadline(time.time() - 1)), pytest.raises(SearchStopped):
        run(evaluation.feeds)
    started = time.monotonic()
    with watching(NO_DEADLINE) as watch:
        time.sleep(0.5)  # the step's stretch before its first check
        run(evaluation.feeds)
    assert 0.5 <= watch.longest_gap_s < time.monotonic() - started
    run(evaluation.feeds)  # watched by nothing: never stopped


def search_job(vit_onnx: dict, tmp_path: Path, profile: TargetProfile) -> TargetJob:
    """The bundled ViT for ``profile`` with a bar no file meets, so every step of its search
    runs, and a deadline that stops each step after the first at its first check."""
    fp32, evaluation = vit_onnx["fp32"][profile.name], vit_onnx["evaluation"]
    (tmp_path / profile.name).mkdir()
    return TargetJob(
        profile=profile, fp32_path=fp32, target_dir=tmp_path / profile.name, out_dir=tmp_path,
        calibration=vit_onnx["calibration"], evaluation=evaluation,
        reference=onnx_runner(fp32)(evaluation.feeds), bars=Bars(0.0, 1.01),
        stage=lambda name, fraction, detail=None: None, latency_runs=2,
        deadline=StartsButCannotRun(time.time() + 3600),
    )  # fmt: skip


def shipped_drift(job: TargetJob) -> tuple[float, float | None]:
    outputs = onnx_runner(job.target_dir / "model_int8.onnx", exact=True)(job.evaluation.feeds)
    drift = measure_drift(job.reference, outputs, job.evaluation.labels)
    return drift.agreement, drift.top1_drop_pts


@pytest.mark.parametrize("search", ["int8 ladder", "int16 fallback"])
def test_a_step_cut_short_ships_the_last_file_measured(
    vit_onnx: dict, tmp_path: Path, search: str
) -> None:
    """The cpu target's second step starts (there is time for it), is stopped part way, and
    the file on disk is again the one the first step measured, with that step's figures."""
    cpu = PROFILES["cpu"]
    profile = cpu if search == "int8 ladder" else dataclasses.replace(cpu, int8_ladder=())
    job = search_job(vit_onnx, tmp_path, profile)
    result = build_onnx_target(job)
    (first,) = result.recipes_tried
    assert first.recipe == cpu.int8_recipes[0].recipe and result.drift is not None
    assert result.excluded == [] and result.int16_tensors == []
    assert (result.drift.agreement, result.drift.top1_drop_pts) == (
        first.agreement,
        first.top1_drop_pts,
    )
    assert shipped_drift(job) == (first.agreement, first.top1_drop_pts)
    (stopped,) = [w for w in result.warnings if w.startswith(STOPPED)]
    step = "int8 recipe 2" if search == "int8 ladder" else "4 tensors to int16"
    assert f"{step} was stopped part way" in stopped


def test_a_per_op_int16_step_the_deadline_reaches_stops_part_way_and_keeps_the_pure_file(
    tmp_path: Path,
) -> None:
    """imx93's per-op fallback (``quant.tflite.mixed``): a step that has time to start but whose
    drift pass runs into what must stay for the checks after the ladder is stopped part way; the
    pure int8 file ships and no wider fallback starts. With time, the same ladder measures its
    steps (the control: what stopped it was the deadline)."""
    from converters.fold_and_export import load_and_fold
    from quant.prepare import tflite_program
    from quant.samples import Samples
    from quant.tflite.direct import convert_direct
    from quant.tflite.litert import run_tflite
    from quant.tflite.mixed import mixed_ladder

    imx93 = PROFILES["imx93"]
    program, why = tflite_program(load_and_fold(examples.path("vit-mnist-un")), [imx93], tmp_path)
    assert program is not None, why
    images = {"images": np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32)}
    samples = Samples(images, None, "random")
    converted = convert_direct(program, samples, tmp_path / "work")
    reference = run_tflite(converted.float32, images)

    def measure(path: Path) -> Drift:
        return measure_drift(reference, run_tflite(path, images), None)

    pure = measure(converted.int8)

    def ladder(deadline: Deadline) -> tuple[MixedResult, list[str]]:
        job = TargetJob(
            profile=imx93, bars=Bars(0.0, 1.01), fp32_path=tmp_path / "unused.onnx",
            target_dir=tmp_path, out_dir=tmp_path, latency_runs=2, calibration=samples,
            evaluation=samples, reference=reference,
            stage=lambda name, fraction, detail=None: None, deadline=deadline,
        )  # fmt: skip
        stopped: list[str] = []
        return mixed_ladder(converted, converted.int8, job, pure, measure, stopped, 5.0), stopped

    cut, stopped = ladder(StartsButCannotRun(time.time() + 3600))
    assert cut.out_of_time and cut.file is None and cut.steps == [] and cut.drift == pure
    (note,) = stopped
    assert "after 0 per-op fallback step(s): the step of 4 ops was stopped part way" in note
    assert "~5 s for the checks after it" in note and "best measured so far" in note

    timed, stopped = ladder(Deadline(time.time() + 3600))
    assert not timed.out_of_time and len(timed.steps) >= 2 and timed.steps[0].tensors
    assert not any("stopped part way" in note for note in stopped)


def test_the_checks_after_a_search_grow_with_the_passes_they_run_not_with_the_drift_pass() -> None:
    """What a QDQ build runs after its search (``quant.ort.search.finish_estimate``): the SQNR
    and latency runs are a fixed number of samples, so a long drift pass over many held-out
    samples does not make them long; only the pass on this host's kernels (cpu) runs every
    sample. The trained BERT-base's tda4vm build (a 335 s pass of 2562 samples, ~45 s of checks
    after it) was once asked for 4 passes, 1340 s, and stopped its ladder with 1083 s left."""
    tda4vm = finish_estimate(335.0, 2562, host_pass=False)
    assert 45 < tda4vm < 120
    # the same cost a sample over twice the samples: the fixed parts do not grow
    assert finish_estimate(670.0, 5124, host_pass=False) == pytest.approx(tda4vm)
    cpu = finish_estimate(335.0, 2562, host_pass=True)
    assert cpu > 0.7 * 335.0 > tda4vm  # cpu's host-kernel pass runs every sample
    # the random BERT-base's cpu build, 100 samples: its checks took 2.7-3.0 passes
    assert finish_estimate(19.0, 100, host_pass=True) > 3.0 * 19.0
