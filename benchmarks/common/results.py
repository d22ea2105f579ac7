"""What the benchmarks share: where their results go, and the command line of those that
write ``results/NAME.json``, its Markdown table and its plot: run (or, with ``--report-only``,
reload the committed JSON), then write the table and the plot, and print the table."""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS = ROOT / "benchmarks" / "results"


def benchmark_main(
    name: str,
    doc: str,
    run: Callable[[], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any]], None],
    modes: Mapping[str, tuple[str, Callable[[], None]]] | None = None,
) -> None:
    """The benchmark ``name`` described by ``doc`` (its module's docstring): ``run`` measures,
    ``markdown`` and ``plot`` write the results. ``modes``: other ways to run it, each an
    option (``--NAME``: its help, and what it runs instead)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="redo the table and plot")
    for option, (help_text, _) in (modes or {}).items():
        parser.add_argument(f"--{option}", action="store_true", help=help_text)
    args = parser.parse_args()
    for option, (_, mode) in (modes or {}).items():
        if getattr(args, option.replace("-", "_")):
            mode()
            return
    path = RESULTS / f"{name}.json"
    if args.report_only:
        results = json.loads(path.read_text())
    else:
        results = run()
        path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(results))
    plot(results)
    print((RESULTS / f"{name}.md").read_text())


def save_figure(figure: Any, name: str) -> None:
    """A matplotlib figure, laid out, as ``results/NAME.png``."""
    figure.tight_layout()
    figure.savefig(RESULTS / f"{name}.png", dpi=120)


def git_commit(*path: Path) -> str:
    """The repository's HEAD, short; with ``path``, the last commit that changed it."""
    command = ["git", "log", "-1", "--format=%h", "--", *map(str, path)] if path else ["git",
               "rev-parse", "--short", "HEAD"]  # fmt: skip
    return subprocess.check_output(command, cwd=ROOT, text=True).strip()
