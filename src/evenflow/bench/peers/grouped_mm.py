"""An MoE layer built from PyTorch's grouped GEMM (``torch._grouped_mm``), as a benchmark peer.

The plain-PyTorch way to run a MoE layer with one GEMM launch per projection:

    key    = local expert of each (token, slot) pair, E_local for pairs routed elsewhere (EP)
    order  = stable argsort(key)                  -> pairs contiguous per expert
    offs   = cumsum(per-expert counts)[:E_local]  -> int32 group end offsets, on the device
    xs     = x[order // k]                        -> gathered copy of token rows   [P, H]
    h      = grouped_mm(xs, w13^T, offs)          -> [P, 2I]
    a      = silu(h[:, :I]) * h[:, I:]            -> [P, I] (bf16, as SGLang does)
    d      = grouped_mm(a, w2^T, offs)            -> [P, H]
    y      = index_add over tokens of d * weight  -> fp32 accumulate, bf16 out

Everything stays on the device (sort, counting by scatter_add, cumsum; no
``bincount`` or ``nonzero``, which sync with the host), so the layer can be captured
in a CUDA graph. Rows of pairs routed to other EP ranks sit after ``offs[-1]``;
grouped_mm leaves them unwritten, so they are masked with ``where`` (not multiplied
by 0, which would keep a NaN of uninitialised memory).

FP8 per-tensor uses ``torch._scaled_grouped_mm`` (row-wise scales; per-tensor scales
broadcast to rows; SM90+): activations quantised with the static scales, weights
column-major per expert as the op requires. FP8 block-128 has no grouped recipe on
SM90 in torch as far as we know; it raises ``PeerUnavailable`` (an error row).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from evenflow.bench.harness import PeerUnavailable

__all__ = ["GroupedMMMoE", "group_pairs"]

_FP8_MAX = 448.0


def group_pairs(topk_ids: torch.Tensor, ep_rank: int, num_local: int):
    """Sort (token, slot) pairs by local expert; device-only, graph capturable.

    Returns ``order`` (pair index, sorted), ``key_sorted`` (local expert, ``num_local``
    for pairs of other ranks), ``offs`` (int32 ``[num_local]`` group end offsets).
    """
    key = topk_ids.reshape(-1).to(torch.int64) - ep_rank * num_local
    key = torch.where((key >= 0) & (key < num_local), key, torch.full_like(key, num_local))
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
    return order, key_sorted, offs


def _quant_static(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)


class GroupedMMMoE:
    """One MoE layer from two grouped GEMMs. Same weight layouts and scale conventions as SGLang/evenflow."""

    def __init__(self, variant: str, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale=None, w2_scale=None,
                 a13_scale=None, a2_scale=None, ep_rank: int = 0, num_experts_total: int | None = None):
        if not hasattr(torch, "_grouped_mm"):
            raise PeerUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
        self.variant = variant
        self.num_local, two_i, self.hidden = w13.shape
        self.inter = two_i // 2
        self.ep_rank = ep_rank if num_experts_total not in (None, self.num_local) else 0
        # Per-expert [K, N] operands as column-major views of the stored [N, K] rows:
        # the layout both grouped GEMMs take without a copy.
        self.w13_t = w13.transpose(1, 2)
        self.w2_t = w2.transpose(1, 2)
        if variant == "bf16":
            pass
        elif variant == "fp8-tensor":
            if not hasattr(torch, "_scaled_grouped_mm"):
                raise PeerUnavailable(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
            e = self.num_local
            # Row-wise weight scales [E, N], the per-expert alpha broadcast over N (load-time work).
            self.s13 = w13_scale.float().reshape(e, 1).expand(e, two_i).contiguous()
            self.s2 = w2_scale.float().reshape(e, 1).expand(e, self.hidden).contiguous()
            self.a13 = a13_scale.float().reshape(1)
            self.a2 = a2_scale.float().reshape(1)
        elif variant == "fp8-block":
            raise PeerUnavailable("torch grouped GEMM: no 128x128 block-scaled recipe on this path "
                                  "(_scaled_grouped_mm takes row-wise scales on SM90)")
        else:
            raise ValueError(f"variant must be bf16, fp8-tensor or fp8-block, got {variant!r}")

    def _gemm(self, a: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor, a_scale=None, w_scale=None):
        if self.variant == "bf16":
            return torch._grouped_mm(a, w_t, offs=offs, out_dtype=torch.bfloat16)
        rows = a_scale.expand(a.shape[0]).contiguous()
        return torch._scaled_grouped_mm(a, w_t, rows, w_scale, offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        order, key_sorted, offs = group_pairs(topk_ids, self.ep_rank, self.num_local)
        tok = order // k
        valid = (key_sorted < self.num_local).unsqueeze(1)
        w_sorted = topk_weights.reshape(-1)[order].float().unsqueeze(1)
        if self.variant == "bf16":
            h = self._gemm(x[tok], self.w13_t, offs)
        else:
            h = self._gemm(_quant_static(x, self.a13)[tok], self.w13_t, offs, self.a13, self.s13)
        act = F.silu(h[:, : self.inter]) * h[:, self.inter:]
        if self.variant == "bf16":
            d = self._gemm(act, self.w2_t, offs)
        else:
            d = self._gemm(_quant_static(act, self.a2), self.w2_t, offs, self.a2, self.s2)
        contrib = torch.where(valid, d.float() * w_sorted, torch.zeros((), device=d.device))
        y = torch.zeros(t, self.hidden, dtype=torch.float32, device=x.device)
        y.index_add_(0, tok, contrib)
        return y.to(torch.bfloat16)

    def bind(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: self(x, topk_ids, topk_weights)
