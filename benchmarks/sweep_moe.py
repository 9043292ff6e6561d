"""Sweep fused_moe tile configs on a few points (one GPU run): which config wins where.

    python benchmarks/sweep_moe.py [--quick] [--out DIR] [--index-only] [--only hy3-tp8/fp8,fp8-block/1]

Most of the time is Triton compiling each config (a few s per config); ``--quick`` keeps 6
configs per point, ``--only`` selects points by substring of ``case/variant/batch``.

Points: Qwen3 bf16 batch 1 (weight streaming, split-K), Hy3 EP8 bf16 batch 32,
Qwen3 bf16 batch 1024 (large tiles), the FP8 batch-1 split-K points (Hy3 TP8
fp8 per-tensor, Hy3 EP8 / Qwen3 fp8-block), Qwen3 fp8-block batch 2, fp8 at batch 512
(Hy3 TP8 per-tensor, Qwen3 block: 64-row wgmma tiles vs 32-row mma.sync). Each config
is checked against the fp32 reference, then graph-timed with rotated weight copies;
``default`` is what ``choose_config`` picks. The index build is timed alone too,
one-program (``index-1prog``) against the two-launch build (``index-multi``),
at every point and at batch 512 / 1024 / 4096 / 8192 (``--index-only``: just those).
Results: <out>/moe_sweep.json (+ md table); use them to retune ``choose_config``
and ``evenflow.moe.routing.MULTI_PROGRAM_PAIRS``.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as B  # noqa: E402  (benchmarks/moe.py: cases, weights, routing, floor)

POINTS = [("qwen3-30b-a3b", "bf16", 1), ("hy3-ep8", "bf16", 32), ("qwen3-30b-a3b", "bf16", 1024),
          ("hy3-tp8", "fp8-tensor", 1), ("hy3-ep8", "fp8-block", 1), ("qwen3-30b-a3b", "fp8-block", 1),
          ("qwen3-30b-a3b", "fp8-block", 2), ("hy3-tp8", "fp8-tensor", 512), ("qwen3-30b-a3b", "fp8-block", 512)]
INDEX_POINTS = [("qwen3-30b-a3b", t) for t in (512, 1024, 4096, 8192)] + [("hy3-ep8", 4096)]


def configs(case: B.MoECase, variant: str, t: int, quick: bool = False):
    """(label, MoEConfig) pairs to try at one point; the first is the default."""
    from evenflow.moe.fused import choose_config

    mode = {"bf16": 0, "fp8-tensor": 1, "fp8-block": 2}[variant]
    d = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, mode,
                      num_experts_total=case.num_experts_total)
    out = [("default", d)]
    r = dataclasses.replace
    if t <= 32:
        for gs in (1, 2, 4, 8, 16):
            for ds in (1, 2, 4):
                out.append((f"gs{gs}-ds{ds}", r(d, gu_split_k=gs, down_split_k=ds)))
        out.append(("gs-default-st4", r(d, num_stages=4)))
        if mode != 2:
            out.append(("gn32", r(d, gu_block_n=32)))
        else:
            out.append(("dn128", r(d, down_block_n=128)))
    else:
        for bm in (32, 64, 128):
            for bn in (64, 128):
                for nw in (4, 8):
                    out.append((f"bm{bm}-bn{bn}-w{nw}", r(d, block_m=bm, gu_block_n=bn, down_block_n=bn,
                                                        num_warps=nw, gu_split_k=1, down_split_k=1)))
        out.append(("bm64-bn128-w8-st4", r(d, block_m=64, gu_block_n=128, down_block_n=128, num_warps=8,
                                           num_stages=4, gu_split_k=1, down_split_k=1)))
    valid = []
    from evenflow.moe.fused import check_config
    for label, c in out:
        try:
            check_config(c, case.hidden, case.inter, mode)
        except ValueError:
            continue
        valid.append((label, c))
    return valid[:6] if quick else valid


def main() -> None:
    import evenflow
    from evenflow.bench import harness as H
    from evenflow.moe.routing import build_moe_index

    def extra(p):
        p.add_argument("--index-only", action="store_true", help="time only the index builds")
        p.add_argument("--only", default="", help="comma-separated substrings: sweep only matching points")

    args = H.parse_args(__doc__.splitlines()[0], extra=extra)
    index_only = args.index_only
    wanted = [w for w in args.only.split(",") if w]
    points = [pt for pt in POINTS if not wanted or any(w in "/".join(map(str, pt)) for w in wanted)]
    ceil = H.measure_ceilings()
    res = H.Results("moe_sweep", ceilings=ceil)
    gen = torch.Generator(device="cpu").manual_seed(0)  # routing, activations (CPU, then moved)
    wgen = torch.Generator(device="cuda").manual_seed(0)  # weights are drawn on the GPU

    def time_index(pt, case, ids, block_m):
        for label, multi in (("index-1prog", False), ("index-multi", True)):
            us = H.time_graph([lambda m=multi: build_moe_index(ids, case.num_local, case.ep_rank, block_m,
                                                               multi_program=m)])
            res.add(case=pt, variant=label, impl="evenflow", us=us, floor_us=None)

    for name, t in H.progress(INDEX_POINTS, "index build"):
        case = B.CASES[name]
        ids, _ = B.make_routing(t, case, gen, B.expert_bias(case.num_experts_total, gen))
        time_index(f"{name}/index/T{t}", case, ids.cuda(), 64)
    for name, variant, t in ([] if index_only else points):
        case = B.CASES[name]
        raw = B.make_weights(case, variant, "cuda", wgen)
        bias = B.expert_bias(case.num_experts_total, gen)
        if variant == "fp8-tensor":
            B.calibrate_static_scales(raw, case, "cuda", gen, bias)
        ids, tw = B.make_routing(t, case, gen, bias)
        stats = B.routing_stats(ids, case)
        nbytes, flops = B.floor_work(case, variant, t, stats)
        rate = "bf16_TFLOPs" if variant == "bf16" else "fp8_TFLOPs"
        floor = H.floor_us(bytes_moved=nbytes, flops=flops, ceilings=ceil, rate=rate)
        n_rot = B.rotations(stats.distinct_experts * B.expert_bytes(case, variant), 60 * 2**20)
        copies = [raw] + [raw.clone() for _ in range(n_rot - 1)]
        ews = []
        for w in copies:
            if variant == "bf16":
                ews.append(evenflow.MoEWeights.bf16(w.w13, w.w2))
            elif variant == "fp8-tensor":
                ews.append(evenflow.MoEWeights.fp8_per_tensor(w.w13, w.w2, w.w13_scale, w.w2_scale,
                                                              w.a13_scale, w.a2_scale))
            else:
                ews.append(evenflow.MoEWeights.fp8_block(w.w13, w.w2, w.w13_scale, w.w2_scale))
        x = torch.randn(t, case.hidden, generator=gen).bfloat16().cuda()
        ids, tw = ids.cuda(), tw.cuda()
        ref = B.reference_moe(x, ids, tw, raw, case)
        pt = f"{name}/{variant}/T{t}"
        time_index(pt, case, ids, 16)
        for label, cfg in H.progress(configs(case, variant, t, args.quick), pt):
            fns = [lambda ew=ew, c=cfg: evenflow.fused_moe(x, ids, tw, ew, ep_rank=case.ep_rank,
                                                           num_experts_total=case.num_experts_total, config=c)
                   for ew in ews]
            try:
                H.check_output(fns[0](), ref, f"{pt} {label}")
                us = H.time_graph(fns)
            except Exception as e:  # a config that fails is a row, not the end of the sweep
                res.add_error(case=pt, variant=label, impl="evenflow", error=f"{type(e).__name__}: {e}"[:200])
                continue
            res.add(case=pt, variant=label, impl="evenflow", us=us, floor_us=floor, config=str(cfg))
    res.finish(x="case", group="variant")


if __name__ == "__main__":
    main()
