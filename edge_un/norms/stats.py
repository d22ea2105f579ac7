"""Per-channel statistics over the non-pad positions of a channels-last tensor."""

from __future__ import annotations

from torch import Tensor


def flatten_tokens(x: Tensor, pad_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(..., C) -> (N, C), and pad_mask (...,) -> a (N, 1) float keep-weight (None: keep all)."""
    flat = x.reshape(-1, x.shape[-1])
    if pad_mask is None:
        return flat, None
    if pad_mask.shape != x.shape[:-1]:
        raise ValueError(
            f"pad_mask has shape {tuple(pad_mask.shape)}, expected x.shape[:-1] = "
            f"{tuple(x.shape[:-1])}"
        )
    keep = (~pad_mask.reshape(-1, 1)).to(flat.dtype)
    return flat, keep


def masked_mean(values: Tensor, keep: Tensor | None) -> Tensor:
    """Mean over dim 0 of (N, C) values, counting only rows whose keep-weight is 1."""
    if keep is None:
        return values.mean(dim=0)
    return (values * keep).sum(dim=0) / keep.sum()


def masked_sum(values: Tensor, keep: Tensor | None) -> Tensor:
    """Sum over dim 0 of (N, C) values, counting only rows whose keep-weight is 1."""
    if keep is None:
        return values.sum(dim=0)
    return (values * keep).sum(dim=0)


def geometric_mean(window: Tensor) -> Tensor:
    """exp(mean(log(w))) over dim 0; a zero entry gives 0 (log 0 = -inf is fine here)."""
    return window.log().mean(dim=0).exp()
