"""Reference Transformers, and the registry that checkpoints rebuild them from."""

from torch import nn

from .blocks import Attention, Block, Mlp
from .text import TextTransformer
from .vision import VisionTransformer

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "VisionTransformer": VisionTransformer,
    "TextTransformer": TextTransformer,
}

__all__ = [
    "ARCHITECTURES",
    "Attention",
    "Block",
    "Mlp",
    "TextTransformer",
    "VisionTransformer",
]
