"""Pure Triton kernels of the router: the split-weight GEMM and the scoring + top-k pass.

Tensors (row-major, unit stride in the last dimension):

    x        [M, K]            bf16   hidden states
    w_hi     [N, K]            bf16   bf16(w), round to nearest even
    w_lo     [N, K]            bf16   bf16((w - w_hi) * 256)
    w_lo2    [N, K]            bf16   bf16(((w - w_hi) * 256 - w_lo) * 256)   (read if NUM_TERMS == 3)
    out      [M, N]            fp32   x @ w_hi^T + (x @ w_lo^T + (x @ w_lo2^T) / 256) / 256
    part     [NUM_SPLITS, M, N] fp32  per-split partial sums (split-K only)
    count    [tiles]           int32  arrivals per output tile; zero between calls

Split-K without float atomics: every program of a tile writes its partial to
``part`` and then bumps the tile's arrival counter; the program that arrives last
sums the NUM_SPLITS partials *in split order* (so the result never depends on which
program finished first), writes ``out`` and puts the counter back to zero, so the
workspace is ready for the next call or CUDA-graph replay without a memset.
``router_gemm_fp32_splitk_kernel`` does the same for small M on CUDA cores from the
fp32 weight itself (4 bytes a weight, no split of w; docs/perf-notes/router.md, round F).

Split-K with float atomics (``RED_ATOMIC``, a config's ``reduce="atomic"``; round BW): ``zero_out_kernel`` zeroes
``out`` first, then every program adds its partial into ``out`` with relaxed fp32 atomic adds
(``atom.global.add.f32``, result unused) and exits: no partials, no counter, no last program's reload (the counter's
chain is three dependent L2 round trips, round BI). The price is the order: the slices' partials meet in the order
the programs arrive, so from three slices a result's last bits may differ from call to call (two slices: 0 + a + b
is a + b either way). Neither batch-invariant mode nor ``torch.use_deterministic_algorithms`` takes it
(``router_gemm``).

``PDL`` (every kernel here): launched with programmatic dependent launch, a kernel waits at its
top for the kernel ahead of it to finish and flush (``pdl_enter``) and then lets the next one
launch, so the launch of a router call overlaps the end of the kernel before it (round AD).
``PREFETCH_W`` (the GEMMs, with PDL): before that wait the programs of the first row tile ask L2
for the weight lines they will read (``prefetch_l2``: a hint, never stale data; the other row
tiles read the same lines), so the weight's DRAM reads overlap the kernel ahead too; x, which that
kernel may write, is read only after the wait. ``PRELOAD_W`` (the CUDA-core ``fp32-simt`` kernel, round BM)
goes further: its first weight block is *loaded* into registers before the wait, which is correct only where
the kernel ahead does not write the weight (see ``router_gemm``).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from evenflow._kernels.common import arrived_last, dot_operand, pdl_enter, prefetch_rows


@triton.jit
def _sum_splits(p_split0, split_stride, m_tile, NUM_SPLITS: tl.constexpr, RED_CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Sum of the NUM_SPLITS partial tiles at ``p_split0 + s * split_stride``, in split order
    (deterministic). RED_CHUNK partials per round trip: the statically unrolled loads of a
    chunk are independent, so they are in flight together (round 3 loaded one partial per
    dependent L2 round trip: 16-24 of them were most of the small-M time; router notes,
    round 4). ``.cg``: written by other programs. A masked-off split adds +0.0, so the sum
    is bitwise that of the plain loop. MASKED: apply ``m_tile`` (else the tile is padded)."""
    b_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, RED_CHUNK):
        for j in tl.static_range(RED_CHUNK):
            live = s0 + j < NUM_SPLITS
            if MASKED:
                live = m_tile & live
            b_sum += tl.load(p_split0 + (s0 + j) * split_stride, mask=live, other=0.0, cache_modifier=".cg")
    return b_sum


@triton.jit
def _split_tile(M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output tile (grid axis 0, N fastest) and K slice [k_start, k_end) (axis 1)."""
    i_mn = tl.program_id(0)
    i_s = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    o_m = (i_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = (i_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    # K_SPLIT is a multiple of BLOCK_K (launch_shape) but not specialised (do_not_specialize):
    # without the hint the compiler cannot prove 16-byte alignment of `p + k` and Triton's
    # software pipeliner refuses cp.async for every load of the K loop (round-B finding: the
    # sm_90 TTGIR had no async copies at all).
    k_start = tl.multiple_of(i_s * K_SPLIT, BLOCK_K)
    k_end = tl.minimum(k_start + K_SPLIT, K)
    return i_mn, i_s, o_m, o_n, o_k, o_m < M, o_n < N, k_start, k_end


@triton.jit(do_not_specialize=["M"])
def zero_out_kernel(p_out, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """``out[:M, :N] = 0`` ahead of an atomic split-K launch (``RED_ATOMIC``). With PDL it lets that launch go
    first (its programs may start, and prefetch or preload their weight, while this one waits), then waits for the
    kernel ahead before it writes (``out`` may be memory that kernel still reads); the GEMM's own wait then covers
    this kernel and, through it, the one ahead."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :],
             tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value, ties to even, as fp32 (finite ``x``): integer ops on
    the bits, exact in the interpreter too (whose fp32 -> bf16 casts truncate)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_and_rest(x):
    """(bf16(x), round to nearest even; x - bf16(x) in fp32, exact), two values an instruction: one
    ``cvt.rn.bf16x2.f32`` per pair (Triton's casts convert a value at a time, at the conversion unit's
    quarter rate, when the bf16 value is widened again), the widening two integer ops."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 h0, h1; "
        "cvt.rn.bf16x2.f32 $0, $4, $3; "
        "shl.b32 h0, $0, 16; and.b32 h1, $0, 0xFFFF0000; "
        "sub.rn.f32 $1, $3, h0; sub.rn.f32 $2, $4, h1; }",
        "=r,=r,=r,r,r", [x], dtype=(tl.bfloat16, tl.float32), is_pure=True, pack=2)


@triton.jit
def _split_in_registers(w, NUM_TERMS: tl.constexpr, INTERPRET: tl.constexpr):
    """bf16 (hi, lo, lo2) of an fp32 weight tile: ``split_weight``'s parts with lo scaled by 2^-8 and lo2 by
    2^-16 (lo2 = lo when NUM_TERMS == 2). Every step but the roundings is exact, and a power-of-two scale
    commutes with them while the values stay in fp32's normal range (bf16 has fp32's exponent range), so the
    products and their fp32 sums are the stored split's times 2^-8 / 2^-16, bit for bit, for weights whose
    remainders stay normal (|w| above ~2^-100: a router weight is ~1e-2; far below, the low terms reach the
    subnormals and the two splits can differ in their last bits); the caller leaves out the epilogue's 1/256
    factors. INTERPRET: the integer rounding (the interpreter runs no PTX, and its casts truncate)."""
    if INTERPRET:
        hi_f = _round_bf16(w)
        r = w - hi_f  # exact
        lo_f = _round_bf16(r)
        hi = hi_f.to(tl.bfloat16)  # exact casts: the values are bf16 values already
        lo = lo_f.to(tl.bfloat16)
        lo2 = lo
        if NUM_TERMS == 3:
            lo2 = _round_bf16(r - lo_f).to(tl.bfloat16)
    else:
        hi, r = _bf16_and_rest(w)
        lo, r2 = _bf16_and_rest(r)
        lo2 = lo
        if NUM_TERMS == 3:
            lo2 = r2.to(tl.bfloat16)  # packed pairs: nothing widens it again
    return hi, lo, lo2


@triton.jit
def _step_masks(k, k_end, o_k, m_m, m_n, EVEN_K: tl.constexpr):
    """(x mask [BLOCK_M, BLOCK_K], w^T mask [BLOCK_K, BLOCK_N]) of the K step at ``k`` (the slice ends at k_end)."""
    if EVEN_K:
        m_xk = m_m[:, None]
        m_wk = m_n[None, :]
    else:
        m_k = (k + o_k) < k_end
        m_xk = m_m[:, None] & m_k[None, :]
        m_wk = m_k[:, None] & m_n[None, :]
    return m_xk, m_wk


@triton.jit
def _step_dots(b_x, b_wh, b_wl, b_wl2, acc_nhi, acc_lo, acc_lo2, NUM_TERMS: tl.constexpr, DOT_F32: tl.constexpr):
    """One K step's products into the three accumulators (the order ``router_gemm_kernel``'s comment gives)."""
    b_xd = dot_operand(b_x, DOT_F32)
    acc_nhi = acc_nhi - tl.dot(b_xd, dot_operand(b_wh, DOT_F32))
    acc_lo = tl.dot(b_xd, dot_operand(b_wl, DOT_F32), acc_lo)
    if NUM_TERMS == 3:
        acc_lo2 = tl.dot(b_xd, dot_operand(b_wl2, DOT_F32), acc_lo2)
    return acc_nhi, acc_lo, acc_lo2


@triton.jit(do_not_specialize=["M", "K_SPLIT", "NUM_SPLITS"])
def router_gemm_kernel(
    p_x, p_whi, p_wlo, p_wlo2, p_out, p_part, p_count,
    M, N, K, K_SPLIT, NUM_SPLITS,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, NUM_TERMS: tl.constexpr, DOT_F32: tl.constexpr,
    RED_CHUNK: tl.constexpr, PDL: tl.constexpr, PREFETCH_W: tl.constexpr, W_FP32: tl.constexpr,
    RED_ATOMIC: tl.constexpr = False, PRELOAD_W: tl.constexpr = False,
):
    """The split-weight GEMM on tensor cores (see the module docstring for the tensors).

    PRELOAD_W (launch ``pdl-preload`` on path ``fp32-tc``, where every K slice is one BLOCK_K step: the launcher's
    choice; round BW): the K loop's one trip without the loop, the slice's fp32 weight loaded and split in registers
    *before* ``pdl_enter``'s wait, so its bytes cross into the SM while the kernel ahead finishes; x is read after
    it. As for the CUDA-core kernel's preload, correct whenever the kernel ahead does not write the fp32 weight (see
    ``router_gemm``).

    W_FP32 (path ``fp32-tc``): ``p_whi`` is the fp32 weight itself (``p_wlo`` / ``p_wlo2`` unused)
    and every K step splits its tile in registers as ``split_weight`` does (round to nearest
    even, the same exact fp32 steps; the low terms scaled by powers of two, which the epilogue
    leaves out), so the output is the same bits as the stored split's at the same config, for 4
    bytes a weight read instead of 2 x NUM_TERMS (docs/perf-notes/router.md, round AH). DOT_F32 is
    True when the interpreter runs the kernel; the split then takes integer rounding instead of the
    inline PTX. (Launches recorded for an emulated GPU, ``_compile_check.emulate_gpu``, carry False,
    as a GPU's do: they are compiled, not run; run in the interpreter they would reach the PTX.)
    """
    i_mn, i_s, o_m, o_n, o_k, m_m, m_n, k_start, k_end = _split_tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    if PRELOAD_W:  # the slice's one step of the weight, in registers before the wait (no memory written)
        tl.static_assert(W_FP32, "PRELOAD_W reads the fp32 weight (path fp32-tc)")
        p_w0 = p_whi + o_n.to(tl.int64)[None, :] * stride_wn + o_k[:, None]
        m_w0 = _step_masks(k_start, k_end, o_k, m_m, m_n, EVEN_K)[1]
        b_w0 = _split_in_registers(tl.load(p_w0 + k_start, mask=m_w0, other=0.0), NUM_TERMS, DOT_F32)
    elif PREFETCH_W:
        k_pf = tl.where(i_mn < tl.cdiv(N, BLOCK_N), k_end, k_start)  # the first row tile only (else no trip)
        if W_FP32:
            prefetch_rows(p_whi, o_n, m_n, stride_wn, k_start, k_pf, BLOCK_K, 32)
        else:
            prefetch_rows(p_whi, o_n, m_n, stride_wn, k_start, k_pf, BLOCK_K, 64)
            prefetch_rows(p_wlo, o_n, m_n, stride_wn, k_start, k_pf, BLOCK_K, 64)
            if NUM_TERMS == 3:
                prefetch_rows(p_wlo2, o_n, m_n, stride_wn, k_start, k_pf, BLOCK_K, 64)
    pdl_enter(PDL)

    p_xb = p_x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :]
    o_w = o_n.to(tl.int64)[None, :] * stride_wn + o_k[:, None]  # [BLOCK_K, BLOCK_N] view of w^T
    p_whb = p_whi + o_w
    p_wlb = p_wlo + o_w
    p_wl2b = p_wlo2 + o_w

    # Accumulation order (docs/perf-notes/router.md, "accuracy, round 2"): the high
    # product starts a FRESH tensor-core accumulator every BLOCK_K step and is added to
    # acc_hi with an ordinary round-to-nearest fp32 add. Chaining it through the MMA
    # accumulator over all of K lets the tensor core's own accumulate rounding (not
    # round-to-nearest on NVIDIA parts) pile up at the magnitude of the full sum; on the
    # H200 that cost 2-3x the fp32 error at K >= 4096 without split-K. The low terms
    # are chained: their rounding is scaled by 2^-8 / 2^-16 in the epilogue.
    # acc_nhi holds MINUS the high sum and is updated with a subtraction: Triton's
    # combiner rewrites `acc + dot(a, b)` into `dot(a, b, acc)` (the chained form we
    # must avoid) but leaves `acc - dot(a, b)` alone. Negation is exact, so this is the
    # same sum, rounded the same way.
    acc_nhi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_lo2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRELOAD_W:  # the slice is one BLOCK_K step: the loop's one trip, without the loop
        b_x = tl.load(p_xb + k_start, mask=_step_masks(k_start, k_end, o_k, m_m, m_n, EVEN_K)[0], other=0.0)
        b_wh, b_wl, b_wl2 = b_w0
        acc_nhi, acc_lo, acc_lo2 = _step_dots(b_x, b_wh, b_wl, b_wl2, acc_nhi, acc_lo, acc_lo2, NUM_TERMS, DOT_F32)
    else:  # (its loads and dots as before round BW, so the loop builds of the table's entries stay what they were)
        for k in range(k_start, k_end, BLOCK_K):
            m_xk, m_wk = _step_masks(k, k_end, o_k, m_m, m_n, EVEN_K)
            b_x = tl.load(p_xb + k, mask=m_xk, other=0.0)
            if W_FP32:
                b_wh, b_wl, b_wl2 = _split_in_registers(tl.load(p_whb + k, mask=m_wk, other=0.0), NUM_TERMS, DOT_F32)
            else:
                b_wh = tl.load(p_whb + k, mask=m_wk, other=0.0)
                b_wl = tl.load(p_wlb + k, mask=m_wk, other=0.0)
            b_xd = dot_operand(b_x, DOT_F32)
            acc_nhi = acc_nhi - tl.dot(b_xd, dot_operand(b_wh, DOT_F32))
            acc_lo = tl.dot(b_xd, dot_operand(b_wl, DOT_F32), acc_lo)
            if NUM_TERMS == 3:
                if not W_FP32:
                    b_wl2 = tl.load(p_wl2b + k, mask=m_wk, other=0.0)
                acc_lo2 = tl.dot(b_xd, dot_operand(b_wl2, DOT_F32), acc_lo2)
    if W_FP32:  # the low terms come pre-scaled (_split_in_registers)
        if NUM_TERMS == 3:
            acc_lo = acc_lo + acc_lo2
        b_out = acc_lo - acc_nhi
    else:
        if NUM_TERMS == 3:
            acc_lo = acc_lo + acc_lo2 * 0.00390625  # 1/256, exact
        b_out = acc_lo * 0.00390625 - acc_nhi

    m_out = m_m[:, None] & m_n[None, :]
    o_out = o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :]
    if not HAS_SPLIT:
        tl.store(p_out + o_out, b_out, mask=m_out)
    elif RED_ATOMIC:  # out zeroed by zero_out_kernel; the slices meet in arrival order
        tl.atomic_add(p_out + o_out, b_out, mask=m_out, sem="relaxed")
    else:
        o_part = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
        plane = M.to(tl.int64) * N
        tl.store(p_part + i_s * plane + o_part, b_out, mask=m_out)
        if arrived_last(p_count + i_mn, NUM_SPLITS):
            b_sum = _sum_splits(p_part + o_part, plane, m_out, NUM_SPLITS, RED_CHUNK, BLOCK_M, BLOCK_N, True)
            tl.store(p_out + o_out, b_sum, mask=m_out)
            tl.store(p_count + i_mn, 0)


@triton.jit(do_not_specialize=["M"])
def router_gemm_fp32_kernel(
    p_x, p_w, p_out,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_W: tl.constexpr, PRELOAD_W: tl.constexpr = False, ONE_BLOCK: tl.constexpr = False,
):
    """Small-M router GEMM on CUDA cores from the ORIGINAL fp32 weight ``w [N, K]``.

    One program owns BLOCK_N weight rows (output columns) and BLOCK_M rows of x, and
    streams its whole K: no split-K, no workspace, no atomics (deterministic). Each K
    block's products are exact-rounded fp32 (bf16 x widened exactly) summed by a fixed
    tree, then added to the running fp32 sum: error like an fp32 GEMM. The next K
    block is loaded before the current one is reduced (register double buffering), so
    one block's loads are always in flight without relying on the software pipeliner.

    PRELOAD_W (launch ``pdl-preload``, with PDL): the first K block of the weight is loaded into registers
    *before* ``pdl_enter``'s wait, so its bytes cross into the SM while the kernel ahead finishes (the whole
    weight where BLOCK_K >= K); x, which the kernel ahead may write, is still read after the wait. Correct
    whenever the kernel ahead does not write the weight (``router_gemm`` says when it uses it; round BM).

    ONE_BLOCK (the launcher's ``one_block``; only where K <= BLOCK_K): the whole K is the first block, so the K loop
    and its prefetch of a second block are left out. That loop's one trip issues the second block's loads masked off
    and holds their registers (the trip count is a run-time value): 104 -> 56 registers and 499 -> 377 sm_90 SASS
    instructions a warp (NOPs aside) at K4096 M = 4's 4 x 2 x 4096 tile on 16 warps (round BO, CPU). The same
    expression as the loop's one trip; the same bits wherever the compiler gives both builds the same register
    layout, which sets the reduction tree: at every tile of the H200 table on its own launch mode (round BQ3 on the
    GPU; tests check the same fp32 operation sequence on sm_90 and the bits on the GPU), not at every tile (a 4 x 2 x
    64 tile on 2 warps came out a few ulps apart, within the rule). 0.88-0.93 of the loop's time at M = 4, 0.94-1.03
    at M = 1 (round BQ3: two of nine passes level). Round BM8 measured an earlier form, the sum without the branch
    below, at 1.086x the loop's time at K4096 M = 1, and withdrew it.
    """
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    # x as [BLOCK_M, 1, BLOCK_K] and the weight as [1, BLOCK_N, BLOCK_K]: both loaded in the product's own 3-D
    # layout, so their broadcast needs no conversion (2-D loads widened by [:, None, :] went through shared memory
    # every block; round BN)
    o_kx = o_k
    if BLOCK_M * BLOCK_N > 1:
        # x's K offsets as runs of 4: the compiler then loads x 4 elements a thread, the layout it gives the fp32
        # weight (bf16 x alone would take 8). Where both tiles are [1, 1, BLOCK_K] they share one layout as they are.
        o_kx = o_k // 4 * 4 + o_k % 4
    p_xb = p_x + o_m.to(tl.int64)[:, None, None] * stride_xm + o_kx[None, None, :]
    p_wb = p_w + o_n.to(tl.int64)[None, :, None] * stride_wn + o_k[None, None, :]
    m_w_rows = m_n[None, :, None]
    m_x_rows = m_m[:, None, None]
    m_w = m_w_rows
    m_x = m_x_rows
    if not EVEN_K:
        m_w = m_w & (o_k < K)[None, None, :]
        m_x = m_x & (o_k < K)[None, None, :]
    if PRELOAD_W:
        b_w = tl.load(p_wb, mask=m_w, other=0.0)
    elif PREFETCH_W:
        prefetch_rows(p_w, o_n, m_n, stride_wn, 0, tl.where(i_m == 0, K, 0), BLOCK_K, 32)  # first row tile only
    pdl_enter(PDL)
    b_x = tl.load(p_xb, mask=m_x, other=0.0)
    if not PRELOAD_W:
        b_w = tl.load(p_wb, mask=m_w, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_BLOCK:
        if K > 0:
            # A branch between the loads and the products (K >= 1 whenever there are products): ptxas moved no
            # load across it in these builds (the sm_90 test checks). Without it, ptxas put a thread's second x
            # load of the 1 x 1 x 4096 tile after the first products, which wait for the first load, so the two
            # load latencies ran one after the other (round BO, CPU; by inference the cause of BM8's 1.086x at
            # K4096 M = 1). Added to the zeros as the loop adds its first block, so a sum of -0.0 gives +0.0 there too.
            acc += tl.sum(b_x.to(tl.float32) * b_w, axis=2)
    else:
        for k in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
            # Prefetch block k (masked off past K: the last iteration loads nothing).
            m_kn = ((k + o_k) < K)[None, None, :]
            b_xn = tl.load(p_xb + k, mask=m_x_rows & m_kn, other=0.0)
            b_wn = tl.load(p_wb + k, mask=m_w_rows & m_kn, other=0.0)
            acc += tl.sum(b_x.to(tl.float32) * b_w, axis=2)
            b_x = b_xn
            b_w = b_wn
    m_out = m_m[:, None] & m_n[None, :]
    tl.store(p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :], acc, mask=m_out)


@triton.jit(do_not_specialize=["M", "K_SPLIT", "NUM_SPLITS"])
def router_gemm_fp32_splitk_kernel(
    p_x, p_w, p_out, p_part, p_count,
    M, N, K, K_SPLIT, NUM_SPLITS,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, RED_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_W: tl.constexpr, RED_ATOMIC: tl.constexpr = False,
):
    """Small-M router GEMM on CUDA cores from the ORIGINAL fp32 weight, K split over the GPU, one launch.

    Grid: (row tiles x column tiles, NUM_SPLITS). Program (i_mn, i_s) owns the output tile
    i_mn (BLOCK_M rows of x, BLOCK_N rows of w) and the K slice [i_s K_SPLIT, (i_s+1) K_SPLIT).

        part   [tiles, NUM_SPLITS, BLOCK_M, BLOCK_N] fp32   tile-major, padded: no masks
        count  [tiles]                              int32  arrivals; zero between calls

    Per slice: every (m, n, k-lane) of a BLOCK_M x BLOCK_N x BLOCK_K register block keeps
    its own fp32 FMA chain over the slice's K steps (bf16 x widened exactly, the fp32
    weight as stored: one rounding per step), then one fixed tree sum over the k-lanes.
    The loads are software-pipelined (``tl.range(num_stages=...)``: cp.async into shared
    memory; a plain ``range`` is not pipelined for loads that feed no dot).
    With HAS_SPLIT, the slice's partial goes to ``part``; the tile's counter is bumped
    (acq_rel, after a CTA barrier so every thread's partial store is ordered before the
    release); the program that arrives last sums the NUM_SPLITS partials in split order
    (the result never depends on arrival order), stores the tile and puts the counter
    back to 0, so the next call or CUDA-graph replay starts clean without a memset.
    """
    i_mn, i_s, o_m, o_n, o_k, m_m, m_n, k_start, k_end = _split_tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    if PREFETCH_W:
        k_pf = tl.where(i_mn < tl.cdiv(N, BLOCK_N), k_end, k_start)  # the first row tile only (else no trip)
        prefetch_rows(p_w, o_n, m_n, stride_wn, k_start, k_pf, BLOCK_K, 32)
    pdl_enter(PDL)

    p_xb = p_x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :]   # [BLOCK_M, BLOCK_K]
    p_wb = p_w + o_n.to(tl.int64)[:, None] * stride_wn + o_k[None, :]   # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            m_xk = m_m[:, None]
            m_wk = m_n[:, None]
        else:
            m_k = (k + o_k) < k_end
            m_xk = m_m[:, None] & m_k[None, :]
            m_wk = m_n[:, None] & m_k[None, :]
        b_x = tl.load(p_xb + k, mask=m_xk, other=0.0).to(tl.float32)
        b_w = tl.load(p_wb + k, mask=m_wk, other=0.0)
        acc = tl.fma(b_x[:, None, :], b_w[None, :, :], acc)
    b_out = tl.sum(acc, axis=2)                                          # [BLOCK_M, BLOCK_N]

    m_out = m_m[:, None] & m_n[None, :]
    p_outb = p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :]
    if not HAS_SPLIT:
        tl.store(p_outb, b_out, mask=m_out)
    elif RED_ATOMIC:  # out zeroed by zero_out_kernel; the slices meet in arrival order
        tl.atomic_add(p_outb, b_out, mask=m_out, sem="relaxed")
    else:
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        o_loc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        p_tile = p_part + i_mn.to(tl.int64) * NUM_SPLITS * TILE + o_loc
        tl.store(p_tile + i_s * TILE, b_out)  # padded rows/columns hold 0 (masked loads)
        if arrived_last(p_count + i_mn, NUM_SPLITS):
            b_sum = _sum_splits(p_tile, TILE, m_out, NUM_SPLITS, RED_CHUNK, BLOCK_M, BLOCK_N, False)
            tl.store(p_outb, b_sum, mask=m_out)
            tl.store(p_count + i_mn, 0)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["T"])
def route_topk_kernel(
    p_logits, p_bias, p_ids, p_weights,
    T, E, stride_lt, routed_scaling,
    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    IS_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
    CLEAR_LOGITS: tl.constexpr = False,
):
    """Scores, top-k and weights for BLOCK_T tokens; a whole expert row per register tile.

    Selection key: the logit (softmax: monotone, so no new ties from rounding) or
    sigmoid(logit) + bias (sigmoid). Order: key descending, ties to the lowest
    expert id. NaN keys are never selected (ids stay in range) but NaN logits still
    poison the weights, and so does a NaN key from the bias, so bad input is visible.

    ``CLEAR_LOGITS`` (``route``'s own logits buffer): the program writes zeros over the logits it read, last, so the
    buffer is all zero again for the next ``route`` call, whose atomic split-K GEMM adds into it with no zeroing
    kernel ahead. A barrier first: a tile's elements are loaded and stored by different threads.
    """
    pdl_enter(PDL)
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    m_t = o_t < T
    m_e = o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    b_l = tl.load(p_logits + o_t.to(tl.int64)[:, None] * stride_lt + o_e[None, :], mask=m_te, other=0.0)

    if IS_SIGMOID:
        b_score = _sigmoid(b_l)
        b_key = b_score
        if HAS_BIAS:
            b_key = b_key + tl.load(p_bias + o_e, mask=m_e, other=0.0)[None, :]
        # a NaN key (a NaN logit, or bias entry) poisons the row's weights below: never selected, it would otherwise
        # only leave its expert out (softmax's sum carries a NaN logit into every weight by itself)
        b_nan = tl.max(tl.where(m_e[None, :] & (b_key != b_key), 1, 0), axis=1)
    else:
        b_max = tl.max(tl.where(m_e[None, :], b_l, float("-inf")), axis=1)
        b_exp = tl.where(m_e[None, :], tl.exp(b_l - b_max[:, None]), 0.0)
        b_score = b_exp / tl.sum(b_exp, axis=1)[:, None]
        b_key = b_l
    b_key = tl.where(b_key == b_key, b_key, float("-inf"))  # NaN -> never preferred

    o_j = tl.arange(0, TOP_K_P2)
    b_free = tl.broadcast_to(m_e[None, :], (BLOCK_T, BLOCK_E))
    b_ids = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.int32)
    b_ws = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_best = tl.max(tl.where(b_free, b_key, float("-inf")), axis=1)
        b_hit = b_free & (b_key == b_best[:, None])
        b_id = tl.min(tl.where(b_hit, o_e[None, :], BLOCK_E), axis=1)
        b_sel = o_e[None, :] == b_id[:, None]
        b_w = tl.sum(tl.where(b_sel, b_score, 0.0), axis=1)
        b_free = b_free & ~b_sel
        b_ids = tl.where(o_j[None, :] == j, b_id[:, None], b_ids)
        b_ws = tl.where(o_j[None, :] == j, b_w[:, None], b_ws)

    if RENORMALIZE:
        b_total = tl.sum(b_ws, axis=1)  # columns >= TOP_K hold zeros
        if IS_SIGMOID:
            b_ws = b_ws / (b_total[:, None] + 1e-20)
        else:
            b_ws = b_ws / b_total[:, None]
    b_ws = b_ws * routed_scaling
    if IS_SIGMOID:
        b_ws = tl.where(b_nan[:, None] > 0, float("nan"), b_ws)
    m_out = m_t[:, None] & (o_j[None, :] < TOP_K)
    o_out = o_t.to(tl.int64)[:, None] * TOP_K + o_j[None, :]
    tl.store(p_ids + o_out, b_ids, mask=m_out)
    tl.store(p_weights + o_out, b_ws, mask=m_out)
    if CLEAR_LOGITS:
        tl.debug_barrier()  # every thread's loads of the tile done before any zero lands
        tl.store(p_logits + o_t.to(tl.int64)[:, None] * stride_lt + o_e[None, :],
                 tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32), mask=m_te)
