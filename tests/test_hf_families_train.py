"""The transformers families users bring, on the training side: each one's smallest useful
config, saved by transformers alone (no edge_un record, as a user's directory), goes through
`edge-un migrate DIR --npz` and `edge-un finetune --int8-ready --npz` (its default method, decay
on the residual branches' output projections) on the data that ships in wheels: sklearn's digits
for the image models, Rotten Tomatoes at 48 tokens (edge_un's word tokenizer) for the text ones.

One short epoch each: the tests check what was swapped, what the int8-ready pressure acted on
(each family names its projections its own way), the records, and that the written directory
computes the figures it records; not accuracy (benchmarks/conversion/hf_families.py trains real
ones)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import edge_un
from edge_un import data
from edge_un.finetune import FinetuneRecipe, NoBranchOutputsError
from service.cli import main as cli_main

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

ONE_EPOCH = ["--epochs", "1", "--batch-size", "32", "--quiet", "--threads", "1"]
TRAIN, VAL = 320, 100  # samples of each npz
TOKENS = 48  # Rotten Tomatoes as edge_un tokenizes it
REPO = Path(__file__).resolve().parents[1]
TINY = {"num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}


@dataclass(frozen=True)
class Family:
    """One family's tiny model, what `migrate` must swap and what `decay` must act on."""

    build: Callable[[int], nn.Module]  # vocabulary size (text) -> an LN model, random weights
    image: bool
    layernorms: list[str]  # every LayerNorm, as transformers names it
    branch_outputs: list[str]  # the residual branches' output projections
    calls: dict[str, int] | None = None  # norms a forward calls more than once


def _blocks(prefix: str, *names: str, depth: int = 2) -> list[str]:
    return [f"{prefix}.{i}.{name}" for i in range(depth) for name in names]


def _text(config_class: type, model_class: type, **sizes: object) -> Callable[[int], nn.Module]:
    def build(vocab: int) -> nn.Module:
        config = config_class(vocab_size=vocab, pad_token_id=data.PAD_ID, num_labels=2, **sizes)
        return model_class(config)

    return build


def _image(config_class: type, model_class: type, **sizes: object) -> Callable[[int], nn.Module]:
    def build(_: int) -> nn.Module:
        config = config_class(image_size=8, num_channels=1, num_labels=10, **sizes)
        return model_class(config)

    return build


def _families() -> dict[str, Family]:
    t = transformers
    vit_sizes = {"patch_size": 4, "hidden_size": 16, **TINY}
    bert_like = {"hidden_size": 16, "max_position_embeddings": TOKENS, **TINY}
    bert_names = ("attention.output.LayerNorm", "output.LayerNorm")
    bert_outputs = ("attention.output.dense", "output.dense")
    albert_layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    swin_stages = "swin.encoder.layers"
    swin_blocks = [f"{swin_stages}.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]
    pre_norms = ("layernorm_before", "layernorm_after")
    return {
        "vit": Family(
            _image(t.ViTConfig, t.ViTForImageClassification, **vit_sizes), True,
            [*_blocks("vit.layers", *pre_norms), "vit.layernorm"],
            _blocks("vit.layers", "attention.o_proj", "mlp.fc2"),
        ),
        "deit": Family(  # the cls and the distillation token
            _image(t.DeiTConfig, t.DeiTForImageClassification, **vit_sizes), True,
            [*_blocks("deit.layers", *pre_norms), "deit.layernorm"],
            _blocks("deit.layers", "attention.o_proj", "mlp.fc2"),
        ),
        "swin": Family(  # 4 x 4 patches, windows of 2 x 2 (shifted in each second block)
            _image(t.SwinConfig, t.SwinForImageClassification, patch_size=2, window_size=2,
                   embed_dim=16, depths=[2, 2], num_heads=[2, 2]), True,
            ["swin.embeddings.norm", *[f"{b}.{n}" for b in swin_blocks[:2] for n in pre_norms],
             f"{swin_stages}.0.downsample.norm",
             *[f"{b}.{n}" for b in swin_blocks[2:] for n in pre_norms], "swin.layernorm"],
            [f"{b}.{n}" for b in swin_blocks for n in ("attention.o_proj", "mlp.fc2")],
        ),
        "bert": Family(
            _text(t.BertConfig, t.BertForSequenceClassification, **bert_like), False,
            ["bert.embeddings.LayerNorm", *_blocks("bert.encoder.layer", *bert_names)],
            _blocks("bert.encoder.layer", *bert_outputs),
        ),
        "distilbert": Family(
            _text(t.DistilBertConfig, t.DistilBertForSequenceClassification, dim=16, n_layers=2,
                  n_heads=2, hidden_dim=32, max_position_embeddings=TOKENS), False,
            ["distilbert.embeddings.LayerNorm",
             *_blocks("distilbert.transformer.layer", "sa_layer_norm", "output_layer_norm")],
            _blocks("distilbert.transformer.layer", "attention.out_lin", "ffn.lin2"),
        ),
        "roberta": Family(  # positions start after the padding index: 48 tokens take 49
            _text(t.RobertaConfig, t.RobertaForSequenceClassification,
                  **{**bert_like, "max_position_embeddings": TOKENS + 1}), False,
            ["roberta.embeddings.LayerNorm", *_blocks("roberta.encoder.layer", *bert_names)],
            _blocks("roberta.encoder.layer", *bert_outputs),
        ),
        "albert": Family(  # factorized embeddings, one layer shared by both depths
            _text(t.AlbertConfig, t.AlbertForSequenceClassification, embedding_size=8,
                  **bert_like), False,
            ["albert.embeddings.LayerNorm", f"{albert_layer}.full_layer_layer_norm",
             f"{albert_layer}.attention.LayerNorm"],
            [f"{albert_layer}.attention.dense", f"{albert_layer}.ffn_output"],
            calls={f"{albert_layer}.attention.LayerNorm": 2,
                   f"{albert_layer}.full_layer_layer_norm": 2},
        ),
        "electra": Family(
            _text(t.ElectraConfig, t.ElectraForSequenceClassification, embedding_size=8,
                  **bert_like), False,
            ["electra.embeddings.LayerNorm", *_blocks("electra.encoder.layer", *bert_names)],
            _blocks("electra.encoder.layer", *bert_outputs),
        ),
        "gpt2": Family(  # Conv1D, pre-norm, causal, pooled at the last non-pad token
            _text(t.GPT2Config, t.GPT2ForSequenceClassification, n_embd=16, n_layer=2, n_head=2,
                  n_positions=TOKENS, bos_token_id=None, eos_token_id=None), False,
            [*_blocks("transformer.h", "ln_1", "ln_2"), "transformer.ln_f"],
            _blocks("transformer.h", "attn.c_proj", "mlp.c_proj"),
        ),
    }  # fmt: skip


FAMILIES = _families()


# -- data from the wheels --------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt() -> data.Dataset:
    return data.load_dataset("rt")


def _split_arrays(inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, np.ndarray]:
    arrays = {name: tensor.numpy() for name, tensor in inputs.items()}
    return {**arrays, "labels": labels.numpy()}


def _write_npz(path: Path, train: dict[str, np.ndarray], val: dict[str, np.ndarray]) -> Path:
    np.savez(path, **train, **{f"val_{name}": array for name, array in val.items()})
    return path


@pytest.fixture(scope="module")
def image_npz(digits: data.Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    (x, y), (vx, vy) = digits.part("train"), digits.part("val")
    return _write_npz(
        tmp_path_factory.mktemp("npz") / "digits.npz",
        _split_arrays({"pixel_values": x[:TRAIN]}, y[:TRAIN]),
        _split_arrays({"pixel_values": vx[:VAL]}, vy[:VAL]),
    )


def _tokens(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "attention_mask": (ids != data.PAD_ID).long()}


@pytest.fixture(scope="module")
def text_npz(rt: data.Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    (x, y), (vx, vy) = rt.part("train"), rt.part("val")
    return _write_npz(
        tmp_path_factory.mktemp("npz") / "rt.npz",
        _split_arrays(_tokens(x[:TRAIN]), y[:TRAIN]),
        _split_arrays(_tokens(vx[:VAL]), vy[:VAL]),
    )


def _source(name: str, rt: data.Dataset, directory: Path) -> Path:
    """The family's LN model saved by transformers alone, as a user's directory."""
    torch.manual_seed(0)
    FAMILIES[name].build(_vocabulary(rt)).save_pretrained(directory)
    return directory


def _vocabulary(rt: data.Dataset) -> int:
    return len(rt.preprocessing["tokenizer"]["vocab"]) + 2


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The command's exit code, stdout and stderr (not what the test printed before it)."""
    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@torch.no_grad()
def _val_predictions(model: nn.Module, npz: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top-1 on the npz's validation inputs, and its validation labels."""
    with np.load(npz) as arrays:
        feeds = {name[4:]: torch.from_numpy(arrays[name]) for name in arrays.files
                 if name.startswith("val_") and name != "val_labels"}  # fmt: skip
        labels = torch.from_numpy(arrays["val_labels"])
    return model.eval()(**feeds).logits.argmax(-1), labels


def _share(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).double().mean())


def _norm_names(model: nn.Module, kind: type) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, kind)]


# -- every family through the two commands ---------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_migrates_and_gets_int8_ready_from_the_command_line(
    name: str, rt: data.Dataset, image_npz: Path, text_npz: Path, tmp_path: Path, capsys
) -> None:
    family = FAMILIES[name]
    npz = image_npz if family.image else text_npz
    source = _source(name, rt, tmp_path / f"{name}-ln")
    teacher, _ = edge_un.load_pretrained(source)
    assert _norm_names(teacher, nn.LayerNorm) == family.layernorms

    migrated = tmp_path / f"{name}-un"
    code, stdout, err = run(["migrate", source, "--npz", npz, *ONE_EPOCH, "--out", migrated],
                            capsys)  # fmt: skip
    assert code == 0, err
    student, info = edge_un.load_pretrained(migrated)
    assert info.architecture == type(teacher).__name__ and info.norm_kind == "un"
    assert not _norm_names(student, nn.LayerNorm)
    assert _norm_names(student, edge_un.UnifiedNorm) == family.layernorms
    meta = info.metadata["finetune"]
    assert meta["purpose"] == "migrate" and meta["swapped"] == len(family.layernorms)
    inputs = "pixel_values" if family.image else "input_ids, attention_mask"
    assert meta["data"] == f"{npz.name} ({TRAIN} samples: {inputs})"
    # A shared norm runs once per depth: its UN warm-up counts that many calls per step.
    warmup = meta["recipe"]["norm_warmup_iters"]
    steps = min(warmup.values())
    calls = family.calls or {}
    assert warmup == {norm: steps * calls.get(norm, 1) for norm in family.layernorms}
    # The figures it prints and records are what the written directory computes.
    mine, labels = _val_predictions(student, npz)
    agreement = _share(mine, _val_predictions(teacher, npz)[0])
    assert agreement == pytest.approx(info.metadata["val_agreement_with_teacher"], abs=1e-12)
    assert _share(mine, labels) == pytest.approx(info.metadata["val_accuracy"], abs=1e-12)
    assert f"validation agreement with the teacher {agreement:.4f}" in stdout

    ready = tmp_path / f"{name}-un-int8"
    code, stdout, err = run(["finetune", migrated, "--int8-ready", "--npz", npz, *ONE_EPOCH,
                             "--out", ready], capsys)  # fmt: skip
    assert code == 0, err
    model, info = edge_un.load_pretrained(ready)
    assert _norm_names(model, edge_un.UnifiedNorm) == family.layernorms
    meta = info.metadata["finetune"]
    assert meta["purpose"] == "int8-ready" and meta["method"] == "decay"
    assert meta["applied_to"] == family.branch_outputs  # this family's own names, each once
    assert meta["history"][0]["extra_loss"] > 0  # the decay term acted on their weights
    assert set(meta["ranges_before"]) == set(meta["ranges_after"]) == set(family.layernorms)
    mine, _ = _val_predictions(model, npz)
    agreement = _share(mine, _val_predictions(student, npz)[0])
    assert agreement == pytest.approx(info.metadata["val_agreement_with_teacher"], abs=1e-12)


# -- what a family needs -----------------------------------------------------------------------


def test_a_family_without_known_branch_outputs_is_pointed_to_range(
    rt: data.Dataset, text_npz: Path, tmp_path: Path, capsys
) -> None:
    """BLOOM (not one of the families) names its projections self_attention.dense and
    mlp.dense_4h_to_h: decay is refused in one line that names --method range, which works."""
    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=_vocabulary(rt), hidden_size=16, n_layer=2,
        n_head=2, pad_token_id=data.PAD_ID, num_labels=2,
    )  # fmt: skip
    with np.load(text_npz) as arrays:
        inputs = _tokens(torch.from_numpy(arrays["input_ids"]))
    recipe = FinetuneRecipe(epochs=1, batch_size=32)
    migrated = edge_un.migrate(
        transformers.BloomForSequenceClassification(config).eval(), inputs, recipe=recipe,
        progress=False, log=None,
    )  # fmt: skip
    with pytest.raises(NoBranchOutputsError, match=r"use --method range \(method='range'\)"):
        edge_un.make_int8_ready(migrated.model, inputs, method="decay", progress=False, log=None)
    source = edge_un.save_pretrained(migrated.model, tmp_path / "bloom-un")

    code, _, err = run(["finetune", source, "--int8-ready", "--npz", text_npz, *ONE_EPOCH,
                        "--out", tmp_path / "decayed"], capsys)  # fmt: skip
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(r"no residual branch output projection .* found in "
                     r"BloomForSequenceClassification: use --method range", err), err  # fmt: skip
    assert not (tmp_path / "decayed").exists()
    code, _, err = run(["finetune", source, "--int8-ready", "--method", "range", "--npz",
                        text_npz, *ONE_EPOCH, "--out", tmp_path / "ranged"], capsys)  # fmt: skip
    assert code == 0, err
    ranged, info = edge_un.load_pretrained(tmp_path / "ranged")
    meta = info.metadata["finetune"]
    assert meta["method"] == "range"  # it bounds every norm's input
    assert meta["applied_to"] == _norm_names(ranged, edge_un.UnifiedNorm)
    assert set(meta["applied_to"]) == set(meta["ranges_after"])


def test_roberta_positions_start_after_its_padding_index(rt, text_npz, tmp_path, capsys) -> None:
    """RoBERTa's position ids start after its padding index (0 here; 1 in roberta-base, whose
    514 positions hold 512 tokens): 48 positions hold 47 tokens, and 48-token data is refused
    before training in one line naming the array (not an index error deep in the model)."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=_vocabulary(rt), hidden_size=16, max_position_embeddings=TOKENS,
        pad_token_id=data.PAD_ID, **TINY,
    )  # fmt: skip
    source = tmp_path / "roberta-48"
    transformers.RobertaForSequenceClassification(config).save_pretrained(source)
    code, _, err = run(["migrate", source, "--npz", text_npz, *ONE_EPOCH, "--out",
                        tmp_path / "out"], capsys)  # fmt: skip
    assert code == 1 and err.count("\n") == 1
    assert "'input_ids' has 48 positions, the model takes at most 47" in err, err


@pytest.mark.slow  # a minute of training; benchmarks.conversion.hf_families trains it fully
def test_the_builder_trains_a_swin_on_mnist_framed_to_32_pixels(tmp_path: Path) -> None:
    """``python -m tools.make_hf_examples --model swin`` (what benchmarks/conversion/hf_families.py
    trains its Swin with), cut to one epoch: the directory records MNIST padded by 2 pixels, so
    its own test split comes back at 32 x 32, and the builder exits 0 only if the reloaded model
    scores the test accuracy it recorded."""
    out = tmp_path / "swin-ln"
    argv = ["--model", "swin", "--norm", "ln", "--epochs", "1", "--batch-size", "256",
            "--threads", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    command = [sys.executable, "-m", "tools.make_hf_examples", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    model, info = edge_un.load_pretrained(out)
    assert info.architecture == "SwinForImageClassification" and info.norm_kind == "ln"
    assert (model.config.image_size, model.config.patch_size, model.config.window_size) == (
        32, 2, 4,
    )  # fmt: skip
    assert info.metadata["preprocessing"]["pad"] == 2
    images, labels = data.checkpoint_split(info, "test")
    assert images.shape == (1000, 1, 32, 32) and len(labels) == 1000
    assert info.metadata["model_inputs"] == {
        "pixel_values": "the preprocessed images, float32 (N, 1, 32, 32)"
    }


def test_progressive_stacking_doubles_a_bert_that_saves_as_a_deeper_one(tmp_path: Path) -> None:
    """``make_hf_examples.stack_encoder`` (how the BERT-base teacher grows 3 -> 6 -> 12 layers):
    the copies are new parameters, their cache indices follow their place, and the grown model
    is saved and read back as a model of the new depth that computes the same logits."""
    import torch
    import transformers

    from tools.make_hf_examples import STAGES, recipe_for, stack_encoder, stage_schedules

    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=8, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.BertForSequenceClassification(config).eval()
    stack_encoder(net)
    layers = net.bert.encoder.layer
    assert len(layers) == net.config.num_hidden_layers == 4
    assert [layer.attention.self.layer_idx for layer in layers] == [0, 1, 2, 3]
    assert torch.equal(layers[2].output.dense.weight, layers[0].output.dense.weight)
    assert layers[2].output.dense.weight is not layers[0].output.dense.weight
    ids = torch.randint(1, 40, (3, 8))
    edge_un.save_pretrained(net, tmp_path / "grown", metadata={})
    reloaded, _ = edge_un.load_pretrained(tmp_path / "grown")
    assert len(reloaded.bert.encoder.layer) == 4
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, net(input_ids=ids).logits)
    # each stage: its depth, epochs and rate; the preset's batch and warm-up fraction
    schedules = stage_schedules("bert-base", recipe_for("bert-base", None, None, None), seed=0)
    assert [(layers, s.epochs, s.lr) for layers, s in schedules] == [
        (stage.layers, stage.epochs, stage.lr) for stage in STAGES["bert-base"]
    ]
    assert {s.batch_size for _, s in schedules} == {32} and schedules[-1][0] == 12
    one_stage = stage_schedules("bert", recipe_for("bert", None, None, None), seed=0)
    assert [layers for layers, _ in one_stage] == [None]
