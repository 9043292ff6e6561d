"""Triton kernel of the fused attention prologue (pure ``@triton.jit`` code; the launcher is ``prologue.py``).

One program takes a block of (token, head) rows of one kind: QT tokens x QH query heads, or KT tokens x KH
key/value heads (sizes from the launcher: about 2048 elements a program, so a slice with few heads a GPU still
gives each program a full tile). It reads those rows of the fused QKV projection once, applies the per-head RMSNorm
(QK-norm) and the rotary embedding in fp32, and writes

* query heads: ``q_out`` in bf16, or in fp8 e4m3 with one dequant scale per token and head
  (``scale = max(amax, eps) / 448``, the convention of the MoE activation quantiser);
* key/value heads: K (normed and rotated) and V (as projected) straight into the paged cache at the token's slot,
  ``page_table[request, position // P]``, offset ``position % P``, divided by the cache's per-tensor dequant scale
  (no division at a unit scale) and, for an fp8 cache, rounded to e4m3 (saturating).

The rotation takes each head as two halves of pairs, ``a[j]``, ``b[j]`` (``j`` and ``j + R/2`` for NeoX, "rotate
half"; ``2j`` and ``2j + 1`` for GPT-J, interleaved), each loaded in the layout it is computed in, and the dims past
R (left unrotated) as a third part. Round CD's profile of the earlier form (one token a program, every element read
twice, its partner moved through shared memory) found it issue-bound, not memory-bound:
docs/perf-notes/prologue.md, "Round CD".
"""
import triton
import triton.language as tl

from evenflow._kernels.common import FP8_E4M3_MAX, to_fp8e4

Q_AMAX_EPS = tl.constexpr(1e-10)


@triton.jit
def _request_of(p_cu, t, B, SEARCH_STEPS: tl.constexpr):
    """(b, live), element by element of ``t``: the request b with ``cu[b] <= t < cu[b + 1]`` by bisection over
    ``cu[0..B]`` and whether the token is live (``cu[0] <= t < cu[B]``). Requests with no tokens are skipped over
    (``cu[b] == cu[b + 1]``)."""
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
def _pair_offsets(D: tl.constexpr, R: tl.constexpr, RH: tl.constexpr, DR: tl.constexpr, GPTJ: tl.constexpr):
    """Columns of a head's rotated pairs and of its tail: ``o_a[j]`` / ``o_b[j]`` (pair j of R/2: ``j`` and
    ``j + R/2`` for NeoX, ``2j`` and ``2j + 1`` for GPT-J, both rotated by angle j), valid where ``m_j``; ``o_r``
    the dims past R (left unrotated), valid where ``m_r``."""
    o_j = tl.arange(0, RH)
    m_j = o_j < R // 2
    if GPTJ:
        o_a = 2 * o_j
        o_b = o_a + 1
    else:
        o_a = o_j
        o_b = o_j + R // 2
    o_r = R + tl.arange(0, DR)
    m_r = o_r < D
    return o_j, m_j, o_a, o_b, o_r, m_r


@triton.jit
def _normed_rotated_rows(p_rows, m, p_cs_rows, p_w, eps, o_j, m_j, o_a, o_b, o_r, m_r,
                         D: tl.constexpr, R: tl.constexpr, TAIL: tl.constexpr, NORM: tl.constexpr,
                         NORM_FIRST: tl.constexpr):
    """fp32 parts (a, b, tail) of rows of heads: row i starts at ``p_rows[i]`` (valid where ``m[i]``; else zeros)
    with its angles' cos at ``p_cs_rows[i]`` and their sin R/2 after; normed with weight ``p_w`` (when NORM) and
    rotated: a' = a cos - b sin, b' = b cos + a sin. Each part is loaded in the layout it is used in (no partner
    gather)."""
    mj = m[:, None] & m_j[None, :]
    xa = tl.load(p_rows[:, None] + o_a[None, :], mask=mj, other=0.0).to(tl.float32)
    xb = tl.load(p_rows[:, None] + o_b[None, :], mask=mj, other=0.0).to(tl.float32)
    cos = tl.load(p_cs_rows[:, None] + o_j[None, :], mask=mj, other=1.0).to(tl.float32)
    sin = tl.load(p_cs_rows[:, None] + (R // 2) + o_j[None, :], mask=mj, other=0.0).to(tl.float32)
    if TAIL:
        xr = tl.load(p_rows[:, None] + o_r[None, :], mask=m[:, None] & m_r[None, :], other=0.0).to(tl.float32)
    else:
        xr = tl.zeros([1, 1], dtype=tl.float32)
    if NORM:
        wa = tl.load(p_w + o_a, mask=m_j, other=0.0).to(tl.float32)[None, :]
        wb = tl.load(p_w + o_b, mask=m_j, other=0.0).to(tl.float32)[None, :]
        if TAIL:
            wr = tl.load(p_w + o_r, mask=m_r, other=0.0).to(tl.float32)[None, :]
        if NORM_FIRST:
            ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)
            if TAIL:
                ss += tl.sum(xr * xr, axis=1)
            rstd = tl.math.rsqrt(ss / D + eps)[:, None]
            xa = xa * wa
            xb = xb * wb
            ya = (xa * cos - xb * sin) * rstd
            yb = (xb * cos + xa * sin) * rstd
            if TAIL:
                xr = (xr * wr) * rstd
        else:
            ra = xa * cos - xb * sin
            rb = xb * cos + xa * sin
            ss = tl.sum(ra * ra, axis=1) + tl.sum(rb * rb, axis=1)
            if TAIL:
                ss += tl.sum(xr * xr, axis=1)
            rstd = tl.math.rsqrt(ss / D + eps)[:, None]
            ya = ra * rstd * wa
            yb = rb * rstd * wb
            if TAIL:
                xr = xr * rstd * wr
    else:
        ya = xa * cos - xb * sin
        yb = xb * cos + xa * sin
    return ya, yb, xr


@triton.jit
def _scaled(y, p_scale, scale_f, SCALE_T: tl.constexpr, UNIT: tl.constexpr):
    """``y / scale`` (correctly rounded): the scale from a tensor (SCALE_T), a float, or 1 (UNIT: no division)."""
    if SCALE_T:
        y = tl.math.div_rn(y, tl.load(p_scale))
    elif not UNIT:
        y = tl.math.div_rn(y, scale_f)
    return y


@triton.jit
def _store_cache(p, y, mask, KV_FP8: tl.constexpr, FP8_ROUND: tl.constexpr):
    """The cache's store rule for values already divided by its scale: fp8 rounded to e4m3 (saturating), else
    bf16."""
    if KV_FP8:
        tl.store(p, to_fp8e4(y, FP8_ROUND), mask=mask)
    else:
        tl.store(p, y.to(tl.bfloat16), mask=mask)


@triton.jit
def _store_parts(p, ya, yb, yr, rows, o_a, o_b, o_r, m_j, m_r, p_scale, scale_f, SCALE_T: tl.constexpr,
                 UNIT: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr, FP8_ROUND: tl.constexpr):
    """A head's parts (rotated pairs a, b; the tail past R) to the rows at ``p`` (valid where ``rows``), each divided by
    the scale (:func:`_scaled`) and stored by :func:`_store_cache`'s rule."""
    mj = rows[:, None] & m_j[None, :]
    _store_cache(p + o_a[None, :], _scaled(ya, p_scale, scale_f, SCALE_T, UNIT), mj, FP8, FP8_ROUND)
    _store_cache(p + o_b[None, :], _scaled(yb, p_scale, scale_f, SCALE_T, UNIT), mj, FP8, FP8_ROUND)
    if TAIL:
        _store_cache(p + o_r[None, :], _scaled(yr, p_scale, scale_f, SCALE_T, UNIT), rows[:, None] & m_r[None, :],
                     FP8, FP8_ROUND)


@triton.jit
def _program_rows(prog, T, H: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr, BLOCKS: tl.constexpr):
    """Row i of program ``prog`` (of its kind, with BLOCKS head blocks a token block): token ``t[i]`` (and as int64),
    head ``h[i]``, valid where ``m[i]``."""
    rows = tl.arange(0, TOKENS * HEADS)
    t = (prog // BLOCKS) * TOKENS + rows // HEADS
    h = (prog % BLOCKS) * HEADS + rows % HEADS
    m = (t < T) & (h < H)
    return t, t.to(tl.int64), h, m


@triton.jit
def _rotary_rows(p_cos_sin, pos, max_pos, stride_cs):
    """The rotary rows of positions ``pos``. The angles of a position outside the table are never used for a live
    row (check_inputs refuses them); the read is clamped all the same."""
    return p_cos_sin + tl.minimum(tl.maximum(pos, 0), max_pos - 1) * stride_cs


@triton.jit
def _q_program(prog, p_qkv, p_pos, p_cos_sin, p_cu, p_qn_w, p_q_out, p_q_scale, T, B, max_pos, eps,
               stride_qkv_t, stride_cs, stride_qo_t, stride_qs_t,
               HQ: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RH: tl.constexpr, DR: tl.constexpr,
               QH: tl.constexpr, QT: tl.constexpr, Q_BLOCKS: tl.constexpr, GPTJ: tl.constexpr, NORM_Q: tl.constexpr,
               NORM_FIRST: tl.constexpr, Q_FP8: tl.constexpr, FP8_ROUND: tl.constexpr):
    """Query program ``prog``: QT tokens x QH query heads, normed, rotated and written to ``q_out`` (fp8: with
    their scales)."""
    TAIL: tl.constexpr = R < D
    o_j, m_j, o_a, o_b, o_r, m_r = _pair_offsets(D, R, RH, DR, GPTJ)
    t, t64, h, m = _program_rows(prog, T, HQ, QT, QH, Q_BLOCKS)
    _, live = _request_of(p_cu, t, B, 0)
    pos = tl.load(p_pos + t64, mask=m, other=0).to(tl.int64)
    p_cs = _rotary_rows(p_cos_sin, pos, max_pos, stride_cs)
    ya, yb, yr = _normed_rotated_rows(p_qkv + t64 * stride_qkv_t + h * D, m & live, p_cs, p_qn_w, eps,
                                      o_j, m_j, o_a, o_b, o_r, m_r, D, R, TAIL, NORM_Q, NORM_FIRST)
    p_o = (p_q_out + t64 * stride_qo_t + h * D)[:, None]
    if Q_FP8:
        amax = tl.maximum(tl.max(tl.abs(ya), axis=1), tl.max(tl.abs(yb), axis=1))
        if TAIL:
            amax = tl.maximum(amax, tl.max(tl.abs(yr), axis=1))
        s = tl.math.div_rn(tl.maximum(amax, Q_AMAX_EPS), FP8_E4M3_MAX)
        _store_parts(p_o, ya, yb, yr, m, o_a, o_b, o_r, m_j, m_r, p_q_scale, s[:, None], False, False, TAIL, True,
                     FP8_ROUND)
        tl.store(p_q_scale + t64 * stride_qs_t + h, s, mask=m)
    else:
        _store_parts(p_o, ya, yb, yr, m, o_a, o_b, o_r, m_j, m_r, p_q_scale, 1.0, False, True, TAIL, False, FP8_ROUND)


@triton.jit
def _kv_program(prog, p_qkv, p_pos, p_cos_sin, p_cu, p_page_table, p_kc, p_vc, p_kn_w, p_k_scale, p_v_scale,
                k_scale_f, v_scale_f, T, B, num_pages, max_pages, max_pos, eps, stride_qkv_t, stride_cs, stride_pt_b,
                stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RH: tl.constexpr,
                DR: tl.constexpr, P: tl.constexpr, KH: tl.constexpr, KT: tl.constexpr, KV_BLOCKS: tl.constexpr,
                SEARCH_STEPS: tl.constexpr, GPTJ: tl.constexpr, NORM_K: tl.constexpr, NORM_FIRST: tl.constexpr,
                KV_FP8: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, K_UNIT: tl.constexpr,
                V_UNIT: tl.constexpr, FP8_ROUND: tl.constexpr):
    """Key / value program ``prog``: KT tokens x KH heads, K normed and rotated, K and V stored into the paged
    cache at each token's slot."""
    TAIL: tl.constexpr = R < D
    o_j, m_j, o_a, o_b, o_r, m_r = _pair_offsets(D, R, RH, DR, GPTJ)
    t, t64, h, m = _program_rows(prog, T, HKV, KT, KH, KV_BLOCKS)
    b, live = _request_of(p_cu, t, B, SEARCH_STEPS)
    pos = tl.load(p_pos + t64, mask=m, other=0).to(tl.int64)
    # the slot: a live token at a position inside the page table whose page is in the cache; anything else
    # writes nothing (check_inputs names it; the kernel only keeps every access in bounds)
    ok = m & live & (pos >= 0) & (pos // P < max_pages)  # (no max_pages * P: it could wrap in int32)
    page = tl.load(p_page_table + b.to(tl.int64) * stride_pt_b + pos // P, mask=ok, other=0).to(tl.int64)
    ok = ok & (page >= 0) & (page < num_pages)
    p_cs = _rotary_rows(p_cos_sin, pos, max_pos, stride_cs)
    p_row = p_qkv + t64 * stride_qkv_t + (HQ + h) * D
    ka, kb, kr = _normed_rotated_rows(p_row, ok, p_cs, p_kn_w, eps, o_j, m_j, o_a, o_b, o_r, m_r, D, R, TAIL,
                                      NORM_K, NORM_FIRST)
    slot = pos % P
    p_k = (p_kc + page * stride_kc_page + slot * stride_kc_slot + h * stride_kc_head)[:, None]
    _store_parts(p_k, ka, kb, kr, ok, o_a, o_b, o_r, m_j, m_r, p_k_scale, k_scale_f, K_SCALE_T, K_UNIT, TAIL, KV_FP8,
                 FP8_ROUND)
    o_d = tl.arange(0, D)[None, :]
    v = tl.load((p_row + HKV * D)[:, None] + o_d, mask=ok[:, None], other=0.0).to(tl.float32)
    p_v = (p_vc + page * stride_vc_page + slot * stride_vc_slot + h * stride_vc_head)[:, None]
    _store_cache(p_v + o_d, _scaled(v, p_v_scale, v_scale_f, V_SCALE_T, V_UNIT), ok[:, None], KV_FP8, FP8_ROUND)


@triton.jit
def qk_norm_rope_store_kv_kernel(
    p_qkv, p_pos, p_cos_sin, p_cu, p_page_table, p_kc, p_vc, p_qn_w, p_kn_w, p_q_out, p_q_scale,
    p_k_scale, p_v_scale, k_scale_f, v_scale_f,
    T, B, num_pages, max_pages, max_pos, eps, Q_PROGRAMS,
    stride_qkv_t, stride_cs, stride_pt_b,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    stride_qo_t, stride_qs_t,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RH: tl.constexpr, DR: tl.constexpr,
    P: tl.constexpr, QH: tl.constexpr, QT: tl.constexpr, Q_BLOCKS: tl.constexpr, KH: tl.constexpr,
    KT: tl.constexpr, KV_BLOCKS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    GPTJ: tl.constexpr, NORM_Q: tl.constexpr, NORM_K: tl.constexpr, NORM_FIRST: tl.constexpr,
    Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr,
    K_UNIT: tl.constexpr, V_UNIT: tl.constexpr, FP8_ROUND: tl.constexpr,
):
    """Programs [0, Q_PROGRAMS) take QT tokens x QH query heads each (head blocks fastest); the rest KT tokens x KH
    key / value heads. A program's rows are (token, head) pairs, row i = (first + i // heads, i % heads)."""
    pid = tl.program_id(0)
    if pid < Q_PROGRAMS:
        _q_program(pid, p_qkv, p_pos, p_cos_sin, p_cu, p_qn_w, p_q_out, p_q_scale, T, B, max_pos, eps,
                   stride_qkv_t, stride_cs, stride_qo_t, stride_qs_t, HQ, D, R, RH, DR, QH, QT, Q_BLOCKS, GPTJ,
                   NORM_Q, NORM_FIRST, Q_FP8, FP8_ROUND)
    else:
        _kv_program(pid - Q_PROGRAMS, p_qkv, p_pos, p_cos_sin, p_cu, p_page_table, p_kc, p_vc, p_kn_w, p_k_scale,
                    p_v_scale, k_scale_f, v_scale_f, T, B, num_pages, max_pages, max_pos, eps, stride_qkv_t,
                    stride_cs, stride_pt_b, stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page,
                    stride_vc_slot, stride_vc_head, HQ, HKV, D, R, RH, DR, P, KH, KT, KV_BLOCKS, SEARCH_STEPS, GPTJ,
                    NORM_K, NORM_FIRST, KV_FP8, K_SCALE_T, V_SCALE_T, K_UNIT, V_UNIT, FP8_ROUND)


@triton.jit
def store_rows_kernel(p_src, p_cache, p_slots, scale_t, scale_f, capacity, P, stride_sn, stride_sh, stride_cp,
                      stride_ct, stride_ch, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                      SCALE_T: tl.constexpr, UNIT: tl.constexpr, KV_FP8: tl.constexpr, FP8_ROUND: tl.constexpr):
    """``store_kv``: row n of ``src`` [N, HKV, D] (bf16 or fp32, any strides with a unit last one: an engine's K / V
    views of its fused q / k / v projection read in place) to the flat slot ``slots[n]``
    (``page * P + offset``) of the cache [pages, P, HKV, D] (any strides, unit last), by the prologue's store rule
    (:func:`_scaled`, :func:`_store_cache`); a slot outside [0, capacity) is not written (a negative one is an
    engine's padding row). Grid: (N, cdiv(HKV, BLOCK_H))."""
    n = tl.program_id(0)
    slot = tl.load(p_slots + n)
    ok = (slot >= 0) & (slot < capacity)
    s = tl.where(ok, slot, 0)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, D)
    m = (o_h < HKV)[:, None] & ok
    y = tl.load(p_src + n.to(tl.int64) * stride_sn + (o_h.to(tl.int64) * stride_sh)[:, None] + o_d[None, :],
                mask=m, other=0.0).to(tl.float32)
    p = p_cache + (s // P) * stride_cp + (s % P) * stride_ct + (o_h.to(tl.int64) * stride_ch)[:, None] + o_d[None, :]
    _store_cache(p, _scaled(y, scale_t, scale_f, SCALE_T, UNIT), m, KV_FP8, FP8_ROUND)
