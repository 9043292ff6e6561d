"""Plain PyTorch oracle of the fused attention prologue (QK-RMSNorm, rotary embedding, fp8 q, paged KV store),
in fp64, written as the model code states it: norm, then rotate-half or interleaved pairs, then the cache write
token by token."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Q_AMAX_EPS = 1e-10


def rope_cos_sin(max_pos: int, rotary_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32,
                 device=None) -> torch.Tensor:
    """The rotary table ``[max_pos, rotary_dim]``: row p holds cos(p * f_i) for i < R/2, then sin(p * f_i), with
    ``f_i = base ** (-2 i / R)`` (the frequencies of RoFormer / Llama / Qwen), computed in fp64 and cast."""
    from evenflow._checks import check_int, check_scaling

    check_int("max_pos", max_pos, lo=1)
    check_int("rotary_dim", rotary_dim, lo=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    check_scaling("base", base, positive=True)  # 0, negative, NaN or inf bases give NaN angles
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(dtype=dtype, device=device)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, in x's dtype (x unchanged when ``w`` is None)."""
    if w is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, H, D] rotated over its first R = 2 * cos.shape[-1] dims by per-token angles (cos, sin: [T, R/2]),
    in x's dtype."""
    half = cos.shape[-1]
    r = 2 * half
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    out = x.clone()
    if style == "neox":
        x1, x2 = x[..., :half], x[..., half:r]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:r] = x2 * c + x1 * s
    elif style == "gptj":
        xe, xo = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = xe * c - xo * s
        out[..., 1:r:2] = xo * c + xe * s
    else:
        raise ValueError(f"style must be 'neox' or 'gptj', got {style!r}")
    return out


def qk_norm_rope_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_kv_heads: int,
                     head_dim: int, q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6,
                     norm_before_rope: bool = True, rope_style: str = "neox", dtype: torch.dtype = torch.float64):
    """(q, k, v) ``[T, H, D]`` each, of every token of ``qkv`` [T, (Hq + 2 Hkv) D], computed in ``dtype``
    (fp64: the oracle; fp32: the same math in the kernel's precision, the tolerance rule's baseline)."""
    qkv = qkv.cpu().to(dtype)
    T = qkv.shape[0]
    D, Hkv = head_dim, num_kv_heads
    Hq = qkv.shape[1] // D - 2 * Hkv
    x = qkv.reshape(T, Hq + 2 * Hkv, D)
    q, k, v = x[:, :Hq], x[:, Hq:Hq + Hkv], x[:, Hq + Hkv:]
    half = cos_sin.shape[1] // 2
    rows = cos_sin.cpu().to(dtype)[positions.long().cpu().clamp(0, cos_sin.shape[0] - 1)]
    cos, sin = rows[:, :half], rows[:, half:]
    qw = None if q_norm_weight is None else q_norm_weight.cpu()
    kw = None if k_norm_weight is None else k_norm_weight.cpu()
    if norm_before_rope:
        q = rotate(rms_norm(q, qw, eps), cos, sin, rope_style)
        k = rotate(rms_norm(k, kw, eps), cos, sin, rope_style)
    else:
        q = rms_norm(rotate(q, cos, sin, rope_style), qw, eps)
        k = rms_norm(rotate(k, cos, sin, rope_style), kw, eps)
    return q, k, v.clone()


def quant_q_ref(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (fp64 or fp32) -> (e4m3 q, fp32 scale [T, H]): scale = max(amax, 1e-10) / 448 per token and
    head, computed in q's dtype."""
    s = q.abs().amax(-1).clamp_min(Q_AMAX_EPS) / FP8_MAX
    return (q / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.float()


def store_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor, page_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches (on the CPU) with each live token's K and V ([T, Hkv, D], fp64 or fp32) written at its
    slot, divided by the scale in their dtype and cast to the cache's dtype (fp8: saturated at 448 first)."""
    kc, vc = k_cache.cpu().clone(), v_cache.cpu().clone()
    cu = cu_seqlens_q.long().cpu().tolist()
    pt = page_table.cpu()
    P = kc.shape[1]
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            p = int(positions[t])
            page = int(pt[b, p // P])
            for cache, x, s in ((kc, k, k_scale), (vc, v, v_scale)):
                val = x[t] / s
                if cache.dtype == FP8:
                    val = val.clamp(-FP8_MAX, FP8_MAX)
                cache[page, p % P] = val.to(cache.dtype)
    return kc, vc
