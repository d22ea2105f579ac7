"""``submit``, ``jobs``, ``status``, ``download``, ``cancel``: a running service, from here.

Built on ``service.client.Client``. ``submit --wait`` follows the job's stage and percent in
the progress bar ``convert`` shows and ends with the same summary tables (service.cli.summary),
so a conversion over HTTP reads like a local one, with the same exit codes: 0, or 1 if the job
failed or a target did. Errors are the server's problem+json ``detail`` in one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from converters.progress import ProgressEvent
from quant.measure.bars import DEFAULT_MAX_DRIFT
from service.job_states import ACTIVE, ENDED

from . import output
from .app import EXIT_FAILURE, command, exit_code
from .choices import EXAMPLES, HF_EXAMPLES, TARGETS
from .summary import print_summary

if TYPE_CHECKING:
    from service.client import Client
    from service.schemas import JobOut

PANEL = "Remote (a running edge-un serve)"
DEFAULT_SERVER = "http://127.0.0.1:8000"
WROTE = "wrote {out_dir}/ (report.md, report.json, report.html and the artifacts)"  # as convert

Server = Annotated[
    str,
    typer.Option(
        envvar="EDGE_UN_SERVER", metavar="URL", help="The service's address.", show_default=True
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        envvar="EDGE_UN_TOKEN",
        metavar="TOKEN",
        help="An API token (edge-un token create on the server host).",
        show_default=False,
    ),
]
JobId = Annotated[str, typer.Argument(metavar="ID", help="A job id (edge-un jobs lists them).")]
OutDir = Annotated[
    Path | None,
    typer.Option(
        "--download",
        "-o",
        metavar="DIR",
        help="Download every artifact and the reports into DIR (checked by sha256).",
        show_default=False,
    ),
]


def _client(server: str, token: str | None) -> Client:
    try:
        from service.client import Client
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the remote commands need {error.name}: pip install 'edge-un[service]'"
        ) from None

    def say(why: str, seconds: float) -> None:
        output.note(f"{server} did not answer ({why}); trying again in {seconds:g} s")

    return Client(server, token or None, on_retry=say)


def _model_path(name: str) -> Path:
    """A path, or a bundled example by name (found without importing edge_un: torch)."""
    path = Path(name)
    if path.exists() or name not in EXAMPLES + HF_EXAMPLES:
        return path
    spec = importlib.util.find_spec("edge_un")
    if spec is None or not spec.submodule_search_locations:
        return path
    examples = Path(next(iter(spec.submodule_search_locations))) / "examples"
    return examples / name if name in HF_EXAMPLES else examples / f"{name}.safetensors"


def _job_line(job: JobOut) -> str:
    stage = f", {job.stage}" if job.stage else ""
    error = f": {job.error}" if job.error else ""
    return f"{job.id} {job.state} ({job.percent:g} %{stage}){error}"


def _download(client: Client, job: JobOut, out_dir: Path) -> None:
    """The job's artifacts and reports into ``out_dir``, with report.html as convert writes
    it; a bar per file on a terminal."""
    with output.stage_progress("download") as bar:
        client.download(
            job.id,
            out_dir,
            progress=lambda name, done, total: bar(ProgressEvent(name, done / max(total, 1))),
        )
    from service.report_html import REPORT_HTML

    (out_dir / REPORT_HTML).write_text(client.report_html(job.id), encoding="utf-8")


def _finish(client: Client, job: JobOut, out_dir: Path | None, label: str) -> int:
    """What ``submit --wait`` and ``status`` end with: the summary tables (and the files),
    and ``convert``'s exit code for the same outcome (the job's state follows the same rule)."""
    from service.client import ServiceError

    report = None
    if job.state in ENDED:
        try:
            report = client.report(job.id)
        except ServiceError as error:
            if job.state != "failed" or error.status != 409:  # 409: failed before a report
                raise
    if report is not None:
        if out_dir is not None:
            _download(client, job, out_dir)
        console = output.stdout()
        print_summary(console, report)
        if out_dir is not None:
            console.print(WROTE.format(out_dir=out_dir))
    if job.state == "cancelled":
        output.error_line(label, f"the conversion {_job_line(job)}")
        return EXIT_FAILURE
    if job.state != "succeeded":
        output.error_line(label, f"the conversion {_job_line(job)}")
    return exit_code(job.state)  # type: ignore[arg-type]


@command(rich_help_panel=PANEL)
def submit(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            help=".safetensors / .pt(h) checkpoint (with --config), .pt2, .onnx (its external "
            "data as --model-data), a Hugging Face save_pretrained directory (zipped on the "
            f"way), or a bundled example ({', '.join(EXAMPLES + HF_EXAMPLES)})",
            show_default=False,
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(metavar="LIST", help=f"Comma-separated: {', '.join(TARGETS)} (default: all)."),
    ] = None,
    calib: Annotated[
        Path | None, typer.Option(metavar="F.npz", help="Calibration data.", show_default=False)
    ] = None,
    eval_data: Annotated[
        Path | None,
        typer.Option("--eval", metavar="F.npz", help="Evaluation data.", show_default=False),
    ] = None,
    model_data: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="F",
            help="An ONNX model's external data file (repeat per file).",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            metavar="JSON", help="JSON config for a .pt/.pth state dict.", show_default=False
        ),
    ] = None,
    max_drift: Annotated[
        float | None,
        typer.Option(metavar="PTS", help=f"Top-1 drop allowed (default {DEFAULT_MAX_DRIFT:g})."),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow the job to its end, then show the summary.")
    ] = False,
    download: OutDir = None,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> int:
    """Convert on a running service: upload MODEL and queue its conversion.

    Prints the job id (stdout) and how to follow it; with --wait, a progress bar, then the
    summary `convert` prints, and `convert`'s exit code for the same outcome (1 if every target
    failed, 3 if some did). --download DIR (implies --wait) fetches the artifacts and reports,
    each checked against its sha256.
    """
    with _client(server, token) as client:
        job = client.submit(
            _model_path(model),
            targets=target,
            calib=calib,
            eval=eval_data,
            config=config,
            model_data=model_data or (),
            max_drift=max_drift,
        )
        if not (wait or download):
            output.stdout().print(job.id)
            output.note(f"queued; follow it with: edge-un status {job.id} (or submit --wait)")
            return 0
        output.note(f"job {job.id} queued on {client.server}")
        try:
            with output.stage_progress("convert") as bar:
                job = client.wait(
                    job.id,
                    progress=lambda j: bar(ProgressEvent(j.stage or j.state, j.percent / 100)),
                )
        except KeyboardInterrupt:
            output.note(f"the job goes on on the server: edge-un status {job.id}, or cancel it")
            raise
        return _finish(client, job, download, "edge-un submit")


@command(rich_help_panel=PANEL)
def jobs(
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many, newest first.")] = 20,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> int:
    """List this token's conversions on the service, newest first."""
    with _client(server, token) as client:
        page = client.jobs(limit=limit)
    listing = output.table(
        "id", "state", "%", "stage", "targets", "model", "created", numeric=("%",)
    )
    for job in page.items:
        listing.add_row(
            job.id,
            output.status_text(job.state),
            f"{job.percent:g}",
            job.stage or "-",
            ",".join(job.targets),
            job.inputs.model,
            f"{job.created_at:%Y-%m-%d %H:%M:%S}",
        )
    console = output.stdout()
    output.print_table(console, listing)
    if page.total > len(page.items):
        console.print(f"({len(page.items)} of {page.total}; --limit for more)")
    return 0


@command(rich_help_panel=PANEL)
def status(
    job_id: JobId,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> int:
    """One conversion: its state, stage and percent; once finished, its summary tables."""
    with _client(server, token) as client:
        job = client.job(job_id)
        console = output.stdout()
        console.print(_job_line(job))
        if job.state in ACTIVE:
            return 0
        return _finish(client, job, None, "edge-un status")


@command(rich_help_panel=PANEL)
def download(
    job_id: JobId,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            "-o",
            metavar="DIR",
            help="Where (default edge-un-out/MODEL).",
            show_default=False,
        ),
    ] = None,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> int:
    """Download a finished conversion's artifacts and reports, each checked against its
    sha256; an interrupted download resumes when run again."""
    with _client(server, token) as client:
        job = client.job(job_id)
        out_dir = directory or Path("edge-un-out") / Path(job.inputs.model).name.split(".")[0]
        _download(client, job, out_dir)
    output.stdout().print(WROTE.format(out_dir=out_dir))
    return 0


@command(rich_help_panel=PANEL)
def cancel(
    job_id: JobId,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> int:
    """Cancel a queued or running conversion (a finished one is left as it is)."""
    with _client(server, token) as client:
        job = client.cancel(job_id)
    output.stdout().print(_job_line(job))
    return 0
