"""Peer: the attention prologue as engines run it without a fused kernel, in PyTorch.

The steps of a Qwen3-style attention layer between the QKV projection and the attention call, as Hugging Face
transformers writes them (RMSNorm of each q and k head: the variance in fp32, the normed value cast back to bf16
and multiplied by the bf16 weight; rotate-half RoPE in bf16 with cos and sin gathered by position), then the
paged-cache write by slot index as vLLM/SGLang do it (``cache.view(-1, Hkv, D)[slot] = k``; the slots, one a token,
computed once a step outside the timed call, as engines compute them once for all layers). An fp8 cache takes
``(k / scale).to(e4m3)`` (saturated first), an fp8 q its per-head amax scale. ``unfused`` runs the steps eagerly
(one kernel each), ``compiled`` through ``torch.compile`` (Inductor fuses the elementwise steps).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from evenflow.bench.harness import PeerUnavailable

FP8 = torch.float8_e4m3fn


def slots(positions: torch.Tensor, page_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
          page_size: int) -> torch.Tensor:
    """Flat slot ids (page * P + offset) of the tokens, every one live (the peer writes every row)."""
    dev = positions.device
    cu = cu_seqlens_q.long()
    if int(cu[-1]) != positions.numel():
        raise PeerUnavailable("the unfused peer writes every token: no padding rows")
    req = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1])
    pos = positions.long()
    return page_table[req, pos // page_size].long() * page_size + pos % page_size


def _steps(hq: int, hkv: int, d: int, eps: float, q_fp8: bool, kv_fp8: bool, k_scale: float, v_scale: float):
    def rms(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def step(qkv, cos_sin, positions, slot, k_flat, v_flat, qw, kw):
        x = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
        q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
        cs = cos_sin[positions].to(qkv.dtype)
        cos = torch.cat([cs[:, : d // 2]] * 2, dim=-1)[:, None, :]
        sin = torch.cat([cs[:, d // 2:]] * 2, dim=-1)[:, None, :]
        q = rope(rms(q, qw), cos, sin)
        k = rope(rms(k, kw), cos, sin)
        if kv_fp8:
            k_flat[slot] = (k.float() / k_scale).clamp(-448, 448).to(FP8)
            v_flat[slot] = (v.float() / v_scale).clamp(-448, 448).to(FP8)
        else:
            k_flat[slot] = k
            v_flat[slot] = v
        if q_fp8:
            qf = q.float()
            s = qf.abs().amax(-1).clamp_min(1e-10) / 448.0
            return (qf / s[..., None]).clamp(-448, 448).to(FP8), s
        return q, None

    return step


def make(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, q_norm_weight, k_norm_weight, *,
         eps: float = 1e-6, q_dtype=torch.bfloat16, k_scale: float = 1.0, v_scale: float = 1.0,
         compiled: bool = False) -> Callable[[], object]:
    """A zero-argument callable running the unfused prologue on these tensors (NeoX rotation over all D, norms
    before the rotation: Qwen3's form); ``compiled``: through ``torch.compile`` (built and warmed here)."""
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise PeerUnavailable("the unfused peer writes by flat slot: contiguous caches only")
    if q_norm_weight is None or k_norm_weight is None or cos_sin.shape[1] != k_cache.shape[3]:
        raise PeerUnavailable("the unfused peer runs Qwen3's form: both norms, rotation over all of D")
    _, page, hkv, d = k_cache.shape
    hq = qkv.shape[1] // d - 2 * hkv
    slot = slots(positions, page_table, cu_seqlens_q, page)
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    qw, kw = q_norm_weight.to(qkv.dtype), k_norm_weight.to(qkv.dtype)
    fn = _steps(hq, hkv, d, eps, q_dtype == FP8, k_cache.dtype == FP8, k_scale, v_scale)
    if compiled:
        try:
            fn = torch.compile(fn, dynamic=False, fullgraph=True)
            fn(qkv, cos_sin, positions, slot, k_flat, v_flat, qw, kw)
        except Exception as e:  # an Inductor that cannot build it here is the peer's failure, not ours
            raise PeerUnavailable(f"torch.compile of the unfused prologue failed: {type(e).__name__}: {e}") from e
    return lambda: fn(qkv, cos_sin, positions, slot, k_flat, v_flat, qw, kw)
