"""Write README's quote of command 1 from a run of command 1.

    .venv/bin/python tools/readme_output.py   # one conversion, all four targets: ~70-120 s

README's "Two commands" quotes what ``.venv/bin/edge-un convert -o out/example`` prints. A quote
typed by hand goes stale the day a recipe changes, so this script runs that exact command from
the repository's root, piped (no progress bar), and replaces the README section between the
``command-1-output`` markers with the sentence that says where and when it ran (commit, host,
wall time, load) and the fenced block of what it printed. ``tests/test_readme.py`` fails when
the quoted drift rows differ from what the command prints now; the docs site includes the same
section (``--8<-- "README.md:command-1-output"``).

The parsing helpers are here, beside the writer, so that the test reads the quote exactly as
this script wrote it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Command 1 as README's "Two commands" shows it, after `bash .ci/install &&`.
COMMAND = (".venv/bin/edge-un", "convert", "-o", "out/example")
SECTION = "command-1-output"
START = f"<!-- --8<-- [start:{SECTION}] -->"
END = f"<!-- --8<-- [end:{SECTION}] -->"
DRIFT_TITLE = "Drift, int8 vs fp32"
LATENCY_TITLE = re.compile(r"^Latency, measured on (?P<host>.+?); Vela: ")
COLUMNS = re.compile(r"\s{2,}")  # rich pads its columns with at least three spaces
FENCE = "```"


@dataclass(frozen=True)
class DriftRow:
    """One target's row of the drift table, each cell as printed."""

    target: str
    status: str
    top1: str  # "97.3 % -> 97.3 %": fp32 -> int8
    drop: str
    agreement: str
    cosine: str
    precision: str


@dataclass(frozen=True)
class DriftQuote:
    """What the summary says about drift: the table's title (its bars), its target rows, and the
    lines under it (the cpu file on this host's own int8 kernels, and any warning)."""

    title: str
    rows: tuple[DriftRow, ...]
    host_lines: tuple[str, ...]


@dataclass(frozen=True)
class Run:
    """One run of command 1: what it printed and the conditions it ran in."""

    stdout: str
    seconds: float
    load: float  # the 1-minute load average when it started
    cores: int


def parse_drift(text: str) -> DriftQuote:
    """The drift table of ``edge-un convert``'s summary in ``text``: its rows are the lines of
    seven cells under the header, the lines after them up to a blank line are the host-kernel
    line and the warnings. Raises ValueError when there is no table, or no row, so that a
    changed layout fails loudly."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(DRIFT_TITLE)), None)
    if start is None:
        raise ValueError(f"no {DRIFT_TITLE!r} table")
    header, rule = lines[start + 1], lines[start + 2]
    if not header.startswith("target") or set(rule.strip()) != {"─"}:
        raise ValueError(f"the drift table's header is not where it was: {header!r}")
    rows: list[DriftRow] = []
    index = start + 3
    while index < len(lines) and len(cells := COLUMNS.split(lines[index].strip())) == 7:
        rows.append(DriftRow(*cells))
        index += 1
    if not rows:
        raise ValueError("a drift table without a target row")
    host_lines: list[str] = []  # what follows the rows up to the blank line: not a row
    while index < len(lines) and lines[index].strip():
        host_lines.append(lines[index].strip())
        index += 1
    return DriftQuote(lines[start].strip(), tuple(rows), tuple(host_lines))


def host_of(text: str) -> str:
    """The host the latency table names (``AMD EPYC (x86_64_v4, 2 cores, AVX2, ...)``)."""
    for line in text.splitlines():
        if found := LATENCY_TITLE.match(line):
            return found["host"]
    raise ValueError("no 'Latency, measured on ...' line")


def int8_features(host: str) -> tuple[str, ...]:
    """A host label's ISA features that select int8 kernels (``AVX2``, ``AVX512-VNNI``, ``no
    VNNI``...): what decides whether the cpu file's host-kernel figures can differ."""
    inside = host[host.rfind("(") + 1 : host.rfind(")")]
    parts = [part.strip() for part in inside.split(",")]
    return tuple(part for part in parts[2:] if part)  # after the microarchitecture and cores


def quoted_section(readme: str) -> str:
    """The README text between the ``command-1-output`` markers."""
    if readme.count(START) != 1 or readme.count(END) != 1:
        raise ValueError(f"README must hold {START} and {END} once each")
    return readme.split(START, 1)[1].split(END, 1)[0]


def quoted_output(readme: str) -> str:
    """The fenced block of the quoted section: command 1's output as README quotes it."""
    section = quoted_section(readme)
    parts = section.split(f"\n{FENCE}\n")
    if len(parts) != 3:
        raise ValueError("the quoted section must hold one fenced block")
    return parts[1]


def run_command(root: Path = ROOT) -> Run:
    """Command 1, as a user runs it from ``root``; its output piped, so no progress bar."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    result = subprocess.run(
        [str(root / COMMAND[0]), *COMMAND[1:]],
        cwd=root, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(COMMAND)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    cores = len(os.sched_getaffinity(0))
    return Run(result.stdout, time.monotonic() - started, load, cores)


def commit(root: Path = ROOT) -> str:
    """HEAD's short hash, and a note when tracked files other than README differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    changed = [
        line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
        if line[3:] != README.name
    ]  # fmt: skip
    return f"{head} with uncommitted changes" if changed else head


def sentence(run: Run, at: str) -> str:
    """Where and when the quoted output was made, and why its latency may be pessimistic."""
    busy = run.load >= 0.5 * run.cores
    return (
        f"This is its output, piped, at {at} on {host_of(run.stdout)}, in {run.seconds:.0f} s "
        f"(load average {run.load:.1f} on {run.cores} cores when it started"
        + (": other work running, latency pessimistic" if busy else "")
        + "), written by `tools/readme_output.py`. Drift is measured in each target's "
        "arithmetic, so those columns do not depend on the host's int8 kernels; the line under "
        "the table is the cpu file on this host's own int8 kernels:"
    )


def wrap(text: str, width: int = 100) -> str:
    """``text`` as lines of at most ``width`` characters, broken at spaces."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return "\n".join([*lines, current])


def rewrite(readme: str, run: Run, at: str) -> str:
    """``readme`` with its quoted section made from ``run``."""
    quoted_section(readme)  # the markers are there, once each
    output = run.stdout.rstrip("\n")
    body = f"\n{wrap(sentence(run, at))}\n\n{FENCE}\n{output}\n{FENCE}\n"
    before, rest = readme.split(START, 1)
    after = rest.split(END, 1)[1]
    return f"{before}{START}{body}{END}{after}"


def main() -> int:
    run = run_command()
    parse_drift(run.stdout)  # what the test will read must be there
    README.write_text(rewrite(README.read_text(), run, commit()))
    print(f"README.md: command 1's output quoted ({run.seconds:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
