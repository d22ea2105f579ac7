"""Fine-tuning for deployment: migration, int8-ready, recalibration, their records and CLI verbs.

Tiny models on the 8x8 digits, a few epochs each: every test checks that a step improves what it
claims to improve, not that it reaches the benchmark's bars.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import edge_un
from converters import OnlineNormError, fold_norms
from edge_un import data
from edge_un.finetune import (
    FinetuneRecipe,
    distill,
    finetune_metadata,
    inference_statistics,
    make_int8_ready,
    migrate,
    recalibrate,
    residual_ranges,
    save_finetuned,
)
from edge_un.training import TrainingDivergedError, fit
from service.cli import main as cli_main

from . import norm_statistics
from .builders import model_inputs, trained_small_model

FAST = FinetuneRecipe(epochs=2, batch_size=32, lr=2e-3)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(digits: data.Dataset, tmp_path_factory: pytest.TempPathFactory):
    """A tiny LN and a tiny UN ViT trained on digits, saved with their data record."""
    folder = tmp_path_factory.mktemp("finetune")
    runs = {
        kind: fit("vit", "tiny", kind, "digits", epochs=3, dataset=digits,
                  out=folder / f"{kind}.safetensors", progress=False, log=None)
        for kind in ("ln", "un")
    }  # fmt: skip
    return runs


def _parts(digits: data.Dataset):
    x, y = digits.part("train")
    vx, vy = digits.part("val")
    return x, y, vx, vy


def test_migrate_raises_agreement_and_leaves_the_teacher_alone(checkpoints, digits) -> None:
    teacher = checkpoints["ln"].model
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    x, y, vx, vy = _parts(digits)
    result = migrate(
        teacher, x, y, recipe=FAST, val_inputs=vx, val_labels=vy, progress=False, log=None
    )
    assert result.val_agreement > result.extras["initial_agreement"] + 0.1
    assert not any(isinstance(m, nn.LayerNorm) for m in result.model.modules())
    assert sum(isinstance(m, edge_un.UnifiedNorm) for m in result.model.modules()) == 5
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert any(isinstance(m, nn.LayerNorm) for m in teacher.modules())


def test_migrate_without_labels_distils_only(checkpoints, digits) -> None:
    x, _, vx, vy = _parts(digits)
    result = migrate(
        checkpoints["ln"].model, x, recipe=FinetuneRecipe(epochs=1, lr=2e-3),
        val_inputs=vx, val_labels=vy, progress=False, log=None,
    )  # fmt: skip
    assert result.val_agreement > result.extras["initial_agreement"]
    with pytest.raises(ValueError, match="no LayerNorm to migrate"):
        migrate(checkpoints["un"].model, x, progress=False, log=None)


def test_keep_best_ends_on_the_epoch_that_agreed_best_with_the_teacher(checkpoints, digits):
    """A student that starts as its teacher's copy agrees 100 %; a learning rate far too high
    then wrecks it. keep_best must hand back the starting weights (epoch 0), the last epoch
    otherwise."""
    import copy

    x, y, vx, vy = _parts(digits)
    teacher = copy.deepcopy(checkpoints["un"].model)  # distill freezes its teacher
    wreck = FinetuneRecipe(epochs=2, batch_size=64, lr=3.0, weight_decay=0.0)
    runs = {}
    for keep_best in (False, True):
        student = copy.deepcopy(checkpoints["un"].model)
        runs[keep_best] = distill(
            student, teacher, x, y, recipe=FinetuneRecipe(**{**wreck.to_dict(),
            "keep_best": keep_best}), val_inputs=vx, val_labels=vy, progress=False, log=None,
        )  # fmt: skip
    assert runs[False].kept is None and runs[False].val_agreement < 0.9  # it did wreck it
    kept = runs[True]
    assert kept.kept is not None and kept.kept.epoch == 0 and kept.val_agreement == 1.0
    for name, value in teacher.state_dict().items():
        assert torch.equal(kept.model.state_dict()[name], value), name
    with torch.no_grad():
        assert torch.equal(kept.model.eval()(vx).argmax(-1), teacher.eval()(vx).argmax(-1))


@pytest.mark.parametrize(("threshold", "polished"), [(0.0, True), (1.01, False)])
def test_a_nearly_intact_swap_is_polished_at_the_lower_rate(
    checkpoints, digits, monkeypatch, threshold, polished
) -> None:
    import sys

    # the module, not the function edge_un.finetune re-exports under the same name
    monkeypatch.setattr(sys.modules["edge_un.finetune.migrate"], "INTACT_AGREEMENT", threshold)
    x, y, vx, vy = _parts(digits)
    lines: list[str] = []
    result = migrate(
        checkpoints["ln"].model, x, y, recipe=FinetuneRecipe(epochs=1, lr=2e-3),
        val_inputs=vx, val_labels=vy, polish_lr=1e-4, progress=False, log=lines.append,
    )  # fmt: skip
    assert result.recipe.lr == (1e-4 if polished else 2e-3)
    assert any("polishing at lr 0.0001" in line for line in lines) == polished


def test_checkpoint_records_source_recipe_and_accuracies(checkpoints, digits, tmp_path) -> None:
    x, y, vx, vy = _parts(digits)
    source = checkpoints["ln"]
    result = migrate(
        source.model, x, y, recipe=FinetuneRecipe(epochs=1, lr=2e-3), val_inputs=vx,
        val_labels=vy, progress=False, log=None,
    )  # fmt: skip
    metadata = finetune_metadata(
        result, "migrate", str(source.path), source.metadata, test=digits.part("test")
    )
    path = save_finetuned(result, tmp_path / "migrated.safetensors", metadata)
    model, info = edge_un.load_checkpoint(path)
    meta = info.metadata
    assert info.norm_kind == "un"
    assert meta["finetune"]["purpose"] == "migrate"
    assert meta["finetune"]["source"] == str(source.path)
    assert meta["recipe"]["epochs"] == 1 and meta["recipe"]["temperature"] == 2.0
    assert meta["teacher_test_accuracy"] == pytest.approx(source.test_accuracy)
    assert meta["source"]["test_accuracy"] == source.test_accuracy
    assert meta["dataset"] == "digits" and meta["split"] == source.metadata["split"]
    inputs, labels = data.checkpoint_split(info, "test")
    accuracy = (model(inputs).argmax(-1) == labels).double().mean().item()
    assert accuracy == pytest.approx(meta["test_accuracy"], abs=1e-9)


def test_range_penalty_lowers_the_residual_stream_range(checkpoints, digits) -> None:
    x, y, vx, vy = _parts(digits)
    model = checkpoints["un"].model
    before = max(residual_ranges(model, x[:256]).values())
    result = make_int8_ready(
        model, x, y, method="range", target=before / 2, weight=1.0, recipe=FAST,
        val_inputs=vx, val_labels=vy, progress=False, log=None,
    )  # fmt: skip
    after = max(result.extras["ranges_after"].values())
    assert max(result.extras["ranges_before"].values()) == pytest.approx(before)
    assert after < 0.8 * before
    assert result.val_agreement >= 0.6


def test_branch_decay_shrinks_the_output_projections(checkpoints, digits) -> None:
    x, y, _, _ = _parts(digits)
    model = checkpoints["un"].model
    result = make_int8_ready(
        model, x, y, method="decay", weight=0.05, recipe=FinetuneRecipe(epochs=1, lr=2e-3),
        progress=False, log=None,
    )  # fmt: skip

    def norm(m: nn.Module) -> float:
        with torch.no_grad():
            return sum(float(b.mlp.fc2.weight.norm() + b.attn.proj.weight.norm()) for b in m.blocks)

    assert norm(result.model) < norm(model)
    with pytest.raises(ValueError, match="unknown int8-ready method"):
        make_int8_ready(model, x, method="qat")


@pytest.mark.parametrize(("family", "kind"), [("vit", "un"), ("vit", "bn"), ("text", "un")])
def test_recalibrate_changes_only_inference_statistics(family: str, kind: str) -> None:
    model = trained_small_model(family, kind, steps=4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stats_before = inference_statistics(model)
    inputs = torch.cat([model_inputs(model, batch=16) for _ in range(4)])
    report = recalibrate(model, inputs, batches=4, batch_size=16)
    after = model.state_dict()
    changed = {k for k in state if not torch.equal(state[k], after[k])}
    assert changed, "no inference statistic moved"
    assert changed <= set(stats_before)  # weights, windows, step counters: bit-identical
    assert set(report.layers) == {k.rsplit(".", 1)[0] for k in stats_before}
    # Recomputed from the activations: the recalibrated model's forward feeds each norm what the
    # recalibration saw (every upstream norm already recalibrated; a norm's own statistics do not
    # change its input). Its new statistics are those of all batches' tokens pooled (every batch
    # has as many non-pad tokens), and TID is measured against the old and the new ones.
    batches = norm_statistics.recalibration_batches(inputs, 4, 16)
    seen = [norm_statistics.norm_inputs(model, batch) for batch in batches]
    tid_before, tid_after = [], []
    for name, tid in report.layers.items():
        centre = norm_statistics.centred(model.get_submodule(name))
        statistics = [norm_statistics.batch_statistics(s[name], centre) for s in seen]
        mean, var = norm_statistics.batch_statistics(torch.cat([s[name] for s in seen]), centre)
        close = {"rtol": 1e-5, "atol": 1e-6}
        if centre:
            torch.testing.assert_close(after[f"{name}.running_mean"].double(), mean, **close)
        torch.testing.assert_close(after[f"{name}.running_var"].double(), var, **close)
        old_mean = state[f"{name}.running_mean"] if centre else None
        tid_before.append(norm_statistics.tid(statistics, old_mean, state[f"{name}.running_var"]))
        tid_after.append(norm_statistics.tid(statistics, mean, var))
        assert tid.tid_before == pytest.approx(tid_before[-1], rel=1e-4), name
        assert tid.tid_after == pytest.approx(tid_after[-1], rel=1e-4, abs=1e-7), name
    assert np.mean(tid_after) < 0.5 * np.mean(tid_before)


class _SharedNorm(nn.Module):
    """One norm applied at two depths, as ALBERT's shared layer applies its norms."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.UnifiedNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.norm(3.0 * x)


def test_recalibrate_pools_every_call_of_a_shared_norm() -> None:
    """A norm a forward calls twice normalises both inputs with one statistic: recalibration
    takes it over both (mean square of x and of 3x: 5 x that of x), not the first call's."""
    torch.manual_seed(0)
    model, x = _SharedNorm(), torch.randn(64, 6, 4)
    report = recalibrate(model, x, batches=4, batch_size=16)
    expected = ((x.double() ** 2).mean(dim=(0, 1)) * 5).float()
    torch.testing.assert_close(model.norm.running_var, expected, rtol=1e-5, atol=1e-6)
    assert list(report.layers) == ["norm"] and report.samples == 64


def test_cli_migrate_from_npz_and_finetune_int8_ready(checkpoints, digits, tmp_path, capsys):
    x, y = digits.part("train")
    npz = tmp_path / "train.npz"
    np.savez(npz, inputs=x[:256].numpy(), labels=y[:256].numpy())
    migrated = tmp_path / "migrated.safetensors"
    argv = ["migrate", str(checkpoints["ln"].path), "--npz", str(npz), "--epochs", "1"]
    assert cli_main([*argv, "--quiet", "--threads", "1", "--out", str(migrated)]) == 0
    _, info = edge_un.load_checkpoint(migrated)
    assert info.norm_kind == "un"
    assert info.metadata["command"].startswith("edge-un migrate ")
    assert info.metadata["dataset"] == "digits"  # the source's record survives an npz run
    ready = tmp_path / "ready.safetensors"
    argv = ["finetune", str(migrated), "--int8-ready", "--epochs", "1", "--recalibrate", "2"]
    capsys.readouterr()
    assert cli_main([*argv, "--threads", "1", "--out", str(ready)]) == 0  # not --quiet
    captured = capsys.readouterr()
    assert f"wrote {ready} (test accuracy" in captured.out
    assert "epoch 1/1: loss " in captured.out  # the epoch lines, but no bar redraws in a pipe
    assert "step/s" not in captured.err and "\r" not in captured.err, captured.err[-300:]
    _, info = edge_un.load_checkpoint(ready)
    assert info.metadata["finetune"]["purpose"] == "int8-ready"
    assert info.metadata["finetune"]["method"] == "decay"
    assert "recalibration" in info.metadata["finetune"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["finetune", "{un}", "--epochs", "1"], "nothing to do: pass --int8-ready"),
        (["migrate", "{un}", "--epochs", "1"], "has no LayerNorm to migrate"),
        (["migrate", "{ln}", "--npz", "{bad}"], "no 'inputs' array"),
        (["migrate", "{ln}", "--data", "mnist"], "was trained on 'digits', not 'mnist'"),
        (["migrate", "{ln}", "--epochs", "0"], "epochs must be positive, got 0"),
    ],
)
def test_cli_bad_input_is_one_line(checkpoints, tmp_path, capsys, argv, message) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, labels=np.zeros(3))
    paths = {"un": checkpoints["un"].path, "ln": checkpoints["ln"].path, "bad": bad}
    argv = [a.format(**paths) for a in argv]
    assert cli_main([*argv, "--quiet", "--out", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "x.safetensors").exists()


def test_converter_error_for_layernorm_names_migrate(checkpoints) -> None:
    with pytest.raises(OnlineNormError, match="edge-un migrate"):
        fold_norms(checkpoints["ln"].model)


@pytest.mark.parametrize("run", ["train", "migrate", "int8-ready"])
def test_every_run_stops_at_the_first_non_finite_loss(run: str, checkpoints, digits) -> None:
    """Training from scratch, migration and the int8-ready fine-tune step through one loop: a
    learning rate that blows the weights up on the first step is caught by its loss on the
    second, before any step on it, whichever entry point ran."""
    x, y, vx, vy = _parts(digits)
    wild = FinetuneRecipe(epochs=1, lr=1e30)
    quiet = {"progress": False, "log": None}
    with pytest.raises(TrainingDivergedError) as raised:
        if run == "train":
            fit("vit", "tiny", "ln", "digits", epochs=1, lr=1e30, dataset=digits, **quiet)
        elif run == "migrate":
            migrate(checkpoints["ln"].model, x, y, recipe=wild, val_inputs=vx, val_labels=vy,
                    **quiet)  # fmt: skip
        else:
            make_int8_ready(checkpoints["un"].model, x, y, recipe=wild, **quiet)
    message = str(raised.value)
    words = "training" if run == "train" else "fine-tune"
    assert re.match(rf"{words} diverged: loss is (nan|inf) at epoch 1, step 2 \(", message)
    assert "lr=1e+30" in message and message.endswith("try a lower learning rate (--lr)")
