"""Sweep fused_moe tile configs on a few points (one GPU run, ~90 s): which config wins where.

    python benchmarks/sweep_moe.py [--quick] [--out DIR]

Points: Qwen3 bf16 batch 1 (weight streaming, split-K), Hy3 EP8 bf16 batch 32,
Qwen3 bf16 batch 1024 (large tiles), Qwen3 fp8-block batch 1. Each config is
checked against the fp32 reference, then graph-timed with rotated weight copies;
``default`` is what ``choose_config`` picks. The index build is timed alone too.
Results: <out>/moe_sweep.json (+ md table); use them to retune ``choose_config``.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as B  # noqa: E402  (benchmarks/moe.py: cases, weights, routing, floor)

POINTS = [("qwen3-30b-a3b", "bf16", 1), ("hy3-ep8", "bf16", 32), ("qwen3-30b-a3b", "bf16", 1024),
          ("qwen3-30b-a3b", "fp8-block", 1)]


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

    args = H.parse_args(__doc__.splitlines()[0])
    ceil = H.measure_ceilings()
    res = H.Results("moe_sweep", ceilings=ceil)
    gen = torch.Generator(device="cpu").manual_seed(0)  # routing, activations (CPU, then moved)
    wgen = torch.Generator(device="cuda").manual_seed(0)  # weights are drawn on the GPU
    for name, variant, t in POINTS:
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
        idx_us = H.time_graph(lambda: build_moe_index(ids, case.num_local, case.ep_rank, 16))
        res.add(case=pt, variant="index-build", impl="evenflow", us=idx_us, floor_us=None)
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
