"""``evenflow demo`` hook for decode attention: one Qwen3-30B-A3B decode step on a GPU
(32 q / 4 kv heads, head_dim 128, page 64, 1 x 32K + 31 x 2K cached tokens), tiny on a CPU."""
from __future__ import annotations

import torch

import evenflow
from evenflow.reference.attention import decode_attention_ref_batched as ref_attn
from evenflow.testing import error_bound


def _inputs(lens, hq, hkv, d, page, device):
    B = len(lens)
    max_pages = max(-(-L // page) for L in lens)
    num_pages = B * max_pages
    k = torch.randn(num_pages, page, hkv, d, device=device).to(torch.bfloat16)
    v = torch.randn(num_pages, page, hkv, d, device=device).to(torch.bfloat16)
    pt = torch.randperm(num_pages, device=device)[: B * max_pages].view(B, max_pages).to(torch.int32)
    q = torch.randn(B, hq, d, device=device).to(torch.bfloat16)
    return q, k, v, pt, torch.tensor(lens, dtype=torch.int32, device=device)


def run_demo(ctx) -> list[dict]:
    torch.manual_seed(0)
    if ctx.gpu:
        lens, hq, hkv, case = [32 * 1024] + [2048] * 31, 32, 4, "qwen3-30b-a3b 1x32K+31x2K"
    else:
        lens, hq, hkv, case = [300, 64, 0, 130], 8, 2, "tiny 300+64+0+130"
    d, page = 128, 64
    q, k, v, pt, sl = _inputs(lens, hq, hkv, d, page, ctx.device)
    plan = evenflow.DecodePlan(len(lens), max(lens), hkv, page_size=page, device=ctx.device,
                               kv_dtype=k.dtype, q_dtype=q.dtype, num_q_heads=hq, head_dim=d).update(sl)
    out = evenflow.decode_attention(q, k, v, pt, sl, plan=plan)
    ref, _ = ref_attn(q, k, v, pt, sl)
    base, _ = ref_attn(q, k, v, pt, sl, dtype=torch.float32, p_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    err = float((out.double() - ref).abs().max())
    bound = error_bound(ref, base, torch.bfloat16)
    ok = bool(torch.isfinite(out.float()).all()) and err <= bound
    row = {"operator": "decode_attention", "case": case, "check": f"max|err| {err:.1e} <= bound {bound:.1e}",
           "ok": ok, "us": None, "floor_us": None, "peers": {}}
    if ctx.gpu:
        H = ctx.harness
        ceil = H.measure_ceilings(verbose=False)
        kv_bytes = 2 * sum(lens) * hkv * d * 2
        row["floor_us"] = H.floor_us(bytes_moved=kv_bytes + 2 * q.numel() * 2, ceilings=ceil)
        o_buf = torch.empty_like(out)
        row["us"] = H.time_graph(lambda: (plan.update(sl), evenflow.decode_attention(q, k, v, pt, sl, plan=plan,
                                                                                      out=o_buf)))
        row["peers"]["evenflow-static"] = H.time_graph(lambda: evenflow.decode_attention(q, k, v, pt, sl, out=o_buf))
        try:
            from evenflow.bench.peers import flashinfer as fi

            for impl in fi.DECODE_IMPLS:
                try:
                    w = fi.FlashInferDecode(impl, pt, sl, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                            page_size=page, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
                    row["peers"][impl] = H.time_graph(w.runner(q, k, v))
                except H.PeerUnavailable as e:
                    row["peers"][impl] = f"unavailable: {e}"
        except Exception as e:  # the peer adapter itself missing or broken must not fail our check
            row["peers"]["flashinfer"] = f"unavailable: {type(e).__name__}: {e}"
    return [row]
