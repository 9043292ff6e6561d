"""decode_attention at real shapes on a GPU: Hy3 heads (64 q / 8 kv, d128, page 64), mixed
lengths up to 128K, bf16 and fp8 KV, the TP8 slice, CUDA-graph capture with changing
lengths and page tables, torch.compile(fullgraph=True)."""
import pytest
import torch
import triton
import triton.language as tl

import evenflow
from evenflow._kernels.common import globaltimer_ns, pdl_enter
from evenflow.reference.attention import decode_attention_ref_batched as ref_attn
from evenflow.testing import assert_within_one_ulp, assert_within_rule, poisoned

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
K = 1024


def inputs(lens, hkv=8, hq=64, d=128, page=64, q_len=1, kv=torch.bfloat16, qdt=torch.bfloat16, spare_pages=8):
    dev = "cuda"
    B = len(lens)
    max_pages = max(-(-L // page) for L in lens) + 1
    num_pages = sum(-(-L // page) for L in lens) + spare_pages
    k = torch.randn(num_pages, page, hkv, d, device=dev)
    v = torch.randn(num_pages, page, hkv, d, device=dev)
    if kv == FP8:
        k, v = (k * 30).clamp(-448, 448).to(FP8), (v * 40).clamp(-448, 448).to(FP8)
    else:
        k, v = k.to(kv), v.to(kv)
    pt = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
    perm = torch.randperm(num_pages, device=dev).to(torch.int32)  # pages in random order
    at = 0
    for b, L in enumerate(lens):
        n = -(-L // page)
        pt[b, :n] = perm[at:at + n]
        at += n
    q = torch.randn(B * q_len, hq, d, device=dev)
    qs = None
    if qdt == FP8:
        qs = q.abs().amax(-1) / 448.0
        q = (q / qs[..., None]).to(FP8)
    else:
        q = q.to(qdt)
    return q, qs, k, v, pt, torch.tensor(lens, dtype=torch.int32, device=dev)


def captured(step):
    """A CUDA graph of ``step``, after one eager run of it (warm-up: compiles, allocates the plan's partial
    buffers)."""
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


def replay_fresh(g, outs, restore):
    """Replay ``g`` once on the inputs as they were (``restore``: (tensor, its first value) pairs), every
    output NaN-filled first (so a write the graph skips shows)."""
    for t, t0 in restore:
        t.copy_(t0)
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()


def check(o, lse, q, qs, k, v, pt, sl, q_len=1, ks=None, vs=None, what="", fp8_scores=False):
    """``o`` / ``lse`` within the tolerance rule of the fp64 reference; the baseline is PyTorch in fp32 with bf16 P
    and output, its scores from PyTorch's fp8 GEMM with fast accumulation where the kernel's are an fp8 MMA's
    (``fp8_scores``: the Gluon kernel's warpgroup form)."""
    kw = dict(q_scale=qs, k_scale=ks, v_scale=vs, q_len=q_len)
    ref, ref_lse = ref_attn(q, k, v, pt, sl, **kw)
    base, base_lse = ref_attn(q, k, v, pt, sl, dtype=torch.float32, p_dtype=torch.bfloat16,
                              out_dtype=torch.bfloat16, fp8_scores=fp8_scores, **kw)
    assert_within_rule(o, ref, base, what=what)
    if lse is not None:  # -inf exactly where no token is seen; elsewhere the tolerance rule, as the CPU tests
        dead = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse < 0), dead), f"{what}: lse -inf exactly where no token is seen"
        assert_within_rule(lse[~dead], ref_lse[~dead], base_lse[~dead].float(), what=f"{what} lse")


CASES = {
    "1x128K+31x4K": [128 * K] + [4 * K] * 31,
    "1x32K+63x512": [32 * K] + [512] * 63,
    "2x64K+30x1K": [64 * K] * 2 + [K] * 30,
    "32x128+32x4K": [128] * 32 + [4 * K] * 32,
    "64x512": [512] * 64,
    "odd": [0, 1, 65, 4097, 0, 30000, 63],
}


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8-q"])
@pytest.mark.parametrize("case", list(CASES))
def test_real_shapes(case, kv):
    lens = CASES[case]
    kvdt = FP8 if kv.startswith("fp8") else torch.bfloat16
    qdt = FP8 if kv == "fp8-q" else torch.bfloat16
    q, qs, k, v, pt, sl = inputs(lens, kv=kvdt, qdt=qdt)
    ks, vs = (torch.tensor([1 / 30], device="cuda"), 1 / 40) if kvdt == FP8 else (None, None)
    plan = evenflow.DecodePlan(64, 128 * K, 8, device="cuda").update(sl)
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"{case} {kv}")
    o2 = evenflow.decode_attention(q, k, v, pt, sl, plan=None, q_scale=qs, k_scale=ks, v_scale=vs)
    check(o2, None, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"{case} {kv} static")


# The plain loop (no warp split) at more resident programs per SM than the default: 4 or 5
# per SM, the registers capped by the launcher at 128 / 96 (round L candidates).
DENSE_PLANS = {"pps4": dict(pps=4, num_stages=3), "pps4s2": dict(pps=4, num_stages=2),
               "pps5s2": dict(pps=5, num_stages=2)}


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8-q"])
@pytest.mark.parametrize("name", list(DENSE_PLANS))
def test_plain_loop_at_more_programs_per_sm(name, kv):
    kw = dict(DENSE_PLANS[name])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = CASES["1x32K+63x512"][:40] + CASES["odd"]
    kvdt = FP8 if kv.startswith("fp8") else torch.bfloat16
    q, qs, k, v, pt, sl = inputs(lens, kv=kvdt, qdt=FP8 if kv == "fp8-q" else torch.bfloat16)
    ks, vs = (torch.tensor([1 / 30], device="cuda"), 1 / 40) if kvdt == FP8 else (None, None)
    plan = evenflow.DecodePlan(64, 64 * K, 8, device="cuda", num_programs=kw.pop("pps") * sms, warp_split=False,
                               **kw).update(sl)
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"{name} {kv}")


@pytest.mark.parametrize("hq,hkv,d,page,q_len", [(8, 1, 128, 64, 1), (32, 4, 128, 16, 2), (16, 4, 64, 32, 4),
                                                 (8, 2, 256, 128, 3), (16, 1, 128, 64, 1)])
def test_shapes(hq, hkv, d, page, q_len):
    lens = [128 * K, 3, 0, 4 * K + 1, 700]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=hq, d=d, page=page, q_len=q_len)
    plan = evenflow.DecodePlan(8, 128 * K, hkv, page_size=page, q_len=q_len, device="cuda").update(sl)
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, q_len=q_len, what=f"hq{hq} hkv{hkv} d{d} p{page} q_len{q_len}")


def test_hnd_view():
    lens = [5000, 70]
    q, qs, k, v, pt, sl = inputs(lens)
    kh, vh = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    plan = evenflow.DecodePlan(4, 8 * K, 8, device="cuda").update(sl)
    o = evenflow.decode_attention(q, kh, vh, pt, sl, plan=plan)
    check(o, None, q, qs, k, v, pt, sl, what="hnd")


@pytest.mark.parametrize("kv", [torch.bfloat16, FP8])
def test_cuda_graph_changing_lengths(kv):
    """Capture plan.update + decode_attention once; replay with new lengths and page tables."""
    B, max_len = 16, 64 * K
    big = [64 * K] + [2 * K] * 15
    q, qs, k, v, pt, sl = inputs(big, kv=kv, spare_pages=64)
    ks, vs = (torch.tensor([1 / 30], device="cuda"), torch.tensor([1 / 40], device="cuda")) \
        if kv == FP8 else (None, None)
    plan = evenflow.DecodePlan(B, max_len, 8, device="cuda")
    s_sl, s_pt, s_q = sl.clone(), pt.clone(), q.clone()
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")

    def step():
        plan.update(s_sl)
        evenflow.decode_attention(s_q, k, v, s_pt, s_sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out)

    g = captured(step)
    for trial, lens in enumerate([big, [3 * K] * 16, [0] * 8 + [60 * K] + [100] * 7, [1] * 16]):
        num_pages = k.shape[0]
        new_sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        new_pt = torch.randint(0, num_pages, pt.shape, dtype=torch.int32, device="cuda")
        s_sl.copy_(new_sl)
        s_pt.copy_(new_pt)
        s_q.copy_(torch.randn(q.shape, device="cuda").to(q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, None, s_q, qs, k, v, s_pt, s_sl, ks=ks, vs=vs, what=f"graph replay {trial}")


def test_torch_compile_fullgraph():
    lens = [20000, 4096, 0, 513]
    q, qs, k, v, pt, sl = inputs(lens)
    plan = evenflow.DecodePlan(4, 32 * K, 8, device="cuda")
    plan.update(sl)
    evenflow.decode_attention(q, k, v, pt, sl, plan=plan)  # allocate partials outside the compiled region

    @torch.compile(fullgraph=True)
    def f(q, k, v, pt, sl):
        plan.update(sl)
        return evenflow.decode_attention(q, k, v, pt, sl, plan=plan)

    o = f(q, k, v, pt, sl)
    check(o, None, q, qs, k, v, pt, sl, what="compiled")


def test_pdl_matches_plain_launches_in_a_graph():
    """Programmatic dependent launch (the default on sm_90) changes when the attention and
    combine kernels start, not what they compute: inside one captured graph, where the
    kernel right before them rewrites q and the plan is rebuilt for new lengths, PDL and
    plain launches give bitwise-equal outputs on every replay, and both follow the
    reference. One kv head and a long request: many chunks per item in the combine."""
    lens0 = [32 * K] + [K] * 15
    q, qs, k, v, pt, sl = inputs(lens0, hkv=1, hq=8, spare_pages=64)
    plans = {p: evenflow.DecodePlan(16, 40 * K, 1, device="cuda", pdl=p) for p in (True, False)}
    outs = {p: torch.empty(q.shape, dtype=torch.bfloat16, device="cuda") for p in plans}
    s_sl, q_src, q_live = sl.clone(), q.clone(), torch.empty_like(q)

    def step():
        for p, plan in plans.items():
            q_live.copy_(q_src)  # the kernel just before the attention writes its input
            plan.update(s_sl)
            evenflow.decode_attention(q_live, k, v, pt, s_sl, plan=plan, out=outs[p])

    g = captured(step)
    for trial, lens in enumerate([lens0, [32 * K + 50] + [300] * 15, [0] * 15 + [20 * K]]):
        s_sl.copy_(torch.tensor(lens, dtype=torch.int32, device="cuda"))
        q_src.copy_(torch.randn(q.shape, device="cuda").to(q.dtype))
        for o in outs.values():
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[True], outs[False]), f"replay {trial}: PDL and plain launches differ"
        check(outs[True], None, q_src, qs, k, v, pt, s_sl, what=f"PDL graph replay {trial}")


FUSED_CASES = {
    # the long item in ~128 chunks on the Triton kernel's plans (16 merge groups), ~256 at the Gluon kernel's 4
    # programs an SM (22 groups of 12, 32 of 8)
    "tp8:1x128K+31x4K": dict(lens=[128 * K] + [4 * K] * 31, hkv=1, hq=8),
    "8x32K": dict(lens=[32 * K] * 8),
    "32x128+32x4K": dict(lens=[128] * 32 + [4 * K] * 32),
}


@pytest.mark.parametrize("kv", [torch.bfloat16, FP8, "fp8-gluon", "fp8-gluon-w2s2", "fp8-gluon-w2", "fp8-gluon-mb8",
                                "fp8-q-gluon-wg"],
                         ids=["bf16", "fp8", "fp8-gluon", "fp8-gluon-w2s2", "fp8-gluon-w2", "fp8-gluon-mb8",
                              "fp8-q-gluon-wg"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_combine_is_deterministic_and_matches_the_combine_kernel(case, kv):
    """The default plan merges split items inside the attention kernel; the order in which the
    chunks of an item finish changes from call to call on the GPU, the merge order does not:
    ten graph replays give bitwise-equal outputs and leave every counter at zero, the output
    is within the rule, and within one bf16 unit in the last place of the combine kernel's.
    ``fp8-gluon``: a plan built for the fp8 cache (the Gluon kernel and its own merge; one warp a program, ``-w2``:
    two warps, the default, merging 12 chunks a round trip in groups of 12 since round AS (the TP8 slice's 256-chunk
    item in 22 groups), ``-w2s2``: two warps beside 2 ring slots (8 chunks a round trip), ``-mb8``: two warps merging
    8 chunks a round trip in groups of 8, the default of rounds AB-AR; ``fp8-q-gluon-wg``: the warpgroup form with an
    fp8 q, round AR, its own merge of its warps and chunks, 8 chunks a round trip)."""
    typed = kv in ("fp8-gluon", "fp8-gluon-w2s2", "fp8-gluon-w2", "fp8-gluon-mb8", "fp8-q-gluon-wg")
    warps = {"fp8-gluon-w2s2": "2s2", "fp8-gluon-w2": 2, "fp8-gluon-mb8": 2, "fp8-q-gluon-wg": 4}.get(kv, 1)
    extra = dict(merge_chunks=8) if kv == "fp8-gluon-mb8" else {}
    qdt = FP8 if kv == "fp8-q-gluon-wg" else torch.bfloat16
    kv = FP8 if typed else kv
    c = FUSED_CASES[case]
    q, qs, k, v, pt, sl = inputs(c["lens"], hkv=c.get("hkv", 8), hq=c.get("hq", 64), kv=kv, qdt=qdt)
    ks, vs = (torch.tensor([1 / 30], device="cuda"), torch.tensor([1 / 40], device="cuda")) \
        if kv == FP8 else (None, None)
    outs = {}
    for combine in ("fused", "kernel"):
        plan = evenflow.DecodePlan(len(sl), max(c["lens"]) + 64, c.get("hkv", 8), device="cuda",
                                   combine=combine, kv_dtype=FP8 if typed else None,
                                   gluon=True if typed else None, **_wk(warps),
                                   **(extra if combine == "fused" else {})).update(sl)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
        evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out)
        first = None
        for _ in range(10):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            first = out.clone() if first is None else first
            assert torch.equal(out, first), f"{combine}: replays differ"
        assert int(plan.group_count.abs().sum()) + int(plan.combine_count.abs().sum()) == 0
        check(first, None, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"{case} combine={combine}",
              fp8_scores=_wg_form(warps, q, c.get("hq", 64) // c.get("hkv", 8)))
        outs[combine] = first.float()
    assert_within_one_ulp(outs["fused"], outs["kernel"], f"{case}: fused against the combine kernel")


# Plans built for an fp8 cache run the Gluon kernel (attention/gluon_kernels.py)
# (round AL: ``gluon_warps`` 1 or 2 warps a program; round AM: the default, 2 warps beside 3 ring slots, their
# outputs meeting in the idle ring, chunks of at most 16 tiles reading 2 tiles ahead and longer ones 1: both tile
# loops; ``2s2``: 2 warps beside 2 slots and a 16 KB output buffer, the default of round AL; 1 warp, at its default
# 2 slots; round AR: 4, the warpgroup form, which runs calls with an fp8 q of at most 8 rows a KV head on wgmma
# scores and the plan's other calls on two warps: the tests below give it an fp8 q where they can)
WARPS = pytest.mark.parametrize("warps", [1, "2s2", 2, 4], ids=["w1", "w2s2", "w2", "wg"])


def _wk(warps):
    """Plan arguments of a ``WARPS`` value."""
    return dict(gluon_warps=2, num_stages=2) if warps == "2s2" else dict(gluon_warps=warps)


def _wg_form(warps, q, rows):
    """Whether a call runs the warpgroup form (its scores an fp8 MMA's: ``check(..., fp8_scores=True)``)."""
    from evenflow.attention.plan import GLUON_FP8_WG_ROWS

    return warps == 4 and q.dtype == FP8 and rows <= GLUON_FP8_WG_ROWS


def _gluon_plan(lens, sl, hkv=8, page=64, q_len=1, max_len=128 * K, prefetch=True, warps=1, **kw):
    from evenflow.attention.decode import gluon_fp8_supported

    plan = evenflow.DecodePlan(len(lens), max_len, hkv, page_size=page, q_len=q_len, device="cuda",
                               kv_dtype=FP8, prefetch=prefetch, gluon=True,  # at one KV head too
                               **_wk(warps), **kw).update(sl)
    return plan, gluon_fp8_supported


@WARPS
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_fp8_real_shapes(case, warps):
    """Every standard case on each Gluon form (the warpgroup form with an fp8 q, which it takes)."""
    lens = CASES[case]
    q, qs, k, v, pt, sl = inputs(lens, kv=FP8, qdt=FP8 if warps == 4 else torch.bfloat16)
    plan, supported = _gluon_plan(lens, sl, warps=warps)
    assert supported(q, k, plan, 8)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"gluon {case}", fp8_scores=_wg_form(warps, q, 8))


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("hq,hkv,page,q_len", [(8, 1, 64, 1), (32, 4, 128, 2), (16, 4, 64, 4), (16, 1, 128, 1),
                                               (4, 4, 64, 4), (64, 8, 128, 1)])
@WARPS
def test_gluon_fp8_shapes(hq, hkv, page, q_len, prefetch, warps):
    """GQA groups, pages, q_len and the prefetch on each Gluon form (an fp8 q at 4 warps: the warpgroup form where
    the rows a KV head are at most 8, two warps on its bins elsewhere)."""
    lens = [128 * K, 3, 0, 4 * K + 1, 700, 64, 65]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=hq, page=page, q_len=q_len, kv=FP8,
                                 qdt=FP8 if warps == 4 else torch.bfloat16)
    plan, supported = _gluon_plan(lens, sl, hkv=hkv, page=page, q_len=q_len, prefetch=prefetch, warps=warps)
    assert supported(q, k, plan, hq // hkv * q_len)
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, q_len=q_len, ks=0.03, vs=0.02, what=f"gluon hq{hq} hkv{hkv} p{page} q{q_len}",
          fp8_scores=_wg_form(warps, q, hq // hkv * q_len))


@pytest.mark.parametrize("hq,hkv,page,q_len", [(64, 8, 64, 1), (8, 1, 64, 1), (32, 4, 128, 2), (16, 4, 64, 4),
                                               (16, 4, 64, 1), (12, 4, 128, 2), (8, 8, 64, 1)])
@WARPS
def test_gluon_fp8_kernel_with_fp8_q(hq, hkv, page, q_len, warps, monkeypatch):
    """fp8 q with its per-token-per-head scale on the Gluon kernel (``decode.GLUON_FP8_Q``, round AO; on by default
    since this test passed on a GPU, round AP1): within the tolerance rule of the fp64
    reference, and the scale read per row (rows of one token and of one head get different scales here)."""
    from evenflow.attention import decode

    monkeypatch.setattr(decode, "GLUON_FP8_Q", True)
    lens = [128 * K, 3, 0, 4 * K + 1, 700, 64, 65]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=hq, page=page, q_len=q_len, kv=FP8, qdt=FP8)
    assert qs.unique().numel() > qs.shape[1]  # scales differ between tokens and between heads
    plan, supported = _gluon_plan(lens, sl, hkv=hkv, page=page, q_len=q_len, warps=warps)
    assert supported(q, k, plan, hq // hkv * q_len)
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, q_len=q_len, ks=0.03, vs=0.02, what=f"gluon fp8 q hq{hq} hkv{hkv} p{page}",
          fp8_scores=_wg_form(warps, q, hq // hkv * q_len))


@pytest.mark.parametrize("qdt", [torch.bfloat16, FP8], ids=["bf16-q", "fp8-q"])
@pytest.mark.parametrize("stages", [4, 5, 6])
def test_gluon_fp8_deeper_rings_at_one_kv_head(stages, qdt):
    """Round AV's knob rows: the one-KV-head plan (2 two-warp programs an SM) on rings of 4-6 slots, reading up to
    ``stages`` - 1 tiles ahead on chunks of at most 16 tiles and a tile fewer on longer ones; an empty request and
    lengths one past a tile among them; against the fp64 reference."""
    lens = [128 * K, 3, 0, 4 * K + 1, 700, 64, 65, 17 * K]
    q, qs, k, v, pt, sl = inputs(lens, hkv=1, hq=8, kv=FP8, qdt=qdt)
    plan, supported = _gluon_plan(lens, sl, hkv=1, warps=2, num_stages=stages)
    assert plan.gluon_stages == stages and plan.per_sm == 2 and supported(q, k, plan, 8)
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, ks=0.03, vs=0.02, what=f"gluon tp8 slice s{stages} {qdt}")


@pytest.mark.parametrize("qdt", [torch.bfloat16, FP8], ids=["bf16-q", "fp8-q"])
@pytest.mark.parametrize("hq,hkv,q_len", [(8, 1, 1), (16, 1, 1), (32, 4, 2), (64, 8, 1)])
def test_gluon_fp8_four_warps_on_mma_sync(hq, hkv, q_len, qdt):
    """``DecodePlan(gluon_warps=4, warpgroup_mma=False)`` (round AV): every call on four warps of mma.sync, 16
    tokens a warp a tile (exact products: the two-warp form's tolerance, not the warpgroup form's), at its 2
    programs an SM, bf16 q and fp8 q, up to 16 q rows a KV head; against the fp64 reference."""
    lens = [128 * K, 3, 0, 4 * K + 1, 700, 64, 65, 17 * K]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=hq, q_len=q_len, kv=FP8, qdt=qdt)
    plan, supported = _gluon_plan(lens, sl, hkv=hkv, q_len=q_len, warps=4, warpgroup_mma=False, merge_chunks=12)
    assert supported(q, k, plan, hq // hkv * q_len) and plan.per_sm == 2
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, q_len=q_len, ks=0.03, vs=0.02, what=f"gluon mma4 hq{hq} hkv{hkv} {qdt}")


def test_fp8_fast_scores_baseline_is_the_tensor_cores_accumulation():
    """The warpgroup form's same-precision baseline (``decode_attention_ref_batched(fp8_scores=True)``): PyTorch's
    fp8 GEMM with fast accumulation (``reference.moe.fast_mm``, the fused MoE's fast-mode baseline too). Against
    exact products (fp64) its error is not zero (the tensor cores keep fewer bits than fp32 while they accumulate)
    yet small beside the products' magnitude, and the promoted GEMM (``use_fast_accum=False``) is no worse."""
    from evenflow.reference.moe import fast_mm

    g = torch.Generator(device="cuda").manual_seed(3)
    a = (torch.randn(8, 128, device="cuda", generator=g) * 100).clamp(-448, 448).to(FP8)
    b = (torch.randn(4096, 128, device="cuda", generator=g) * 30).clamp(-448, 448).to(FP8)
    exact = a.double() @ b.double().t()
    mag = a.double().abs() @ b.double().abs().t()
    fast = fast_mm(a, b).double()
    err = ((fast - exact).abs() / mag).max().item()
    assert 0 < err < 2.0**-10, err
    one = torch.ones((), device="cuda")
    pa = torch.zeros(16, 128, dtype=FP8, device="cuda")
    pa[:8] = a
    promoted = torch._scaled_mm(pa, b.t(), one, one, out_dtype=torch.float32)[:8].double()
    assert ((promoted - exact).abs() / mag).max().item() <= err


@pytest.mark.parametrize("merge_chunks", [8, 12], ids=["mb8", "mb12"])
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_warpgroup_fp8_q_real_shapes(case, merge_chunks):
    """The warpgroup form (round AR) on every standard case with an fp8 q, against the fp64 reference; its fused
    merge reading 8 or 12 chunks a round trip."""
    lens = CASES[case]
    q, qs, k, v, pt, sl = inputs(lens, kv=FP8, qdt=FP8)
    plan, supported = _gluon_plan(lens, sl, warps=4, merge_chunks=merge_chunks)
    assert supported(q, k, plan, 8)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                       return_lse=True)
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"gluon warpgroup fp8 q {case}", fp8_scores=True)


def _same_output(plan_kws, q, qs, k, v, pt, sl, ks, vs, hkv, q_len=1, what=""):
    """One call on a plan (fp8 cache) per entry of ``plan_kws``: their outputs and LSEs must be bitwise equal.
    Returns the plans and the first call's output and LSE."""
    plans, outs = [], []
    for kw in plan_kws:
        plan = evenflow.DecodePlan(sl.shape[0], 128 * K, hkv, q_len=q_len, device="cuda", kv_dtype=FP8,
                                   **kw).update(sl)
        out = poisoned(q.shape, torch.bfloat16, "cuda")
        outs.append(evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs,
                                              out=out, return_lse=True))
        plans.append(plan)
    torch.cuda.synchronize()
    (o, lse), rest = outs[0], outs[1:]
    for kw, (o2, lse2) in zip(plan_kws[1:], rest):
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"{what}: the plans {plan_kws[0]} and {kw} differ"
    return plans, o, lse


@pytest.mark.parametrize("qdt", [torch.bfloat16, FP8], ids=["bf16-q", "fp8-q"])
@pytest.mark.parametrize("hq,q_len,case", [(8, 1, "1x128K+31x4K"), (8, 1, "32x128+32x4K"), (4, 2, "odd"),
                                           (16, 1, "2x64K+30x1K")])
def test_one_kv_head_default_plan_is_the_warpgroup_form_for_fp8_q_else_the_two_warp_form(hq, q_len, case, qdt):
    """Round AW: a plan for an fp8 cache at one KV head takes four warps by default. A call with an fp8 q of at most 8
    rows a KV head runs the warpgroup form (its output bitwise the explicit ``gluon_warps=4`` plan's with the 8-chunk
    merge, within the rule of the fp8 GEMM baseline); every other call (a bf16 q, or 16 rows) the two-warp default's
    program (bitwise the explicit ``gluon_warps=2`` plan's, within the rule of the exact-score baseline)."""
    lens = CASES[case]
    q, qs, k, v, pt, sl = inputs(lens, hkv=1, hq=hq, kv=FP8, qdt=qdt, q_len=q_len)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    wg = qdt == FP8 and hq * q_len <= 8
    explicit = dict(gluon_warps=4, merge_chunks=8) if wg else dict(gluon_warps=2)
    plans, o, lse = _same_output([{}, explicit], q, qs, k, v, pt, sl, ks, vs, hkv=1, q_len=q_len, what=case)
    assert [(p.gluon_warps, p.per_sm) for p in plans] == [(4, 2), (explicit["gluon_warps"], 2)], plans
    check(o, lse, q, qs, k, v, pt, sl, q_len=q_len, ks=ks, vs=vs, what=f"one-KV-head default {case}",
          fp8_scores=wg)


@pytest.mark.parametrize("hkv,case", [(2, "1x128K+31x4K"), (2, "32x128+32x4K"), (4, "2x64K+30x1K"), (4, "odd")])
def test_plan_told_an_fp8_q_at_two_to_four_kv_heads_runs_the_warpgroup_form(hkv, case):
    """Round AX: a plan told ``q_dtype=torch.float8_e4m3fn`` at 2 and 4 KV heads (GQA 8) takes four warps at 2
    programs an SM: its output bitwise the explicit ``gluon_warps=4, num_programs=2 x SMs, merge_chunks=8`` plan's,
    within the rule of the fp8 GEMM baseline."""
    from evenflow._runtime import num_sms

    lens = CASES[case]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=8 * hkv, kv=FP8, qdt=FP8)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    sms = num_sms(torch.device("cuda"))
    explicit = dict(gluon_warps=4, num_programs=2 * sms, merge_chunks=8)
    plans, o, lse = _same_output([dict(q_dtype=FP8), explicit], q, qs, k, v, pt, sl, ks, vs, hkv=hkv, what=case)
    assert all((p.gluon_warps, p.per_sm, p.wg_max_regs) == (4, 2, 0) for p in plans), plans
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"told fp8 q, {hkv} KV heads, {case}", fp8_scores=True)


@pytest.mark.parametrize("hkv,kv,qdt,told,budget", [(8, FP8, torch.bfloat16, False, 42), (8, FP8, FP8, False, 42),
                                                    (4, torch.bfloat16, torch.bfloat16, False, 42),
                                                    (4, FP8, FP8, True, 42)],
                         ids=["fp8-8kv", "fp8-q-8kv", "bf16-4kv", "fp8-q-told-4kv"])
def test_pack_short_plan_at_real_shapes(hkv, kv, qdt, told, budget):
    """Round BB: a ``pack_short`` plan of 2x64K+30x1K on an H200's 132 SMs, for each kernel (the Gluon two-warp
    form at 8 KV heads, the Triton kernel for a bf16 cache, the warpgroup form for a told fp8 q): the reference's
    plan, packed (the 1K items padded from 16 tiles to 21 units), and the output within the rule of the fp64
    reference."""
    from evenflow._runtime import num_sms
    from evenflow.reference.attention import build_plan_ref

    if num_sms(torch.device("cuda")) != 132:
        pytest.skip("the budgets are an H200's (132 SMs)")
    lens = CASES["2x64K+30x1K"]
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=8 * hkv, kv=kv, qdt=qdt)
    ks, vs = (torch.tensor([1 / 30], device="cuda"), 1 / 40) if kv == FP8 else (None, None)
    plan = evenflow.DecodePlan(len(lens), 128 * K, hkv, device="cuda", kv_dtype=kv, q_dtype=qdt if told else None,
                               pack_short=True).update(sl)
    ref, _ = build_plan_ref(sl, hkv, plan.num_programs, plan.min_tiles, 128 * K, pack_short=True,
                            align_longer_growth=plan.align_longer_growth)
    assert plan.as_dict()["meta"].tolist() == ref["meta"].tolist()
    assert ref["meta"][1].item() == budget and ref["meta"][5].item() == 21 and plan.tiles[2].item() == 21
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                       return_lse=True)
    wg = told and plan.gluon_warps == 4
    check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"packed, {hkv} KV heads, {kv}, q {qdt}", fp8_scores=wg)


@pytest.mark.parametrize("hkv,lens,budgets", [(8, [32 * K] * 2 + [4 * K] * 30, (45, 64)),
                                               (8, [32 * K] + [2 * K] * 31, (23, 32)),
                                               (4, [32 * K] + [2 * K] * 31, (12, 16))],
                         ids=["2x32K+30x4K", "1x32K+31x2K", "tp2:1x32K+31x2K"])
def test_gluon_default_plan_at_four_an_sm_takes_the_longer_bound_of_two(hkv, lens, budgets):
    """Round AZ: the default fp8 plan at 8 and 4 KV heads (two warps, 4 programs an SM on 132 SMs: 528 bins) takes
    align_longer's bound 2: the budget the reference gives at 2 (raised from the one at 17/16), and the output within
    the rule of the fp64 reference, with a bf16 q."""
    from evenflow._runtime import num_sms
    from evenflow.reference.attention import build_plan_ref

    if num_sms(torch.device("cuda")) != 132:
        pytest.skip("the budgets are an H200's (132 SMs)")
    q, qs, k, v, pt, sl = inputs(lens, hkv=hkv, hq=8 * hkv, kv=FP8)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    for growth, budget in zip((1.0625, None), budgets):
        plan = evenflow.DecodePlan(len(lens), 128 * K, hkv, device="cuda", kv_dtype=FP8,
                                   align_longer_growth=growth).update(sl)
        assert (plan.gluon_warps, plan.per_sm, plan.num_programs) == (2, 4, 528)
        assert plan.align_longer_growth == (growth or 2.0)
        ref, _ = build_plan_ref(sl, hkv, 528, plan.min_tiles, 128 * K, align_longer_growth=plan.align_longer_growth)
        assert plan.as_dict()["meta"].tolist() == ref["meta"].tolist() and ref["meta"][1].item() == budget
        out = poisoned(q.shape, torch.bfloat16, "cuda")
        o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
                                           return_lse=True)
        check(o, lse, q, qs, k, v, pt, sl, ks=ks, vs=vs, what=f"bound {plan.align_longer_growth}, {len(lens)} requests")


@WARPS
def test_gluon_fp8_ignores_nan_bytes_past_each_length(warps):
    """Rows past a request's length in its last page are never read into the result: the
    kernel zero-fills them in shared memory, so NaN bytes there (e4m3 0x7F) change nothing."""
    lens = [4 * K + 5, 700, 63, 1]
    q, qs, k, v, pt, sl = inputs(lens, kv=FP8, spare_pages=0, qdt=FP8 if warps == 4 else torch.bfloat16)
    plan, _ = _gluon_plan(lens, sl, max_len=8 * K, warps=warps)
    clean = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02)
    kn, vn = k.clone(), v.clone()
    for b, L in enumerate(lens):
        page, row = int(pt[b, (L - 1) // 64]), (L - 1) % 64 + 1
        kn.view(torch.uint8)[page, row:] = 0x7F
        vn.view(torch.uint8)[page, row:] = 0x7F
    dirty = evenflow.decode_attention(q, kn, vn, pt, sl, plan=plan, q_scale=qs, k_scale=0.03, v_scale=0.02)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("hkv", [8, 1])
@WARPS
def test_gluon_fp8_cuda_graph_changing_lengths(warps, hkv):
    """A captured update + call replayed on new lengths, pages and q; at one KV head too (with gluon=True: the
    two-warp form and the warpgroup form hold 2 programs an SM there (rounds AU, AV), one warp 4)."""
    B, max_len = 16, 64 * K
    big = [64 * K] + [2 * K] * 15
    q, qs, k, v, pt, sl = inputs(big, hkv=hkv, hq=8 * hkv, kv=FP8, spare_pages=64,
                                 qdt=FP8 if warps == 4 else torch.bfloat16)
    ks, vs = torch.tensor([1 / 30], device="cuda"), torch.tensor([1 / 40], device="cuda")
    plan = evenflow.DecodePlan(B, max_len, hkv, device="cuda", kv_dtype=FP8, gluon=True, **_wk(warps))
    s_sl, s_pt, s_q = sl.clone(), pt.clone(), q.clone()
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")

    def step():
        plan.update(s_sl)
        evenflow.decode_attention(s_q, k, v, s_pt, s_sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=out)

    g = captured(step)
    for trial, lens in enumerate([big, [3 * K] * 16, [0] * 8 + [60 * K] + [100] * 7, [1] * 16]):
        s_sl.copy_(torch.tensor(lens, dtype=torch.int32, device="cuda"))
        s_pt.copy_(torch.randint(0, k.shape[0], pt.shape, dtype=torch.int32, device="cuda"))
        s_q.copy_(torch.randn(q.shape, device="cuda").to(q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, None, s_q, qs, k, v, s_pt, s_sl, ks=ks, vs=vs, what=f"gluon graph replay {trial}",
              fp8_scores=_wg_form(warps, q, 8))


@triton.jit
def _late_writer(p_q, p_q_src, n_q, p_k, p_v, p_k_src, p_v_src, p_off, n_kv, p_s, p_s_src, n_s,
                 SLEEP_NS: tl.constexpr, BLOCK: tl.constexpr):
    """A kernel ahead of a decode call under PDL: it waits for the kernel before it, lets the next
    launch at once, then sleeps ~SLEEP_NS and writes q (all of it), q's scales (``n_s`` of them; 0 for a
    bf16 q) and the K / V bytes at ``p_off``. One kernel writes all of them: a second kernel in between
    would wait for this one to finish before it lets the decode call launch, so none of this kernel's
    writes would be late any more."""
    pdl_enter(True)
    t = globaltimer_ns(n_q, False)
    t_end = t + SLEEP_NS
    while t < t_end:
        t = globaltimer_ns(t, False)
    o = tl.arange(0, BLOCK)
    for i in range(0, n_q, BLOCK):
        tl.store(p_q + i + o, tl.load(p_q_src + i + o, mask=i + o < n_q), mask=i + o < n_q)
    for i in range(0, n_s, BLOCK):
        tl.store(p_s + i + o, tl.load(p_s_src + i + o, mask=i + o < n_s), mask=i + o < n_s)
    for i in range(0, n_kv, BLOCK):
        m = i + o < n_kv
        off = tl.load(p_off + i + o, mask=m, other=0)
        tl.store(p_k + off, tl.load(p_k_src + i + o, mask=m), mask=m)
        tl.store(p_v + off, tl.load(p_v_src + i + o, mask=m), mask=m)


def _row_bytes(k, pt, lens, positions):
    """Flat byte offsets into a [pages, page, Hkv, D] fp8 cache of every head's K / V row at each
    request's token ``positions(L)``."""
    page, row = k.shape[1], k.shape[2] * k.shape[3]
    offs = []
    for b, L in enumerate(lens):
        for t in positions(L):
            base = (int(pt[b, t // page]) * page + t % page) * row
            offs.append(torch.arange(base, base + row, device="cuda"))
    return torch.cat(offs)


@WARPS
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("qdt", ["bf16", "fp8"])
def test_gluon_fp8_pdl_early_reads_skip_what_the_kernel_ahead_writes(qdt, q_len, warps, monkeypatch):
    """Round AE: under PDL the Gluon kernel (after the plan's first call) reads the plan and issues its
    first tiles before waiting for the kernel ahead. Here that kernel lets it launch at once and writes q
    and every request's new tokens (its last q_len) ~100 us later: the call must see all of them (bits of
    a plain launch on the final tensors). Sensitivity: where the kernel ahead instead rewrites each
    request's first 64 tokens (cached tokens, which a decode step never writes), the early reads do see
    the old bytes (the output differs), and with ``early_reads=False`` they do not. With an fp8 q (round AO,
    ``decode.GLUON_FP8_Q`` on here) the kernel ahead rewrites q's scales late too."""
    from evenflow.attention import decode

    fp8_q = qdt == "fp8"
    monkeypatch.setattr(decode, "GLUON_FP8_Q", fp8_q)
    lens = [5000, 300, 129, 4 * K + 1, 64, 2000, 0, 65, 1, 16 * K]
    q, qs, k, v, pt, sl = inputs(lens, kv=FP8, q_len=q_len, qdt=FP8 if fp8_q else torch.bfloat16)
    ks, vs = torch.tensor([1 / 30], device="cuda"), 1 / 40
    new_rows = _row_bytes(k, pt, lens, lambda L: range(max(0, L - q_len), L))
    old_rows = _row_bytes(k, pt, lens, lambda L: range(0, 64) if L - q_len >= 64 else ())
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    q_new = torch.randn_like(q, dtype=torch.float32).to(q.dtype)
    restore = [(q, q0), (k, k0), (v, v0)]
    if fp8_q:
        qs0, qs_new = qs.clone(), qs * (0.5 + torch.rand_like(qs))
        restore.append((qs, qs0))
    else:
        qs0 = qs_new = None

    def run(offs, early_reads):
        kb, vb = k.view(torch.uint8).view(-1), v.view(torch.uint8).view(-1)
        k_src = (torch.randn(offs.numel(), device="cuda") * 30).to(FP8).view(torch.uint8)
        v_src = (torch.randn(offs.numel(), device="cuda") * 40).to(FP8).view(torch.uint8)
        plan = evenflow.DecodePlan(len(lens), 16 * K + 64, 8, q_len=q_len, device="cuda", kv_dtype=FP8,
                                   early_reads=early_reads, **_wk(warps))
        assert decode.gluon_fp8_supported(q, k, plan, 8 * q_len)
        outs = [torch.empty(q.shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]

        def step():
            plan.update(sl)
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=outs[0])
            s, s_src = (qs, qs_new) if fp8_q else (q, q_new)  # q's scales (fp8 q) or nothing (n_s = 0)
            _late_writer[(1,)](q, q_new, q.numel(), kb, vb, k_src, v_src, offs, offs.numel(), s, s_src,
                               qs.numel() if fp8_q else 0, SLEEP_NS=100_000, BLOCK=1024, launch_pdl=True)
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, k_scale=ks, v_scale=vs, out=outs[1])

        g = captured(step)
        same = []
        for _ in range(3):
            replay_fresh(g, outs, restore)
            plain = evenflow.DecodePlan(len(lens), 16 * K + 64, 8, q_len=q_len, device="cuda", kv_dtype=FP8,
                                        pdl=False, **_wk(warps)).update(sl)
            before = evenflow.decode_attention(q0, k0, v0, pt, sl, plan=plain, q_scale=qs0, k_scale=ks, v_scale=vs)
            after = evenflow.decode_attention(q, k, v, pt, sl, plan=plain, q_scale=qs, k_scale=ks, v_scale=vs)
            assert torch.equal(outs[0], before)
            same.append(torch.equal(outs[1], after))
        return same

    assert run(new_rows, True) == [True] * 3
    assert run(old_rows, False) == [True] * 3
    assert run(old_rows, True) == [False] * 3


@pytest.mark.parametrize("q_len", [1, 2])
def test_triton_pdl_trigger_and_early_metadata_see_everything_the_kernel_ahead_writes(q_len):
    """Round AF: under PDL the Triton kernel (bf16 KV) lets the next kernel launch at its top and, after
    the plan's first call, reads its first item's metadata before waiting for the kernel ahead; it reads
    no q or K / V before that wait. Here the kernel ahead lets it launch at once and ~100 us later writes
    q, every request's new tokens and its first 64 cached tokens: both calls of the graph (the first after
    the update, the second reading early) give the bits of a plain launch on the final tensors, and the
    calls do let the next launch go (the trigger is in the build, a CPU test of the sm_90 PTX)."""
    from evenflow.attention.decode import triton_holds_plan

    lens = [5000, 300, 129, 4 * K + 1, 64, 2000, 0, 65, 1, 16 * K]
    q, _, k, v, pt, sl = inputs(lens, q_len=q_len)
    rows = _row_bytes(k, pt, lens, lambda L: sorted(set(range(max(0, L - q_len), L)) | set(range(min(L, 64)))))
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    q_new = torch.randn_like(q, dtype=torch.float32).to(q.dtype)
    kb, vb = k.view(torch.int16).view(-1), v.view(torch.int16).view(-1)
    k_src = torch.randn(rows.numel(), device="cuda").to(k.dtype).view(torch.int16)
    v_src = torch.randn(rows.numel(), device="cuda").to(v.dtype).view(torch.int16)
    plan = evenflow.DecodePlan(len(lens), 16 * K + 64, 8, q_len=q_len, device="cuda")
    assert triton_holds_plan(plan, q.shape[1] // 8 * q_len, 128)
    outs = [torch.empty(q.shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]

    # what the kernel ahead writes before each call: the first call's inputs as they were, then the new ones
    srcs = [(q0, k0.view(torch.int16).view(-1)[rows], v0.view(torch.int16).view(-1)[rows]),
            (q_new, k_src, v_src), (q_new, k_src, v_src)]

    def step():
        plan.update(sl)
        for i, (q_s, k_s, v_s) in enumerate(srcs):  # the first call after the update, then two that read early
            _late_writer[(1,)](q, q_s, q.numel(), kb, vb, k_s, v_s, rows, rows.numel(), q, q_s, 0,
                               SLEEP_NS=100_000, BLOCK=1024, launch_pdl=True)
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, out=outs[i])

    g = captured(step)
    plain = evenflow.DecodePlan(len(lens), 16 * K + 64, 8, q_len=q_len, device="cuda", pdl=False).update(sl)
    for _ in range(3):
        replay_fresh(g, outs, ((q, q0), (k, k0), (v, v0)))
        want0 = evenflow.decode_attention(q0, k0, v0, pt, sl, plan=plain)
        want = evenflow.decode_attention(q, k, v, pt, sl, plan=plain)
        assert torch.equal(outs[0], want0)
        assert torch.equal(outs[1], want) and torch.equal(outs[2], want)
