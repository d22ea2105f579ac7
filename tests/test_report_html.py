"""report.html: one self-contained page, rendered in real headless Chromium.

A real report (the UN ViT example converted for cpu and imx93) is rendered and opened through
a local HTTP server in the system's Chromium (selenium, the system chromedriver; selenium's
driver download never runs): a row per target in the tables, every plot drawn with a size, no
console errors and no request beyond the page itself. Under CI=true a missing browser fails.
"""

from __future__ import annotations

import html
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from quant.report import Report
from quant.targets import parse_targets
from service.report_html import render_report_html

BROWSER_WINDOW = "1280,2000"  # the window of the conftest's browser
HOSTILE = '<img src="http://evil.example/x.png" onerror="alert(1)">$x$</td>'


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Report:
    from edge_un import examples
    from quant.pipeline import convert

    out = tmp_path_factory.mktemp("report")
    return convert(examples.path("vit-mnist-un"), targets=parse_targets("cpu,imx93"), out_dir=out,
                   latency_runs=10)  # fmt: skip


def hostile_variant(report: Report) -> Report:
    """The same report with a user-chosen hostile model name, layer name and a failed target."""
    cpu = report.targets["cpu"]
    assert cpu.drift is not None
    layers = [cpu.drift.worst_layers[0].model_copy(update={"name": HOSTILE}),
              *cpu.drift.worst_layers[1:]]  # fmt: skip
    drift = cpu.drift.model_copy(update={"worst_layers": layers})
    failed = cpu.model_copy(update={
        "name": "tda4vm", "status": "failed", "error": f"converter crashed on {HOSTILE}",
        "drift": None, "latency": [], "artifacts": [], "vela": None,
    })  # fmt: skip
    targets = {**report.targets, "cpu": cpu.model_copy(update={"drift": drift}), "tda4vm": failed}
    model = report.model.model_copy(update={"name": HOSTILE})
    return report.model_copy(update={"model": model, "targets": targets})


class _Pages(BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, bytes]] = {}
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        body = self.pages.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def page_server() -> Iterator[tuple[str, type[_Pages]]]:
    """A local HTTP server of the pages in ``_Pages.pages``, recording every request."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Pages
    httpd.shutdown()
    httpd.server_close()


def open_page(browser, page_server, name: str, page: str) -> list[dict]:
    """Load ``page`` over HTTP; the browser's log entries for it."""
    base, pages = page_server
    pages.pages[f"/{name}"] = page.encode()
    pages.requests.clear()
    browser.get_log("browser")  # drop earlier entries
    browser.get(f"{base}/{name}")
    return browser.get_log("browser")


def svg_sizes(browser) -> dict[str, tuple[float, float]]:
    return browser.execute_script(
        "const out = {};"
        "for (const f of document.querySelectorAll('figure.plot')) {"
        "  const s = f.querySelector('svg'); const r = s ? s.getBoundingClientRect() : null;"
        "  out[f.id] = r ? [r.width, r.height] : [0, 0]; }"
        "return out;"
    )


def test_litert_latency_rows_say_what_xnnpack_took(report: Report) -> None:
    """The imx93 file's latency rows carry the ops XNNPACK's delegate took, every attention
    BATCH_MATMUL among them (the symmetric right operands); ONNX Runtime's rows none."""
    for target in report.targets.values():
        for timing in target.latency:
            if timing.runtime != "litert":
                assert timing.xnnpack_ops is None, timing
                continue
            total, taken = timing.xnnpack_ops["BATCH_MATMUL"]
            assert total == taken > 0, timing.xnnpack_ops
            assert timing.xnnpack_ops["FULLY_CONNECTED"][1] > 0, timing.xnnpack_ops


def column(browser, table: str, index: int) -> list[str]:
    return browser.execute_script(
        f"return [...document.querySelectorAll('#{table}-table tbody tr')]"
        f".map(r => r.cells[{index}].textContent);"
    )


def test_report_page_renders_in_chromium(browser, page_server, report: Report) -> None:
    page = render_report_html(report)
    logs = open_page(browser, page_server, "report.html", page)
    assert [entry for entry in logs if entry["level"] == "SEVERE"] == []
    assert page_server[1].requests == ["/report.html"], "the page made requests of its own"
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert column(browser, "drift", 0) == list(report.targets)
    assert column(browser, "drift", 1) == ["ok" if t.status == "ok" else "over the bar"
                                           for t in report.targets.values()]  # fmt: skip
    latency_rows = column(browser, "latency", 0)
    assert sorted(set(latency_rows)) == sorted(report.targets)
    expected = sum(len(t.latency) + (t.vela is not None) for t in report.targets.values())
    assert len(latency_rows) == expected
    runtimes = set(column(browser, "latency", 1))
    assert {"onnxruntime", "litert"} <= runtimes and any(r.startswith("Vela") for r in runtimes)
    delegated = dict(zip(column(browser, "latency", 2), column(browser, "latency", 7), strict=True))
    assert delegated["cpu/model_int8.onnx"] == "-"
    imx93 = delegated["imx93/model_int8.tflite"]
    assert re.fullmatch(r"\d+ / \d+ \(BATCH_MATMUL (\d+) / \1\)", imx93), imx93
    sizes = svg_sizes(browser)
    assert set(sizes) == {"plot-sqnr-cpu", "plot-sqnr-imx93", "plot-latency", "plot-vela"}
    assert all(width > 100 and height > 50 for width, height in sizes.values()), sizes
    assert (
        browser.execute_script("return document.title")
        == f"edge-un conversion: {report.model.name}"
    )
    # the machine that measured it, where the latency is and in a section of its own
    text = "return document.querySelector(arguments[0]).textContent"
    assert f"measured on {report.host.label()}" in browser.execute_script(text, "#latency-host")
    host = browser.execute_script(text, "#host")
    assert report.host.int8_kernels in host and report.host.versions["onnxruntime"] in host
    # which converter made the TFLite file, and why: in its target's section, not the cpu's
    assert "TFLite route: litert-torch (to float " in browser.execute_script(text, "#target-imx93")
    assert "TFLite route" not in browser.execute_script(text, "#target-cpu")


def test_hostile_names_stay_text_in_chromium(browser, page_server, report: Report) -> None:
    hostile = hostile_variant(report)
    logs = open_page(browser, page_server, "hostile.html", render_report_html(hostile))
    assert [entry for entry in logs if entry["level"] == "SEVERE"] == []
    assert page_server[1].requests == ["/hostile.html"]
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert browser.execute_script("return document.querySelector('h1').textContent") == (
        f"edge-un conversion: {HOSTILE}"
    )
    failed = browser.execute_script("return document.querySelector('#failed-targets').textContent")
    assert "tda4vm" in failed and f"converter crashed on {HOSTILE}" in failed
    assert column(browser, "drift", 0) == ["cpu", "imx93", "tda4vm"]
    assert len(svg_sizes(browser)) == 4  # no plot for a target without measurements


def test_page_is_self_contained(report: Report) -> None:
    page = render_report_html(hostile_variant(report))
    attributes = re.findall(r'\b(?:src|href|xlink:href|action)\s*=\s*"([^"]*)"', page)
    assert all(value.startswith(("#", "data:")) for value in attributes), attributes
    assert not re.search(r"url\((?!#)", page), "a CSS url() that is not a local reference"
    assert "<script" not in page and "@import" not in page
    assert "Content-Security-Policy" in page
    assert html.escape(HOSTILE) in page and HOSTILE not in page


def test_worst_layers_name_the_models_modules(browser, page_server, report: Report) -> None:
    """Issue 21: each worst-layer row, ONNX and TFLite, carries the module of the user's model
    (from the export's module records; TFLite names mapped back through onnx2tf's tensor map)
    beside the graph's own name, in report.json, report.md and the page."""
    for target in report.targets.values():
        assert target.drift is not None and target.drift.worst_layers, target.name
        for layer in target.drift.worst_layers:
            assert layer.module and layer.module != layer.name, (target.name, layer)
            head = layer.module.split(".")[0]
            assert head in ("blocks", "patch_embed", "head") or "." not in layer.module, layer
    softmax = {t: [lay.module for lay in report.targets[t].drift.worst_layers
                   if lay.op.lower() == "softmax"] for t in ("cpu", "imx93")}  # fmt: skip
    assert all(m.startswith("blocks.") and m.endswith(".attn.softmax")
               for ms in softmax.values() for m in ms), softmax  # fmt: skip
    from quant.report.summary import summary_markdown

    markdown = summary_markdown(report)  # report.md
    assert all(f"{layer.module} `{layer.name}`" in markdown for t in report.targets.values()
               for layer in t.drift.worst_layers)  # fmt: skip
    open_page(browser, page_server, "modules.html", render_report_html(report))
    for name, target in report.targets.items():
        assert column(browser, f"{name}-worst", 0) == [
            layer.module for layer in target.drift.worst_layers
        ]
        assert column(browser, f"{name}-worst", 1) == [
            layer.name for layer in target.drift.worst_layers
        ]
