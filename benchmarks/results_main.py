"""The command line a benchmark shares with the others: run it (or, with ``--report-only``,
reload its committed JSON), then write ``results/NAME.json``, the Markdown table and the plot,
and print the table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def benchmark_main(
    name: str,
    description: str,
    run: Callable[[], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any]], None],
) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--report-only", action="store_true", help="redo the table and plot")
    args = parser.parse_args()
    path = RESULTS / f"{name}.json"
    if args.report_only:
        results = json.loads(path.read_text())
    else:
        results = run()
        path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(results))
    plot(results)
    print((RESULTS / f"{name}.md").read_text())
