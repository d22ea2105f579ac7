"""README's quote of command 1 against what command 1 prints now.

README's "Two commands" quotes the output of ``.venv/bin/edge-un convert -o out/example`` (the
bundled ``vit-mnist-ln-to-un``, all four targets), as ``tools/readme_output.py`` wrote it. A
recipe change that moves a drift figure makes that quote wrong, so this runs the same command
once (about 70-120 s on 2 cores: no other test runs the default model on all four targets with
the default bars and prints the summary; tests/test_quant_pipeline.py's default-model test
builds three targets and reads report.json) and compares, cell by cell:

- the drift table's title (its bars) and every target row: (target, status, fp32 -> int8,
  drop, agreement, cosine, precision). Drift is measured in each target's own arithmetic (exact
  integer arithmetic for the QDQ ONNX files, LiteRT's int32-summing kernels for TFLite), so these
  are the same on every x86 host;
- the line under the table, ``cpu on this host's ONNX Runtime int8 kernels: ...`` (and any
  warning printed there), only on a host whose int8 features are the quoted host's. That line
  is the cpu file on the host's own kernels: its 7-bit weights cannot saturate an AVX2 core
  without VNNI, but the fused kernels' requantize rounding is the host's, and
  tests/test_int8_hosts.py allows it 0.2 pt from the exact figure. On another kind of host it
  is skipped, saying why.

The latency table is timed on a shared host and is never compared. When a test here fails,
run ``.venv/bin/python tools/readme_output.py`` and commit the README it writes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.readme_output import (
    COMMAND,
    END,
    README,
    START,
    Run,
    host_of,
    int8_features,
    parse_drift,
    quoted_output,
    rewrite,
)

EDGE_UN = Path(sys.executable).with_name("edge-un")  # .venv/bin/edge-un beside the tests' python


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Command 1 as README gives it (a relative output directory), from a scratch directory,
    piped: what it prints on stdout."""
    cwd = tmp_path_factory.mktemp("command-1")
    result = subprocess.run(
        [str(EDGE_UN), *COMMAND[1:]],
        cwd=cwd, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def quoted() -> str:
    return quoted_output(README.read_text())


def test_readme_shows_the_command_the_quote_comes_from() -> None:
    command = " ".join(COMMAND)
    assert f"bash .ci/install && {command}\n" in README.read_text()


def test_the_quoted_drift_rows_are_what_command_1_prints(printed: str, quoted: str) -> None:
    now, then = parse_drift(printed), parse_drift(quoted)
    assert [row.target for row in now.rows] == ["cpu", "imx93", "imx8mp", "tda4vm"]
    assert then.title == now.title
    assert then.rows == now.rows, (
        "README's drift rows are stale: run `.venv/bin/python tools/readme_output.py`"
    )


def test_the_quoted_host_kernel_line_is_what_command_1_prints(printed: str, quoted: str) -> None:
    here, there = host_of(printed), host_of(quoted)
    if int8_features(here) != int8_features(there):
        pytest.skip(
            f"the quote's cpu-on-host line was measured on {there}; this host ({here}) has "
            "other int8 kernels, whose requantize rounding may move it"
        )
    assert parse_drift(quoted).host_lines == parse_drift(printed).host_lines


def test_a_changed_cell_is_a_difference(quoted: str) -> None:
    """The comparison above can fail: one cell changed in the quote is a different row, the
    other rows stay as they were, and text without the table is refused."""
    quote = parse_drift(quoted)
    assert len(quote.rows) == 4 and quote.host_lines
    row = quote.rows[1]
    line = next(line for line in quoted.splitlines() if line.startswith(f"{row.target} "))
    other = "98.0 %" if row.agreement != "98.0 %" else "97.0 %"
    rows = parse_drift(quoted.replace(line, line.replace(row.agreement, other))).rows
    assert rows[1] != row and rows[1].agreement == other
    assert rows[0] == quote.rows[0] and rows[2:] == quote.rows[2:]
    with pytest.raises(ValueError, match="no 'Drift, int8 vs fp32' table"):
        parse_drift("vit: 1000 evaluation samples\n")


def test_the_writer_changes_only_the_quote(quoted: str) -> None:
    """tools/readme_output.py rewrites the marked section and nothing around it."""
    readme = README.read_text()
    written = rewrite(readme, Run(stdout=f"{quoted}\n", seconds=70.0, load=0.2, cores=2), "abc1234")
    assert quoted_output(written) == quoted
    for marker, side in ((START, 0), (END, 1)):
        assert written.split(marker)[side] == readme.split(marker)[side]
    assert "at abc1234 on " in written and "latency pessimistic" not in written
