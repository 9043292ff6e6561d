"""Triton kernel of paged prefill / extend attention (pure ``@triton.jit`` code; the launcher is ``prefill.py``).

A program takes one query head of one request and walks that request's blocks of BLOCK_M new rows (block
``program_id(1)``, then every ``num_programs(1)``-th: the grid's second dimension is a bound from the host, and a
request with more rows than it covers is still computed whole; requests are the first dimension, which CUDA allows
up to 2^31 - 1). For each block it streams the request's keys in
BLOCK_N steps up to the block's last visible key, gathering each step's pages through the page table, with the
online softmax of the decode kernel (``kernels._scores`` / ``_softmax_pv_step``: bf16 MMAs for a bf16 cache, f16
MMAs of the exact e4m3 values for an fp8 one). Row i of a request with n new rows and L cached tokens (new ones
included) sees keys [0, L - n + i + 1). The grid's extra request (``program_id(0) == B``) writes zeros (and LSE
-inf) to the rows no request owns: past ``cu_seqlens_q[B]`` (padding) and before ``cu_seqlens_q[0]``.

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
def prefill_attention_kernel(
    p_q, p_k, p_v, p_cu, p_pt, p_sl, p_out, p_lse, p_ks, p_vs,
    qk_scale, v_scale_f, T, B, num_pages, max_pages,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, K_SCALE_T: tl.constexpr, V_SCALE_T: tl.constexpr, HAS_LSE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(2).to(tl.int64)
    if b == B:  # the rows no request owns: before cu[0] and past cu[B]
        first = tl.minimum(tl.maximum(tl.load(p_cu), 0), T)
        _zero_rows(0, first, p_out, p_lse, hq, stride_ot, stride_oh, stride_lt, D, BLOCK_M, HAS_LSE)
        last = tl.minimum(tl.maximum(tl.load(p_cu + B), first), T)
        _zero_rows(last, T, p_out, p_lse, hq, stride_ot, stride_oh, stride_lt, D, BLOCK_M, HAS_LSE)
    else:
        h = hq // GROUP  # (int64, as hq: head offsets of a large strided view)
        c1 = tl.minimum(tl.maximum(tl.load(p_cu + b + 1), 0), T)
        c0 = tl.minimum(tl.maximum(tl.load(p_cu + b), 0), c1)
        n = c1 - c0
        L = tl.minimum(tl.maximum(tl.load(p_sl + b), 0), max_pages * PAGE)
        prefix = L - n
        rs, vs = _scales(qk_scale, v_scale_f, p_ks, p_vs, K_SCALE_T, V_SCALE_T)
        o_d = tl.arange(0, D)
        p_ptrow = p_pt + b.to(tl.int64) * stride_ptb
        for mb in range(tl.program_id(1), (n + BLOCK_M - 1) // BLOCK_M, tl.num_programs(1)):
            o_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            m_row = o_m < n
            p_qrow = p_q + (c0 + o_m).to(tl.int64) * stride_qt + hq * stride_qh
            b_q = tl.load(p_qrow[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)
            b_rs = tl.zeros([BLOCK_M], dtype=tl.float32) + rs
            if KV_FP8:
                b_q, b_rs = _f16_rows(b_q, b_rs)
            b_vis = prefix + o_m + 1  # keys [0, vis) of each row (<= 0: none)
            n_end = tl.minimum(L, prefix + (mb + 1) * BLOCK_M)  # the block's last row's
            b_m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
            b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
            for n0 in range(0, n_end, BLOCK_N):
                o_n = n0 + tl.arange(0, BLOCK_N)
                m_n = o_n < n_end
                b_page = tl.load(p_ptrow + o_n // PAGE, mask=m_n, other=0)
                b_page = tl.minimum(tl.maximum(b_page, 0), num_pages - 1).to(tl.int64)
                o_slot = o_n % PAGE
                p_kr = p_k + b_page * stride_kp + o_slot * stride_kt + h * stride_kh
                p_vr = p_v + b_page * stride_vp + o_slot * stride_vt + h * stride_vh
                b_k = tl.load(p_kr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
                b_v = tl.load(p_vr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
                b_s = _scores(b_q, tl.trans(b_k), False, KV_FP8, DOT_F32) * b_rs[:, None]
                b_s = tl.where((o_n[None, :] < b_vis[:, None]) & m_n[None, :], b_s, float("-inf"))
                b_m, b_l, b_acc = _softmax_pv_step(b_s, b_v, b_m, b_l, b_acc, 1, KV_FP8, DOT_F32)
            seen = b_l > 0.0
            b_o = b_acc * (vs / tl.where(seen, b_l, 1.0))[:, None]
            p_orow = p_out + (c0 + o_m).to(tl.int64) * stride_ot + hq * stride_oh
            tl.store(p_orow[:, None] + o_d[None, :], b_o.to(tl.bfloat16), mask=m_row[:, None])
            if HAS_LSE:  # log2 domain inside: natural log out
                b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * LN2, float("-inf"))
                tl.store(p_lse + (c0 + o_m).to(tl.int64) * stride_lt + hq, b_lse, mask=m_row)
