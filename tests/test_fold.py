"""fold_norms: exact folding (float64) on random and example models, and honest refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import edge_un
from converters import ConversionError, OnlineNormError, fold_norms
from converters.equations import (
    fold_affine_into_embedding_tables,
    fold_affine_into_following_linear,
    fold_affine_into_preceding_linear,
)
from edge_un.models import TextTransformer, VisionTransformer

from .fold_helpers import build, inputs_for, random_config, randomize_norm_state, relative_diff

EXACT = 1e-10  # float64 folding is exact up to rounding (measured ~1e-16)


def test_following_linear_equation() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    s, t = (
        torch.rand(4, generator=g, dtype=torch.float64) + 0.5,
        torch.randn(4, dtype=torch.float64),
    )
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    for bias in (b, None):
        new_w, new_b = fold_affine_into_following_linear(w, bias, s, t)
        torch.testing.assert_close(F.linear(x, new_w, new_b), F.linear(x * s + t, w, bias))


def test_preceding_linear_and_conv_equation() -> None:
    g = torch.Generator().manual_seed(1)
    s, t = (
        torch.rand(6, generator=g, dtype=torch.float64) + 0.5,
        torch.randn(6, dtype=torch.float64),
    )
    w, b = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    for bias in (b, None):
        new_w, new_b = fold_affine_into_preceding_linear(w, bias, s, t)
        torch.testing.assert_close(F.linear(x, new_w, new_b), F.linear(x, w, bias) * s + t)
    cw, cb = torch.randn(6, 2, 3, 3, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    image = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    new_w, new_b = fold_affine_into_preceding_linear(cw, cb, s, t)
    expected = F.conv2d(image, cw, cb) * s[:, None, None] + t[:, None, None]
    torch.testing.assert_close(F.conv2d(image, new_w, new_b), expected)


def test_embedding_tables_equation() -> None:
    g = torch.Generator().manual_seed(2)
    s, t = torch.rand(4, generator=g, dtype=torch.float64) + 0.5, torch.randn(4, generator=g)
    word, position = torch.randn(9, 4, generator=g), torch.randn(5, 4, generator=g)
    ids, positions = torch.randint(0, 9, (3, 5), generator=g), torch.arange(5)
    new_word, new_position = fold_affine_into_embedding_tables(
        [word.double(), position.double()], s, t.double()
    )
    expected = (word[ids].double() + position[positions].double()) * s + t
    torch.testing.assert_close(new_word[ids] + new_position[positions], expected)


def expected_actions(model: nn.Module) -> dict[str, str]:
    """What Algorithm 1 must do with each norm of edge_un's own models."""
    config = model.config
    actions = {}
    for name, module in model.named_modules():
        if not isinstance(module, edge_un.OfflineNorm):
            continue
        if not config.get("norm_first", True):
            actions[name] = "scale_shift"  # post-norm: output also feeds the residual
        elif name == "norm" and "vocab_size" in config:
            actions[name] = "scale_shift"  # masked mean pooling: shift does not commute
        else:
            actions[name] = "folded_forward"
    return actions


@pytest.mark.parametrize("seed", range(10))
def test_random_models_fold_exactly(seed: int) -> None:
    family, config = random_config(seed)
    model = build(family, config, seed).double()
    x = inputs_for(model)
    x = x.double() if x.is_floating_point() else x
    folded, report = fold_norms(model)
    with torch.no_grad():
        assert relative_diff(model(x), folded(x)) <= EXACT, config
    assert {n.name: n.action for n in report.norms} == expected_actions(model), str(report)
    assert report.fully_integer
    for norm in report.kept:
        assert norm.reason
    # the folded graph has no norm arithmetic left: no sqrt/rsqrt/div from norms
    targets = {str(n.target) for n in folded.graph.nodes}
    assert not {"aten.sqrt.default", "aten.rsqrt.default"} & targets


@pytest.mark.parametrize("kind", edge_un.OFFLINE_KINDS)
def test_every_offline_kind_folds_exactly(kind: str) -> None:
    """The random configs above draw the norm kind; this covers each kind on purpose (centred
    kinds fold their running mean into the shift)."""
    config = {"img_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "heads": 2, "pool": "mean",
              "norm": kind}  # fmt: skip
    model = build("vit", config, 6).double()
    x = inputs_for(model).double()
    folded, report = fold_norms(model)
    with torch.no_grad():
        assert relative_diff(model(x), folded(x)) <= EXACT
    assert {n.name: n.action for n in report.norms} == expected_actions(model), str(report)
    assert report.fully_integer and {n.kind for n in report.norms} == {kind}


def test_folding_keeps_the_original_model_untouched() -> None:
    model = build("vit", {"img_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "heads": 2}, 0)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fold_norms(model)
    assert model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_missing_bias_is_created_by_folding() -> None:
    model = build("vit", {"img_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "heads": 2,
                          "bias": False, "pool": "mean"}, 3).double()  # fmt: skip
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    folded, _ = fold_norms(model)
    assert "blocks.0.attn.qkv.bias" in dict(folded.named_parameters())
    assert relative_diff(model(x), folded(x)) <= EXACT


def test_folded_module_keeps_a_dynamic_batch() -> None:
    model = build("text", {"vocab_size": 30, "max_len": 7, "dim": 8, "depth": 1, "heads": 2}, 4)
    folded, _ = fold_norms(model)
    for batch in (1, 5):
        ids = torch.randint(1, 30, (batch, 7))
        assert relative_diff(model(ids), folded(ids)) <= 1e-5


def test_layernorm_model_is_refused_with_the_modules_named() -> None:
    model = VisionTransformer(img_size=8, patch_size=4, dim=8, depth=1, heads=2, norm="ln").eval()
    with pytest.raises(OnlineNormError, match=r"blocks\.0\.norm1 \(LayerNorm\)"):
        fold_norms(model)
    folded, report = fold_norms(model, allow_online=True)
    assert not report.fully_integer and report.online_norms
    assert report.norms == ()
    x = torch.randn(2, 1, 8, 8)
    assert relative_diff(model(x), folded(x)) <= 1e-6


def test_plain_torch_layernorm_and_rmsnorm_are_found() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 2)).eval()
    with pytest.raises(OnlineNormError, match=r"1 \(RMSNorm\)"):
        fold_norms(model, torch.randn(2, 4))


class NormThenGelu(nn.Module):
    """A norm whose input is an Add and whose output feeds GELU: cannot fold either way."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.norm = edge_un.make_norm("bn", 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.gelu(self.norm(self.a(x) + self.b(x))))


class LinearUsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.make_norm("un", 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        return self.fc(y) + self.fc(y)


class NormFeedsLinearAndResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.make_norm("mabn", 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        return y + self.fc(y)


class LinearNormGelu(nn.Module):
    """A norm right after a Linear (folds backward) and one after a conv stem (same)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 6, 2, stride=2, bias=False)
        self.stem_norm = edge_un.make_norm("rbn", 6)
        self.fc1 = nn.Linear(6, 8)
        self.norm = edge_un.make_norm("pn", 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem_norm(self.stem(x).flatten(2).transpose(1, 2))
        return self.fc2(F.gelu(self.norm(self.fc1(F.gelu(x)))))


@pytest.mark.parametrize(
    ("module", "shape", "expected"),
    [
        (NormThenGelu, (3, 6), {"norm": ("scale_shift", "gelu")}),
        (LinearUsedTwice, (3, 6), {"norm": ("scale_shift", "used 2 times")}),
        (NormFeedsLinearAndResidual, (3, 6), {"norm": ("scale_shift", "add")}),
        (LinearNormGelu, (2, 2, 4, 4), {"stem_norm": ("folded_backward", "stem"),
                                        "norm": ("folded_backward", "fc1")}),
    ],
)  # fmt: skip
def test_norm_placements(module: type, shape: tuple, expected: dict) -> None:
    model = randomize_norm_state(module(), 5).double()
    x = torch.randn(*shape, dtype=torch.float64)
    folded, report = fold_norms(model, (x,))
    assert relative_diff(model(x), folded(x)) <= EXACT
    by_name = {n.name: n for n in report.norms}
    assert set(by_name) == set(expected)
    for name, (action, word) in expected.items():
        assert by_name[name].action == action
        assert word in (by_name[name].reason + " ".join(by_name[name].into))
    # a kept norm is exactly one Mul and one Add, with no reduction, division or square root
    for norm in report.kept:
        ops = [str(n.target) for n in folded.graph.nodes if _in_module(n, norm.name)]
        assert sorted(ops) == ["aten.add.Tensor", "aten.mul.Tensor"], ops


class EmbeddingSumNorm(nn.Module):
    """BERT's embeddings: a norm of word + position lookups, read by a Linear and a residual
    (so it folds neither forward nor into a Linear): it folds into the tables, unless the word
    table is tied to the output layer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.word, self.position = nn.Embedding(11, 6), nn.Embedding(5, 6)
        self.norm = edge_un.make_norm("un", 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, ids: Tensor) -> Tensor:
        y = self.norm(self.word(ids) + self.position(torch.arange(ids.shape[1])))
        y = y + self.fc(y)
        return F.linear(y, self.word.weight) if self.tied else y


@pytest.mark.parametrize(
    ("tied", "action", "words"),
    [(False, "folded_backward", ("word", "position")), (True, "scale_shift", ("shares",))],
)
def test_a_norm_of_embedding_lookups_folds_into_the_tables(
    tied: bool, action: str, words: tuple[str, ...]
) -> None:
    model = randomize_norm_state(EmbeddingSumNorm(tied), 6).double()
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(3))
    folded, report = fold_norms(model, (ids,))
    assert relative_diff(model(ids), folded(ids)) <= EXACT
    (norm,) = report.norms
    assert norm.action == action, str(report)
    assert all(word in norm.reason + " ".join(norm.into) for word in words), str(report)
    ops = {str(n.target) for n in folded.graph.nodes if _in_module(n, "norm")}
    assert ops == (set() if action == "folded_backward" else {"aten.add.Tensor", "aten.mul.Tensor"})


def _in_module(node: torch.fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return node.op == "call_function" and bool(stack) and list(stack.values())[-1][0] == path


def test_unknown_model_without_inputs_is_a_clear_error() -> None:
    with pytest.raises(ConversionError, match="pass example_inputs"):
        fold_norms(NormThenGelu().eval())


EXAMPLES = ("vit-mnist-un", "vit-mnist-ln", "text-rt-un", "text-rt-ln")


def example_checkpoint(name: str) -> nn.Module:
    # The examples ship with the package (no optional tool makes them): a missing one is a
    # broken install, a failure here, never a skip.
    from edge_un import examples

    model, _ = edge_un.load_checkpoint(examples.path(name))
    return model


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_models(name: str) -> None:
    model = example_checkpoint(name).double()
    x = inputs_for(model, batch=4)
    x = x.double() if x.is_floating_point() else x
    if name.endswith("-ln"):
        with pytest.raises(OnlineNormError):
            fold_norms(model)
        folded, report = fold_norms(model, allow_online=True)
        assert not report.fully_integer
    else:
        folded, report = fold_norms(model)
        assert {n.name: n.action for n in report.norms} == expected_actions(model)
    with torch.no_grad():
        assert relative_diff(model(x), folded(x)) <= EXACT


def test_text_model_pooling_is_traced_not_guessed() -> None:
    """The pre-norm text model's final norm reaches the head through a masked (weighted) sum:
    kept as scale-and-shift, because with an all-padding row the shift would not cancel."""
    model = randomize_norm_state(TextTransformer(vocab_size=20, max_len=5, dim=8, depth=1,
                                                 heads=2), 2)  # fmt: skip
    folded, report = fold_norms(model)
    final = next(n for n in report.norms if n.name == "norm")
    assert final.action == "scale_shift" and "mul" in final.reason
    ids = torch.zeros(2, 5, dtype=torch.long)  # all padding: the case that forbids folding
    ids[1, :2] = 3
    assert relative_diff(model(ids), folded(ids)) <= 1e-6
