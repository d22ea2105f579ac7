"""Per-channel statistics over the non-pad positions of a channels-last tensor."""

from __future__ import annotations

from torch import Tensor

from ..errors import InputError


def flatten_tokens(x: Tensor, pad_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(..., C) -> (N, C), and pad_mask (...,) -> a (N, 1) float keep-weight (None: keep all)."""
    flat = x.reshape(-1, x.shape[-1])
    if pad_mask is None:
        return flat, None
    _check_pad_mask(x, pad_mask)
    keep = (~pad_mask.reshape(-1, 1)).to(flat.dtype)
    return flat, keep


def group_tokens(
    x: Tensor, pad_mask: Tensor | None, per_sample: bool
) -> tuple[Tensor, Tensor | None]:
    """(..., C) -> (G, T, C) groups of positions that statistics are taken over, and pad_mask ->
    a (G, T, 1) float keep-weight (None: keep all).

    One group holding every position (G = 1, batch statistics), or ``per_sample``: one group per
    element of the first dimension, its other positions pooled ((B, N, C) -> B groups of N;
    (B, C) -> B groups of one position).
    """
    if pad_mask is not None:
        _check_pad_mask(x, pad_mask)
    if per_sample:
        if x.dim() < 2:
            raise InputError(
                f"per-sample statistics need a batch dimension: input of shape {tuple(x.shape)}, "
                "expected (B, C) or (B, ..., C)"
            )
        shape = (x.shape[0], -1, x.shape[-1])
    else:
        shape = (1, -1, x.shape[-1])
    grouped = x.reshape(shape)
    if pad_mask is None:
        return grouped, None
    keep = (~pad_mask.reshape(*shape[:2], 1)).to(grouped.dtype)
    return grouped, keep


def _check_pad_mask(x: Tensor, pad_mask: Tensor) -> None:
    if pad_mask.shape != x.shape[:-1]:
        raise InputError(
            f"pad_mask has shape {tuple(pad_mask.shape)}, expected x.shape[:-1] = "
            f"{tuple(x.shape[:-1])}"
        )


def masked_mean(values: Tensor, keep: Tensor | None, dim: int = 0) -> Tensor:
    """Mean over ``dim`` (default: dim 0 of (N, C) values), counting only positions whose
    keep-weight is 1."""
    if keep is None:
        return values.mean(dim=dim)
    return (values * keep).sum(dim=dim) / keep.sum(dim=dim)


def masked_sum(values: Tensor, keep: Tensor | None, dim: int | tuple[int, ...] = 0) -> Tensor:
    """Sum over ``dim`` (default: dim 0 of (N, C) values), counting only positions whose
    keep-weight is 1."""
    if keep is None:
        return values.sum(dim=dim)
    return (values * keep).sum(dim=dim)


def geometric_mean(window: Tensor) -> Tensor:
    """exp(mean(log(w))) over dim 0; a zero entry gives 0 (log 0 = -inf is fine here)."""
    return window.log().mean(dim=0).exp()
