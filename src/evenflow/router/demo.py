"""``evenflow demo`` hook for the router: one Qwen3-30B-A3B decode step's router on a GPU
(hidden 2048, 128 experts, top-8 softmax; 32 tokens), tiny on a CPU."""
from __future__ import annotations

import torch

import evenflow
from evenflow.reference import router as R
from evenflow.testing import error_bound


def run_demo(ctx) -> list[dict]:
    torch.manual_seed(0)
    if ctx.gpu:
        m, n, k, case = 32, 128, 2048, "qwen3-30b-a3b 32 tokens"
    else:
        m, n, k, case = 5, 40, 96, "tiny M5 N40 K96"
    w = torch.randn(n, k, device=ctx.device) * 0.02
    x = torch.randn(m, k, device=ctx.device).to(torch.bfloat16)
    rw = evenflow.RouterWeight(w)
    rw.reserve(m)
    logits = evenflow.router_gemm(x, rw)
    ref = R.router_logits_fp64(x, w)
    err = float((logits.double() - ref).abs().max())
    bound = error_bound(ref, R.split_logits_fp32(x, *rw.parts), torch.float32)
    gemm_row = {"operator": "router_gemm", "case": case, "check": f"max|err| {err:.1e} <= bound {bound:.1e}",
                "ok": bool(torch.isfinite(logits).all()) and err <= bound, "us": None, "floor_us": None, "peers": {}}

    ids, wts = evenflow.route(x, rw, 8, "softmax")
    ref_ids, ref_w = R.route_ref(ref, 8, "softmax")
    same = int((ids.cpu() == ref_ids.cpu()).all(-1).sum())
    werr = float((wts.double().cpu() - ref_w.cpu()).abs().max())
    _, base_w = R.route_ref(R.split_logits_fp32(x, *rw.parts), 8, "softmax", dtype=torch.float32)
    wbound = error_bound(ref_w.cpu(), base_w.cpu(), torch.float32)
    route_row = {"operator": "route", "case": case + " top-8 softmax",
                 "check": f"ids == fp64 top-8 in {same}/{m} rows, max|w err| {werr:.1e} <= bound {wbound:.1e}",
                 "ok": same == m and werr <= wbound, "us": None, "floor_us": None, "peers": {}}

    if ctx.gpu:
        H = ctx.harness
        ceil = H.measure_ceilings(verbose=False)
        floor = H.floor_us(bytes_moved=n * k * 4 + m * k * 2 + m * n * 4, ceilings=ceil, extra_us=ceil["launch_us"])
        out = torch.empty(m, n, device="cuda")
        ids_b = torch.empty(m, 8, dtype=torch.int32, device="cuda")
        w_b = torch.empty(m, 8, device="cuda")
        gemm_row["us"] = H.time_graph(lambda: evenflow.router_gemm(x, rw, out))
        gemm_row["floor_us"] = floor
        route_row["us"] = H.time_graph(lambda: evenflow.route(x, rw, 8, out=(ids_b, w_b)))
        route_row["floor_us"] = floor
        from evenflow.bench.peers import cublas

        for name in cublas.PEERS:
            try:
                gemm_row["peers"][name] = H.time_graph(cublas.make(name, x, w))
            except H.PeerUnavailable as e:
                gemm_row["peers"][name] = f"unavailable: {e}"
        fp32 = cublas.make("cublas-fp32", x, w)
        route_row["peers"]["cublas-fp32+torch.topk"] = H.time_graph(
            lambda: torch.softmax(fp32(), -1).topk(8, dim=-1))
    return [gemm_row, route_row]
