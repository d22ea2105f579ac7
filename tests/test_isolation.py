"""Each target is built in a process of its own: a native crash (SIGABRT), an error or a bug in
one target fails that target with a one-line reason, the others complete and the report is
written. The crashing builders (tests/crash_builders.py) replace a real one for one target."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

import quant.pipeline
from converters.progress import ProgressEvent
from edge_un import examples
from quant.isolation import (
    MESSAGES,
    BuildFailed,
    BuildOrder,
    Built,
    StageReached,
    builder_for,
)
from quant.measure.bars import DEFAULT_BARS, Bars
from quant.measure.drift import Drift
from quant.pipeline import convert
from quant.report import LayerError, Report, TargetResult
from quant.report.records import drift_record, finite
from quant.report.verdict import verdicts
from quant.targets import PROFILES, parse_targets
from quant.targets.builder import TargetSettings
from service.report_html import escape
from service.server.web.pages import verdict_table


@pytest.fixture
def imx93_builder(monkeypatch: pytest.MonkeyPatch):
    """Replace the imx93 target's builder by the named one of tests/crash_builders.py."""

    def use(name: str) -> None:
        def chosen(profile):
            return (
                f"tests.crash_builders:{name}" if profile.name == "imx93" else builder_for(profile)
            )

        monkeypatch.setattr(quant.pipeline, "builder_for", chosen)

    return use


def run(out: Path) -> tuple[Report, list[str]]:
    """Convert for cpu and imx93; the report and the progress stages the caller saw."""
    stages: list[str] = []
    report = convert(
        examples.path("vit-mnist-un"), targets=parse_targets("cpu,imx93"), out_dir=out,
        latency_runs=5, progress=lambda event: stages.append(event.label),
    )  # fmt: skip
    assert (out / "report.json").read_text() == report.model_dump_json(indent=2) + "\n"
    assert report.targets["cpu"].status == "ok"  # the other target completed
    return report, stages


def test_a_native_abort_fails_only_its_target_and_says_where(tmp_path: Path, imx93_builder):
    imx93_builder("abort_in_drift")
    report, stages = run(tmp_path / "out")
    imx93 = report.targets["imx93"]
    assert imx93.status == "failed" and imx93.drift is None and imx93.artifacts == []
    assert imx93.error == (
        f"the imx93 build crashed in native code (killed by {signal.SIGABRT.name}) during "
        "'drift (LiteRT)'; its output is in imx93/build.log"
    )
    log = (tmp_path / "out" / "imx93" / "build.log").read_text()
    assert "LiteRT: tensor type mismatch" in log
    assert "imx93: drift (LiteRT)" in stages  # the child's progress reached the caller
    assert "failed" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    ("builder", "error"),
    [
        ("raise_tool_error", "the converter refused the model: op Foo has no int8 kernel"),
        ("raise_key_error", "internal error: KeyError: 'missing'"),
        (
            "raise_numpy_error",
            "internal error: ValueError: cannot reshape array of size 3 into shape (2,2)",
        ),
    ],
)
def test_an_error_in_a_target_is_its_one_line_reason(
    tmp_path: Path, imx93_builder, builder: str, error: str
) -> None:
    imx93_builder(builder)
    report, _ = run(tmp_path / "out")
    assert report.targets["imx93"].status == "failed"
    assert report.targets["imx93"].error == error
    assert not (tmp_path / "out" / "imx93" / "build.log").exists()  # kept for crashes only
    # the web page's verdict says the same, in the row under the target's
    verdict = next(v for v in verdicts(report) if v.target == "imx93")
    assert (verdict.status, verdict.error, verdict.agreement) == ("failed", error, None)
    assert f'<td colspan="6" class="error">{escape(error)}</td>' in verdict_table([verdict])


def test_when_every_target_fails_the_cli_shows_each_targets_own_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No target built: the report is still written with an fp32 reference, and the command
    line prints every target's own reason (not an unrelated export error) and exits 1."""
    from service.cli.app import main

    builders = {"cpu": "raise_tool_error", "imx93": "abort_in_drift"}
    monkeypatch.setattr(
        quant.pipeline, "builder_for",
        lambda profile: f"tests.crash_builders:{builders[profile.name]}",
    )  # fmt: skip
    out = tmp_path / "out"
    code = main(["convert", "vit-mnist-un", "--target", "cpu,imx93", "-o", str(out)])
    printed = " ".join(capsys.readouterr().out.split())  # the table wraps long reasons
    assert code == 1
    report = Report.read(out / "report.json")
    assert [t.status for t in report.targets.values()] == ["failed", "failed"]
    assert report.reference.top1_fp32 is not None  # the fp32 export still ran once
    assert "op Foo has no int8 kernel" in printed
    assert "killed by SIGABRT" in printed and "imx93/build.log" in printed


@pytest.mark.parametrize("name", list(PROFILES))
def test_a_build_order_crosses_to_the_child_whole(name: str, tmp_path: Path) -> None:
    """Every profile (its tuples, frozensets and literals) and the bars come back equal."""
    settings = TargetSettings(
        profile=PROFILES[name], bars=Bars(0.25, 0.98), fp32_path=tmp_path / "m.onnx",
        target_dir=tmp_path / name, out_dir=tmp_path, latency_runs=3, shared_dir=tmp_path / "s",
    )  # fmt: skip
    order = BuildOrder(
        builder=builder_for(PROFILES[name]), settings=settings, calibration=tmp_path / "c",
        evaluation=tmp_path / "e", reference=tmp_path / "r.npy",
    )  # fmt: skip
    back = BuildOrder.model_validate_json(order.model_dump_json())
    assert back == order and back.settings.profile == PROFILES[name]
    assert isinstance(back.settings.profile.float_inputs, frozenset)
    assert isinstance(back.settings.profile.artifacts, tuple)
    assert back.settings.profile.builder is PROFILES[name].builder
    document = order.model_dump(mode="json")
    document["settings"]["profile"]["int8_ladder"] = ["nope"]
    with pytest.raises(ValidationError, match="unknown int8 recipes"):  # the profile's own check
        BuildOrder.model_validate(document)


def test_each_message_comes_back_as_its_own_type() -> None:
    event = ProgressEvent("fallback", 0.4, detail="8 tensors to int16")
    sent = [StageReached(event=event), Built(result=TargetResult()), BuildFailed(reason="why")]
    back = [MESSAGES.validate_json(message.model_dump_json()) for message in sent]
    assert back == sent
    assert back[0].event == event  # the event itself, not a label to parse
    with pytest.raises(ValidationError):
        MESSAGES.validate_json('{"kind": "progress", "stage": "x"}')


def test_a_result_with_infinite_sqnr_comes_back_whole() -> None:
    """A tensor whose fp32 values are infinite (a mask filled with -inf) has no finite SQNR.
    JSON has no infinity: the record holds None, and the result crosses the process boundary
    equal (a -inf there used to fail the target: 'Input should be a valid number')."""
    figure = Drift(None, None, None, 1.0, 1.0, 0.0, 100)
    layers = [
        LayerError(name=name, op="SELECT_V2", sqnr_db=finite(db), own_sqnr_db=finite(own))
        for name, db, own in [("mask", -math.inf, math.inf), ("nan", math.nan, 12.5)]
    ]
    drift = drift_record(figure, "imx93/model_int8.tflite", layers, DEFAULT_BARS, "litert")
    sent = Built(result=TargetResult(drift=drift))
    back = MESSAGES.validate_json(sent.model_dump_json())
    assert back == sent
    assert [(layer.sqnr_db, layer.own_sqnr_db) for layer in back.result.drift.worst_layers] == [
        (None, None),
        (None, 12.5),
    ]
