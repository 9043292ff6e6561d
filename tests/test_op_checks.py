"""The ``torch.ops.evenflow.*`` custom ops check what their kernels index when called directly.

Compiled code calls these ops, and so can anyone. Each test records the arguments the public function hands its
launcher (eager calls go to the launcher directly), replays them through the op (the same output, bit for bit), and
then corrupts one argument at a time the way a caller's own tensors could be wrong: too few rows or entries, another
dtype, a stride-0 view, another row stride. Every corruption must be refused before a launch with an error naming the
argument. On the old ops (no checks) each of these launched: an out-of-bounds write or read (round BI's audit).
"""
import inspect

import pytest
import torch

import evenflow
from evenflow._checks import checked_op
from evenflow.attention import decode as D
from evenflow.attention import plan as PL
from evenflow.attention import prologue as PR
from evenflow.moe import fused as F
from evenflow.reference.moe import random_moe_weights, random_routing
from evenflow.router import gemm as G
from evenflow.router import topk as TK
from tests_support_router import router_inputs


def _record(monkeypatch, module, name):
    """Replace ``module.name`` (a launcher) by a recorder that runs it; returns the list of bound calls (the ops'
    own ``checked_op``, with a check that keeps each call's arguments, defaults filled in)."""
    calls = []
    monkeypatch.setattr(module, name, checked_op(getattr(module, name), lambda a: calls.append(dict(a))))
    return calls


def _replay(op, args: dict, **changes):
    a = dict(args)
    a.update(changes)
    return op(**a)


def _refused(op, args, match, **changes):
    with pytest.raises((ValueError, TypeError), match=match):
        _replay(op, args, **changes)


def _fresh_like(t):
    return torch.zeros_like(t) if t.dtype in (torch.int32, torch.int64) else torch.full_like(t, float("nan"))


# ----------------------------------------------------------------------------- router


def test_router_gemm_ops_check_their_tensors(device, monkeypatch):
    m, n, k = 5, 40, 64
    x, w = router_inputs(m, n, k, device)
    rw = evenflow.RouterWeight(w)
    cases = (("_launch_split", "router_gemm_split", evenflow.GemmConfig(16, 32, 16, 4, 2, 1)),
             ("_launch_split", "router_gemm_split", evenflow.GemmConfig(16, 32, 16, 2, 2, 1, "fp32-tc")),
             ("_launch_fp32_splitk", "router_gemm_fp32_splitk", evenflow.GemmConfig(4, 4, 16, 2, 4, 2, "fp32-splitk")),
             ("_launch_fp32", "router_gemm_fp32", evenflow.GemmConfig(4, 2, 32, 1, 2, 1, "fp32-simt")))
    for launcher, name, cfg in cases:
        calls = _record(monkeypatch, G, launcher)
        want = evenflow.router_gemm(x, rw, config=cfg)
        (a,) = calls
        op = getattr(torch.ops.evenflow, name).default
        out = _fresh_like(a["out"])
        _replay(op, a, out=out)
        assert torch.equal(out, want), name
        _refused(op, a, "out must have shape", out=torch.empty(1, n, device=device))
        _refused(op, a, "x must have dtype", x=x.float())
        wname = "w" if "w" in a else "w_hi"
        _refused(op, a, f"{wname} must have shape", **{wname: a[wname][:, : k // 2]})  # another K than x's
        if name == "router_gemm_split":
            _refused(op, a, "w_lo must have w_hi's row stride",
                     w_lo=torch.cat([a["w_lo"], a["w_lo"]], 1)[:, :k])
            _refused(op, a, "num_terms must be one of", num_terms=4)
        if "part" in a:
            _refused(op, a, "part must be contiguous", part=torch.empty(1, device=device).expand(4 * m * n))
            _refused(op, a, "count must have dtype", count=a["count"].long())
            _refused(op, a, "workspace too small", count=torch.zeros(0, dtype=torch.int32, device=device))
        _refused(op, a, "config.block_n must be", block_n=3)


def test_route_topk_op_checks_its_tensors(device, monkeypatch):
    calls = _record(monkeypatch, TK, "_launch_topk")
    logits = torch.randn(64, 32, device=device)
    bias = torch.randn(32, device=device)
    ids, wts = evenflow.select_experts(logits, 8, "sigmoid", bias)
    (a,) = calls
    op = torch.ops.evenflow.route_topk.default
    got_ids, got_w = _fresh_like(a["ids"]), _fresh_like(a["weights"])
    _replay(op, a, ids=got_ids, weights=got_w)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, wts)
    _refused(op, a, "ids must have shape", ids=torch.empty(1, 8, dtype=torch.int32, device=device))
    _refused(op, a, "weights must have dtype", weights=a["weights"].double())
    _refused(op, a, "bias must have shape", bias=bias[:1])
    _refused(op, a, "top_k must be <=", top_k=33)
    _refused(op, a, "logits must have dtype", logits=logits.bfloat16())


# ----------------------------------------------------------------------------- decode


def _decode_inputs(device, lens=(300, 70, 0, 129), hkv=2, group=4, d=64, page=16):
    B = len(lens)
    max_pages = max(-(-L // page) for L in lens) + 1
    num_pages = B * max_pages + 2
    k = torch.randn(num_pages, page, hkv, d, device=device).bfloat16()
    v = torch.randn(num_pages, page, hkv, d, device=device).bfloat16()
    pt = torch.randperm(num_pages, device=device)[: B * max_pages].view(B, max_pages).to(torch.int32)
    q = torch.randn(B, hkv * group, d, device=device).bfloat16()
    return q, k, v, pt, torch.tensor(lens, dtype=torch.int32, device=device)


def test_decode_plan_update_op_checks_its_buffers(device, monkeypatch):
    calls = _record(monkeypatch, PL, "_plan_update_launch")
    q, k, v, pt, sl = _decode_inputs(device)
    plan = evenflow.DecodePlan(8, 4096, 2, page_size=16, device=device, num_programs=6)
    plan.update(sl)
    (a,) = calls
    op = torch.ops.evenflow.decode_plan_update.default
    bufs = {n: _fresh_like(a[n]) for n in ("tiles", "req_end", "prog_start", "meta")}
    _replay(op, a, **bufs)
    for n, t in bufs.items():
        assert torch.equal(t, a[n]), n
    _refused(op, a, "tiles must hold at least 4", tiles=torch.zeros(1, dtype=torch.int32, device=device))
    _refused(op, a, "req_end must hold at least 4", req_end=torch.zeros(3, dtype=torch.int32, device=device))
    _refused(op, a, "meta must hold at least 6", meta=torch.zeros(2, dtype=torch.int32, device=device))
    _refused(op, a, "prog_start must hold at least 2", prog_start=torch.zeros(1, dtype=torch.int32, device=device))
    _refused(op, a, r"seq_lens.shape\[0\] \(batch\) must be <= 2", max_batch=2)
    _refused(op, a, "seq_lens must have dtype", seq_lens=sl.long())
    _refused(op, a, "num_kv_heads must be >= 1", num_kv_heads=0)
    _refused(op, a, "min_tiles must be >= 1", min_tiles=0)
    # DecodePlan's int32 bound on the tile indices (the plan refuses the same options)
    _refused(op, a, "too large for the plan.s int32 tile and token indices", max_seq_len=2**31 - 64, num_kv_heads=256)
    with pytest.raises(ValueError, match="too large for the plan.s int32 tile and token indices"):
        evenflow.DecodePlan(8, 2**31 - 64, 256, page_size=16, device=device, num_programs=6)
    # one request's own tile count: (len + 63) // 64 in int32 (round BX's audit: 2^31 - 1 wrapped negative)
    _refused(op, a, "max_seq_len must be <= 2147483584", max_seq_len=2**31 - 63)


@pytest.mark.parametrize("planned", [True, False], ids=["plan", "static"])
def test_decode_attention_op_checks_its_tensors(device, monkeypatch, planned):
    calls = _record(monkeypatch, D, "_decode_launch")
    q, k, v, pt, sl = _decode_inputs(device)
    plan = None
    if planned:
        plan = evenflow.DecodePlan(8, 4096, 2, page_size=16, device=device, num_programs=6).update(sl)
    want, lse = evenflow.decode_attention(q, k, v, pt, sl, plan, return_lse=True)
    (a,) = calls
    op = torch.ops.evenflow.decode_attention.default
    out, got_lse = _fresh_like(a["out"]), _fresh_like(a["lse"])
    _replay(op, a, out=out, lse=got_lse)
    assert torch.equal(out, want) and torch.equal(got_lse, lse)
    Hq, d = 8, 64
    _refused(op, a, "out must have shape", out=torch.empty(1, Hq, d, dtype=torch.bfloat16, device=device))
    _refused(op, a, "lse must have shape", lse=torch.empty(1, Hq, device=device))
    _refused(op, a, "q rows", q=q[:1])
    _refused(op, a, "v_cache must have shape", v_cache=v[:1])
    _refused(op, a, "page_table must have 4 rows", page_table=pt[:1])
    _refused(op, a, "q_len must be", q_len=2)
    _refused(op, a, "max_len must be <=", max_len=pt.shape[1] * 16 + 1)
    _refused(op, a, "part_o must hold at least", part_o=a["part_o"].reshape(-1)[:1])
    _refused(op, a, "part_lse must be contiguous", part_lse=a["part_lse"].reshape(-1)[:1].expand(a["part_lse"].numel()))
    _refused(op, a, "sm_scale must be > 0", sm_scale=0.0)
    # the launch options (round CP's review: block_n=32 made the loop step 0, num_warps=3 and num_stages=-1 ran; a
    # float is refused by the schema itself, a bool taken as 0 or 1 and checked as that)
    for name, bad, why in (("block_n", 32, r"one of \[0, 64, 128\]"),
                           ("num_warps", 3, r"one of \[0, 2, 4, 8\]"), ("num_stages", -1, ">= 0"),
                           ("max_regs", 16, "0 \\(no cap\\) or 24-255"),
                           ("warp_split", 2, r"one of \[-1, 0, 1\]"), ("gluon_warps", 3, r"one of \[1, 2, 4\]"),
                           ("pad", -1, ">= 0"), ("short_tiles", -1, ">= 0"), ("merge_chunks", 0, ">= 1")):
        _refused(op, a, f"{name} must .*{why}", **{name: bad})
    if planned:
        _refused(op, a, "tiles must hold at least 4", tiles=a["tiles"][:1])
        _refused(op, a, "group_count must hold at least", group_count=a["group_count"][:1])
        _refused(op, a, "combine_count must have dtype", combine_count=a["combine_count"].long())
        _refused(op, a, "stamps must have shape", stamps=torch.zeros(1, 1, dtype=torch.int64, device=device))
        _refused(op, a, "gluon=True: the Gluon fp8 kernel does not run this call", gluon=True)
        # program pid drains bin (pid * bin_stride) % programs: 0 leaves bins undrained, -1 indexes before prog_start
        for bad, why in ((0, ">= 1"), (-1, ">= 1"), (7, "<= 6")):
            _refused(op, a, f"bin_stride must be {why}", bin_stride=bad)
        _refused(op, a, "bin_stride must be prime to the plan's 6 programs", bin_stride=4)
        out = _fresh_like(a["out"])
        _replay(op, a, out=out, lse=_fresh_like(a["lse"]), bin_stride=5)  # another stride prime to 6: the same bins
        assert torch.equal(out, want)


def test_prologue_op_checks_its_tensors(device, monkeypatch):
    from test_prologue import make_inputs

    calls = _record(monkeypatch, PR, "_prologue_launch")
    args, qw, kw = make_inputs([2, 1], [3, 4], 4, 2, 64, 16, torch.float8_e4m3fn, pad=1, device=device)
    kc0, vc0 = args["k_cache"].clone(), args["v_cache"].clone()
    want, want_s = evenflow.qk_norm_rope_store_kv(**args, q_norm_weight=qw, k_norm_weight=kw, k_scale=0.5,
                                                  q_dtype=torch.float8_e4m3fn)
    kc1 = args["k_cache"].clone()
    (a,) = calls
    op = torch.ops.evenflow.qk_norm_rope_store_kv.default
    a["k_cache"].copy_(kc0)
    a["v_cache"].copy_(vc0)
    q, s = _fresh_like(a["q_out"].float()).to(torch.float8_e4m3fn), _fresh_like(a["q_scale"])
    _replay(op, a, q_out=q, q_scale=s)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(s, want_s)
    assert torch.equal(a["k_cache"].view(torch.uint8), kc1.view(torch.uint8))
    _refused(op, a, "q_out must have shape", q_out=q[:2])
    _refused(op, a, "q_scale must have shape", q_scale=s[:, :1])
    _refused(op, a, "q_scale is required", q_scale=None)
    _refused(op, a, "q_scale must be contiguous", q_scale=s.t().contiguous().t())
    _refused(op, a, "positions must have shape", positions=a["positions"][:1])
    _refused(op, a, "cu_seqlens_q must have shape", cu_seqlens_q=a["cu_seqlens_q"][:2])
    _refused(op, a, "cos_sin must have shape", cos_sin=a["cos_sin"][:, :32])
    _refused(op, a, "rotary_dim must be <= 64", rotary_dim=128)
    _refused(op, a, "q_norm_weight must have shape", q_norm_weight=qw[:8])
    _refused(op, a, "v_cache must have shape", v_cache=a["v_cache"][:1])
    _refused(op, a, "k_scale must hold one element", k_scale=torch.ones(0, device=device))
    _refused(op, a, "k_scale_f must be > 0", k_scale_f=0.0)
    _refused(op, a, "qkv's width", qkv=a["qkv"][:, :-8])


# ----------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("fmt", ["bf16", "fp8_per_tensor", "fp8_block"])
def test_fused_moe_op_checks_its_tensors(device, monkeypatch, fmt):
    calls = _record(monkeypatch, F, "_launch")
    h, i = (128, 128) if fmt == "fp8_block" else (64, 32)
    ew = random_moe_weights(fmt, 4, h, i, device)
    x = torch.randn(8, h, device=device).bfloat16()
    ids, w = random_routing(8, 2, 4, device)
    want = evenflow.fused_moe(x, ids, w, ew)
    (a,) = calls
    names = list(inspect.signature(F._fused_moe_op_launch).parameters)
    launch_names = list(inspect.signature(F._launch).parameters)
    # the public call hands _launch its arguments under its own names: the op's are the same values
    rename = {"mode": "weight_mode", "cfg": "config", "accum": "fp8_accum"}
    b = {rename.get(n, n): a[n] for n in launch_names if rename.get(n, n) in names}
    b["config"] = None
    op = torch.ops.evenflow.fused_moe_.default
    out = _fresh_like(b["out"])
    _replay(op, b, out=out)
    assert torch.equal(out, want)
    _refused(op, b, "out must have shape", out=torch.empty(1, h, dtype=torch.bfloat16, device=device))
    _refused(op, b, "w2 must have shape", w2=b["w2"][:1])
    _refused(op, b, "topk_weights must have shape", topk_weights=w[:1])
    _refused(op, b, "topk_ids must have 8 rows", topk_ids=ids[:1])
    _refused(op, b, "weight_mode must be <= 2", weight_mode=3)
    if b["counters"] is not None:
        _refused(op, b, "counters must be contiguous", counters=b["counters"][:1].expand(b["counters"].numel()))
    if fmt == "bf16":
        _refused(op, b, "w13 must have dtype", weight_mode=1)
    else:
        _refused(op, b, "w13_scale must have shape", w13_scale=b["w13_scale"][:1])
    _refused(op, b, "config must list 5-14", config=[16, 32])  # MoEConfig's 14 fields (round BK: prefetch)
    _refused(op, b, "pdl must be <= 1", pdl=2)
