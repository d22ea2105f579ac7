"""The ``edge-un`` command line. Errors print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

import edge_un

EXIT_USAGE = 2


def _info(args: argparse.Namespace) -> int:
    """Print what a checkpoint says about itself, as JSON."""
    model, info = edge_un.load_checkpoint(args.checkpoint, config=args.config)
    summary = info.to_dict()
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(summary, indent=2, sort_keys=True))
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return run(args)
    except (edge_un.CheckpointError, ValueError, OSError) as error:
        print(f"edge-un {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"edge-un {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
