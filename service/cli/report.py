"""``edge-un report DIR``: a conversion's report.json as tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import output
from .app import command
from .summary import print_details, read_report


@command(rich_help_panel="Convert")
def report(
    directory: Annotated[
        Path, typer.Argument(metavar="DIR", help="output directory of convert (its report.json)")
    ],
) -> int:
    """Show a conversion's report as tables: model, drift, latency, artifacts."""
    print_details(output.stdout(), read_report(directory))
    return 0
