"""``convert``, ``export`` and ``targets``: the command line over quant and converters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from quant.measure.bars import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT

from . import output
from .app import command, exit_code
from .choices import DEFAULT_MODEL, EXAMPLES, HF_EXAMPLES, TARGETS
from .summary import print_summary

if TYPE_CHECKING:  # quant is imported by the commands that run it
    from quant.targets import TargetProfile

PANEL = "Convert"
MODEL_HELP = (
    ".safetensors / .pt(h) checkpoint, .pt2 program, .onnx model (its .onnx.data beside it), "
    "a Hugging Face save_pretrained directory, or the name of a bundled example "
    f"({', '.join(EXAMPLES + HF_EXAMPLES)})"
)
CONFIG_HELP = "JSON config for a .pt/.pth state dict."
ONLINE_HELP = (
    "Keep LayerNorm/RMSNorm/GroupNorm (not fully integer on every target) instead of failing."
)

Source = Annotated[str, typer.Argument(metavar="MODEL", help=MODEL_HELP, show_default=False)]
Config = Annotated[str | None, typer.Option("--config", metavar="JSON", help=CONFIG_HELP)]
AllowOnline = Annotated[bool, typer.Option("--allow-online", help=ONLINE_HELP)]


def _source(name: str) -> Path:
    """A path, or the name of a bundled example model."""
    source = Path(name)
    if not source.exists() and name in EXAMPLES + HF_EXAMPLES:
        from edge_un import examples

        return examples.path(name)
    return source


def targets_here(spec: str | None) -> tuple[TargetProfile, ...]:
    """The targets to build. Default: every target this installation can build (the others
    are named in a note); a target asked for by name that cannot be built here is refused
    before any work, in one line."""
    from quant.availability import targets_to_build

    profiles, missing = targets_to_build(spec)
    names = ", ".join(p.name for p in profiles)
    for reason in dict.fromkeys(missing.values()):
        skipped = ", ".join(name for name, why in missing.items() if why == reason)
        output.note(f"targets: {names} (not {skipped}: {reason}; see edge-un targets)")
    return profiles


def _cannot_write(out_dir: Path, where: Path) -> PermissionError:
    """The one line for an output directory this process may not write: who, where, what to
    do. In a container (Docker sets /.dockerenv, podman /run/.containerenv) the usual cause is
    a mounted host directory owned by another uid: running as its owner is the fix."""
    uid, gid = os.getuid(), os.getgid()
    try:
        owner = where.stat()
        owned = f" (owned by uid {owner.st_uid}, gid {owner.st_gid})"
    except OSError:
        owned = ""
    fix = f"make {where} writable for uid {uid}, or choose another output directory"
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        fix = (
            f"run the container as the owner of {where} (docker run --user "
            f'"$(id -u):$(id -g)" ..., from a directory you own), or {fix}'
        )
    return PermissionError(
        f"uid {uid} (gid {gid}) cannot write the output directory {out_dir}: no write "
        f"permission on {where}{owned}; {fix}"
    )


def _check_writable(out_dir: Path) -> Path:
    """``out_dir`` (absolute), checked before minutes of loading and folding: it, or the
    directory it will be created in, must be writable by this process. Nothing is created."""
    out_dir = Path(os.path.abspath(out_dir))
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is not a directory: choose another output directory")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise PermissionError(
            f"cannot write the output directory {out_dir}: {existing} is on a read-only file "
            "system (a volume mounted :ro?); choose another output directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _cannot_write(out_dir, existing)
    return out_dir


@command(rich_help_panel=PANEL)
def convert(
    source: Source = DEFAULT_MODEL,
    out: Annotated[
        str | None,
        typer.Option("-o", "--out", metavar="DIR", help="Output directory.", show_default=False),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            metavar="LIST",
            help=f"Comma-separated: {', '.join(TARGETS)}, or all (default: every target this "
            "installation can build, see `edge-un targets`).",
        ),
    ] = None,
    calib: Annotated[
        str | None,
        typer.Option(metavar="F.npz", help="Calibration data ('inputs'; default: train split)."),
    ] = None,
    eval_data: Annotated[
        str | None,
        typer.Option(
            "--eval",
            metavar="F.npz",
            help="Evaluation data ('inputs', 'labels'; default: test split).",
        ),
    ] = None,
    max_drift: Annotated[
        float, typer.Option(metavar="PTS", help="Top-1 drop allowed, in points.")
    ] = DEFAULT_MAX_DRIFT,
    min_agreement: Annotated[
        float,
        typer.Option(
            metavar="PCT",
            min=0,
            max=100,
            help="Share of test samples whose int8 top-1 must equal fp32's, in percent.",
        ),
    ] = 100 * DEFAULT_MIN_AGREEMENT,
    config: Config = None,
    allow_online: AllowOnline = False,
    recalibrate: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=0,
            help="First recompute the offline norms' inference statistics over N batches of the "
            "calibration data (--calib, else the checkpoint's train split); checkpoints only.",
        ),
    ] = 0,
    parallel: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=1,
            help="Build N targets at once, each in a process of its own (their memory adds up).",
        ),
    ] = 1,
) -> int:
    """Fold the norms, quantize to int8 for each edge target, measure drift and latency.

    Writes the artifacts, report.json and report.md to DIR (default edge-un-out/MODEL); exits
    1 if every target failed, 3 if some did (a target over the drift bar is reported, not a
    failure).
    """
    model = _source(source)
    out_dir = Path(out) if out else Path("edge-un-out") / model.stem
    profiles = targets_here(target)
    resolved = _check_writable(out_dir)  # both before importing torch: a mistake costs < 1 s
    from quant.pipeline import convert as run_convert
    from quant.recalibration import recalibration_note

    with output.stage_progress("convert") as progress:
        try:
            report = run_convert(
                model,
                targets=profiles,
                calib=calib,
                eval=eval_data,
                out_dir=out_dir,
                max_drift=max_drift,
                min_agreement=min_agreement / 100,
                progress=progress,
                config=config,
                allow_online=allow_online,
                recalibrate_batches=recalibrate,
                parallel=parallel,
            )
        except PermissionError as error:  # the check above passed, the directory said no
            where = Path(os.path.abspath(error.filename)) if error.filename else None
            if where is None or not (where == resolved or resolved in where.parents):
                raise
            raise _cannot_write(resolved, where if where.is_dir() else where.parent) from None
    from service.report_html import write_report_html

    write_report_html(out_dir)  # the page the service serves for the same report.json
    console = output.stdout()
    print_summary(console, report)
    if report.recalibration is not None:
        console.print(recalibration_note(report.recalibration, recalibrate))
    console.print(f"wrote {out_dir}/ (report.md, report.json, report.html and the artifacts)")
    return exit_code(report.outcome())


@command(rich_help_panel=PANEL)
def export(
    out: Annotated[
        str, typer.Option(metavar="DIR", help="Directory for model.onnx and the report.")
    ],
    source: Source = DEFAULT_MODEL,
    config: Config = None,
    opset: Annotated[int, typer.Option(help="ONNX opset, 17..25.")] = 18,
    static_batch: Annotated[
        bool, typer.Option("--static-batch", help="Batch 1, static shapes (NPU targets).")
    ] = False,
    allow_online: AllowOnline = False,
) -> int:
    """Fold the norms into the weights and export one checked fp32 ONNX model."""
    _check_writable(Path(out))
    from converters.fold_and_export import convert as run_export

    with output.stage_progress("export") as progress:
        result = run_export(
            _source(source),
            out,
            config=config,
            opset=opset,
            dynamic_batch=not static_batch,
            allow_online=allow_online,
            progress=progress,
        )
    console = output.stdout()
    console.print(str(result.fold))
    if result.test_split is not None:
        check = result.test_split
        console.print(
            f"test split: torch {check.torch_accuracy:.4f}, folded ONNX {check.onnx_accuracy:.4f}, "
            f"agreement {check.top1_agreement:.4f} on {check.samples} samples"
        )
    console.print(f"wrote {result.onnx_path}, {result.report_path}, {result.summary_path}")
    return 0


@command(rich_help_panel=PANEL)
def targets() -> int:
    """List the edge targets, the rules their artifacts follow, and whether this installation
    can build each (`convert` builds those by default)."""
    from quant.availability import missing_targets
    from quant.targets import PROFILES

    listing = output.table("target", "here", "board, runtime, artifacts", "rules")
    listing.show_lines = True
    missing = missing_targets()
    for profile in PROFILES.values():
        about = f"{profile.board}\n{profile.runtime}\nartifacts: {', '.join(profile.artifacts)}"
        rules = "\n".join(f"- {rule}" for rule in profile.rules)
        listing.add_row(profile.name, "no" if profile.name in missing else "yes", about, rules)
    console = output.stdout()
    output.print_table(console, listing)
    here = [name for name in PROFILES if name not in missing]
    console.print(f"\nthis installation can build: {', '.join(here) or 'none'}")
    for name, why in missing.items():
        console.print(f"cannot build {name}: {why}")
    return 0
