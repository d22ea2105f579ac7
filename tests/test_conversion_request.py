"""The one value a conversion is asked with (quant.request): what the library, the command line
and the service's workers build, and its checks, made before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.source import ModelSource
from edge_un import examples
from quant.errors import QuantError
from quant.measure.bars import DEFAULT_BARS, Bars
from quant.request import ConversionRequest, conversion_request
from quant.targets import PROFILES
from service.db import Job
from service.settings import Settings
from service.storage import make_store
from service.upload_layout import HF_DIRECTORY
from service.worker.steps import job_request


def test_what_a_person_writes_becomes_typed_values() -> None:
    request = conversion_request(
        "model.pt", "cpu,imx93", "calib.npz", "eval.npz", max_drift=0.25, min_agreement=0.98
    )
    assert request.model == ModelSource(Path("model.pt"), "pt")
    assert request.targets == (PROFILES["cpu"], PROFILES["imx93"])
    assert (request.calib, request.eval) == (Path("calib.npz"), Path("eval.npz"))
    assert request.bars == Bars(0.25, 0.98)
    every = conversion_request(examples.path("vit-mnist-un"))
    assert every.targets == tuple(PROFILES.values()) and every.bars == DEFAULT_BARS
    assert every.model.format == "safetensors"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"targets": ()}, "no targets to build"),
        ({"bars": Bars(-0.1, 0.99)}, "max_drift must be >= 0 points, got -0.1"),
        ({"recalibrate_batches": -1}, "recalibrate_batches must be >= 0, got -1"),
    ],
)
def test_a_request_that_cannot_run_is_refused_when_it_is_made(changes: dict, message: str) -> None:
    asked = {
        "model": ModelSource(Path("m.safetensors"), "safetensors"),
        "targets": (PROFILES["cpu"],),
    }
    with pytest.raises(QuantError, match=message):
        ConversionRequest(**(asked | changes))


def test_the_service_asks_for_what_the_job_recorded(tmp_path: Path) -> None:
    """A job's record and its upload directory become the request the pipeline runs: the model
    in the format its checks found, named after the uploaded file; only the files uploaded."""
    settings = Settings(data_dir=tmp_path, latency_runs=7)
    job = Job(
        id="j1", targets=["tda4vm", "cpu"], max_drift=0.3, model_format="hf",
        model_label="my-vit.zip", calib_label="c.npz", eval_label=None, config_label=None,
    )  # fmt: skip
    request = job_request(settings, make_store(settings), job)
    uploads = make_store(settings).upload_dir("j1")
    assert request.model == ModelSource(uploads / HF_DIRECTORY, "hf", name="my-vit")
    assert request.targets == (PROFILES["tda4vm"], PROFILES["cpu"])
    assert (request.calib, request.eval, request.config) == (uploads / "calib", None, None)
    assert request.bars.max_drift == 0.3 and request.latency_runs == 7
