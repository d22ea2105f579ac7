"""``info``, ``train``, ``migrate`` and ``finetune``: the command line over edge_un (the logic and
its tqdm progress bars live there). ``migrate`` and ``finetune`` take an edge_un checkpoint or a
Hugging Face model directory and write the same kind."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from service.errors import UsageError

from . import output
from .app import command
from .choices import Dataset, FinetuneMethod, Model, NormKind, OfflineKind

PANEL = "Train"

Checkpoint = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help=".safetensors checkpoint, or a Hugging Face model directory (save_pretrained).",
        show_default=False,
    ),
]
Out = Annotated[
    str,
    typer.Option(
        metavar="PATH",
        help="Checkpoint to write (.safetensors), or the directory for a Hugging Face model.",
        show_default=False,
    ),
]
Epochs = Annotated[
    int | None,
    typer.Option(
        help="Default: migrate 20, finetune 10 (Hugging Face models: as many as make about 1600 "
        "and 400 steps, at most 30)."
    ),
]
BatchSize = Annotated[int | None, typer.Option(help="Default 32 (Hugging Face models: 64).")]
Lr = Annotated[
    float | None,
    typer.Option(
        help="Peak learning rate. Default: migrate 1e-3, finetune 5e-4 (Hugging Face models: "
        "migrate 2e-3, or 2e-4 when the swapped model still agrees with its teacher on >= 80 % "
        "of the validation samples, keeping the epoch that agrees best; finetune 5e-4)."
    ),
]
Seed = Annotated[int | None, typer.Option()]
Data = Annotated[
    Dataset | None,
    typer.Option(help="Data set (default: the one the model records); not with --npz."),
]
Npz = Annotated[
    str | None,
    typer.Option(
        metavar="F.npz",
        help="One array per model input, named as the model names it ('inputs' for an edge_un "
        "checkpoint; 'pixel_values', or 'input_ids' [, 'attention_mask', 'token_type_ids'] for "
        "a Hugging Face model), optional 'labels', and 'val_'-prefixed twins for validation.",
    ),
]
NoLabels = Annotated[bool, typer.Option("--no-labels", help="Distillation only.")]
LabelsOnly = Annotated[bool, typer.Option("--labels-only", help="No teacher (ablation).")]
Recalibrate = Annotated[
    int | None,
    typer.Option(metavar="N", help="Then recompute inference statistics over N training batches."),
]
Threads = Annotated[int | None, typer.Option(help="torch CPU threads.")]
Quiet = Annotated[bool, typer.Option("--quiet", help="No progress bar.")]


def _bars(quiet: bool) -> bool:
    """tqdm bars on a terminal only: piped to a log they would be thousands of redraws."""
    return not quiet and sys.stderr.isatty()


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


@command(rich_help_panel=PANEL)
def info(
    checkpoint: Annotated[
        str, typer.Argument(help=".safetensors checkpoint (or .pt/.pth with --config).")
    ],
    config: Annotated[
        str | None, typer.Option(metavar="JSON", help="JSON config for a .pt/.pth state dict.")
    ] = None,
) -> int:
    """Show a checkpoint's architecture, norm and metadata (JSON)."""
    import edge_un

    model, checkpoint_info = edge_un.load_checkpoint(checkpoint, config=config)
    summary = checkpoint_info.to_dict()
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    output.stdout().print_json(json.dumps(summary, sort_keys=True), indent=2, highlight=False)
    return 0


@command(rich_help_panel=PANEL)
def train(
    out: Out,
    model: Annotated[Model, typer.Option()] = "vit",
    preset: Annotated[
        str, typer.Option(help="Model + recipe size (tiny, example, bench).")
    ] = "tiny",
    norm: Annotated[NormKind, typer.Option()] = "un",
    data: Annotated[
        Dataset | None, typer.Option(help="Default: mnist for vit, rt for text.")
    ] = None,
    epochs: Annotated[int | None, typer.Option(help="Default: the preset's.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Default: the preset's.")] = None,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate; default: the preset's.")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    post_norm: Annotated[
        bool, typer.Option("--post-norm", help="Post-norm blocks (text only).")
    ] = False,
    threads: Threads = None,
    quiet: Quiet = False,
) -> int:
    """Train a reference model on real offline data and write its checkpoint."""
    from edge_un.training import fit

    _set_threads(threads)
    result = fit(
        model,
        preset,
        norm,
        data,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        norm_first=not post_norm,
        out=out,
        progress=_bars(quiet),
    )
    output.stdout().print(f"wrote {result.path} (test accuracy {result.test_accuracy:.4f})")
    return 0


@command(rich_help_panel=PANEL)
def migrate(
    checkpoint: Checkpoint,
    out: Out,
    kind: Annotated[OfflineKind, typer.Option(help="The offline norm to migrate to.")] = "un",
    data: Data = None,
    npz: Npz = None,
    epochs: Epochs = None,
    batch_size: BatchSize = None,
    lr: Lr = None,
    seed: Seed = None,
    no_labels: NoLabels = False,
    labels_only: LabelsOnly = False,
    recalibrate: Recalibrate = None,
    threads: Threads = None,
    quiet: Quiet = False,
) -> int:
    """Swap LayerNorm for UN (or another offline norm) and distil to recover the accuracy."""
    return _finetune_job("migrate", checkpoint, out, {"kind": kind}, {"kind": kind}, locals())


@command(rich_help_panel=PANEL)
def finetune(
    checkpoint: Checkpoint,
    out: Out,
    int8_ready: Annotated[
        bool, typer.Option("--int8-ready", help="Bound the residual stream's range.")
    ] = False,
    method: Annotated[FinetuneMethod, typer.Option()] = "decay",
    weight: Annotated[
        float | None, typer.Option(help="Penalty weight (default per method).")
    ] = None,
    target: Annotated[float, typer.Option(help="Range: allowed abs max.")] = 8.0,
    data: Data = None,
    npz: Npz = None,
    epochs: Epochs = None,
    batch_size: BatchSize = None,
    lr: Lr = None,
    seed: Seed = None,
    no_labels: NoLabels = False,
    labels_only: LabelsOnly = False,
    recalibrate: Recalibrate = None,
    threads: Threads = None,
    quiet: Quiet = False,
) -> int:
    """Fine-tune a UN model, e.g. --int8-ready so that pure int8 quantization is accurate."""
    if not int8_ready:
        raise UsageError("nothing to do: pass --int8-ready (the only fine-tune so far)")
    options = {"method": method, "weight": weight, "target": target}
    recorded = {"int8_ready": int8_ready, **options}
    return _finetune_job("int8-ready", checkpoint, out, options, recorded, locals())


# The options a migrate/finetune run records in its checkpoint's "command", in this order.
_COMMON = ("data", "npz", "epochs", "batch_size", "lr", "seed", "no_labels", "labels_only",
           "recalibrate", "threads")  # fmt: skip


def _exclusive(params: dict[str, Any], *names: str) -> None:
    given = [name for name in names if params[name] not in (None, False)]
    if len(given) > 1:
        flags = " and ".join(f"--{name.replace('_', '-')}" for name in given)
        raise typer.BadParameter(f"{flags} cannot be used together")


def _finetune_job(
    purpose: str,
    checkpoint: str,
    out: str,
    job_options: dict[str, Any],
    recorded_options: dict[str, Any],
    params: dict[str, Any],
) -> int:
    """``migrate`` and ``finetune`` both distil a student from a frozen teacher on data."""
    _exclusive(params, "data", "npz")
    _exclusive(params, "no_labels", "labels_only")
    from edge_un.finetune.model_runs import finetune_model

    _set_threads(params["threads"])
    command_name = "migrate" if purpose == "migrate" else "finetune"
    recorded = [command_name, checkpoint]
    for key, value in [*recorded_options.items(), *((k, params[k]) for k in _COMMON)]:
        if value is not None and value is not False:
            recorded += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    recorded += ["--out", out]
    overrides = {"epochs": params["epochs"], "batch_size": params["batch_size"],
                 "lr": params["lr"], "seed": params["seed"]}  # fmt: skip
    if params["labels_only"]:
        overrides["distill"] = False
    console = output.stdout()
    path, metadata = finetune_model(
        purpose,
        checkpoint,
        out,
        data=params["data"],
        npz=params["npz"],
        recipe_overrides=overrides,
        use_labels=not params["no_labels"],
        recalibrate_batches=params["recalibrate"] or 0,
        job_options=job_options,
        argv=recorded,
        progress=_bars(params["quiet"]),
        log=None if params["quiet"] else console.print,
    )
    console.print(f"wrote {path} ({_scores(metadata)})")
    return 0


def _scores(metadata: dict[str, Any]) -> str:
    """The written model's scores: on the test split when the data has one, else validation."""
    if "test_accuracy" in metadata:
        return (
            f"test accuracy {metadata['test_accuracy']:.4f}, teacher "
            f"{metadata['teacher_test_accuracy']:.4f}, agreement "
            f"{metadata['test_agreement_with_teacher']:.4f}"
        )
    scores = [f"validation agreement with the teacher {metadata['val_agreement_with_teacher']:.4f}"]
    if "val_accuracy" in metadata:
        scores.insert(0, f"validation accuracy {metadata['val_accuracy']:.4f}")
    return ", ".join(scores)
