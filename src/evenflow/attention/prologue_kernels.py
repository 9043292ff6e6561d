"""Triton kernel of the fused attention prologue (pure ``@triton.jit`` code; the launcher is ``prologue.py``).

One program takes one token and a block of heads of one kind: query heads, or key/value heads. It reads the
token's row of the fused QKV projection once, applies the per-head RMSNorm (QK-norm) and the rotary embedding in
fp32, and writes

* query heads: ``q_out`` in bf16, or in fp8 e4m3 with one dequant scale per token and head
  (``scale = max(amax, eps) / 448``, the convention of the MoE activation quantiser);
* key/value heads: K (normed and rotated) and V (as projected) straight into the paged cache at the token's slot,
  ``page_table[request, position // P]``, offset ``position % P``, divided by the cache's per-tensor dequant scale
  and, for an fp8 cache, rounded to e4m3 (saturating).

The rotation pairs element ``d`` with a partner: ``d ± R/2`` (NeoX, "rotate half") or ``d ^ 1`` (GPT-J,
interleaved), for ``d < R`` (the rotary dims); both elements are read from memory (the partner's read hits the
cache), so the norm, which scales each element, is applied to both before or after the rotation as asked.
"""
import triton
import triton.language as tl

from evenflow._kernels.common import FP8_E4M3_MAX, to_fp8e4

Q_AMAX_EPS = tl.constexpr(1e-10)


@triton.jit
def _request_of(p_cu, t, B, SEARCH_STEPS: tl.constexpr):
    """(b, live): the request b with ``cu[b] <= t < cu[b + 1]`` by bisection over ``cu[0..B]`` and whether the
    token is live (``cu[0] <= t < cu[B]``). Requests with no tokens are skipped over (``cu[b] == cu[b + 1]``)."""
    total = tl.load(p_cu + B)
    live = (t < total) & (tl.load(p_cu) <= t)
    lo = t * 0
    hi = lo + B
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        at = tl.load(p_cu + mid)
        step = hi - lo > 1
        lo = tl.where(step & (at <= t), mid, lo)
        hi = tl.where(step & (at > t), mid, hi)
    return lo, live


@triton.jit
def _normed_rotated(p_row, o_h, m_h, o_d, p_w, p_cos, p_sin, eps,
                    D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, NORM_FIRST: tl.constexpr,
                    GPTJ: tl.constexpr, live):
    """fp32 [BLOCK_H, D] of heads ``o_h`` of one token row (``p_row``: the heads' first column), normed with
    weight ``p_w`` (when NORM) and rotated by the angles at ``p_cos``/``p_sin`` (R/2 of each)."""
    if GPTJ:
        o_p = o_d ^ 1
        o_i = o_d // 2
        sign = tl.where(o_d % 2 == 0, -1.0, 1.0)
    else:
        o_p = tl.where(o_d < R // 2, o_d + R // 2, o_d - R // 2)
        o_i = o_d % (R // 2)
        sign = tl.where(o_d < R // 2, -1.0, 1.0)
    rot = o_d < R
    o_p = tl.where(rot, o_p, o_d)
    m = m_h[:, None] & live
    x = tl.load(p_row + o_h[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(p_row + o_h[:, None] * D + o_p[None, :], mask=m, other=0.0).to(tl.float32)
    cos = tl.where(rot, tl.load(p_cos + o_i, mask=rot, other=1.0).to(tl.float32), 1.0)
    sin = tl.where(rot, tl.load(p_sin + o_i, mask=rot, other=0.0).to(tl.float32), 0.0) * sign
    if NORM:
        w = tl.load(p_w + o_d).to(tl.float32)
        wp = tl.load(p_w + o_p).to(tl.float32)
        if NORM_FIRST:
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            y = (x * w[None, :]) * cos[None, :] + (xp * wp[None, :]) * sin[None, :]
            y = y * rstd[:, None]
        else:
            r = x * cos[None, :] + xp * sin[None, :]
            rstd = tl.math.rsqrt(tl.sum(r * r, axis=1) / D + eps)
            y = r * rstd[:, None] * w[None, :]
    else:
        y = x * cos[None, :] + xp * sin[None, :]
    return y


@triton.jit
def _store_kv(p_cache, y, o_h, m_h, o_d, slot_off, ok, scale_t, scale_f,
              SCALE_T: tl.constexpr, KV_FP8: tl.constexpr, FP8_ROUND: tl.constexpr, stride_h):
    """Write ``y / scale`` (fp8: rounded to e4m3, saturating) to heads ``o_h`` of the cache slot at ``slot_off``."""
    if SCALE_T:
        y = tl.math.div_rn(y, tl.load(scale_t))
    else:
        y = tl.math.div_rn(y, scale_f)
    if KV_FP8:
        v = to_fp8e4(y, FP8_ROUND)
    else:
        v = y.to(tl.bfloat16)
    tl.store(p_cache + slot_off + o_h[:, None] * stride_h + o_d[None, :], v, mask=m_h[:, None] & ok)


@triton.jit
def qk_norm_rope_store_kv_kernel(
    p_qkv, p_pos, p_cos_sin, p_cu, p_page_table, p_kc, p_vc, p_qn_w, p_kn_w, p_q_out, p_q_scale,
    p_k_scale, p_v_scale, k_scale_f, v_scale_f,
    B, num_pages, max_pages, max_pos, eps,
    stride_qkv_t, stride_cs, stride_pt_b,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    stride_qo_t, stride_qs_t,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_BLOCKS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    GPTJ: tl.constexpr, NORM_Q: tl.constexpr, NORM_K: tl.constexpr, NORM_FIRST: tl.constexpr,
    Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr,
    FP8_ROUND: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    t64 = t.to(tl.int64)
    b, live = _request_of(p_cu, t, B, SEARCH_STEPS)
    pos = tl.load(p_pos + t64).to(tl.int64)
    # the angles of a position outside the table are never used for a live row (check_inputs refuses them);
    # the read is clamped all the same
    row = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    p_cos = p_cos_sin + row * stride_cs
    p_sin = p_cos + R // 2
    p_row = p_qkv + t64 * stride_qkv_t
    o_d = tl.arange(0, D)
    if hb < Q_BLOCKS:
        o_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m_h = o_h < HQ
        y = _normed_rotated(p_row, o_h, m_h, o_d, p_qn_w, p_cos, p_sin, eps, D, R, NORM_Q, NORM_FIRST, GPTJ, live)
        p_out = p_q_out + t64 * stride_qo_t + o_h[:, None] * D + o_d[None, :]
        if Q_FP8:
            s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=1), Q_AMAX_EPS), FP8_E4M3_MAX)
            tl.store(p_out, to_fp8e4(tl.math.div_rn(y, s[:, None]), FP8_ROUND), mask=m_h[:, None])
            tl.store(p_q_scale + t64 * stride_qs_t + o_h, s, mask=m_h)
        else:
            tl.store(p_out, y.to(tl.bfloat16), mask=m_h[:, None])
    else:
        o_h = (hb - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        m_h = o_h < HKV
        # the slot: a live token at a position inside the page table whose page is in the cache; anything else
        # writes nothing (check_inputs names it; the kernel only keeps every access in bounds)
        ok = live & (pos >= 0) & (pos // P < max_pages)  # (no max_pages * P: it could wrap in int32)
        page = tl.load(p_page_table + b.to(tl.int64) * stride_pt_b + pos // P, mask=ok, other=0).to(tl.int64)
        ok = ok & (page >= 0) & (page < num_pages)
        k = _normed_rotated(p_row + HQ * D, o_h, m_h, o_d, p_kn_w, p_cos, p_sin, eps, D, R, NORM_K, NORM_FIRST,
                            GPTJ, live)
        _store_kv(p_kc, k, o_h, m_h, o_d, page * stride_kc_page + (pos % P) * stride_kc_slot, ok, p_k_scale,
                  k_scale_f, K_SCALE_T, KV_FP8, FP8_ROUND, stride_kc_head)
        v = tl.load(p_row + (HQ + HKV) * D + o_h[:, None] * D + o_d[None, :], mask=m_h[:, None] & ok,
                    other=0.0).to(tl.float32)
        _store_kv(p_vc, v, o_h, m_h, o_d, page * stride_vc_page + (pos % P) * stride_vc_slot, ok, p_v_scale,
                  v_scale_f, V_SCALE_T, KV_FP8, FP8_ROUND, stride_vc_head)


@triton.jit
def store_rows_kernel(p_src, p_cache, p_slots, scale_t, scale_f, capacity, P, stride_sn, stride_sh, stride_cp,
                      stride_ct, stride_ch, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                      SCALE_T: tl.constexpr, KV_FP8: tl.constexpr, FP8_ROUND: tl.constexpr):
    """``store_kv``: row n of ``src`` [N, HKV, D] (bf16 or fp32, any strides with a unit last one: an engine's K / V
    views of its fused q / k / v projection read in place) to the flat slot ``slots[n]``
    (``page * P + offset``) of the cache [pages, P, HKV, D] (any strides, unit last), by the prologue's store rule
    (:func:`_store_kv`); a slot outside [0, capacity) is not written (a negative one is an engine's padding row).
    Grid: (N, cdiv(HKV, BLOCK_H))."""
    n = tl.program_id(0)
    slot = tl.load(p_slots + n)
    ok = (slot >= 0) & (slot < capacity)
    s = tl.where(ok, slot, 0)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, D)
    m_h = o_h < HKV
    y = tl.load(p_src + n.to(tl.int64) * stride_sn + (o_h.to(tl.int64) * stride_sh)[:, None] + o_d[None, :],
                mask=m_h[:, None] & ok, other=0.0).to(tl.float32)
    _store_kv(p_cache, y, o_h.to(tl.int64), m_h, o_d, (s // P) * stride_cp + (s % P) * stride_ct, ok, scale_t,
              scale_f, SCALE_T, KV_FP8, FP8_ROUND, stride_ch)
