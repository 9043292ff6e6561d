"""Triton kernel of paged prefill / extend attention (pure ``@triton.jit`` code; the launcher is ``prefill.py``).

A program takes one query head of one request (``HEADS`` of them where it packs a KV head's q heads into a block's
rows) and walks that request's blocks of new rows (block ``program_id(1)``, then every ``num_programs(1)``-th: the
grid's row-block dimension is a bound from the host, and a request with more rows than it covers is still computed
whole; requests are the first dimension, which CUDA allows up to 2^31 - 1). For each block it streams the request's
keys in BLOCK_N steps up to the block's last visible key (with ``SPLIT``, the steps every row sees unmasked, then
the diagonal's masked), gathering each step's pages through the page table, with the online softmax of the decode
kernel (``kernels._scores`` / ``_softmax_pv_step``: bf16 MMAs for a bf16 cache, f16 MMAs of the exact e4m3 values
for an fp8 one). Row i of a request with n new rows and L cached tokens (new ones included) sees keys [0, L - n + i
+ 1). The grid's extra request (``program_id(0) == B``) writes zeros (and LSE -inf) to the rows no request owns:
past ``cu_seqlens_q[B]`` (padding) and before ``cu_seqlens_q[0]``.

Values inside device tensors are clamped so nothing is read or written out of bounds: request boundaries to
[0, T], lengths to [0, max_pages * P], page ids to [0, num_pages).
"""
import triton
import triton.language as tl

from evenflow.attention.kernels import _scales, _scores, _softmax_pv_step

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _f16_rows(b_q, b_rs):
    """bf16 rows as exact f16 MMA operands for an fp8 cache: each row scaled by a power of two that puts its max |q|
    in (2^13, 2^14] (no overflow, no subnormals within 2^-24 of the max), the scale moved into the score scale."""
    b_qf = b_q.to(tl.float32)
    b_qmax = tl.max(tl.abs(b_qf), axis=1)
    b_e = tl.where(b_qmax > 0.0, tl.ceil(tl.log2(tl.where(b_qmax > 0.0, b_qmax, 1.0))) - 14.0, 0.0)
    b_e = tl.minimum(tl.maximum(b_e, -100.0), 114.0)
    return (b_qf * tl.exp2(-b_e)[:, None]).to(tl.float16), b_rs * tl.exp2(b_e)


@triton.jit
def _zero_rows(r_start, r_end, p_out, p_lse, hq, stride_ot, stride_oh, stride_lt,
               D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LSE: tl.constexpr):
    """Zeros (and LSE -inf) to head ``hq`` of rows [r_start, r_end), the grid's row-block programs taking turns."""
    o_d = tl.arange(0, D)
    for r0 in range(r_start + tl.program_id(1) * BLOCK_M, r_end, tl.num_programs(1) * BLOCK_M):
        o_r = r0 + tl.arange(0, BLOCK_M)
        m_r = o_r < r_end
        tl.store(p_out + o_r.to(tl.int64)[:, None] * stride_ot + hq * stride_oh + o_d[None, :],
                 tl.zeros([BLOCK_M, D], dtype=tl.bfloat16), mask=m_r[:, None])
        if HAS_LSE:
            tl.store(p_lse + o_r.to(tl.int64) * stride_lt + hq, tl.zeros([BLOCK_M], dtype=tl.float32)
                     - float("inf"), mask=m_r)


@triton.jit
def _kv_step(b_q, b_rs, b_vis, n0, n_end, b_m, b_l, b_acc, p_ptrow, p_k, p_v, h, num_pages,
             stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
             D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DOT_F32: tl.constexpr,
             MASKED: tl.constexpr, PAGE_STEPS: tl.constexpr):
    """One BLOCK_N-key step of the online softmax over keys [n0, n0 + BLOCK_N). ``MASKED``: the step may hold keys past
    ``n_end`` or keys some row must not see (``o_n >= b_vis``); unmasked steps are wholly visible to every row of the
    block, so they load and score without a mask. ``PAGE_STEPS``: a step lies in one page (PAGE a multiple of BLOCK_N;
    steps start at multiples of BLOCK_N), so one page id and contiguous rows; else a page id a key."""
    o_d = tl.arange(0, D)
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < n_end
    if PAGE_STEPS:  # n0 < n_end <= L <= max_pages * PAGE: the page table's entry is in bounds
        page = tl.minimum(tl.maximum(tl.load(p_ptrow + n0 // PAGE), 0), num_pages - 1).to(tl.int64)
        o_slot = n0 % PAGE + tl.arange(0, BLOCK_N)
        p_kr = p_k + page * stride_kp + o_slot * stride_kt + h * stride_kh
        p_vr = p_v + page * stride_vp + o_slot * stride_vt + h * stride_vh
    else:
        if MASKED:
            b_page = tl.load(p_ptrow + o_n // PAGE, mask=m_n, other=0)
        else:
            b_page = tl.load(p_ptrow + o_n // PAGE)
        b_page = tl.minimum(tl.maximum(b_page, 0), num_pages - 1).to(tl.int64)
        o_slot = o_n % PAGE
        p_kr = p_k + b_page * stride_kp + o_slot * stride_kt + h * stride_kh
        p_vr = p_v + b_page * stride_vp + o_slot * stride_vt + h * stride_vh
    if MASKED:
        b_k = tl.load(p_kr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(p_vr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_s = _scores(b_q, tl.trans(b_k), False, KV_FP8, DOT_F32) * b_rs[:, None]
        b_s = tl.where((o_n[None, :] < b_vis[:, None]) & m_n[None, :], b_s, float("-inf"))
    else:
        b_k = tl.load(p_kr[:, None] + o_d[None, :])
        b_v = tl.load(p_vr[:, None] + o_d[None, :])
        b_s = _scores(b_q, tl.trans(b_k), False, KV_FP8, DOT_F32) * b_rs[:, None]
    return _softmax_pv_step(b_s, b_v, b_m, b_l, b_acc, 1, KV_FP8, DOT_F32)


@triton.jit
def prefill_attention_kernel(
    p_q, p_k, p_v, p_cu, p_pt, p_sl, p_out, p_lse, p_ks, p_vs,
    qk_scale, v_scale_f, T, B, num_pages, max_pages,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, HAS_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, SPLIT: tl.constexpr = False, HEADS: tl.constexpr = 1,
):
    """``SPLIT``: each block's keys in two loops, those every row of the block sees (no mask, one page id a step where
    the page size allows) and then the diagonal's steps (masked). The grid is (requests + 1, row-block slots, q heads
    / HEADS). ``HEADS``: a program takes HEADS consecutive q heads of one KV head, and a block's BLOCK_M rows are
    HEADS heads x R = BLOCK_M / HEADS new rows (row r: head hq + r // R, hq the block's first head; the block's
    (r % R)-th new row), so short chunks fill the MMA's rows and load each K / V step once for HEADS heads."""
    R: tl.constexpr = BLOCK_M // HEADS  # a block's new rows (of each of its heads)
    b = tl.program_id(0)
    hq = tl.program_id(2).to(tl.int64) * HEADS  # the block's first q head
    if b == B:  # the rows no request owns: before cu[0] and past cu[B]
        first = tl.minimum(tl.maximum(tl.load(p_cu), 0), T)
        for i in tl.static_range(HEADS):
            _zero_rows(0, first, p_out, p_lse, hq + i, stride_ot, stride_oh, stride_lt, D, BLOCK_M, HAS_LSE)
        last = tl.minimum(tl.maximum(tl.load(p_cu + B), first), T)
        for i in tl.static_range(HEADS):
            _zero_rows(last, T, p_out, p_lse, hq + i, stride_ot, stride_oh, stride_lt, D, BLOCK_M, HAS_LSE)
    else:
        h = hq // GROUP  # (int64, as hq: head offsets of a large strided view; HEADS divides GROUP)
        c1 = tl.minimum(tl.maximum(tl.load(p_cu + b + 1), 0), T)
        c0 = tl.minimum(tl.maximum(tl.load(p_cu + b), 0), c1)
        n = c1 - c0
        L = tl.minimum(tl.maximum(tl.load(p_sl + b), 0), max_pages * PAGE)
        prefix = L - n
        rs, vs = _scales(qk_scale, v_scale_f, p_ks, p_vs, K_SCALE_T, V_SCALE_T)
        o_d = tl.arange(0, D)
        p_ptrow = p_pt + b.to(tl.int64) * stride_ptb
        PAGE_STEPS: tl.constexpr = SPLIT and (PAGE % BLOCK_N == 0)
        for mb in range(tl.program_id(1), (n + R - 1) // R, tl.num_programs(1)):
            if HEADS == 1:  # (a scalar head: one head offset for the block's rows)
                o_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
                o_h = hq
            else:  # row r: head hq + r // R, new row mb * R + r % R
                o_m = mb * R + tl.arange(0, BLOCK_M) % R
                o_h = hq + tl.arange(0, BLOCK_M) // R
            m_row = o_m < n
            p_qrow = p_q + (c0 + o_m).to(tl.int64) * stride_qt + o_h * stride_qh
            b_q = tl.load(p_qrow[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)
            b_rs = tl.zeros([BLOCK_M], dtype=tl.float32) + rs
            if KV_FP8:
                b_q, b_rs = _f16_rows(b_q, b_rs)
            b_vis = prefix + o_m + 1  # keys [0, vis) of each row (<= 0: none)
            n_end = tl.minimum(L, prefix + (mb + 1) * R)  # the block's last row's
            b_m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
            b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
            n_full = 0  # (a constant 0 without SPLIT: the record's one masked loop)
            if SPLIT:
                # keys [0, prefix + mb * R + 1) are seen by the block's first row, and so by every row; they end at
                # or before L (the first row is a real row: mb * R < n), and at or before n_end
                n_full = tl.maximum(prefix + mb * R + 1, 0) // BLOCK_N * BLOCK_N
                for n0 in range(0, n_full, BLOCK_N):
                    b_m, b_l, b_acc = _kv_step(b_q, b_rs, b_vis, n0, n_end, b_m, b_l, b_acc, p_ptrow, p_k, p_v, h,
                                               num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                               stride_vh, D, PAGE, BLOCK_N, KV_FP8, DOT_F32, False, PAGE_STEPS)
            for n0 in range(n_full, n_end, BLOCK_N):
                b_m, b_l, b_acc = _kv_step(b_q, b_rs, b_vis, n0, n_end, b_m, b_l, b_acc, p_ptrow, p_k, p_v, h,
                                           num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                           stride_vh, D, PAGE, BLOCK_N, KV_FP8, DOT_F32, True, PAGE_STEPS)
            seen = b_l > 0.0
            b_o = b_acc * (vs / tl.where(seen, b_l, 1.0))[:, None]
            p_orow = p_out + (c0 + o_m).to(tl.int64) * stride_ot + o_h * stride_oh
            tl.store(p_orow[:, None] + o_d[None, :], b_o.to(tl.bfloat16), mask=m_row[:, None])
            if HAS_LSE:  # log2 domain inside: natural log out
                b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * LN2, float("-inf"))
                tl.store(p_lse + (c0 + o_m).to(tl.int64) * stride_lt + o_h, b_lse, mask=m_row)
