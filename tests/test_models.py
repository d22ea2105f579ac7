"""Reference Transformers: shapes, padding, and export-friendly structure."""

from __future__ import annotations

import pytest
import torch

from edge_un.models import TextTransformer, VisionTransformer

from .builders import SMALL_TEXT, SMALL_VIT, trained_small_model


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_output_shape_and_token_count(pool: str) -> None:
    model = VisionTransformer(**SMALL_VIT, pool=pool).eval()
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    tokens = 16 + (1 if pool == "cls" else 0)
    assert model.pos_embed.shape == (1, tokens, 16)


def test_invalid_configurations_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        VisionTransformer(**{**SMALL_VIT, "heads": 3})
    with pytest.raises(ValueError, match="pool must be"):
        VisionTransformer(**SMALL_VIT, pool="max")
    with pytest.raises(ValueError, match="divisible by patch_size"):
        VisionTransformer(**{**SMALL_VIT, "patch_size": 3})


@pytest.mark.parametrize("kind", ["un", "ln", "bn"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_text_logits_do_not_depend_on_padding(kind: str, norm_first: bool) -> None:
    model = trained_small_model("text", kind, norm_first=norm_first)
    ids = torch.tensor([[5, 9, 12, 3, 0, 0], [7, 8, 0, 0, 0, 0]])
    longer = torch.cat([ids, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(longer), rtol=1e-5, atol=1e-6)
    assert model.norm is None if not norm_first else model.norm is not None


def test_text_model_ignores_what_pad_positions_would_embed_in_training() -> None:
    # In training the norms take statistics over non-pad tokens only: the embedding row of the
    # pad id must not change the loss of the real tokens.
    torch.manual_seed(0)
    model = TextTransformer(**SMALL_TEXT, norm="un", norm_kwargs={"warmup_iters": 0})
    ids = torch.tensor([[5, 9, 12, 0, 0], [7, 8, 4, 2, 0]])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first = model(ids)
    model.load_state_dict(state)
    with torch.no_grad():
        model.token_embed.weight[0].mul_(100.0)
    second = model(ids)
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["vit", "text"])
def test_eval_models_export_without_graph_breaks(family: str) -> None:
    # torch.export is strict about data-dependent Python control flow: eval models have none.
    model = trained_small_model(family, "un")
    example = torch.randn(2, 1, 8, 8) if family == "vit" else torch.randint(0, 50, (2, 10))
    program = torch.export.export(model, (example,))
    torch.testing.assert_close(program.module()(example), model(example))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    if family == "vit":
        # Gather comes from select/index ops; the ViT must use slicing and chunk instead.
        assert not {op for op in ops if "select" in op or "index" in op}, ops
