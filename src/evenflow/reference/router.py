"""Plain PyTorch oracles for the router: the fp64 product and the routing rules.

Deliberately simple: float64 math, a stable sort for top-k (ties -> lowest expert id).
"""
from __future__ import annotations

import torch


def split_weight_ref(w: torch.Tensor, terms: int = 2) -> tuple[torch.Tensor, ...]:
    """w_hi = bf16(w) (nearest even), w_lo = bf16((w - w_hi) * 256) [, w_lo2 = bf16(((w - w_hi) * 256
    - w_lo) * 256)], computed through fp64."""
    w64 = w.double()
    w_hi = w.to(torch.bfloat16)
    r = (w64 - w_hi.double()) * 256.0
    w_lo = r.to(torch.bfloat16)
    if terms == 2:
        return w_hi, w_lo
    return w_hi, w_lo, ((r - w_lo.double()) * 256.0).to(torch.bfloat16)


def router_logits_fp64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The oracle: x (as given, e.g. bf16) times the fp32 weight, in float64. [M, N]."""
    return x.double() @ w.double().t()


def split_logits_fp64(x: torch.Tensor, w_hi: torch.Tensor, w_lo: torch.Tensor,
                      w_lo2: torch.Tensor | None = None) -> torch.Tensor:
    """What the split kernel approximates, exactly: x @ (w_hi + (w_lo + w_lo2/256)/256)^T in float64."""
    lo = w_lo.double() if w_lo2 is None else w_lo.double() + w_lo2.double() / 256.0
    return x.double() @ (w_hi.double() + lo / 256.0).t()


def split_logits_fp32(x: torch.Tensor, w_hi: torch.Tensor, w_lo: torch.Tensor,
                      w_lo2: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch doing the same two- (or three-) product math in fp32 (the tolerance rule's baseline)."""
    xf = x.float()
    lo = xf @ w_lo.float().t()
    if w_lo2 is not None:
        lo = lo + (xf @ w_lo2.float().t()) / 256.0
    return xf @ w_hi.float().t() + lo / 256.0


def route_ref(logits: torch.Tensor, top_k: int, scoring: str = "softmax", bias: torch.Tensor | None = None,
              renormalize: bool = True, routed_scaling: float = 1.0,
              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32, weights in ``dtype``) by the rules of ``evenflow.router.topk``.

    With ``dtype=float32`` this is "PyTorch doing the same math in fp32" (the baseline).
    """
    lg = logits.to(dtype)
    if scoring == "softmax":
        scores = torch.softmax(lg, dim=-1)
        key = lg
    elif scoring == "sigmoid":
        scores = torch.sigmoid(lg)
        key = scores + (bias.to(dtype) if bias is not None else 0.0)
    else:
        raise ValueError(scoring)
    # sigmoid: a NaN key (logit or bias) makes the row's weights NaN; softmax's sum does so by itself
    nan_row = torch.isnan(key).any(-1, keepdim=True) if scoring == "sigmoid" else None
    key = torch.where(torch.isnan(key), torch.full_like(key, float("-inf")), key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # stable: ties keep id order
    ids = order[:, :top_k]
    weights = torch.gather(scores, 1, ids)
    if renormalize:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if scoring == "sigmoid" else denom)
    weights = weights * routed_scaling
    if nan_row is not None:
        weights = weights.masked_fill(nan_row, float("nan"))
    return ids.to(torch.int32), weights
