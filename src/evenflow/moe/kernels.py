"""Triton kernels of the fused MoE pipeline (pure @triton.jit, no torch logic).

Data contract (P = T * top_k token-expert pairs; pair p = token * top_k + slot):

| tensor          | shape                 | dtype        | meaning                                            |
|-----------------|-----------------------|--------------|----------------------------------------------------|
| topk_ids        | [T, k] (flat [P])     | int32/int64  | global expert id of each pair                      |
| counts          | [E_local]             | int32        | pairs routed to each local expert                  |
| offsets         | [E_local + 1]         | int32        | exclusive prefix sums; offsets[E_local] = kept     |
| sorted_pairs    | [P]                   | int32        | pair ids grouped by expert, ascending inside one;  |
|                 |                       |              | slots >= kept hold -1                              |
| tile_expert     | [max_tiles]           | int32        | local expert of each BLOCK_M-row tile, -1 unused   |
| tile_row        | [max_tiles]           | int32        | first sorted row of the tile, -1 unused            |
| inter           | [P, I]                | bf16 / fp8   | SiLU(gate)*up, row r = sorted row r (not pair id;  |
|                 |                       |              | pair tiles: row = pair id)                         |
| inter_scale     | [P, I/128]            | fp32         | fp8 block mode: per-row-per-128-group dequant scale|
| pair_out        | [S_down, P, H]        | bf16 (S=1) / | topk_weight * expert output (K-split s), row = pair|
|                 |                       | fp32 (S>1)   | (bf16 without a down K split: half the bytes of    |
|                 |                       |              | the largest activation buffer at large batch)      |
| gu_part         | [S_gu, tiles*BM, 2I]  | fp32         | gate-up split-K partials (S_gu > 1 only); pair     |
|                 |                       |              | tiles: [S_gu, P, 2I], row = pair id                |
| gu_count        | [tiles, I/BLOCK_N]    | int32        | split arrivals per (tile, n-block); zeroed by the  |
|                 |                       |              | index build (pair tiles: MoEWeights.counters, zero |
|                 |                       |              | between calls, or a buffer moe_zero_kernel zeroes) |

Pair tiles (PAIR_TILES, tiny batches, no index build): task i is pair i alone (row 0 of a
BLOCK_M-row tile, the other rows masked), its expert read from topk_ids; inter and pair_out
rows are pair ids. Under expert parallelism (LOCAL_FIRST) the grid is flat and program i takes the
i-th task of the pairs routed to this rank only (_local_pair_task), so those start first. A K-split
gate-up on pair tiles is reduced by its last split (gu_count: the weights' counters, each put
back to 0 by its last arriver, or a buffer ``moe_zero_kernel`` zeroes), or, where the config
says so (``gu_defer``), in the down GEMM's operand load (DEFER / GU_SPLIT: no inter, no gu_count).

Weights: w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1), w2 [E, H, I], both
K-contiguous. Scales are dequantisation multipliers (value = stored * scale).

MODE: 0 = bf16 weights, 1 = fp8 per-tensor (static activation scales), 2 = fp8
block-128 (dynamic per-token-group-128 activation scales, 128x128 weight blocks).
"""
import triton
import triton.language as tl

from evenflow._kernels.common import (
    FP8_E4M3_MAX,
    arrived_last,
    dot_operand,
    f16_operand,
    layout_barrier_bf16,
    pdl_enter,
    pdl_enter_overlapped,
    pdl_leave_overlapped,
    prefetch_rows,
    to_fp8e4,
)

# Smallest amax a dynamic group scale is derived from (an all-zero group gets a tiny
# scale and quantises to zeros rather than dividing by zero).
GROUP_AMAX_EPS = tl.constexpr(1e-10)
# fp8 dots ("f16 products"): both e4m3 operands are upcast to f16 on every tile. Exact (every
# e4m3 value is an f16, every product of two exact in fp32), accumulated in fp32 by the MMA.
# Why not fp8 wgmma: one K=32 fp8 wgmma (QGMMA) sums its 32 products with reduced precision
# (DeepSeek-V3's report: ~14 bits kept on Hopper) even with Triton's finest promotion
# (max_num_imprecise_acc=32, a fresh accumulator per K step), and the intermediate is
# requantised to fp8, so those errors flip fp8 roundings that an fp32 sum would not. Round F:
# per-tensor Qwen3 T=1024/4096 failed the tolerance rule on every 64/128-row (wgmma) tile and
# passed on every 16/32-row tile (mma.sync, where Triton upcasts fp8 to f16 anyway). Round G:
# block mode's default (64-row wgmma tiles) failed it too at Qwen3 T=4096 (3.45e-2 > 2.75e-2);
# block mode now takes the same f16 products, each K block's fresh fp32 sum scaled and added.
# On sm_90 this also replaces the serialised QGMMA + FADD promotion by pipelined HGMMA (per-
# tensor gate-up: 226-280 instead of 382-397 SASS instructions per 128-deep K step).
#
# FAST_ACC (opt-in, ``fused_moe(fp8_accum="fast")``): the e4m3 tiles go to tl.dot as they are,
# with Triton's default max_num_imprecise_acc (on sm_90: fp8 wgmma at the fp8 rate, the
# hardware's reduced-precision accumulation, never promoted by the compiler). Per-tensor mode
# accumulates the whole K loop in the running accumulator (the class of
# torch._scaled_mm(use_fast_accum=True)); block mode takes a fresh fp8 dot per 128-deep K
# block and adds it, times its scales, to the fp32 accumulator (promotion once per 128, the
# DeepSeek-V3 recipe). Tiles below 64 rows compile to mma.sync, where Triton upcasts fp8 to
# f16 itself (exact products): the same numerics as the default there. fp8 tl.dot needs
# K-steps >= 32 (the launcher never gives FAST_ACC a 16-deep step). Tested against its own
# baseline (evenflow.reference.moe.moe_fast_accum_baseline), not the default's.
#
# FAST_ACC == 2 (``fp8_accum="promoted"``): the same fp8 MMAs, but per-tensor mode's dots take
# max_num_imprecise_acc=BLOCK_K, so each K step's sum (at most 128 products) is summed by the tensor
# core into a fresh partial and added to the fp32 accumulator: block mode's promotion, in per-tensor
# mode too. Block mode is the same build as FAST_ACC == 1 (it already promotes per K step). Against
# the default's rule (fp32 baseline, with round W's requantisation allowance) it passed at 14 of 15
# benchmark-shape points and failed at Hy3 TP8 T=4096 (round AA2): opt-in, tested against its own
# baseline (moe_fast_accum_baseline(promoted=True)).


@triton.jit
def _fp8_operand(x, FAST_ACC: tl.constexpr, DOT_F32: tl.constexpr):
    """An e4m3 tile as a ``tl.dot`` operand: as it is, for fp8 MMAs with fast accumulation
    (FAST_ACC), else as exact f16 values (the default's f16 products, see the top)."""
    if FAST_ACC:
        return dot_operand(x, DOT_F32)
    else:
        return f16_operand(x, DOT_F32)


@triton.jit
def _acc_dot(a, b, acc, FAST_ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` for per-tensor mode's running accumulator: with FAST_ACC == 2 the step's
    products are summed apart from ``acc`` and added to it in fp32 (see the top)."""
    if FAST_ACC == 2:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _local_ids(p_ids, o_p, num_pairs, e_first, num_local):
    """Local expert id of pairs o_p (0 where dropped) and whether the pair is kept on this rank."""
    m_p = o_p < num_pairs
    # range check in the ids' own dtype (int64 ids >= 2^31 must not wrap onto a local expert)
    lid = tl.load(p_ids + o_p, mask=m_p, other=-1) - e_first
    valid = m_p & (lid >= 0) & (lid < num_local)
    return tl.where(valid, lid, 0).to(tl.int32), valid


# Index build, cost model (round F): each program of these kernels is one chain of dependent
# steps on 4 warps, so it costs the SASS it executes, not bytes. Round 5's version unrolled
# [BLOCK_P, E_PAD] one-hot tiles over a 256-pair chunk (tl.static_range): at E_PAD 256 that was
# 5.3K (counts) + 13K (place) straight-line SASS instructions per program, 85 + 208 KB of code
# run once each, i.e. from a cold instruction cache, with 109 barriers. Now per block of
# BLOCK_P pairs: counts by tl.histogram (ballots + popc, O(log E) per pair), the expert cursor of
# each pair by tl.gather, its rank by a BLOCK_P-key sort, the task map by a histogram of tile
# ends; chunks are walked by a rolled loop (sm_90, E_PAD 256: 208 + 1528 instructions in all, a
# 349-instruction step per 128 pairs). BLOCK_P = 32 * num_warps and E_PAD >= BLOCK_P, so no
# tl.histogram input is replicated across threads.
@triton.jit
def _count_range(p_ids, start, end, num_pairs, e_first, num_local, E_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pairs of [start, end) per local expert (dropped pairs count nowhere)."""
    b_counts = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(start, tl.minimum(end, num_pairs), BLOCK_P):
        lid, valid = _local_ids(p_ids, s + tl.arange(0, BLOCK_P), num_pairs, e_first, num_local)
        b_counts += tl.histogram(lid, E_PAD, mask=valid)
    return b_counts


@triton.jit
def _scatter_range(p_ids, p_sorted, b_cursor, start, end, num_pairs, e_first, num_local,
                   E_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    """Scatter the pair ids of [start, end) to expert cursor + rank, block by block.

    Registers and shared memory only (no atomics, no global round trip). One block: sort the
    keys (expert, index in block) -- dropped pairs last -- so each expert's pairs sit together
    in ascending pair order, starting at first[e] (exclusive prefix of the block's expert
    counts); the pair at sorted position j of expert e goes to ``cursor[e] - first[e] + j``. A sort of
    BLOCK_P keys is ~250 SASS instructions at 128 (sm_90), the [BLOCK_P, BLOCK_P] compare it
    replaces ~1230.
    """
    o_b = tl.arange(0, BLOCK_P)
    for s in range(start, tl.minimum(end, num_pairs), BLOCK_P):
        lid, valid = _local_ids(p_ids, s + o_b, num_pairs, e_first, num_local)
        b_hist = tl.histogram(lid, E_PAD, mask=valid)
        key = tl.sort(tl.where(valid, lid, E_PAD) * BLOCK_P + o_b, 0)
        s_lid = key // BLOCK_P
        b_base = b_cursor - (tl.cumsum(b_hist, 0) - b_hist)
        dest = tl.gather(b_base, tl.minimum(s_lid, E_PAD - 1), 0) + o_b
        tl.store(p_sorted + dest, s + key % BLOCK_P, mask=s_lid < E_PAD)
        b_cursor += b_hist


@triton.jit
def _fill_unused(p_sorted, start, end, kept, num_pairs, BLOCK_P: tl.constexpr):
    """sorted_pairs[p] = -1 for kept <= p < num_pairs, over pairs [start, end)."""
    for s in range(tl.maximum(start, kept // BLOCK_P * BLOCK_P), tl.minimum(end, num_pairs), BLOCK_P):
        o_p = s + tl.arange(0, BLOCK_P)
        tl.store(p_sorted + o_p, tl.full([BLOCK_P], -1, tl.int32), mask=(o_p >= kept) & (o_p < num_pairs) & (o_p < end))


@triton.jit
def _zero_share(p_zero, first, step, num_zero):
    """Zero p_zero[first + j*step : + 1024] for all j (one program's share of the gate-up's counters)."""
    for start in range(first, num_zero, step):
        o_z = start + tl.arange(0, 1024)
        tl.store(p_zero + o_z, tl.zeros([1024], dtype=tl.int32), mask=o_z < num_zero)


@triton.jit
def _task_map_share(b_counts, p_tile_expert, p_tile_row, first, step, max_tiles,
                    E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tiles [first + j*step, + BLOCK_T) of the task map: tile t belongs to the expert e with
    tile_start[e] <= t < tile_end[e], i.e. e = #{e' : tile_end[e'] <= t}; unused tiles get -1.

    That count for the BLOCK_T tiles from ``start`` is the experts ending at or before
    ``start`` plus the running sum of a histogram of the tile ends inside the block
    (BLOCK_T bins), not a [BLOCK_T, E_PAD] compare.
    """
    b_offs = tl.cumsum(b_counts, 0) - b_counts
    b_ntiles = (b_counts + BLOCK_M - 1) // BLOCK_M
    b_tile_end = tl.cumsum(b_ntiles, 0)
    total_tiles = tl.sum(b_ntiles, 0)
    b_row_base = b_offs - (b_tile_end - b_ntiles) * BLOCK_M
    o_v = tl.arange(0, BLOCK_T)
    for start in range(first, max_tiles, step):
        rel = b_tile_end - start
        ended = tl.sum((rel <= 0).to(tl.int32), 0)
        expert = ended + tl.cumsum(tl.histogram(rel, BLOCK_T, mask=(rel > 0) & (rel < BLOCK_T)), 0)
        o_t = start + o_v
        row = tl.gather(b_row_base, tl.minimum(expert, E_PAD - 1), 0) + o_t * BLOCK_M
        used = o_t < total_tiles
        tl.store(p_tile_expert + o_t, tl.where(used, expert, -1), mask=o_t < max_tiles)
        tl.store(p_tile_row + o_t, tl.where(used, row, -1), mask=o_t < max_tiles)


@triton.jit
def _store_counts(b_counts, p_counts, p_offsets, num_local, E_PAD: tl.constexpr):
    o_e = tl.arange(0, E_PAD)
    b_offs = tl.cumsum(b_counts, 0) - b_counts
    tl.store(p_counts + o_e, b_counts, mask=o_e < num_local)
    tl.store(p_offsets + o_e, b_offs, mask=o_e < num_local)
    tl.store(p_offsets + num_local, tl.sum(b_counts, 0))


@triton.jit(do_not_specialize=["num_pairs", "max_tiles", "num_zero"])
def moe_index_kernel(
    p_ids, p_counts, p_offsets, p_sorted, p_tile_expert, p_tile_row, p_zero,
    num_pairs, e_first, num_local, max_tiles, num_zero,
    E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):
    """One program (small batches: one launch): counts -> prefix sums -> task map -> stable scatter."""
    pdl_enter(PDL)
    b_counts = _count_range(p_ids, 0, num_pairs, num_pairs, e_first, num_local, E_PAD, BLOCK_P)
    _store_counts(b_counts, p_counts, p_offsets, num_local, E_PAD)
    _zero_share(p_zero, 0, 1024, num_zero)
    _task_map_share(b_counts, p_tile_expert, p_tile_row, 0, BLOCK_T, max_tiles, E_PAD, BLOCK_T, BLOCK_M)
    _scatter_range(p_ids, p_sorted, tl.cumsum(b_counts, 0) - b_counts, 0, num_pairs, num_pairs, e_first,
                   num_local, E_PAD, BLOCK_P)
    _fill_unused(p_sorted, 0, num_pairs, tl.sum(b_counts, 0), num_pairs, BLOCK_P)


# Larger batches: two launches, each one program per CHUNK pairs, no serial walk over the
# whole batch anywhere. (1) per-chunk expert counts -> hist[c]; (2) each chunk sums hist
# over all chunks (totals -> offsets) and over the chunks before it (its cursors), scatters
# its own pairs, and writes its share of the task map. Same layout and order as above.
@triton.jit(do_not_specialize=["num_pairs", "num_zero"])
def moe_index_hist_kernel(p_ids, p_hist, p_zero, num_pairs, e_first, num_local, num_zero,
                          E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """hist[c, e] = pairs of chunk c routed to local expert e; zeroes this program's share of p_zero."""
    pdl_enter(PDL)
    i_c = tl.program_id(0)
    b_counts = _count_range(p_ids, i_c * CHUNK, i_c * CHUNK + CHUNK, num_pairs, e_first, num_local, E_PAD, BLOCK_P)
    tl.store(p_hist + i_c.to(tl.int64) * E_PAD + tl.arange(0, E_PAD), b_counts)
    _zero_share(p_zero, i_c * 1024, tl.num_programs(0) * 1024, num_zero)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_tiles"])
def moe_index_place_kernel(
    p_ids, p_hist, p_counts, p_offsets, p_sorted, p_tile_expert, p_tile_row,
    num_pairs, num_chunks, e_first, num_local, max_tiles,
    E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):
    """Chunk c: totals and earlier-chunk sums of hist -> its cursors; scatter; its share of the task map."""
    pdl_enter(PDL)
    i_c = tl.program_id(0)
    o_e = tl.arange(0, E_PAD)
    o_c = tl.arange(0, BLOCK_C)
    b_total = tl.zeros([E_PAD], dtype=tl.int32)
    b_before = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_chunks, BLOCK_C):
        c = start + o_c
        b_h = tl.load(p_hist + c.to(tl.int64)[:, None] * E_PAD + o_e[None, :], mask=(c < num_chunks)[:, None],
                      other=0)
        b_total += tl.sum(b_h, axis=0)
        b_before += tl.sum(tl.where((c < i_c)[:, None], b_h, 0), axis=0)
    if i_c == 0:
        _store_counts(b_total, p_counts, p_offsets, num_local, E_PAD)
    _task_map_share(b_total, p_tile_expert, p_tile_row, i_c * BLOCK_T, num_chunks * BLOCK_T, max_tiles,
                    E_PAD, BLOCK_T, BLOCK_M)
    _scatter_range(p_ids, p_sorted, tl.cumsum(b_total, 0) - b_total + b_before, i_c * CHUNK, i_c * CHUNK + CHUNK,
                   num_pairs, e_first, num_local, E_PAD, BLOCK_P)
    _fill_unused(p_sorted, i_c * CHUNK, i_c * CHUNK + CHUNK, tl.sum(b_total, 0), num_pairs, BLOCK_P)


@triton.jit
def moe_group_quant_kernel(
    p_x, p_q, p_s, num_groups, stride_xt, stride_qt, stride_st,
    GROUPS: tl.constexpr, FP8_ROUND: tl.constexpr, PDL: tl.constexpr, OVERLAP: tl.constexpr,
):
    """x [T, H] -> fp8 q [T, H] and fp32 scale [T, H/128] per 128-wide group of a row.

    OVERLAP (with PDL, inside ``fused_moe`` after its index or zeroing kernel, which waited for the
    kernels that wrote x): runs beside that kernel and waits for it only before exiting."""
    pdl_enter_overlapped(PDL, OVERLAP)
    i_t = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    o_g = i_g * GROUPS + tl.arange(0, GROUPS)
    o_c = tl.arange(0, 128)
    m_g = o_g < num_groups
    b_x = tl.load(p_x + i_t * stride_xt + o_g[:, None] * 128 + o_c[None, :], mask=m_g[:, None], other=0.0)
    b_x = b_x.to(tl.float32)
    b_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(b_x), axis=1), GROUP_AMAX_EPS), FP8_E4M3_MAX)
    b_q = to_fp8e4(tl.math.div_rn(b_x, b_s[:, None]), FP8_ROUND)
    tl.store(p_q + i_t * stride_qt + o_g[:, None] * 128 + o_c[None, :], b_q, mask=m_g[:, None])
    tl.store(p_s + i_t * stride_st + o_g, b_s, mask=m_g)
    pdl_leave_overlapped(PDL, OVERLAP)


@triton.jit
def moe_tensor_quant_kernel(p_x, p_q, p_scale, H, stride_xt, stride_qt, BLOCK_H: tl.constexpr,
                            FP8_ROUND: tl.constexpr, PDL: tl.constexpr, OVERLAP: tl.constexpr):
    """x [T, H] -> fp8 q = sat_e4m3(x / scale) with one static scale (fp8 per-tensor mode).

    Done once per call: quantising inside the GEMM repeated the IEEE division for every
    n-block program (round B: fp8 per-tensor 2x slower than bf16). OVERLAP: as
    :func:`moe_group_quant_kernel`.
    """
    pdl_enter_overlapped(PDL, OVERLAP)
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_x = tl.load(p_x + i_t * stride_xt + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_q = to_fp8e4(tl.math.div_rn(b_x, tl.load(p_scale)), FP8_ROUND)
    tl.store(p_q + i_t * stride_qt + o_h, b_q, mask=m_h)
    pdl_leave_overlapped(PDL, OVERLAP)


@triton.jit(do_not_specialize=["num_zero"])
def moe_zero_kernel(p_zero, num_zero, PDL: tl.constexpr):
    """p_zero[:num_zero] = 0 (the gate-up's split-K and activation-group counters on pair tiles, where the
    weights keep no counters of their own or too few)."""
    pdl_enter(PDL)
    _zero_share(p_zero, tl.program_id(0) * 1024, tl.num_programs(0) * 1024, num_zero)


@triton.jit
def _tile_rows(p_ids, p_tile_expert, p_tile_row, p_offsets, i_tile, e_first, num_local,
               BLOCK_M: tl.constexpr, PAIR_TILES: tl.constexpr):
    """(local expert or -1, rows, row mask) of task i_tile: a tile of the task map, or with
    PAIR_TILES pair i_tile alone in row 0 (one dependent load before the weights, not three)."""
    if PAIR_TILES:
        lid = tl.load(p_ids + i_tile) - e_first  # checked in the ids' dtype, as _local_ids
        e = tl.where((lid >= 0) & (lid < num_local), lid, -1).to(tl.int32)
        o_b = tl.arange(0, BLOCK_M)
        return e, i_tile + o_b, o_b == 0
    else:
        e = tl.load(p_tile_expert + i_tile)
        row0 = tl.load(p_tile_row + i_tile)
        row_end = tl.load(p_offsets + tl.maximum(e, 0) + 1)
        o_m = row0 + tl.arange(0, BLOCK_M)
        return e, o_m, o_m < row_end


@triton.jit
def _row_pairs(p_sorted, o_m, m_m, PAIR_TILES: tl.constexpr):
    """Pair id of each row (only after the task is known to be used: unused tiles have row -1)."""
    if PAIR_TILES:
        return o_m
    else:
        return tl.load(p_sorted + o_m, mask=m_m, other=0)


@triton.jit
def _used_tiles(p_offsets, num_local, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Tiles of the task map in use: sum over local experts of ceil(pairs / BLOCK_M). The index build
    puts them first (tile_expert[t] >= 0 exactly for t below this count)."""
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < num_local
    b_cnt = tl.load(p_offsets + o_e + 1, mask=m_e, other=0) - tl.load(p_offsets + o_e, mask=m_e, other=0)
    return tl.sum((b_cnt + BLOCK_M - 1) // BLOCK_M, axis=0)


@triton.jit
def _local_pair_task(p_ids, pid, num_pairs, num_nb, e_first, num_local, SPLIT_K: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Task ``pid`` of a pair-tile GEMM whose tasks are the n pairs routed to this rank's experts (in pair order)
    times ``num_nb`` n-blocks times SPLIT_K K splits, the pair fastest and the K split slowest: (pair id, n-block,
    K split, local expert), the expert -1 for pid >= n * num_nb * SPLIT_K. One vector load of the (<= BLOCK_P)
    ids and a prefix count."""
    o_p = tl.arange(0, BLOCK_P)
    lid, mine = _local_ids(p_ids, o_p, num_pairs, e_first, num_local)
    n1 = tl.maximum(tl.sum(mine.to(tl.int32), axis=0), 1)
    i_n = (pid // n1) % num_nb
    i_s = pid // (n1 * num_nb)
    sel = mine & (tl.cumsum(mine.to(tl.int32), axis=0) == pid % n1 + 1)
    pair = tl.sum(tl.where(sel, o_p, 0), axis=0)
    e = tl.sum(tl.where(sel, lid, 0), axis=0)
    # none selected: no pair is local (n1 = 1 stands in for n = 0); past the packed tasks: i_s >= SPLIT_K
    return pair, i_n, i_s, tl.where((tl.sum(sel.to(tl.int32), axis=0) > 0) & (i_s < SPLIT_K), e, -1)


@triton.jit
def _grid_task(p_ids, p_tile_expert, p_tile_row, p_offsets, e_first, num_local, num_nb, BLOCK_M: tl.constexpr,
               SPLIT_K: tl.constexpr, PAIR_TILES: tl.constexpr, LOCAL_FIRST: tl.constexpr,
               MAX_PAIRS: tl.constexpr):
    """This program's task in the one-program-per-task grid (tiles, n-blocks, K splits): (tile, n-block, K
    split, local expert or -1 for an unused tile, rows, row mask, tiles in the grid).

    The GPU starts programs in grid order: the tile fastest, the K split slowest. LOCAL_FIRST (pair tiles
    under expert parallelism; a flat grid of the same size): each program counts the n pairs routed to this
    rank and takes its flat index as (the n local pairs, n-blocks, K splits) in that
    order, so the working programs are the grid's first and the rest exit; without it most of an EP rank's
    grid (other ranks' pairs) is interleaved with its work (round Y, docs/perf-notes/moe.md)."""
    if LOCAL_FIRST:
        n_tiles = tl.num_programs(0) // (SPLIT_K * num_nb)
        i_tile, i_n, i_s, e = _local_pair_task(p_ids, tl.program_id(0), n_tiles, num_nb, e_first, num_local,
                                               SPLIT_K, MAX_PAIRS)
        o_m = i_tile + tl.arange(0, BLOCK_M)
        m_m = tl.arange(0, BLOCK_M) == 0
    else:
        i_tile = tl.program_id(0)
        i_n = tl.program_id(1)
        i_s = tl.program_id(2)
        n_tiles = tl.num_programs(0)
        e, o_m, m_m = _tile_rows(p_ids, p_tile_expert, p_tile_row, p_offsets, i_tile, e_first, num_local, BLOCK_M,
                                 PAIR_TILES)
    return i_tile, i_n, i_s, e, o_m, m_m, n_tiles


@triton.jit
def _persistent_task(task, used, num_nb, p_ids, p_tile_expert, p_tile_row, p_offsets, e_first, num_local,
                     BLOCK_M: tl.constexpr, N_FASTEST: tl.constexpr):
    """Task ``task`` of a persistent GEMM's loop over the ``used`` tiles times the ``num_nb`` n-blocks, tiles
    fastest (the one-program-per-task grid's order) or, with N_FASTEST, a tile's n-blocks in turn: (tile,
    n-block, local expert, rows, row mask)."""
    if N_FASTEST:
        i_tile = task // num_nb
        i_n = task % num_nb
    else:
        i_tile = task % used
        i_n = task // used
    e, o_m, m_m = _tile_rows(p_ids, p_tile_expert, p_tile_row, p_offsets, i_tile, e_first, num_local, BLOCK_M, False)
    return i_tile, i_n, e, o_m, m_m


@triton.jit
def _silu_mul(acc_g, acc_u, e64, p_ws, p_a_scale, MODE: tl.constexpr):
    """SiLU(gate) * up in fp32 of fully reduced gate-up sums [rows, cols] (per-tensor fp8: dequantised first)."""
    if MODE == 1:
        deq = tl.load(p_ws + e64) * tl.load(p_a_scale)
        acc_g = acc_g * deq
        acc_u = acc_u * deq
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _requant(b_h, p_o_scale, MODE: tl.constexpr, FP8_ROUND: tl.constexpr):
    """The activation [rows, cols] as the down GEMM reads it: (values, per-row scale). bf16: fp32
    values, scale unused; fp8 per-tensor: e4m3 at the static scale ``p_o_scale``; fp8 block: e4m3
    with each row's scale over these columns, which must be one whole 128-wide activation group."""
    b_s = 1.0  # bf16 and per-tensor: no row scale
    if MODE == 1:
        b_h = to_fp8e4(tl.math.div_rn(b_h, tl.load(p_o_scale)), FP8_ROUND)
    elif MODE == 2:
        b_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(b_h), axis=1), GROUP_AMAX_EPS), FP8_E4M3_MAX)
        b_h = to_fp8e4(tl.math.div_rn(b_h, b_s[:, None]), FP8_ROUND)
    return b_h, b_s


@triton.jit
def _activate(acc_g, acc_u, e64, p_ws, p_a_scale, p_o_scale, MODE: tl.constexpr, FP8_ROUND: tl.constexpr):
    """SiLU(gate) * up of fully reduced gate-up sums, requantised (:func:`_requant`). One definition
    for the places the activation runs (the gate-up's epilogue, the down GEMM's deferred operand),
    so the paths give the same bits."""
    return _requant(_silu_mul(acc_g, acc_u, e64, p_ws, p_a_scale, MODE), p_o_scale, MODE, FP8_ROUND)


@triton.jit
def _gate_up_epilogue(acc_g, acc_u, o_m, m_m, o_n, i_n, i_tile, e64, p_ws, p_out, p_out_s, p_a_scale, p_o_scale,
                      p_hbuf, p_gcount, I, stride_om, stride_osm, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                      FP8_ROUND: tl.constexpr):
    """SiLU(gate) * up of fully reduced accumulators, requantised as the down GEMM wants, stored.

    Block mode with BLOCK_N < 128: an activation group (128 columns of a row, one scale) spans
    128 // BLOCK_N programs of the tile. Each stores its fp32 activations in ``p_hbuf`` [pairs, I]
    and counts in at its (tile, group) counter in ``p_gcount``; the last to arrive reads the whole
    group back and requantises it, as one 128-wide program would (the same bits), then resets the
    counter."""
    if MODE == 2 and BLOCK_N < 128:
        o_m64 = o_m.to(tl.int64)
        b_h = _silu_mul(acc_g, acc_u, e64, p_ws, p_a_scale, MODE)
        tl.store(p_hbuf + o_m64[:, None] * I + o_n[None, :], b_h, mask=m_m[:, None])
        i_g = (i_n * BLOCK_N) // 128
        p_c = p_gcount + i_tile * (I // 128) + i_g
        if arrived_last(p_c, 128 // BLOCK_N):
            o_g = i_g * 128 + tl.arange(0, 128)
            b_g = tl.load(p_hbuf + o_m64[:, None] * I + o_g[None, :], mask=m_m[:, None], other=0.0,
                          cache_modifier=".cg")
            b_q, b_s = _requant(b_g, p_o_scale, MODE, FP8_ROUND)
            tl.store(p_out + o_m64[:, None] * stride_om + o_g[None, :], b_q.to(p_out.dtype.element_ty),
                     mask=m_m[:, None])
            tl.store(p_out_s + o_m64 * stride_osm + i_g, b_s, mask=m_m)
            tl.store(p_c, 0)
    else:
        b_h, b_s = _activate(acc_g, acc_u, e64, p_ws, p_a_scale, p_o_scale, MODE, FP8_ROUND)
        p_o = p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :]
        tl.store(p_o, b_h.to(p_out.dtype.element_ty), mask=m_m[:, None])
        if MODE == 2:
            # BLOCK_N == 128: this program owns one whole activation group of each row.
            tl.store(p_out_s + o_m.to(tl.int64) * stride_osm + i_n, b_s, mask=m_m)


@triton.jit
def _gate_up_tile(e, o_m, m_m, i_tile, i_n, i_s, n_tiles, num_nb,
                  p_x, p_xs, p_w, p_ws, p_sorted, p_out, p_out_s, p_a_scale, p_o_scale, p_part, p_count,
                  p_hbuf, p_gcount, top_k, I, K, stride_xt, stride_xst, stride_we, stride_wn, stride_wse,
                  stride_wsn, stride_om, stride_osm, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, FP8_ROUND: tl.constexpr,
                  PAIR_TILES: tl.constexpr, FAST_ACC: tl.constexpr, DEFER: tl.constexpr, ONE_DOT: tl.constexpr):
    """One task of the gate-up GEMM: (tile of local expert ``e``, rows ``o_m`` / ``m_m``, n-block ``i_n`` of
    ``num_nb``, K split ``i_s``, of a grid of ``n_tiles`` tiles); see moe_gate_up_kernel.

    ONE_DOT (bf16, per-tensor fp8): the gate and up n-blocks as one [BLOCK_K, 2 * BLOCK_N] weight tile whose
    columns alternate gate row n and up row I + n, one MMA of twice the width a K step (the activation tile is
    loaded once either way; the MMAs read it from shared memory once a step, not twice), the accumulator split
    back into gate and up columns after the loop: each output is the same sum of the same products as with two
    dots. Round AT6's probe: 1.09x the two-dot gate-up at Qwen3 T = 4096 on 128 x (128 + 128) bf16 tiles."""
    pair = _row_pairs(p_sorted, o_m, m_m, PAIR_TILES)
    tok = (pair // top_k).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    k_split = K // SPLIT_K
    # The launcher guarantees K % (SPLIT_K * BLOCK_K) == 0; without telling the compiler,
    # K // SPLIT_K loses K's 16-divisibility and every fp8 load of the K loop became a
    # byte load that the pipeliner refuses (sm_90 TTGIR: no async copies at SPLIT_K >= 8).
    k0 = tl.multiple_of(i_s * k_split, BLOCK_K)

    p_a = p_x + tok[:, None] * stride_xt + (k0 + o_k)[None, :]
    if ONE_DOT:
        tl.static_assert(MODE < 2, "ONE_DOT: bf16 or per-tensor fp8 weights (one scale for gate and up)")
        o_j = tl.arange(0, 2 * BLOCK_N)
        row = i_n * BLOCK_N + o_j // 2 + (o_j % 2) * I  # column 2n: gate row n, 2n + 1: up row I + n
        p_bg = p_w + e64 * stride_we + row[None, :].to(tl.int64) * stride_wn + (k0 + o_k)[:, None]
        acc_g = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    else:
        p_bg = p_w + e64 * stride_we + o_n[None, :].to(tl.int64) * stride_wn + (k0 + o_k)[:, None]
        p_bu = p_bg + I * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 2:
        p_as = p_xs + tok * stride_xst + k0 // 128
        p_wsg = p_ws + e64 * stride_wse + ((i_n * BLOCK_N) // 128) * stride_wsn + k0 // 128
        p_wsu = p_ws + e64 * stride_wse + ((I + i_n * BLOCK_N) // 128) * stride_wsn + k0 // 128

    for i_k in range(0, k_split // BLOCK_K):
        b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
        b_g = tl.load(p_bg)  # ONE_DOT: gate and up columns interleaved, acc_g holds both
        if not ONE_DOT:
            b_u = tl.load(p_bu)
        if MODE == 0:
            acc_g = tl.dot(dot_operand(b_a, DOT_F32), dot_operand(b_g, DOT_F32), acc_g)
            if not ONE_DOT:
                acc_u = tl.dot(dot_operand(b_a, DOT_F32), dot_operand(b_u, DOT_F32), acc_u)
        elif MODE == 1:  # x quantised once by moe_tensor_quant_kernel; the whole K in acc (see the top)
            b_a8 = _fp8_operand(b_a, FAST_ACC, DOT_F32)
            acc_g = _acc_dot(b_a8, _fp8_operand(b_g, FAST_ACC, DOT_F32), acc_g, FAST_ACC, BLOCK_K)
            if not ONE_DOT:
                acc_u = _acc_dot(b_a8, _fp8_operand(b_u, FAST_ACC, DOT_F32), acc_u, FAST_ACC, BLOCK_K)
        else:  # block scales: each K block's sum in a fresh tile, scaled, added in fp32
            b_xs = tl.load(p_as + i_k, mask=m_m, other=0.0)
            ws_g = tl.load(p_wsg + i_k)
            ws_u = tl.load(p_wsu + i_k)
            b_a8 = _fp8_operand(b_a, FAST_ACC, DOT_F32)
            acc_g += tl.dot(b_a8, _fp8_operand(b_g, FAST_ACC, DOT_F32)) * (b_xs[:, None] * ws_g)
            acc_u += tl.dot(b_a8, _fp8_operand(b_u, FAST_ACC, DOT_F32)) * (b_xs[:, None] * ws_u)
        p_a += BLOCK_K
        p_bg += BLOCK_K
        if not ONE_DOT:
            p_bu += BLOCK_K
    if ONE_DOT:  # back to gate and up columns (an MMA accumulator's thread holds its columns in pairs)
        acc_g, acc_u = acc_g.reshape([BLOCK_M, BLOCK_N, 2]).split()

    if SPLIT_K == 1:
        _gate_up_epilogue(acc_g, acc_u, o_m, m_m, o_n, i_n, i_tile, e64, p_ws, p_out, p_out_s, p_a_scale,
                          p_o_scale, p_hbuf, p_gcount, I, stride_om, stride_osm, MODE, BLOCK_N, FP8_ROUND)
    else:
        if PAIR_TILES:  # one partial row per pair (row 0; the masked rows address nothing)
            n_rows = n_tiles
            o_r = (i_tile + tl.arange(0, BLOCK_M)).to(tl.int64)
        else:
            n_rows = n_tiles * BLOCK_M
            o_r = (i_tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        stride_ps = n_rows.to(tl.int64) * 2 * I
        p_pg = p_part + o_r[:, None] * (2 * I) + o_n[None, :]
        tl.store(p_pg + i_s * stride_ps, acc_g, mask=m_m[:, None])
        tl.store(p_pg + i_s * stride_ps + I, acc_u, mask=m_m[:, None])
        if not DEFER:  # DEFER: the partials are the down GEMM's to add
            p_c = p_count + i_tile * num_nb + i_n
            # (arrived_last puts a CTA barrier before the release: without it only the thread
            # that runs the atomic had its partial stores ordered before it)
            if arrived_last(p_c, SPLIT_K):
                # split order from a zero tile: moe_down_kernel's GU_SPLIT sum must stay the same
                red_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                red_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    red_g += tl.load(p_pg + s * stride_ps, mask=m_m[:, None], other=0.0, cache_modifier=".cg")
                    red_u += tl.load(p_pg + s * stride_ps + I, mask=m_m[:, None], other=0.0, cache_modifier=".cg")
                _gate_up_epilogue(red_g, red_u, o_m, m_m, o_n, i_n, i_tile, e64, p_ws, p_out, p_out_s, p_a_scale,
                                  p_o_scale, p_hbuf, p_gcount, I, stride_om, stride_osm, MODE, BLOCK_N, FP8_ROUND)
                tl.store(p_c, 0)


@triton.jit
def _prefetch_then_wait(p_we, o_n, second, stride_wn, i_s, k_split, BLOCK_K: tl.constexpr, LINE: tl.constexpr,
                        TWO_SETS: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    """Before a pair-tile program's PDL wait: ask L2 for the weight lines its task will read (rows ``o_n`` of the
    expert's matrix at ``p_we`` and, with TWO_SETS, rows ``o_n + second`` (the gate-up's up rows), columns [i_s *
    k_split, (i_s + 1) * k_split), or with STEPS > 0 its first STEPS K steps of BLOCK_K, at least the line they start
    in: :func:`prefetch_rows`), then wait and let the next kernel launch (:func:`pdl_enter`). The weights are no
    kernel's output, so the lines cannot be stale; only the task (the pair's expert, read from ``topk_ids``) had to be
    complete, which the caller ensures (moe_gate_up_kernel's PREFETCH). Program 0 waits even with no task, before it
    exits: a kernel completes when its last program exits, and the next kernel waits for this one alone, so a grid of
    programs that all exited unwaited (an expert-parallel rank no pair reaches) would let the layer's later kernels, and
    the next layer, run while the kernel ahead still writes (round BK's review; the record BK5 ran without that wait).
    One waiting program orders the whole grid after the kernel ahead, so the other programs with no task exit at once
    and leave their slots to programs with work (round BL3a: with every idle program waiting, Hy3 EP8 fp8-tensor T = 4,
    where 7 of 8 pairs are another rank's, took 1.05x the time)."""
    k0 = i_s * k_split
    k_end = k0 + k_split
    if STEPS > 0:
        k_end = tl.minimum(k_end, k0 + STEPS * BLOCK_K)
    m_n = o_n >= 0  # every row exists (the launcher's n-blocks tile the matrix): prefetch_rows masks columns only
    prefetch_rows(p_we, o_n, m_n, stride_wn, k0, k_end, BLOCK_K, LINE)
    if TWO_SETS:
        prefetch_rows(p_we, o_n + second, m_n, stride_wn, k0, k_end, BLOCK_K, LINE)
    pdl_enter(PDL)


@triton.jit(do_not_specialize=["top_k", "e_first", "num_local", "num_nb"])
def moe_gate_up_kernel(
    p_x, p_xs, p_w, p_ws, p_ids, p_sorted, p_offsets, p_tile_expert, p_tile_row,
    p_out, p_out_s, p_a_scale, p_o_scale, p_part, p_count, p_hbuf, p_gcount,
    top_k, I, K, e_first, num_local, num_nb,
    stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, FP8_ROUND: tl.constexpr, PDL: tl.constexpr,
    PAIR_TILES: tl.constexpr, FAST_ACC: tl.constexpr, DEFER: tl.constexpr, PERSIST: tl.constexpr,
    E_PAD: tl.constexpr, LOCAL_FIRST: tl.constexpr, MAX_PAIRS: tl.constexpr, ONE_DOT: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, PREFETCH_STEPS: tl.constexpr = 0,
):
    """inter[rows, n-block] = act(x[tokens] @ w13[e, gate n-block].T, x[tokens] @ w13[e, up n-block].T).

    One program per (tile, n-block of I, K split); tokens are read through
    sorted_pairs (row -> pair -> token), never gathered into a copy. LOCAL_FIRST (pair tiles under
    expert parallelism): a flat grid of the same size whose first programs take the tasks of this
    rank's pairs and the rest exit (:func:`_grid_task`; MAX_PAIRS: the id vector's width, >= the pairs).

    SPLIT_K > 1 (decode: too few (tile, n-block) programs to stream the weights at
    full bandwidth): each split stores its fp32 partial sums of gate and up in
    ``p_part`` [SPLIT_K, max_tiles * BLOCK_M, 2 * I] (pair tiles: [SPLIT_K, P, 2 * I]),
    then bumps the arrival counter of its (tile, n-block) in ``p_count`` (zeroed by the
    index kernel; with pair tiles zero between calls, or zeroed by moe_zero_kernel);
    the split that arrives last sums the partials in split order (deterministic),
    applies the activation and requantisation, and resets the counter.

    DEFER (pair tiles with SPLIT_K > 1): each split only stores its partials; the down
    kernel adds them as it loads its operand (``GU_SPLIT``), so no counter, no arrival
    round trips and no ``inter`` buffer.

    Block mode (MODE 2) with BLOCK_N < 128 (more, smaller programs at decode batches): the
    128-column activation groups are requantised by the last of their 128 // BLOCK_N programs to
    finish, through ``p_hbuf`` (fp32 activations [pairs, I]) and the group counters ``p_gcount``
    [tiles, I // 128] (zeroed like ``p_count``); see :func:`_gate_up_epilogue`.

    ONE_DOT (bf16, per-tensor fp8): the gate and up n-blocks as one MMA of twice the width a K step
    (:func:`_gate_up_tile`).

    PREFETCH > 0 (pair tiles under PDL, where a kernel of the layer that waited for the kernel ahead of the layer
    runs before this one, so ``topk_ids`` is complete): each program reads its task, asks L2 for its weight lines
    (gate and up rows, its K split, or its first PREFETCH_STEPS K steps; PREFETCH elements a 128-byte line) and only
    then waits for the kernel ahead (round BK, :func:`_prefetch_then_wait`). 0: the wait first, as always before.

    PERSIST (index tiles, no K split; ``num_nb`` n-blocks): a fixed grid of programs takes the
    used tasks in turn (:func:`_used_tiles`), in the order of the one-program-per-task grid
    (tiles fastest), in one flattened loop over tasks and K steps, so that the compiler may start a
    task's first loads under the previous task's last steps. Measured slower than one program per
    task (docs/perf-notes/moe.md, rounds T3, T6), and slower still walking the n-blocks fastest (round AT4):
    opt-in only.
    """
    tl.static_assert(not DEFER or (PAIR_TILES and SPLIT_K > 1), "DEFER: pair tiles with a K split only")
    tl.static_assert(not PERSIST or (SPLIT_K == 1 and not PAIR_TILES), "PERSIST: index tiles, no K split")
    tl.static_assert(PREFETCH == 0 or (PAIR_TILES and PDL), "PREFETCH: pair tiles under PDL")
    if PREFETCH == 0:
        pdl_enter(PDL)
    if PERSIST:
        used = _used_tiles(p_offsets, num_local, BLOCK_M, E_PAD)
        # not flattened around block mode's group requantisation (a branch after the K loop): Triton 3.6's
        # nested-loop fusion then emits invalid IR (scf.if results) and the kernel does not compile
        for task in tl.range(tl.program_id(0), used * num_nb, tl.num_programs(0),
                             flatten=not (MODE == 2 and BLOCK_N < 128)):
            i_tile, i_n, e, o_m, m_m = _persistent_task(task, used, num_nb, p_ids, p_tile_expert, p_tile_row,
                                                         p_offsets, e_first, num_local, BLOCK_M, False)
            _gate_up_tile(e, o_m, m_m, i_tile, i_n, tl.full([], 0, tl.int32), 0, num_nb, p_x, p_xs, p_w, p_ws, p_sorted,
                p_out, p_out_s, p_a_scale, p_o_scale, p_part, p_count, p_hbuf, p_gcount, top_k, I, K, stride_xt,
                stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm, MODE, BLOCK_M,
                BLOCK_N, BLOCK_K, SPLIT_K, DOT_F32, FP8_ROUND, PAIR_TILES, FAST_ACC, DEFER, ONE_DOT)
    else:
        i_tile, i_n, i_s, e, o_m, m_m, n_tiles = _grid_task(p_ids, p_tile_expert, p_tile_row, p_offsets, e_first,
                                                            num_local, num_nb, BLOCK_M, SPLIT_K, PAIR_TILES,
                                                            LOCAL_FIRST, MAX_PAIRS)
        if e < 0:
            if PREFETCH > 0 and tl.program_id(0) == 0:  # no task: program 0 waits all the same (_prefetch_then_wait)
                pdl_enter(PDL)
            return
        if PREFETCH > 0:
            o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _prefetch_then_wait(p_w + e.to(tl.int64) * stride_we, o_n, I, stride_wn, i_s, K // SPLIT_K, BLOCK_K,
                                PREFETCH, True, PREFETCH_STEPS, PDL)
        _gate_up_tile(e, o_m, m_m, i_tile, i_n, i_s, n_tiles, num_nb, p_x, p_xs, p_w, p_ws, p_sorted, p_out,
            p_out_s, p_a_scale, p_o_scale, p_part, p_count, p_hbuf, p_gcount, top_k, I, K, stride_xt, stride_xst,
            stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm, MODE, BLOCK_M, BLOCK_N, BLOCK_K,
            SPLIT_K, DOT_F32, FP8_ROUND, PAIR_TILES, FAST_ACC, DEFER, ONE_DOT)


@triton.jit
def _down_step(acc, i_k, p_x, p_xs, p_b, p_bs, p_g, m_m, e64, p_w, p_gws, p_ga_scale, p_a_scale, K, stride_gps,
               MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
               FAST_ACC: tl.constexpr, GU_SPLIT: tl.constexpr, FP8_ROUND: tl.constexpr):
    """One K step of a down task: acc + its [BLOCK_M, BLOCK_K] operand (loaded from ``p_x``, or with GU_SPLIT
    built from the gate-up's partials at ``p_g``) times the weight tile at ``p_b``; block mode scales the step's
    product by the row scales at ``p_xs`` (K group ``i_k``) and the weight block's at ``p_bs``."""
    if GU_SPLIT > 0:
        # split order from zero, as the gate-up's last split sums them (equal bits)
        b_g = tl.zeros([BLOCK_K], dtype=tl.float32)
        b_u = tl.zeros([BLOCK_K], dtype=tl.float32)
        for s in tl.static_range(GU_SPLIT):
            b_g += tl.load(p_g + s * stride_gps)
            b_u += tl.load(p_g + s * stride_gps + K)
        # activated once, as one row, then put on every row of the tile (only row 0 is stored):
        # on the broadcast tile, block mode's row max and requantisation ran per row of the tile
        # (round P4, sm_90: 588-1354 -> 328-525 instructions per K step)
        b_h, b_s = _activate(b_g[None, :], b_u[None, :], e64, p_gws, p_ga_scale, p_a_scale, MODE, FP8_ROUND)
        if MODE == 0:
            # DOT_F32: the interpreter runs this launch (no PTX there); False under emulate_gpu, whose
            # launches are recorded and compiled, not run
            b_h = layout_barrier_bf16(b_h.to(p_w.dtype.element_ty), DOT_F32)
        b_a = tl.broadcast_to(b_h, (BLOCK_M, BLOCK_K))
        if MODE == 2:
            b_xs = tl.broadcast_to(b_s, (BLOCK_M,))
    else:
        b_a = tl.load(p_x, mask=m_m[:, None], other=0.0)
        if MODE == 2:
            b_xs = tl.load(p_xs + i_k, mask=m_m, other=0.0)
    b_b = tl.load(p_b)
    if MODE == 0:
        acc = tl.dot(dot_operand(b_a, DOT_F32), dot_operand(b_b, DOT_F32), acc)
    elif MODE == 1:
        acc = _acc_dot(_fp8_operand(b_a, FAST_ACC, DOT_F32), _fp8_operand(b_b, FAST_ACC, DOT_F32), acc,
                       FAST_ACC, BLOCK_K)
    else:
        b_d = tl.dot(_fp8_operand(b_a, FAST_ACC, DOT_F32), _fp8_operand(b_b, FAST_ACC, DOT_F32))
        acc += b_d * (b_xs[:, None] * tl.load(p_bs + i_k))
    return acc


@triton.jit
def _down_store(acc, o_n, m_m, pair, i_s, b_tw, p_out, stride_os, stride_om):
    """The down task's epilogue (after per-tensor mode's dequantisation, which the caller applies first: the same
    bits whatever the loop): each row times its top-k weight ``b_tw``, stored to pair_out[i_s, pair, o_n]
    (row-masked)."""
    acc = acc * b_tw[:, None]
    p_o = p_out + i_s.to(tl.int64) * stride_os + pair.to(tl.int64)[:, None] * stride_om + o_n[None, :]
    tl.store(p_o, acc.to(p_out.dtype.element_ty), mask=m_m[:, None])


@triton.jit
def _down_tile(e, o_m, m_m, i_tile, i_g, i_s,
               p_a, p_as, p_w, p_ws, p_sorted, p_topk_w, p_out, p_a_scale, p_gpart, p_gws, p_ga_scale,
               K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_os, stride_om,
               stride_gps, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, PAIR_TILES: tl.constexpr,
               FAST_ACC: tl.constexpr, GU_SPLIT: tl.constexpr, FP8_ROUND: tl.constexpr, N_GROUP: tl.constexpr):
    """One task of the down GEMM (tile of local expert ``e``, n-blocks ``i_g * N_GROUP`` .. ``+ N_GROUP - 1``,
    K split ``i_s``); see moe_down_kernel."""
    o_n = i_g * (N_GROUP * BLOCK_N) + tl.arange(0, BLOCK_N)  # the (first) n-block's columns
    o_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    o_m64 = o_m.to(tl.int64)
    k_split = K // SPLIT_K
    # The launcher guarantees K % (SPLIT_K * BLOCK_K) == 0; without telling the compiler,
    # K // SPLIT_K loses K's 16-divisibility and every fp8 load of the K loop became a
    # byte load that the pipeliner refuses (sm_90 TTGIR: no async copies at SPLIT_K >= 8).
    k0 = tl.multiple_of(i_s * k_split, BLOCK_K)

    p_x = p_a + o_m64[:, None] * stride_am + (k0 + o_k)[None, :]
    p_b = p_w + e64 * stride_we + o_n[None, :].to(tl.int64) * stride_wn + (k0 + o_k)[:, None]
    p_xs = p_as
    p_bs = p_ws
    p_g = p_gpart
    if MODE == 2:
        p_xs = p_as + o_m64 * stride_asm + k0 // 128
        p_bs = p_ws + e64 * stride_wse + ((i_g * N_GROUP * BLOCK_N) // 128) * stride_wsn + k0 // 128

    if GU_SPLIT > 0:
        p_g = p_gpart + i_tile.to(tl.int64) * (2 * K) + k0 + o_k

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if N_GROUP == 1:
        for i_k in range(0, k_split // BLOCK_K):
            acc = _down_step(acc, i_k, p_x, p_xs, p_b, p_bs, p_g, m_m, e64, p_w, p_gws, p_ga_scale, p_a_scale, K,
                             stride_gps, MODE, BLOCK_M, BLOCK_K, DOT_F32, FAST_ACC, GU_SPLIT, FP8_ROUND)
            p_g += BLOCK_K
            p_x += BLOCK_K
            p_b += BLOCK_K
        if MODE == 1:
            acc = acc * (tl.load(p_ws + e64) * tl.load(p_a_scale))
        pair = _row_pairs(p_sorted, o_m, m_m, PAIR_TILES)
        b_tw = tl.load(p_topk_w + pair, mask=m_m, other=0.0)
        _down_store(acc, o_n, m_m, pair, i_s, b_tw, p_out, stride_os, stride_om)
    else:
        # N_GROUP n-blocks of one tile in one loop of N_GROUP * n_k steps (round AJ: at K = 192 a task is three
        # steps, too few for the pipeline to fill; the operand rows are the same for every n-block, re-read
        # from L1 / L2), each n-block stored after its last K step
        n_k = k_split // BLOCK_K
        pair = _row_pairs(p_sorted, o_m, m_m, PAIR_TILES)
        # loaded once, not per n-block
        b_scale = 1.0
        if MODE == 1:
            b_scale = tl.load(p_ws + e64) * tl.load(p_a_scale)
        b_tw = tl.load(p_topk_w + pair, mask=m_m, other=0.0)
        # the tile pointers move by one K step, and at an n-block's last step back to k0 (the operand) or on to the
        # next n-block's first (the weights): scalar steps, the tiles' addresses never recomputed (block mode's
        # scalar weight-scale pointer is, from the step's n-block)
        back = (n_k - 1) * BLOCK_K
        for step in range(0, N_GROUP * n_k):
            i_k = step % n_k
            if MODE == 2:
                p_bs = p_ws + e64 * stride_wse + (((i_g * N_GROUP + step // n_k) * BLOCK_N) // 128) * stride_wsn \
                    + k0 // 128
            acc = _down_step(acc, i_k, p_x, p_xs, p_b, p_bs, p_g, m_m, e64, p_w, p_gws, p_ga_scale, p_a_scale, K,
                             stride_gps, MODE, BLOCK_M, BLOCK_K, DOT_F32, FAST_ACC, GU_SPLIT, FP8_ROUND)
            last = i_k == n_k - 1
            p_x += tl.where(last, -back, BLOCK_K)
            p_g += tl.where(last, -back, BLOCK_K)
            p_b += tl.where(last, BLOCK_N * stride_wn - back, BLOCK_K)
            if last:
                if MODE == 1:
                    acc = acc * b_scale
                _down_store(acc, o_n, m_m, pair, i_s, b_tw, p_out, stride_os, stride_om)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                o_n += BLOCK_N


@triton.jit(do_not_specialize=["top_k", "e_first", "num_local", "num_nb"])
def moe_down_kernel(
    p_a, p_as, p_w, p_ws, p_ids, p_sorted, p_offsets, p_tile_expert, p_tile_row, p_topk_w,
    p_out, p_a_scale, p_gpart, p_gws, p_ga_scale,
    top_k, K, e_first, num_local, num_nb,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_os, stride_om, stride_gps,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, PAIR_TILES: tl.constexpr,
    FAST_ACC: tl.constexpr, GU_SPLIT: tl.constexpr, FP8_ROUND: tl.constexpr, PERSIST: tl.constexpr,
    E_PAD: tl.constexpr, LOCAL_FIRST: tl.constexpr, MAX_PAIRS: tl.constexpr, N_GROUP: tl.constexpr,
    N_FASTEST: tl.constexpr = False, PREFETCH: tl.constexpr = 0, PREFETCH_STEPS: tl.constexpr = 0,
):
    """pair_out[split, pair, n-block] = topk_weight[pair] * (inter[rows, k-split] @ w2[e, n-block, k-split].T).

    Stored in pair_out's dtype (bf16 with SPLIT_K == 1, else fp32 partial sums); the reduce
    kernel sums the SPLIT_K slices (in order) with the top-k slots in fp32.

    GU_SPLIT > 0 (pair tiles whose gate-up was K-split GU_SPLIT ways with DEFER): there is no
    ``inter``; each K step adds the step's gate and up partials of the pair (``p_gpart``
    [GU_SPLIT, P, 2K], row = pair, in split order as the gate-up's last split would) and
    applies the activation and requantisation itself (:func:`_activate`, with the gate-up's
    scales ``p_gws``, ``p_ga_scale``; block mode: one 128-wide group per K step). The partial
    loads are one [BLOCK_K] row per split, pipelined with the weights like any operand load.

    N_GROUP: a task is N_GROUP consecutive n-blocks of its tile, run as one loop of N_GROUP times the K steps
    (``num_nb`` counts those groups: H / (BLOCK_N * N_GROUP)); 1: one n-block, the loop of round AI and before.

    PERSIST: as in moe_gate_up_kernel (index tiles, no K split, no deferred gate-up reduction); N_FASTEST: the
    persistent loop takes a tile's n-blocks (or n-block groups) in turn instead of the tiles (round AU's knob; the
    gate-up's loop keeps the grid's order). LOCAL_FIRST, MAX_PAIRS: as there.

    PREFETCH > 0 (pair tiles under PDL: the gate-up ahead waited, so ``topk_ids`` is complete): the program asks
    L2 for its weight lines (its N_GROUP n-blocks' rows, its K split) before its wait, as the gate-up's PREFETCH.
    """
    tl.static_assert(GU_SPLIT == 0 or PAIR_TILES, "the deferred gate-up reduction reads pair rows")
    tl.static_assert(GU_SPLIT == 0 or MODE != 2 or BLOCK_K == 128, "block mode: one group per K step")
    tl.static_assert(not PERSIST or (SPLIT_K == 1 and not PAIR_TILES), "PERSIST: index tiles, no K split")
    tl.static_assert(PREFETCH == 0 or (PAIR_TILES and PDL), "PREFETCH: pair tiles under PDL")
    if PREFETCH == 0:
        pdl_enter(PDL)
    if PERSIST:
        used = _used_tiles(p_offsets, num_local, BLOCK_M, E_PAD)
        for task in tl.range(tl.program_id(0), used * num_nb, tl.num_programs(0), flatten=True):
            i_tile, i_n, e, o_m, m_m = _persistent_task(task, used, num_nb, p_ids, p_tile_expert, p_tile_row,
                                                         p_offsets, e_first, num_local, BLOCK_M, N_FASTEST)
            _down_tile(e, o_m, m_m, i_tile, i_n, tl.full([], 0, tl.int32), p_a, p_as, p_w, p_ws, p_sorted,
                p_topk_w, p_out, p_a_scale, p_gpart, p_gws, p_ga_scale, K, stride_am, stride_asm, stride_we,
                stride_wn, stride_wse, stride_wsn, stride_os, stride_om, stride_gps, MODE, BLOCK_M, BLOCK_N, BLOCK_K,
                SPLIT_K, DOT_F32, PAIR_TILES, FAST_ACC, GU_SPLIT, FP8_ROUND, N_GROUP)
    else:
        i_tile, i_n, i_s, e, o_m, m_m, _ = _grid_task(p_ids, p_tile_expert, p_tile_row, p_offsets, e_first,
                                                      num_local, num_nb, BLOCK_M, SPLIT_K, PAIR_TILES, LOCAL_FIRST,
                                                      MAX_PAIRS)
        if e < 0:
            if PREFETCH > 0 and tl.program_id(0) == 0:  # no task: program 0 waits all the same (_prefetch_then_wait)
                pdl_enter(PDL)
            return
        if PREFETCH > 0:
            o_n = i_n * (N_GROUP * BLOCK_N) + tl.arange(0, N_GROUP * BLOCK_N)
            _prefetch_then_wait(p_w + e.to(tl.int64) * stride_we, o_n, 0, stride_wn, i_s, K // SPLIT_K, BLOCK_K,
                                PREFETCH, False, PREFETCH_STEPS, PDL)
        _down_tile(e, o_m, m_m, i_tile, i_n, i_s, p_a, p_as, p_w, p_ws, p_sorted, p_topk_w,
            p_out, p_a_scale, p_gpart, p_gws, p_ga_scale, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_os, stride_om, stride_gps, MODE, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DOT_F32,
            PAIR_TILES, FAST_ACC, GU_SPLIT, FP8_ROUND, N_GROUP)


@triton.jit(do_not_specialize=["top_k"])
def moe_reduce_kernel(
    p_pair_out, p_ids, p_shared, p_y, top_k, H, e_first, num_local, routed_scaling,
    stride_ps, stride_pm, stride_sht, stride_yt,
    HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr, FENCED: tl.constexpr = False,
):
    """y[t] = routed_scaling * sum_split sum_slot pair_out[split, t*k + slot] + shared[t].

    Local pairs only. The token's top_k ids are one vector load and each split's top_k
    rows one [BLOCK_K, BLOCK_H] load, written to be issued before the first sum (the splits are
    unrolled): two dependent round trips to memory per program, where a loop over the
    slots paid two per slot (at T = 1 the reduce is pure latency). Fixed order (a fixed
    tree over the slots, then the splits in turn): deterministic.

    The sm_90 build does not keep that order (round BO, CPU: ``benchmarks/sass_load_waves.py``): ptxas issues some
    rows, and one of the eight ids, after sums that read earlier ones, so their latencies run in turn: 4 round trips
    a program at one K split, 10 at four. FENCED (``fused.REDUCE_FENCED``; the default since round BQ: 0.9964 of the
    unfenced build's time, the median over T = 1-4)
    puts two branches between the round trips (``if top_k > 0`` after the ids, ``if H > 0`` after the rows, always
    taken where there is work), across which ptxas moved no load or read in these builds (the sm_90 test checks), and
    asks for the shared output's row with the ids (its address needs no loaded value): 2 round trips at every split.
    The same sums in the same order: the same bits. The unfenced body stays for the A/B row evenflow-unfencedreduce.
    """
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_j = tl.arange(0, BLOCK_K)
    pair = i_t * top_k + o_j
    if FENCED:
        # first round trip: every load whose address is known (nothing reads them before the branch)
        b_ids = tl.load(p_ids + pair, mask=o_j < top_k, other=0)
        if HAS_SHARED:
            b_shared = tl.load(p_shared + i_t * stride_sht + o_h, mask=m_h, other=0.0)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        if top_k > 0:
            lid = b_ids - e_first  # in the ids' dtype, as _local_ids
            mine = (o_j < top_k) & (lid >= 0) & (lid < num_local)
            p_rows = p_pair_out + pair[:, None] * stride_pm + o_h[None, :]
            m_rows = mine[:, None] & m_h[None, :]
            # second round trip: every split's rows, before any sum
            rows = ()
            for s in tl.static_range(SPLIT_K):
                rows = rows + (tl.load(p_rows + s * stride_ps, mask=m_rows, other=0.0),)
            if H > 0:
                for s in tl.static_range(SPLIT_K):
                    acc += tl.sum(rows[s].to(tl.float32), axis=0)
        acc = acc * routed_scaling
        if HAS_SHARED:
            acc += b_shared.to(tl.float32)
    else:
        lid = tl.load(p_ids + pair, mask=o_j < top_k, other=0) - e_first  # in the ids' dtype, as _local_ids
        mine = (o_j < top_k) & (lid >= 0) & (lid < num_local)
        p_rows = p_pair_out + pair[:, None] * stride_pm + o_h[None, :]
        m_rows = mine[:, None] & m_h[None, :]
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.sum(tl.load(p_rows + s * stride_ps, mask=m_rows, other=0.0).to(tl.float32), axis=0)
        acc = acc * routed_scaling
        if HAS_SHARED:
            acc += tl.load(p_shared + i_t * stride_sht + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(p_y + i_t * stride_yt + o_h, acc.to(p_y.dtype.element_ty), mask=m_h)
