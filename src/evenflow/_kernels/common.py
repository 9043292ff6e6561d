"""Triton helpers shared across operators.

``dot_operand`` and ``to_fp8e4`` exist for the Triton 3.6 CPU interpreter's defects
(see ``evenflow._runtime``); on a GPU their constexpr switch is False and they compile
to nothing. ``arrived_last`` is the one place the "last program to arrive finishes the
work" pattern orders memory (router split-K, MoE split-K and block-mode activation groups, decode combine
groups).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def dot_operand(x, DOT_F32: tl.constexpr):
    """Return ``x`` ready for ``tl.dot``: upcast to fp32 only when DOT_F32."""
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def f16_operand(x, DOT_F32: tl.constexpr):
    """``x`` (e4m3 or any type whose values f16 holds exactly) as an f16 ``tl.dot`` operand:
    the "f16 products" of fp8 dots (exact products, fp32 accumulation in the MMA)."""
    return dot_operand(x.to(tl.float16), DOT_F32)


@triton.jit
def saturate_e4m3(x):
    """``x`` clamped to e4m3's finite range [-448, 448], NaN kept (as ``torch.clamp``; a plain min / max would
    return the bound)."""
    return tl.minimum(tl.maximum(x, -FP8_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_E4M3_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def round_to_fp8e4_grid(x):
    """Round fp32 ``x`` to the nearest e4m3fn value (ties to even), saturating at 448.

    Normal e4m3 numbers carry 3 mantissa bits, so the grid step at binary exponent
    e is 2^(e-3); below 2^-6 the subnormal step is 2^-9. The exponent is read from
    the fp32 bits, which is exact, and the rounding uses the fp32 "add and subtract
    1.5*2^23*step" trick, which rounds to a multiple of ``step`` with ties to even
    while |x| < 2^22*step (here |x/step| < 16).
    """
    x = saturate_e4m3(x)
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = tl.exp2((e - 3).to(tl.float32))
    magic = step * 12582912.0  # 1.5 * 2^23
    return (x + magic) - magic


@triton.jit
def to_fp8e4(x, FP8_ROUND: tl.constexpr):
    """Cast fp32 ``x`` to float8e4nv, saturating; exact rounding in the interpreter too. On a GPU NaN stays NaN, as
    in ``torch.clamp`` and the cast after it: the clamp propagates it (a plain min / max returns the bound) and the
    hardware's cast gives e4m3's NaN. (The Triton 3.6 interpreter's casts do not: f32 NaN -> e4m3 384, e4m3 NaN ->
    f16 480.)"""
    if FP8_ROUND:
        x = round_to_fp8e4_grid(x)  # (saturates first)
    else:
        x = saturate_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def e4m3_to_f16_in_registers(x, INTERPRET: tl.constexpr):
    """e4m3 ``x`` -> f16, converted where ``x`` lives (exact: every e4m3 value is an f16).

    A plain ``x.to(tl.float16)`` feeding ``tl.dot`` lets the compiler keep the tile in
    shared memory as bytes and convert after loading it in the MMA operand layout; for an
    operand read transposed (V in P @ V) sm_90 has no 8-bit ldmatrix, so that load is one
    byte-wide LDS per value. Converting here (inline PTX, 4 values per call, opaque to the
    compiler) makes the tile f16 first, so the operand load is an ldmatrix transpose of
    16-bit values. The interpreter runs no PTX: there it is the plain cast.
    """
    if INTERPRET:
        return x.to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def layout_barrier_bf16(x, INTERPRET: tl.constexpr):
    """``x`` (bf16) unchanged, through an identity inline PTX move the compiler cannot see into.

    Layout propagation pulls a ``tl.dot`` operand's layout back through the elementwise ops
    that produce it; where those ops run on a broadcast row (the MoE down GEMM's deferred
    gate-up sums and activation), the whole chain then runs in the MMA operand layout,
    replicated across the threads that hold copies of each column (sm_90: 735 instructions
    per K step instead of 192). An opaque op stops the propagation here: the chain keeps the
    row's own layout and only the result is converted. Bits are unchanged (a 32-bit move of
    two packed values). The interpreter runs no PTX: there it is ``x``.
    """
    tl.static_assert(x.dtype == tl.bfloat16, "layout_barrier_bf16 takes bf16")
    if INTERPRET:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False,
                                         pack=2)


@triton.jit
def arrived_last(p_counter, expected):
    """Count this program in at ``p_counter``; True in the one that arrives ``expected``-th.

    The atomic is executed by one thread, and a release orders only that thread's own
    writes; the CTA barrier first makes every thread's global stores (the partial this
    program leaves for the last one) happen before it. acq_rel at GPU scope then makes all
    arrivals' stores visible to the last one, which must read them with ``.cg`` loads (L1 is
    not coherent across SMs) and put the counter back to 0 for the next call / graph replay.
    """
    tl.debug_barrier()
    return tl.atomic_add(p_counter, 1, sem="acq_rel") == expected - 1


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch, at the top of a kernel launched with ``launch_pdl``:
    wait until the kernel before it in the stream has finished and flushed its writes (it
    may have been launched while that one ran), then allow the next kernel to launch. No-op
    when PDL is False. Every load of the kernel must come after this."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def empty_pdl_kernel(p, PDL: tl.constexpr):
    """Nothing but :func:`pdl_enter` (nothing at all without PDL): the benchmarks' launch-cost probe."""
    pdl_enter(PDL)


@triton.jit
def prefetch_l2(ptrs, mask, fallback):
    """Ask L2 for the line of every pointer of ``ptrs`` (``fallback``, a valid address, where ``mask``
    is False): ``prefetch.global.L2``, a hint that writes no register and can never make a later load
    see old data (L2 is where every SM's stores land, so a line fetched early is updated by any store
    after it). Issued before ``pdl_enter``'s wait, it fetches what the kernel ahead does not write (a
    weight) while that kernel finishes. Compiled code only (the interpreter runs no PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, fallback)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(p_w, o_n, m_n, stride_wn, k_start, k_end, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch (:func:`prefetch_l2`) of rows ``o_n`` (where ``m_n``), columns [k_start, k_end) of ``w``: one
    pointer a 128-byte line (``LINE`` elements), BLOCK_K columns a trip, or one line a trip where BLOCK_K < LINE
    (each pointer asks for the whole line it falls in, so a range narrower than a line still asks for its line; before
    round BL such steps asked for nothing, which left the MoE down GEMM's prefetch a no-op on fp8's 64-deep steps)."""
    TRIP: tl.constexpr = BLOCK_K if BLOCK_K >= LINE else LINE
    o_l = tl.arange(0, TRIP // LINE) * LINE
    p_row = p_w + o_n.to(tl.int64)[:, None] * stride_wn
    for k in range(k_start, k_end, TRIP):
        o_kl = k + o_l
        prefetch_l2(p_row + o_kl[None, :], m_n[:, None] & (o_kl < k_end)[None, :], p_w)


@triton.jit
def pdl_enter_overlapped(PDL: tl.constexpr, OVERLAP: tl.constexpr):
    """:func:`pdl_enter`, or with ``OVERLAP`` (the kernel reads nothing the kernel ahead of it writes, and
    that kernel waited at its top for everything before it, so what this one reads is complete): allow
    the next kernel to launch and start at once, running beside the kernel ahead. Also required with
    ``OVERLAP``: this kernel writes no memory the kernel ahead reads or writes (allocate its outputs
    before launching that kernel); every program reaches :func:`pdl_leave_overlapped` (no early return).
    The kernel after this one sees the outputs of the kernel ahead only through that final wait: its own
    wait covers this kernel alone."""
    if OVERLAP:
        if PDL:
            gdc_launch_dependents()
    else:
        pdl_enter(PDL)


@triton.jit
def pdl_leave_overlapped(PDL: tl.constexpr, OVERLAP: tl.constexpr):
    """At the end of a kernel begun by :func:`pdl_enter_overlapped` with ``OVERLAP``: wait for the kernel
    ahead to finish before exiting. The kernel after this one waits (its :func:`pdl_enter`) for this one
    only, and would otherwise read the unfinished kernel's outputs."""
    if OVERLAP:
        if PDL:
            gdc_wait()


@triton.jit
def _read_u64(dep, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    # a 64-bit special register read by ``ASM``; 0 when interpreting (no GPU registers). The asm is
    # volatile (is_pure=False), which keeps it in program order with the kernel's other volatile
    # operations; taking ``dep`` (a scalar) as an input keeps it after dep's computation. Stores
    # before it are issued, not necessarily complete, when it reads.
    if INTERPRET:
        return dep.to(tl.int64) * 0
    else:
        return tl.inline_asm_elementwise(ASM, "=l,r", [dep.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def globaltimer_ns(dep, INTERPRET: tl.constexpr):
    """The GPU's global nanosecond timer (``%globaltimer``, comparable across SMs), read after
    ``dep`` (a scalar) is computed; 0 in the interpreter. For diagnostic timelines (the
    decode kernel's STAMPS build), never for results."""
    return _read_u64(dep, "mov.u64 $0, %globaltimer;", INTERPRET)


@triton.jit
def clock64(dep, INTERPRET: tl.constexpr):
    """This SM's cycle counter (``%clock64``: fine-grained, not comparable across SMs), read
    after ``dep`` is computed; 0 in the interpreter. Diagnostics only."""
    return _read_u64(dep, "mov.u64 $0, %clock64;", INTERPRET)


@triton.jit
def sm_id(dep, INTERPRET: tl.constexpr):
    """The SM this program runs on (``%smid``); -1 in the interpreter. Diagnostics only."""
    if INTERPRET:
        return dep.to(tl.int32) * 0 - 1
    else:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep.to(tl.int32)],
                                         dtype=tl.int32, is_pure=False, pack=1)
