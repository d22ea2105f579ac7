"""The canonical form programs are brought to before the fold rules match (issue 66): in-place
ops functionalized where the mutation is the graph's own business, ``rsub`` as an affine, and
each rewrite recorded; what another reader could see mutated is left as it is."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from converters.canonical import canonicalize

aten = torch.ops.aten


def _graph(model: nn.Module, *args: Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model.eval(), args).module()


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


class InPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        y = x * 2
        y += 1  # the graph's own tensor: functionalized
        z = torch.zeros_like(y)
        z.copy_(y)
        return 3.0 - z * y  # rsub


def test_in_place_ops_and_rsub_become_functional_and_are_recorded() -> None:
    x = torch.randn(2, 3)
    gm = _graph(InPlace(), x)
    expected = gm(x)
    assert aten.add_.Tensor in _targets(gm) and aten.rsub.Scalar in _targets(gm)
    rewritten = canonicalize(gm)
    assert rewritten == (
        "aten.add_.Tensor -> aten.add.Tensor (1)",
        "aten.copy_.default -> aten.copy.default (1)",
        "aten.rsub.Scalar -> aten.mul.Tensor, aten.add.Tensor (1)",
    )
    targets = _targets(gm)
    assert not {aten.add_.Tensor, aten.copy_.default, aten.rsub.Scalar} & set(targets)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
    assert canonicalize(gm) == ()  # canonical already


class MutatesAView(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        y = x * 2
        row = y[0]  # a view of y: the in-place add below changes y too
        row.add_(1)
        return y


def test_a_mutation_another_tensor_sees_is_left_as_it_is() -> None:
    x = torch.randn(2, 3)
    gm = _graph(MutatesAView(), x)
    assert aten.add_.Tensor in _targets(gm)
    assert canonicalize(gm) == ()
    assert aten.add_.Tensor in _targets(gm)
    torch.testing.assert_close(gm(x), MutatesAView()(x))
