"""Triton kernels of paged decode attention: plan, attention, combine. No torch logic here.

Data contract (all int32 unless noted; ``Hkv`` = ``HKV``, item = (request b, kv head h))
-----------------------------------------------------------------------------------------
items are ordered request-outer, kv-head inner: ``item = b * HKV + h``.

==================  ===============  =====================================================
plan tensor          shape            meaning
==================  ===============  =====================================================
``tiles``            [max_batch]      work units of every item of request b: its 64-token
                                      tiles ceil(clamp(seq_len, 0, max_seq_len) / 64), plus
                                      ``item_cost`` when it is non-empty and has at most
                                      ``cost_max`` tiles (unit u is tile u; the units past
                                      the last tile carry no tokens and are not looped over)
``req_end``          [max_batch]      inclusive prefix sum of HKV * tiles: global tile index
                                      one past request b's last tile. Item (b, h) owns the
                                      global tiles [req_end[b] - (HKV - h) * tiles[b], +tiles[b])
``prog_start``       [NP + 1]         first item program p visits (p > 0: the item that holds
                                      global tile p * budget; p = 0: item 0; NP: B * HKV)
``meta``             [6]              total units T, budget, programs used, 1 if a length
                                      was out of [0, max_seq_len] (it was clamped), item_cost,
                                      the pack quantum q (1 unless ``pack_short`` chose one:
                                      then ``tiles`` is rounded up to a multiple of q)
==================  ===============  =====================================================

Program p owns the global unit range [p * budget, min((p + 1) * budget, T)). An item cut
by a bin edge is split: its chunk in the program where it starts goes to partial slot
``2p + 1``; its chunks in later programs q go to slot ``2q`` (a program holds at most one
item that began earlier and one that continues later, so slots are unique and fewer than
2 * NP). Items that fit in one bin are finished in place (normalised output + LSE), so the
combine only touches split items. It runs in the attention kernel by default (``FUSED``: the
last chunk of each group of an item to finish merges it, see ``decode_kernel``), or as the
separate ``combine_kernel`` (``DecodePlan(combine="kernel")``, and the static split).
Arrival counters (int32, zero between calls; each last arriver puts its own back to 0):
``combine_count`` [NP] per start bin (the groups of an item; with the combine kernel, groups x
column-block programs), ``group_count`` [2 * NP] per partial slot of a group's first chunk
(fused combine only: the chunks of a group).

Partials: ``part_o`` fp32 [slots, ROWS, D] (already normalised and scaled by v_scale),
``part_lse`` fp32 [slots, ROWS] in log2 units of the scaled scores. ROWS = GROUP * Q_LEN,
row m = r * GROUP + g (query row r of the request, query head h * GROUP + g).

Static split (IS_STATIC): program = item * SPLITS + c takes the c-th of SPLITS equal tile
ranges of its item; partial slot = program; combine program = item.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from evenflow._kernels.common import (
    arrived_last,
    clock64,
    dot_operand,
    e4m3_to_f16_in_registers,
    globaltimer_ns,
    pdl_enter,
    sm_id,
)

# decode_kernel's STAMPS build: one row of STAMP_SLOTS int64 per program (globaltimer ns unless
# said otherwise). "first_end" / "last_end": the end of its first / last chunk's attention;
# "merge_ns": time from a chunk's end to the end of the group merge it ran (summed);
# "merge_end": the end of its last merge (0 if none); "program_end": after its last item;
# "clk_*": the SM's cycle counter at the same points (fine-grained; compare within a program).
STAMP_FIELDS = ("entry", "after_wait", "meta", "first_end", "last_end", "program_end", "sm", "chunks",
                "merges", "merge_ns", "tiles", "merge_end", "clk_entry", "clk_after_wait", "clk_meta",
                "clk_first_end", "clk_last_end", "clk_program_end")
STAMP_SLOTS = 24
_STAMP_SLOTS = tl.constexpr(STAMP_SLOTS)
# the kernel's slot of each field, in STAMP_FIELDS order (the unpacking fails if they disagree)
(_T_ENTRY, _T_WAIT, _T_META, _T_FIRST, _T_LAST, _T_END, _T_SM, _T_CHUNKS, _T_MERGES, _T_MERGE_NS, _T_TILES,
 _T_MERGE_END, _C_ENTRY, _C_WAIT, _C_META, _C_FIRST, _C_LAST, _C_END) = (
    tl.constexpr(j) for j in range(len(STAMP_FIELDS)))
assert len(STAMP_FIELDS) <= STAMP_SLOTS
# Globals used inside @triton.jit must be constexpr objects (the GPU compiler rejects
# plain or merely annotated globals; the interpreter does not).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
TILE = tl.constexpr(64)


@triton.jit
def _plan_units(p_len, o_b, m_b, max_len, item_cost, cost_max, quantum):
    """Requests ``o_b``'s work units an item: its 64-token tiles, plus item_cost for a non-empty item of at
    most cost_max tiles (its fixed cost: q load, first page, store; see DecodePlan), rounded up to a multiple
    of ``quantum``; and whether each length was out of [0, max_len]."""
    b_len = tl.load(p_len + o_b, mask=m_b, other=0)
    b_bad = (b_len < 0) | (b_len > max_len)
    b_len = tl.minimum(tl.maximum(b_len, 0), max_len)
    b_real = (b_len + TILE - 1) // TILE
    b_tiles = b_real + tl.where((b_len > 0) & (b_real <= cost_max), item_cost, 0)
    return (b_tiles + quantum - 1) // quantum * quantum, b_bad


@triton.jit
def _plan_prefix(p_len, p_tiles, p_req_end, B, max_len, item_cost, cost_max, quantum, HKV: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    """Stores every request's units an item and the inclusive prefix sum of HKV x them; returns the total, the
    shortest non-empty item's units (INT32_MAX if none) and 1 if a length was out of [0, max_len]."""
    carry = tl.zeros([], dtype=tl.int32)
    bad = tl.zeros([], dtype=tl.int32)
    shortest = tl.zeros([], dtype=tl.int32) + 2147483647
    for b0 in range(0, B, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < B
        b_tiles, b_bad = _plan_units(p_len, o_b, m_b, max_len, item_cost, cost_max, quantum)
        bad = tl.maximum(bad, tl.max(b_bad.to(tl.int32), axis=0))
        b_end = tl.cumsum(b_tiles * HKV, axis=0) + carry
        tl.store(p_tiles + o_b, b_tiles, mask=m_b)
        tl.store(p_req_end + o_b, b_end, mask=m_b)
        carry += tl.sum(b_tiles * HKV, axis=0)
        shortest = tl.minimum(shortest, tl.min(tl.where(b_tiles > 0, b_tiles, 2147483647), axis=0))
    return carry, shortest, bad


@triton.jit
def _pack_choice(p_len, B, max_len, item_cost, cost_max, min_tiles, raw, shortest, NP: tl.constexpr,
                 HKV: tl.constexpr, PACK_BLOCK: tl.constexpr):
    """``DecodePlan(pack_short=True)``: the least budget (and its quantum) over the quanta of
    ``reference.attention.pack_quanta`` (k = 1..8 shortest items a bin: max(shortest, ceil(raw / k)) + j,
    j = 0..3), every item's units rounded up to a multiple of the quantum and the budget the least multiple
    of it that holds them in NP bins and is at least min_tiles; an int64 key budget << 32 | quantum, INT64_MAX
    where no padded total stays within int32 indices. Called where the shortest item fits in the raw budget and both
    the total and the raw budget are below 2^30 units, so an item's units plus a quantum stay within int32 (the
    per-request rounding runs in int32: int64 division is a call a quotient on sm_90, round BB's SASS count)."""
    o_c = tl.arange(0, 32)
    k = o_c // 4 + 1
    quanta = tl.maximum(shortest, (raw + k - 1) // k) + o_c % 4
    padded = tl.zeros([32], dtype=tl.int64)
    zero = tl.zeros([], dtype=tl.int32)
    for b0 in range(0, B, PACK_BLOCK):
        o_b = b0 + tl.arange(0, PACK_BLOCK)
        b_units, _ = _plan_units(p_len, o_b, o_b < B, max_len, item_cost, cost_max, zero + 1)
        u = b_units[:, None]
        padded += tl.sum(((u + quanta[None, :] - 1) // quanta[None, :] * quanta[None, :]).to(tl.int64), axis=0)
    padded = padded * HKV
    q64 = quanta.to(tl.int64)
    least = tl.maximum((padded + NP - 1) // NP, min_tiles.to(tl.int64))
    budgets = (least + q64 - 1) // q64 * q64
    ok = padded + NP * (budgets + 1) < 2147483648
    return tl.min(tl.where(ok, budgets * 4294967296 + q64, 9223372036854775807), axis=0)


@triton.jit(do_not_specialize=["B", "max_len", "min_tiles", "item_cost", "cost_max", "grow16", "grow_longer16"])
def plan_kernel(
    p_len, p_tiles, p_req_end, p_prog_start, p_meta,
    B, max_len, min_tiles, item_cost, cost_max, grow16, grow_longer16,
    NP: tl.constexpr, HKV: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, SEARCH_ITERS: tl.constexpr, ALIGN: tl.constexpr,
    ALIGN_LONGER: tl.constexpr, PACK: tl.constexpr = False,
):
    """Single program: prefix sums over requests, budget, then per-program start items."""
    one = tl.zeros([], dtype=tl.int32) + 1
    total, shortest, bad = _plan_prefix(p_len, p_tiles, p_req_end, B, max_len, item_cost, cost_max, one, HKV,
                                        BLOCK_B)
    budget = tl.maximum((total + NP - 1) // NP, min_tiles)
    raw = budget
    if ALIGN:
        # whole short items per bin: round the budget up to a multiple of the shortest
        # non-empty item when that grows it by at most grow16 / 16 (see DecodePlan)
        aligned = (budget + shortest - 1) // shortest * shortest
        fits = (shortest <= budget) & (16 * aligned.to(tl.int64) <= grow16 * budget.to(tl.int64))
        if ALIGN_LONGER:
            # or, for a shortest item longer than the budget, up to that item over
            # n = shortest // budget when n divides it and that grows the budget by at most
            # grow_longer16 / 16 (n = 1: the item itself) (shortest stays INT32_MAX when no
            # item is non-empty; int64 products)
            longer = (shortest > budget) & (shortest < 2147483647)
            n_cut = tl.maximum(shortest // budget, 1)
            div = shortest // n_cut
            grows_ok = 16 * div.to(tl.int64) <= grow_longer16 * budget.to(tl.int64)
            fits_div = longer & (div * n_cut == shortest) & grows_ok
            aligned = tl.where(fits_div, div, aligned)
            fits = fits | fits_div
        budget = tl.where(fits, aligned, budget)
    quantum = one
    if PACK:
        # priced only where the shortest item fits in the raw budget (and the units stay far from int32's range), and
        # where a quantum can be taken: every priced budget is at least the raw one, so where 16 x raw exceeds 15 x
        # the rules' budget none is (the same plan without the pass: 1.3-1.7 us an update less on an H200, BD1 against
        # BC1); the units and prefix sums are rewritten only where a quantum is taken: elsewhere the pack costs
        # one branch
        if ((shortest <= raw) & (total < 1073741824) & (raw < 1073741824)
                & (16 * raw.to(tl.int64) <= 15 * budget.to(tl.int64))):
            key = _pack_choice(p_len, B, max_len, item_cost, cost_max, min_tiles, raw, shortest, NP, HKV, 128)
            # taken where it is at most 15/16 of the rules' budget (see DecodePlan)
            if 16 * (key >> 32) <= 15 * budget.to(tl.int64):
                quantum = (key & 4294967295).to(tl.int32)
                budget = (key >> 32).to(tl.int32)
                # the same threads rewrite the units and prefix sums they stored above, now padded
                tl.debug_barrier()
                total, shortest, bad = _plan_prefix(p_len, p_tiles, p_req_end, B, max_len, item_cost, cost_max,
                                                    quantum, HKV, BLOCK_B)
    used = (total + budget - 1) // budget
    tl.store(p_meta + 0, total)
    tl.store(p_meta + 1, budget)
    tl.store(p_meta + 2, used)
    tl.store(p_meta + 3, bad)
    tl.store(p_meta + 4, item_cost)
    tl.store(p_meta + 5, quantum)
    # The searches below read req_end written above by other threads of this program.
    tl.debug_barrier()
    n_items = B * HKV
    for p0 in range(0, NP + 1, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        x = o_p * budget
        # first request b with req_end[b] > x (vectorised binary search over [0, B])
        lo = tl.zeros([BLOCK_P], dtype=tl.int32)
        hi = tl.zeros([BLOCK_P], dtype=tl.int32) + B
        for _ in tl.static_range(SEARCH_ITERS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(p_req_end + mid, mask=active & (mid < B), other=0)
            right = v <= x
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & (~right), mid, hi)
        m_found = lo < B
        b_safe = tl.minimum(lo, B - 1)
        n = tl.load(p_tiles + b_safe, mask=m_found, other=1)
        e = tl.load(p_req_end + b_safe, mask=m_found, other=0)
        h = (x - (e - HKV * n)) // tl.maximum(n, 1)
        item = tl.where(m_found, b_safe * HKV + h, n_items)
        item = tl.where(o_p == 0, 0, item)
        tl.store(p_prog_start + o_p, item, mask=o_p <= NP)


@triton.jit
def _scales(qk_scale_f, v_scale_f, p_ks, p_vs, HAS_K_SCALE_PTR: tl.constexpr, HAS_V_SCALE_PTR: tl.constexpr):
    """The score and V scales: the launcher's factors, times the per-tensor K / V scale tensors where
    the caller passed tensors (both attention kernels)."""
    qk_scale = qk_scale_f
    if HAS_K_SCALE_PTR:
        qk_scale = qk_scale * tl.load(p_ks)
    v_scale = v_scale_f
    if HAS_V_SCALE_PTR:
        v_scale = v_scale * tl.load(p_vs)
    return qk_scale, v_scale


@triton.jit
def _bin_start(p_meta, p_prog_start, pid):
    """Bin ``pid`` of the plan: its global units [g0, g1), its first item and the budget."""
    total = tl.load(p_meta + 0)
    budget = tl.load(p_meta + 1)
    g0 = pid * budget
    return g0, tl.minimum(g0 + budget, total), tl.load(p_prog_start + pid), budget


@triton.jit
def _item_at(i, n_items, p_tiles, p_req_end, HKV: tl.constexpr):
    """Item i's request b, its units n and its first global unit (the plan contract's item
    order: request-outer, kv head inner)."""
    b = tl.minimum(i, n_items - 1) // HKV
    n = tl.load(p_tiles + b)
    return b, n, tl.load(p_req_end + b) - (HKV - i % HKV) * n


@triton.jit
def _item_in_bin(i, n_items, start, n, g1):
    # a bin walks the items that start inside it; zero-unit items on its end edge belong to it,
    # so every empty request is finished exactly once
    return (i < n_items) & ((start < g1) | ((start == g1) & (n == 0)))


@triton.jit
def _chunk_of(start, n, g0, g1, len_b, max_len, pid):
    """The chunk of an item (first unit ``start``, ``n`` units, length ``len_b``) in bin [g0, g1):
    its length L (clamped; never more tokens than the plan's units cover), its tiles [t0, t1) (up
    to its last tile: the item_cost units past it carry no tokens and are not looped over, or the
    plan's fixed cost would be paid twice, round J), whether it is the whole item, and the
    partial slot it writes otherwise (2p + 1 where the item starts, 2p in later bins)."""
    L = tl.minimum(tl.minimum(tl.maximum(len_b, 0), max_len), n * TILE)
    t0 = tl.maximum(start, g0) - start
    t1 = tl.minimum(tl.minimum(start + n, g1) - start, (L + TILE - 1) // TILE)
    is_final = (start >= g0) & (start + n <= g1)
    return L, t0, t1, is_final, 2 * pid + (start >= g0).to(tl.int32)


@triton.jit
def _merge_group_of(start, n, budget, pid, FUSED_C: tl.constexpr):
    """For the chunk in bin ``pid`` of a split item: the bin p_s where the item starts, its
    chunk count, the chunk's merge group g, that group's arrival counter slot and size."""
    p_s = start // budget
    n_chunks = (start + n - 1) // budget - p_s + 1
    g = (pid - p_s) // FUSED_C
    return p_s, n_chunks, g, _combine_slot(2 * p_s + 1, p_s, g * FUSED_C, False), \
        tl.minimum(FUSED_C, n_chunks - g * FUSED_C)


@triton.jit
def _first_page(p_ptrow, t0, o_tok, n_end, max_pages, PAGE: tl.constexpr, SCALAR_PAGE: tl.constexpr):
    """Page id of a chunk's first step: one scalar when a step lies in one page, else one per token."""
    if SCALAR_PAGE:
        n0 = t0 * TILE
        b_page = tl.load(p_ptrow + n0 // PAGE, mask=(n0 < n_end) & (n0 // PAGE < max_pages), other=0)
    else:
        o_nx = t0 * TILE + o_tok
        b_page = tl.load(p_ptrow + o_nx // PAGE, mask=(o_nx < n_end) & (o_nx // PAGE < max_pages), other=0)
    return b_page


@triton.jit
def _kv_step(t, b_pagex, o_tok, h, n_end, p_k, p_v, p_ptrow, num_pages, max_pages,
             stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SCALAR_PAGE: tl.constexpr):
    """Step t of a chunk: token positions (``o_tok``'s shape), their mask, the K and V row
    pointers, and the next step's page id, loaded one step ahead so the K/V copies of a step
    never wait on a load of the same step and the pipeliner can multi-buffer them."""
    STEP: tl.constexpr = BLOCK_N // TILE
    o_n = t * TILE + o_tok
    m_n = o_n < n_end
    b_page = tl.minimum(tl.maximum(b_pagex, 0), num_pages - 1).to(tl.int64)
    if SCALAR_PAGE:
        n_x = (t + STEP) * TILE
        b_next = tl.load(p_ptrow + n_x // PAGE, mask=(n_x < n_end) & (n_x // PAGE < max_pages), other=0)
        o_slot = (t * TILE) % PAGE + o_tok
        p_kr = p_k + (b_page * stride_kp + h * stride_kh) + o_slot * stride_kt
        p_vr = p_v + (b_page * stride_vp + h * stride_vh) + o_slot * stride_vt
    else:
        o_nx = o_n + BLOCK_N
        b_next = tl.load(p_ptrow + o_nx // PAGE, mask=(o_nx < n_end) & (o_nx // PAGE < max_pages), other=0)
        o_slot = o_n % PAGE
        p_kr = p_k + (b_page * stride_kp + o_slot * stride_kt + h * stride_kh)
        p_vr = p_v + (b_page * stride_vp + o_slot * stride_vt + h * stride_vh)
    return o_n, m_n, p_kr, p_vr, b_next


@triton.jit
def _scores(b_q, b_kt, USE_FP8_DOT: tl.constexpr, KV_FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """q @ K^T of one step (``b_kt``: K transposed, 2-D or batched 3-D): fp8 x fp8 as is,
    fp8 K as exact f16 values against the f16 q, else bf16."""
    if USE_FP8_DOT:
        return tl.dot(b_q, b_kt)
    elif KV_FP8:
        return tl.dot(dot_operand(b_q, DOT_F32), dot_operand(b_kt.to(tl.float16), DOT_F32))
    else:
        return tl.dot(dot_operand(b_q, DOT_F32), dot_operand(b_kt, DOT_F32))


@triton.jit
def _softmax_pv_step(b_s, b_v, b_m, b_l, b_acc, AX: tl.constexpr, KV_FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over the scores ``b_s`` (log2 domain, tokens on axis ``AX``,
    masked to -inf) and the step's V: new (row max, weight sum, unnormalised output). A row
    that has seen no visible token keeps max -inf and weight 0 (no NaN)."""
    b_mnew = tl.maximum(b_m, tl.max(b_s, axis=AX))
    b_msafe = tl.where(b_mnew == float("-inf"), 0.0, b_mnew)
    b_alpha = tl.exp2(b_m - b_msafe)
    b_p = tl.exp2(b_s - tl.expand_dims(b_msafe, AX))
    b_l = b_l * b_alpha + tl.sum(b_p, axis=AX)
    if KV_FP8:
        b_vh = e4m3_to_f16_in_registers(b_v, DOT_F32)
        b_pv = tl.dot(dot_operand(b_p.to(tl.float16), DOT_F32), dot_operand(b_vh, DOT_F32))
    else:
        b_pv = tl.dot(dot_operand(b_p.to(tl.bfloat16), DOT_F32), dot_operand(b_v, DOT_F32))
    return b_mnew, b_l, b_acc * tl.expand_dims(b_alpha, AX) + b_pv


@triton.jit
def _tiles_plain(
    b_q, b_rs, b_vis, h, t0, t1, L, p_k, p_v, p_ptrow, num_pages, max_pages,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, USE_FP8_DOT: tl.constexpr,
    DOT_F32: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Tiles [t0, t1) of one item, the warps sharing each step's softmax (scores split over
    the warps by token, the output by column). Returns (row max, weight sum, unnormalised
    output), log2 domain."""
    o_d = tl.arange(0, D)
    b_m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # BLOCK_N tokens (one or more 64-token plan tiles) per iteration. A chunk ends at tile
    # t1, so a wide step masks the tokens past it (they belong to the next program).
    # Page ids are loaded one step ahead (b_pagex), so the K/V copies of a step never wait
    # on a load of the same step and Triton's pipeliner can multi-buffer them.
    # One-tile steps with PAGE >= 64: a step lies in one page (steps start at multiples of
    # 64), so one scalar page id and a contiguous [BLOCK_N, D] block; else one page id per
    # token (a 128-token step may start at an odd tile, where a chunk starts, and cross a
    # page boundary whatever the page size).
    STEP: tl.constexpr = BLOCK_N // TILE
    SCALAR_PAGE: tl.constexpr = (PAGE >= BLOCK_N) and (BLOCK_N == TILE)
    o_tok = tl.arange(0, BLOCK_N)
    n_end = tl.minimum(L, t1 * TILE)
    b_pagex = _first_page(p_ptrow, t0, o_tok, n_end, max_pages, PAGE, SCALAR_PAGE)
    for t in tl.range(t0, t1, STEP, num_stages=NUM_STAGES):
        o_n, m_n, p_kr, p_vr, b_pagex = _kv_step(
            t, b_pagex, o_tok, h, n_end, p_k, p_v, p_ptrow, num_pages, max_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, BLOCK_N, SCALAR_PAGE)
        b_k = tl.load(p_kr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(p_vr[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_s = _scores(b_q, tl.trans(b_k), USE_FP8_DOT, KV_FP8, DOT_F32) * b_rs[:, None]
        b_s = tl.where((o_n[None, :] < b_vis[:, None]) & m_n[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _softmax_pv_step(b_s, b_v, b_m, b_l, b_acc, 1, KV_FP8, DOT_F32)
    return b_m, b_l, b_acc


@triton.jit
def _tiles_split(
    b_q, b_rs, b_vis, h, t0, t1, L, p_k, p_v, p_ptrow, num_pages, max_pages,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, USE_FP8_DOT: tl.constexpr,
    DOT_F32: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
    WSPLIT: tl.constexpr,
):
    """Tiles [t0, t1) of one item as WSPLIT independent online softmaxes, merged at the end.

    Each step's BLOCK_N tokens are cut into WSPLIT groups of BLOCK_N // WSPLIT and both
    products are batched over the groups ([WSPLIT, rows, D] x [WSPLIT, D, tokens]). A
    batched MMA puts one group on each warp, so each warp keeps its own row max, weight
    sum and output and a step needs no exchange between warps: the plain formulation
    splits the scores over the warps by token and the output by column, which costs a
    cross-warp max, a cross-warp sum and a shared-memory round trip of P per step.
    Returns (row max, weight sum, unnormalised output) over all groups, log2 domain.
    """
    TN: tl.constexpr = BLOCK_N // WSPLIT
    STEP: tl.constexpr = BLOCK_N // TILE
    SCALAR_PAGE: tl.constexpr = (PAGE >= BLOCK_N) and (BLOCK_N == TILE)
    o_tok = tl.arange(0, WSPLIT)[:, None] * TN + tl.arange(0, TN)[None, :]  # [W, TN]
    o_d = tl.arange(0, D)[None, None, :]
    b_q3 = tl.broadcast_to(b_q[None, :, :], (WSPLIT, BLOCK_M, D))
    b_m = tl.zeros([WSPLIT, BLOCK_M], dtype=tl.float32) - float("inf")
    b_l = tl.zeros([WSPLIT, BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([WSPLIT, BLOCK_M, D], dtype=tl.float32)
    n_end = tl.minimum(L, t1 * TILE)
    b_pagex = _first_page(p_ptrow, t0, o_tok, n_end, max_pages, PAGE, SCALAR_PAGE)
    for t in tl.range(t0, t1, STEP, num_stages=NUM_STAGES):
        o_n, m_n, p_kr, p_vr, b_pagex = _kv_step(
            t, b_pagex, o_tok, h, n_end, p_k, p_v, p_ptrow, num_pages, max_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, BLOCK_N, SCALAR_PAGE)
        b_k = tl.load(p_kr[:, :, None] + o_d, mask=m_n[:, :, None], other=0.0)
        b_v = tl.load(p_vr[:, :, None] + o_d, mask=m_n[:, :, None], other=0.0)
        b_s = _scores(b_q3, tl.permute(b_k, (0, 2, 1)), USE_FP8_DOT, KV_FP8, DOT_F32) * b_rs[None, :, None]
        b_s = tl.where((o_n[:, None, :] < b_vis[None, :, None]) & m_n[:, None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _softmax_pv_step(b_s, b_v, b_m, b_l, b_acc, 2, KV_FP8, DOT_F32)
    # merge the groups (a group that saw no visible token has max -inf and weight 0)
    b_mall = tl.max(b_m, axis=0)
    b_wg = tl.exp2(b_m - tl.where(b_mall == float("-inf"), 0.0, b_mall)[None, :])
    return b_mall, tl.sum(b_l * b_wg, axis=0), tl.sum(b_acc * b_wg[:, :, None], axis=0)


@triton.jit
def _attend_chunk(
    b, h, t0, t1, L, is_final, slot,
    p_q, p_qs, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse,
    qk_scale, v_scale, num_pages, max_pages,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_Q_SCALE: tl.constexpr, USE_FP8_DOT: tl.constexpr,
    HAS_LSE: tl.constexpr, DOT_F32: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, WSPLIT: tl.constexpr, WS_MIN_TILES: tl.constexpr,
):
    """Online softmax of one item's tiles [t0, t1); finish in place or write a partial."""
    ROWS: tl.constexpr = GROUP * Q_LEN
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    m_row = o_m < ROWS
    i_r = o_m // GROUP
    i_tok = b * Q_LEN + i_r
    i_head = h * GROUP + (o_m % GROUP)
    p_qrow = p_q + i_tok.to(tl.int64) * stride_qt + i_head * stride_qh
    b_q = tl.load(p_qrow[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)
    b_rs = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
    if HAS_Q_SCALE:
        b_rs = b_rs * tl.load(p_qs + i_tok.to(tl.int64) * stride_qst + i_head * stride_qsh, mask=m_row, other=0.0)
    # MMA operand type. bf16 KV: bf16. fp8 KV: f16, since e4m3 -> f16 is one exact
    # conversion per pair of values on sm_90 where e4m3 -> bf16 takes several, and the
    # fp8 loop is bound by instruction issue, not bytes (perf notes, round E). bf16 q
    # goes to f16 exactly after a power-of-two row scale that puts the row's max |q| in
    # (2^13, 2^14] (undone in the score scale): no overflow, no subnormals for values
    # within 2^-24 of the row max; P in [0, 1] keeps 3 more bits in f16 than in bf16.
    if KV_FP8:
        if not USE_FP8_DOT:
            b_qf = b_q.to(tl.float32)
            b_qmax = tl.max(tl.abs(b_qf), axis=1)
            b_e = tl.where(b_qmax > 0.0, tl.ceil(tl.log2(tl.where(b_qmax > 0.0, b_qmax, 1.0))) - 14.0, 0.0)
            b_e = tl.minimum(tl.maximum(b_e, -100.0), 114.0)
            b_q = (b_qf * tl.exp2(-b_e)[:, None]).to(tl.float16)
            b_rs = b_rs * tl.exp2(b_e)
    else:
        b_q = b_q.to(tl.bfloat16)
    # row r sees the tokens before its own position: L - Q_LEN + r + 1 of them
    b_vis = L - Q_LEN + i_r + 1

    p_ptrow = p_pt + b.to(tl.int64) * stride_ptb
    # Chunks of at least WS_MIN_TILES tiles take the warp-split loop when WSPLIT > 1 (its merge
    # costs ~3 us per chunk on the H200, its steps ~15% less than the plain loop's for fp8 KV:
    # round H), shorter ones the plain loop. With WSPLIT == 1 `split` stays a compile-time
    # False and the split loop is not built.
    split = False
    if WSPLIT > 1:
        split = t1 - t0 >= WS_MIN_TILES
    if split:
        b_m, b_l, b_acc = _tiles_split(
            b_q, b_rs, b_vis, h, t0, t1, L, p_k, p_v, p_ptrow, num_pages, max_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
            D, PAGE, BLOCK_M, USE_FP8_DOT, DOT_F32, NUM_STAGES, BLOCK_N, KV_FP8, WSPLIT)
    else:
        b_m, b_l, b_acc = _tiles_plain(
            b_q, b_rs, b_vis, h, t0, t1, L, p_k, p_v, p_ptrow, num_pages, max_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
            D, PAGE, BLOCK_M, USE_FP8_DOT, DOT_F32, NUM_STAGES, BLOCK_N, KV_FP8)
    m_live = b_l > 0.0
    b_o = tl.where(m_live[:, None], b_acc * (v_scale / tl.where(m_live, b_l, 1.0))[:, None], 0.0)
    b_lse2 = tl.where(m_live, b_m + tl.log2(tl.where(m_live, b_l, 1.0)), float("-inf"))
    if is_final:
        p_orow = p_out + i_tok.to(tl.int64) * stride_ot + i_head * stride_oh
        tl.store(p_orow[:, None] + o_d[None, :], b_o.to(p_out.dtype.element_ty), mask=m_row[:, None])
        if HAS_LSE:
            tl.store(p_lse + i_tok.to(tl.int64) * stride_lt + i_head, b_lse2 * LN2, mask=m_row)
    else:
        o_prow = slot.to(tl.int64) * ROWS + o_m
        tl.store(p_po + o_prow[:, None] * D + o_d[None, :], b_o, mask=m_row[:, None])
        tl.store(p_plse + o_prow, b_lse2, mask=m_row)


@triton.jit(do_not_specialize=["B", "splits", "max_len"])
def decode_kernel(
    p_q, p_qs, p_k, p_v, p_pt, p_len,
    p_tiles, p_req_end, p_prog_start, p_meta,
    p_out, p_lse, p_po, p_plse, p_ks, p_vs, p_glse, p_count, p_gcount, p_stamp,
    qk_scale_f, v_scale_f, B, splits, max_len, num_pages, max_pages, bin_stride,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ptb, stride_ot, stride_oh, stride_lt,
    HKV: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, IS_STATIC: tl.constexpr, HAS_Q_SCALE: tl.constexpr,
    HAS_K_SCALE_PTR: tl.constexpr, HAS_V_SCALE_PTR: tl.constexpr, USE_FP8_DOT: tl.constexpr,
    HAS_LSE: tl.constexpr, DOT_F32: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, PDL: tl.constexpr, WSPLIT: tl.constexpr, WS_MIN_TILES: tl.constexpr,
    PREFETCH: tl.constexpr, FUSED: tl.constexpr, FUSED_C: tl.constexpr, FUSED_M: tl.constexpr,
    FUSED_UNROLL: tl.constexpr, STAMPS: tl.constexpr, TRIGGER: tl.constexpr, EARLY: tl.constexpr,
    MERGE_ONE_PASS: tl.constexpr = False,
):
    """Persistent (plan) or one-chunk-per-program (static) paged decode attention.

    STAMPS (diagnostics, plan path): each program writes its timeline to ``p_stamp``
    [programs, STAMP_SLOTS] int64 (globaltimer ns; layout at ``STAMP_FIELDS``). Off by
    default; off, the build is the same as without it.

    FUSED (plan only): the combine runs here, no combine kernel. A program that leaves a
    partial arrives on its group's counter (``p_gcount``, per partial slot of the group's
    first chunk; a group is FUSED_C consecutive chunks of one item); the last of the group
    merges it (:func:`_combine_group`, every column, FUSED_M rows, FUSED_UNROLL chunks per
    load step) and, for an item of several groups, arrives on the item's counter
    (``p_count``, per start bin), whose last merges the groups. Each counter is put back to
    0 by its last arriver.
    MERGE_ONE_PASS (``decode.MERGE_ONE_PASS``): those merges' steps in one pass
    (:func:`_merge_chunks`' ONE_PASS); off, the build is the same as without it.

    ``qk_scale_f`` = sm_scale * log2(e) * python k_scale; ``max_len`` caps every length
    (min of the plan's max_seq_len and max_pages * PAGE) so no page-table column or tile
    outside the plan is touched.
    """
    pid = tl.program_id(0)
    if not IS_STATIC:
        # plan: this program's bin, ``bin_stride`` apart from the next program's (1 = bin pid; see TRIGGER)
        pid = ((pid.to(tl.int64) * bin_stride) % tl.num_programs(0)).to(tl.int32)
    if STAMPS:
        c_entry = clock64(pid, DOT_F32)
        s_entry = globaltimer_ns(pid, DOT_F32)
    # Programmatic dependent launch: wait for the kernels before this one (the plan
    # update, the engine's KV write) before reading what they may write. With a combine
    # kernel after this one, let it be launched now (it waits in turn for this grid).
    # Fused, TRIGGER (round AF): let the next kernel launch at the top too. Its programs then
    # take the slots this grid's programs free, so the launcher sets TRIGGER only where an SM
    # holds no more programs than the plan puts on it (the default d128 build's registers:
    # 2), and the plan spreads its bins (``bin_stride``): without either, the next decode call
    # of back-to-back graph replays had its bins sit unevenly on the SMs (round N2: 2x32K+30x4K,
    # +12%; the Gluon kernel's round AE4). Without TRIGGER the next kernel launches as this
    # grid's programs exit. EARLY (fused, PDL; never right after the plan's update): the first
    # item's metadata and length, which no kernel between the update and this call may
    # rewrite (the plan contract), are read before the wait.
    if FUSED:
        if PDL:
            if TRIGGER:
                gdc_launch_dependents()
            if not EARLY:
                gdc_wait()
    else:
        pdl_enter(PDL)
    if STAMPS and not EARLY:
        c_wait = clock64(pid, DOT_F32)
        s_wait = globaltimer_ns(pid, DOT_F32)
    if IS_STATIC:
        qk_scale, v_scale = _scales(qk_scale_f, v_scale_f, p_ks, p_vs, HAS_K_SCALE_PTR, HAS_V_SCALE_PTR)
        item = pid // splits
        c = pid % splits
        b = item // HKV
        h = item % HKV
        if b < B:
            L = tl.minimum(tl.maximum(tl.load(p_len + b), 0), max_len)
            n = (L + TILE - 1) // TILE
            per = (n + splits - 1) // splits
            t0 = tl.minimum(c * per, n)
            t1 = tl.minimum(t0 + per, n)
            _attend_chunk(
                b, h, t0, t1, L, splits == 1, pid,
                p_q, p_qs, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse,
                qk_scale, v_scale, num_pages, max_pages,
                stride_qt, stride_qh, stride_qst, stride_qsh,
                stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                stride_ptb, stride_ot, stride_oh, stride_lt,
                GROUP, Q_LEN, D, PAGE, BLOCK_M, HAS_Q_SCALE, USE_FP8_DOT, HAS_LSE, DOT_F32, NUM_STAGES, BLOCK_N, KV_FP8,
                WSPLIT, WS_MIN_TILES,
            )
    else:
        g0, g1, i, budget = _bin_start(p_meta, p_prog_start, pid)
        n_items = B * HKV
        b, n, start = _item_at(i, n_items, p_tiles, p_req_end, HKV)
        if PREFETCH:
            len_b = tl.load(p_len + b)
        go = _item_in_bin(i, n_items, start, n, g1)
        if EARLY:
            gdc_wait()
            if STAMPS:
                c_wait = clock64(start, DOT_F32)
                s_wait = globaltimer_ns(start, DOT_F32)
        qk_scale, v_scale = _scales(qk_scale_f, v_scale_f, p_ks, p_vs, HAS_K_SCALE_PTR, HAS_V_SCALE_PTR)
        if STAMPS:
            # what is known before the loop is stored now, so the loop carries fewer registers
            p_row, c_last, s_last, s_chunks, s_tiles, s_merges, s_merge_ns, s_merge_end = _stamps_open(
                p_stamp, pid, start, s_entry, s_wait, c_entry, c_wait, DOT_F32)
        while go:
            h = i % HKV
            if PREFETCH:
                # the next item's tiles, end and length depend on its index only: load them
                # before this item's work, so a bin of many short items does not pay one
                # more memory round trip per item after each item's store (round I)
                b_nx = tl.minimum(i + 1, n_items - 1) // HKV
                n_nx = tl.load(p_tiles + b_nx)
                end_nx = tl.load(p_req_end + b_nx)
                len_nx = tl.load(p_len + b_nx)
            else:
                len_b = tl.load(p_len + b)
            L, t0, t1, is_final, slot = _chunk_of(start, n, g0, g1, len_b, max_len, pid)
            _attend_chunk(
                b, h, t0, t1, L, is_final, slot,
                p_q, p_qs, p_k, p_v, p_pt, p_out, p_lse, p_po, p_plse,
                qk_scale, v_scale, num_pages, max_pages,
                stride_qt, stride_qh, stride_qst, stride_qsh,
                stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                stride_ptb, stride_ot, stride_oh, stride_lt,
                GROUP, Q_LEN, D, PAGE, BLOCK_M, HAS_Q_SCALE, USE_FP8_DOT, HAS_LSE, DOT_F32, NUM_STAGES, BLOCK_N, KV_FP8,
                WSPLIT, WS_MIN_TILES,
            )
            if STAMPS:
                c_last, s_last, s_chunks, s_tiles = _stamps_chunk(p_row, t0, t1, s_chunks, s_tiles, DOT_F32)
            if FUSED:
                if (start < g0) | (start + n > g1):
                    # chunk c of an item that starts in bin p_s and spans n_chunks bins
                    p_s, n_chunks, g, slot0, in_group = _merge_group_of(start, n, budget, pid, FUSED_C)
                    if arrived_last(p_gcount + slot0, in_group):
                        tl.store(p_gcount + slot0, 0)
                        _combine_group(i, p_s, n_chunks, g, 0, p_po, p_plse, p_glse, p_count, p_out, p_lse,
                                       stride_ot, stride_oh, stride_lt, HKV, GROUP, Q_LEN, D, FUSED_M, HAS_LSE,
                                       FUSED_C, D, FUSED_UNROLL, MERGE_ONE_PASS)
                        if STAMPS:
                            s_merge_end, s_merge_ns, s_merges = _stamps_merge(slot0, s_last, s_merge_ns, s_merges,
                                                                              DOT_F32)
            i += 1
            if PREFETCH:
                b = b_nx
                n = n_nx
                start = end_nx - (HKV - i % HKV) * n
                len_b = len_nx
            else:
                b, n, start = _item_at(i, n_items, p_tiles, p_req_end, HKV)
            go = _item_in_bin(i, n_items, start, n, g1)
        if STAMPS:
            _stamps_close(p_row, pid, i, c_last, s_last, s_chunks, s_tiles, s_merges, s_merge_ns, s_merge_end,
                          DOT_F32)


# The STAMPS build's bookkeeping, shared by this kernel and the Gluon fp8 kernel
# (attention/gluon_kernels.py): scalar helpers over one program's row of the stamp buffer.
@triton.jit
def _stamps_open(p_stamp, pid, start, s_entry, s_wait, c_entry, c_wait, DOT_F32: tl.constexpr):
    """Store what a program knows once its first item's metadata is in (``start`` read); return
    its row and the loop's zeroed counters (c_last, s_last, chunks, tiles, merges, merge_ns,
    merge_end)."""
    c_meta = clock64(start, DOT_F32)
    s_meta = globaltimer_ns(start, DOT_F32)
    p_row = p_stamp + pid.to(tl.int64) * _STAMP_SLOTS
    tl.store(p_row + _T_ENTRY, s_entry)
    tl.store(p_row + _T_WAIT, s_wait)
    tl.store(p_row + _T_META, s_meta)
    tl.store(p_row + _C_ENTRY, c_entry)
    tl.store(p_row + _C_WAIT, c_wait)
    tl.store(p_row + _C_META, c_meta)
    tl.store(p_row + _T_FIRST, s_meta * 0)
    tl.store(p_row + _C_FIRST, c_meta * 0)
    z = s_meta * 0
    return p_row, z, z, z, z, z, z, z


@triton.jit
def _stamps_chunk(p_row, t0, t1, s_chunks, s_tiles, DOT_F32: tl.constexpr):
    """After a chunk's attention (tiles [t0, t1)): its end stamps, the first chunk's stored."""
    c_last = clock64(t1, DOT_F32)
    s_last = globaltimer_ns(t1, DOT_F32)
    if s_chunks == 0:
        tl.store(p_row + _T_FIRST, s_last)
        tl.store(p_row + _C_FIRST, c_last)
    return c_last, s_last, s_chunks + 1, s_tiles + tl.maximum(t1 - t0, 0)


@triton.jit
def _stamps_merge(dep, s_last, s_merge_ns, s_merges, DOT_F32: tl.constexpr):
    """After a group merge (run after ``dep``) that followed the chunk ending at ``s_last``."""
    s_merge_end = globaltimer_ns(dep, DOT_F32)
    return s_merge_end, s_merge_ns + (s_merge_end - s_last), s_merges + 1


@triton.jit
def _stamps_close(p_row, pid, i, c_last, s_last, s_chunks, s_tiles, s_merges, s_merge_ns, s_merge_end,
                  DOT_F32: tl.constexpr):
    """A program's end: the loop's counters, its SM, the end stamps (after ``i``, its last item)."""
    tl.store(p_row + _T_LAST, s_last)
    tl.store(p_row + _T_SM, sm_id(pid, DOT_F32).to(tl.int64))
    tl.store(p_row + _T_CHUNKS, s_chunks)
    tl.store(p_row + _T_MERGES, s_merges)
    tl.store(p_row + _T_MERGE_NS, s_merge_ns)
    tl.store(p_row + _T_TILES, s_tiles)
    tl.store(p_row + _T_MERGE_END, s_merge_end)
    tl.store(p_row + _C_LAST, c_last)
    tl.store(p_row + _C_END, clock64(i, DOT_F32))
    tl.store(p_row + _T_END, globaltimer_ns(i, DOT_F32))


@triton.jit
def _combine_slot(first, pid, c, IS_STATIC: tl.constexpr):
    # Partial slot of chunk c of the item being combined. Static: the item's SPLITS
    # consecutive slots. Plan: the item's first chunk is in its starting bin's tail slot
    # (2 * pid + 1), its later chunks at the head slot of each following bin.
    if IS_STATIC:
        return first + c
    else:
        return tl.where(c == 0, first, 2 * (pid + c))


@triton.jit
def _merge_chunks(p_po, p_plse, first, pid, c_lo, c_hi, o_m, o_d, m_row,
                  ROWS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_C: tl.constexpr, IS_STATIC: tl.constexpr, C_STRIDE: tl.constexpr = 1,
                  ONE_PASS: tl.constexpr = False):
    """(max, sum of weights, weighted sum) of chunks [c_lo, c_hi) of one item, columns o_d.

    Each chunk is a normalised output (``p_po``) with its LSE (``p_plse``); chunk c sits in
    the slot of the item's chunk c * C_STRIDE (C_STRIDE > 1: merged groups, each left in
    the slot of its first chunk).

    Purely elementwise: each thread merges its own outputs in chunk order, and the row
    statistics are [BLOCK_M] vectors read by small loads (fewer values than threads, so
    the compiler gives them the accumulator's row layout instead of converting through
    shared memory). No cross-thread reduction: deterministic, racecheck clean. BLOCK_C
    chunks per step, unrolled with no dependence between their loads, so they are in
    flight together: one pass for the step's max, one that adds each chunk under its
    weight. ``.cg`` loads: inside the attention kernel (fused combine) the partials were
    written by other programs of the same grid, and L1 is not coherent across SMs.

    ONE_PASS (the fused combine's, ``decode.MERGE_ONE_PASS``; the default since round BQ: 0.9885
    of the two-pass time on the TP8 slice):
    a step loads each chunk's LSE once and its output with it, all before a
    branch on ``c0 + first >= 0`` (always true; it varies with the step, so the compiler can
    neither fold it nor take it out of the loop: ``first >= 0`` left no branch between a
    step's loads and its reads, and ``c0 >= 0`` folds at the second level, where c0 starts
    at 0), then reads them. The loads are masked, as a fence needs: an unmasked load read
    only inside the branch may be moved below it (round BP). The two-pass body's
    sm_90 build takes 2-3 memory round trips a step where its addresses need 1 (ptxas puts
    some second-pass loads after reads of the first); the branch keeps every load of a step
    ahead of the first read. The same operations in the same order: the same bits. Not in
    the combine kernel: its 32-chunk steps under its register cap would spill (84 bytes).
    """
    b_m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if ONE_PASS:
        for c0 in range(c_lo, c_hi, BLOCK_C):
            lses = ()
            outs = ()
            for j in tl.static_range(BLOCK_C):
                slot = _combine_slot(first, pid, (c0 + j) * C_STRIDE, IS_STATIC)
                live = m_row & (c0 + j < c_hi)
                o_prow = slot.to(tl.int64) * ROWS + o_m
                lses = lses + (tl.load(p_plse + o_prow, mask=live, other=float("-inf"), cache_modifier=".cg"),)
                outs = outs + (tl.load(p_po + o_prow[:, None] * D + o_d[None, :], mask=live[:, None], other=0.0,
                                       cache_modifier=".cg"),)
            if c0 + first >= 0:
                b_mnew = b_m
                for j in tl.static_range(BLOCK_C):
                    b_mnew = tl.maximum(b_mnew, lses[j])
                b_msafe = tl.where(b_mnew == float("-inf"), 0.0, b_mnew)
                b_a = tl.exp2(b_m - b_msafe)
                b_acc = b_acc * b_a[:, None]
                b_l = b_l * b_a
                for j in tl.static_range(BLOCK_C):
                    b_w = tl.exp2(lses[j] - b_msafe)
                    b_acc += outs[j] * b_w[:, None]
                    b_l += b_w
                b_m = b_mnew
        return b_m, b_l, b_acc
    for c0 in range(c_lo, c_hi, BLOCK_C):
        b_mnew = b_m
        for j in tl.static_range(BLOCK_C):
            slot = _combine_slot(first, pid, (c0 + j) * C_STRIDE, IS_STATIC)
            b_lj = tl.load(p_plse + slot.to(tl.int64) * ROWS + o_m, mask=m_row & (c0 + j < c_hi),
                           other=float("-inf"), cache_modifier=".cg")
            b_mnew = tl.maximum(b_mnew, b_lj)
        b_msafe = tl.where(b_mnew == float("-inf"), 0.0, b_mnew)
        b_a = tl.exp2(b_m - b_msafe)
        b_acc = b_acc * b_a[:, None]
        b_l = b_l * b_a
        for j in tl.static_range(BLOCK_C):
            slot = _combine_slot(first, pid, (c0 + j) * C_STRIDE, IS_STATIC)
            live = m_row & (c0 + j < c_hi)
            o_prow = slot.to(tl.int64) * ROWS + o_m
            b_w = tl.exp2(tl.load(p_plse + o_prow, mask=live, other=float("-inf"), cache_modifier=".cg") - b_msafe)
            b_oc = tl.load(p_po + o_prow[:, None] * D + o_d[None, :], mask=live[:, None], other=0.0,
                           cache_modifier=".cg")
            b_acc += b_oc * b_w[:, None]
            b_l += b_w
        b_m = b_mnew
    return b_m, b_l, b_acc


@triton.jit
def _store_final(p_out, p_lse, b, h, b_m, b_l, b_acc, o_m, o_d, m_row, stride_ot, stride_oh, stride_lt,
                 GROUP: tl.constexpr, Q_LEN: tl.constexpr, HAS_LSE: tl.constexpr, WRITE_LSE):
    m_live = b_l > 0.0
    b_o = tl.where(m_live[:, None], b_acc / tl.where(m_live, b_l, 1.0)[:, None], 0.0)
    i_tok = b * Q_LEN + o_m // GROUP
    i_head = h * GROUP + (o_m % GROUP)
    p_orow = p_out + i_tok.to(tl.int64) * stride_ot + i_head * stride_oh
    tl.store(p_orow[:, None] + o_d[None, :], b_o.to(p_out.dtype.element_ty), mask=m_row[:, None])
    if HAS_LSE:
        if WRITE_LSE:
            b_lse = tl.where(m_live, (b_m + tl.log2(tl.where(m_live, b_l, 1.0))) * LN2, float("-inf"))
            tl.store(p_lse + i_tok.to(tl.int64) * stride_lt + i_head, b_lse, mask=m_row)


@triton.jit
def _combine_group(item, p, n_chunks, g, pid_d, p_po, p_plse, p_glse, p_count, p_out, p_lse,
                   stride_ot, stride_oh, stride_lt,
                   HKV: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                   UNROLL: tl.constexpr, ONE_PASS: tl.constexpr = False):
    """Group g (chunks [g * BLOCK_C, +BLOCK_C)) of the plan item that starts in bin p, read
    UNROLL chunks per load step (the combine kernel: the whole group; the fused combine,
    which merges every column in one program: fewer, to bound its registers).

    One group: the item's output is finished here. Several: the group's normalised output
    goes in place over its first chunk's columns (this program is their only reader), its
    LSE to ``glse`` (column block 0 writes it; every column block computes the same value;
    not over the chunk's LSE, which the group's other column blocks may still read), then
    an arrival counter per start bin picks the last of the item's groups x column blocks,
    which merges the groups like chunks (:func:`_merge_chunks`) over the whole head dim,
    in group order (deterministic), and puts the counter back to zero. An item of
    hundreds of chunks (the TP8 slice) is then merged by hundreds of programs in one step
    each, not by D / BLOCK_D programs in one step per BLOCK_C chunks (round F: 19.7 us).
    """
    ROWS: tl.constexpr = GROUP * Q_LEN
    ND: tl.constexpr = D // BLOCK_D
    b = item // HKV
    h = item % HKV
    o_m = tl.arange(0, BLOCK_M)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_row = o_m < ROWS
    first = 2 * p + 1
    c_lo = g * BLOCK_C
    b_m, b_l, b_acc = _merge_chunks(p_po, p_plse, first, p, c_lo, tl.minimum(n_chunks, c_lo + BLOCK_C), o_m, o_d,
                                    m_row, ROWS, D, BLOCK_M, BLOCK_D, UNROLL, False, 1, ONE_PASS)
    n_groups = (n_chunks + BLOCK_C - 1) // BLOCK_C
    if n_groups == 1:
        _store_final(p_out, p_lse, b, h, b_m, b_l, b_acc, o_m, o_d, m_row, stride_ot, stride_oh, stride_lt,
                     GROUP, Q_LEN, HAS_LSE, pid_d == 0)
    else:
        slot0 = _combine_slot(first, p, c_lo, False).to(tl.int64)
        o_srow = slot0 * ROWS + o_m
        m_live = b_l > 0.0
        b_o = tl.where(m_live[:, None], b_acc / tl.where(m_live, b_l, 1.0)[:, None], 0.0)
        tl.store(p_po + o_srow[:, None] * D + o_d[None, :], b_o, mask=m_row[:, None])
        if pid_d == 0:
            b_lse2 = tl.where(m_live, b_m + tl.log2(tl.where(m_live, b_l, 1.0)), float("-inf"))
            tl.store(p_glse + o_srow, b_lse2, mask=m_row)
        if arrived_last(p_count + p, n_groups * ND):
            # [BLOCK_M, DF] column chunks of at most 4096 values, UG groups per load step (at
            # most 8192 values in flight: 64 registers a thread at 4 warps)
            DF: tl.constexpr = D if BLOCK_M * D <= 4096 else 4096 // BLOCK_M
            UG: tl.constexpr = 8 if BLOCK_M * DF <= 1024 else 8192 // (BLOCK_M * DF)
            for f0 in tl.static_range(0, D, DF):
                o_f = f0 + tl.arange(0, DF)
                f_m, f_l, f_acc = _merge_chunks(p_po, p_glse, first, p, 0, n_groups, o_m, o_f, m_row,
                                                ROWS, D, BLOCK_M, DF, UG, False, BLOCK_C, ONE_PASS)
                _store_final(p_out, p_lse, b, h, f_m, f_l, f_acc, o_m, o_f, m_row, stride_ot, stride_oh, stride_lt,
                             GROUP, Q_LEN, HAS_LSE, f0 == 0)
            tl.store(p_count + p, 0)


@triton.jit(do_not_specialize=["B", "splits"])
def combine_kernel(
    p_tiles, p_req_end, p_prog_start, p_meta, p_po, p_plse, p_glse, p_count, p_out, p_lse,
    B, splits, stride_ot, stride_oh, stride_lt,
    NP: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, IS_STATIC: tl.constexpr, HAS_LSE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the partial chunks of split items under one softmax normalisation.

    Plan: program (bin q, column block d) has up to two roles. Tail: the item that starts
    in bin q and continues past it (its chunk 0 is q's tail slot) -> its group 0. Head:
    the item that reaches bin q from an earlier start bin p (its chunk q - p is q's head
    slot) -> its group (q - p) / BLOCK_C when q - p is a multiple of BLOCK_C. So every
    group of BLOCK_C chunks has its own program, found with O(1) loads and no work list
    (see :func:`_combine_group`). Static: program (item, d) merges the item's SPLITS
    slots in steps of BLOCK_C.
    """
    ROWS: tl.constexpr = GROUP * Q_LEN
    # One grid axis, column block fastest: the D / BLOCK_D programs of a bin are dispatched
    # together, in bin order.
    ND: tl.constexpr = D // BLOCK_D
    pid = tl.program_id(0) // ND
    pid_d = tl.program_id(0) % ND
    if PDL:
        gdc_wait()  # launched while the attention kernel runs: wait for its partials
    n_items = B * HKV
    if IS_STATIC:
        if pid < n_items:
            o_m = tl.arange(0, BLOCK_M)
            o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
            m_row = o_m < ROWS
            b_m, b_l, b_acc = _merge_chunks(p_po, p_plse, pid * splits, pid, 0, splits, o_m, o_d, m_row,
                                            ROWS, D, BLOCK_M, BLOCK_D, BLOCK_C, True)
            _store_final(p_out, p_lse, pid // HKV, pid % HKV, b_m, b_l, b_acc, o_m, o_d, m_row,
                         stride_ot, stride_oh, stride_lt, GROUP, Q_LEN, HAS_LSE, pid_d == 0)
    else:
        total = tl.load(p_meta + 0)
        budget = tl.maximum(tl.load(p_meta + 1), 1)
        g0 = pid * budget
        g1 = tl.minimum(g0 + budget, total)
        # Both roles' loads are issued before either branch: two independent load chains
        # (item -> request -> its tile count and end) overlap instead of running back to back.
        # tail role: the item containing the first tile of bin q + 1, if it starts in bin q
        t_item = tl.load(p_prog_start + pid + 1)
        t_b = tl.minimum(t_item, n_items - 1) // HKV
        # head role: the item containing the first tile of bin q, if it started in an earlier bin
        h_item = tl.load(p_prog_start + pid)
        h_b = tl.minimum(h_item, n_items - 1) // HKV
        t_n = tl.load(p_tiles + t_b)
        h_n = tl.load(p_tiles + h_b)
        t_start = tl.load(p_req_end + t_b) - (HKV - t_item % HKV) * t_n
        h_start = tl.load(p_req_end + h_b) - (HKV - h_item % HKV) * h_n
        if (t_item < n_items) & (t_start >= g0) & (t_start < g1) & (t_start + t_n > g1):
            n_chunks = (t_start + t_n - 1) // budget - pid + 1
            _combine_group(t_item, pid, n_chunks, 0, pid_d, p_po, p_plse, p_glse, p_count, p_out, p_lse,
                           stride_ot, stride_oh, stride_lt, HKV, GROUP, Q_LEN, D, BLOCK_M, HAS_LSE, BLOCK_C, BLOCK_D,
                           BLOCK_C)
        # (two inlined calls: one loop over both roles kept the slots from folding, 213 registers)
        p = h_start // budget
        c = pid - p
        if (h_item < n_items) & (h_start < g0) & (g0 < total) & (c % BLOCK_C == 0):
            n_chunks = (h_start + h_n - 1) // budget - p + 1
            _combine_group(h_item, p, n_chunks, c // BLOCK_C, pid_d, p_po, p_plse, p_glse, p_count, p_out, p_lse,
                           stride_ot, stride_oh, stride_lt, HKV, GROUP, Q_LEN, D, BLOCK_M, HAS_LSE, BLOCK_C, BLOCK_D,
                           BLOCK_C)
