"""Paged decode attention: launcher (checks, allocation, config) and its custom op.

Shapes: ``B`` requests, ``q_len`` new rows per request, ``Hq``/``Hkv`` heads, ``D`` head dim,
``P`` page size.

==============  ===========================  ===================================================
argument         shape                        dtype
==============  ===========================  ===================================================
q                [B * q_len, Hq, D]           bf16, or fp8 e4m3 with q_scale
q_scale          [B * q_len, Hq]              fp32 (dequant scale per token per head)
k/v_cache        [num_pages, P, Hkv, D]       bf16 or fp8 e4m3 (NHD; any strides with a unit
                                              last stride, so HND views ``x.transpose(1, 2)`` of
                                              a [num_pages, Hkv, P, D] cache work, whose rows of
                                              one page lie < 2^31 elements apart: ``check_kv_cache``)
k/v_scale        float or fp32 tensor [1]     per-tensor dequant scale (tensor: graph-friendly,
                                              read on the device), applied to any cache dtype:
                                              K = stored K * k_scale; None (default): 1, the
                                              stored values are the real ones (an fp8 cache too)
page_table       [B, max_pages]               int32, pages in any order
seq_lens         [B]                          int32, cached tokens including the new ones
out              [B * q_len, Hq, D]           bf16
lse (optional)   [B * q_len, Hq]              fp32, natural log of sum(exp(score)) where score =
                                              sm_scale * q_scale * k_scale * q.k; -inf for rows
                                              that see no token
==============  ===========================  ===================================================

Row r of request b attends to the cached tokens [0, seq_len - q_len + r + 1) (causal
among the new rows). Rows that see no token (length-0 requests) get zeros.

What is checked where: dtypes, shapes, devices and strides raise on the host. Values
inside device tensors (page indices, lengths) are not read by the launcher by default (that
would sync); the kernels clamp them so nothing is read out of bounds. ``decode_attention(...,
check_inputs=True)`` checks them in the call (one sync; skipped under CUDA-graph capture and
torch.compile), and :func:`validate_inputs` checks them alone. With no sync at all, a call
refuses a plan whose ``seq_lens`` tensor was written in place since its ``plan.update`` (the
tensor's version counter; not seen for inference-mode tensors, under torch.compile, or where
the call is given another tensor).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import triton

from evenflow import _runtime
from evenflow._checks import (
    check_bool,
    check_fp32_scale,
    check_int,
    check_no_overlap,
    check_out,
    check_scaling,
    check_tensor,
    checked_op,
)
from evenflow.attention import kernels as K
from evenflow.attention.plan import (
    BLOCK_NS,
    DEFAULT_PROGRAMS_PER_SM,
    GLUON_FP8_HEAD_DIM,
    GLUON_FP8_MAX_ROWS,
    GLUON_FP8_PAGE_SIZES,
    GLUON_FP8_STAGES,
    GLUON_FP8_WARP_COUNTS,
    GLUON_FP8_WG_ROWS,
    HEAD_DIMS,
    KV_DTYPES,
    MAX_GQA_GROUP,
    Q_DTYPES,
    TILE,
    TRITON_WARP_COUNTS,
    DecodePlan,
    check_register_cap,
    gluon_fp8_shape_misses,
    programs_per_sm,
    static_splits,
)

# The Gluon kernel is written against Triton 3.6's Gluon (an experimental API that changes between
# releases); with an older Triton, or none of Gluon, every call runs the Triton kernels.
GK = None
if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6):
    try:
        from evenflow.attention import gluon_kernels as GK
    except ImportError:  # pragma: no cover (the pinned Triton has it)
        GK = None

FP8 = torch.float8_e4m3fn
_QDT = Q_DTYPES
_KVDT = KV_DTYPES
_LOG2E = math.log2(math.e)


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def _num_stages(head_dim: int, kv_dtype: torch.dtype, block_n: int) -> int:
    # Software-pipelining depth of the K/V tile copies. Triton's pipeliner gives a load
    # (depth - 1 - 1) extra buffers here: the page-id load takes one stage of the
    # schedule, so 2 stages means one K/V buffer, refilled only after the tile has been
    # consumed (each tile's memory latency exposed), 3 stages double-buffers (one tile in
    # flight while one is computed) and 4 triple-buffers. Shared memory per program:
    # buffers x 2 x 64 x D x bytes; up to 3 programs/SM must fit in 227 KB, so bf16 d128 takes 3
    # stages (2 buffers, 70 KB), fp8 d128 4 (3 buffers, 54 KB: half the bytes per tile,
    # so one more tile in flight for the same bytes), d256 and 128-token steps one less.
    # Measured: docs/perf-notes/decode.md, round E.
    stages = 4 if kv_dtype == FP8 else 3
    return stages - 1 if head_dim > 128 or block_n > TILE else stages


def _max_regs(block_m: int, head_dim: int, block_n: int, num_warps: int, programs: int,
              device: torch.device) -> int:
    # Register cap (ptxas maxnreg) so the plan's programs per SM are all resident: 3
    # programs of 4 warps need <= 170 registers/thread (64 K per SM). Uncapped, ptxas
    # takes 197 (bf16, 3 stages) to 224 (fp8) and only 2 programs fit. The 16-row tile
    # (GQA group <= 16, one query row) fits 168 with no or a few bytes of spill with the
    # plain loop (sm_90 compile, perf notes); with the warp-split loop (fp8 default since
    # round H) it spills 36 bytes (fp8) / 176 (bf16) at 168, so 3 programs/SM are a measured
    # option, not the default. Larger row tiles, head dim 256 and 128-token steps would
    # spill 136-244 bytes under it, so they keep the compiler's choice.
    if block_m > 16 or head_dim > 128 or block_n > TILE:
        return 0
    return min(255, 65536 // (programs_per_sm(programs, device) * 32 * num_warps)) // 8 * 8


def _block_n(head_dim: int, kv_dtype: torch.dtype) -> int:
    # Tokens per loop iteration (a DecodePlan's block_n overrides it). 64 is the measured
    # default for both KV dtypes. 128 for fp8 KV (the bytes of one bf16 tile per iteration)
    # needs ~250 registers/thread on sm_90 = 2 programs/SM, so it is a plan option that the
    # benchmark measures against the default (perf notes), not the default.
    del head_dim, kv_dtype
    return TILE


# Chunks of at least this many tiles (an item's item_cost units are not looped over)
# take the warp-split loop (kernels._tiles_split) when it is on. Round H (H200, fp8 KV): its
# steps are ~15% cheaper than the plain loop's (8x32K 204 -> 173 us) but its merge costs
# ~3 us per chunk (32x128+32x4K: 149 -> 245 us with every chunk split), i.e. ~0.25 us saved
# per tile against ~3 us per chunk: even at ~12 tiles; 24 leaves chunks of 8-16 tiles
# (64x512, the TP8 slice's 16-tile bins) on the plain loop.
WS_MIN_TILES = 24


def _warp_split(block_n: int, num_warps: int, choice: int, kv_fp8: bool, block_m: int, head_dim: int) -> int:
    # Token groups per step for long chunks (kernels._tiles_split): one per warp, each >= 16
    # tokens (the MMA's K in P @ V); 1 = the plain loop only. The split loop keeps a
    # [warps, rows, D] fp32 output, so it is built for the 16-row tile and head_dim <= 128
    # only (sm_90: fp8 d256 with 64 rows needs 288 KB of shared memory, over the 227 KB of a
    # block; d128 with 64 rows spills 2 KB). Launcher's choice (-1): on for fp8 KV, where the
    # plain loop is bound by its per-step chain (round H: +18-20% on the long fp8 cases);
    # off for bf16 KV, whose long cases are at the copy floor either way and whose plain loop
    # measured 2-5% faster. An explicit request (1) the kernel cannot build is an error.
    supported = block_n // num_warps >= 16 and block_m == 16 and head_dim <= 128
    if choice == 1 and not supported:
        raise ValueError(f"warp_split=True needs block_n / num_warps >= 16 (got {block_n} / {num_warps}), "
                         f"GQA group x q_len <= 16 (a 16-row tile, got {block_m} rows) and head_dim <= 128 "
                         f"(got {head_dim})")
    if choice == 0 or not supported or (choice == -1 and not kv_fp8):
        return 1
    return num_warps


# Register cap of the combine kernel: 3 programs of 4 warps per SM (sm_90 build: 168
# registers, <= 4 bytes of spill; 185 uncapped = 2 per SM). Most of its programs find no
# work and exit at once; the more are resident, the fewer waves the grid takes.
_COMBINE_MAX_REGS = 168


def _combine_blocks(block_m: int, head_dim: int) -> tuple[int, int]:
    # Combine: chunks merged per step x head-dim columns per program. One long item (the
    # TP8 slice: ~190 chunks of one kv head) is latency-bound in the combine: each step
    # is a dependent round trip. 32 chunks of [16 rows, 16 columns] fp32 per step (8192
    # values, 64 registers/thread at 4 warps) keep 32 loads in flight, and the head dim
    # split over a second grid axis puts D / 16 programs on the item.
    block_d = min(head_dim, 16)
    block_c = max(2, min(32, 8192 // (block_m * block_d)))
    return block_c, block_d


def _fused_blocks(rows: int, head_dim: int) -> tuple[int, int]:
    # Fused combine (inside the attention kernel, one program merging every column of a
    # group): rows padded to a power of two (not the attention's 16-row MMA tile) and
    # chunks per load step so that a step's [chunks, rows, D] fp32 loads stay at <= 8192
    # values (64 registers/thread at 4 warps), at most 8.
    block_m = max(2, 1 << (rows - 1).bit_length())
    return block_m, max(1, min(8, 8192 // (block_m * head_dim)))


# An fp8 q (with its per-token-per-head q_scale) on the Gluon fp8 kernel: built in round AO, on since its GPU tests
# passed on an H200 (round AP: tests/test_decode_gpu.py's fp8-q cases). Set False to run such calls on the Triton
# kernel (the tests of that path do).
GLUON_FP8_Q = True


def gluon_fp8_refusal(q: torch.Tensor, k_cache: torch.Tensor, plan: DecodePlan | None,
                      rows: int) -> tuple[str, bool] | None:
    """Why a call does not run the Gluon fp8 kernel (``attention/gluon_kernels.py``), or None where it does: a
    plan built with ``kv_dtype=torch.float8_e4m3fn`` for it (``DecodePlan.takes_gluon``: at any KV-head count
    at 2 or 4 warps a program, from 2 KV heads at 1, or as its ``gluon`` says; pages of 64 or 128 tokens; none of the
    Triton kernel's launch options, where ``num_stages``, if given, is the ring's slots and must be >= 2; a
    timeline, ``DecodePlan.record_timeline``, runs its own STAMPS build), bf16 q (or fp8 q where GLUON_FP8_Q), an
    fp8 cache, head_dim 128, GQA group x q_len <= 16, compiled code on a GPU with e4m3 conversions (sm_89+). The
    flag says whether the reason is the call's (its q, cache or GQA group: a plan built for the Gluon kernel then
    runs the Triton one), not the plan's or the machine's."""
    if plan is None or not plan.takes_gluon:
        return "no plan built for it", False
    machine = gluon_fp8_machine_refusal(q.device)
    if machine is not None:
        return machine, False
    call = gluon_fp8_call_refusal(q, k_cache, rows)
    return None if call is None else (call, True)


def gluon_fp8_call_refusal(q: torch.Tensor, k_cache: torch.Tensor, rows: int) -> str | None:
    """Why a call's own q, cache and GQA group keep it from the Gluon fp8 kernel, or None (``gluon_fp8_refusal``)."""
    if k_cache.dtype != FP8:
        return f"the cache is {k_cache.dtype}, not float8_e4m3fn"
    if q.dtype != torch.bfloat16 and not (q.dtype == FP8 and GLUON_FP8_Q):
        return f"q is {q.dtype}, not bfloat16" + (" (decode.GLUON_FP8_Q is off)" if q.dtype == FP8 else "")
    head_out, rows_out = gluon_fp8_shape_misses(k_cache.shape[3], rows)
    if head_out:
        return f"head_dim is {k_cache.shape[3]}, not {GLUON_FP8_HEAD_DIM}"
    if k_cache.shape[1] not in GLUON_FP8_PAGE_SIZES:  # (decode_attention refuses a cache of another page size)
        return f"the cache's pages hold {k_cache.shape[1]} tokens"
    if rows_out:
        return f"GQA group x q_len is {rows}, over {GLUON_FP8_MAX_ROWS}"
    return None


def gluon_fp8_machine_refusal(device) -> str | None:
    """Why the Gluon fp8 kernel cannot run on ``device`` at all (no Gluon in this Triton; no compiled code with e4m3
    conversions, sm_89+: the interpreter cannot run Gluon, a compile check records what an H200 runs), or None."""
    if GK is None:
        return f"Triton {triton.__version__} has no Gluon (3.6 or later)"
    cap = _runtime.compiled_capability(torch.device(device))
    if cap is None or cap < (8, 9):
        return "no compiled code with e4m3 conversions (sm_89 or later)"
    return None


def warpgroup_form_runs(q: torch.Tensor, rows: int) -> bool:
    """Whether a call on a plan with ``gluon_warps=4`` runs the warpgroup form (round AR): an fp8 q of at most
    GLUON_FP8_WG_ROWS rows a KV head, compiled for sm_90 (``wgmma`` is Hopper's: sm_89 has no warpgroup MMA, and
    sm_100 builds of Triton 3.6's Gluon take its own MMA). Else the plan's calls run the two-warp form on the same
    bins (the same ring and programs an SM)."""
    if q.dtype != FP8 or rows > GLUON_FP8_WG_ROWS:  # (a bf16 q's call asks no device property)
        return False
    cap = _runtime.compiled_capability(q.device)
    return cap is not None and cap[0] == 9


def gluon_call_form(plan: DecodePlan, q: torch.Tensor, rows: int) -> tuple[int, int, int]:
    """The Gluon program a call on ``plan`` runs, as (warps a program, fused-merge batch, register cap; 0 = none): on
    a four-warp plan with ``warpgroup_mma``, the warpgroup form (4, ``plan.wg_merge_chunks``, ``plan.wg_max_regs``)
    where ``warpgroup_form_runs`` takes the call, else two warps on its bins (2, ``plan.merge_chunks``, 0); on any
    other plan its own warps and batch, uncapped. The one place the launcher, and the benchmark's rows, decide it."""
    if plan.gluon_warps == 4 and plan.warpgroup_mma:
        if warpgroup_form_runs(q, rows):
            return 4, plan.wg_merge_chunks, plan.wg_max_regs
        return 2, plan.merge_chunks, 0
    return plan.gluon_warps, plan.merge_chunks, 0


def gluon_fp8_supported(q: torch.Tensor, k_cache: torch.Tensor, plan: DecodePlan | None, rows: int) -> bool:
    """Whether a call runs the Gluon fp8 kernel (``gluon_fp8_refusal`` says why not)."""
    return gluon_fp8_refusal(q, k_cache, plan, rows) is None


def _warn_triton_on_a_gluon_plan(plan: DecodePlan, reason: str, num_q_heads: int, head_dim: int, rows: int) -> None:
    """Once a plan: its bins were sized for the Gluon kernel (``plan.per_sm`` programs an SM) and this call
    runs the Triton kernel, which holds DEFAULT_PROGRAMS_PER_SM an SM: the output is right, the schedule is not the
    one the plan was built for (its programs run in two rounds)."""
    if plan.warned_kernel or plan.per_sm <= DEFAULT_PROGRAMS_PER_SM:  # (at most 2 an SM: one round, nothing to say)
        return
    plan.warned_kernel = True
    # where the reason is the call's shape, a plan told it (round AP) is built for the Triton kernel (this plan was not
    # told it: a told shape outside the scope makes a Triton plan, and a call of another shape than told raises)
    head_out, rows_out = gluon_fp8_shape_misses(head_dim, rows)
    told = [s for s, out in ((f"head_dim={head_dim}", head_out), (f"num_q_heads={num_q_heads}", rows_out)) if out]
    told = f" (or told the calls' {' and '.join(told)})" if told else ""
    warnings.warn(f"decode_attention: this plan was built for the Gluon fp8 kernel ({plan.per_sm} programs an SM), "
                  f"which does not run this call ({reason}); the Triton kernel runs the plan's bins at "
                  f"{DEFAULT_PROGRAMS_PER_SM} programs an SM instead. Build the plan with gluon=False{told} for such "
                  f"calls.", RuntimeWarning, stacklevel=3)


# Chunks per merge group of the fused combine: one or two load steps per group (TP8 slice:
# 128 chunks = 16 groups merged in parallel, then 16 group results in 2 steps).
FUSED_GROUP_CHUNKS = 8
# Round BP: the Triton kernel's fused merge step (kernels._merge_chunks) in one pass, each chunk's LSE loaded once,
# every load of a step ahead of a branch (ONE_PASS). The sm_90 build of the default two-pass step takes 2-3 memory
# round trips a step where its addresses need 1; the TP8 slice's merge tail is several such steps after the last
# chunk. The same bits. On since round BQ: 0.9885 of the two-pass step's time on the TP8 slice bf16 (the median of six
# passes, BQ5), level elsewhere (benchmarks/decode.py's evenflow-twopassmerge rows switch it off).
MERGE_ONE_PASS = True
# ... on merges of at most this many rows (fused_m): the 64-row builds (GQA group x q_len 33-64) already spill (212
# bytes at head_dim 256, q_len 4), and holding a step's loads there adds 76 (round BP's sm_90 builds)
MERGE_ONE_PASS_MAX_ROWS = 32


def _decode_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, tiles: torch.Tensor, req_end: torch.Tensor, prog_start: torch.Tensor,
               meta: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, part_glse: torch.Tensor,
               combine_count: torch.Tensor, group_count: torch.Tensor, out: torch.Tensor,
               lse: Optional[torch.Tensor], stamps: Optional[torch.Tensor],  # noqa: UP045 (schema inference)
               q_scale: Optional[torch.Tensor],  # noqa: UP045
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],  # noqa: UP045
               k_scale_f: float, v_scale_f: float, sm_scale: float,
               q_len: int, splits: int, max_len: int, num_warps: int = 0, num_stages: int = 0,
               block_n: int = 0, max_regs: int = 0, pdl: bool = False, warp_split: int = -1,
               prefetch: bool = True, fused: bool = False, gluon: bool = False, early: bool = False,
               pad: int = 0, bin_stride: int = 1, trigger: bool = False, gluon_warps: int = 1,
               short_tiles: int = 0, merge_chunks: int = FUSED_GROUP_CHUNKS, warpgroup_mma: bool = True) -> None:
    # num_warps / num_stages / block_n: 0 = the launcher's choice (a DecodePlan may override
    # them); max_regs: register cap per thread, 0 = none; pdl: programmatic dependent launch;
    # warp_split: 1 = on, 0 = off, -1 = the launcher's choice; prefetch: the persistent loop
    # loads the next item's metadata before the current item's work; fused: the plan path
    # merges split items inside the attention kernel (no combine kernel); stamps: the plan
    # path's per-program timeline buffer [programs, K.STAMP_SLOTS] int64 (diagnostics), or None;
    # gluon: the plan path runs the Gluon fp8 kernel (gluon_fp8_supported), fused or with the combine kernel;
    # with pdl, early: it reads the plan, page table and cached K / V before its PDL wait (the kernel ahead
    # did not update the plan); pad: unused ring slots that keep an SM to the plan's programs, bin_stride: its
    # programs take bins this stride apart (DecodePlan.resident_pad / .bin_stride); trigger: with pdl, the plan
    # path lets the next kernel launch at its top (DecodePlan.launch_next); gluon_warps: the Gluon kernel's warps a
    # program (DecodePlan.gluon_warps); short_tiles: its chunks of at most this many tiles read the whole ring ahead,
    # longer ones a tile fewer (DecodePlan.deep_ring_tiles; 0 = every chunk the whole ring); merge_chunks: the Gluon
    # kernel's fused-merge batch and group (gluon_call_form: DecodePlan.wg_merge_chunks for a call in the warpgroup
    # form, else DecodePlan.merge_chunks; the Triton kernel's groups are FUSED_GROUP_CHUNKS); warpgroup_mma: with
    # gluon_warps=4 (the call's, gluon_call_form), the warpgroup form; False: four warps on mma.sync
    # (DecodePlan.warpgroup_mma); max_regs: on the Gluon path the form's cap (gluon_call_form), 0 = none
    B = seq_lens.shape[0]
    _, Hq, D = q.shape
    num_pages, P, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    rows = G * q_len
    block_m = _block_m(rows)
    is_static = splits > 0
    block_n = block_n or _block_n(D, k_cache.dtype)
    num_warps = num_warps or 4
    wsplit = _warp_split(block_n, num_warps, warp_split, k_cache.dtype == FP8, block_m, D)
    np_ = prog_start.shape[0] - 1
    use_fp8_dot = q.dtype == FP8 and k_cache.dtype == FP8
    has_lse = lse is not None
    qs = q_scale if q_scale is not None else q
    common = dict(HKV=Hkv, GROUP=G, Q_LEN=q_len, D=D, BLOCK_M=block_m, IS_STATIC=is_static, HAS_LSE=has_lse)
    lse_t = lse if has_lse else out
    fused = bool(fused) and not is_static
    fused_m, fused_unroll = _fused_blocks(rows, D)
    grid = (B * Hkv * splits,) if is_static else (np_,)
    if gluon and not is_static:
        wg = gluon_warps == 4 and warpgroup_mma
        GK.decode_fp8_kernel[grid](
            q, qs, k_cache, v_cache, page_table, seq_lens, tiles, req_end, prog_start, meta, out, lse_t,
            part_o, part_lse,
            k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,
            part_glse, combine_count, group_count, stamps if stamps is not None else meta,
            sm_scale * _LOG2E * k_scale_f, v_scale_f, B, max_len, num_pages, bin_stride,
            q.stride(0), q.stride(1), qs.stride(0) if q_scale is not None else 0,
            qs.stride(1) if q_scale is not None else 0, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            page_table.stride(0), out.stride(0), out.stride(1), lse_t.stride(0) if has_lse else 0,
            HKV=Hkv, GROUP=G, Q_LEN=q_len, PAGE=P, STAGES=num_stages or GLUON_FP8_STAGES[gluon_warps],
            HAS_Q_SCALE=q_scale is not None, HAS_K_SCALE_PTR=k_scale is not None,
            HAS_V_SCALE_PTR=v_scale is not None, HAS_LSE=has_lse,
            FUSED=fused, FUSED_C=merge_chunks, STAMPS=stamps is not None, PREFETCH=bool(prefetch),
            EARLY=bool(pdl and early), PAD=pad, TRIGGER=bool(pdl and trigger), WARPS=gluon_warps,
            SHORT_TILES=short_tiles, WG=wg, num_warps=gluon_warps, **({"maxnreg": max_regs} if max_regs > 0 else {}),
            **_runtime.pdl_kwargs(pdl),
        )
    else:
        K.decode_kernel[grid](
            q, qs, k_cache, v_cache, page_table, seq_lens, tiles, req_end, prog_start, meta,
            out, lse_t, part_o, part_lse,
            k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,
            part_glse, combine_count, group_count, stamps if stamps is not None else meta,
            sm_scale * _LOG2E * k_scale_f, v_scale_f, B, max(splits, 1), max_len, num_pages, page_table.shape[1],
            bin_stride, q.stride(0), q.stride(1),
            qs.stride(0) if q_scale is not None else 0, qs.stride(1) if q_scale is not None else 0,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            page_table.stride(0), out.stride(0), out.stride(1), lse_t.stride(0) if has_lse else 0,
            PAGE=P, HAS_Q_SCALE=q_scale is not None, HAS_K_SCALE_PTR=k_scale is not None,
            HAS_V_SCALE_PTR=v_scale is not None, USE_FP8_DOT=use_fp8_dot, DOT_F32=_runtime.dot_needs_fp32(),
            KV_FP8=k_cache.dtype == FP8,
            NUM_STAGES=num_stages or _num_stages(D, k_cache.dtype, block_n), BLOCK_N=block_n,
            WSPLIT=wsplit, WS_MIN_TILES=WS_MIN_TILES, PREFETCH=bool(prefetch) and not is_static, FUSED=fused,
            FUSED_C=FUSED_GROUP_CHUNKS, FUSED_M=fused_m, FUSED_UNROLL=fused_unroll,
            STAMPS=stamps is not None and not is_static, TRIGGER=bool(pdl and trigger and fused),
            EARLY=bool(pdl and early and fused),
            MERGE_ONE_PASS=MERGE_ONE_PASS and fused and fused_m <= MERGE_ONE_PASS_MAX_ROWS, num_warps=num_warps,
            **({"maxnreg": max_regs} if max_regs > 0 else {}), **common,
            **_runtime.pdl_kwargs(pdl),
        )
    if fused or (is_static and splits == 1):
        return
    block_c, block_d = _combine_blocks(block_m, D)
    cgrid = ((B * Hkv if is_static else np_) * (D // block_d),)
    K.combine_kernel[cgrid](
        tiles, req_end, prog_start, meta, part_o, part_lse, part_glse, combine_count, out, lse_t,
        B, max(splits, 1), out.stride(0), out.stride(1), lse_t.stride(0) if has_lse else 0,
        NP=max(np_, 1), BLOCK_C=block_c, BLOCK_D=block_d, num_warps=4, maxnreg=_COMBINE_MAX_REGS, **common,
        **_runtime.pdl_kwargs(pdl),
    )


def _static_slots(batch: int, num_kv_heads: int, splits: int) -> int:
    """Partial slots of the static split: one an (item, split), or one in all where nothing is split (the kernel writes
    the output directly)."""
    return batch * num_kv_heads * splits if splits > 1 else 1


def _check_decode_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): the call's tensors as :func:`decode_attention` checks them, and the
    schedule's buffers sized for the launch (``splits`` > 0: the static split's partials; 0: the plan's, from its
    ``prog_start``). The values inside a plan's buffers are the kernels' to trust: ``DecodePlan.update`` writes them."""
    q, k_cache, page_table = a["q"], a["k_cache"], a["page_table"]
    B, q_len, Hq, D, Hkv = _check(q, k_cache, a["v_cache"], page_table, a["seq_lens"], None, a["q_scale"])
    dev = q.device
    if a["q_len"] != q_len:
        raise ValueError(f"q_len must be q's rows over the batch, {q_len}, got {a['q_len']!r}")
    check_out("out", a["out"], [B * q_len, Hq, D], torch.bfloat16, dev)
    if a["lse"] is not None:
        check_out("lse", a["lse"], [B * q_len, Hq], torch.float32, dev)
    for name in ("k_scale", "v_scale"):
        if a[name] is not None:
            _scale_arg(name, a[name], dev)
    for name in ("k_scale_f", "v_scale_f", "sm_scale"):
        check_scaling(name, a[name], positive=True)
    splits = check_int("splits", a["splits"], 0, 1 << 16)
    check_int("max_len", a["max_len"], 0, page_table.shape[1] * k_cache.shape[1])
    rows = Hq // Hkv * q_len
    if splits > 0:
        slots, least = _static_slots(B, Hkv, splits), {}
    else:
        check_tensor("prog_start", a["prog_start"], dtypes=[torch.int32], ndim=1, device=dev, contiguous=True)
        np_ = a["prog_start"].numel() - 1
        if np_ < 1:
            raise ValueError("prog_start must hold at least 2 entries (one program)")
        slots = 2 * np_
        least = {"tiles": B, "req_end": B, "meta": 6, "combine_count": np_, "group_count": 2 * np_}
        # program pid drains bin (pid * bin_stride) % programs: a stride prime to the count visits every bin once
        # (plan.bin_stride is; 0 or a negative stride would leave bins undrained or index before the buffers)
        if check_int("bin_stride", a["bin_stride"], 1, np_) > 1 and math.gcd(a["bin_stride"], np_) != 1:
            raise ValueError(f"bin_stride must be prime to the plan's {np_} programs, got {a['bin_stride']}")
        if a["stamps"] is not None:
            check_tensor("stamps", a["stamps"], dtypes=[torch.int64], shape=[np_, K.STAMP_SLOTS], device=dev,
                         contiguous=True)
    least.update(part_o=slots * rows * D, part_lse=slots * rows, part_glse=slots * rows)
    for name in ("tiles", "req_end", "prog_start", "meta", "combine_count", "group_count", "part_o", "part_lse",
                 "part_glse"):
        t = check_tensor(name, a[name], dtypes=[torch.float32 if name.startswith("part") else torch.int32],
                         device=dev, contiguous=True)
        if t.numel() < least.get(name, 0):
            raise ValueError(f"{name} must hold at least {least[name]} entries for this launch, got {t.numel()}")
    for name in ("pdl", "prefetch", "fused", "gluon", "early", "trigger", "warpgroup_mma"):
        check_bool(name, a[name])
    _check_launch_ints(a)
    if a["gluon"] and splits == 0:
        why = gluon_fp8_machine_refusal(dev) or gluon_fp8_call_refusal(q, k_cache, rows)
        if why is not None:
            raise ValueError(f"gluon=True: the Gluon fp8 kernel does not run this call: {why}")


def _check_launch_ints(a: dict) -> None:
    """The launch options of a direct call, each an int (a bool or float refused) within what the launchers pass
    (round CP's review: ``block_n=32`` made the loop step 0, ``num_warps=3`` and ``num_stages=-1`` were taken)."""
    for name, allowed in (("num_warps", (0, *TRITON_WARP_COUNTS)), ("block_n", (0, *BLOCK_NS)),
                          ("warp_split", (-1, 0, 1)), ("gluon_warps", GLUON_FP8_WARP_COUNTS)):
        if check_int(name, a[name]) not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {a[name]}")
    check_int("num_stages", a["num_stages"], 0, 8)
    check_register_cap("max_regs", a["max_regs"])
    for name, least in (("pad", 0), ("short_tiles", 0), ("merge_chunks", 1)):
        check_int(name, a[name], least)


# Registered as a custom op (fake below) for torch.compile; eager calls launch directly,
# since torch.library's dispatch costs tens of us per call on the host (router notes).
_decode_op = torch.library.custom_op("evenflow::decode_attention",
                                     mutates_args=("out", "lse", "part_o", "part_lse", "part_glse",
                                                   "combine_count", "group_count", "stamps"))(
    checked_op(_decode_launch, _check_decode_op))


@_decode_op.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, tiles, req_end, prog_start, meta, part_o, part_lse, part_glse,
      combine_count, group_count, out, lse, stamps,
      q_scale, k_scale, v_scale, k_scale_f, v_scale_f, sm_scale, q_len, splits, max_len, num_warps=0, num_stages=0,
      block_n=0, max_regs=0, pdl=False, warp_split=-1, prefetch=True, fused=False, gluon=False, early=False,
      pad=0, bin_stride=1, trigger=False, gluon_warps=1, short_tiles=0, merge_chunks=FUSED_GROUP_CHUNKS,
      warpgroup_mma=True):
    return None


# The kernels' score multiplier (sm_scale * log2(e) * a float k_scale, or with a tensor k_scale that scale times
# sm_scale * log2(e)) is refused above this. The scores s (q . k times it, log2 domain) are fp32. On the GPU the
# prefill kernel's exp2(s - running max) compiles to one fma of q . k, the multiplier and the max, so a row's largest
# weight is 2^r, r the rounding residual of s (|r| <= half an ulp of s: 8 at |s| < 2^28); the decode kernels round s
# first (their largest weight is 1). Prefill's output is finite while |s| < 2^28 (an fp8 cache's weights are f16 MMA
# operands, max 65504; a bf16 cache's hold further), its largest weight off by a factor 2^r (which cancels where
# that key dominates its row, and shifts near-ties: r <= 0.5 below |s| = 2^24); round
# CL's H100 probe (CL3) read prefill finite through 2^29 (fp8) / 2^32 (bf16) and not from 2^30 / 2^34, at multipliers
# of 0.9 x 2^12 to 1.44 x 2^60 alike, decode exact throughout. A model's multiplier is 1 / sqrt(head_dim) x log2(e)
# (under 1) times its cache's k_scale; this bound keeps |s| < 2^28 for any |q . k| < 2^16. Round CK's 2^64 held only
# without the fma: prefill gave NaN on an H100 at 1.44 x 2^60.
MAX_SCORE_MULTIPLIER = 2.0 ** 12


def _scale_arg(name: str, s, device) -> tuple[torch.Tensor | None, float]:
    if s is None:
        return None, 1.0
    if isinstance(s, torch.Tensor):
        check_tensor(name, s, dtypes=[torch.float32], device=device)
        if s.numel() != 1:
            raise ValueError(f"{name} must hold one element (a per-tensor scale), got shape {tuple(s.shape)}")
        return s, 1.0
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return None, check_fp32_scale(name, s)
    raise TypeError(f"{name} must be a float or a float32 tensor of one element, got {type(s).__name__}")


def check_scale_tensors(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        sm_scale: float | None = None) -> None:
    """``check_inputs``' part for scales given as tensors (one sync, where any is): each as a float scale must be
    (:func:`check_fp32_scale`), and with ``sm_scale`` the score multiplier a tensor ``k_scale`` gives within
    :data:`MAX_SCORE_MULTIPLIER`. Without it a NaN or infinite scale reaches the kernels unseen (the output then
    zeros or NaN) and a negative one inverts attention."""
    given = [(n, t) for n, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
    if not given:
        return
    values = torch.stack([t.reshape(()) for _, t in given]).tolist()
    for (name, _), f in zip(given, values):
        check_fp32_scale(name, f)
    if sm_scale is not None and k_scale is not None:
        check_score_scale(sm_scale, values[0])


def check_kv_cache(k_cache, v_cache, dev) -> tuple[int, int, int, int]:
    """The paged K / V caches as every attention operator takes them (decode, prefill, the prologue's store):
    bf16 or fp8 e4m3 ``[num_pages, P, Hkv, D]`` on ``dev`` with a unit last stride, V like K, P in 16..128, D one of
    HEAD_DIMS, at least one page and one kv head. Returns (num_pages, P, Hkv, D)."""
    check_tensor("k_cache", k_cache, dtypes=_KVDT, ndim=4, device=dev, last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, dtypes=[k_cache.dtype], shape=list(k_cache.shape), device=dev,
                 last_dim_contiguous=True)
    num_pages, P, Hkv, D = k_cache.shape
    if P not in (16, 32, 64, 128):
        raise ValueError(f"k_cache page size (dim 1) must be one of [16, 32, 64, 128], got {P}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)}, got {D}")
    if num_pages < 1:
        raise ValueError("k_cache must hold at least one page")
    if Hkv < 1:
        raise ValueError("k_cache must hold at least one kv head (dim 2)")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        # the kernels index a page's rows in int32 (the page's own offset is int64): a layout whose heads or tokens
        # lie further apart (e.g. heads outermost, [Hkv, pages, P, D] viewed as [pages, P, Hkv, D]) would wrap
        span = (P - 1) * abs(c.stride(1)) + (Hkv - 1) * abs(c.stride(2)) + D - 1
        if span >= 2 ** 31:
            raise ValueError(f"{name}: strides {tuple(c.stride())} put a page's rows up to {span} elements apart; "
                             "the kernels index within a page in int32 (< 2^31): keep the page dimension outermost "
                             "(NHD [pages, P, Hkv, D] or HND [pages, Hkv, P, D] views)")
    return num_pages, P, Hkv, D


def check_score_scale(sm_scale: float, k_scale_f: float) -> None:
    """The kernels' score multiplier ``sm_scale * log2(e) * k_scale`` (a float k_scale; 1 for a tensor, whose value
    ``check_inputs`` checks), checked to be at most :data:`MAX_SCORE_MULTIPLIER` (its comment derives the bound: the
    scores are q . k times it in fp32, and prefill's weights are exp2 of one fma of them, exact only to half an ulp of
    the score in the exponent)."""
    v = sm_scale * _LOG2E * k_scale_f
    if not v <= MAX_SCORE_MULTIPLIER:
        raise ValueError(f"sm_scale ({sm_scale!r}) x k_scale ({k_scale_f!r}) x log2(e) = {v:.4g} is beyond "
                         f"2^{math.log2(MAX_SCORE_MULTIPLIER):g}: "
                         "the kernels' scores, q . k times it, are fp32 and prefill's largest weight is off by up "
                         "to 2^(half an ulp of the score), which overflows from |score| ~ 2^28 (a model's "
                         "multiplier is under 1 times its cache's k_scale)")


def _check(q, k_cache, v_cache, page_table, seq_lens, plan, q_scale):
    check_tensor("q", q, dtypes=_QDT, ndim=3, last_dim_contiguous=True)
    dev = q.device
    num_pages, P, Hkv, D = check_kv_cache(k_cache, v_cache, dev)
    check_tensor("seq_lens", seq_lens, dtypes=[torch.int32], ndim=1, device=dev, contiguous=True)
    B = seq_lens.shape[0]
    check_tensor("page_table", page_table, dtypes=[torch.int32], ndim=2, device=dev, last_dim_contiguous=True)
    if page_table.shape[0] != B:
        raise ValueError(f"page_table must have {B} rows (one per request in seq_lens), got {page_table.shape[0]}")
    if q.shape[2] != D:
        raise ValueError(f"q head_dim {q.shape[2]} != k_cache head_dim {D}")
    Hq = q.shape[1]
    if Hq % Hkv != 0 or not 1 <= Hq // Hkv <= MAX_GQA_GROUP:
        raise ValueError(f"q heads ({Hq}) must be a multiple 1..{MAX_GQA_GROUP} of the kv heads ({Hkv})")
    if page_table.shape[1] < 1:
        raise ValueError("page_table must have at least one column")
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan or None, got {type(plan).__name__}")
        if plan.num_kv_heads != Hkv:
            raise ValueError(f"plan was built for {plan.num_kv_heads} kv heads, k_cache has {Hkv}")
        if plan.num_q_heads is not None and plan.num_q_heads != Hq:
            raise ValueError(f"plan was built for num_q_heads={plan.num_q_heads}, q has {Hq} heads")
        if plan.head_dim is not None and plan.head_dim != D:
            raise ValueError(f"plan was built for head_dim={plan.head_dim}, k_cache has head_dim {D}")
        if plan.page_size != P:
            raise ValueError(f"plan was built for page_size {plan.page_size}, k_cache pages hold {P}")
        if plan.kv_dtype is not None and plan.kv_dtype != k_cache.dtype:
            raise ValueError(f"plan was built for kv_dtype {plan.kv_dtype}, k_cache is {k_cache.dtype}")
        if plan.q_dtype is not None and plan.q_dtype != q.dtype:
            raise ValueError(f"plan was built for q_dtype {plan.q_dtype}, q is {q.dtype}")
        if plan.batch is None:
            raise ValueError("plan: call plan.update(seq_lens) before decode_attention")
        if plan.batch != B:
            raise ValueError(f"plan was last updated for batch {plan.batch}, seq_lens has {B}")
        if plan.written_since_update(seq_lens):
            raise ValueError("seq_lens was written in place after plan.update(seq_lens): the plan was not updated "
                             "with these lengths (call plan.update(seq_lens) again)")
        if plan.prog_start.device != dev:
            raise ValueError(f"plan is on {plan.prog_start.device}, q on {dev}")
        q_len = plan.q_len
        if plan.stamps is not None:
            check_tensor("plan.stamps", plan.stamps, dtypes=[torch.int64], shape=[plan.num_programs, K.STAMP_SLOTS],
                         device=dev, contiguous=True)
    else:
        if B < 1:
            raise ValueError("seq_lens is empty (batch 0): decode_attention needs at least one request")
        if q.shape[0] % B != 0 or not 1 <= q.shape[0] // B <= 4:
            raise ValueError(f"q rows ({q.shape[0]}) must be q_len * batch with q_len in 1..4 (batch {B})")
        q_len = q.shape[0] // B
    if q.shape[0] != B * q_len:
        raise ValueError(f"q must have batch * q_len = {B} * {q_len} = {B * q_len} rows, got {q.shape[0]}")
    if q.dtype == FP8:
        if q_scale is None:
            raise ValueError("q_scale is required when q is fp8 (float8_e4m3fn)")
        check_tensor("q_scale", q_scale, dtypes=[torch.float32], shape=[B * q_len, Hq], device=dev,
                     last_dim_contiguous=True)
    elif q_scale is not None:
        raise ValueError("q_scale is only used with an fp8 q; q is bf16")
    return B, q_len, Hq, D, Hkv


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, plan: DecodePlan | None = None, q_scale=None,
                     k_scale=None, v_scale=None, sm_scale: float | None = None, out=None,
                     return_lse: bool = False, lse=None, *, check_inputs: bool = False):
    """Paged decode attention over a KV cache (see the module docstring for shapes).

    ``plan``: a :class:`DecodePlan` updated with these ``seq_lens`` (length-balanced
    persistent schedule); ``None`` runs the static split-KV schedule (allocates its
    partial buffers per call). Returns ``out`` (bf16), or ``(out, lse)`` when
    ``return_lse`` (``lse`` may be given as a preallocated [B * q_len, Hq] fp32 buffer).
    ``check_inputs``: also check the values inside ``seq_lens``, ``page_table`` and the plan as
    :func:`validate_inputs` does, and scales given as tensors as float ones are (ValueError naming
    the first bad entry), at the cost of a host sync a call; skipped where a sync is not allowed
    (CUDA-graph capture, torch.compile). Off by default: a decode step calls this once per layer,
    and each kernel (20-245 us on the decode record's cases) would wait on the host. Whatever the
    setting, bad values are clamped by the kernels, never read or written out of bounds.
    """
    B, q_len, Hq, D, Hkv = _check(q, k_cache, v_cache, page_table, seq_lens, plan, q_scale)
    check_bool("check_inputs", check_inputs)
    dev = q.device
    ks_t, ks_f = _scale_arg("k_scale", k_scale, dev)
    vs_t, vs_f = _scale_arg("v_scale", v_scale, dev)
    # > 0: 0 would give uniform attention and a negative scale would invert it
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else check_scaling("sm_scale", sm_scale, positive=True)
    check_score_scale(sm_scale, ks_f)
    if check_inputs and _runtime.host_sync_allowed(seq_lens):
        _check_values(B, q_len, k_cache, page_table, seq_lens, plan)
        check_scale_tensors(ks_t, vs_t, sm_scale)
    check_bool("return_lse", return_lse)
    if lse is not None and not return_lse:
        raise ValueError("lse is given but return_lse is False: pass return_lse=True to have it filled")
    if out is None:
        out = torch.empty(B * q_len, Hq, D, dtype=torch.bfloat16, device=dev)
    else:
        check_out("out", out, [B * q_len, Hq, D], torch.bfloat16, dev)
        # the kernels read these while they write out (round CP's review: an out over the cache was taken)
        check_no_overlap("out", out, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens)
    if return_lse:
        if lse is None:
            lse = torch.empty(B * q_len, Hq, dtype=torch.float32, device=dev)
        else:
            check_out("lse", lse, [B * q_len, Hq], torch.float32, dev)
            check_no_overlap("lse", lse, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                             seq_lens=seq_lens, out=out)
    P = k_cache.shape[1]
    rows = (Hq // Hkv) * q_len
    max_pages_len = page_table.shape[1] * P
    op = _decode_op if torch.compiler.is_compiling() else _decode_launch
    if plan is not None:
        part_o, part_lse, part_glse = plan.partials(rows, D)
        pdl = _runtime.pdl_supported(dev) if plan.pdl is None else plan.pdl
        # reads before the PDL wait only where the kernel ahead is not the plan's update (the first call
        # after update() waits first); under torch.compile the call order is not known here: never
        early = pdl and plan.early_reads and not plan.fresh and not torch.compiler.is_compiling()
        plan.fresh = False
        refusal = gluon_fp8_refusal(q, k_cache, plan, rows)
        gluon = refusal is None
        if refusal is not None and refusal[1] and not torch.compiler.is_compiling():
            _warn_triton_on_a_gluon_plan(plan, refusal[0], Hq, D, rows)
        # the next kernel let go at the top only where an SM holds no more than the plan's programs
        trigger = pdl and plan.launch_next and (gluon or triton_holds_plan(plan, rows, D))
        warps, merge, gluon_regs = gluon_call_form(plan, q, rows) if gluon else (plan.gluon_warps, plan.merge_chunks, 0)
        op(q, k_cache, v_cache, page_table, seq_lens, plan.tiles, plan.req_end, plan.prog_start, plan.meta,
                   part_o, part_lse, part_glse, plan.combine_count, plan.group_count, out, lse, plan.stamps, q_scale,
                   ks_t, vs_t, ks_f, vs_f,
                   float(sm_scale), q_len, 0,
                   min(plan.max_seq_len, max_pages_len), plan.num_warps or 0,
                   plan.gluon_stages if gluon else (plan.num_stages or 0),
                   plan.block_n or 0, gluon_regs if gluon else _plan_max_regs(plan, rows, D, dev),
                   pdl, -1 if plan.warp_split is None else int(plan.warp_split), plan.prefetch,
                   plan.combine == "fused", gluon, early,
                   plan.resident_pad if pdl and plan.resident_cap else plan.min_pad,
                   plan.bin_stride if pdl and plan.spread_bins else 1, trigger, warps,
                   plan.deep_ring_tiles, merge, plan.warpgroup_mma)
    else:
        splits = static_splits(B, Hkv, dev)
        slots = _static_slots(B, Hkv, splits)
        part_o = torch.empty(slots, rows, D, dtype=torch.float32, device=dev)
        part_lse = torch.empty(slots, rows, dtype=torch.float32, device=dev)
        dummy = torch.zeros(2, dtype=torch.int32, device=dev)
        op(q, k_cache, v_cache, page_table, seq_lens, dummy, dummy.clone(), dummy.clone(), dummy.clone(),
                   part_o, part_lse, part_lse, dummy.clone(), dummy.clone(), out, lse, None, q_scale, ks_t, vs_t,
                   ks_f, vs_f,
                   float(sm_scale), q_len, splits,
                   max_pages_len, pdl=_runtime.pdl_supported(dev))
    return (out, lse) if return_lse else out


def triton_holds_plan(plan: DecodePlan, rows: int, head_dim: int) -> bool:
    """Whether the Triton kernel's build holds an SM to the plan's programs, so that a next call launched
    at its top (``DecodePlan.launch_next``) takes only the slots this call frees: the default build
    (no launch option of the plan set) at head_dim 128 and a 16-row tile (GQA group x q_len <= 16), whose
    registers (216-248 a thread at 4 warps, sm_90) let 2 programs share an SM and not 3 (a CPU test of
    the sm_90 builds), on a plan of DEFAULT_PROGRAMS_PER_SM programs an SM."""
    if any(o is not None for o in (plan.num_warps, plan.num_stages, plan.block_n, plan.max_registers)):
        return False
    return head_dim == 128 and _block_m(rows) == 16 and plan.per_sm == DEFAULT_PROGRAMS_PER_SM


def _plan_max_regs(plan: DecodePlan, rows: int, head_dim: int, device: torch.device) -> int:
    if plan.max_registers is not None:
        return plan.max_registers
    if _runtime.interpreting() and not _runtime.emulating_gpu():
        return 0  # the interpreter has no registers (an sm_90 compile check still sees the cap)
    # on a plan built for the Gluon kernel (4 programs an SM; 2 at one KV head) whose call runs the Triton kernel,
    # capped for at most its own 2 an SM (DecodePlan.triton_programs; at 4, 128 registers: 500-532 bytes of spill a
    # thread in the sm_90 build, round AO)
    return _max_regs(_block_m(rows), head_dim, plan.block_n or TILE, plan.num_warps or 4, plan.triton_programs,
                     device)


def validate_inputs(q, k_cache, v_cache, page_table, seq_lens, plan: DecodePlan | None = None, q_scale=None) -> None:
    """Debug check of the values the launcher cannot see without a host sync (it syncs once).

    Raises ValueError when a length is negative, between 0 and q_len (it must hold the
    request's q_len new tokens), beyond the page table or the plan's max_seq_len, when a page
    index a request uses is outside [0, num_pages), or when ``plan`` was not updated with
    these lengths. ``decode_attention(..., check_inputs=True)`` runs the same checks in the call.
    """
    B, q_len, *_ = _check(q, k_cache, v_cache, page_table, seq_lens, plan, q_scale)
    _check_values(B, q_len, k_cache, page_table, seq_lens, plan)


def _check_values(B: int, q_len: int, k_cache, page_table, seq_lens, plan: DecodePlan | None) -> None:
    """The value checks of :func:`validate_inputs`, computed where the tensors live and read back in one
    sync (a second, on a failure, finds the first bad entry for the message)."""
    num_pages, P = k_cache.shape[0], k_cache.shape[1]
    lens = seq_lens.long()
    cap = page_table.shape[1] * P
    if plan is not None:
        cap = min(cap, plan.max_seq_len)
    out_of_range = (lens < 0) | (lens > cap)
    short = (lens > 0) & (lens < q_len)
    cols = torch.arange(page_table.shape[1], device=lens.device)
    used = cols[None, :] < ((lens.clamp(min=0) + P - 1) // P)[:, None]
    bad_page = used & ((page_table < 0) | (page_table >= num_pages))
    faults = [out_of_range.any(), short.any(), bad_page.any()]
    if plan is not None:  # the units the last update gave each request, against what these lengths give
        faults.append((plan.tiles[:B].long() != plan.item_units(lens, plan.meta[5].long())).any())
    faults = torch.stack(faults).tolist()
    for bad, fault, why in ((out_of_range, faults[0], f"outside [0, {cap}] (page table columns * page size"
                             f"{' and plan max_seq_len' if plan is not None else ''})"),
                            (short, faults[1], f"is under q_len {q_len}: a request's length counts its new "
                             "tokens (0 for an empty slot)")):
        if fault:
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"seq_lens[{b}] = {int(lens[b])} {why}")
    if faults[2]:
        b, c = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(f"page_table[{b}, {c}] = {int(page_table[b, c])} outside [0, {num_pages}) for a page in use")
    if plan is not None and faults[3]:
        raise ValueError("plan was not updated with these seq_lens (call plan.update(seq_lens))")
