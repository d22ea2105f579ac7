"""The transformers families users bring, tiny and random: a model of each, swapped to UN with
trained-looking norm statistics, data shaped as a user's, and the model exported the three ways
users export it (a ``save_pretrained`` directory, a ``torch.export`` program, a dynamo ONNX
file). For the tests (tests/test_hf_families_convert.py) and the benchmark
(benchmarks/conversion/hf_families.py).

Random weights: each model's labels are its own fp32 predictions on the evaluation data, so
top-1 agreement of int8 with fp32 on random inputs from a fixed seed is what is measured.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import edge_un
import edge_un.hf

FORMATS = ("directory", "pt2", "onnx")
TOKENS = 32  # the data's sequence length: shorter than every model's positions
VOCAB = 60
CLASSES = 3
CALIBRATION, EVALUATION = 64, 200


# 2 layers of 32 channels; Swin as the (MNIST padded to 32 x 32, patch 2, window 4,
# depths [2, 2], heads [2, 4]); ALBERT and ELECTRA with factorized embeddings (16 wide);
# RoBERTa with its own padding index 1 (its positions start after it); GPT-2 pads with 0.
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64, "num_labels": CLASSES}  # fmt: skip
IMAGE = {"image_size": 16, "patch_size": 4, "num_channels": 1, "hidden_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
         "num_labels": CLASSES}  # fmt: skip
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {  # family: model class, config class, config
    "vit": ("ViTForImageClassification", "ViTConfig", IMAGE),
    "deit": ("DeiTForImageClassification", "DeiTConfig", IMAGE),
    "swin": ("SwinForImageClassification", "SwinConfig", {
        "image_size": 32, "patch_size": 2, "num_channels": 1, "embed_dim": 32, "depths": [2, 2],
        "num_heads": [2, 4], "window_size": 4, "num_labels": CLASSES}),
    "bert": ("BertForSequenceClassification", "BertConfig", TEXT),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig", {
        "vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64,
        "max_position_embeddings": 64, "num_labels": CLASSES}),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig",
                {**TEXT, "max_position_embeddings": 66}),
    "albert": ("AlbertForSequenceClassification", "AlbertConfig", {**TEXT, "embedding_size": 16}),
    "electra": ("ElectraForSequenceClassification", "ElectraConfig",
                {**TEXT, "embedding_size": 16}),
    "gpt2": ("GPT2ForSequenceClassification", "GPT2Config", {
        "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
        "num_labels": CLASSES, "pad_token_id": 0, "bos_token_id": VOCAB - 1,
        "eos_token_id": VOCAB - 1}),
}  # fmt: skip
FAMILIES = tuple(MODELS)


def randomize_norm_state(model: nn.Module, seed: int) -> nn.Module:
    """Plausible trained statistics and affine parameters in every offline norm."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, edge_un.OfflineNorm):
                continue
            c = module.num_features
            module.running_var.copy_(torch.empty(c).uniform_(0.05, 6.0, generator=generator))
            module.weight.copy_(1 + 0.4 * torch.randn(c, generator=generator))
            module.bias.copy_(0.5 * torch.randn(c, generator=generator))
            if module.centered:
                module.running_mean.copy_(torch.randn(c, generator=generator))
    return model.eval()


def build(family: str, seed: int = 0) -> nn.Module:
    """The family's tiny model, random weights, every LayerNorm swapped to UN
    (:func:`edge_un.swap_layernorm`) with trained-looking statistics, in eval mode."""
    transformers = edge_un.hf.require_transformers()
    model_class, config_class, config = MODELS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    edge_un.swap_layernorm(model, kind="un")
    return randomize_norm_state(model, seed)


def user_feeds(model: nn.Module, count: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs as a user's data has them: images of the config's size; token ids of TOKENS
    positions, each sentence padded at its end with the model's pad id (its mask 0 there)."""
    rng = np.random.default_rng(seed)
    config = model.config
    if model.main_input_name == "pixel_values":
        size = config.image_size
        shape = (count, config.num_channels, size, size)
        return {"pixel_values": rng.standard_normal(shape).astype(np.float32)}
    pad = edge_un.hf.pad_token_id(model)
    ids = rng.integers(2, VOCAB - 1, (count, TOKENS))
    lengths = rng.integers(TOKENS // 4, TOKENS + 1, count)
    mask = np.arange(TOKENS)[None, :] < lengths[:, None]
    return {"input_ids": np.where(mask, ids, pad), "attention_mask": mask.astype(np.int64)}


@torch.no_grad()
def logits(model: nn.Module, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's logits, called by keyword as a user calls it (its cache off)."""
    tensors = {name: torch.from_numpy(array) for name, array in feeds.items()}
    return model(**tensors, **_no_cache(model)).logits.numpy()


def write_data(model: nn.Module, directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """calib.npz (CALIBRATION samples) and eval.npz (EVALUATION, labelled by the model's own
    fp32 predictions) in ``directory``."""
    calibration = user_feeds(model, CALIBRATION, seed)
    evaluation = user_feeds(model, EVALUATION, seed + 1)
    np.savez(directory / "calib.npz", **calibration)
    np.savez(directory / "eval.npz", **evaluation, labels=logits(model, evaluation).argmax(-1))
    return directory / "calib.npz", directory / "eval.npz"


def export_as_users_do(
    model: nn.Module,
    feeds: dict[str, np.ndarray],
    directory: Path,
    forms: Sequence[str] = FORMATS,
) -> dict[str, Path]:
    """The model in each of ``forms`` (default: all FORMATS), from a batch of one of
    ``feeds``, by keyword as a tokenizer's output is passed (a decoder with
    ``use_cache=False``); the ONNX file with the exporter's defaults, except that HF Swin's is
    exported with eager attention: torch's exporter fails on its
    scaled_dot_product_attention (strides of a view it cannot redo)."""
    kwargs: dict[str, Any] = {n: torch.from_numpy(a[:1]) for n, a in feeds.items()}
    kwargs.update(_no_cache(model))
    names = ("directory", "model.pt2", "model.onnx")
    paths = {form: directory / name for form, name in zip(FORMATS, names, strict=True)}
    if "directory" in forms:
        edge_un.save_pretrained(model, paths["directory"])
    if "pt2" in forms:
        torch.export.save(torch.export.export(model, (), kwargs), paths["pt2"])
    if "onnx" in forms:
        exported = model
        if isinstance(model, edge_un.hf.require_transformers().SwinPreTrainedModel):
            exported = copy.deepcopy(model)
            exported.set_attn_implementation("eager")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch.onnx.export(exported, (), paths["onnx"], kwargs=kwargs,
                              input_names=list(feeds), dynamo=True)  # fmt: skip
    return {form: paths[form] for form in forms}


def _no_cache(model: nn.Module) -> dict[str, bool]:
    takes = "use_cache" in inspect.signature(type(model).forward).parameters
    return {"use_cache": False} if takes else {}
