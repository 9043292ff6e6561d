"""``evenflow demo`` hook for attention: one Qwen3-30B-A3B decode step on a GPU (32 q / 4 kv heads, head_dim 128,
page 64, 1 x 32K + 31 x 2K cached tokens), tiny on a CPU. The fused prologue (QK-norm, RoPE, the new token's K and V
into the paged cache) runs first and hands its q to decode attention, as in a model's attention layer; then a
chunked-prefill step (new tokens after a cached prefix) through prefill attention."""
from __future__ import annotations

import torch

import evenflow
from evenflow.attention.prefill import prefill_work
from evenflow.attention.prologue import prologue_bytes
from evenflow.reference.attention import decode_attention_ref_batched as ref_attn
from evenflow.reference.attention import prefill_rows_ref
from evenflow.reference.prologue import qk_norm_rope_ref
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


def _prologue(ctx, lens, hq, hkv, d, k, v, pt, case) -> tuple[torch.Tensor, dict]:
    """The step's new tokens (one a request of nonzero length, at its last position; empty slots last, as padding
    rows) through ``qk_norm_rope_store_kv`` into the cache; returns q and the prologue's row."""
    dev = ctx.device
    live = [n for n in lens if n > 0]
    assert lens[:len(live)] == live, "empty slots go last"
    B = len(lens)
    qkv = torch.randn(B, (hq + 2 * hkv) * d, device=dev).to(torch.bfloat16)
    pos = torch.tensor([n - 1 for n in live] + [0] * (B - len(live)), device=dev)
    cu = torch.tensor([0] + list(range(1, len(live) + 1)) + [len(live)] * (B - len(live)), dtype=torch.int32,
                      device=dev)
    cos_sin = evenflow.rope_cos_sin(max(lens) + 1, d, base=1e6, device=dev)
    qw = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16)
    kw = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16)
    args = (qkv, pos, cos_sin, k, v, pt, cu)
    q, _ = evenflow.qk_norm_rope_store_kv(*args, q_norm_weight=qw, k_norm_weight=kw)
    ref = qk_norm_rope_ref(qkv, pos, cos_sin, hkv, d, qw, kw)
    base = qk_norm_rope_ref(qkv, pos, cos_sin, hkv, d, qw, kw, dtype=torch.float32)
    for x in (*ref, *base):
        x[len(live):] = 0  # padding rows: q = 0, nothing written
    rows = torch.arange(len(live), device=dev)
    pages = pt[rows, pos[:len(live)] // k.shape[1]].long()
    slots = pos[:len(live)] % k.shape[1]
    got = (q.cpu(), k[pages, slots].cpu(), v[pages, slots].cpu())
    want = (ref[0], ref[1][:len(live)], ref[2][:len(live)])
    bases = (base[0].to(torch.bfloat16), base[1][:len(live)].to(torch.bfloat16), base[2][:len(live)])
    # each of q, the written K and the written V under the rule; the row shows the one nearest its bound
    checks = [(float((g.double() - w).abs().max()), error_bound(w, b, torch.bfloat16), bool(torch.isfinite(
        g.float()).all())) for g, w, b in zip(got, want, bases)]
    err, bound, _ = max(checks, key=lambda c: c[0] / max(c[1], 1e-30))
    ok = all(f and e <= b for e, b, f in checks)
    row = {"operator": "qk_norm_rope_store_kv", "case": case,
           "check": f"q, K, V max|err| <= bound (worst {err:.1e} <= {bound:.1e})", "ok": ok, "us": None,
           "floor_us": None, "peers": {}}
    if ctx.gpu:
        H = ctx.harness
        ceil = H.measure_ceilings(verbose=False)
        row["floor_us"] = H.floor_us(bytes_moved=prologue_bytes(B, hq, hkv, d, torch.bfloat16, k.dtype),
                                     ceilings=ceil, extra_us=ceil["launch_us"])
        q_buf = torch.empty_like(q)
        row["us"] = H.time_graph(lambda: evenflow.qk_norm_rope_store_kv(*args, q_norm_weight=qw, k_norm_weight=kw,
                                                                         q_out=q_buf))
        from evenflow.bench.peers import torch_prologue

        for name, compiled in (("torch-unfused", False), ("torch-compile", True)):
            try:
                row["peers"][name] = H.time_graph(torch_prologue.make(*args, qw, kw, compiled=compiled))
            except Exception as e:  # a peer that cannot run here must not fail our check
                row["peers"][name] = f"unavailable: {type(e).__name__}: {e}"
    return q, row


def _prefill(ctx, hq, hkv, d, page) -> dict:
    """A chunked-prefill step: new tokens after a cached prefix, checked against the oracle (on a GPU: a 2048-token
    chunk after 4096 cached tokens, timed eagerly beside FlashInfer's paged prefill)."""
    dev = ctx.device
    n, prefix, case = (2048, 4096, "qwen3-30b-a3b chunk 2K after 4K") if ctx.gpu else (40, 70, "tiny chunk 40 after 70")
    L = n + prefix
    pages = -(-L // page)
    k = torch.randn(pages + 3, page, hkv, d, device=dev).to(torch.bfloat16)
    v = torch.randn(pages + 3, page, hkv, d, device=dev).to(torch.bfloat16)
    pt = torch.randperm(pages + 3, device=dev)[:pages].view(1, pages).to(torch.int32)
    q = torch.randn(n, hq, d, device=dev).to(torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    sl = torch.tensor([L], dtype=torch.int32, device=dev)
    out = evenflow.prefill_attention(q, k, v, cu, pt, sl, n)
    rows = [0, n // 2, n - 1]  # a few rows, each as the one-row request it is
    ref, _ = prefill_rows_ref(q, k, v, cu, pt, sl, rows)
    base, _ = prefill_rows_ref(q, k, v, cu, pt, sl, rows, dtype=torch.float32, p_dtype=torch.bfloat16,
                               out_dtype=torch.bfloat16)
    err = float((out[torch.tensor(rows, device=dev)].double() - ref).abs().max())
    bound = error_bound(ref, base, torch.bfloat16)
    row = {"operator": "prefill_attention", "case": case, "check": f"rows 0, n/2, n-1: max|err| {err:.1e} <= bound "
           f"{bound:.1e}", "ok": bool(torch.isfinite(out.float()).all()) and err <= bound, "us": None,
           "floor_us": None, "peers": {}}
    if ctx.gpu:
        H = ctx.harness
        ceil = H.measure_ceilings(verbose=False)
        byt, flops = prefill_work([n], [L], hq, hkv, d, k.element_size())
        row["floor_us"] = H.floor_us(bytes_moved=byt, flops=flops, ceilings=ceil)
        o_buf = torch.empty_like(out)
        row["us"] = H.time_eager(lambda: evenflow.prefill_attention(q, k, v, cu, pt, sl, n, out=o_buf))
        try:
            from evenflow.bench.peers import flashinfer as fi

            for impl in fi.PREFILL_IMPLS:
                try:
                    w = fi.FlashInferPrefill(impl, cu, pt, sl, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                             page_size=page, kv_dtype=k.dtype)
                    row["peers"][impl] = H.time_eager(w.runner(q, k, v))
                except H.PeerUnavailable as e:
                    row["peers"][impl] = f"unavailable: {e}"
        except Exception as e:  # the peer adapter itself missing or broken must not fail our check
            row["peers"]["flashinfer"] = f"unavailable: {type(e).__name__}: {e}"
    return row


def run_demo(ctx) -> list[dict]:
    torch.manual_seed(0)
    if ctx.gpu:
        lens, hq, hkv, case = [32 * 1024] + [2048] * 31, 32, 4, "qwen3-30b-a3b 1x32K+31x2K"
    else:
        lens, hq, hkv, case = [300, 64, 130, 0], 8, 2, "tiny 300+64+130+0"
    d, page = 128, 64
    _, k, v, pt, sl = _inputs(lens, hq, hkv, d, page, ctx.device)
    q, prologue_row = _prologue(ctx, lens, hq, hkv, d, k, v, pt, case)
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
    return [prologue_row, row, _prefill(ctx, hq, hkv, d, page)]
