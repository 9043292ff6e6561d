"""Which operand order makes fp8 expert GEMMs fast with exact f16 products? (round G probe)

The fused MoE's fp8 dots upcast e4m3 to f16 on every tile (exact products, fp32 accumulation:
the tolerance rule rejects Hopper's reduced-precision fp8 accumulation). On 64/128-row tiles
that upcast sends the weight tile, Hopper's operand B, back through shared memory before every
warpgroup MMA, and the tuner picks 32-row mma.sync tiles instead, 2x slower than SGLang's fp8
wgmma at T >= 1024. Swapping the operands (out^T = W x^T) makes the weight tile operand A,
which a warpgroup MMA may read from registers, so it is converted where it is loaded; the
activations (operand B) are then kept as f16 in memory (exact e4m3 values, 2 bytes each).
The sm_90 compile (perf notes, round G) shows no shared-memory round trip and half the
conversions; this probe measures it on the GEMM alone before the MoE kernels are rebuilt.

    python benchmarks/probe_moe_operand.py [--out DIR] [--cases ...]
    TRITON_INTERPRET=0 python benchmarks/probe_moe_operand.py --sm90-stats   # CPU: the sm_90 build

Round AS added the swap written in Gluon (``gluon_rs_kernel``, formulations ``gluon-rs-*``): Triton-lang's swapped
build issues each register-operand ``wgmma`` behind its own warpgroup fence and wait (16-32 ``WARPGROUP`` fences and
waits a K step in the sm_90 loops above), which round H measured as no faster than the row tiles; in Gluon the
step's MMAs go out as one asynchronous group, one left in flight while the next step's weights are loaded and
converted (one arrive and one wait a step).

Every expert gets the same row count (a batched GEMM: no routing, no index), Qwen3-30B-A3B
sizes: gate-up N = 2 * 768, K = 2048; down N = 2048, K = 768. Rows (BENCH.md schema): one per
case x formulation, ``us`` (graph replay), ``frac_of_floor`` against the larger of bytes / copy
bandwidth and FLOPs / the bf16 matmul rate (f16 MMAs run at the bf16 rate), ``max_abs_err``
against an fp32 product of the same values, and ``torch-bmm-bf16`` (cuBLAS on the same values
in bf16: the dense rate these shapes reach) as the peer.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from evenflow._kernels.common import f16_operand

FP8 = torch.float8_e4m3fn


@triton.jit
def gemm_kernel(p_x, p_w, p_o, R, N, K,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """o[e, m, n] = sum_k x[e, m, k] w[e, n, k] with f16 products.

    SWAP False: tokens are the MMA's rows (today's layout; both fp8 tiles upcast, the weight
    is operand B). SWAP True: o^T = w x^T, weight rows are the MMA's rows (operand A, upcast in
    registers), tokens its columns (x stored as f16: operand B straight from shared memory).
    """
    e = tl.program_id(0).to(tl.int64)
    o_m = tl.program_id(1) * BM + tl.arange(0, BM)
    o_n = tl.program_id(2) * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    p_xe = p_x + e * R * K
    p_we = p_w + e * N * K
    if SWAP:
        p_a = p_we + o_n[:, None] * K + o_k[None, :]
        p_b = p_xe + o_m[None, :] * K + o_k[:, None]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        p_a = p_xe + o_m[:, None] * K + o_k[None, :]
        p_b = p_we + o_n[None, :] * K + o_k[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K // BK):
        acc = tl.dot(f16_operand(tl.load(p_a), DOT_F32), f16_operand(tl.load(p_b), DOT_F32), acc)
        p_a += BK
        p_b += BK
    p_oe = p_o + e * R * N
    if SWAP:
        tl.store(p_oe + o_m[None, :] * N + o_n[:, None], acc)
    else:
        tl.store(p_oe + o_m[:, None] * N + o_n[None, :], acc)


@gluon.jit
def _rs_step(i, acc, a_held, w_s, x_s, p_wt, p_xt, w_all, x_all, steps,
             AOP: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, SYNC: gl.constexpr):
    # K step i of gluon_rs_kernel: wait for its copies, refill the slot of step i - 2 with step i + STAGES - 2, load
    # and convert its weights into the register operand, issue its MMAs; ``a_held``: the other register set, the
    # operand of step i - 1's MMAs, kept unmodified until the wait says they are done
    cp.wait_group(STAGES - 3)  # step i's copies have landed (one group a step, issued STAGES - 2 ahead)
    fence_async_shared()
    gl.thread_barrier()  # every warp's copies visible, every warp past step i - 1's loads and MMA i - 2
    j = i + STAGES - 2  # its slot held step i - 2, whose MMA every warp has waited for
    cp.async_copy_global_to_shared(w_s.index(j % STAGES), p_wt + j * BK, mask=w_all & (j < steps))
    cp.async_copy_global_to_shared(x_s.index(j % STAGES), p_xt + j * BK, mask=x_all & (j < steps))
    cp.commit_group()
    a = w_s.index(i % STAGES).load(AOP).to(gl.float16)
    if SYNC:
        acc = warpgroup_mma(a, x_s.index(i % STAGES).permute((1, 0)), acc)
    else:
        acc = warpgroup_mma(a, x_s.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        acc, a_held = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a_held])  # MMA i - 1 done
    return acc, a, a_held


@gluon.jit
def gluon_rs_kernel(p_x, p_w, p_o, R, N, K,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    SYNC: gl.constexpr = False, W_PLAIN: gl.constexpr = False, OUT_ACC: gl.constexpr = False,
                    WARPS: gl.constexpr = 4):
    """o[e, m, n] = sum_k x[e, m, k] w[e, n, k] with f16 products, swapped (o^T = w x^T) on WARPS / 4 warpgroups
    (round AS; each warpgroup 64 of every 64 x WARPS / 4 weight rows): the weight tile [BN, BK] (e4m3) is read from
    shared memory straight into ``wgmma``'s register operand layout and converted there (operand A, no converted
    copy stored), x [BM, BK] (f16, exact e4m3 values) is operand B from 128-byte-swizzled shared memory; both arrive
    by cp.async in a ring of STAGES slots filled STAGES - 2 steps ahead. Each step's MMAs run asynchronously beside
    the next step's load and conversion: the wait keeps one step in flight. A register operand may not be written
    while its MMA runs (PTX), and a loop redefines its values in the same registers each trip, so the steps
    alternate between two register sets (the loop runs two steps a trip: K must be an even number of BK steps, which
    ``run_formulation`` checks; an odd last step after the loop made ptxas spill 88 bytes at BN = BM = 128): round
    AS5 ran a one-set loop, which failed its GPU tests. (Diagnostic switches: SYNC waits for each step's MMAs,
    W_PLAIN keeps the weights unswizzled, OUT_ACC stores from the accumulator's layout.)"""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BM, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    WCP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])  # 16 e4m3 a thread, 4 threads a row
    XCP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # 8 f16 a thread, 8 threads a row
    if W_PLAIN:
        W_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    else:
        W_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BK, element_bitwidth=8, rank=2)
    X_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, WARPS], [0, 1])  # a warp stores 128 n of one m
    gl.static_assert(BK * 2 == 128, "x rows of BK f16 are the 128-byte swizzle's width")
    gl.static_assert(STAGES >= 3, "the ring is filled STAGES - 2 steps ahead")
    e = gl.program_id(0).to(gl.int64)
    m0 = gl.program_id(1) * BM
    n0 = gl.program_id(2) * BN
    w_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], W_SL)
    x_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], X_SL)
    w_r = gl.arange(0, BN, layout=gl.SliceLayout(1, WCP))
    w_k = gl.arange(0, BK, layout=gl.SliceLayout(0, WCP))
    x_r = gl.arange(0, BM, layout=gl.SliceLayout(1, XCP))
    x_k = gl.arange(0, BK, layout=gl.SliceLayout(0, XCP))
    p_wt = p_w + e * N * K + (n0 + w_r).to(gl.int64)[:, None] * K + w_k[None, :]
    p_xt = p_x + e * R * K + (m0 + x_r).to(gl.int64)[:, None] * K + x_k[None, :]
    w_all = (w_r[:, None] < BN) & (w_k[None, :] < BK)  # full-shape masks, ANDed with "step in range"
    x_all = (x_r[:, None] < BM) & (x_k[None, :] < BK)
    steps = K // BK
    for s in gl.static_range(STAGES - 2):
        cp.async_copy_global_to_shared(w_s.index(s), p_wt + s * BK, mask=w_all & (s < steps))
        cp.async_copy_global_to_shared(x_s.index(s), p_xt + s * BK, mask=x_all & (s < steps))
        cp.commit_group()
    acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
    a0 = gl.zeros([BN, BK], gl.float16, layout=AOP)
    a1 = gl.zeros([BN, BK], gl.float16, layout=AOP)
    for t in range(steps // 2):
        acc, a0, a1 = _rs_step(2 * t, acc, a1, w_s, x_s, p_wt, p_xt, w_all, x_all, steps, AOP, BK, STAGES, SYNC)
        acc, a1, a0 = _rs_step(2 * t + 1, acc, a0, w_s, x_s, p_wt, p_xt, w_all, x_all, steps, AOP, BK, STAGES,
                               SYNC)
    if not SYNC:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    cp.wait_group(0)
    if OUT_ACC:
        a_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        a_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
        gl.store(p_o + e * R * N + a_m.to(gl.int64)[None, :] * N + a_n[:, None], acc)
    else:
        o = gl.convert_layout(acc, OUT)
        o_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, OUT))
        o_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, OUT))
        gl.store(p_o + e * R * N + o_m.to(gl.int64)[None, :] * N + o_n[:, None], o)


@dataclass(frozen=True)
class Formulation:
    swap: bool  # weights as the MMA's rows; activations stored as f16 (exact e4m3 values)
    block_m: int  # tokens per tile
    block_n: int  # weight rows per tile
    block_k: int
    num_warps: int
    num_stages: int
    gluon: bool = False  # gluon_rs_kernel (swapped, the weight as wgmma's register operand; round AS)
    out_acc: bool = False  # gluon_rs_kernel's OUT_ACC: store from the accumulator's layout (tiles narrower than its
    # 128-row store layout, round BJ4's 16-token tiles)


FORMULATIONS = {
    # today's 64/128-row f16-product tiles (the heuristic's choice at large T)
    "rows-bm64-w8": Formulation(False, 64, 128, 128, 8, 3),
    "rows-bm128-w8": Formulation(False, 128, 128, 128, 8, 3),
    # the tuner's pick at T >= 512 (32-row mma.sync tiles)
    "rows-bm32-w4": Formulation(False, 32, 128, 128, 4, 4),
    # swapped operands, f16 activations
    "swapped-bm64-w4": Formulation(True, 64, 128, 128, 4, 3),
    "swapped-bm128-w8": Formulation(True, 128, 128, 128, 8, 3),
    "swapped-bm256-w8": Formulation(True, 256, 128, 64, 8, 3),
    # the same swap in Gluon (round AS): one warpgroup, the MMA asynchronous beside the next step's conversion
    "gluon-rs-bn128-bm128": Formulation(True, 128, 128, 64, 4, 4, gluon=True),
    "gluon-rs-bn128-bm64": Formulation(True, 64, 128, 64, 4, 4, gluon=True),
    "gluon-rs-bn64-bm128": Formulation(True, 128, 64, 64, 4, 4, gluon=True),
    # two warpgroups on 256 weight rows: half the activation bytes a FLOP of the 128-row tile (AS5's arithmetic)
    "gluon-rs-bn256-bm128-w8": Formulation(True, 128, 256, 64, 8, 4, gluon=True),
    # small batches (round BJ4): today's exact-mode decode tile (16 token rows, 64 weight rows, 4 warps) against the
    # swap with the tokens as a 16-wide wgmma N (64 or 128 weight rows, 4 or 6 ring slots)
    "rows-bm16-w4": Formulation(False, 16, 64, 128, 4, 3),
    "rows-bm16-bn32-w4": Formulation(False, 16, 32, 128, 4, 3),  # the table's 32-wide N block at Qwen3 T = 4
    "gluon-rs-bn64-bm16": Formulation(True, 16, 64, 64, 4, 4, gluon=True, out_acc=True),
    "gluon-rs-bn64-bm16-s6": Formulation(True, 16, 64, 64, 4, 6, gluon=True, out_acc=True),
    "gluon-rs-bn128-bm16-w8": Formulation(True, 16, 128, 64, 8, 4, gluon=True, out_acc=True),
}

# name: (experts, rows per expert, N, K). Rows per expert = T * top_k / E at Qwen3 (E 128, top-8).
CASES = {
    "qwen3-gate-up-T1024": (128, 64, 1536, 2048),
    "qwen3-gate-up-T4096": (128, 256, 1536, 2048),
    "qwen3-down-T4096": (128, 256, 2048, 768),
    # decode-size batches (round BJ4): 16 rows an expert (a 16-row tile's worth; at T <= 64 an expert sees 1-4),
    # experts enough that the weights (150 / 100 MB) do not fit in L2
    "qwen3-gate-up-r16": (48, 16, 1536, 2048),
    "qwen3-down-r16": (64, 16, 2048, 768),
    # the same at the MoE's own sizes (round BJ5): 75 MB, about Qwen3 T = 4's gate-up, and 302 MB
    "qwen3-gate-up-r16-e24": (24, 16, 1536, 2048),
    "qwen3-gate-up-r16-e96": (96, 16, 1536, 2048),
    "qwen3-down-r16-e48": (48, 16, 2048, 768),
}


def make_inputs(e: int, r: int, n: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 activations [e, r, k] and weights [e, n, k] (values of a unit-scale layer)."""
    x = (torch.randn(e, r, k, generator=gen, device=device) * 8).clamp(-448, 448).to(FP8)
    w = (torch.randn(e, n, k, generator=gen, device=device) * 8).clamp(-448, 448).to(FP8)
    return x, w


def run_formulation(name: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                    dot_f32: bool = False):
    """A zero-argument launcher of ``name`` on (x, w) writing fp32 ``out`` [e, r, n]."""
    f = FORMULATIONS[name]
    e, r, k = x.shape
    n = w.shape[1]
    if r % f.block_m or n % f.block_n or k % f.block_k:
        raise ValueError(f"{name}: tiles {f.block_m}x{f.block_n}x{f.block_k} do not divide R={r} N={n} K={k}")
    if f.gluon and (k // f.block_k) % 2:
        raise ValueError(f"{name}: K={k} is an odd number of {f.block_k}-deep steps (the Gluon loop runs two a trip)")
    xs = x.to(torch.float16) if f.swap else x  # exact: every e4m3 value is an f16
    out = out if out is not None else torch.empty(e, r, n, dtype=torch.float32, device=x.device)
    grid = (e, r // f.block_m, n // f.block_n)
    kw = {} if dot_f32 else {"num_warps": f.num_warps, "num_stages": f.num_stages}

    def launch():
        if f.gluon:
            gluon_rs_kernel[grid](xs, w, out, r, n, k, BM=f.block_m, BN=f.block_n, BK=f.block_k,
                                  STAGES=f.num_stages, WARPS=f.num_warps, OUT_ACC=f.out_acc, num_warps=f.num_warps)
        else:
            gemm_kernel[grid](xs, w, out, r, n, k, BM=f.block_m, BN=f.block_n, BK=f.block_k, SWAP=f.swap,
                              DOT_F32=dot_f32, **kw)
        return out
    return launch


def sm90_stats() -> list[str]:
    """Compile every formulation for sm_90 on this machine (no GPU needed; run with
    TRITON_INTERPRET=0) and describe one K step of its loop: registers, shared memory, SASS
    instructions, shared-memory stores (an operand sent back through shared memory), e4m3
    conversions, and which tensor-core instruction it got."""
    lines = []
    for name, st in sm90_builds().items():
        count = lambda prefix: sum(v for op, v in st["loop"].items() if op.startswith(prefix))  # noqa: E731, B023
        lines.append(f"{name:20s} regs {st['regs']} spill {st['spill']} shared {st['shared'] // 1024} KB "
                     f"loop {st['instructions']} STS {count('STS')} LDS {count('LDS')} F2FP {count('F2FP')} "
                     f"MMA {count('HGMMA') or count('HMMA')} WARPGROUP {count('WARPGROUP')} {st['mma']}"
                     + "".join(f"\n    ptxas: {w}" for w in st["ptxas_warnings"]))
    return lines


def sass_main_loop(cubin: bytes) -> list[tuple[str, str]]:
    """(opcode, operands) of each SASS instruction of ``cubin``'s largest loop body."""
    from evenflow._compile_check import sass_loop_bodies

    return (sass_loop_bodies(cubin) or [[]])[0]


def _regs_written(op: str, args: str) -> set[int]:
    # general registers an ordinary SASS instruction writes: its first operand where that is a register, 2 or 4 of
    # them for .64 / .WIDE / .128 forms (stores, branches and barriers write none: their first operand is not one)
    import re

    m = re.match(r"R(\d+)\b", args)
    if not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_register_hazards(loop: list[tuple[str, str]]) -> list[str]:
    """Writes to a register an unfinished ``wgmma`` reads (its A operand, where it comes from registers: 4 from the
    second operand) or accumulates in (N / 2 from the first, for an m64nNk f32 MMA), in a loop body run twice (the
    second trip sees what the back edge carries): each ``HGMMA`` joins the group the next one marked ``gsb0``
    closes, ``WARPGROUP.DEPBAR.LE gsb0, k`` retires all but the newest k groups. PTX forbids such writes (the MMA
    may read the register after it); ptxas does not always keep them apart (round AS5)."""
    import re

    flying, building, found = [], set(), []
    for trip in (1, 2):
        for op, args in loop:
            if op.startswith("HGMMA"):  # "HGMMA.64" + "x128x16.F32 R24, R88, gdesc[UR16], R24, gsb0"
                shape, _, rest = args.partition(" ")
                n = int(re.match(r"x(\d+)x", shape).group(1))
                ops = [x.strip() for x in rest.split(",")]
                d = int(ops[0][1:])
                building |= set(range(d, d + n // 2))
                if ops[1].startswith("R"):  # A from registers (else a shared-memory descriptor)
                    a = int(ops[1][1:])
                    building |= set(range(a, a + 4))
                if "gsb0" in args:
                    flying.append(building)
                    building = set()
            elif op.startswith("WARPGROUP.DEPBAR"):
                keep = int(re.search(r"0x([0-9a-f]+)", args).group(1), 16)
                flying = flying[len(flying) - keep:] if keep else []
            else:
                hit = _regs_written(op, args) & set().union(building, *flying)
                if hit and trip == 2:
                    found.append(f"{op} {args}: writes R{min(hit)} of an unfinished wgmma")
    return found


def sm90_builds(names=None) -> dict[str, dict]:
    """Each formulation's sm_90 build (CPU, TRITON_INTERPRET=0): registers, spill bytes, shared memory, its K
    loop's SASS (instructions and opcode counts), PTX MMA counts, and ptxas' warnings (a wgmma pipeline that ptxas
    serialises says so there)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from evenflow._compile_check import _ptxas_usage, mma_counts, sass_loops

    out = {}
    for name in names or FORMULATIONS:
        f = FORMULATIONS[name]
        sig = {"p_x": "*fp16" if f.swap else "*fp8e4nv", "p_w": "*fp8e4nv", "p_o": "*fp32",
               "R": "i32", "N": "i32", "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
        consts = {"BM": f.block_m, "BN": f.block_n, "BK": f.block_k}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
        if f.gluon:
            sig.update(STAGES="constexpr", SYNC="constexpr", W_PLAIN="constexpr", OUT_ACC="constexpr",
                       WARPS="constexpr")
            src = GluonASTSource(fn=gluon_rs_kernel, signature=sig, attrs=attrs,
                                 constexprs={**consts, "STAGES": f.num_stages, "SYNC": False, "W_PLAIN": False,
                                             "OUT_ACC": f.out_acc, "WARPS": f.num_warps})
            options = {"num_warps": f.num_warps}
        else:
            sig.update(SWAP="constexpr", DOT_F32="constexpr")
            src = ASTSource(fn=gemm_kernel, signature=sig, attrs=attrs,
                            constexprs={**consts, "SWAP": f.swap, "DOT_F32": False})
            options = {"num_warps": f.num_warps, "num_stages": f.num_stages}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        regs, spill = _ptxas_usage(c.asm["ptx"], 90)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "k.ptx"), "w") as fh:
                fh.write(c.asm["ptx"])
            r = subprocess.run([ptxas, "--gpu-name=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
        loop = (sass_loops(c.asm["cubin"]) or [{"instructions": 0, "ops": {}}])[0]
        body = sass_main_loop(c.asm["cubin"])
        # ptxas reports a serialised wgmma pipeline as an info line (C7510-C7520, "Potential Performance Loss")
        notes = [ln.strip() for ln in r.stderr.splitlines()
                 if "arning" in ln or "Potential Performance Loss" in ln or "serialized" in ln or "(C75" in ln]
        out[name] = {"regs": regs, "spill": spill, "shared": c.metadata.shared, "instructions": loop["instructions"],
                     "loop": loop["ops"], "mma": mma_counts(c.asm["ptx"]), "ptxas_warnings": notes,
                     "depbars": [a for o, a in body if o.startswith("WARPGROUP.DEPBAR")],
                     "hazards": wgmma_register_hazards(body)}
    return out


def main(argv=None) -> None:
    from evenflow.bench import harness as H

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--sm90-stats", action="store_true",
                   help="compile for sm_90 on this machine and print the loop statistics (no GPU; TRITON_INTERPRET=0)")
    p.add_argument("--sm90-json", default=None, metavar="NAMES",
                   help="compile these formulations (comma list) for sm_90 and print sm90_builds() as JSON (no GPU)")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    p.add_argument("--impls", default=",".join(FORMULATIONS), help="comma list of " + ",".join(FORMULATIONS))
    args = p.parse_args(argv)
    if args.sm90_stats:
        print("\n".join(sm90_stats()))
        return
    if args.sm90_json:
        import json

        print(json.dumps(sm90_builds(args.sm90_json.split(","))))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/probe_moe_operand.py needs a CUDA GPU (or --sm90-stats)")
    ceil = H.measure_ceilings(verbose=False)
    res = H.Results("probe_moe_operand", ceilings=ceil, out=args.out,
                    meta={"floor": "max(bytes / copy_TBps, 2*E*R*N*K / bf16_TFLOPs); bytes = fp8 weights + "
                                   "activations (1 B, 2 B when stored as f16) + fp32 output"})
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        e, r, n, k = CASES[case]
        x, w = make_inputs(e, r, n, k, "cuda", gen)
        ref = torch.bmm(x.float(), w.float().transpose(1, 2))
        flops = 2.0 * e * r * n * k
        for impl in args.impls.split(","):
            f = FORMULATIONS[impl]
            nbytes = e * n * k + e * r * k * (2 if f.swap else 1) + 4 * e * r * n
            fl = H.floor_us(nbytes, flops, ceilings=ceil, rate="bf16_TFLOPs")
            try:
                fn = run_formulation(impl, x, w)
                err = float((fn() - ref).abs().max())
                res.add(case=case, impl=impl, us=H.time_graph([fn]), floor_us=fl, max_abs_err=err,
                        rows_per_expert=r, n=n, k=k)
            except Exception as exc:  # a formulation that does not build is a row, not a crash
                res.add_error(case=case, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)  # exact: e4m3 values fit bf16
        fl = H.floor_us(e * n * k * 2 + e * r * k * 2 + 2 * e * r * n, flops, ceilings=ceil, rate="bf16_TFLOPs")
        res.add(case=case, impl="torch-bmm-bf16", floor_us=fl, us=H.time_graph([lambda: torch.bmm(xb, wb.mT)]),
                rows_per_expert=r, n=n, k=k)
        print(f"[probe_moe_operand] {case} done", flush=True)
    res.finish(x="case", group=None, plot=False, columns=["case", "impl", "us", "floor_us", "frac_of_floor",
                                                          "max_abs_err"])


if __name__ == "__main__":
    main()
