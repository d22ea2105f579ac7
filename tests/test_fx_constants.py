"""converters.fx_constants: the input-free subgraphs of a torch program computed once."""

from __future__ import annotations

import torch

from converters.fx_constants import MAX_FOLDED_ELEMENTS, fold_constant_subgraphs


class ShiftedWindowMask(torch.nn.Module):
    """Swin's way: a mask built on every call from zeros, filled slices and ``masked_fill``,
    added to scores computed from the input; and a constant too large to be worth storing."""

    def forward(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        regions = torch.zeros(1, 4, 4)
        regions[:, :2, 2:] = 1
        regions[:, 2:, :] = 2
        flat = regions.reshape(1, 16)
        apart = flat.unsqueeze(1) != flat.unsqueeze(2)
        mask = (flat.unsqueeze(1) - flat.unsqueeze(2)).masked_fill(apart, -100.0)
        large = torch.arange(MAX_FOLDED_ELEMENTS + 1, dtype=torch.float32)
        return scores + mask, scores.mean() + large


def test_an_input_free_mask_is_stored_once_and_computes_the_same() -> None:
    scores = torch.randn(2, 16, 16)
    program = torch.export.export(ShiftedWindowMask(), (scores,))
    in_place = program.module()  # fill_ into slices of the zeros: left alone
    assert fold_constant_subgraphs(in_place) == 0
    module = program.run_decompositions().module()  # functional, as prepare's programs are
    before = module(scores)
    assert fold_constant_subgraphs(module) == 1  # the mask; the arange stays computed
    ops = {n.target for n in module.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.masked_fill.Scalar not in ops and torch.ops.aten.zeros.default not in ops
    assert torch.ops.aten.arange.start_step in ops or torch.ops.aten.arange.default in ops
    for got, expected in zip(module(scores), before, strict=True):
        torch.testing.assert_close(got, expected)
    folded = [n for n in module.graph.nodes if n.op == "get_attr" and "folded" in n.target]
    assert len(folded) == 1 and getattr(module, folded[0].target).shape == (1, 16, 16)
    exported = torch.export.export(module, (scores,))  # what the direct route converts next
    torch.testing.assert_close(exported.module()(scores)[0], before[0])
