"""Do tensor-memory-accelerator (TMA) loads lift the large-batch expert GEMMs? (round AT probe)

At Qwen3-30B-A3B T = 4096 the fused MoE's bf16 GEMMs run at 0.58 (gate-up) and 0.39 (down) of the dense bf16
rate (perf notes, round T1) where cuBLAS's batched GEMM on the same shapes reaches 0.87 (round AS5). Every MoE
GEMM loads both operands with pointer loads, which Triton pipelines through ``cp.async`` (each thread computes and
issues its own addresses a K step). On sm_90 a TMA load moves a whole tile for one thread's instruction and
lands it swizzled for ``wgmma``; the weight operand, a plain 2-D block of ``[E * N, K]``, can take it, while the
activations are rows gathered by token (TMA on sm_90 has no row gather) and stay pointer loads. This probe times
the GEMM alone, every expert with the same row count (a batched GEMM, no routing, no index build), each
formulation in one run beside cuBLAS's bf16 ``bmm``:

- ``ptr-*``: both operands by pointer loads, the activation rows gathered through a token index (today's kernels);
- ``tmaw-*``: the weight tile by TMA, the activations gathered as today;
- ``tma2-*``: both by TMA on activations already laid out by expert (no gather: the bound a gather-free layout
  would reach);
- ``*-p``: persistent (one program an SM walking the tiles), ``*-pws``: persistent with Triton's warp
  specialisation (producer warps issue the loads), ``*-pnf``: persistent without flattening the K loop into the
  tile loop;
- the MoE gate-up's shape, step by step: ``ptr-gu-*`` two accumulators (gate and up weight rows) and the
  SiLU(gate) * up epilogue, ``ptr-gui-*`` one accumulator over interleaved gate / up rows split after the loop,
  ``ptr-r-*`` ragged experts (masked rows), ``ptr-gur-*`` both.

    python benchmarks/probe_moe_tma.py [--out DIR] [--cases ...] [--impls ...]

Rows (BENCH.md schema): one per case x formulation, ``us`` (graph replay), ``frac_of_floor`` against the larger of
bytes / copy bandwidth and FLOPs / the measured bf16 matmul rate, ``max_abs_err`` against an fp32 product.
Outputs are bf16 ([E * R, N], as the gate-up's activation is), fp32 accumulation.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from evenflow._kernels.common import dot_operand
from evenflow._runtime import dot_needs_fp32


@triton.jit
def _tile_coords(tile, R, N, BM: tl.constexpr, BN: tl.constexpr):
    # tile -> (expert, first row, first column); n-blocks fastest, so neighbouring programs share the x rows
    nb = N // BN
    per_e = (R // BM) * nb
    e = tile // per_e
    t = tile % per_e
    return e, (t // nb) * BM, (t % nb) * BN


@triton.jit
def _tile(e, m0, n0, p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, W_TMA: tl.constexpr, X_MODE: tl.constexpr, STAGES: tl.constexpr, GU: tl.constexpr,
          RAG: tl.constexpr, DOT_F32: tl.constexpr):
    # one output tile: its K loop (pipelined at STAGES; 0: left to an enclosing flattened loop), then its store.
    # GU: the gate-up's shape, SiLU(gate) * up stored as [rows, N / 2]: 1, two accumulators (weight rows c0.. and
    # N / 2 + c0.., c0 = n0 / 2); 2, one accumulator over weight rows n0.. that interleave gate and up rows (gate j,
    # up j at 2j, 2j + 1), split in registers; RAG: expert e has cnt[e] <= R rows, the rest masked (loads, stores)
    BW: tl.constexpr = BN // 2 if GU == 1 else BN
    c0 = n0 // 2 if GU == 1 else n0
    o_m = m0 + tl.arange(0, BM)
    o_c = c0 + tl.arange(0, BW)
    o_k = tl.arange(0, BK)
    e64 = e.to(tl.int64)
    m_m = o_m < tl.load(p_cnt + e) if RAG else o_m < R
    if X_MODE == 0:  # gathered: the rows of token ids idx[e, m]
        tok = tl.load(p_idx + e64 * R + o_m, mask=m_m, other=0).to(tl.int64)
        p_a = p_x + tok[:, None] * K + o_k[None, :]
    else:
        p_a = p_x + (e64 * R + o_m)[:, None] * K + o_k[None, :]
    p_b = p_w + (e64 * N + o_c)[None, :] * K + o_k[:, None]
    p_bu = p_b + (N // 2) * K
    acc = tl.zeros([BM, BW], dtype=tl.float32)
    acc_u = tl.zeros([BM, BW], dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES if STAGES > 0 else None):
        if X_MODE == 2:
            a = x_desc.load([(e * R + m0).to(tl.int32), k])
        elif RAG:
            a = tl.load(p_a + k, mask=m_m[:, None], other=0.0)
        else:
            a = tl.load(p_a + k)
        a = dot_operand(a, DOT_F32)
        if W_TMA:
            b = w_desc.load([(e * N + c0).to(tl.int32), k]).T
        else:
            b = tl.load(p_b + k)
        acc = tl.dot(a, dot_operand(b, DOT_F32), acc)
        if GU == 1:
            if W_TMA:
                bu = w_desc.load([(e * N + N // 2 + c0).to(tl.int32), k]).T
            else:
                bu = tl.load(p_bu + k)
            acc_u = tl.dot(a, dot_operand(bu, DOT_F32), acc_u)
    if GU == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    elif GU == 2:
        g, u = acc.reshape([BM, BN // 2, 2]).split()
        acc = g / (1.0 + tl.exp(-g)) * u
    NO: tl.constexpr = 2 if GU else 1
    o_o = n0 // NO + tl.arange(0, BN // NO)
    p_out = p_o + (e64 * R + o_m)[:, None] * (N // NO) + o_o[None, :]
    if RAG:
        tl.store(p_out, acc.to(p_o.dtype.element_ty), mask=m_m[:, None])
    else:
        tl.store(p_out, acc.to(p_o.dtype.element_ty))


@triton.jit
def bmm_kernel(p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, W_TMA: tl.constexpr, X_MODE: tl.constexpr, STAGES: tl.constexpr,
               GU: tl.constexpr, RAG: tl.constexpr, DOT_F32: tl.constexpr):
    """o[e * R + m, n] = sum_k x[row(e, m), k] w[e * N + n, k]; one program a (expert, row block, column block)."""
    e, m0, n0 = _tile_coords(tl.program_id(0), R, N, BM, BN)
    _tile(e, m0, n0, p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, BM, BN, BK, W_TMA, X_MODE, STAGES, GU,
          RAG, DOT_F32)


@triton.jit
def bmm_persistent_kernel(p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, num_tiles, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, W_TMA: tl.constexpr, X_MODE: tl.constexpr,
                          STAGES: tl.constexpr, GU: tl.constexpr, RAG: tl.constexpr, WS: tl.constexpr,
                          FLAT: tl.constexpr, DOT_F32: tl.constexpr):
    """The same product, each program taking tiles pid, pid + programs, ... (FLAT: the tile loop flattened with
    the K loop and pipelined across tiles, ``WS`` Triton's warp specialisation of it; else each tile's K loop
    pipelined on its own)."""
    if FLAT:
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=STAGES, flatten=True,
                             warp_specialize=WS):
            e, m0, n0 = _tile_coords(tile, R, N, BM, BN)
            _tile(e, m0, n0, p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, BM, BN, BK, W_TMA, X_MODE, 0, GU,
                  RAG, DOT_F32)
    else:
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            e, m0, n0 = _tile_coords(tile, R, N, BM, BN)
            _tile(e, m0, n0, p_x, x_desc, p_idx, p_cnt, w_desc, p_w, p_o, R, N, K, BM, BN, BK, W_TMA, X_MODE, STAGES,
                  GU, RAG, DOT_F32)


@dataclass(frozen=True)
class Formulation:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    w_tma: bool  # the weight tile by a TMA descriptor
    x_mode: int  # 0: rows gathered through a token index (pointer loads); 1: by expert, pointer loads; 2: TMA
    persistent: bool = False
    warp_specialize: bool = False
    gate_up: int = 0  # the gate-up's SiLU(gate) * up epilogue: 1 two accumulators (AT5), 2 one, interleaved (AT6)
    ragged: bool = False  # experts' row counts below R, masked rows (round AT5)
    flat: bool = True  # persistent: the tile loop flattened with the K loop (False: AT6)


def _named():
    out = {}
    for tile, (bm, bn, bk, w, s) in {"bm128-bn256-w8": (128, 256, 64, 8, 3), "bm128-bn128-w8": (128, 128, 64, 8, 4),
                                    "bm128-bn128-w4": (128, 128, 64, 4, 4)}.items():
        out[f"ptr-{tile}"] = Formulation(bm, bn, bk, w, s, False, 0)
        out[f"tmaw-{tile}"] = Formulation(bm, bn, bk, w, s, True, 0)
        out[f"tma2-{tile}"] = Formulation(bm, bn, bk, w, s, True, 2)
    for tile, (bm, bn, bk, w, s) in {"bm128-bn256-w8": (128, 256, 64, 8, 3),
                                    "bm128-bn128-w8": (128, 128, 64, 8, 4)}.items():
        out[f"tmaw-{tile}-p"] = Formulation(bm, bn, bk, w, s, True, 0, persistent=True)
        out[f"tma2-{tile}-p"] = Formulation(bm, bn, bk, w, s, True, 2, persistent=True)
        out[f"tma2-{tile}-pws"] = Formulation(bm, bn, bk, w, s, True, 2, persistent=True, warp_specialize=True)
    # round AT3: persistence without TMA; a fourth stage; 64-row tiles (T = 1024: 64 rows an expert; the table's
    # bf16 tile there is 64 x (64 + 64) on 4 warps at 4 stages)
    out["ptr-bm128-bn256-w8-p"] = Formulation(128, 256, 64, 8, 3, False, 0, persistent=True)
    out["tmaw-bm128-bn256-w8-s4-p"] = Formulation(128, 256, 64, 8, 4, True, 0, persistent=True)
    for tile, (bm, bn, bk, w, s) in {"bm64-bn128-w4": (64, 128, 64, 4, 4), "bm64-bn256-w4": (64, 256, 64, 4, 4),
                                    "bm64-bn256-w8": (64, 256, 64, 8, 4)}.items():
        out[f"ptr-{tile}"] = Formulation(bm, bn, bk, w, s, False, 0)
        out[f"ptr-{tile}-p"] = Formulation(bm, bn, bk, w, s, False, 0, persistent=True)
        out[f"tmaw-{tile}-p"] = Formulation(bm, bn, bk, w, s, True, 0, persistent=True)
    # round AT5: the MoE gate-up's structure, step by step (gu: two accumulators and the SiLU epilogue; gur: and
    # ragged experts, masked rows)
    for kind, gu, rag in (("gu", 1, False), ("gur", 1, True), ("r", 0, True), ("gui", 2, False)):
        for sfx, per in (("", False), ("-p", True)):
            out[f"ptr-{kind}-bm128-bn256-w8{sfx}"] = Formulation(128, 256, 64, 8, 3, False, 0, persistent=per,
                                                                 gate_up=gu, ragged=rag)
    # round AT6: the two-accumulator gate-up persistent without the flattening
    out["ptr-gu-bm128-bn256-w8-pnf"] = Formulation(128, 256, 64, 8, 3, False, 0, persistent=True, gate_up=1,
                                                   flat=False)
    return out


FORMULATIONS = _named()

# name: (experts, rows per expert, N, K). Rows per expert = T * top_k / E at Qwen3 (E 128, top-8).
CASES = {
    "qwen3-gate-up-T4096": (128, 256, 1536, 2048),
    "qwen3-down-T4096": (128, 256, 2048, 768),
    "qwen3-gate-up-T1024": (128, 64, 1536, 2048),
    "qwen3-down-T1024": (128, 64, 2048, 768),
}


def make_inputs(e: int, r: int, n: int, k: int, device, gen):
    """bf16 token activations x [T, K] (T = e * r / 8: each token in 8 experts' rows), token ids idx [e, r] (each
    expert's rows in random token order), the same rows laid out by expert x_e [e * r, K], weights [e * n, K]."""
    t = max(1, e * r // 8)
    x = torch.randn(t, k, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.randint(0, t, (e, r), generator=gen, device=device, dtype=torch.int32)
    w = (torch.randn(e * n, k, generator=gen, device=device) / k ** 0.5).to(torch.bfloat16)
    return x, idx, x[idx.flatten().long()].contiguous(), w


def row_counts(e: int, r: int, device) -> torch.Tensor:
    """Rows of each expert for the ragged formulations: r, r - 16, r - 32, r - 48 in turn (a partial last tile)."""
    return (r - 16 * (torch.arange(e, device=device, dtype=torch.int32) % 4)).clamp(min=0)


def reference(name: str, x_e, w, e: int, r: int, dtype=torch.float64) -> torch.Tensor:
    """What ``name`` computes, in ``dtype`` ([e * r, n] or, for the gate-up ones, [e * r, n / 2]); rows past a ragged
    expert's count are 0 (the kernel writes none: compare against an output zeroed first)."""
    f = FORMULATIONS[name]
    k = x_e.shape[1]
    n = w.shape[0] // e
    o = torch.bmm(x_e.view(e, r, k).to(dtype), w.view(e, n, k).to(dtype).mT)
    if f.gate_up:
        g, u = (o[..., :n // 2], o[..., n // 2:]) if f.gate_up == 1 else (o[..., 0::2], o[..., 1::2])
        o = g / (1 + torch.exp(-g)) * u
    if f.ragged:
        keep = torch.arange(r, device=o.device)[None, :] < row_counts(e, r, o.device)[:, None]
        o = o * keep[..., None]
    return o.reshape(e * r, -1)


def run_formulation(name: str, x, idx, x_e, w, out=None, num_sms: int | None = None):
    """A zero-argument launcher of ``name`` writing bf16 ``out`` ([e * r, n], or [e * r, n / 2] for the gate-up
    formulations; ragged ones leave the rows past each expert's count as they were)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    f = FORMULATIONS[name]
    e, r = idx.shape
    k = x.shape[1]
    n = w.shape[0] // e
    if r % f.block_m or n % f.block_n or k % f.block_k:
        raise ValueError(f"{name}: tiles {f.block_m}x{f.block_n}x{f.block_k} do not divide R={r} N={n} K={k}")
    if out is None:
        out = torch.zeros(e * r, n // 2 if f.gate_up else n, dtype=torch.bfloat16, device=x.device)
    w_desc = TensorDescriptor.from_tensor(w, [f.block_n // (2 if f.gate_up == 1 else 1), f.block_k]) if f.w_tma else w
    x_desc = TensorDescriptor.from_tensor(x_e, [f.block_m, f.block_k]) if f.x_mode == 2 else x_e
    p_x = x if f.x_mode == 0 else x_e
    cnt = row_counts(e, r, x.device)
    tiles = e * (r // f.block_m) * (n // f.block_n)
    common = dict(BM=f.block_m, BN=f.block_n, BK=f.block_k, W_TMA=f.w_tma, X_MODE=f.x_mode, STAGES=f.num_stages,
                  GU=f.gate_up, RAG=f.ragged, DOT_F32=dot_needs_fp32(), num_warps=f.num_warps)
    if f.persistent:
        sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = (min(tiles, sms),)

        def launch():
            bmm_persistent_kernel[grid](p_x, x_desc, idx, cnt, w_desc, w, out, r, n, k, tiles,
                                        WS=f.warp_specialize, FLAT=f.flat, **common)
            return out
    else:
        def launch():
            bmm_kernel[(tiles,)](p_x, x_desc, idx, cnt, w_desc, w, out, r, n, k, **common)
            return out
    return launch


def sm90_builds(names=None) -> dict[str, dict]:
    """Each formulation's sm_90 build (CPU, TRITON_INTERPRET=0): registers, spill bytes, shared memory and the opcode
    counts of its largest SASS loop (``UTMALDG``: a TMA load; ``LDGSTS``: a pointer load's asynchronous copy)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from evenflow._compile_check import _ptxas_usage, sass_loops

    out = {}
    for name in names or FORMULATIONS:
        f = FORMULATIONS[name]
        desc = lambda rows: f"tensordesc<bf16[{rows}, {f.block_k}]>"  # noqa: E731
        w_rows = f.block_n // (2 if f.gate_up == 1 else 1)
        sig = {"p_x": "*bf16", "x_desc": desc(f.block_m) if f.x_mode == 2 else "*bf16", "p_idx": "*i32",
               "p_cnt": "*i32", "w_desc": desc(w_rows) if f.w_tma else "*bf16", "p_w": "*bf16", "p_o": "*bf16",
               "R": "i32", "N": "i32", "K": "i32"}
        consts = dict(BM=f.block_m, BN=f.block_n, BK=f.block_k, W_TMA=f.w_tma, X_MODE=f.x_mode,
                      STAGES=f.num_stages, GU=f.gate_up, RAG=f.ragged, DOT_F32=False)
        fn = bmm_kernel
        if f.persistent:
            sig["num_tiles"] = "i32"
            consts["WS"] = f.warp_specialize
            consts["FLAT"] = f.flat
            fn = bmm_persistent_kernel
        sig.update({c: "constexpr" for c in consts})
        names_ = list(sig)
        aligned = [a for a in ("p_x", "x_desc", "p_idx", "p_cnt", "w_desc", "p_w", "p_o", "R", "N", "K")
                   if not sig[a].startswith("tensordesc")]  # as a GPU launch specialises them (16-byte multiples)
        attrs = {(names_.index(a),): [["tt.divisibility", 16]] for a in aligned}
        c = triton.compile(ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": f.num_warps, "num_stages": f.num_stages})
        regs, spill = _ptxas_usage(c.asm["ptx"], 90)
        loop = (sass_loops(c.asm["cubin"]) or [{"instructions": 0, "ops": {}}])[0]
        out[name] = {"regs": regs, "spill": spill, "shared": c.metadata.shared, "instructions": loop["instructions"],
                     "loop": loop["ops"]}
    return out


def _tma_allocator():
    # device-side descriptors (which Triton may build for host ones under warp specialisation) need scratch memory
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def main(argv=None) -> None:
    from evenflow.bench import harness as H

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    p.add_argument("--impls", default=",".join(FORMULATIONS), help="comma list of " + ",".join(FORMULATIONS))
    p.add_argument("--sm90-json", default=None, metavar="NAMES",
                   help="compile these formulations (comma list) for sm_90 and print sm90_builds() as JSON (no GPU; "
                        "TRITON_INTERPRET=0)")
    args = p.parse_args(argv)
    if args.sm90_json:
        import json

        print(json.dumps(sm90_builds(args.sm90_json.split(","))))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/probe_moe_tma.py needs a CUDA GPU")
    _tma_allocator()
    ceil = H.measure_ceilings(verbose=False)
    res = H.Results("probe_moe_tma", ceilings=ceil, out=args.out,
                    meta={"floor": "max(bytes / copy_TBps, 2*E*R*N*K / bf16_TFLOPs); bytes = bf16 weights + "
                                   "activations as laid out by expert + bf16 output"})
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        e, r, n, k = CASES[case]
        x, idx, x_e, w = make_inputs(e, r, n, k, "cuda", gen)
        flops = 2.0 * e * r * n * k
        fl = H.floor_us(2 * (e * n * k + e * r * k + e * r * n), flops, ceilings=ceil, rate="bf16_TFLOPs")
        for impl in args.impls.split(","):
            try:
                fn = run_formulation(impl, x, idx, x_e, w)
                err = float((fn().float() - reference(impl, x_e, w, e, r, torch.float32)).abs().max())
                # (the gate-up formulations write half the output bytes and the ragged ones skip up to 48 rows an
                # expert: the floor stays the plain GEMM's, so fractions compare times)
                res.add(case=case, impl=impl, us=H.time_graph([fn]), floor_us=fl, max_abs_err=err,
                        rows_per_expert=r, n=n, k=k)
            except Exception as exc:  # a formulation that does not build is a row, not a crash
                res.add_error(case=case, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
            print(f"[probe_moe_tma] {case} {impl}", flush=True)
        xb, wb = x_e.view(e, r, k), w.view(e, n, k)
        res.add(case=case, impl="torch-bmm-bf16", floor_us=fl, us=H.time_graph([lambda: torch.bmm(xb, wb.mT)]),
                rows_per_expert=r, n=n, k=k)
    res.finish(x="case", group=None, plot=False, columns=["case", "impl", "us", "floor_us", "frac_of_floor",
                                                          "max_abs_err"])


if __name__ == "__main__":
    main()
