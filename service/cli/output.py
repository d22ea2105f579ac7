"""Where the command line writes: rich consoles, tables and progress bars that stay plain text
(no ANSI codes, no hard wrapping) when the output is a pipe or a file, as in tests and CI logs."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from converters.progress import Progress as ProgressCallback
from converters.progress import ProgressEvent

# Piped output is read by programs and people with wide editors: never wrap it at 80 columns
# (a wrapped file path or table row breaks `grep` and the tests). Tables keep their natural width.
PIPE_WIDTH = 1000

# Row styles for a target's status in the drift table.
STATUS_STYLES = {"ok": "green", "over_bar": "yellow", "failed": "bold red"}


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    # markup/highlight off: file paths like "runs/[a]" must print as they are, and a number in
    # an error message is not worth colouring. soft_wrap: long lines are never broken.
    return Console(
        stderr=stderr,
        soft_wrap=True,
        markup=False,
        highlight=False,
        emoji=False,
        width=None if terminal else PIPE_WIDTH,
    )


def stdout() -> Console:
    """A console on the current ``sys.stdout`` (made per call: tests swap the stream)."""
    return _console(stderr=False)


def stderr() -> Console:
    return _console(stderr=True)


def table(*headers: str, title: str | None = None, numeric: Sequence[str] = ()) -> Table:
    """A borderless table whose rows start at column 0 (so `grep ^cpu` finds a target's row)."""
    result = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        title=title,
        title_justify="left",
        title_style="bold",
        header_style="bold",
    )
    for header in headers:
        # fold: a narrow terminal breaks a long path or digest, never cuts it with an ellipsis
        result.add_column(header, justify="right" if header in numeric else "left", overflow="fold")
    return result


def print_table(console: Console, table: Table) -> None:
    """Print a table; into a pipe without the padding rich adds after the last column."""
    if console.is_terminal:
        console.print(table, soft_wrap=False)  # cells wrap within the terminal's width
        return
    with console.capture() as captured:
        console.print(table)
    console.out("\n".join(line.rstrip() for line in captured.get().splitlines()))


def status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLES.get(status, ""))


def error_line(command: str, message: str, kind: str = "error") -> None:
    """The one line a failed command prints on stderr: ``edge-un CMD: error: what and why``."""
    line = Text(f"{command}: ")
    line.append(f"{kind}:", style="bold red")
    line.append(f" {message}")
    stderr().print(line)


def note(message: str) -> None:
    """A remark for the person at the terminal, on stderr (stdout stays for the result)."""
    stderr().print(Text(message, style="dim"))


class _StageBar:
    """Feeds a rich progress bar from a pipeline's progress events; each stage that ends is
    logged above the bar with its duration (a terminal only)."""

    def __init__(self, progress: Progress, verb: str) -> None:
        self.progress = progress
        self.verb = verb
        self.task = progress.add_task(verb, total=1.0)
        self.stage: str | None = None
        self.started = time.monotonic()

    def __call__(self, event: ProgressEvent) -> None:
        now = time.monotonic()
        if event.label != self.stage:
            self.finish_stage(now)
            self.stage, self.started = event.label, now
        completed = min(max(event.fraction, 0.0), 1.0)
        description = f"{self.verb}: {event.label}"
        self.progress.update(self.task, description=description, completed=completed)

    def finish_stage(self, now: float) -> None:
        if self.progress.disable or self.stage in (None, "done"):
            return
        line = Text("  ✓ ", style="green")
        line.append(f"{self.stage}").append(f"  {now - self.started:.1f} s", style="dim")
        self.progress.console.print(line)


@contextlib.contextmanager
def stage_progress(verb: str) -> Iterator[ProgressCallback]:
    """A progress bar on stderr for a long pipeline. Off when stderr is not a terminal: a log
    file gets no bar redraws, only the result. Transient: on an error the bar is cleared and the
    error line is the last thing on the screen."""
    console = stderr()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}", style="bold"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        feed = _StageBar(bar, verb)
        yield feed
        feed.finish_stage(time.monotonic())
