"""The choices the options offer, spelled out here so that building the command line (and
``edge-un --help``) does not import torch. tests/test_cli.py keeps them equal to edge_un's own
lists (edge_un.data.DATASETS, edge_un.NORM_KINDS, ...)."""

from __future__ import annotations

from typing import Literal

Model = Literal["vit", "text"]  # edge_un.training.presets.MODELS
Dataset = Literal["mnist", "digits", "rt"]  # edge_un.data.DATASETS
NormKind = Literal["ln", "bn", "mabn", "pn", "rbn", "un", "on"]  # edge_un.NORM_KINDS
OfflineKind = Literal["bn", "mabn", "pn", "rbn", "un", "on"]  # edge_un.OFFLINE_KINDS
FinetuneMethod = Literal["range", "growth", "decay", "fakequant"]  # edge_un.finetune.METHODS

# edge_un.examples.names()
EXAMPLES = (
    "vit-mnist-un",
    "vit-mnist-ln",
    "text-rt-un",
    "text-rt-ln",
    "vit-mnist-ln-to-un",
    "text-rt-ln-to-un",
)
# edge_un.examples.names(hf=True): Hugging Face save_pretrained directories
HF_EXAMPLES = ("hf-vit-mnist-ln", "hf-vit-mnist-un", "hf-bert-rt-ln", "hf-bert-rt-un")
TARGETS = ("cpu", "imx93", "imx8mp", "tda4vm")  # quant.targets.TARGET_NAMES

# The bundled UN ViT migrated from its LayerNorm twin: the route edge-un recommends, and the
# example whose pure int8 files meet the drift bar on every target
# (benchmarks/conversion/quant_compare).
DEFAULT_MODEL = "vit-mnist-ln-to-un"
