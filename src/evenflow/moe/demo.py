"""``evenflow demo`` hook for the fused MoE: one Qwen3-30B-A3B decode step's MoE layer on a GPU
(32 tokens, 128 experts top-8, hidden 2048, intermediate 768) in every weight format; tiny on a CPU.
Peers (SGLang's Triton fused MoE, torch._grouped_mm) are timed by ``benchmarks/moe.py``."""
from __future__ import annotations

import torch

import evenflow
from evenflow.reference.moe import moe_rule_terms, random_moe_weights, random_routing
from evenflow.testing import rule_check

FORMATS = ("bf16", "fp8_per_tensor", "fp8_block")


def run_demo(ctx) -> list[dict]:
    torch.manual_seed(0)
    if ctx.gpu:
        t, k, e, h, i, case = 32, 8, 128, 2048, 768, "qwen3-30b-a3b 32 tokens"
    else:
        t, k, e, h, i, case = 3, 2, 4, 256, 128, "tiny T3 E4 top-2 H256 I128"
    x = torch.randn(t, h, device=ctx.device).bfloat16()
    ids, w = random_routing(t, k, e, ctx.device)
    rows = []
    ceil = ctx.harness.measure_ceilings(verbose=False) if ctx.gpu else None
    for fmt in FORMATS:
        ew = random_moe_weights(fmt, e, h, i, ctx.device)
        y = evenflow.fused_moe(x, ids, w, ew)
        ref, base, allowance = moe_rule_terms(x, ids, w, ew)
        # finite, and within the bound plus the fp8 requantisation allowance element by element
        msg, err, bound = rule_check(y, ref, base, allowance=allowance)
        ok = not msg
        check = f"max|err| {err:.1e} <= bound {bound:.1e}"
        if allowance.any():
            check += f" (+ fp8 requant allowance per element, max {float(allowance.max()):.1e})"
        row = {"operator": f"fused_moe[{fmt}]", "case": case, "check": check, "ok": ok, "us": None, "floor_us": None,
               "peers": {}}
        if ctx.gpu:
            H = ctx.harness
            out = torch.empty_like(x)
            row["us"] = H.time_graph(lambda ew=ew: evenflow.fused_moe(x, ids, w, ew, out=out))
            hit = int(torch.unique(ids).numel())
            wbytes = ew.w13[0].numel() * ew.w13.element_size() + ew.w2[0].numel() * ew.w2.element_size()
            row["floor_us"] = H.floor_us(bytes_moved=hit * wbytes + 2 * t * h * 2, ceilings=ceil)
        rows.append(row)
    return rows
