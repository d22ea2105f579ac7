"""The typer application: global options (--version, --debug), one error policy for every
command, and ``main``.

Exit codes: 0 done; 1 failed (bad input, or a conversion in which every target failed);
3 a conversion in which some targets failed and the others were built (``Report.outcome``, the
rule the service's job states follow too); 2 a usage error (typer's); 130 interrupted.

Error policy: a command that fails on bad input (a ValueError, an OSError, a checkpoint error,
a missing optional package...) prints ONE line on stderr, ``edge-un CMD: error: ...``, and exits
1; anything else is a bug and prints one line too, with a hint to rerun with ``--debug``, which
shows the traceback. Usage errors (unknown option, bad choice) are typer's: usage + exit 2.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

import typer

from . import output

EXIT_FAILURE = 1
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130
# A conversion's outcome (quant.report.Outcome), as the exit code of convert and submit --wait.
OUTCOME_EXIT = {"succeeded": 0, "partial": EXIT_PARTIAL, "failed": EXIT_FAILURE}

# Set by the root callback, read by the error handler of the command that runs after it.
_debug: ContextVar[bool] = ContextVar("edge_un_debug", default=False)

Command = TypeVar("Command", bound=Callable[..., Any])

app = typer.Typer(
    name="edge-un",
    help="Unified Normalization Transformers: train, fold, export, quantize to int8 for edge "
    "targets, and serve conversions over HTTP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def version() -> str:
    """The installed edge-un's version, from its package metadata: importing edge_un would
    import torch (~2 s) just to print a string."""
    return importlib.metadata.version("edge-un")


def _show_version(value: bool) -> None:
    if value:
        output.stdout().print(f"edge-un {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="On an error, show the full traceback.")
    ] = False,
) -> None:
    _debug.set(debug)


def _is_bad_input(error: BaseException) -> bool:
    """Errors that are not ours (the input, a tool, this host, the service's answer): explained
    in one line, not a traceback. The conversion's errors are sorted by quant.errors.blame."""
    from quant.errors import Blame, blame
    from service.errors import UsageError

    if blame(error) is not Blame.BUG or isinstance(error, UsageError):
        return True
    # settings from the environment (pydantic's), and the service's answers (service.client:
    # httpx, loaded by the remote commands): an error of a module not loaded was not raised
    for module, name in (("pydantic", "ValidationError"), ("service.client", "ServiceError")):
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(error, kind):
            return True
    return False


def exit_code(outcome: str) -> int:
    """The exit code for a conversion that ended ``outcome`` (succeeded, partial, failed)."""
    return OUTCOME_EXIT[outcome]


def _fail(label: str, error: BaseException) -> int:
    from quant.errors import one_line

    if _debug.get():
        traceback.print_exc()
    if _is_bad_input(error):
        output.error_line(label, one_line(error))
    else:
        hint = "" if _debug.get() else " (rerun with --debug for the traceback)"
        output.error_line(
            label, f"{type(error).__name__}: {one_line(error)}{hint}", "unexpected error"
        )
    return EXIT_FAILURE


def command(
    group: typer.Typer = app, name: str | None = None, **options: Any
) -> Callable[[Command], Command]:
    """``@command()``: register a function returning an exit code under the error policy."""

    def register(function: Command) -> Command:
        command_name = name or function.__name__.replace("_", "-")
        label = (
            f"edge-un {command_name}"
            if group is app
            else f"edge-un {group.info.name} {command_name}"
        )

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> None:
            try:
                code = function(*args, **kwargs)
            except (typer.Exit, typer.Abort, typer.BadParameter, BrokenPipeError):
                raise  # typer's: usage errors, and a closed pipe (`edge-un report D | head`)
            except KeyboardInterrupt:
                output.error_line(label, "interrupted")
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except Exception as error:  # the policy above
                raise typer.Exit(_fail(label, error)) from None
            if code:
                raise typer.Exit(code)

        group.command(command_name, **options)(guarded)
        return function

    return register


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: sys.argv) and return the exit code."""
    # torch.export's own deprecation noise is not the user's concern.
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    _debug.set(False)
    cli = typer.main.get_command(app)
    try:
        cli.main(args=None if argv is None else list(argv), prog_name="edge-un")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        output.stderr().print(str(done.code))
        return EXIT_FAILURE
    return 0
