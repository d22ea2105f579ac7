"""LayerNorm, the online baseline, with the same call signature as the offline norms."""

from __future__ import annotations

from torch import Tensor, nn


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension that accepts (and ignores) ``pad_mask``:
    per-token statistics never mix positions, so padding cannot leak into them."""

    kind = "ln"

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        return super().forward(x)
