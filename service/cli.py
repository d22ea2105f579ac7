"""The ``edge-un`` command line. Errors print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

import edge_un
from edge_un import examples
from edge_un.data import DATASETS
from edge_un.training.presets import MODELS

EXIT_USAGE = 2
# The bundled UN ViT migrated from its LayerNorm twin: the route edge-un recommends, and the
# example whose pure int8 files meet the drift bar on every target (benchmarks/quant_compare).
DEFAULT_MODEL = "vit-mnist-ln-to-un"


def _info(args: argparse.Namespace) -> int:
    """Print what a checkpoint says about itself, as JSON."""
    model, info = edge_un.load_checkpoint(args.checkpoint, config=args.config)
    summary = info.to_dict()
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _train(args: argparse.Namespace) -> int:
    """Train a reference model on real data and write its checkpoint (logic in edge_un)."""
    from edge_un.training import fit

    if args.threads:
        torch.set_num_threads(args.threads)
    result = fit(
        args.model,
        args.preset,
        args.norm,
        args.data,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        norm_first=not args.post_norm,
        out=args.out,
        progress=not args.quiet,
    )
    print(f"wrote {result.path} (test accuracy {result.test_accuracy:.4f})")
    return 0


def _source(name: str) -> Path:
    """A path, or the name of a bundled example model."""
    source = Path(name)
    if not source.exists() and name in examples.names():
        return examples.path(name)
    return source


@contextlib.contextmanager
def _progress_bar(verb: str) -> Iterator[Callable[[str, float], None]]:
    """A terminal bar fed by ``progress(stage, fraction)`` callbacks."""
    from tqdm.auto import tqdm

    # leave=False: on an error the half-drawn bar is cleared and only the error line remains.
    bar_format = "{desc:<40} {percentage:3.0f}%|{bar}| {elapsed}"
    with tqdm(total=100, bar_format=bar_format, leave=False) as bar:

        def progress(stage: str, fraction: float) -> None:
            bar.set_description(f"{verb}: {stage}"[:40])
            bar.update(max(0, round(100 * fraction) - bar.n))

        yield progress


def _convert(args: argparse.Namespace) -> int:
    """Fold, export, quantize for each target, measure; the report (logic in quant)."""
    from quant.pipeline import convert
    from quant.summary import drift_rows, latency_rows

    source = _source(args.source)
    out = Path(args.out) if args.out else Path("edge-un-out") / source.stem
    with _progress_bar("convert") as progress:
        report = convert(
            source,
            targets=args.target,
            calib=args.calib,
            eval=args.eval,
            out_dir=out,
            max_drift=args.max_drift,
            progress=progress,
            config=args.config,
            allow_online=args.allow_online,
        )
    reference = report.reference
    top1 = "" if reference.top1_fp32 is None else f", fp32 top-1 {100 * reference.top1_fp32:.1f} %"
    print(f"{report.model.name}: {reference.samples} evaluation samples{top1}")
    print(_table(["target", "status", "top-1 fp32 -> int8", "drop", "agreement", "cosine",
                  "precision"], drift_rows(report)))  # fmt: skip
    print(_table(["target", "runtime", "artifact", "threads", "p50 ms", "p90 ms", "p99 ms"],
                 latency_rows(report)))  # fmt: skip
    print(f"wrote {out}/ (report.md, report.json and the artifacts)")
    failed = [t.name for t in report.targets.values() if t.status == "failed"]
    return 1 if failed else 0


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)  # fmt: skip


def _export(args: argparse.Namespace) -> int:
    """Fold the norms of a model and export one fp32 ONNX file, checked (logic in converters)."""
    from converters.pipeline import convert

    with _progress_bar("export") as progress:
        result = convert(
            _source(args.source),
            args.out,
            config=args.config,
            opset=args.opset,
            dynamic_batch=not args.static_batch,
            allow_online=args.allow_online,
            progress=progress,
        )
    print(str(result.fold))
    if result.test_split is not None:
        check = result.test_split
        print(
            f"test split: torch {check.torch_accuracy:.4f}, folded ONNX {check.onnx_accuracy:.4f}, "
            f"agreement {check.top1_agreement:.4f} on {check.samples} samples"
        )
    print(f"wrote {result.onnx_path}, {result.report_path}, {result.summary_path}")
    return 0


def _targets(args: argparse.Namespace) -> int:
    """Each edge target and the rules its artifacts follow."""
    from quant.targets import PROFILES

    for profile in PROFILES.values():
        print(f"{profile.name}: {profile.board}")
        print(f"  runtime: {profile.runtime}; artifacts: {', '.join(profile.artifacts)}")
        for rule in profile.rules:
            print(f"  - {rule}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-un",
        description="Unified Normalization Transformers: train, fold, export, quantize.",
    )
    parser.add_argument("--version", action="version", version=f"edge-un {edge_un.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = commands.add_parser("info", help="show a checkpoint's architecture, norm and metadata")
    info.add_argument("checkpoint", help=".safetensors checkpoint (or .pt/.pth with --config)")
    info.add_argument("--config", help="JSON config for a .pt/.pth state dict")
    info.set_defaults(run=_info)

    train = commands.add_parser("train", help="train a reference model on real offline data")
    train.add_argument("--model", choices=MODELS, default="vit")
    train.add_argument(
        "--preset", default="tiny", help="model + recipe size (tiny, example, bench)"
    )
    train.add_argument("--norm", choices=edge_un.NORM_KINDS, default="un")
    train.add_argument("--data", choices=DATASETS, help="default: mnist for vit, rt for text")
    train.add_argument("--epochs", type=int, help="default: the preset's")
    train.add_argument("--batch-size", type=int, help="default: the preset's")
    train.add_argument("--lr", type=float, help="peak learning rate; default: the preset's")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--post-norm", action="store_true", help="post-norm blocks (text only)")
    train.add_argument("--threads", type=int, help="torch CPU threads")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--out", required=True, help="checkpoint to write (.safetensors)")
    train.set_defaults(run=_train)

    model_help = (
        ".safetensors / .pt(h) checkpoint, .pt2 program, .onnx model, or the name of a bundled "
        f"example ({', '.join(examples.names())}); default: {DEFAULT_MODEL}"
    )
    online_help = (
        "keep LayerNorm/RMSNorm/GroupNorm (not fully integer on every target) instead of failing"
    )
    convert = commands.add_parser(
        "convert", help="fold, quantize to int8 for each edge target, measure drift and latency"
    )
    convert.add_argument("source", nargs="?", default=DEFAULT_MODEL, help=model_help)
    convert.add_argument("-o", "--out", help="output directory (default edge-un-out/MODEL)")
    convert.add_argument(
        "--target", help="comma-separated: cpu, imx93, imx8mp, tda4vm (default: all)"
    )
    convert.add_argument("--calib", help="calibration .npz ('inputs'; default: the train split)")
    convert.add_argument("--eval", help="evaluation .npz ('inputs', 'labels'; default: test split)")
    convert.add_argument(
        "--max-drift", type=float, default=0.5, help="top-1 drop allowed, points (default 0.5)"
    )
    convert.add_argument("--config", help="JSON config for a .pt/.pth state dict")
    convert.add_argument("--allow-online", action="store_true", help=online_help)
    convert.set_defaults(run=_convert)

    export = commands.add_parser(
        "export", help="fold the norms into the weights and export one checked fp32 ONNX model"
    )
    export.add_argument("source", nargs="?", default=DEFAULT_MODEL, help=model_help)
    export.add_argument("--out", required=True, help="directory for model.onnx and the report")
    export.add_argument("--config", help="JSON config for a .pt/.pth state dict")
    export.add_argument("--opset", type=int, default=18, help="ONNX opset, 17..25 (default 18)")
    export.add_argument(
        "--static-batch", action="store_true", help="batch 1, static shapes (NPU targets)"
    )
    export.add_argument("--allow-online", action="store_true", help=online_help)
    export.set_defaults(run=_export)

    targets = commands.add_parser("targets", help="list the edge targets and their rules")
    targets.set_defaults(run=_targets)
    _add_finetune_commands(commands)
    return parser


def _migrate(args: argparse.Namespace) -> int:
    """Swap LayerNorm for an offline norm and distil the LN model into it (logic in edge_un)."""
    return _finetune_job("migrate", args, {"kind": args.kind})


def _finetune(args: argparse.Namespace) -> int:
    """Fine-tune a UN model so that pure int8 quantization is accurate (logic in edge_un)."""
    if not args.int8_ready:
        raise ValueError("nothing to do: pass --int8-ready (the only fine-tune so far)")
    options = {"method": args.method, "weight": args.weight, "target": args.target}
    return _finetune_job("int8-ready", args, options)


def _finetune_job(purpose: str, args: argparse.Namespace, options: dict) -> int:
    from edge_un.finetune.jobs import run_job

    if args.threads:
        torch.set_num_threads(args.threads)
    recorded = [args.command, args.checkpoint]
    skip = ("command", "checkpoint", "run", "quiet", "out")
    for key, value in vars(args).items():
        if key not in skip and value is not None and value is not False:
            recorded += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    recorded += ["--out", args.out]
    path, metadata = run_job(
        purpose,
        args.checkpoint,
        args.out,
        data=args.data,
        npz=args.npz,
        recipe_overrides={"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                          "seed": args.seed, **({"distill": False} if args.labels_only else {})},
        use_labels=not args.no_labels,
        recalibrate_batches=args.recalibrate or 0,
        job_options=options,
        argv=recorded,
        progress=not args.quiet,
        log=None if args.quiet else print,
    )  # fmt: skip
    summary = f"wrote {path}"
    if "test_accuracy" in metadata:
        summary += (
            f" (test accuracy {metadata['test_accuracy']:.4f}, teacher "
            f"{metadata['teacher_test_accuracy']:.4f}, agreement "
            f"{metadata['test_agreement_with_teacher']:.4f})"
        )
    print(summary)
    return 0


def _add_finetune_commands(commands: argparse._SubParsersAction) -> None:
    """``migrate`` and ``finetune``: both distil a student from a frozen teacher on data."""
    migrate = commands.add_parser(
        "migrate", help="swap LayerNorm for UN (or another offline norm) and distil to recover"
    )
    migrate.add_argument("--kind", choices=edge_un.OFFLINE_KINDS, default="un")
    migrate.set_defaults(run=_migrate)
    finetune = commands.add_parser(
        "finetune", help="fine-tune a UN model, e.g. --int8-ready for pure int8 quantization"
    )
    finetune.add_argument(
        "--int8-ready", action="store_true", help="bound the residual stream's range"
    )
    finetune.add_argument("--method", choices=edge_un.finetune.METHODS, default="decay")
    finetune.add_argument("--weight", type=float, help="penalty weight (default per method)")
    finetune.add_argument("--target", type=float, default=8.0, help="range: allowed abs max")
    finetune.set_defaults(run=_finetune)
    for command in (migrate, finetune):
        command.add_argument("checkpoint", help=".safetensors checkpoint")
        source = command.add_mutually_exclusive_group()
        source.add_argument(
            "--data", choices=DATASETS, help="data set (default: the one the checkpoint records)"
        )
        source.add_argument(
            "--npz", help=".npz with 'inputs' [, 'labels', 'val_inputs', 'val_labels']"
        )
        command.add_argument("--epochs", type=int, help="default: migrate 20, finetune 10")
        command.add_argument("--batch-size", type=int, help="default 32")
        command.add_argument("--lr", type=float, help="peak learning rate")
        command.add_argument("--seed", type=int)
        labels = command.add_mutually_exclusive_group()
        labels.add_argument("--no-labels", action="store_true", help="distillation only")
        labels.add_argument("--labels-only", action="store_true", help="no teacher (ablation)")
        command.add_argument(
            "--recalibrate", type=int, metavar="N", help="then recompute inference statistics "
            "over N training batches"
        )  # fmt: skip
        command.add_argument("--threads", type=int, help="torch CPU threads")
        command.add_argument("--quiet", action="store_true", help="no progress bar")
        command.add_argument("--out", required=True, help="checkpoint to write (.safetensors)")


def main(argv: Sequence[str] | None = None) -> int:
    # torch.export's own deprecation noise is not the user's concern.
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return run(args)
    except (edge_un.CheckpointError, ValueError, OSError, ModuleNotFoundError) as error:
        print(f"edge-un {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"edge-un {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
