"""Is fp8 decode held back by the cache layout's access granularity? (round F probe)

With the NHD cache ``[pages, page, Hkv, D]`` one kv head's row of one token is D bytes
contiguous: 256 B in bf16, 128 B in fp8, the next row 8 heads further on. HND
``[pages, Hkv, page, D]`` puts a head's whole page in one contiguous block. The
same decode kernel reads both (strided views), so timing it on both layouts, and a
plain strided read of the same bytes, separates the kernel from the memory system.

    python benchmarks/probe_kv_layout.py [--out DIR]

Rows (BENCH.md schema): impl ``evenflow-NHD`` / ``evenflow-HND``: decode µs (graph replay)
and frac of the copy floor; ``read-<layout>-s<stages>`` (uniform cases): a Triton kernel
that only sums one head's K and V rows tile by tile (no attention math), same pages and
access pattern as decode.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import decode as bench  # noqa: E402  (the benchmark's cases, floors and inputs)
import evenflow  # noqa: E402
from evenflow.bench import harness  # noqa: E402

FP8 = torch.float8_e4m3fn


@triton.jit
def _read_kernel(p_k, p_v, p_pt, p_out, pages_per_req, stride_p, stride_t, stride_h,
                 HKV: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr):
    # one program per (request, head): stream its pages, sum them (keeps the loads live)
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    o_t = tl.arange(0, PAGE)
    o_d = tl.arange(0, D)
    acc = tl.zeros([PAGE, D], dtype=tl.float32)
    for i in tl.range(0, pages_per_req, num_stages=NUM_STAGES):
        page = tl.load(p_pt + b * pages_per_req + i).to(tl.int64)
        off = page * stride_p + h * stride_h + o_t[:, None] * stride_t + o_d[None, :]
        acc += tl.load(p_k + off).to(tl.float32) + tl.load(p_v + off).to(tl.float32)
    tl.store(p_out + pid * D + o_d, tl.sum(acc, axis=0))


def _caches(pages: int, hkv: int, dtype, layout: str, gen):
    shape = (pages, bench.PAGE_SIZE, hkv, bench.HEAD_DIM) if layout == "NHD" else (pages, hkv, bench.PAGE_SIZE,
                                                                                   bench.HEAD_DIM)
    out = []
    for _ in range(2):
        x = (torch.randn(shape, generator=gen, device="cuda") * 2).to(dtype)
        out.append(x if layout == "NHD" else x.transpose(1, 2))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default="8x32K,1x128K+31x4K,64x4K")
    args = p.parse_args(argv)
    ceil = harness.measure_ceilings(verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.cases.split(","):
        case = bench.parse_case(name)
        pages_per = [-(-n // bench.PAGE_SIZE) for n in case.lengths]
        total = sum(pages_per)
        for dtype in (torch.bfloat16, FP8):
            floor = harness.floor_us(bench.floor_bytes(case, dtype), ceilings=ceil)
            mp = max(pages_per)
            perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
            pt = torch.zeros(case.batch, mp, dtype=torch.int32, device="cuda")
            o = 0
            for i, n in enumerate(pages_per):
                pt[i, :n] = perm[o:o + n]
                o += n
            sl = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
            q = torch.randn(case.batch, case.num_q_heads, bench.HEAD_DIM, device="cuda").to(torch.bfloat16)
            sc = dict(k_scale=0.5, v_scale=0.5) if dtype == FP8 else {}
            for layout in ("NHD", "HND"):
                k, v = _caches(total, case.num_kv_heads, dtype, layout, gen)
                plan = evenflow.DecodePlan(case.batch, mp * bench.PAGE_SIZE, case.num_kv_heads,
                                           page_size=bench.PAGE_SIZE, device="cuda").update(sl)
                us = harness.time_graph(lambda: evenflow.decode_attention(q, k, v, pt, sl, plan=plan, **sc))
                variant = "fp8-kv" if dtype == FP8 else "bf16-kv"
                row = dict(case=name, variant=variant, impl=f"evenflow-{layout}", us=us, floor_us=floor,
                           frac_of_floor=floor / us)
                read = []
                if len(set(case.lengths)) == 1:  # uniform: the plain read, same pages, same pattern
                    out = torch.empty(case.batch * case.num_kv_heads, bench.HEAD_DIM, device="cuda")
                    ptc = pt.contiguous()
                    for stages in (2, 4):
                        t = harness.time_graph(lambda: _read_kernel[(case.batch * case.num_kv_heads,)](
                            k, v, ptc, out, mp, k.stride(0), k.stride(1), k.stride(2), HKV=case.num_kv_heads,
                            PAGE=bench.PAGE_SIZE, D=bench.HEAD_DIM, NUM_STAGES=stages, num_warps=4))
                        read.append(dict(case=name, variant=variant, impl=f"read-{layout}-s{stages}", us=t,
                                         floor_us=floor, frac_of_floor=floor / t))
                rows += [row] + read
                print(f"{name:14s} {variant} {layout} decode {us:8.1f} us frac {floor / us:.3f} "
                      + " ".join(f"{r['impl']} {r['frac_of_floor']:.3f}" for r in read), flush=True)
    harness.write_rows(harness.results_dir(args.out) / "sweeps", "probe_kv_layout.json", rows, ceilings=ceil)


if __name__ == "__main__":
    main()
