"""Fine-tuning for deployment, measured: LayerNorm -> UN migration and the int8-ready fine-tune.

Stages (each run is one record in the JSON, keyed by its id; a run already there is skipped,
so the benchmark resumes after a kill):

  baseline   residual-stream abs max per norm input and pure-int8 ORT quality of the bundled
             UN and LN examples of a task
  migrate    migrate <task>-ln to UN with edge_un.migrate (distillation + labels, or labels
             only with --labels-only), N epochs, per seed
  zero       swap LN for UN and measure statistics from data, no fine-tuning (the starting point)
  scratch    from-scratch UN training with the example recipe for N epochs (the reference a
             migration must beat on cost)
  int8       edge_un.make_int8_ready on a UN checkpoint (a bundled example or a candidate), one
             method and weight, per seed; residual ranges before/after, fp32 and int8 quality
  recal      edge_un.recalibrate on a UN checkpoint: TID per layer and test accuracy before and
             after precise inference statistics, for several batch counts (no training)
  report     rewrite finetune.md and the plots from the JSON

Every produced checkpoint goes to benchmarks/results/candidates/<id>.safetensors. int8 quality
is benchmarks.training.int8_ort: QDQ, per-channel s8 weights, symmetric s8 activations, MinMax on
256 training samples, 1000 test samples. One training process with one thread at a time.

Usage:  python -m benchmarks.training.finetune migrate --task vit-mnist --seeds 0 1 2 --epochs 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.results import RESULTS

CANDIDATES = RESULTS / "candidates"
JSON_PATH = RESULTS / "finetune.json"
MD_PATH = RESULTS / "finetune.md"
TASKS = {"vit-mnist": ("vit", "mnist"), "text-rt": ("text", "rt")}


# -- bookkeeping -----------------------------------------------------------------------------


def load_runs() -> dict[str, dict[str, Any]]:
    if not JSON_PATH.is_file():
        return {}
    return json.loads(JSON_PATH.read_text())["runs"]


def save_run(run_id: str, record: dict[str, Any]) -> None:
    runs = load_runs()
    runs[run_id] = record
    RESULTS.mkdir(parents=True, exist_ok=True)
    notes = json.loads(JSON_PATH.read_text()).get("notes", []) if JSON_PATH.is_file() else []
    payload = {
        "description": "fine-tuning for deployment: migration LN -> UN and int8-ready; see "
        "benchmarks/training/finetune.py for what each stage measures",
        "torch_threads": 1,
        "notes": notes,
        "runs": dict(sorted(runs.items())),
    }
    tmp = JSON_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(JSON_PATH)


def _source(name_or_path: str) -> Path:
    from edge_un import examples

    if name_or_path in examples.names():
        return examples.path(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        path = CANDIDATES / f"{name_or_path}.safetensors"
    return path


def _int8(path: Path) -> dict[str, Any]:
    from benchmarks.training.int8_ort import int8_quality

    return int8_quality(path)


def _ranges(model: Any, info: Any) -> dict[str, float]:
    from edge_un.data import checkpoint_split
    from edge_un.finetune import residual_ranges

    train_x, _ = checkpoint_split(info, "train")
    return residual_ranges(model, train_x[:256])


# -- stages ----------------------------------------------------------------------------------


def baseline(task: str) -> None:
    import edge_un

    for kind in ("un", "ln"):
        run_id = f"baseline-{task}-{kind}"
        if run_id in load_runs():
            continue
        path = _source(f"{task}-{kind}")
        model, info = edge_un.load_checkpoint(path)
        record = {"stage": "baseline", "task": task, "model": path.name,
                  "test_accuracy": info.metadata["test_accuracy"],
                  "ranges": _ranges(model, info)}  # fmt: skip
        if kind == "un":  # ORT keeps LayerNormalization in float: not a pure-int8 comparison
            record["int8_ort"] = _int8(path)
        save_run(run_id, record)
        print(run_id, json.dumps(record)[:300])


def migrate_stage(task: str, seeds: list[int], epochs: int, lr: float, labels_only: bool) -> None:
    import edge_un
    from edge_un.finetune import FinetuneRecipe, finetune_metadata, save_finetuned
    from edge_un.finetune.model_runs import load_finetune_data

    mode = "labels" if labels_only else "distill"
    for seed in seeds:
        run_id = f"migrate-{task}-{mode}-e{epochs}-lr{lr:g}-s{seed}"
        if run_id in load_runs():
            continue
        path = _source(f"{task}-ln")
        model, info = edge_un.load_checkpoint(path)
        data = load_finetune_data(info)
        recipe = FinetuneRecipe(epochs=epochs, lr=lr, seed=seed, shift=data.shift,
                                distill=not labels_only)  # fmt: skip
        start = time.perf_counter()
        result = edge_un.migrate(
            model, data.inputs, data.labels, recipe=recipe, val_inputs=data.val_inputs,
            val_labels=data.val_labels, progress=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        metadata = finetune_metadata(result, "migrate", f"{task}-ln", info.metadata, data.test)
        out = save_finetuned(result, CANDIDATES / f"{run_id}.safetensors", metadata)
        record = {
            "stage": "migrate", "task": task, "mode": mode, "seed": seed, "epochs": epochs,
            "lr": lr, "seconds": round(seconds, 1), "checkpoint": str(out.relative_to(RESULTS)),
            "initial_agreement": result.extras["initial_agreement"],
            "test_accuracy": metadata["test_accuracy"],
            "teacher_test_accuracy": metadata["teacher_test_accuracy"],
            "test_agreement_with_teacher": metadata["test_agreement_with_teacher"],
            "history": result.history_dicts(), "ranges": _ranges(result.model, info),
        }  # fmt: skip
        record["int8_ort"] = _int8(out)
        save_run(run_id, record)
        print(run_id, {k: record[k] for k in ("test_accuracy", "teacher_test_accuracy")})


def zero_stage(task: str) -> None:
    """Swap LN for UN and measure the statistics from data, with no fine-tuning at all: what
    migrate's initialisation alone gives (its 'before fine-tune' point)."""
    import edge_un
    from edge_un.finetune import agreement, migration_student, predict
    from edge_un.finetune.model_runs import load_finetune_data

    run_id = f"zero-{task}"
    if run_id in load_runs():
        return
    model, info = edge_un.load_checkpoint(_source(f"{task}-ln"))
    data = load_finetune_data(info)
    student, _, _ = migration_student(model, data.inputs, "un", batches=20)
    test_x, test_y = data.test
    logits, teacher = predict(student, test_x), predict(model, test_x)
    out = edge_un.save_checkpoint(student, CANDIDATES / f"{run_id}.safetensors", {
        k: info.metadata[k] for k in ("dataset", "split", "preprocessing", "task", "preset")
    })  # fmt: skip
    record = {
        "stage": "zero", "task": task, "seed": 0,
        "test_accuracy": float((logits.argmax(-1) == test_y).double().mean()),
        "teacher_test_accuracy": float((teacher.argmax(-1) == test_y).double().mean()),
        "test_agreement_with_teacher": agreement(logits, teacher),
        "ranges": _ranges(student, info), "int8_ort": _int8(out),
    }  # fmt: skip
    save_run(run_id, record)
    print(run_id, json.dumps({k: record[k] for k in ("test_accuracy", "int8_ort")}))


def scratch_stage(task: str, seeds: list[int], epochs: int) -> None:
    from edge_un.training import fit

    model, data = TASKS[task]
    for seed in seeds:
        run_id = f"scratch-{task}-un-e{epochs}-s{seed}"
        if run_id in load_runs():
            continue
        start = time.perf_counter()
        result = fit(model, "example", "un", data, epochs=epochs, seed=seed, progress=False)
        record = {
            "stage": "scratch", "task": task, "seed": seed, "epochs": epochs,
            "seconds": round(time.perf_counter() - start, 1),
            "test_accuracy": result.test_accuracy,
            "history": [{"epoch": r.epoch, "val_accuracy": r.val_accuracy}
                        for r in result.history],
        }  # fmt: skip
        save_run(run_id, record)
        print(run_id, record["test_accuracy"])


def int8_stage(
    source: str, method: str, weight: float, target: float, seeds: list[int], epochs: int,
    lr: float,
) -> None:  # fmt: skip
    import edge_un
    from edge_un.finetune import FinetuneRecipe, finetune_metadata, save_finetuned
    from edge_un.finetune.model_runs import load_finetune_data

    for seed in seeds:
        tag = f"t{target:g}" if method in ("range", "growth") else ""
        run_id = f"int8-{source}-{method}-w{weight:g}{tag}-e{epochs}-lr{lr:g}-s{seed}"
        if run_id in load_runs():
            continue
        path = _source(source)
        model, info = edge_un.load_checkpoint(path)
        data = load_finetune_data(info)
        recipe = FinetuneRecipe(epochs=epochs, lr=lr, seed=seed, shift=data.shift)
        start = time.perf_counter()
        result = edge_un.make_int8_ready(
            model, data.inputs, data.labels, method=method, weight=weight, target=target,
            recipe=recipe, val_inputs=data.val_inputs, val_labels=data.val_labels,
            progress=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        metadata = finetune_metadata(result, "int8-ready", source, info.metadata, data.test)
        out = save_finetuned(result, CANDIDATES / f"{run_id}.safetensors", metadata)
        record = {
            "stage": "int8", "source": source, "method": method, "weight": weight,
            "target": target if method in ("range", "growth") else None, "seed": seed,
            "epochs": epochs,
            "lr": lr, "seconds": round(seconds, 1), "checkpoint": str(out.relative_to(RESULTS)),
            "source_test_accuracy": metadata["teacher_test_accuracy"],
            "test_accuracy": metadata["test_accuracy"],
            "test_agreement_with_teacher": metadata["test_agreement_with_teacher"],
            "ranges_before": result.extras["ranges_before"],
            "ranges_after": result.extras["ranges_after"],
            "history": result.history_dicts(), "int8_ort": _int8(out),
        }  # fmt: skip
        save_run(run_id, record)
        print(run_id, json.dumps({k: record[k] for k in ("test_accuracy", "int8_ort")}))


def recal_stage(source: str, batch_counts: list[int]) -> None:
    import edge_un
    from edge_un.data import checkpoint_split
    from edge_un.finetune import predict

    for batches in batch_counts:
        run_id = f"recal-{source}-b{batches}"
        if run_id in load_runs():
            continue
        model, info = edge_un.load_checkpoint(_source(source))
        train_x, _ = checkpoint_split(info, "train")
        test_x, test_y = checkpoint_split(info, "test")
        before = float((predict(model, test_x).argmax(-1) == test_y).double().mean())
        report = edge_un.recalibrate(model, train_x, batches=batches)
        after = float((predict(model, test_x).argmax(-1) == test_y).double().mean())
        record = {"stage": "recal", "source": source, "batches": batches, "seed": 0,
                  "test_accuracy_before": before, "test_accuracy_after": after,
                  **report.as_dict()}  # fmt: skip
        save_run(run_id, record)
        print(run_id, before, after)


# -- report ----------------------------------------------------------------------------------


def report() -> None:
    from benchmarks.training.finetune_report import write_report

    write_report(load_runs(), MD_PATH, RESULTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stages = parser.add_subparsers(dest="stage", required=True)
    for name in ("baseline", "migrate", "zero", "scratch", "int8", "recal", "report"):
        stage = stages.add_parser(name)
        stage.add_argument("--task", choices=list(TASKS), default="vit-mnist")
        stage.add_argument("--seeds", type=int, nargs="+", default=[0])
        stage.add_argument("--epochs", type=int, default=20)
        stage.add_argument("--lr", type=float, default=1e-3)
        if name == "migrate":
            stage.add_argument("--labels-only", action="store_true")
        if name in ("int8", "recal"):
            stage.add_argument("--source", default="vit-mnist-un")
            stage.add_argument("--batches", type=int, nargs="+", default=[20])
            stage.add_argument("--method", default="decay",
                               choices=("range", "growth", "decay", "fakequant"))  # fmt: skip
            stage.add_argument("--weight", type=float, default=1.0)
            stage.add_argument("--target", type=float, default=8.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.stage == "baseline":
        baseline(args.task)
    elif args.stage == "migrate":
        migrate_stage(args.task, args.seeds, args.epochs, args.lr, args.labels_only)
    elif args.stage == "zero":
        zero_stage(args.task)
    elif args.stage == "scratch":
        scratch_stage(args.task, args.seeds, args.epochs)
    elif args.stage == "recal":
        recal_stage(args.source, args.batches)
    elif args.stage == "int8":
        int8_stage(args.source, args.method, args.weight, args.target, args.seeds, args.epochs,
                   args.lr)  # fmt: skip
    report()


if __name__ == "__main__":
    main()
