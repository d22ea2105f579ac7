"""The ``edge-un`` command line. Errors print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import edge_un
from edge_un import examples
from edge_un.data import DATASETS
from edge_un.training.presets import MODELS

EXIT_USAGE = 2


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


def _convert(args: argparse.Namespace) -> int:
    """Fold the norms of a model and export it to ONNX, with a report (logic in converters)."""
    from tqdm.auto import tqdm

    from converters.pipeline import convert

    source = Path(args.source)
    if not source.exists() and args.source in examples.names():
        source = examples.path(args.source)
    # leave=False: on an error the half-drawn bar is cleared and only the error line remains.
    bar_format = "{desc:<22} {percentage:3.0f}%|{bar}| {elapsed}"
    with tqdm(total=100, bar_format=bar_format, leave=False) as bar:

        def progress(stage: str, fraction: float) -> None:
            bar.set_description(f"convert: {stage}")
            bar.update(round(100 * fraction) - bar.n)

        result = convert(
            source,
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

    convert = commands.add_parser(
        "convert", help="fold the norms into the weights and export a checked ONNX model"
    )
    convert.add_argument(
        "source",
        nargs="?",
        default="vit-mnist-un",
        help=".safetensors / .pt(h) checkpoint, .pt2 program, .onnx model, or the name of a "
        f"bundled example ({', '.join(examples.names())}); default: vit-mnist-un",
    )
    convert.add_argument("--out", required=True, help="directory for model.onnx and the report")
    convert.add_argument("--config", help="JSON config for a .pt/.pth state dict")
    convert.add_argument("--opset", type=int, default=18, help="ONNX opset, 17..25 (default 18)")
    convert.add_argument(
        "--static-batch", action="store_true", help="batch 1, static shapes (NPU targets)"
    )
    convert.add_argument(
        "--allow-online",
        action="store_true",
        help="keep LayerNorm/RMSNorm/GroupNorm (result is not fully integer) instead of failing",
    )
    convert.set_defaults(run=_convert)
    return parser


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
