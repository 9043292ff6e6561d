"""Gluon kernel of paged decode attention over an fp8 e4m3 KV cache: one warp per program.

Gluon is Triton's lower-level language (``triton.experimental.gluon``, in the Triton wheel):
layouts, shared memory and the MMA are written out instead of inferred. It is used here for
one reason, measured in round AB (docs/perf-notes/decode.md): the fp8 loop of
:mod:`evenflow.attention.kernels` converts each e4m3 tile in registers and Triton-lang then
moves the converted V (and P) back through shared memory to reach the MMA's operand layout,
with cross-warp softmax reductions every step; that loop ran at ~0.7 us per 64-token tile per
SM for every change tried in rounds F-M. Here nothing converted goes back to shared memory:

* K, the B operand of S = q K^T (contraction over d): each thread loads 32 contiguous d-bytes
  of a token (two 16-byte shared loads). The contraction index is permuted (q by the same
  permutation, ``_phys_k``), so the converted registers are ``mma.sync``'s B fragments as they
  are (the reshape / permute below only relabels them: the ``convert_layout`` is trivial).
* V, the B operand of O = P V (contraction over tokens): each thread loads 16 contiguous
  d-bytes of each of its tokens. The output columns are permuted (``_phys_v``, undone at the
  store), so after the conversion only an in-thread re-pairing of two tokens' values is left.
* P stays in registers: the accumulator layout of S is the A operand layout of P V.
* One warp per program: no cross-warp max or sum; a one-warp barrier guards the cp.async ring.

Scope (``decode.gluon_fp8_supported`` says where it runs; the Triton kernel runs everywhere
else): the plan path, fp8 K/V with per-tensor scales, bf16 q (scaled to f16 per row by a power
of two, as the Triton kernel does), head_dim 128, page size 64 or 128, GQA group x q_len <= 16.
It follows the plan contract of :mod:`evenflow.attention.kernels` (bins, finished items in
place, split chunks in partial slots ``2p`` / ``2p + 1``); split items are merged by
``kernels.combine_kernel`` after it. No torch logic here.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

TILE = gl.constexpr(64)
D = gl.constexpr(128)
LN2 = gl.constexpr(0.6931471805599453)

# mma.sync m16n8k16 on one warp: S [16 rows, 64 tokens] and O [16 rows, 128 columns]
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
LA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
LB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# cp.async of a [64 tokens, 128 d] byte tile: 16 bytes a thread, 4 rows x 8 chunks a warp instruction
CP = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0]))
# 16-byte chunks XOR-swizzled by row: the loads below read 8 chunks of 4 rows (V) or 4 chunks of
# 8 rows (K) per instruction, 4 wavefronts for 512 bytes either way
SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))
# K tile [64 tok, 128 d] as loaded: registers d bits 0-4 (32 contiguous bytes), token bits 3-5;
# lanes d bits 5-6, token bits 0-2: mma B's register / lane split once d is read through _phys_k
LK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[64, 128]))
# V tile [64 tok, 128 d] as loaded: registers d bits 0-3 (16 contiguous bytes), token bits 0, 3-5;
# lanes token bits 1-2, d bits 4-6: mma B's lanes once the columns are read through _phys_v
LV = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[], block_bases=[], shape=[64, 128]))


@gluon.jit
def _phys_k(k):
    # head-dim column of contraction index k (q and K): d0 = k0, d1 = k3, d2-d4 = k4-k6, d5-d6 = k1-k2
    return (k & 1) | (((k >> 3) & 1) << 1) | (((k >> 4) & 7) << 2) | (((k >> 1) & 3) << 5)


@gluon.jit
def _phys_v(n):
    # head-dim column of output column n (V and O): d0-d3 = n3-n6, d4-d6 = n0-n2
    return (n >> 3) | ((n & 7) << 4)


@gluon.jit
def _issue(k_s, v_s, buf, t, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
           stride_vp, stride_vt, stride_vh, PAGE: gl.constexpr):
    """cp.async of tile t's K and V rows into ring slot ``buf`` (one commit group). Rows past the
    item's length and tiles past the chunk (t >= t1) are zero-filled, never read from memory."""
    live = t < t1
    page = gl.load(p_ptrow + (t * TILE) // PAGE, mask=live, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
    o_t = gl.arange(0, TILE, layout=gl.SliceLayout(1, CP))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, CP))
    row = (t * TILE) % PAGE + o_t
    m = (live & (t * TILE + o_t < L))[:, None] & (o_d < D)[None, :]
    pk = p_k + (page * stride_kp + h * stride_kh) + row[:, None] * stride_kt + o_d[None, :]
    pv = p_v + (page * stride_vp + h * stride_vh) + row[:, None] * stride_vt + o_d[None, :]
    cp.async_copy_global_to_shared(k_s.index(buf), pk, mask=m)
    cp.async_copy_global_to_shared(v_s.index(buf), pv, mask=m)
    cp.commit_group()


@gluon.jit
def _attend_chunk(k_s, v_s, b, h, t0, t1, L, is_final, slot,
                  p_q, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse, qk_scale, v_scale, num_pages,
                  stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                  stride_ptb, stride_ot, stride_oh, stride_lt,
                  GROUP: gl.constexpr, Q_LEN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LSE: gl.constexpr):
    """Online softmax of item (b, h)'s tiles [t0, t1); finish in place or write partial ``slot``."""
    ROWS: gl.constexpr = GROUP * Q_LEN
    # q, logical [16 rows, 128 contraction] in the A layout (rows >= ROWS zero), to f16 under a
    # per-row power of two that puts the row's max |q| in (2^13, 2^14] (undone in the score scale)
    o_m = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
    o_k = gl.arange(0, D, layout=gl.SliceLayout(0, LA))
    m_row = o_m < ROWS
    i_tok = b * Q_LEN + o_m // GROUP
    i_head = h * GROUP + o_m % GROUP
    pq = p_q + (i_tok.to(gl.int64) * stride_qt + i_head * stride_qh)[:, None] + _phys_k(o_k)[None, :]
    qf = gl.load(pq, mask=m_row[:, None] & (o_k < D)[None, :], other=0.0).to(gl.float32)
    qmax = gl.max(gl.abs(qf), axis=1)
    e = gl.where(qmax > 0.0, gl.ceil(gl.log2(gl.where(qmax > 0.0, qmax, 1.0))) - 14.0, 0.0)
    e = gl.minimum(gl.maximum(e, -100.0), 114.0)
    q_a = (qf * gl.exp2(-e)[:, None]).to(gl.float16)
    rs = gl.convert_layout(qk_scale * gl.exp2(e), gl.SliceLayout(1, MMA))
    # row m = r * GROUP + g sees the item's first L - Q_LEN + r + 1 tokens
    o_r = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    vis = L - Q_LEN + o_r // GROUP + 1

    p_ptrow = p_pt + b.to(gl.int64) * stride_ptb
    for s in gl.static_range(STAGES - 1):
        _issue(k_s, v_s, s, t0 + s, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
               stride_vp, stride_vt, stride_vh, PAGE)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.full([16], 0.0, gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([16, D], gl.float32, layout=MMA)
    o_tok = gl.arange(0, TILE, layout=gl.SliceLayout(0, MMA))
    for t in range(t0, t1):
        j = t - t0
        _issue(k_s, v_s, (j + STAGES - 1) % STAGES, t + STAGES - 1, t1, L, p_k, p_v, p_ptrow, h, num_pages,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE)
        cp.wait_group(STAGES - 1)
        gl.thread_barrier()
        buf = j % STAGES
        kf = k_s.index(buf).load(LK).to(gl.float16)
        kt = gl.reshape(gl.permute(kf, [1, 0]), [4, 2, 2, 2, 2, 2, TILE])
        kt = gl.convert_layout(gl.reshape(gl.permute(kt, [1, 2, 3, 4, 0, 5, 6]), [D, TILE]), LB, assert_trivial=True)
        sc = mma_v2(q_a, kt, gl.zeros([16, TILE], gl.float32, layout=MMA))
        sc = gl.where((t * TILE + o_tok)[None, :] < vis[:, None], sc * rs[:, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        vf = v_s.index(buf).load(LV).to(gl.float16)
        vl = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(vf, [TILE, 8, 16]), [0, 2, 1]), [TILE, D]), LB)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), LA), vl, acc * alpha[:, None])
        m_i = m_new
        gl.thread_barrier()  # every lane is done with slot `buf` before the next issue refills it
    cp.wait_group(0)  # the tail's zero-fill copies land before the next chunk reuses the ring
    gl.thread_barrier()

    live = l_i > 0.0
    b_o = gl.where(live[:, None], acc * (v_scale / gl.where(live, l_i, 1.0))[:, None], 0.0)
    lse2 = gl.where(live, m_i + gl.log2(gl.where(live, l_i, 1.0)), float("-inf"))
    o_n = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
    m_out = o_r < ROWS
    col = _phys_v(o_n)
    if is_final:
        o_tok_r = b * Q_LEN + o_r // GROUP
        o_head = h * GROUP + o_r % GROUP
        po = p_out + (o_tok_r.to(gl.int64) * stride_ot + o_head * stride_oh)[:, None] + col[None, :]
        gl.store(po, b_o.to(gl.bfloat16), mask=m_out[:, None] & (o_n < D)[None, :])
        if HAS_LSE:
            gl.store(p_lse + o_tok_r.to(gl.int64) * stride_lt + o_head, lse2 * LN2, mask=m_out)
    else:
        o_prow = slot.to(gl.int64) * ROWS + o_r
        gl.store(p_po + o_prow[:, None] * D + col[None, :], b_o, mask=m_out[:, None] & (o_n < D)[None, :])
        gl.store(p_plse + o_prow, lse2, mask=m_out)


@gluon.jit
def decode_fp8_kernel(
    p_q, p_k, p_v, p_pt, p_len, p_tiles, p_req_end, p_prog_start, p_meta,
    p_out, p_lse, p_po, p_plse, p_ks, p_vs,
    qk_scale_f, v_scale_f, B, max_len, num_pages,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    HKV: gl.constexpr, GROUP: gl.constexpr, Q_LEN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
    HAS_K_SCALE_PTR: gl.constexpr, HAS_V_SCALE_PTR: gl.constexpr, HAS_LSE: gl.constexpr,
):
    """Persistent plan program (one warp): drain bin ``pid`` of the plan (see
    ``kernels.decode_kernel``'s walk: the items that start inside the bin, zero-tile items on its
    end edge included). ``qk_scale_f`` = sm_scale * log2(e) * python k_scale; ``max_len`` caps
    every length (min of the plan's max_seq_len and the page table's columns x PAGE)."""
    pid = gl.program_id(0)
    qk_scale = qk_scale_f
    if HAS_K_SCALE_PTR:
        qk_scale = qk_scale * gl.load(p_ks)
    v_scale = v_scale_f
    if HAS_V_SCALE_PTR:
        v_scale = v_scale * gl.load(p_vs)
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE, D], SMEM)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE, D], SMEM)
    total = gl.load(p_meta + 0)
    budget = gl.load(p_meta + 1)
    g0 = pid * budget
    g1 = gl.minimum(g0 + budget, total)
    n_items = B * HKV
    i = gl.load(p_prog_start + pid)
    b = gl.minimum(i, n_items - 1) // HKV
    n = gl.load(p_tiles + b)
    start = gl.load(p_req_end + b) - (HKV - i % HKV) * n
    go = (i < n_items) & ((start < g1) | ((start == g1) & (n == 0)))
    while go:
        h = i % HKV
        len_b = gl.load(p_len + b)
        # unit u of the item is its tile u; units past its last tile (item_cost) hold no tokens
        L = gl.minimum(gl.minimum(gl.maximum(len_b, 0), max_len), n * TILE)
        t0 = gl.maximum(start, g0) - start
        t1 = gl.minimum(gl.minimum(start + n, g1) - start, (L + TILE - 1) // TILE)
        is_final = (start >= g0) & (start + n <= g1)
        slot = 2 * pid + (start >= g0).to(gl.int32)
        _attend_chunk(k_s, v_s, b, h, t0, t1, L, is_final, slot,
                      p_q, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse, qk_scale, v_scale, num_pages,
                      stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                      stride_ptb, stride_ot, stride_oh, stride_lt, GROUP, Q_LEN, PAGE, STAGES, HAS_LSE)
        i += 1
        b = gl.minimum(i, n_items - 1) // HKV
        n = gl.load(p_tiles + b)
        start = gl.load(p_req_end + b) - (HKV - i % HKV) * n
        go = (i < n_items) & ((start < g1) | ((start == g1) & (n == 0)))
