"""A report's latency on a busy host: each timing says how busy other work kept the cores, the
summaries name the figures timed on a busy host, and assembling the report times such a figure
again once the builds are done (``quant.quiet_latency``).

One real conversion of the bundled UN ViT through the CLI (cpu, imx93 and imx8mp, which share
imx93's TFLite file); its files are timed again for real, in ONNX Runtime and LiteRT. Whether
its own figures were contended depends on what pytest's other worker was doing: the tests say
what must hold either way, and give a figure a busy host by hand where they need one.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

import edge_un
from edge_un import examples
from quant.quiet_latency import retime_contended
from quant.report import Report
from quant.report.summary import summary_markdown
from quant.samples import Feeds, checkpoint_samples
from service.cli.summary import print_summary
from service.report_html import render_report_html

CONTENDED = "timed while other work"  # how the summaries' note starts
TARGETS = "cpu,imx93,imx8mp"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Report]:
    out = tmp_path_factory.mktemp("convert") / "vit"
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "convert", "vit-mnist-un", "--target", TARGETS,
         "-o", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return out, result.stdout, Report.read(out / "report.json")


@pytest.fixture(scope="module")
def sample() -> Feeds:
    """The batch-1 input the report's timings ran on: the bundled model's first test sample."""
    _, info = edge_un.load_checkpoint(examples.path("vit-mnist-un"))
    return checkpoint_samples(info, "test").head(1).feeds


def _with_busy_cores(report: Report, busy: dict[tuple[str, int], float]) -> Report:
    """``report`` with every timing's ``others_busy_cores`` 0, except (target, row) in ``busy``."""
    targets = {}
    for name, target in report.targets.items():
        latency = [
            timing.model_copy(update={"others_busy_cores": busy.get((name, row), 0.0)})
            for row, timing in enumerate(target.latency)
        ]
        targets[name] = target.model_copy(update={"latency": latency})
    return report.model_copy(update={"targets": targets})


def test_each_timing_says_how_busy_the_host_was_and_the_summaries_say_when_it_was(
    converted: tuple[Path, str, Report],
) -> None:
    out, stdout, report = converted
    timings = [timing for target in report.targets.values() for timing in target.latency]
    assert timings and all(
        timing.others_busy_cores is not None and 0 <= timing.others_busy_cores <= report.host.cores
        for timing in timings
    )
    said = CONTENDED in " ".join(stdout.split())  # the terminal wraps long lines
    in_md = CONTENDED in (out / "report.md").read_text()
    assert said == in_md == any(timing.contended() for timing in timings)


def test_a_figure_timed_on_a_busy_host_is_named_in_every_summary(
    converted: tuple[Path, str, Report],
) -> None:
    _, _, report = converted
    busy = _with_busy_cores(report, {("cpu", 0): 1.5})
    named = f"cpu (onnxruntime, {busy.targets['cpu'].latency[0].artifact}, 1 thread): 1.5"
    console = Console(record=True, width=400)
    print_summary(console, busy)
    for text in (summary_markdown(busy), render_report_html(busy), console.export_text()):
        assert CONTENDED in text and named in text
        assert "imx93 (" not in text.split(CONTENDED)[1].split("These figures")[0]
    assert CONTENDED not in summary_markdown(_with_busy_cores(report, {}))


def test_a_figure_timed_on_a_busy_host_is_timed_again_and_the_quieter_kept(
    converted: tuple[Path, str, Report], sample: Feeds
) -> None:
    """The first cpu figure and imx93's first (the TFLite file imx8mp shares) as if timed with
    every core busy: each is timed again, in its own runtime, at its own thread count; the
    shared file once, for both targets; every other figure stays as it was."""
    out, _, report = converted
    cores = report.host.cores
    busy = _with_busy_cores(report, {("cpu", 0): cores, ("imx93", 0): cores, ("imx8mp", 0): cores})
    shared = {
        name: {a.name: a.sha256 for a in target.artifacts}[target.latency[0].artifact]
        for name, target in busy.targets.items()
    }
    assert shared["imx93"] == shared["imx8mp"]  # one file, in two targets' directories
    again = retime_contended(busy.targets, out, lambda: sample, runs=100)
    for name in ("cpu", "imx93"):
        first, second = busy.targets[name].latency[0], again[name].latency[0]
        assert second.retimed and second.others_busy_cores < cores
        assert (second.runtime, second.artifact, second.threads) == (
            first.runtime, first.artifact, first.threads,
        )  # fmt: skip
        assert second.p50_ms != first.p50_ms and second.xnnpack_ops == first.xnnpack_ops
    imx93, imx8mp = again["imx93"].latency[0], again["imx8mp"].latency[0]
    assert imx8mp == imx93.model_copy(update={"artifact": imx8mp.artifact})  # timed once
    for name, target in busy.targets.items():
        assert again[name].latency[1:] == target.latency[1:]


def test_no_figure_is_timed_again_past_the_deadline_or_without_its_file(
    converted: tuple[Path, str, Report], sample: Feeds, tmp_path: Path
) -> None:
    """The builds' deadline passed: the report's own share of the job's time is not spent on
    timing. A file that cannot be timed (gone): its first figure stands, with its note."""
    out, _, report = converted
    busy = _with_busy_cores(report, {("cpu", 0): 1.5, ("imx93", 1): 1.5})
    late = retime_contended(busy.targets, out, lambda: sample, 100, deadline=time.time() - 1)
    gone = retime_contended(busy.targets, tmp_path, lambda: sample, 100)
    assert late == gone == dict(busy.targets)
    assert "cpu (onnxruntime" in summary_markdown(busy.model_copy(update={"targets": gone}))


def test_assembling_the_report_times_again_a_figure_its_build_timed_on_a_busy_host(
    tmp_path: Path,
) -> None:
    """The pipeline's last step (the CLI's and the Celery report task's): the cpu target built,
    its part's first figure then marked as timed with every core busy (the others as quiet);
    the report assembled from the parts has that one timed again, says so in its progress, and
    writes what it returns; not when the part was built on another kind of machine."""
    from converters.progress import ProgressEvent, ignore_progress
    from quant.job_files import load_part, save_part
    from quant.pipeline import assemble, build_target
    from quant.prepare import prepare
    from quant.request import conversion_request

    out = tmp_path / "out"
    request = conversion_request(examples.path("vit-mnist-un"), "cpu")
    prepared = prepare(request, out, tmp_path / "work", ignore_progress)
    build_target(prepared, "cpu")
    part = load_part(prepared, "cpu")
    first, *rest = part.report.latency
    busy = first.model_copy(update={"others_busy_cores": float(part.host.cores)})
    rest = [timing.model_copy(update={"others_busy_cores": 0.0}) for timing in rest]  # quiet
    report = part.report.model_copy(update={"latency": [busy, *rest]})
    save_part(prepared, part.model_copy(update={"report": report}))
    events: list[ProgressEvent] = []
    assembled = assemble(prepared, progress=events.append)
    again = assembled.targets["cpu"].latency[0]
    assert again.retimed and again.others_busy_cores < part.host.cores
    assert assembled.targets["cpu"].latency[1:] == rest
    assert [e.stage for e in events] == ["latency", "report", "done"]
    written = Report.read(out / "report.json")
    assert written.targets["cpu"].latency == assembled.targets["cpu"].latency
    # built on another kind of machine (a Celery worker elsewhere): this host's timing is no
    # figure of that one's
    elsewhere = part.host.model_copy(update={"cpu": "another CPU"})
    save_part(prepared, part.model_copy(update={"report": report, "host": elsewhere}))
    assert assemble(prepared).targets["cpu"].latency[0] == busy
