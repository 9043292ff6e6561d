"""The fused attention prologue: QK-RMSNorm, rotary embedding, q (bf16, or fp8 with its scales) and the paged
KV-cache store in one kernel. Launcher (checks, allocation, block choice) and its custom op.

==============  =============================  =================================================================
argument         shape                          dtype
==============  =============================  =================================================================
qkv              [T, (Hq + 2 * Hkv) * D]        bf16, the fused projection's output: Hq query heads, then Hkv key
                                                heads, then Hkv value heads, D wide each (any row stride, unit
                                                last stride)
positions        [T]                            int32 or int64: each token's position in its request (the rotary
                                                angle and the cache slot)
cos_sin          [max_pos, R]                   fp32 or bf16: row p holds cos(p * f_i) for i < R/2, then
                                                sin(p * f_i) (R = rotary_dim, the rotated dims; R <= D, even)
k/v_cache        [num_pages, P, Hkv, D]         bf16 or fp8 e4m3 (the layout ``decode_attention`` reads; any
                                                strides with a unit last stride)
page_table       [B, max_pages]                 int32, pages in any order
cu_seqlens_q     [B + 1]                        int32, token t belongs to request b where cu[b] <= t < cu[b + 1];
                                                tokens at or past cu[B] are padding
q/k_norm_weight  [D] or None                    bf16 or fp32 RMSNorm weight shared by every head (None: no norm)
k/v_scale        float, fp32 tensor [1], None   per-tensor dequant scale of the cache (stored = value / scale;
                                                ``decode_attention`` takes the same value)
q_out            [T, Hq, D]                     bf16, or fp8 e4m3 with ``q_dtype=torch.float8_e4m3fn``
q_scale_out      [T, Hq]                        fp32 (fp8 q only): q = q_out * q_scale, scale = max(amax, 1e-10) /
                                                448 over the head's D values (``decode_attention``'s ``q_scale``)
==============  =============================  =================================================================

Token t (a request's position ``positions[t]``) writes its K and V to ``k_cache[page, slot]`` with
``page = page_table[b, positions[t] // P]`` and ``slot = positions[t] % P``. Padding tokens (past ``cu[B]``, or
before ``cu[0]``) get q = 0 and write nothing to the cache. Two live tokens given the same slot race (the cache keeps
one of them).

What is checked where: dtypes, shapes, devices and strides raise on the host. Values inside device tensors
(positions, the page table, cu_seqlens_q) are not read by the launcher by default (that would sync): a live token
whose position is outside [0, max_pages * P) or whose page is outside [0, num_pages) writes nothing, and rotary
angles are read at the position clamped to the table, so nothing is read or written out of bounds.
``check_inputs=True`` checks those values in the call (one sync; skipped under CUDA-graph capture and
torch.compile) and names the first bad entry.
"""
from __future__ import annotations

import math

import torch

from evenflow import _runtime
from evenflow._checks import (
    FP32,
    check_bool,
    check_choice,
    check_cu_seqlens_values,
    check_int,
    check_out,
    check_scaling,
    check_tensor,
    checked_op,
)
from evenflow.attention import prologue_kernels as PK
from evenflow.attention.decode import _scale_arg, check_kv_cache, check_scale_tensors
from evenflow.attention.plan import Q_DTYPES

FP8 = torch.float8_e4m3fn
ROPE_STYLES = ("neox", "gptj")
# elements a program takes: about 2048 of each operand (its heads, then as many tokens as fill the block)
_BLOCK_ELEMS = 2048


def _block_h(num_heads: int, head_dim: int) -> int:
    return max(1, min(_runtime.next_power_of_2(num_heads), _BLOCK_ELEMS // head_dim))


def _rows_block(num_heads: int, head_dim: int, tokens: int, sms: int) -> tuple[int, int]:
    """(heads, tokens) of a program's rows: heads up to the block's elements, then tokens to fill it (powers of two),
    but no more tokens than leave one program an SM for this kind. Round CD: with one token a program, a slice of one
    KV head ran programs of one 128-element row each (issue-bound at large T); with full blocks at small T, a few
    programs each ran a long serial chain of fp8 stores while most SMs idled."""
    heads = _block_h(num_heads, head_dim)
    spread = max(1, tokens * _runtime.cdiv(num_heads, heads) // sms)
    toks = max(1, min(_BLOCK_ELEMS // (heads * head_dim), 1 << (spread.bit_length() - 1)))
    return heads, toks


def _check(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, q_norm_weight, k_norm_weight,
           rotary_dim, q_dtype):
    """The host-side checks; returns (T, Hq, Hkv, D, R, B)."""
    check_tensor("qkv", qkv, dtypes=[torch.bfloat16], ndim=2, last_dim_contiguous=True)
    dev = qkv.device
    _, P, Hkv, D = check_kv_cache(k_cache, v_cache, dev)
    T, width = qkv.shape
    if width % D or width // D <= 2 * Hkv or (width // D - 2 * Hkv) % Hkv:
        raise ValueError(f"qkv's width ({width}) must be (Hq + 2 * Hkv) * D with D = {D}, Hkv = {Hkv} (k_cache) "
                         "and Hq a positive multiple of Hkv")
    Hq = width // D - 2 * Hkv
    check_tensor("positions", positions, dtypes=[torch.int32, torch.int64], shape=[T], device=dev, contiguous=True)
    check_tensor("cos_sin", cos_sin, dtypes=[torch.float32, torch.bfloat16], ndim=2, device=dev,
                 last_dim_contiguous=True)
    R = D if rotary_dim is None else check_int("rotary_dim", rotary_dim, 2, D)
    if R % 2:
        raise ValueError(f"rotary_dim must be even, got {R}")
    if cos_sin.shape[1] != R or cos_sin.shape[0] < 1:
        raise ValueError(f"cos_sin must have shape (max_pos >= 1, {R}) (cos then sin of the {R // 2} angles), "
                         f"got {tuple(cos_sin.shape)}")
    check_tensor("page_table", page_table, dtypes=[torch.int32], ndim=2, device=dev, last_dim_contiguous=True)
    if page_table.shape[1] < 1:
        raise ValueError("page_table must have at least one column")
    B = page_table.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=[torch.int32], shape=[B + 1], device=dev, contiguous=True)
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(name, w, dtypes=[torch.bfloat16, torch.float32], shape=[D], device=dev, contiguous=True)
    check_choice("q_dtype", q_dtype, Q_DTYPES)
    return T, Hq, Hkv, D, R, B


def _prologue_launch(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, page_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, q_out: torch.Tensor,
                     q_scale: torch.Tensor | None, k_scale_f: float, v_scale_f: float, eps: float,
                     rotary_dim: int, gptj: bool, norm_first: bool) -> None:
    T = qkv.shape[0]
    _, P, Hkv, D = k_cache.shape
    Hq = qkv.shape[1] // D - 2 * Hkv
    B = page_table.shape[0]
    if T == 0:
        return
    sms = _runtime.num_sms(qkv.device)
    qh, qt = _rows_block(Hq, D, T, sms)
    kh, kt = _rows_block(Hkv, D, T, sms)
    q_blocks, kv_blocks = _runtime.cdiv(Hq, qh), _runtime.cdiv(Hkv, kh)
    q_programs = _runtime.cdiv(T, qt) * q_blocks
    q_fp8 = q_out.dtype == FP8
    PK.qk_norm_rope_store_kv_kernel[(q_programs + _runtime.cdiv(T, kt) * kv_blocks,)](
        qkv, positions, cos_sin, cu_seqlens_q, page_table, k_cache, v_cache,
        q_norm_weight if q_norm_weight is not None else qkv, k_norm_weight if k_norm_weight is not None else qkv,
        q_out, q_scale if q_scale is not None else cos_sin,
        k_scale if k_scale is not None else cos_sin, v_scale if v_scale is not None else cos_sin,
        k_scale_f, v_scale_f,
        T, B, k_cache.shape[0], page_table.shape[1], cos_sin.shape[0], eps, q_programs,
        qkv.stride(0), cos_sin.stride(0), page_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), q_out.stride(0), q_scale.stride(0) if q_scale is not None else 0,
        HQ=Hq, HKV=Hkv, D=D, R=rotary_dim, RH=_runtime.next_power_of_2(rotary_dim // 2),
        DR=_runtime.next_power_of_2(max(1, D - rotary_dim)), P=P, QH=qh, QT=qt, Q_BLOCKS=q_blocks, KH=kh, KT=kt,
        KV_BLOCKS=kv_blocks, SEARCH_STEPS=max(1, math.ceil(math.log2(B + 1))),
        GPTJ=gptj, NORM_Q=q_norm_weight is not None, NORM_K=k_norm_weight is not None, NORM_FIRST=norm_first,
        Q_FP8=q_fp8, KV_FP8=k_cache.dtype == FP8, K_SCALE_T=k_scale is not None, V_SCALE_T=v_scale is not None,
        K_UNIT=k_scale is None and k_scale_f == 1.0, V_UNIT=v_scale is None and v_scale_f == 1.0,
        FP8_ROUND=_runtime.fp8_cast_needs_rounding(), num_warps=4,
    )


def _check_prologue_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): every tensor the kernel indexes, sized from the others."""
    T, Hq, Hkv, D, R, B = _check(a["qkv"], a["positions"], a["cos_sin"], a["k_cache"], a["v_cache"],
                                 a["page_table"], a["cu_seqlens_q"], a["q_norm_weight"], a["k_norm_weight"],
                                 a["rotary_dim"], a["q_out"].dtype if isinstance(a["q_out"], torch.Tensor)
                                 else None)
    dev = a["qkv"].device
    check_out("q_out", a["q_out"], [T, Hq, D], a["q_out"].dtype, dev)
    if a["q_out"].dtype == FP8:
        if a["q_scale"] is None:
            raise ValueError("q_scale is required with an fp8 q_out")
        check_out("q_scale", a["q_scale"], [T, Hq], torch.float32, dev)
    elif a["q_scale"] is not None:
        raise ValueError("q_scale is only written for an fp8 q_out")
    for name in ("k_scale", "v_scale"):
        if a[name] is not None:
            _scale_arg(name, a[name], dev)
    for name in ("k_scale_f", "v_scale_f", "eps"):
        check_scaling(name, a[name], positive=True)
    check_bool("gptj", a["gptj"])
    check_bool("norm_first", a["norm_first"])


# Registered as a custom op (fake below) for torch.compile; eager calls launch directly (the op's dispatch costs
# tens of us on the host, as for the other operators).
_prologue_op = torch.library.custom_op("evenflow::qk_norm_rope_store_kv",
                                       mutates_args=("k_cache", "v_cache", "q_out", "q_scale"))(
    checked_op(_prologue_launch, _check_prologue_op))


@_prologue_op.register_fake
def _(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, q_norm_weight, k_norm_weight, k_scale,
      v_scale, q_out, q_scale, k_scale_f, v_scale_f, eps, rotary_dim, gptj, norm_first):
    return None


def qk_norm_rope_store_kv(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, *,
                          q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6, norm_before_rope: bool = True,
                          rope_style: str = "neox", rotary_dim: int | None = None, k_scale=None, v_scale=None,
                          q_dtype: torch.dtype = torch.bfloat16, q_out=None, q_scale_out=None,
                          check_inputs: bool = False):
    """QK-RMSNorm, rotary embedding and the paged KV store of one layer's tokens, in one kernel (shapes in the
    module docstring). Returns ``(q, q_scale)``: q ``[T, Hq, D]`` in ``q_dtype`` and, for an fp8 q, its fp32
    scales ``[T, Hq]`` (else None), ready for :func:`evenflow.decode_attention`; K and V are written into
    ``k_cache`` / ``v_cache`` in place.

    ``norm_before_rope``: RMSNorm then rotation (Qwen3), or the rotation first. ``rope_style``: ``"neox"``
    (rotate half) or ``"gptj"`` (interleaved pairs). ``rotary_dim``: the rotated leading dims (default D).
    ``check_inputs``: also check positions, pages, cu_seqlens_q and scales given as tensors on the host (a sync;
    see the module).
    All math in fp32, rounded once to the output's dtype.
    """
    T, Hq, Hkv, D, R, B = _check(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q,
                                 q_norm_weight, k_norm_weight, rotary_dim, q_dtype)
    dev = qkv.device
    eps = check_scaling("eps", eps, positive=True)
    if eps < FP32.tiny:  # the kernel's fp32 eps would be 0 (or flushed to it), and an all-zero head NaN
        raise ValueError(f"eps must be at least fp32's smallest normal number {FP32.tiny:.4g} (the kernel adds it "
                         f"in fp32), got {eps!r}")
    check_bool("norm_before_rope", norm_before_rope)
    check_choice("rope_style", rope_style, ROPE_STYLES)
    check_bool("check_inputs", check_inputs)
    ks_t, ks_f = _scale_arg("k_scale", k_scale, dev)
    vs_t, vs_f = _scale_arg("v_scale", v_scale, dev)
    if q_out is None:
        q_out = torch.empty(T, Hq, D, dtype=q_dtype, device=dev)
    else:
        check_out("q_out", q_out, [T, Hq, D], q_dtype, dev)
    if q_dtype == FP8:
        if q_scale_out is None:
            q_scale_out = torch.empty(T, Hq, dtype=torch.float32, device=dev)
        else:
            check_out("q_scale_out", q_scale_out, [T, Hq], torch.float32, dev)
    elif q_scale_out is not None:
        raise ValueError("q_scale_out is only written for q_dtype=torch.float8_e4m3fn")
    if check_inputs and _runtime.host_sync_allowed(positions):
        _check_values(positions, cos_sin, k_cache, page_table, cu_seqlens_q, T)
        check_scale_tensors(ks_t, vs_t)
    op = _prologue_op if torch.compiler.is_compiling() else _prologue_launch
    op(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, q_norm_weight, k_norm_weight, ks_t,
       vs_t, q_out, q_scale_out, ks_f, vs_f, eps, R, rope_style == "gptj", norm_before_rope)
    return q_out, q_scale_out


def prologue_bytes(tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype, rotary_dim: int | None = None, rotary_rows: int | None = None,
                   table_dtype: torch.dtype = torch.float32, position_dtype: torch.dtype = torch.int64) -> int:
    """Bytes one call must move (the floor's numerator): each token's qkv row read, its q written (with its fp32
    scales for an fp8 q), its K and V written and its position read, and each distinct rotary row read once
    (``rotary_rows``: the distinct positions of the call; ``tokens`` by default, which over-counts a batch whose
    requests share positions). The page table's reads (4 bytes a token, under 0.1% of the total) are left out, so
    with ``rotary_rows`` given the count is a lower bound."""
    r = head_dim if rotary_dim is None else rotary_dim
    q = num_q_heads * head_dim * q_dtype.itemsize + (num_q_heads * 4 if q_dtype == FP8 else 0)
    kv = 2 * num_kv_heads * head_dim * kv_dtype.itemsize
    rows = tokens if rotary_rows is None else rotary_rows
    return (tokens * ((num_q_heads + 2 * num_kv_heads) * head_dim * 2 + q + kv + position_dtype.itemsize)
            + rows * r * table_dtype.itemsize)


def validate_prologue_inputs(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, *,
                             rotary_dim: int | None = None) -> None:
    """The checks of ``qk_norm_rope_store_kv(..., check_inputs=True)`` alone (one host sync): ``cu_seqlens_q``
    starts at 0, never decreases and ends at most at T; each live token's position is inside the rotary table and
    the request's page table, and the page it lands on inside the cache. ValueError names the first bad entry."""
    T, *_ = _check(qkv, positions, cos_sin, k_cache, v_cache, page_table, cu_seqlens_q, None, None, rotary_dim,
                   torch.bfloat16)
    _check_values(positions, cos_sin, k_cache, page_table, cu_seqlens_q, T)


def _check_values(positions, cos_sin, k_cache, page_table, cu_seqlens_q, T: int) -> None:
    cu = check_cu_seqlens_values(cu_seqlens_q, T, "qkv")
    live = int(cu[-1])
    if live == 0:
        return
    pos = positions[:live].long().cpu()
    req = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    P = k_cache.shape[1]
    cap = min(cos_sin.shape[0], page_table.shape[1] * P)
    bad = ((pos < 0) | (pos >= cap)).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ValueError(f"positions[{t}] = {int(pos[t])} outside [0, {cap}) (rows of cos_sin "
                         f"{cos_sin.shape[0]}, page table columns * page size {page_table.shape[1] * P})")
    pages = page_table.cpu()[req, pos // P].long()
    bad = ((pages < 0) | (pages >= k_cache.shape[0])).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ValueError(f"page_table[{int(req[t])}, {int(pos[t]) // P}] = {int(pages[t])} (token {t}) outside "
                         f"[0, {k_cache.shape[0]})")


def store_kv(k, v, k_cache, v_cache, slots, *, k_scale=None, v_scale=None, check_inputs: bool = False) -> None:
    """Write token rows into the paged caches, for callers whose K and V are already normed and rotated (an engine's
    own attention module): ``k`` / ``v`` ``[N, Hkv, D]`` (bf16 or fp32; any strides, read in place where the last is
    1: an engine's views of its fused q / k / v projection) go to the flat slots ``slots`` ``[N]`` int64 (``page * P
    + offset``) of ``k_cache`` / ``v_cache`` ``[num_pages, P, Hkv, D]`` (any strides with a unit last one: contiguous,
    HND views, the K or V half of an engine's ``[num_pages, P, Hkv, 2 * D]`` buffer), divided by the scale and cast
    to the cache's dtype as the prologue stores them (in fp32; fp8 saturated at 448 first), one kernel each for K and
    V (the prologue's store step); no host sync. A negative slot is a padding row (vLLM marks them -1): not written.
    A slot past the cache is not written either (no sync to report it): ``check_inputs=True`` raises for it, and
    for a scale tensor that is not a positive fp32 number, on the host first (a sync). Rows sharing a slot leave
    one of them there, which one unspecified."""
    dev = k.device
    num_pages, P, Hkv, D = check_kv_cache(k_cache, v_cache, dev)
    check_tensor("k", k, dtypes=[torch.bfloat16, torch.float32], shape=[None, Hkv, D], device=dev)
    check_tensor("v", v, dtypes=[k.dtype], shape=list(k.shape), device=dev)
    check_tensor("slots", slots, dtypes=[torch.int64], shape=[k.shape[0]], device=dev, contiguous=True)
    check_bool("check_inputs", check_inputs)
    capacity = num_pages * P
    scales = [(x, cache, *_scale_arg(name, s, dev))
              for x, cache, name, s in ((k, k_cache, "k_scale", k_scale), (v, v_cache, "v_scale", v_scale))]
    if check_inputs and slots.numel() and _runtime.host_sync_allowed(slots):
        s = slots.cpu()
        bad = (s >= capacity).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"slots[{i}] = {int(s[i])} past the cache's {capacity} slots (pages x page size)")
        check_scale_tensors(scales[0][2], scales[1][2])
    N = k.shape[0]
    block_h = min(_runtime.next_power_of_2(Hkv), max(1, 4096 // D))
    for x, cache, s_t, s_f in scales:
        if N == 0:
            continue
        if x.stride(2) != 1:  # rows are read in place at any row and head strides (an engine's views of its qkv)
            x = x.contiguous()
        PK.store_rows_kernel[(N, _runtime.cdiv(Hkv, block_h))](
            x, cache, slots, s_t if s_t is not None else x, s_f, capacity, P, x.stride(0), x.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), HKV=Hkv, D=D, BLOCK_H=block_h, SCALE_T=s_t is not None,
            UNIT=s_t is None and s_f == 1.0, KV_FP8=cache.dtype == FP8, FP8_ROUND=_runtime.fp8_cast_needs_rounding())
