"""Gluon kernel of paged decode attention over an fp8 e4m3 KV cache: 1, 2 or 4 warps per program (4: the warpgroup
form for an fp8 q, below).

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
* No cross-warp max or sum inside the tile loop: each of a program's ``WARPS`` warps (``DecodePlan.gluon_warps``)
  takes its 64 / WARPS tokens of every tile with its own online softmax (round AL: at one warp a program, the
  loop's dependency chain set the pace of short items and tails), and the warps' states are merged once per
  chunk; a CTA barrier guards the cp.async ring.

Scope (``decode.gluon_fp8_supported`` says where it runs; the Triton kernel runs everywhere
else): the plan path, fp8 K/V with per-tensor scales, bf16 q (scaled to f16 per row by a power
of two, as the Triton kernel does) or, where ``decode.GLUON_FP8_Q`` lets it, fp8 q with its per-token-per-head
scale folded into the row's score scale, head_dim 128, page size 64 or 128, GQA group x q_len <= 16.
It follows the plan contract of :mod:`evenflow.attention.kernels` (bins, finished items in
place, split chunks in partial slots ``2p`` / ``2p + 1``). Split items are merged as the
Triton kernel's fused combine does (``FUSED``: the last chunk of each group of ``FUSED_C`` to
finish merges the group, the last group the item, in a fixed order, counters reset by their
last arriver), or by ``kernels.combine_kernel`` after it (``DecodePlan(combine="kernel")``).
No torch logic here.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from evenflow._kernels.common import arrived_last, clock64, globaltimer_ns
from evenflow.attention import kernels as K

TILE = gl.constexpr(64)
D = gl.constexpr(128)
LN2 = gl.constexpr(0.6931471805599453)

# The program's W warps (``WARPS``: 1, 2 or 4; at 4 programs an SM of 4 warps, 16 warps an SM leave a thread at most
# 128 registers (at 2, the one-KV-head count since round AV, no cap since round AW: plan.gluon_wg_max_regs), and the
# scores are the warpgroup form's, below) split every 64-token tile: warp w takes its tokens [w * TW, (w + 1) * TW),
# TW = 64 / W, with its own online softmax (max, sum, output), merged once per chunk. Every per-tile tensor has a
# leading warp dimension of size W (the warp bases of its layout), so the MMAs are batched over the warps: each warp's
# work is a one-warp program's on fewer tokens, and no value crosses warps inside the tile loop. The
# layouts below are built for a given W.


@gluon.constexpr_function
def _warp_bases(W, rank):
    # the leading dimension (size W) over the warps
    return [[1 << i] + [0] * (rank - 1) for i in range(W.bit_length() - 1)]


@gluon.constexpr_function
def _mma(W):
    # mma.sync m16n8k16 batched over the warps: S [W, 16 rows, TW tokens], O [W, 16 rows, 128 columns] (the
    # warpgroup form: S^T [4, 16 tokens, 8 rows], O^T [4, 128 columns, 8 rows])
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _operand(W, index):
    return gl.DotOperandLayout(operand_index=index, parent=_mma(W), k_width=2)


@gluon.constexpr_function
def _cp(W):
    # cp.async of a tile [W, TW tokens, 128 d] bytes: 16 bytes a thread, 4 rows x 8 chunks a warp
    # instruction, warp w copying the rows it will read
    return gl.BlockedLayout([1, 1, 16], [1, 4, 8], [W, 1, 1], [2, 1, 0])


# 16-byte chunks XOR-swizzled by row: the loads below read 8 chunks of 4 rows (V) or 4 chunks of
# 8 rows (K) per instruction, 4 wavefronts for 512 bytes either way
SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[2, 1, 0]))


@gluon.constexpr_function
def _tile_layout(W, reg_bases, lane_bases):
    # a K or V tile [W, TW tokens, 128 d] as loaded: the given register and lane bases, then the token bits from 3
    # up in registers (as many as TW = 64 / W has), the leading dimension over the warps
    tw = 64 // W
    return gl.DistributedLinearLayout(
        reg_bases=reg_bases + [[0, b, 0] for b in (8, 16, 32) if b < tw], lane_bases=lane_bases,
        warp_bases=_warp_bases(W, 3), block_bases=[], shape=[W, tw, 128])


@gluon.constexpr_function
def _lk(W):
    # K: registers d bits 0-4 (32 contiguous bytes); lanes d bits 5-6, token bits 0-2: mma B's register / lane
    # split once d is read through _phys_k
    return _tile_layout(W, [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
                        [[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]])


@gluon.constexpr_function
def _lv(W):
    # V: registers d bits 0-3 (16 contiguous bytes) and token bit 0; lanes token bits 1-2, d bits 4-6: mma B's
    # lanes once the columns are read through _phys_v
    return _tile_layout(W, [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0]],
                        [[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]])


@gluon.constexpr_function
def _ml(W, rows):
    # fused combine: blocks of partials of 16 bytes a thread and row, 32 / W fp32 a thread a chunk: [8 rows,
    # 128 columns] where the item has at most 8 rows (one pass over the head dim), else [16, 64] (two);
    # the warps split the rows
    if rows <= 8:
        return gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    return gl.BlockedLayout([1, 4], [2, 16], [W, 1], [1, 0])


@gluon.constexpr_function
def _ll(W, rows, nb):
    # the LSEs of a merge batch, [8 or 16 chunks (``nb`` padded), rows]: at 8 chunks and 1-2 warps all in every
    # thread's registers; at 4 warps (the warpgroup form: at most 128 registers a thread at 4 programs an SM) or 12
    # chunks a thread holds one row's chunks
    if W == 4 or nb > 8:
        return gl.BlockedLayout([8 if nb <= 8 else 16, 1], [1, 32], [1, W], [1, 0])
    return gl.BlockedLayout([8, 8 if rows <= 8 else 16], [1, 32], [1, W], [1, 0])


@gluon.constexpr_function
def _lsum(W):
    # the W warps' weighted outputs [W, 16 rows (8 in the warpgroup form), 128] read back from shared memory, a
    # thread holding every warp's value of its 4 columns: the sum over the warps is in registers
    return gl.BlockedLayout([W, 1, 4], [1, 2, 16], [1, W, 1], [2, 1, 0])


# the warps' outputs [W, 16, 128] fp32 ([4, 8, 128] at W = 4) after a chunk: 16-byte chunks XOR-swizzled by row, so
# the MMA layout's stores (8 rows, 4 columns a warp instruction) spread over the banks
OSTAGE = gl.constexpr(gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[2, 1, 0]))

# a merge batch's outputs in the idle K / V ring: [2 chunks, rows, columns] fp32 a ring slot, each
# thread reading back the 16-byte pieces it copied (no swizzle needed: a warp reads 512 contiguous bytes)
STAGE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

# The warpgroup form (``WARPS`` 4, round AR: fp8 q, GQA group x q_len <= WG_N): the scores of a tile as
# S^T = K q^T on one warpgroup MMA (``wgmma``, e4m3 x e4m3 from shared memory, no conversion), K's ring slots and q
# in 128-byte-swizzled shared memory; warp w's accumulator rows are the tile's tokens [16 w, 16 w + 16), so each
# warp keeps its online softmax over those 16 tokens, and O^T += V^T P^T by ``mma.sync`` per warp (V converted in
# registers as above, read through ``_lv``: its registers are V^T's A fragment; P^T from the S^T fragment).
WG_N = gl.constexpr(8)  # wgmma's N: the rows of q a KV head (padded to 8)
# K's ring slots ([slots, 64, 128]: the layout of one slot, rank 2) and q [8, 128]
KQ_SW = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
# cp.async of a K tile [64 tokens, 128 d] into the swizzled slot, and q [8 rows, 128 d]: 16 bytes a thread
CPK = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
WG_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32]))


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
           stride_vp, stride_vt, stride_vh, PAGE: gl.constexpr, W: gl.constexpr, WG: gl.constexpr):
    """cp.async of tile t's K and V rows into ring slot ``buf`` (one commit group). Rows past the
    item's length and tiles past the chunk (t >= t1) are zero-filled, never read from memory. ``WG``: the
    warpgroup form's K slot (swizzled for ``wgmma``)."""
    TW: gl.constexpr = TILE // W
    CP: gl.constexpr = _cp(W)
    live = t < t1
    page = gl.load(p_ptrow + (t * TILE) // PAGE, mask=live, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
    o_w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, CP)))
    o_t = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(2, CP)))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP)))
    tok = o_w[:, None] * TW + o_t[None, :]  # [W, TW]: the tile's token of each row
    row = ((t * TILE) % PAGE + tok)[:, :, None]
    m = (live & (t * TILE + tok < L))[:, :, None] & (o_d < D)[None, None, :]
    if WG:  # K as wgmma reads it: the slot [64 tokens, 128 d], 128-byte swizzled
        k_t = gl.arange(0, TILE, layout=gl.SliceLayout(1, CPK))
        k_d = gl.arange(0, D, layout=gl.SliceLayout(0, CPK))
        k_m = (live & (t * TILE + k_t < L))[:, None] & (k_d < D)[None, :]
        pk = (p_k + (page * stride_kp + h * stride_kh) + ((t * TILE) % PAGE + k_t)[:, None] * stride_kt
              + k_d[None, :])
        cp.async_copy_global_to_shared(k_s.index(buf), pk, mask=k_m)
    else:
        pk = p_k + (page * stride_kp + h * stride_kh) + row * stride_kt + o_d[None, None, :]
        cp.async_copy_global_to_shared(k_s.index(buf), pk, mask=m)
    pv = p_v + (page * stride_vp + h * stride_vh) + row * stride_vt + o_d[None, None, :]
    cp.async_copy_global_to_shared(v_s.index(buf), pv, mask=m)
    cp.commit_group()


@gluon.jit
def _deep(t0, t1, SHORT_TILES: gl.constexpr):
    """Whether chunk [t0, t1) runs on the whole ring, STAGES - 1 tiles ahead (else on its first STAGES - 1 slots, a
    tile fewer ahead): every chunk where SHORT_TILES is 0, else chunks of at most SHORT_TILES tiles
    (``DecodePlan.deep_ring_tiles``)."""
    if SHORT_TILES > 0:
        return t1 - t0 <= SHORT_TILES
    else:
        return True


@gluon.jit
def _issue_first(k_s, v_s, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                 stride_vp, stride_vt, stride_vh, PAGE: gl.constexpr, STAGES: gl.constexpr, W: gl.constexpr, deep,
                 WG: gl.constexpr):
    # a chunk's first STAGES - 1 tiles into ring slots 0 .. STAGES - 2 (STAGES - 2 where not ``deep``)
    for s in gl.static_range(STAGES - 1):
        if s < STAGES - 2:
            _issue(k_s, v_s, s, t0 + s, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                   stride_vp, stride_vt, stride_vh, PAGE, W, WG)
        elif deep:
            _issue(k_s, v_s, s, t0 + s, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                   stride_vp, stride_vt, stride_vh, PAGE, W, WG)


@gluon.jit
def _next_tile(k_s, v_s, t, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
               stride_vp, stride_vt, stride_vh, PAGE: gl.constexpr, RING: gl.constexpr, W: gl.constexpr,
               WG: gl.constexpr):
    """A tile loop's step t over [t0, t1) on the ring's first RING slots: issue tile t + RING - 1 into its slot, wait
    for tile t's copies and return its slot (tile t in slot (t - t0) % RING). In the warpgroup form (W = 4) each
    thread's copies are fenced before the barrier, since ``wgmma`` reads shared memory through the async proxy
    (``WG``)."""
    LOOK: gl.constexpr = RING - 1
    j = t - t0
    _issue(k_s, v_s, (j + LOOK) % RING, t + LOOK, t1, L, p_k, p_v, p_ptrow, h, num_pages,
           stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, W, WG)
    cp.wait_group(LOOK)
    if WG:
        fence_async_shared()
    gl.thread_barrier()
    return j % RING


@gluon.jit
def _softmax_step(s, m_i, l_i, AXIS: gl.constexpr):
    """One tile of the online softmax, per warp and q row: the scores ``s`` (log2 units, masked to -inf) reduced
    over their tokens' axis AXIS against the running max ``m_i`` and sum ``l_i``. Returns the new max, the old
    state's rescale ``alpha``, the tile's probabilities and the new sum (a row with no score yet keeps max -inf and
    gets zero probabilities, never NaN)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=AXIS))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, AXIS))
    return m_new, alpha, p, l_i * alpha + gl.sum(p, axis=AXIS)


@gluon.jit
def _tiles(k_s, v_s, q_a, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages,
           stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
           PAGE: gl.constexpr, RING: gl.constexpr, W: gl.constexpr):
    """The tile loop over [t0, t1) on the ring's first RING slots: tile t in slot (t - t0) % RING, RING - 1 tiles
    issued ahead of it."""
    TW: gl.constexpr = TILE // W
    MMA: gl.constexpr = _mma(W)
    LA: gl.constexpr = _operand(W, 0)
    LB: gl.constexpr = _operand(W, 1)
    for t in range(t0, t1):
        buf = _next_tile(k_s, v_s, t, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, PAGE, RING, W, False)
        kf = k_s.index(buf).load(_lk(W)).to(gl.float16)
        kt = gl.reshape(gl.permute(kf, [0, 2, 1]), [W, 4, 2, 2, 2, 2, 2, TW])
        kt = gl.convert_layout(gl.reshape(gl.permute(kt, [0, 2, 3, 4, 5, 1, 6, 7]), [W, D, TW]), LB,
                               assert_trivial=True)
        sc = mma_v2(q_a, kt, gl.zeros([W, 16, TW], gl.float32, layout=MMA))
        sc = gl.where(t * TILE + tok < vis[None, :, None], sc * rs[:, :, None], float("-inf"))
        m_new, alpha, p, l_i = _softmax_step(sc, m_i, l_i, 2)
        vf = v_s.index(buf).load(_lv(W)).to(gl.float16)
        vl = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(vf, [W, TW, 8, 16]), [0, 1, 3, 2]), [W, TW, D]), LB)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), LA), vl, acc * alpha[:, :, None])
        m_i = m_new
        gl.thread_barrier()  # every lane is done with slot `buf` before the next issue refills it
    return m_i, l_i, acc


@gluon.jit
def _tiles_wg(k_s, v_s, q_s, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages,
              stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
              PAGE: gl.constexpr, RING: gl.constexpr):
    """The warpgroup form's tile loop (see ``_tiles``): per tile S^T [64 tokens, 8 rows] = K q^T on ``wgmma``,
    seen per warp as [4 warps, 16 tokens, 8 rows]; each warp's softmax over its 16 tokens; O^T [4, 128, 8] += V^T
    P^T per warp."""
    W: gl.constexpr = 4
    TW: gl.constexpr = TILE // W
    MMA: gl.constexpr = _mma(W)
    LA: gl.constexpr = _operand(W, 0)
    LB: gl.constexpr = _operand(W, 1)
    for t in range(t0, t1):
        buf = _next_tile(k_s, v_s, t, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, PAGE, RING, W, True)
        st = warpgroup_mma(k_s.index(buf), q_s.permute((1, 0)), gl.zeros([TILE, WG_N], gl.float32, layout=WG_ACC))
        st = gl.convert_layout(gl.reshape(st, [W, TW, WG_N]), MMA)
        st = gl.where(t * TILE + tok < vis[None, None, :], st * rs[None, None, :], float("-inf"))
        m_new, alpha, p, l_i = _softmax_step(st, m_i, l_i, 1)
        vf = v_s.index(buf).load(_lv(W)).to(gl.float16)
        vn = gl.reshape(gl.permute(gl.reshape(vf, [W, TW, 8, 16]), [0, 1, 3, 2]), [W, TW, D])  # columns n
        acc = mma_v2(gl.convert_layout(gl.permute(vn, [0, 2, 1]), LA), gl.convert_layout(p.to(gl.float16), LB),
                     acc * alpha[:, None, :])
        m_i = m_new
        gl.thread_barrier()  # every warp is done with slot `buf` (and q) before the next issue refills it
    return m_i, l_i, acc


@gluon.jit
def _tile_loop(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
               PAGE: gl.constexpr, RING: gl.constexpr, W: gl.constexpr, WG: gl.constexpr):
    """The tile loop of W warps on the ring's first RING slots: the warpgroup form's (``WG``; ``q_op``: q in shared
    memory), else the one, two or four warps' on ``mma.sync`` (``q_op``: q's MMA operand in registers)."""
    if WG:
        m_i, l_i, acc = _tiles_wg(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h,
                                  num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE,
                                  RING)
    else:
        m_i, l_i, acc = _tiles(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h,
                               num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE,
                               RING, W)
    return m_i, l_i, acc


@gluon.jit
def _attend_chunk(k_s, v_s, o_s, q_s, b, h, t0, t1, L, is_final, slot, issued,
                  p_q, p_qs, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse, qk_scale, v_scale, num_pages,
                  stride_qt, stride_qh, stride_qst, stride_qsh, stride_kp, stride_kt, stride_kh, stride_vp,
                  stride_vt, stride_vh, stride_ptb, stride_ot, stride_oh, stride_lt,
                  GROUP: gl.constexpr, Q_LEN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LSE: gl.constexpr, W: gl.constexpr, SHORT_TILES: gl.constexpr, HAS_Q_SCALE: gl.constexpr,
                  WG: gl.constexpr):
    """Online softmax of item (b, h)'s tiles [t0, t1); finish in place or write partial ``slot``.
    ``issued``: the chunk's first tiles are already in flight (:func:`_issue_first`, before the kernel's
    PDL wait: STAGES - 1 of them, STAGES - 2 on a chunk that runs a tile fewer ahead, ``_deep``). Each warp runs
    its own softmax over its TW tokens of every tile; the W states are merged after the last tile. In the warpgroup
    form (``WG``: 4 warps, an fp8 q, at most WG_N rows) q goes to ``q_s`` as it is and the tiles run ``_tiles_wg``."""
    ROWS: gl.constexpr = GROUP * Q_LEN
    NR: gl.constexpr = WG_N if WG else 16  # rows of the MMAs (ROWS padded)
    MMA: gl.constexpr = _mma(W)
    p_ptrow = p_pt + b.to(gl.int64) * stride_ptb
    if WG:
        # q [8 rows, 128 d] fp8 as given (rows >= ROWS zero) into q_s (the loop's last barrier: no warp reads it);
        # the row's score scale carries its q scale
        o_m = gl.arange(0, NR, layout=gl.SliceLayout(1, CPK))
        o_k = gl.arange(0, D, layout=gl.SliceLayout(0, CPK))
        i_tok = b * Q_LEN + o_m // GROUP
        i_head = h * GROUP + o_m % GROUP
        q_raw = gl.load(p_q + (i_tok.to(gl.int64) * stride_qt + i_head * stride_qh)[:, None] + o_k[None, :],
                        mask=(o_m < ROWS)[:, None] & (o_k < D)[None, :], other=0.0)
        RW: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, MMA))  # a row's value in [W, TW, NR]
        o_rw = gl.arange(0, NR, layout=RW)
        rs = gl.full([NR], 1.0, gl.float32, layout=RW) * qk_scale
        if HAS_Q_SCALE:
            rs = rs * gl.load(p_qs + (b * Q_LEN + o_rw // GROUP).to(gl.int64) * stride_qst
                              + (h * GROUP + o_rw % GROUP) * stride_qsh, mask=o_rw < ROWS, other=0.0)
        if not issued:
            _issue_first(k_s, v_s, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, PAGE, STAGES, W, _deep(t0, t1, SHORT_TILES), WG)
        q_s.store(q_raw)
        fence_async_shared()
        gl.thread_barrier()
        vis = L - Q_LEN + o_rw // GROUP + 1
        o_sw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        o_tok = gl.arange(0, TILE // W, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        tok = (o_sw[:, None] * (TILE // W) + o_tok[None, :])[:, :, None]  # [W, TW, 1]
        m_i = gl.full([W, NR], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.full([W, NR], 0.0, gl.float32, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([W, D, NR], gl.float32, layout=MMA)  # O^T a warp
        q_op = q_s
    else:
        TW: gl.constexpr = TILE // W
        LA: gl.constexpr = _operand(W, 0)
        # q, logical [W, 16 rows, 128 contraction] in the A layout (rows >= ROWS zero; every warp holds the
        # same q), to f16 under a per-row power of two that puts the row's max |q| in (2^13, 2^14] (undone
        # in the score scale)
        o_qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA)))
        o_m = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA)))
        o_k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA)))
        m_row = o_m < ROWS
        i_tok = b * Q_LEN + o_m // GROUP
        i_head = h * GROUP + o_m % GROUP
        pq = p_q + ((i_tok.to(gl.int64) * stride_qt + i_head * stride_qh)[None, :, None]
                    + _phys_k(o_k)[None, None, :] + (o_qw * 0)[:, None, None])
        q_raw = gl.load(pq, mask=m_row[None, :, None] & (o_k < D)[None, None, :], other=0.0)
        if HAS_Q_SCALE:  # fp8 q: its per-token-per-head dequant scale, loaded beside q
            q_sc = gl.load(p_qs + i_tok.to(gl.int64) * stride_qst + i_head * stride_qsh, mask=m_row, other=0.0)
        # the ring's first tiles are issued while q is in flight (AC5: waits on q were ~10% of the TP8
        # slice's stall samples); measured level with issuing them after q's conversion (AC7: no case
        # moved beyond the run's spread), kept as the order with fewer serial round trips
        if not issued:
            _issue_first(k_s, v_s, t0, t1, L, p_k, p_v, p_ptrow, h, num_pages, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, PAGE, STAGES, W, _deep(t0, t1, SHORT_TILES), WG)
        qf = q_raw.to(gl.float32)
        qmax = gl.max(gl.abs(qf), axis=2)
        e = gl.where(qmax > 0.0, gl.ceil(gl.log2(gl.where(qmax > 0.0, qmax, 1.0))) - 14.0, 0.0)
        e = gl.minimum(gl.maximum(e, -100.0), 114.0)
        q_a = (qf * gl.exp2(-e)[:, :, None]).to(gl.float16)  # an fp8 q's values are exact in f16 under that power
        row_scale = qk_scale * gl.exp2(e)
        if HAS_Q_SCALE:  # the row's scores times its q scale, as in the Triton kernel
            row_scale = row_scale * q_sc[None, :]
        rs = gl.convert_layout(row_scale, gl.SliceLayout(2, MMA))
        # row m = r * GROUP + g sees the item's first L - Q_LEN + r + 1 tokens
        o_r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        vis = L - Q_LEN + o_r // GROUP + 1
        # the tile's token of each score column: warp w's TW tokens
        o_sw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        o_tok = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        tok = o_sw[:, None, None] * TW + o_tok[None, None, :]

        m_i = gl.full([W, 16], float("-inf"), gl.float32, layout=gl.SliceLayout(2, MMA))
        l_i = gl.full([W, 16], 0.0, gl.float32, layout=gl.SliceLayout(2, MMA))
        acc = gl.zeros([W, 16, D], gl.float32, layout=MMA)
        q_op = q_a
    # the whole ring on a deep chunk, else its first STAGES - 1 slots; the constexpr branch keeps builds without
    # SHORT_TILES to one loop (``_deep``'s constant is not a constexpr here: the shallow loop would be built too)
    if SHORT_TILES > 0:
        if _deep(t0, t1, SHORT_TILES):
            m_i, l_i, acc = _tile_loop(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h,
                                       num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                       PAGE, STAGES, W, WG)
        else:
            m_i, l_i, acc = _tile_loop(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h,
                                       num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                       PAGE, STAGES - 1, W, WG)
    else:
        m_i, l_i, acc = _tile_loop(k_s, v_s, q_op, rs, vis, tok, m_i, l_i, acc, t0, t1, L, p_k, p_v, p_ptrow, h,
                                   num_pages, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE,
                                   STAGES, W, WG)
    cp.wait_group(0)  # the tail's zero-fill copies land before the next chunk reuses the ring
    gl.thread_barrier()

    # the warps' states merged (a warp that saw no token has max -inf and weight 0): the weighted
    # outputs through ``o_s`` [W, NR, 128] fp32 (W > 1), summed in a fixed order
    m_c = gl.max(m_i, axis=0)
    m_cs = gl.where(m_c == float("-inf"), 0.0, m_c)
    wt = gl.exp2(m_i - m_cs[None, :])
    OL: gl.constexpr = gl.SliceLayout(0, MMA) if W == 1 else gl.SliceLayout(0, _lsum(W))  # merged [NR, D]
    RL: gl.constexpr = gl.SliceLayout(1, OL)
    l_c = gl.convert_layout(gl.sum(l_i * wt, axis=0), RL)
    m_c = gl.convert_layout(m_c, RL)
    if W == 1:
        o_c = gl.sum(acc * wt[:, :, None], axis=0)
    else:
        if WG:
            o_s.store(gl.permute(acc * wt[:, None, :], [0, 2, 1]))  # O^T back to [W, rows, columns]
        else:
            o_s.store(acc * wt[:, :, None])
        gl.thread_barrier()
        o_c = gl.sum(o_s.load(_lsum(W)), axis=0)
        gl.thread_barrier()  # every warp has read it before it is written again (the next chunk, or a merge's copies)
    live = l_c > 0.0
    b_o = gl.where(live[:, None], o_c * (v_scale / gl.where(live, l_c, 1.0))[:, None], 0.0)
    lse2 = gl.where(live, m_c + gl.log2(gl.where(live, l_c, 1.0)), float("-inf"))
    o_r2 = gl.arange(0, NR, layout=RL)
    o_n = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
    m_out = o_r2 < ROWS
    col = _phys_v(o_n)
    if is_final:
        o_tok_r = b * Q_LEN + o_r2 // GROUP
        o_head = h * GROUP + o_r2 % GROUP
        po = p_out + (o_tok_r.to(gl.int64) * stride_ot + o_head * stride_oh)[:, None] + col[None, :]
        gl.store(po, b_o.to(gl.bfloat16), mask=m_out[:, None] & (o_n < D)[None, :])
        if HAS_LSE:
            gl.store(p_lse + o_tok_r.to(gl.int64) * stride_lt + o_head, lse2 * LN2, mask=m_out)
    else:
        o_prow = slot.to(gl.int64) * ROWS + o_r2
        gl.store(p_po + o_prow[:, None] * D + col[None, :], b_o, mask=m_out[:, None] & (o_n < D)[None, :])
        gl.store(p_plse + o_prow, lse2, mask=m_out)


@gluon.jit
def _stage_chunk(k_s, v_s, j: gl.constexpr, NB: gl.constexpr, MB: gl.constexpr, MF: gl.constexpr):
    """Shared-memory block [MB, MF] fp32 (4 KB) for the j-th chunk of a merge batch of NB (8, or 12 on a ring of 3
    or more slots): the idle K / V ring (8 KB a slot) read as 4 KB blocks, K's first NB / 2 for chunks
    0 .. NB / 2 - 1, V's for the rest."""
    HALF: gl.constexpr = NB // 2
    ring = k_s if j < HALF else v_s
    n: gl.constexpr = ring.shape[0] * 2
    return ring._reinterpret(gl.float32, [n, MB, MF], STAGE).index(j % HALF)


@gluon.jit
def _merge(k_s, v_s, p_po, p_plse, first, p, c_lo, c_hi, f0, ROWS: gl.constexpr, C_STRIDE: gl.constexpr,
           MB: gl.constexpr, MF: gl.constexpr, ML: gl.constexpr, LL: gl.constexpr, NB: gl.constexpr):
    """(max, weight sum, weighted sum) of chunks [c_lo, c_hi) of one item, rows [0, MB), columns
    [f0, f0 + MF), chunk c in the slot of chunk c * C_STRIDE, in batches of NB chunks: their
    outputs copied (cp.async, 16 bytes, L2 only: other SMs wrote them; L1 is not coherent) into
    the idle K / V ring and their LSEs loaded (``.cg``) together, one memory round trip a batch;
    then merged in chunk order (deterministic). The ring is free: the chunk before waited for its
    copies and synchronised; the batch's last barrier frees it again for the next chunk's tiles."""
    NBP: gl.constexpr = 8 if NB <= 8 else 16  # the LSE batch's rows (a power of two; those past NB masked)
    o_m = gl.arange(0, MB, layout=gl.SliceLayout(1, ML))
    o_f = f0 + gl.arange(0, MF, layout=gl.SliceLayout(0, ML))
    m_row = o_m < ROWS
    o_c = gl.arange(0, NBP, layout=gl.SliceLayout(1, LL))
    o_r = gl.arange(0, MB, layout=gl.SliceLayout(0, LL))
    b_m = gl.full([MB], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ML))
    b_l = gl.full([MB], 0.0, gl.float32, layout=gl.SliceLayout(1, ML))
    acc = gl.zeros([MB, MF], gl.float32, layout=ML)
    for c0 in range(c_lo, c_hi, NB):
        for j in gl.static_range(NB):
            # a batch's chunks past the last are zero-filled (AR4: a branch around each copy and read instead took
            # the TP8 slice 7% longer), so their zero weights meet zeros, never stale ring bytes
            sl = K._combine_slot(first, p, (c0 + j) * C_STRIDE, False).to(gl.int64)
            live = m_row & (c0 + j < c_hi)
            cp.async_copy_global_to_shared(_stage_chunk(k_s, v_s, j, NB, MB, MF),
                                           p_po + (sl * ROWS + o_m)[:, None] * D + o_f[None, :],
                                           mask=live[:, None] & (o_f < D)[None, :])
        cp.commit_group()
        in_batch = (o_c < NB) & (c0 + o_c < c_hi)
        sl8 = K._combine_slot(first, p, (c0 + o_c) * C_STRIDE, False).to(gl.int64)
        lse = gl.load(p_plse + sl8[:, None] * ROWS + o_r[None, :],
                      mask=in_batch[:, None] & (o_r < ROWS)[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        m_new = gl.maximum(b_m, gl.convert_layout(gl.max(lse, axis=0), gl.SliceLayout(1, ML)))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        a = gl.exp2(b_m - m_safe)
        acc = acc * a[:, None]
        b_l = b_l * a
        wt = gl.exp2(lse - gl.convert_layout(m_safe, gl.SliceLayout(0, LL))[None, :])
        cp.wait_group(0)
        for j in gl.static_range(NB):
            w = gl.convert_layout(gl.sum(gl.where((o_c == j)[:, None], wt, 0.0), axis=0), gl.SliceLayout(1, ML))
            acc += _stage_chunk(k_s, v_s, j, NB, MB, MF).load(ML) * w[:, None]
            b_l += w
        b_m = m_new
        gl.thread_barrier()  # every lane has read the batch before the ring is written again
    return b_m, b_l, acc


@gluon.jit
def _store_merged(p_out, p_lse, b, h, b_m, b_l, acc, f0, stride_ot, stride_oh, stride_lt,
                  GROUP: gl.constexpr, Q_LEN: gl.constexpr, HAS_LSE: gl.constexpr, MB: gl.constexpr,
                  MF: gl.constexpr, ML: gl.constexpr):
    ROWS: gl.constexpr = GROUP * Q_LEN
    o_m = gl.arange(0, MB, layout=gl.SliceLayout(1, ML))
    o_f = f0 + gl.arange(0, MF, layout=gl.SliceLayout(0, ML))
    m_row = o_m < ROWS
    live = b_l > 0.0
    o = gl.where(live[:, None], acc / gl.where(live, b_l, 1.0)[:, None], 0.0)
    i_tok = b * Q_LEN + o_m // GROUP
    i_head = h * GROUP + o_m % GROUP
    po = p_out + (i_tok.to(gl.int64) * stride_ot + i_head * stride_oh)[:, None] + o_f[None, :]
    gl.store(po, o.to(gl.bfloat16), mask=m_row[:, None] & (o_f < D)[None, :])
    if HAS_LSE:
        if f0 == 0:
            lse = gl.where(live, (b_m + gl.log2(gl.where(live, b_l, 1.0))) * LN2, float("-inf"))
            gl.store(p_lse + i_tok.to(gl.int64) * stride_lt + i_head, lse, mask=m_row)


@gluon.jit
def _combine_group(k_s, v_s, item, p, n_chunks, g, p_po, p_plse, p_glse, p_count, p_out, p_lse, stride_ot,
                   stride_oh, stride_lt, HKV: gl.constexpr, GROUP: gl.constexpr, Q_LEN: gl.constexpr,
                   HAS_LSE: gl.constexpr, FUSED_C: gl.constexpr, W: gl.constexpr):
    """Group g (chunks [g * FUSED_C, +FUSED_C)) of the item that starts in bin p, merged by the last
    of its chunks to finish (see kernels._combine_group): one group finishes the item; else the
    group's normalised output goes over its first chunk's slot, its LSE to ``p_glse``, and the
    last group to arrive on the item's counter merges the groups in order."""
    ROWS: gl.constexpr = GROUP * Q_LEN
    MB: gl.constexpr = 8 if ROWS <= 8 else 16
    MF: gl.constexpr = D if ROWS <= 8 else 64
    ML: gl.constexpr = _ml(W, ROWS)
    LL: gl.constexpr = _ll(W, ROWS, FUSED_C)
    b = item // HKV
    h = item % HKV
    first = 2 * p + 1
    c_lo = g * FUSED_C
    c_hi = gl.minimum(n_chunks, c_lo + FUSED_C)
    n_groups = (n_chunks + FUSED_C - 1) // FUSED_C
    sl0 = K._combine_slot(first, p, c_lo, False).to(gl.int64)
    o_m = gl.arange(0, MB, layout=gl.SliceLayout(1, ML))
    m_row = o_m < ROWS
    for f0 in gl.static_range(0, D, MF):
        b_m, b_l, acc = _merge(k_s, v_s, p_po, p_plse, first, p, c_lo, c_hi, f0, ROWS, 1, MB, MF, ML, LL, FUSED_C)
        if n_groups == 1:
            _store_merged(p_out, p_lse, b, h, b_m, b_l, acc, f0, stride_ot, stride_oh, stride_lt, GROUP, Q_LEN,
                          HAS_LSE, MB, MF, ML)
        else:
            # in place over the columns just read (the group's first chunk: this program is its only reader)
            live = b_l > 0.0
            o_f = f0 + gl.arange(0, MF, layout=gl.SliceLayout(0, ML))
            o = gl.where(live[:, None], acc / gl.where(live, b_l, 1.0)[:, None], 0.0)
            gl.store(p_po + (sl0 * ROWS + o_m)[:, None] * D + o_f[None, :], o, mask=m_row[:, None] & (o_f < D)[None, :])
            if f0 == 0:
                lse2 = gl.where(live, b_m + gl.log2(gl.where(live, b_l, 1.0)), float("-inf"))
                gl.store(p_glse + sl0 * ROWS + o_m, lse2, mask=m_row)
    if n_groups > 1:
        if arrived_last(p_count + p, n_groups):
            for f0 in gl.static_range(0, D, MF):
                b_m, b_l, acc = _merge(k_s, v_s, p_po, p_glse, first, p, 0, n_groups, f0, ROWS, FUSED_C, MB, MF, ML, LL,
                                       FUSED_C)
                _store_merged(p_out, p_lse, b, h, b_m, b_l, acc, f0, stride_ot, stride_oh, stride_lt, GROUP,
                              Q_LEN, HAS_LSE, MB, MF, ML)
            gl.store(p_count + p, 0)


@gluon.jit
def decode_fp8_kernel(
    p_q, p_qs, p_k, p_v, p_pt, p_len, p_tiles, p_req_end, p_prog_start, p_meta,
    p_out, p_lse, p_po, p_plse, p_ks, p_vs, p_glse, p_count, p_gcount, p_stamp,
    qk_scale_f, v_scale_f, B, max_len, num_pages, bin_stride,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    HKV: gl.constexpr, GROUP: gl.constexpr, Q_LEN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
    HAS_Q_SCALE: gl.constexpr, HAS_K_SCALE_PTR: gl.constexpr, HAS_V_SCALE_PTR: gl.constexpr, HAS_LSE: gl.constexpr,
    FUSED: gl.constexpr, FUSED_C: gl.constexpr, STAMPS: gl.constexpr, PREFETCH: gl.constexpr,
    PDL: gl.constexpr, EARLY: gl.constexpr, PAD: gl.constexpr, TRIGGER: gl.constexpr, WARPS: gl.constexpr,
    SHORT_TILES: gl.constexpr, WG: gl.constexpr,
):
    """Persistent plan program (``WARPS`` warps): drain bin ``pid`` of the plan (see
    ``kernels.decode_kernel``'s walk: the items that start inside the bin, zero-tile items on its
    end edge included). ``qk_scale_f`` = sm_scale * log2(e) * python k_scale; ``max_len`` caps
    every length (min of the plan's max_seq_len and the page table's columns x PAGE).
    STAMPS (diagnostics): the Triton kernel's timeline build (``kernels.STAMP_FIELDS`` in
    ``p_stamp``).

    PDL (programmatic dependent launch), TRIGGER: the next kernel may launch at once (its programs take
    the SM slots this grid's programs free; ``PAD`` unused ring slots make a program's shared
    memory so large that an SM holds no more programs than the plan puts on it, so a next call's
    bins never crowd onto the SMs that finished first, as round N2 saw) and this one waits for
    the kernel ahead (``gdc_wait``) before reading anything that kernel may write. With EARLY,
    what it cannot write in a decode step (the plan, seq_lens, the page table, and K / V before
    each request's last Q_LEN tokens, which the step's KV write adds) is read before that wait:
    the first item's metadata and its chunk's first tiles; q, the scales and the new tokens' K /
    V after it (the launcher sets EARLY only where the plan was not updated by the kernel ahead).
    ``bin_stride``: program i drains bin ``i * bin_stride mod programs`` (a stride prime to the program
    count; 1 = bin i). Under PDL a program takes the slot an earlier call's program freed, so the
    programs of a call are placed in the order the call ahead finished; with bin i for program i an SM
    then gets bins of one stretch of the batch (round AE4: on 1x128K+31x4K half the SMs held four of
    the 128K item's chunks, the other half none, and the call ended 6 us later); strided, consecutive
    programs take bins a quarter of the batch apart."""
    if WG:
        gl.static_assert(WARPS == 4, "the warpgroup form is 4 warps")
        gl.static_assert(GROUP * Q_LEN <= WG_N, "the warpgroup form takes at most 8 q rows a KV head")
    # a merge batch's chunk outputs (4 KB each) fit the K and V rings (two 4 KB blocks a slot each)
    gl.static_assert(FUSED_C <= 4 * (STAGES + PAD), "merge batch larger than the idle ring")
    pid = ((gl.program_id(0).to(gl.int64) * bin_stride) % gl.num_programs(0)).to(gl.int32)  # this program's bin
    if PDL and TRIGGER:
        gdc_launch_dependents()
    if STAMPS:
        c_entry = clock64(pid, False)
        s_entry = globaltimer_ns(pid, False)
    if PDL and not EARLY:
        gdc_wait()
    # PAD slots past the ring are never touched (see PDL above)
    if WG:  # the warpgroup form: K's slots as wgmma reads them, and q
        k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES + PAD, TILE, D], KQ_SW)
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [WG_N, D], KQ_SW)
    else:
        k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES + PAD, WARPS, TILE // WARPS, D], SMEM)
        q_s = k_s  # not used
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES + PAD, WARPS, TILE // WARPS, D], SMEM)
    if WG:
        # the warpgroup's outputs [4, 8, 128] fp32 meet in K's ring slots 0-1 (16 KB), as at two warps below
        o_s = k_s._reinterpret(gl.float32, [WARPS, WG_N, D], OSTAGE)
    elif WARPS > 1 and STAGES > 2:
        # two warps beside 3 or more ring slots (at 3, no room for an output buffer at 4 programs an SM): the warps'
        # outputs [W, 16, 128] fp32 meet in K's ring slots 0-1 (16 KB, idle after a chunk: the loop's last wait and
        # barrier), one store / load round as with the buffer below; four warps on mma.sync (round AV) in its slots
        # 0-3 (the plan pads a 3-slot ring to 4: ``DecodePlan.min_pad``)
        gl.static_assert(WARPS * 16 * D * 4 <= (STAGES + PAD) * TILE * D, "the warps' outputs overflow K's ring")
        o_s = k_s._reinterpret(gl.float32, [WARPS, 16, D], OSTAGE)
    elif WARPS > 1:
        # where the warps' outputs meet after a chunk (16 KB at 2 warps: it counts as a ring slot for PAD)
        o_s = gl.allocate_shared_memory(gl.float32, [WARPS, 16, D], OSTAGE)
    else:
        o_s = k_s  # not used
    # the plan contract's arithmetic is the Triton kernel's own (scalar Triton-lang helpers)
    g0, g1, i, budget = K._bin_start(p_meta, p_prog_start, pid)
    n_items = B * HKV
    b, n, start = K._item_at(i, n_items, p_tiles, p_req_end, HKV)
    go = K._item_in_bin(i, n_items, start, n, g1)
    len_b = gl.load(p_len + b)
    issued = pid < 0  # False: the first chunk issues its own first tiles
    if EARLY:
        # the first chunk's first tiles, if they end before the tokens the kernel ahead may write
        L, t0, t1, is_final, slot = K._chunk_of(start, n, g0, g1, len_b, max_len, pid)
        issued = go & ((t0 + STAGES - 1) * TILE <= L - Q_LEN)
        if issued:
            _issue_first(k_s, v_s, t0, t1, L, p_k, p_v, p_pt + b.to(gl.int64) * stride_ptb, i % HKV, num_pages,
                         stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, STAGES, WARPS,
                         _deep(t0, t1, SHORT_TILES), WG)
        gdc_wait()
    if STAMPS:
        s_wait = globaltimer_ns(len_b, False)
        c_wait = clock64(len_b, False)
        p_row, c_last, s_last, s_chunks, s_tiles, s_merges, s_merge_ns, s_merge_end = K._stamps_open(
            p_stamp, pid, start, s_entry, s_wait, c_entry, c_wait, False)
    qk_scale, v_scale = K._scales(qk_scale_f, v_scale_f, p_ks, p_vs, HAS_K_SCALE_PTR, HAS_V_SCALE_PTR)
    while go:
        h = i % HKV
        L, t0, t1, is_final, slot = K._chunk_of(start, n, g0, g1, len_b, max_len, pid)
        if PREFETCH:
            # the next item's metadata loaded before this one's work, as the Triton kernel's PREFETCH
            # (round I); here level with prefetch=False within -2.4..+2.1% (AC7, row -g-noprefetch),
            # at ~20 more of the tile loop's ~1155 instructions (predicates, addresses kept live)
            b_nx, n_nx, start_nx = K._item_at(i + 1, n_items, p_tiles, p_req_end, HKV)
            len_nx = gl.load(p_len + b_nx)
        _attend_chunk(k_s, v_s, o_s, q_s, b, h, t0, t1, L, is_final, slot, issued,
                      p_q, p_qs, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse, qk_scale, v_scale, num_pages,
                      stride_qt, stride_qh, stride_qst, stride_qsh, stride_kp, stride_kt, stride_kh, stride_vp,
                      stride_vt, stride_vh, stride_ptb, stride_ot, stride_oh, stride_lt, GROUP, Q_LEN, PAGE, STAGES,
                      HAS_LSE, WARPS, SHORT_TILES, HAS_Q_SCALE, WG)
        if STAMPS:
            c_last, s_last, s_chunks, s_tiles = K._stamps_chunk(p_row, t0, t1, s_chunks, s_tiles, False)
        if FUSED:
            if (start < g0) | (start + n > g1):
                # chunk of an item that starts in bin p_s and spans n_chunks bins: arrive on its group
                p_s, n_chunks, g, gslot, in_group = K._merge_group_of(start, n, budget, pid, FUSED_C)
                if arrived_last(p_gcount + gslot, in_group):
                    gl.store(p_gcount + gslot, 0)
                    _combine_group(k_s, v_s, i, p_s, n_chunks, g, p_po, p_plse, p_glse, p_count, p_out, p_lse,
                                   stride_ot, stride_oh, stride_lt, HKV, GROUP, Q_LEN, HAS_LSE, FUSED_C, WARPS)
                    if STAMPS:
                        s_merge_end, s_merge_ns, s_merges = K._stamps_merge(gslot, s_last, s_merge_ns, s_merges,
                                                                            False)
        i += 1
        issued = pid < 0
        if PREFETCH:
            b = b_nx
            n = n_nx
            start = start_nx
            len_b = len_nx
        else:
            b, n, start = K._item_at(i, n_items, p_tiles, p_req_end, HKV)
            len_b = gl.load(p_len + b)
        go = K._item_in_bin(i, n_items, start, n, g1)
    if STAMPS:
        K._stamps_close(p_row, pid, i, c_last, s_last, s_chunks, s_tiles, s_merges, s_merge_ns, s_merge_end, False)
