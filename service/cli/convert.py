"""``convert``, ``export`` and ``targets``: the command line over quant and converters."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import output
from .app import command
from .choices import DEFAULT_MODEL, EXAMPLES, HF_EXAMPLES, TARGETS
from .summary import print_summary

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


@command(rich_help_panel=PANEL)
def convert(
    source: Source = DEFAULT_MODEL,
    out: Annotated[
        str | None,
        typer.Option("-o", "--out", metavar="DIR", help="Output directory.", show_default=False),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(metavar="LIST", help=f"Comma-separated: {', '.join(TARGETS)} (default: all)."),
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
    ] = 0.5,
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
) -> int:
    """Fold the norms, quantize to int8 for each edge target, measure drift and latency.

    Writes the artifacts, report.json and report.md to DIR (default edge-un-out/MODEL); exits
    1 if a target failed outright (a target over the drift bar is reported, not an error).
    """
    from quant.pipeline import convert as run_convert
    from quant.recalibration import recalibration_note

    model = _source(source)
    out_dir = Path(out) if out else Path("edge-un-out") / model.stem
    with output.stage_progress("convert") as progress:
        report = run_convert(
            model,
            targets=target,
            calib=calib,
            eval=eval_data,
            out_dir=out_dir,
            max_drift=max_drift,
            progress=progress,
            config=config,
            allow_online=allow_online,
            recalibrate_batches=recalibrate,
        )
    console = output.stdout()
    print_summary(console, report)
    if report.recalibration is not None:
        console.print(recalibration_note(report.recalibration, recalibrate))
    console.print(f"wrote {out_dir}/ (report.md, report.json and the artifacts)")
    failed = [t.name for t in report.targets.values() if t.status == "failed"]
    return 1 if failed else 0


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
    from converters.pipeline import convert as run_export

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
    """List the edge targets and the rules their artifacts follow."""
    from quant.targets import PROFILES

    listing = output.table("target", "board, runtime, artifacts", "rules")
    listing.show_lines = True
    for profile in PROFILES.values():
        about = f"{profile.board}\n{profile.runtime}\nartifacts: {', '.join(profile.artifacts)}"
        rules = "\n".join(f"- {rule}" for rule in profile.rules)
        listing.add_row(profile.name, about, rules)
    output.print_table(output.stdout(), listing)
    return 0
