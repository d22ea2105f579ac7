"""The ``edge-un`` command line (typer + rich). ``main(argv) -> exit code``.

Modules: app (the typer app, --version, --debug, the error policy), convert (convert, export,
targets), report (report DIR), training (info, train, migrate, finetune), tokens (token ...),
serve (serve), worker (worker), remote (submit, jobs, status, download, cancel: a running
service, through service.client), output (consoles, tables, progress bars), choices (option
choices).
"""

# Importing a command module registers its commands, in the order `edge-un --help` lists them.
from . import convert, report, training, tokens, serve, worker, remote  # noqa: F401, I001
from .app import app, main

__all__ = ["app", "main"]
