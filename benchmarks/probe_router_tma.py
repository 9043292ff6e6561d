"""Does the small-M router tile read faster through TMA than through cp.async? (round BJ probe)

Rounds BH3-BH5 put the CUDA-core router tile's time at M <= 16 on ``t ~ 1.65 us + (KB into the busiest SM) /
~50-60 GB/s``, with the SM's L1/TEX pipe its busiest unit (ncu, BH5: 64% at M = 16) and the L2 at ~20%: the
tile's copies (``cp.async``, through L1/TEX) and its shared-memory reads share that pipe. A TMA copy
(``cp.async.bulk.tensor``) moves a whole box from L2 into shared memory without the load/store unit. This probe
runs the same fp32 FMA tile (bf16 x widened exactly, the fp32 weight as stored, a fixed tree over the k-lanes) with
its x and weight boxes loaded through tensor descriptors (``tma``), beside the library's ``fp32-splitk`` kernel on
the same tile (``cp.async``, unsplit) and the dispatch's own pick (``entry``), in graph replay with rotated copies
(as the router tuner times), each checked against the fp64 product with the tests' rule.

    python benchmarks/probe_router_tma.py [--out DIR]

A TMA box is at most 256 elements a dimension, so the tiles are 4 x 2 x 256 (rows x weight columns x K a step).
Prints a table and writes ``probe_router_tma.json`` (a diagnostic, not a result file of record).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evenflow._kernels.common import pdl_enter  # noqa: E402

# (label, M, N, K): the router benchmark's small-M points that miss 2x the floor, and one that meets it
POINTS = (("k4096-m4", 4, 192, 4096), ("k4096-m16", 16, 192, 4096), ("qwen3-m4", 4, 128, 2048),
          ("longcat-lite-m4", 4, 384, 3072))
TMA_STAGES = (3, 5, 8)
PTR_STAGES = (3, 5)


@triton.jit
def tma_fma_kernel(x_desc, w_desc, p_out, M, N, K, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   PDL: tl.constexpr):
    """out[m0:m0+BM, n0:n0+BN] = x @ w.T in fp32 FMAs, x and w boxes by TMA (K a multiple of BLOCK_K)."""
    pdl_enter(PDL)
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        b_x = x_desc.load([m0, k]).to(tl.float32)
        b_w = w_desc.load([n0, k])
        acc = tl.fma(b_x[:, None, :], b_w[None, :, :], acc)
    b_out = tl.sum(acc, axis=2)
    o_m = m0 + tl.arange(0, BLOCK_M)
    o_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :], b_out,
             mask=(o_m < M)[:, None] & (o_n < N)[None, :])


def tma_launcher(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bm: int, bn: int, bk: int, stages: int,
                 warps: int = 4, pdl: bool = True):
    """A zero-argument launch of :func:`tma_fma_kernel` on x [M, K] bf16, w [N, K] fp32 into out [M, N] fp32."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0]
    if k % bk:
        raise ValueError(f"K={k} must be a multiple of BLOCK_K={bk}")
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    kw = {"launch_pdl": True} if pdl else {}

    def launch():
        tma_fma_kernel[grid](xd, wd, out, m, n, k, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             NUM_STAGES=stages, PDL=pdl, num_warps=warps, **kw)
        return out
    return launch


def main(argv=None) -> None:
    import evenflow
    import router as bench  # the router benchmark's bytes a call moves and its rotation size
    from evenflow.bench import harness as H
    from evenflow.router.dispatch import GemmConfig
    from evenflow.testing import rule_check

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_router_tma.py needs a CUDA GPU")
    # the descriptors' scratch, where Triton asks for one
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for label, m, n, k in POINTS:
        ws, xs, rws, outs, ref, base, entry = bench.probe_point(m, n, k)
        variants = {"entry": entry}
        for st in PTR_STAGES:
            cfg = GemmConfig(4, 2, 256, 1, 4, st, "fp32-splitk")
            variants[f"cp.async-4x2x256-s{st}"] = [
                lambda x=x, rw=rw, o=o, c=cfg: evenflow.router_gemm(x, rw, out=o, config=c, prefetch_weights=False)
                for x, rw, o in zip(xs, rws, outs)]
        for st in TMA_STAGES:
            variants[f"tma-4x2x256-s{st}"] = [tma_launcher(x, w, o, 4, 2, 256, st) for x, w, o in zip(xs, ws, outs)]
        line = []
        for name, fns in variants.items():
            out = fns[0]()
            msg, err, bound = rule_check(out, ref, base)
            us = H.time_graph(fns)
            rows.append(dict(point=label, M=m, N=n, K=k, impl=name, us=round(us, 3), max_abs_err=err, rule_ok=not msg))
            line.append(f"{name} {us:6.2f}{'' if not msg else ' FAIL'}")
        print(f"{label:16s} " + " | ".join(line), flush=True)
    if a.out:
        H.write_rows(a.out, "probe_router_tma.json", rows)


if __name__ == "__main__":
    main()
