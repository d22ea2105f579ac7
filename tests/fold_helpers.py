"""Models and helpers for the folding/export tests: random configs, trained-looking norm state,
a norm-free twin for op-count comparisons, and a Transformer written outside edge_un."""

from __future__ import annotations

import collections
import copy
import random
from typing import Any

import torch
from torch import Tensor, nn

import edge_un
from edge_un.models import TextTransformer, VisionTransformer
from testbed.hf_families import randomize_norm_state  # shared with the benchmarks


def random_config(seed: int) -> tuple[str, dict[str, Any]]:
    """A random small model of either family: dim, depth, heads, pooling, pre/post-norm, bias,
    norm kind."""
    rng = random.Random(seed)
    heads = rng.choice([1, 2, 4])
    common = {
        "dim": heads * rng.choice([4, 8]),
        "depth": rng.randint(1, 3),
        "heads": heads,
        "mlp_ratio": rng.choice([1.0, 2.0, 3.0]),
        "bias": rng.random() < 0.5,
        "norm": rng.choice(edge_un.OFFLINE_KINDS),
    }
    if rng.random() < 0.5:
        size = rng.choice([8, 12])
        config = {"img_size": size, "in_chans": rng.choice([1, 3]), "patch_size": 4,
                  "num_classes": rng.randint(2, 10),
                  "pool": rng.choice(["cls", "mean"])}  # fmt: skip
        return "vit", {**common, **config}
    config = {"vocab_size": 40, "max_len": rng.choice([6, 9]), "num_classes": 3,
              "norm_first": rng.random() < 0.5}  # fmt: skip
    return "text", {**common, **config}


def build(family: str, config: dict[str, Any], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cls = VisionTransformer if family == "vit" else TextTransformer
    return randomize_norm_state(cls(**config), seed)


def inputs_for(model: nn.Module, batch: int = 3, seed: int = 1) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if "img_size" in config:
        size = config["img_size"]
        return torch.randn(batch, config["in_chans"], size, size, generator=generator)
    ids = torch.randint(1, config["vocab_size"], (batch, config["max_len"]), generator=generator)
    ids[0, -2:] = config["pad_id"]  # some padding
    return ids


def relative_diff(expected: Tensor, actual: Any) -> float:
    if isinstance(actual, Tensor):
        actual = actual.detach()
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = expected.detach().to(torch.float64)
    return float((expected - actual).abs().max() / expected.abs().max())


class NoNorm(nn.Module):
    """Identity with a norm's call signature."""

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        return x


def norm_free_twin(model: nn.Module, folded_into: set[str]) -> nn.Module:
    """The same model with every norm removed, and a bias on every Linear that folding gave one:
    the graph a perfectly folded model must have, op for op."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, edge_un.OfflineNorm):
                setattr(module, child_name, NoNorm())
    for name in folded_into:
        linear = twin.get_submodule(name)
        if isinstance(linear, nn.Linear) and linear.bias is None:
            linear.bias = nn.Parameter(torch.zeros(linear.out_features))
    return twin.eval()


def histogram_difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    diff = collections.Counter(after)
    diff.subtract(before)
    return {op: n for op, n in diff.items() if n}


class ForeignAttention(nn.Module):
    """Separate q, k, v Linears (not edge_un's packed qkv), no bias on k."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = (t.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
                   for t in (self.q(x), self.k(x), self.v(x)))  # fmt: skip
        attn = torch.softmax(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, dim=-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, c))


class ParallelBlock(nn.Module):
    """GPT-J style: one norm feeds attention (q, k, v) and the MLP (fc_in) in parallel."""

    def __init__(self, dim: int, heads: int, kind: str) -> None:
        super().__init__()
        self.ln = edge_un.make_norm(kind, dim)
        self.attn = ForeignAttention(dim, heads)
        self.fc_in = nn.Linear(dim, 2 * dim)
        self.fc_out = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.fc_out(torch.relu(self.fc_in(h)))


class ForeignTransformer(nn.Module):
    """A model edge_un never saw: conv stem followed by a norm (folds backward into the conv),
    parallel blocks, a final norm, mean pooling over tokens and a bias-free head."""

    def __init__(self, dim: int = 16, heads: int = 2, depth: int = 2, kind: str = "un") -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.stem_norm = edge_un.make_norm(kind, dim)
        self.blocks = nn.Sequential(*(ParallelBlock(dim, heads, kind) for _ in range(depth)))
        self.final = edge_un.make_norm(kind, dim)
        self.head = nn.Linear(dim, 5, bias=False)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem_norm(self.stem(images).flatten(2).transpose(1, 2))
        x = self.blocks(x)
        return self.head(self.final(x).mean(dim=1))


def foreign_model(kind: str = "un", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_norm_state(ForeignTransformer(kind=kind), seed)
