"""decode_attention against a float64 PyTorch oracle, under the tolerance rule.

Baseline of the rule (same precision as the kernel): PyTorch in fp32 on the same bf16/fp8
inputs, unnormalised probabilities rounded to bf16 before the product with V (the kernel
feeds P to a bf16 tensor-core dot), output rounded to bf16.
"""
import contextlib
import math
import warnings

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.reference.attention import decode_attention_ref, random_kv_caches
from evenflow.testing import assert_within_one_ulp, assert_within_rule, poisoned

FP8 = torch.float8_e4m3fn


def make_inputs(lens, hkv, group, d, page, q_len, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                extra_cols=1, hnd=False, device="cpu"):
    B = len(lens)
    max_pages = max(1, max(-(-L // page) for L in lens)) + extra_cols
    num_pages = B * max_pages + 3
    k, v = random_kv_caches(num_pages, page, hkv, d, kv_dtype, hnd=hnd, device=device)
    # pages in random order
    pt = torch.randperm(num_pages, device=device)[: B * max_pages].view(B, max_pages).to(torch.int32)
    q = torch.randn(B * q_len, hkv * group, d, device=device)
    q_scale = None
    if q_dtype == FP8:
        q_scale = q.abs().amax(-1) / 448.0
        q = (q / q_scale[..., None]).to(FP8)
    else:
        q = q.to(q_dtype)
    return q, q_scale, k, v, pt, torch.tensor(lens, dtype=torch.int32, device=device)


def check(q, q_scale, k, v, pt, sl, q_len, plan=None, k_scale=None, v_scale=None, sm_scale=None, what=""):
    out = poisoned(q.shape, torch.bfloat16, q.device)
    lse = poisoned(q.shape[:2], torch.float32, q.device)
    o, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=q_scale, k_scale=k_scale,
                                       v_scale=v_scale, sm_scale=sm_scale, out=out, return_lse=True, lse=lse)
    assert o.data_ptr() == out.data_ptr()
    kw = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, q_len=q_len)
    ref, ref_lse = decode_attention_ref(q, k, v, pt, sl, **kw)
    base, base_lse = decode_attention_ref(q, k, v, pt, sl, dtype=torch.float32, p_dtype=torch.bfloat16,
                                          out_dtype=torch.bfloat16, **kw)
    assert_within_rule(o, ref, base, what=f"{what} output")
    # compare on the CPU: the fp64 reference may live on another device than the output
    lse_c, ref_lse, base_lse = lse.cpu(), ref_lse.cpu(), base_lse.cpu()
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse_c) & (lse_c < 0), dead), f"{what}: lse -inf exactly where no token is seen"
    assert (o.cpu()[dead] == 0).all(), f"{what}: rows that see no token must be zero"
    assert_within_rule(lse_c[~dead], ref_lse[~dead], base_lse[~dead].float(), what=f"{what} lse")
    return o


def run(device, lens, hkv=2, group=4, d=64, page=64, q_len=1, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
        dynamic=True, num_programs=4, min_tiles=1, hnd=False, num_warps=None, num_stages=None, block_n=None,
        item_cost=None, item_cost_max_tiles="default", warp_split=None, pack_short=False, **kw):
    q, qs, k, v, pt, sl = make_inputs(lens, hkv, group, d, page, q_len, kv_dtype, q_dtype, hnd=hnd, device=device)
    plan = None
    if dynamic:
        costs = {} if item_cost is None else dict(item_cost=item_cost)
        if item_cost_max_tiles != "default":
            costs["item_cost_max_tiles"] = item_cost_max_tiles
        plan = evenflow.DecodePlan(len(lens), 1 << 16, hkv, page_size=page, q_len=q_len, device=device,
                                   num_programs=num_programs, min_tiles=min_tiles, num_warps=num_warps,
                                   num_stages=num_stages, block_n=block_n, warp_split=warp_split,
                                   pack_short=pack_short, **costs).update(sl)
    return check(q, qs, k, v, pt, sl, q_len, plan=plan, what=f"lens={lens}", **kw)


# The first priority case: bf16, q_len 1, head_dim 128, page 64, a skewed batch split across bins.
def test_bf16_d128_p64_skewed(device):
    run(device, [700, 64, 0, 65, 130], hkv=2, group=8, d=128, page=64, num_programs=5)


@pytest.mark.parametrize("group,q_len", [(8, 1), (16, 4)], ids=["g8", "g16-q4"])
def test_item_spread_over_many_bins(group, q_len, device):
    # One kv head, one tile per bin: the long item is cut into 62 chunks, more than the
    # combine merges per step (32 at 16 rows, 8 at 64), with the head dim split over
    # combine programs (TP8-slice-like: one kv head, a long request).
    run(device, [64 * 60 + 17, 100, 0], hkv=1, group=group, d=128, q_len=q_len, num_programs=70)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_prefetch_keeps_results(kv, device, monkeypatch):
    """Bins of many short items, empty ones among them and last in the batch, a long item
    cut across bins: the persistent loop that loads the next item's metadata before the
    current item's work gives the same output bit for bit as the one that loads it after,
    both within the rule; the plan's choice reaches the kernel (its PREFETCH constexpr)."""
    from evenflow.attention import kernels as K

    seen = []
    real = K.decode_kernel

    class Spy:  # records the PREFETCH constexpr of every decode_kernel launch
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["PREFETCH"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(K, "decode_kernel", Spy())
    lens = [130, 0, 64, 65, 1, 700, 0, 200, 64 * 12 + 3, 0]
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    q, qs, k, v, pt, sl = make_inputs(lens, 2, 4, 64, 64, 1, kv_dtype=kv_dtype, device=device)
    scales = dict(k_scale=1 / 30, v_scale=1 / 40) if kv == "fp8" else {}
    outs = []
    for prefetch in (True, False):
        plan = evenflow.DecodePlan(len(lens), 1 << 16, 2, device=device, num_programs=3, min_tiles=1,
                                   prefetch=prefetch).update(sl)
        outs.append(check(q, qs, k, v, pt, sl, 1, plan=plan, what=f"prefetch={prefetch}", **scales).clone())
    assert torch.equal(outs[0], outs[1])
    assert seen == [True, False]


@pytest.mark.parametrize("combine", ["fused", "kernel"])
def test_combine_groups_merge_deterministically_and_reset_their_counters(combine, device):
    """Items of more chunks than one combine step are merged in groups, the last group to
    arrive finishing the item: two items of 61 and 40 chunks plus single-group ones, the
    plan reused for a second call and for other lengths. Same result bitwise every time,
    counters back at zero after each call, both calls within the rule; merged inside the
    attention kernel (fused) or by the combine kernel. (The interpreter runs programs in order,
    so here the last arriver is always the last program; arrival order varies only on a GPU:
    tests/test_decode_gpu.py replays the fused merge and asserts bitwise-equal outputs.)"""
    lens = [64 * 60 + 17, 100, 64 * 40, 0, 700]
    q, qs, k, v, pt, sl = make_inputs(lens, 1, 8, 128, 64, 1, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 13, 1, device=device, num_programs=120, min_tiles=1,
                               combine=combine).update(sl)

    def counters():
        return int(plan.combine_count.abs().sum()) + int(plan.group_count.abs().sum())

    o1 = check(q, qs, k, v, pt, sl, 1, plan=plan, what="first call").clone()
    assert counters() == 0
    o2 = check(q, qs, k, v, pt, sl, 1, plan=plan, what="second call")
    assert torch.equal(o1, o2) and counters() == 0
    sl2 = torch.tensor([64 * 20, 64 * 55, 5, 0, 64], dtype=torch.int32, device=device)
    check(q, qs, k, v, pt, sl2, 1, plan=plan.update(sl2), what="other lengths")
    assert counters() == 0


def test_fused_final_merge_of_more_groups_than_one_load_step(device):
    """The fused merge's last arriver merges an item's groups UG = 8 at a time (8 rows x 64
    columns): an item of 137 chunks (one tile per bin) is 18 groups of 8, three load steps, the
    last masked after 2 groups; beside it a 17-chunk item (3 groups, one masked step) and an empty
    one. Within the rule against the oracle, the same bitwise on a second call, counters back at
    zero. (The older tests take several steps only at UG = 2 (64 rows), all of them full; a merge
    that drops a partly masked last step fails here alone.)"""
    from evenflow.attention.decode import FUSED_GROUP_CHUNKS

    assert FUSED_GROUP_CHUNKS == 8  # the chunk counts above are chosen for groups of 8
    lens = [64 * 136 + 9, 0, 64 * 16 + 1]
    q, qs, k, v, pt, sl = make_inputs(lens, 1, 8, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 14, 1, device=device, num_programs=160, min_tiles=1).update(sl)
    assert int(plan.meta[1]) == 1
    o1 = check(q, qs, k, v, pt, sl, 1, plan=plan, what="137-chunk item").clone()
    o2 = check(q, qs, k, v, pt, sl, 1, plan=plan, what="second call")
    assert torch.equal(o1, o2)
    assert int(plan.group_count.abs().sum()) + int(plan.combine_count.abs().sum()) == 0


@pytest.mark.parametrize("kv,group,q_len,d", [("bf16", 4, 2, 64), ("fp8", 8, 1, 128)], ids=["bf16-g4-q2", "fp8-g8"])
def test_one_pass_merge_gives_the_same_bits(kv, group, q_len, d, device, monkeypatch):
    """Round BP: the fused merge step built in one pass (``decode.MERGE_ONE_PASS``: each chunk's LSE loaded once,
    every load of a step ahead of a branch; kernels._merge_chunks' ONE_PASS) takes the same maxima and adds the same
    weighted outputs in the same order as the two-pass step (the default until round BQ): the same output and LSE
    bits, and within the rule.
    One tile a bin: items of 21 chunks (three groups, merged again in one load step masked after three), 9 (two
    groups, the second of one chunk), one and none; two q rows a request (a causal row that sees a token fewer) or a
    TP8-like group of 8 on an fp8 cache (the Triton kernel: the plan is not told the dtype). On the CPU the launches
    are recorded too, so the switch is seen to reach the attention kernel."""
    from evenflow._compile_check import record_launches
    from evenflow.attention import decode

    lens = [64 * 20 + 9, 0, 64 * 8 + 1, 37, 64]
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    q, qs, k, v, pt, sl = make_inputs(lens, 1, group, d, 64, q_len, kv_dtype=kv_dtype, device=device)
    scales = dict(k_scale=1 / 30, v_scale=1 / 40) if kv == "fp8" else {}
    plan = evenflow.DecodePlan(len(lens), 1 << 12, 1, page_size=64, q_len=q_len, device=device, num_programs=40,
                               min_tiles=1).update(sl)
    assert int(plan.meta[1]) == 1  # one tile a bin: every long item cut at each tile
    outs = []
    for one_pass in (False, True):
        monkeypatch.setattr(decode, "MERGE_ONE_PASS", one_pass)
        with record_launches(execute=True) if _runtime.interpreting() else contextlib.nullcontext() as rec:
            outs.append(evenflow.decode_attention(q, k, v, pt, sl, plan=plan, return_lse=True, **scales))
        if rec is not None:
            assert [(la.name, dict(la.constexprs)["MERGE_ONE_PASS"]) for la in rec] == [("decode_kernel", one_pass)]
    (o0, lse0), (o1, lse1) = outs
    assert torch.equal(o0.view(torch.int16), o1.view(torch.int16)), "output bits"
    assert torch.equal(lse0.view(torch.int32), lse1.view(torch.int32)), "LSE bits"
    check(q, qs, k, v, pt, sl, q_len, plan=plan, what="one-pass merge", **scales)  # the switch is still on


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_fused_combine_launches_one_kernel_and_matches_the_combine_kernel(kv, device, monkeypatch):
    """The default plan merges split items inside the attention kernel: one launch per call,
    no combine kernel. With one work unit per bin every non-empty item is split: items of 3-10
    chunks (one merge group; the short ones end in token-free item-cost units) and one of 46
    (6 fused groups of 8, 2 of the combine kernel's 32), an empty item finished in place, 16
    rows (q_len 2, causal), the LSE too. Both modes are within the rule against the oracle and
    agree to the merge's rounding."""
    from evenflow.attention import kernels as K

    seen = []

    class Spy:  # records which kernels a call launches
        def __init__(self, name):
            self.name, self.real = name, getattr(K, name)

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(self.name)
                return self.real[grid](*args, **kw)
            return launch

    for name in ("decode_kernel", "combine_kernel"):
        monkeypatch.setattr(K, name, Spy(name))
    lens = [64 * 45 + 3, 0, 70, 64 * 3, 1, 64 * 9 + 40]
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    q, qs, k, v, pt, sl = make_inputs(lens, 2, 8, 64, 64, 2, kv_dtype=kv_dtype, device=device)
    scales = dict(k_scale=1 / 30, v_scale=1 / 40) if kv == "fp8" else {}
    outs = {}
    for combine in ("fused", "kernel"):
        seen.clear()
        # one tile per bin: the 46-tile item is 46 chunks (6 fused merge groups, 2 of the combine kernel)
        plan = evenflow.DecodePlan(len(lens), 1 << 13, 2, q_len=2, device=device, num_programs=140, min_tiles=1,
                                   combine=combine).update(sl)
        assert int(plan.meta[1]) == 1
        outs[combine] = check(q, qs, k, v, pt, sl, 2, plan=plan, what=f"combine={combine}", **scales).float()
        assert seen == (["decode_kernel"] if combine == "fused" else ["decode_kernel", "combine_kernel"])
        assert int(plan.group_count.abs().sum()) + int(plan.combine_count.abs().sum()) == 0
    # the two merge in different groups and load steps (8-chunk groups against 32): fp32 sums equal up to their
    # rounding, so the bf16 outputs differ by at most one unit in the last place
    assert_within_one_ulp(outs["fused"], outs["kernel"], "fused against the combine kernel")


@pytest.mark.parametrize("build", ["triton-bf16", "gluon-fp8"])
def test_timeline_build_counts_each_programs_work_and_keeps_results(device, build):
    """DecodePlan.record_timeline: the STAMPS build writes one row per program. Its counts
    are checked against the reference plan's bins (chunks visited, empty items included;
    real tiles, not item-cost units; one merge per group of chunks of each split item, 8 a group for the Triton
    kernel and the plan's ``merge_chunks`` (12 since round AS) for the Gluon one,
    summed over programs since which program merges depends on arrival order), and its
    output is bitwise the default build's. (The interpreter has no timer or SM id: those
    fields are 0 / -1 here; on a GPU they must come in program order.) ``gluon-fp8``: a plan
    built for an fp8 cache, whose Gluon kernel has its own STAMPS build (compiled
    code only: Gluon has no interpreter)."""
    from evenflow.attention import kernels as K
    from evenflow.attention.decode import FUSED_GROUP_CHUNKS, gluon_fp8_supported
    from evenflow.reference.attention import build_plan_ref

    gluon = build == "gluon-fp8"
    if gluon and device != "cuda":
        pytest.skip("the Gluon kernel runs as compiled code only (its sm_90 build: tests/test_decode_sm90.py)")
    lens = [64 * 45 + 3, 0, 70, 64 * 3, 1, 64 * 9 + 40]
    hkv, nprog, d = 2, 24, (128 if gluon else 64)
    kv = FP8 if gluon else torch.bfloat16
    q, qs, k, v, pt, sl = make_inputs(lens, hkv, 8, d, 64, 1, kv_dtype=kv, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 13, hkv, device=device, num_programs=nprog, min_tiles=1,
                               kv_dtype=kv if gluon else None).update(sl)
    assert gluon_fp8_supported(q, k, plan, 8) == gluon
    base = check(q, qs, k, v, pt, sl, 1, plan=plan, what="default build").clone()
    stamps = plan.record_timeline()
    assert stamps.shape == (nprog, K.STAMP_SLOTS) and stamps.dtype == torch.int64
    stamps.fill_(-7)
    o = check(q, qs, k, v, pt, sl, 1, plan=plan, what="timeline build")
    assert torch.equal(o, base)
    assert (stamps[:, :len(K.STAMP_FIELDS)] != -7).all(), "every field of every program written"
    f = {name: stamps[:, j].cpu() for j, name in enumerate(K.STAMP_FIELDS)}
    _, bins = build_plan_ref(sl, hkv, nprog, 1, 1 << 13, item_cost=plan.item_cost,
                             item_cost_max_tiles=plan.item_cost_max_tiles, align_growth=plan.align_growth,
                             align_longer_growth=plan.align_longer_growth)
    real = [-(-L // 64) for L in lens]
    want_chunks = [len(b) for b in bins]
    want_tiles = [sum(max(0, min(e, real[i // hkv]) - t) for i, t, e in b) for b in bins]
    chunks_of = {}
    for b in bins:
        for i, t, e in b:
            chunks_of[i] = chunks_of.get(i, 0) + (e > t)
    group = plan.merge_chunks if gluon else FUSED_GROUP_CHUNKS  # the Gluon merge's groups: 12 since round AS
    want_merges = sum(-(-c // group) for c in chunks_of.values() if c > 1)
    assert f["chunks"].tolist() == want_chunks
    assert f["tiles"].tolist() == want_tiles
    assert int(f["merges"].sum()) == want_merges > 1
    if _runtime.interpreting():  # no timer, no SM id
        assert (f["sm"] == -1).all() and (f["entry"] == 0).all() and (f["clk_program_end"] == 0).all()
    else:  # stamps in program order: entry <= after the wait <= metadata <= chunk ends <= end
        busy = f["chunks"] > 0
        assert ((f["sm"] >= 0) & (f["sm"] < _runtime.num_sms(device))).all()
        assert (f["entry"] > 0).all() and (f["after_wait"] >= f["entry"]).all() and (f["meta"] >= f["after_wait"]).all()
        assert (f["first_end"][busy] >= f["meta"][busy]).all() and (f["last_end"][busy] >= f["first_end"][busy]).all()
        assert (f["program_end"] >= torch.maximum(f["meta"], f["last_end"])).all()
        assert (f["clk_program_end"] >= f["clk_entry"]).all()
    assert plan.record_timeline(False) is None and plan.stamps is None
    assert plan.record_timeline().data_ptr() == stamps.data_ptr() and (stamps == 0).all()  # one buffer, zeroed
    plan.stamps = stamps[:, :4]
    with pytest.raises(ValueError, match="plan.stamps"):
        evenflow.decode_attention(q, k, v, pt, sl, plan=plan)
    plan.record_timeline(False)
    assert torch.equal(check(q, qs, k, v, pt, sl, 1, plan=plan, what="default again"), base)
    with pytest.raises(TypeError, match="on must be a bool"):
        plan.record_timeline(1)


@pytest.mark.parametrize("dynamic", [True, False], ids=["plan", "static"])
@pytest.mark.parametrize("lens", [[200, 200, 200], [1, 64, 65, 300], [0, 0], [0, 129, 0]],
                         ids=["uniform", "tile_edges", "all_zero", "zero_around"])
def test_lengths(lens, dynamic, device):
    run(device, lens, dynamic=dynamic)


@pytest.mark.parametrize("group", [1, 2, 8, 16])
def test_gqa_group(group, device):
    run(device, [150, 70], hkv=2 if group < 16 else 1, group=group)


@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_q_len_causal(q_len, device):
    # 65: last tile holds one token, invisible to the first rows; 2: shorter than q_len for 3 and 4
    run(device, [65, 130, 2, 0], q_len=q_len, group=2)


@pytest.mark.parametrize("page", [16, 32, 128])
def test_page_size(page, device):
    run(device, [200, 33, 129], page=page)


@pytest.mark.parametrize("d", [128, 256])
def test_head_dim(d, device):
    run(device, [100, 140], d=d, group=2)


def test_sm_scale_and_hnd_view(device):
    run(device, [150, 90], sm_scale=0.3, hnd=True)


def test_fp8_kv_bf16_q(device):
    run(device, [300, 64, 0, 77], kv_dtype=FP8, k_scale=1 / 30, v_scale=torch.tensor([1 / 40], device=device))


@pytest.mark.parametrize("magnitude", [2.0**17, 2.0**-10], ids=["beyond_f16_max", "small"])
def test_fp8_kv_bf16_q_any_magnitude(magnitude, device):
    # With fp8 KV the kernel's MMAs run in f16; bf16 q reaches f16 through a power-of-two
    # row scale. |q| of 2^17 * N(0, 1) overflows f16 (max 65504) without it.
    q, qs, k, v, pt, sl = make_inputs([300, 70], 2, 4, 64, 64, 1, FP8, device=device)
    q = (q.float() * magnitude).to(torch.bfloat16)
    plan = evenflow.DecodePlan(2, 1 << 12, 2, device=device, num_programs=3, min_tiles=1).update(sl)
    o = check(q, qs, k, v, pt, sl, 1, plan=plan, k_scale=1 / 30, v_scale=1 / 40, sm_scale=0.125 / magnitude,
              what=f"|q| ~ {magnitude}")
    assert torch.isfinite(o).all()


def test_fp8_kv_fp8_q(device):
    run(device, [300, 65, 0], kv_dtype=FP8, q_dtype=FP8, k_scale=torch.tensor([1 / 30], device=device), v_scale=1 / 40,
        group=8, d=128)


def test_fp8_kv_static_q_len2(device):
    run(device, [190, 3], kv_dtype=FP8, q_dtype=FP8, k_scale=1 / 30, v_scale=1 / 40, q_len=2, dynamic=False)


def test_plan_and_static_agree_and_min_tiles_path(device):
    """One-bin plans (min_tiles large: nothing split, combine idle) still match the oracle."""
    run(device, [300, 20, 90], min_tiles=64)


def test_launch_overrides_keep_results(device):
    """The sweep knobs (num_warps / num_stages on the plan) change the launch, not the result."""
    run(device, [300, 20, 90], num_programs=3, num_warps=8, num_stages=1)


def _mid_step_cuts(lens, hkv, num_programs, **plan_kw):
    """Chunks of the plan's bins (min_tiles 1) that end before their item's last tile after an
    odd number of tiles: a 128-token step reads one tile past them (the next program's)."""
    from evenflow.reference.attention import build_plan_ref

    sl = torch.tensor(lens, dtype=torch.int32)
    tiles = [-(-L // 64) for L in lens]
    _, bins = build_plan_ref(sl, hkv, num_programs, 1, 1 << 16, **plan_kw)
    return [(i, t0, t1) for chunks in bins for i, t0, t1 in chunks
            if t1 < tiles[i // hkv] and (t1 - t0) % 2 == 1]


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_block_n_128_masks_chunk_ends(device, kv):
    """Two tiles per iteration: with an odd budget (22 tiles / 5 programs = 5, no item cost)
    chunks end in the middle of a 128-token step; the tokens past the chunk belong to the next
    program and must not be counted twice. (The default item cost gives budget 9 here and no
    such chunk, so the plan is built without it; the premise is asserted.)"""
    lens = [300, 64, 0, 77, 129]
    assert _mid_step_cuts(lens, 2, 5, item_cost=0)
    if kv == "fp8":
        run(device, lens, kv_dtype=FP8, num_programs=5, block_n=128, k_scale=1 / 30, v_scale=1 / 40, item_cost=0)
    else:
        run(device, lens, page=16, q_len=2, num_programs=5, block_n=128, item_cost=0)


ITEM_COST_CASES = {
    # the units past an item's last tile carry no tokens: with 1-tile bins a split item's
    # last chunks are token-free partials (LSE -inf) that the combine must weigh as nothing
    "skewed-g8": dict(lens=[700, 64, 0, 65, 130], group=8, d=128, num_programs=5, item_cost=2),
    "one-tile-bins": dict(lens=[300, 64, 0, 77, 129], num_programs=40, item_cost=3),
    "many-bins-q4": dict(lens=[64 * 60 + 17, 100, 0], hkv=1, group=16, d=128, q_len=4, num_programs=70, item_cost=1),
    "fp8-block_n128": dict(lens=[300, 64, 0, 77, 129], kv_dtype=FP8, num_programs=5, block_n=128, k_scale=1 / 30,
                           v_scale=1 / 40, item_cost=1),
    # charged to every item (the long one too), and to none
    "all-items": dict(lens=[700, 64, 0, 65, 130], num_programs=7, item_cost=3, item_cost_max_tiles=None),
    "one-tile-bins-all": dict(lens=[300, 64, 0, 77, 129], num_programs=40, item_cost=2, item_cost_max_tiles=None),
    "no-cost": dict(lens=[700, 64, 0, 65, 130], num_programs=5, item_cost=0),
}


@pytest.mark.parametrize("case", list(ITEM_COST_CASES))
def test_item_cost_keeps_results(case, device):
    """A plan that charges each non-empty item extra work units (so short items spread over
    more bins) changes the schedule, not the attention."""
    run(device, **ITEM_COST_CASES[case])


PACK_CASES = {
    # (run's arguments, the quantum the reference plan takes): items padded to a multiple of the quantum, so a
    # split item's last chunks may hold only units past its tokens (partials of LSE -inf the merge weighs as
    # nothing); a 1100-token item (18 tiles) padded to 20 units, cut across bins
    "two-lengths-g2": (dict(lens=[130, 65, 1100, 200, 1100], num_programs=8, pack_short=True), 5),
    "phantom-chunks-fp8-g8": (dict(lens=[1100, 130, 64, 200, 65, 300], hkv=1, group=8, d=128, kv_dtype=FP8,
                                   num_programs=10, k_scale=1 / 30, v_scale=1 / 40, pack_short=True), 5),
    "empties-p16-q2": (dict(lens=[0, 0, 0, 1600, 200, 300, 0, 65], hkv=1, page=16, q_len=2, num_programs=3,
                            pack_short=True), 5),
}


@pytest.mark.parametrize("case", list(PACK_CASES))
def test_pack_short_keeps_results(case, device):
    """A pack_short plan (round BB) changes the schedule, not the attention; the premise (the plan packs, with
    chunks that hold no tokens) is asserted on the reference."""
    from evenflow.reference.attention import build_plan_ref

    kw, quantum = PACK_CASES[case]
    lens, hkv = kw["lens"], kw.get("hkv", 2)
    ref, bins = build_plan_ref(torch.tensor(lens), hkv, kw["num_programs"], 1, 1 << 16, pack_short=True)
    assert int(ref["meta"][5]) == quantum
    assert any(t0 >= -(-lens[i // hkv] // 64) for chunks in bins for i, t0, t1 in chunks if t1 > t0 > 0)
    run(device, **kw)


def test_validate_inputs_takes_a_packed_plan(device):
    lens = [130, 65, 1100, 200, 1100]
    q, qs, k, v, pt, sl = make_inputs(lens, 2, 4, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 16, 2, device=device, num_programs=8, min_tiles=1,
                               pack_short=True).update(sl)
    assert int(plan.meta[5]) == 5
    evenflow.attention.validate_inputs(q, k, v, pt, sl, plan=plan)
    unpacked = evenflow.DecodePlan(len(lens), 1 << 16, 2, device=device, num_programs=8, min_tiles=1,
                                   pack_short=False).update(sl)
    with pytest.raises(ValueError, match="not updated"):
        evenflow.attention.validate_inputs(q, k, v, pt, sl, plan=plan.update(sl.flip(0)))
    evenflow.attention.validate_inputs(q, k, v, pt, sl, plan=unpacked)


# Each case has chunks of >= WS_MIN_TILES (24) tiles (the warp-split loop), among them one
# that ends at the item's length (a part-filled last tile, masked), and short items (the plain
# loop) in one launch.
LONG = 64 * 30 + 5
WARP_SPLIT_CASES = {
    "skewed-g8-d128": dict(lens=[LONG, 64, 0, 65, 130], group=8, d=128, num_programs=2),
    "fp8-kv": dict(lens=[LONG, 64, 0, 77, 129], kv_dtype=FP8, num_programs=2, k_scale=1 / 30, v_scale=1 / 40),
    "fp8-kv-fp8-q-g16": dict(lens=[LONG, 64, 0, 77, 129], group=16, kv_dtype=FP8, q_dtype=FP8, num_programs=2,
                             k_scale=1 / 30, v_scale=1 / 40),
    "p16-q3-causal": dict(lens=[LONG, 20, 0, 77, 129], page=16, q_len=3, num_programs=2),
    "fp8-q4-w2": dict(lens=[LONG, 20, 0, 77], q_len=4, kv_dtype=FP8, num_programs=2, num_warps=2,
                      k_scale=1 / 30, v_scale=1 / 40),
    "n128-w8": dict(lens=[64 * 60 + 17, 100, 0], hkv=1, group=16, d=128, num_programs=2, block_n=128,
                    num_warps=8),
}


def _longest_final_chunk(lens, hkv, num_programs):
    """Tiles of the longest chunk that ends at its item's last tile, in the default plan's bins."""
    from evenflow.reference.attention import build_plan_ref

    sl = torch.tensor(lens, dtype=torch.int32)
    tiles = [-(-L // 64) for L in lens]
    _, bins = build_plan_ref(sl, hkv, num_programs, 1, 1 << 16)
    return max((t1 - t0 for chunks in bins for i, t0, t1 in chunks if t1 == tiles[i // hkv] > 0), default=0)


@pytest.mark.parametrize("case", list(WARP_SPLIT_CASES))
def test_warp_split_keeps_results(case, device):
    """Long chunks on the warp-split loop (each warp its own online softmax over a quarter, a
    half or an eighth of every step's tokens, merged once per chunk) and short ones on the
    plain loop, in one launch: another order of the same sums, so the same attention and LSE,
    and zeros where no token is visible (a warp whose tokens are all masked holds -inf)."""
    from evenflow.attention.decode import WS_MIN_TILES

    kw = WARP_SPLIT_CASES[case]
    assert _longest_final_chunk(kw["lens"], kw.get("hkv", 2), kw["num_programs"]) >= WS_MIN_TILES
    run(device, warp_split=True, **kw)


def test_warp_split_static_schedule(device):
    """The static split (no plan) takes the split loop by default for fp8 KV: enough items
    that each is one chunk (splits == 1 on this device), each of >= WS_MIN_TILES tiles."""
    from evenflow.attention.decode import WS_MIN_TILES
    from evenflow.attention.plan import default_num_programs, static_splits

    hkv = 2
    B = -(-default_num_programs(device) // hkv)
    assert static_splits(B, hkv, device) == 1 and -(-LONG // 64) >= WS_MIN_TILES
    run(device, [LONG] * (B - 1) + [77], hkv=hkv, kv_dtype=FP8, dynamic=False, k_scale=1 / 30, v_scale=1 / 40)


@pytest.mark.parametrize("kw", [dict(d=256, group=2), dict(group=16, q_len=2), dict(num_warps=8)],
                         ids=["d256", "32-rows", "8-warps-64-tokens"])
def test_warp_split_true_where_it_cannot_build_is_an_error(kw, device):
    """An explicit warp_split=True on a shape the split loop is not built for (head_dim 256,
    more than 16 rows, fewer than 16 tokens per warp) says so; the default falls back to the
    plain loop there (fp8 KV d256 g16 q4 is in the sm_90 compile scenarios)."""
    with pytest.raises(ValueError, match="warp_split=True needs"):
        run(device, [300, 20], kv_dtype=FP8, warp_split=True, num_programs=2, k_scale=1 / 30, v_scale=1 / 40, **kw)


def test_page128_two_tile_steps_from_an_odd_tile(device):
    """128-token steps over 128-token pages: a chunk that starts at an odd tile (budget 5 of
    10 tiles) steps across a page boundary, so each token needs its own page id; with the
    pages in random order a single page id per step reads the wrong page (or past the last)."""
    for ws in (False, True):
        run(device, [640], hkv=1, group=8, d=64, page=128, block_n=128, num_programs=2, warp_split=ws)
        run(device, [640], hkv=1, group=8, d=64, page=128, block_n=128, num_programs=2, warp_split=ws,
            kv_dtype=FP8, k_scale=1 / 30, v_scale=1 / 40)


def test_default_programs_and_plan_reuse(device):
    lens = [500, 3, 260]
    q, qs, k, v, pt, sl = make_inputs(lens, 2, 4, 64, 32, 1, device=device)
    plan = evenflow.DecodePlan(6, 4096, 2, page_size=32, device=device)
    plan.update(sl)
    check(q, qs, k, v, pt, sl, 1, plan=plan)
    sl2 = torch.tensor([40, 511, 0], dtype=torch.int32, device=device)  # new lengths, same buffers
    check(q, qs, k, v, pt, sl2, 1, plan=plan.update(sl2))


def test_validate_inputs_and_kernel_stays_in_bounds(device):
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device, num_programs=2, min_tiles=1).update(sl)
    evenflow.attention.validate_inputs(q, k, v, pt, sl, plan=plan)
    bad_pt = pt.clone()
    bad_pt[0, 1] = k.shape[0] + 5
    with pytest.raises(ValueError, match=r"page_table\[0, 1\]"):
        evenflow.attention.validate_inputs(q, k, v, bad_pt, sl, plan=plan)
    # the kernel clamps the bad index instead of reading past the cache: finite output
    o = evenflow.decode_attention(q, k, v, bad_pt, sl, plan=plan)
    assert torch.isfinite(o.float()).all()
    long = torch.tensor([100, 64 * pt.shape[1] + 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        evenflow.attention.validate_inputs(q, k, v, pt, long, plan=None)
    with pytest.raises(ValueError, match="not updated"):
        evenflow.attention.validate_inputs(q, k, v, pt, torch.tensor([100, 65], dtype=torch.int32, device=device),
                                          plan=plan)
    for lens, what in (([-5, 64], r"seq_lens\[0\] = -5 outside \[0, "),  # negative
                       ([100, 300], r"seq_lens\[1\] = 300 outside \[0, 192\]")):  # 3 page columns of 64
        with pytest.raises(ValueError, match=what):
            evenflow.attention.validate_inputs(q, k, v, pt, torch.tensor(lens, dtype=torch.int32, device=device))
    small = evenflow.DecodePlan(2, 128, 2, device=device, num_programs=2, min_tiles=1)
    over = torch.tensor([100, 150], dtype=torch.int32, device=device)  # within the page table, over max_seq_len
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 150 outside \[0, 128\] .*plan max_seq_len"):
        evenflow.attention.validate_inputs(q, k, v, pt, over, plan=small.update(over))
    neg_pt = pt.clone()
    neg_pt[1, 0] = -7
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = -7 outside"):
        evenflow.attention.validate_inputs(q, k, v, neg_pt, sl)
    # a length under q_len cannot hold the request's new tokens (0 is an empty slot and passes)
    q2, _, k2, v2, pt2, _ = make_inputs([100, 64], 2, 2, 64, 64, 2, device=device)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 1 is under q_len 2"):
        evenflow.attention.validate_inputs(q2, k2, v2, pt2, torch.tensor([1, 64], dtype=torch.int32, device=device))
    evenflow.attention.validate_inputs(q2, k2, v2, pt2, torch.tensor([0, 64], dtype=torch.int32, device=device))


def test_check_inputs_in_the_call(device):
    """decode_attention(check_inputs=True) refuses what validate_inputs refuses, names the entry, and on good
    inputs gives the unchecked call's output bit for bit."""
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device, num_programs=2, min_tiles=1).update(sl)
    for p in (plan, None):
        checked = evenflow.decode_attention(q, k, v, pt, sl, plan=p, check_inputs=True)
        assert torch.equal(checked, evenflow.decode_attention(q, k, v, pt, sl, plan=p))
        check(q, qs, k, v, pt, sl, 1, plan=p, what="after a checked call")
    bad_pt = pt.clone()
    bad_pt[0, 1] = k.shape[0] + 5
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = \d+ outside \[0, \d+\) for a page in use"):
        evenflow.decode_attention(q, k, v, bad_pt, sl, plan=plan, check_inputs=True)
    unused = pt.clone()
    unused[1, 2] = -3  # past request 1's one page: never read, so not an error
    evenflow.decode_attention(q, k, v, unused, sl, plan=plan, check_inputs=True)
    over = torch.tensor([100, 64 * pt.shape[1] + 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 193 outside \[0, 192\]"):
        evenflow.decode_attention(q, k, v, pt, over, check_inputs=True)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -1 outside"):
        evenflow.decode_attention(q, k, v, pt, torch.tensor([-1, 64], dtype=torch.int32, device=device),
                                  check_inputs=True)
    other = torch.tensor([100, 65], dtype=torch.int32, device=device)  # another tensor, one tile more
    with pytest.raises(ValueError, match="not updated"):
        evenflow.decode_attention(q, k, v, pt, other, plan=plan, check_inputs=True)
    q2, _, k2, v2, pt2, _ = make_inputs([100, 64], 2, 2, 64, 64, 2, device=device)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 1 is under q_len 2"):
        evenflow.decode_attention(q2, k2, v2, pt2, torch.tensor([1, 64], dtype=torch.int32, device=device),
                                  check_inputs=True)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="check_inputs"):
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, check_inputs=bad)


def test_seq_lens_written_after_update_is_refused(device):
    """The tensor the last update read, written in place since, is refused with no sync (its version counter),
    even where the new lengths need the same tiles; an update after the write, or another tensor, is not."""
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device, num_programs=2, min_tiles=1).update(sl)
    assert not plan.written_since_update(sl)
    sl[0] += 1  # 101: the same two tiles
    assert plan.written_since_update(sl)
    with pytest.raises(ValueError, match="written in place after plan.update"):
        evenflow.decode_attention(q, k, v, pt, sl, plan=plan)
    with pytest.raises(ValueError, match="written in place after plan.update"):
        evenflow.attention.validate_inputs(q, k, v, pt, sl, plan=plan)
    check(q, qs, k, v, pt, sl, 1, plan=plan.update(sl), what="updated after the write")
    same = sl.clone()  # another tensor: the counter says nothing about it, the values agree
    assert not plan.written_since_update(same)
    check(q, qs, k, v, pt, same, 1, plan=plan, what="another tensor of the same lengths")
    with torch.inference_mode():  # inference tensors keep no version counter: only check_inputs can tell
        inf_sl = sl.clone()
        plan.update(inf_sl)
        inf_sl[1] = 130  # three tiles
        assert not plan.written_since_update(inf_sl)
        with pytest.raises(ValueError, match="not updated"):
            evenflow.decode_attention(q, k, v, pt, inf_sl, plan=plan, check_inputs=True)


def test_bad_arguments(device):
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device).update(sl)
    da = evenflow.decode_attention
    with pytest.raises(TypeError, match="q must have dtype"):
        da(q.float(), k, v, pt, sl, plan=plan)
    with pytest.raises(TypeError, match="page_table"):
        da(q, k, v, pt.long(), sl, plan=plan)
    with pytest.raises(ValueError, match="v_cache"):
        da(q, k, v[:, :32], pt, sl, plan=plan)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple 1..16 of the kv heads \(2\)"):
        da(q[:, :3], k, v, pt, sl, plan=plan)
    with pytest.raises(ValueError, match="q_scale is required"):
        da(q.to(FP8), k, v, pt, sl, plan=plan)
    with pytest.raises(ValueError, match="plan was built for 4 kv heads"):
        da(q, k, v, pt, sl, plan=evenflow.DecodePlan(2, 1000, 4, device=device).update(sl))
    with pytest.raises(ValueError, match="plan was last updated for batch 2, seq_lens has 1"):
        da(q[:1], k, v, pt[:1], sl[:1], plan=plan)
    with pytest.raises(ValueError, match="k_scale"):
        da(q, k, v, pt, sl, plan=plan, k_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 64\)"):
        da(q, k, v, pt, sl, plan=plan, out=torch.empty(2, 4, 32, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        da(q, k.transpose(2, 3), v.transpose(2, 3), pt, sl, plan=plan)
    with pytest.raises(TypeError, match="pdl"):
        evenflow.DecodePlan(2, 1000, 2, device=device, pdl=1)
    with pytest.raises(ValueError, match="combine must be one of"):
        evenflow.DecodePlan(2, 1000, 2, device=device, combine="both")
    for bad in (0, 3, 8):
        with pytest.raises(ValueError, match="gluon_warps must be one of"):
            evenflow.DecodePlan(2, 1000, 2, device=device, gluon_warps=bad)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="gluon_warps must be an int"):
            evenflow.DecodePlan(2, 1000, 2, device=device, gluon_warps=bad)
    with pytest.raises(TypeError, match="num_stages"):
        evenflow.DecodePlan(2, 1000, 2, device=device, num_stages="3")
    # which chunks the Gluon kernel's ring reads 2 tiles ahead: only on a plan for that kernel at two warps with 3
    # or more slots (0, every chunk the whole ring, is accepted anywhere: it changes nothing there)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="deep_ring_tiles=8 .*num_stages=2"):
        evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, num_stages=2, deep_ring_tiles=8)
    with pytest.raises(ValueError, match="deep_ring_tiles=8 .*kv_dtype=None"):
        evenflow.DecodePlan(2, 1000, 2, device=device, num_stages=3, deep_ring_tiles=8)
    with pytest.raises(ValueError, match="deep_ring_tiles=8 .*gluon=False"):
        evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, gluon=False, deep_ring_tiles=8)
    with pytest.raises(ValueError, match="deep_ring_tiles=8 .*gluon_warps=1"):
        evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, gluon_warps=1, num_stages=3, deep_ring_tiles=8)
    evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, num_stages=2, deep_ring_tiles=0)
    with pytest.raises(ValueError, match="deep_ring_tiles must be >= 0"):
        evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, deep_ring_tiles=-1)
    with pytest.raises(TypeError, match="deep_ring_tiles"):
        evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=fp8, deep_ring_tiles=8.0)
    # 4 ring slots (64 KB a program at one warp or two) leave an SM 3 programs: refused unless the program count is
    # given; no Gluon kernel, no refusal
    for warps in (1, 2):
        with pytest.raises(ValueError, match="num_stages=4: the Gluon kernel's 4 ring slots .* 3 programs"):
            evenflow.DecodePlan(2, 1000, 2, device=device, gluon_warps=warps, num_stages=4, kv_dtype=fp8)
    evenflow.DecodePlan(2, 1000, 2, device=device, gluon_warps=2, num_stages=4)
    if _runtime.interpreting():
        with pytest.raises(ValueError, match="pdl=True"):
            evenflow.DecodePlan(2, 1000, 2, device=device, pdl=True)


def test_what_would_overflow_the_kernels_int32_or_fp32_is_refused(device):
    """Round BX's audit found four inputs the kernels would compute wrongly: a cache whose heads lie 2^30 elements
    apart (heads outermost, [Hkv, pages, P, D] viewed as [pages, P, Hkv, D]: the in-page int32 offsets wrapped and
    decode and the prologue read / wrote out of bounds), a plan's max_seq_len whose tile count overflows int32
    (every program idle, the output left uninitialised), a score scale beyond fp32 (garbage out), and store_kv's
    strided slots (read as contiguous). Each now raises naming its argument; the same layout at 2 heads (the last
    head's offset 2^30, within int32) passes the check."""
    from evenflow.attention.decode import check_kv_cache
    from evenflow.attention.prologue import store_kv

    def cache(heads):  # strides only (meta): a real one is 2^30 x heads elements
        return torch.empty_strided((2, 64, heads, 64), (4096, 64, 2 ** 30, 1), dtype=torch.bfloat16, device="meta")

    with pytest.raises(ValueError, match=r"k_cache: strides \(4096, 64, 1073741824, 1\) put a page's rows up to "
                                         r"2147487743 elements apart.*int32"):
        check_kv_cache(cache(3), cache(3), torch.device("meta"))
    assert check_kv_cache(cache(2), cache(2), torch.device("meta")) == (2, 64, 2, 64)
    with pytest.raises(ValueError, match="max_seq_len must be <= 2147483584"):
        evenflow.DecodePlan(3, 2 ** 31 - 1, 1, device=device)
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    for kw in (dict(sm_scale=1e37), dict(sm_scale=1e20, k_scale=1e20), dict(sm_scale=2840.0)):  # 2840 x 1.4427 > 2^12
        with pytest.raises(ValueError, match=r"is beyond 2\^12"):
            evenflow.decode_attention(q, k, v, pt, sl, **kw)
    with pytest.raises(ValueError, match=r"is beyond 2\^12"):
        evenflow.prefill_attention(q, k, v, torch.tensor([0, 1, 2], dtype=torch.int32, device=device), pt, sl, 1,
                                   sm_scale=1e37)
    slots = torch.tensor([[5, -1], [17, -1]], device=device)[:, 0]
    with pytest.raises(ValueError, match="slots must be contiguous"):
        store_kv(q[:, :2].float(), q[:, :2].float(), k, v, slots)


def test_scales_the_kernels_take_as_fp32_are_checked_as_fp32(device):
    """Round CK's review of the launchers' number checks: a float scale outside fp32's normal range (0 or subnormal
    in fp32, which the GPU flushes to 0, or inf there) and a score multiplier over 2^12 (decode.MAX_SCORE_MULTIPLIER
    derives it; sm_scale=1e37 had given a wrong output with no error) are refused by name; scale tensors, which
    the launchers cannot read without a sync, are checked the same way under check_inputs=True, in decode and in
    prefill (a NaN k_scale tensor had given zeros, an empty request's output, and a negative one inverted attention,
    with no error). Good tensor scales under the check still run; the next test runs scores at the bound."""
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    calls = {"decode": lambda **kw: evenflow.decode_attention(q, k, v, pt, sl, **kw),
             "prefill": lambda **kw: evenflow.prefill_attention(q, k, v, cu, pt, sl, 1, **kw)}

    def t(x):
        return torch.tensor([x], dtype=torch.float32, device=device)

    fp32_range = "must be a finite positive number in fp32's normal range"
    for op, call in calls.items():
        for bad in (1e-50, 3e-39, 1e39, 10 ** 400):
            with pytest.raises(ValueError, match=f"k_scale {fp32_range}"):
                call(k_scale=bad)
            with pytest.raises(ValueError, match=f"v_scale {fp32_range}"):
                call(v_scale=bad)
        for name in ("k_scale", "v_scale"):
            for bad in (float("nan"), float("inf"), -1.0, 0.0, 1e-40):
                with pytest.raises(ValueError, match=f"{name} {fp32_range}"):
                    call(**{name: t(bad)}, check_inputs=True)
        with pytest.raises(ValueError, match=r"is beyond 2\^12"):  # 1e30 x 1/8 x log2(e): a tensor's, checked
            call(k_scale=t(1e30), check_inputs=True)
        out = call(k_scale=t(0.5), v_scale=t(2.0), check_inputs=True)
        assert torch.isfinite(out.float()).all(), op


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_scores_at_the_multiplier_bound_give_the_reference(kv, device):
    """decode.MAX_SCORE_MULTIPLIER's promise, where it matters, on the GPU: there prefill's exp2(score - max) is one
    fma of q . k, the multiplier and the max, so a row's largest weight is 2^r with r the rounding residual of its
    fp32 score, |r| <= half an ulp (round CK's bound of 2^64 gave NaN on an H100 at a multiplier of 1.44 x 2^60 and
    |score| ~ 2^63: r overflowed exp2; CL3's probe put the edge between 2^29 and 2^30 with an fp8 cache). At 0.9 of
    the bound, q scaled so that the largest |score| is 2^27 (|r| <= 8, an fp8 cache's f16 weights included), decode
    and prefill give the fp64 reference: one key per row outweighs the rest by far, so the output is that key's V,
    off by the largest weight's rounding to the P . V operand's type (2^-9 relative with bf16 weights; fp8 V's
    reference rounds as ours) and the output's bf16 rounding (2^-9): |out - ref| <= (2^-8 + 2^-18) x max|V| (the
    interpreter and the decode kernels round the score first, so there the largest weight is 1)."""
    from evenflow.attention.decode import MAX_SCORE_MULTIPLIER
    from evenflow.reference.attention import prefill_attention_ref
    fp8 = kv == "fp8"
    q, _, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, FP8 if fp8 else torch.bfloat16, device=device)
    k_scale, v_scale = (1 / 30, 1 / 40) if fp8 else (None, None)
    # 0.9 of the bound: a multiplier with a full mantissa (a power of two would make the product exact, r = 0)
    multiplier = 0.9 * MAX_SCORE_MULTIPLIER
    sm_scale = multiplier / math.log2(math.e) / (k_scale or 1.0)
    # the largest |q . k| over every key the kernels may read (k as the kernels multiply it: fp8 values unscaled)
    qk_max = (q.double().flatten(0, 1) @ k.double().flatten(0, 2).t()).abs().max().item()
    q = (q.double() * (2.0 ** 27 / multiplier / qk_max) * 0.99).to(torch.bfloat16)
    kw = dict(k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    v_max = v.double().abs().max().item() * (v_scale or 1.0)
    for op, out, ref in (
            ("decode", evenflow.decode_attention(q, k, v, pt, sl, **kw),
             decode_attention_ref(q, k, v, pt, sl, **kw)[0]),
            ("prefill", evenflow.prefill_attention(q, k, v, cu, pt, sl, 1, **kw),
             prefill_attention_ref(q, k, v, cu, pt, sl, **kw)[0])):
        assert torch.isfinite(out.float()).all(), op
        err = (out.double().cpu() - ref.double().cpu()).abs().max().item()
        assert err <= (2.0 ** -8 + 2.0 ** -18) * v_max, f"{op}: max abs error {err:.3e} against the fp64 reference"


def test_every_argument_check_names_its_argument(device):
    """Each of decode_attention's host-side checks not covered above raises the right error naming the argument."""
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device).update(sl)
    da = evenflow.decode_attention
    cases = [  # (error, message pattern, call)
        (ValueError, r"k_scale must be a finite positive number in fp32's normal range \[1.175e-38, 3.403e\+38\], "
                     "got 0.0", lambda: da(q, k, v, pt, sl, k_scale=0.0)),
        (ValueError, "v_scale must be a finite positive number in fp32's normal range .*got nan",
         lambda: da(q, k, v, pt, sl, v_scale=float("nan"))),
        (TypeError, "k_scale must be a float or a float32 tensor", lambda: da(q, k, v, pt, sl, k_scale="1")),
        (TypeError, "v_scale must have dtype in", lambda: da(q, k, v, pt, sl, v_scale=torch.ones(
            1, dtype=torch.float64, device=device))),
        (ValueError, r"v_scale must hold one element", lambda: da(q, k, v, pt, sl, v_scale=torch.ones(
            2, device=device))),
        (ValueError, r"page size \(dim 1\) must be one of \[16, 32, 64, 128\], got 8",
         lambda: da(q, k[:, :8], v[:, :8], pt, sl)),
        (ValueError, r"head_dim must be one of \[64, 128, 256\], got 32",
         lambda: da(q[..., :32], k[..., :32], v[..., :32], pt, sl)),
        (ValueError, "q head_dim 32 != k_cache head_dim 64", lambda: da(q[..., :32], k, v, pt, sl)),
        (TypeError, "plan must be a DecodePlan or None, got str", lambda: da(q, k, v, pt, sl, plan="plan")),
        (ValueError, "plan was built for page_size 32, k_cache pages hold 64",
         lambda: da(q, k, v, pt, sl, plan=evenflow.DecodePlan(2, 1000, 2, page_size=32, device=device).update(sl))),
        (ValueError, r"call plan.update\(seq_lens\) before decode_attention",
         lambda: da(q, k, v, pt, sl, plan=evenflow.DecodePlan(2, 1000, 2, device=device))),
        (ValueError, r"q rows \(3\) must be q_len \* batch", lambda: da(torch.cat([q, q[:1]]), k, v, pt, sl)),
        (ValueError, "q_scale is only used with an fp8 q", lambda: da(q, k, v, pt, sl, q_scale=torch.ones(
            2, 4, device=device))),
        (ValueError, r"q_scale must have shape \(2, 4\)", lambda: da(q.to(FP8), k, v, pt, sl, q_scale=torch.ones(
            2, 3, device=device))),
        (TypeError, "sm_scale must be a float, got str", lambda: da(q, k, v, pt, sl, sm_scale="0.1")),
        (ValueError, "sm_scale must be finite, got inf", lambda: da(q, k, v, pt, sl, sm_scale=float("inf"))),
        (ValueError, "sm_scale must be finite", lambda: da(q, k, v, pt, sl, sm_scale=10**400)),
        (TypeError, "out must have dtype in", lambda: da(q, k, v, pt, sl, out=torch.empty(
            2, 4, 64, device=device))),
        (TypeError, "return_lse must be a bool, got 1", lambda: da(q, k, v, pt, sl, return_lse=1)),
        (ValueError, r"lse must have shape \(2, 4\)", lambda: da(q, k, v, pt, sl, return_lse=True, lse=torch.empty(
            2, 3, device=device))),
        (ValueError, "lse is given but return_lse is False", lambda: da(q, k, v, pt, sl, lse=torch.empty(
            2, 4, device=device))),
        (ValueError, "page_table must have 2 rows", lambda: da(q, k, v, pt[:1], sl)),
        (ValueError, r"sm_scale must be > 0, got 0.0", lambda: da(q, k, v, pt, sl, sm_scale=0.0)),
        (ValueError, r"sm_scale must be > 0, got -1.0", lambda: da(q, k, v, pt, sl, sm_scale=-1.0)),
        (ValueError, r"seq_lens is empty \(batch 0\)", lambda: da(q[:0], k, v, pt[:0], sl[:0])),
        (ValueError, "out must be contiguous", lambda: da(q, k, v, pt, sl, out=torch.empty(
            2, 64, 4, dtype=torch.bfloat16, device=device).transpose(1, 2))),
        (ValueError, "k_cache is on meta", lambda: da(q, k.to("meta"), v, pt, sl)),
        (ValueError, "page_table is on meta", lambda: da(q, k, v, pt.to("meta"), sl)),
        (ValueError, "seq_lens is on meta", lambda: da(q, k, v, pt, sl.to("meta"))),
        (TypeError, "seq_lens must have dtype", lambda: da(q, k, v, pt, sl.long())),
        (TypeError, "v_cache must have dtype", lambda: da(q, k, v.to(FP8), pt, sl)),
        (ValueError, "q must be 3-D", lambda: da(q[0], k, v, pt, sl)),
        (ValueError, "q_scale is on meta", lambda: da(q.to(FP8), k, v, pt, sl, q_scale=torch.ones(
            2, 4, device="meta"))),
        (ValueError, "k_scale is on meta", lambda: da(q, k, v, pt, sl, k_scale=torch.ones(1, device="meta"))),
        (ValueError, "q rows \\(2\\) must be q_len \\* batch|q must have batch \\* q_len",
         lambda: da(q, k, v, pt, sl, plan=evenflow.DecodePlan(2, 1000, 2, q_len=2, device=device).update(sl))),
    ]
    for err, pattern, call in cases:
        with pytest.raises(err, match=pattern):
            call()
    # the same call with good arguments runs (the checks above fail on their argument alone)
    out, lse = da(q, k, v, pt, sl, plan=plan, k_scale=0.5, v_scale=torch.ones(1, device=device), return_lse=True)
    assert out.shape == (2, 4, 64) and lse.shape == (2, 4)


def test_opcheck(device):
    q, qs, k, v, pt, sl = make_inputs([70, 0], 1, 2, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 1, device=device, num_programs=2, min_tiles=1).update(sl)
    po, pl, pg = plan.partials(2, 64)
    out = torch.empty(2, 2, 64, dtype=torch.bfloat16, device=device)
    lse = torch.empty(2, 2, device=device)
    for stamps in (None, plan.record_timeline()):  # the default build, and the timeline build's extra output
        args = (q, k, v, pt, sl, plan.tiles, plan.req_end, plan.prog_start, plan.meta, po, pl, pg, plan.combine_count,
                plan.group_count, out, lse, stamps,
                None, None, None, 1.0, 1.0, 1 / math.sqrt(64), 1, 0, min(1000, pt.shape[1] * 64))  # as the call caps it
        torch.library.opcheck(torch.ops.evenflow.decode_attention.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_batched_reference_matches_simple_reference():
    """The GPU tests use the request-batched oracle; it must equal the simple one."""
    q, qs, k, v, pt, sl = make_inputs([70, 0, 3, 130], 2, 3, 64, 16, 3, kv_dtype=FP8, q_dtype=FP8)
    from evenflow.reference.attention import decode_attention_ref_batched

    kw = dict(q_scale=qs, k_scale=0.5, v_scale=torch.tensor([0.25]), sm_scale=0.2, q_len=3)
    a, al = decode_attention_ref(q, k, v, pt, sl, **kw)
    b, bl = decode_attention_ref_batched(q, k, v, pt, sl, **kw)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bl, al, rtol=1e-12, atol=1e-12)


def test_fp8_score_baseline_takes_each_rows_head_and_scales():
    """The warpgroup form's baseline (``fp8_scores=True``: the scores from ``reference.moe.fast_mm``, then q's per
    row, k's and the softmax scales) computes the same attention as the plain fp32 baseline where the fp8 GEMM is
    exact (on the CPU: exact products, fp32 sums): GQA 3, q_len 3, a scale per token and head, a tensor k scale. A
    head, row or scale taken wrong moves it by O(1); the two sum orders differ by fp32 rounding."""
    q, qs, k, v, pt, sl = make_inputs([70, 0, 3, 130], 2, 3, 64, 16, 3, kv_dtype=FP8, q_dtype=FP8)
    from evenflow.reference.attention import decode_attention_ref_batched

    assert qs.unique().numel() > qs.shape[1]  # scales differ between tokens and between heads
    kw = dict(q_scale=qs, k_scale=torch.tensor([0.5]), v_scale=0.25, sm_scale=0.2, q_len=3, dtype=torch.float32)
    ref, ref_lse = decode_attention_ref_batched(q, k, v, pt, sl, **{**kw, "dtype": torch.float64})
    plain, plain_lse = decode_attention_ref_batched(q, k, v, pt, sl, **kw)
    fp8, fp8_lse = decode_attention_ref_batched(q, k, v, pt, sl, fp8_scores=True, **kw)
    live = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(fp8_lse), ~live)
    for got, base, want in ((fp8, plain, ref), (fp8_lse[live], plain_lse[live], ref_lse[live])):
        err, base_err = (got.double() - want).abs().max().item(), (base.double() - want).abs().max().item()
        assert err <= 4 * base_err + 1e-6 * want.abs().max().item(), (err, base_err)
    with pytest.raises(ValueError, match="fp8_scores needs an e4m3 q and cache"):
        decode_attention_ref_batched(q.float(), k, v, pt, sl, fp8_scores=True, **kw)


def test_demo_runs_at_tiny_shapes(device):
    import types

    from evenflow.attention.demo import run_demo

    rows = run_demo(types.SimpleNamespace(device=device, gpu=False, harness=None))
    assert rows and all(r["ok"] for r in rows), rows


def test_compiled_calls_go_through_the_custom_ops(device):
    """Eager calls launch directly (torch.library dispatch costs tens of us on the host);
    under torch.compile the plan update and the attention must still be custom ops in the
    graph, with the same result as eager."""
    q, qs, k, v, pt, sl = make_inputs([300, 70, 0], 2, 4, 64, 64, 1, device=device)
    plan = evenflow.DecodePlan(3, 1 << 12, 2, device=device, num_programs=4, min_tiles=1)
    eager = evenflow.decode_attention(q, k, v, pt, sl, plan=plan.update(sl))
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def step(q, sl):
        plan.update(sl)
        return evenflow.decode_attention(q, k, v, pt, sl, plan=plan)

    got = step(q, sl)
    assert any("evenflow.decode_plan_update" in t for t in seen), seen
    assert any("evenflow.decode_attention" in t for t in seen), seen
    assert torch.equal(got, eager)


# A plan built for an fp8 cache (DecodePlan(kv_dtype=FP8)): on a GPU (sm_89+) the Gluon
# kernel where it applies (bf16 q, d128, page 64 / 128, GQA group x q_len <= 16), with the combine
# kernel merging split items; elsewhere (and in the interpreter) the Triton kernel on the same bins.
GLUON_CASES = {
    # lens, hkv, group, page, q_len, num_programs
    "g8-p64-skewed": ([700, 64, 0, 65, 130, 1], 2, 8, 64, 1, 5),
    "g8-one-kv-head-62-chunks": ([64 * 60 + 17, 100, 0], 1, 8, 64, 1, 70),
    "g16-q1-p128": ([300, 129, 0, 64], 2, 16, 128, 1, 3),
    "g4-q4-p128": ([257, 4, 0, 190], 2, 4, 128, 4, 4),
    "g1-q2": ([63, 64, 65, 1], 3, 1, 64, 2, 4),
    "g2-q3-p64-tile-edges": ([128, 129, 191, 192, 193], 1, 2, 64, 3, 6),
}


@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_plan_for_an_fp8_cache(name, device):
    from evenflow.attention.decode import gluon_fp8_supported

    lens, hkv, group, page, q_len, np_ = GLUON_CASES[name]
    q, qs, k, v, pt, sl = make_inputs(lens, hkv, group, 128, page, q_len, FP8, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 16, hkv, page_size=page, q_len=q_len, device=device,
                               num_programs=np_, min_tiles=1, kv_dtype=FP8, gluon=True).update(sl)
    # the path the call takes: Gluon on a GPU (gluon=True: at one KV head too), the Triton kernel in the interpreter
    assert gluon_fp8_supported(q, k, plan, group * q_len) == (device == "cuda")
    for ks, vs in ((0.05, torch.tensor([0.025], device=device)), (torch.tensor([0.03], device=device), None)):
        check(q, qs, k, v, pt, sl, q_len, plan=plan, k_scale=ks, v_scale=vs, what=f"{name} ks={ks} vs={vs}")


def test_plan_for_an_fp8_cache_outside_the_gluon_scope_runs_the_triton_kernel(device, monkeypatch):
    from evenflow.attention import decode
    from evenflow.attention.decode import gluon_fp8_supported
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM

    monkeypatch.setattr(decode, "GLUON_FP8_Q", False)  # the switch off: an fp8 q runs the Triton kernel
    gluon_here = decode.gluon_fp8_machine_refusal(device) is None  # where a Gluon kernel could run at all
    for d, page, qdt in ((64, 64, torch.bfloat16), (128, 16, torch.bfloat16), (128, 64, FP8)):
        lens = [300, 5, 0]
        q, qs, k, v, pt, sl = make_inputs(lens, 2, 4, d, page, 1, FP8, qdt, device=device)
        # the interpreter: 4 programs (1 an SM of its 4); a GPU: the plan's default, 4 an SM
        plan = evenflow.DecodePlan(3, 1 << 12, 2, page_size=page, device=device,
                                   num_programs=4 if device == "cpu" else None, min_tiles=1, kv_dtype=FP8).update(sl)
        assert not gluon_fp8_supported(q, k, plan, 4)
        assert plan.takes_gluon == (page != 16)  # a page of 16 tokens: a plan for the Triton kernel
        # a plan built for the Gluon kernel at more programs an SM than the Triton kernel holds says once that this
        # call runs the Triton one (the interpreter runs no Gluon: nothing to say)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            check(q, qs, k, v, pt, sl, 1, plan=plan, k_scale=0.05, v_scale=0.025, what=f"d{d} p{page} {qdt}")
            check(q, qs, k, v, pt, sl, 1, plan=plan, k_scale=0.05, v_scale=0.025, what=f"d{d} p{page} {qdt} again")
        said = [str(w.message) for w in said if "built for the Gluon fp8 kernel" in str(w.message)]
        want = gluon_here and plan.takes_gluon and plan.per_sm > DEFAULT_PROGRAMS_PER_SM
        assert len(said) == want and all("gluon=False" in m for m in said), said
    # one KV head, two warps: the plan holds 2 programs an SM (round AU), as many as the Triton kernel, so a call the
    # Gluon kernel does not take (here an fp8 q with the switch off) runs the plan's bins in one round, unsaid
    q, qs, k, v, pt, sl = make_inputs([300, 5, 0], 1, 4, 128, 64, 1, FP8, FP8, device=device)
    plan = evenflow.DecodePlan(3, 1 << 12, 1, device=device, min_tiles=1, kv_dtype=FP8).update(sl)
    assert plan.takes_gluon and plan.per_sm == DEFAULT_PROGRAMS_PER_SM and plan.triton_programs == plan.num_programs
    assert not gluon_fp8_supported(q, k, plan, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check(q, qs, k, v, pt, sl, 1, plan=plan, k_scale=0.05, v_scale=0.025, what="one KV head, fp8 q, Triton")
    # a Triton launch option or a one-slot ring keeps the Triton kernel too
    q, qs, k, v, pt, sl = make_inputs([300, 5, 0], 2, 4, 128, 64, 1, FP8, device=device)
    sms = _runtime.num_sms(torch.device(device))
    for kw in (dict(num_warps=4), dict(warp_split=False), dict(num_stages=1), dict(block_n=64),
               dict(max_registers=168)):
        plan = evenflow.DecodePlan(3, 1 << 12, 2, device=device, num_programs=4, min_tiles=1, kv_dtype=FP8,
                                   **kw).update(sl)
        assert not gluon_fp8_supported(q, k, plan, 4), kw
        # such a plan is built for the Triton kernel (its default program count), and gluon=True is refused by name
        assert not plan.takes_gluon and evenflow.DecodePlan(3, 1 << 12, 2, device=device, kv_dtype=FP8,
                                                            **kw).num_programs == DEFAULT_PROGRAMS_PER_SM * sms, kw
        with pytest.raises(ValueError, match=f"gluon=True.*{next(iter(kw))}"):
            evenflow.DecodePlan(3, 1 << 12, 2, device=device, kv_dtype=FP8, gluon=True, **kw)
    plan = evenflow.DecodePlan(3, 1 << 12, 2, device=device, num_programs=4, min_tiles=1).update(sl)
    assert not gluon_fp8_supported(q, k, plan, 4)  # no kv_dtype given: the Triton kernel, as before


def test_fp8_plan_told_its_calls_shape_is_built_for_the_kernel_that_runs_them(device):
    """Round AP: a plan given ``head_dim`` / ``num_q_heads`` outside the Gluon kernel's scope (head_dim other than
    128, GQA group x q_len over 16) is built for the Triton kernel from the start: its default program count, no
    warning, the output right; inside the scope the hints change nothing. ``gluon=True`` with such a shape and calls
    of another shape are refused by name."""
    from evenflow.attention.plan import (
        DEFAULT_PROGRAMS_PER_SM,
        GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM,
        GLUON_FP8_PROGRAMS_PER_SM,
    )

    sms = _runtime.num_sms(torch.device(device))
    for hkv, hq, d, q_len, gluon_shape in ((2, 4, 64, 1, False), (2, 4, 256, 1, False), (2, 32, 128, 2, False),
                                           (2, 32, 128, 1, True), (2, 16, 128, 4, False), (1, 4, 128, 4, True),
                                           (2, 4, 128, 1, True)):
        kw = dict(q_len=q_len, device=device, kv_dtype=FP8)
        told = evenflow.DecodePlan(3, 1 << 12, hkv, num_q_heads=hq, head_dim=d, **kw)
        assert told.takes_gluon == gluon_shape, (hkv, hq, d, q_len)
        pps = DEFAULT_PROGRAMS_PER_SM if not gluon_shape else (
            GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM if hkv == 1 else GLUON_FP8_PROGRAMS_PER_SM)
        assert told.num_programs == pps * sms, (hkv, hq, d, q_len)
        assert told.triton_programs == min(told.num_programs, DEFAULT_PROGRAMS_PER_SM * sms)
        assert f"num_q_heads={hq}, head_dim={d}" in repr(told)
        assert evenflow.DecodePlan(3, 1 << 12, hkv, **kw).takes_gluon  # not told: sized for the Gluon kernel
        if not gluon_shape:
            named = f"head_dim={d}" if d != 128 else f"num_q_heads={hq} .GQA group x q_len"
            with pytest.raises(ValueError, match="gluon=True.*" + named):
                evenflow.DecodePlan(3, 1 << 12, hkv, num_q_heads=hq, head_dim=d, gluon=True, **kw)
            # the Gluon kernel's read-ahead knob on such a plan names the told shape as the reason
            with pytest.raises(ValueError, match="deep_ring_tiles=16 .*no told shape outside.*" + named):
                evenflow.DecodePlan(3, 1 << 12, hkv, num_q_heads=hq, head_dim=d, deep_ring_tiles=16, **kw)
    # the calls on such a plan: right, and silent (it is the Triton kernel's own plan; the warning can only come on a
    # GPU, where a Gluon-sized plan would run the Triton kernel: the interpreter runs no Gluon kernel at all)
    for d, group, q_len in ((64, 2, 1), (128, 16, 2)):
        lens = [300, 5, 0, 70]
        q, qs, k, v, pt, sl = make_inputs(lens, 2, group, d, 64, q_len, FP8, device=device)
        plan = evenflow.DecodePlan(4, 1 << 12, 2, q_len=q_len, device=device, min_tiles=1, kv_dtype=FP8,
                                   num_q_heads=2 * group, head_dim=d).update(sl)
        assert not plan.takes_gluon
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            check(q, qs, k, v, pt, sl, q_len, plan=plan, k_scale=0.05, v_scale=0.025, what=f"told d{d} g{group}")
    # calls of another shape than the plan was told (bad values of the keywords: test_plan.py's argument table)
    q, qs, k, v, pt, sl = make_inputs([300, 5], 2, 4, 128, 64, 1, FP8, device=device)
    for told, match in ((dict(num_q_heads=16), "plan was built for num_q_heads=16, q has 8 heads"),
                        (dict(head_dim=64), "plan was built for head_dim=64, k_cache has head_dim 128")):
        plan = evenflow.DecodePlan(2, 1 << 12, 2, device=device, **told).update(sl)
        with pytest.raises(ValueError, match=match):
            evenflow.decode_attention(q, k, v, pt, sl, plan=plan, k_scale=0.05, v_scale=0.025)


# Every plan value a launch of the Gluon kernel reads, but its warps: two plans that agree on them launch the same
# program for a call that takes the same form on both.
PLAN_LAUNCH_VALUES = ("takes_gluon", "num_programs", "per_sm", "triton_programs", "gluon_stages", "deep_ring_tiles",
                      "resident_pad", "min_pad", "bin_stride", "merge_chunks", "wg_merge_chunks", "wg_max_regs",
                      "warpgroup_mma", "min_tiles", "item_cost", "align_items", "align_longer", "align_growth",
                      "align_longer_growth", "combine", "prefetch", "pdl", "early_reads", "resident_cap", "spread_bins",
                      "launch_next")


def test_one_kv_head_fp8_plan_takes_four_warps_with_the_two_warp_default_program_for_other_calls(device):
    """Round AW: an fp8 plan for the Gluon kernel at one KV head takes four warps unless told (``gluon_warps=None``):
    its fp8-q calls run the warpgroup form, merging ``wg_merge_chunks`` (8) chunks a round trip, its other calls the
    two-warp default's program on the same bins (every plan value a launch reads equal to a ``gluon_warps=2`` plan's,
    the 12-chunk merge included). Not where the plan is told more than 8 q rows a KV head, 2 ring slots, more KV
    heads, another page size or no fp8 cache; ``merge_chunks=`` sets both batches."""
    from evenflow.attention.plan import GLUON_FP8_WG_ROWS, GLUON_WG_MERGE_CHUNKS

    sms = _runtime.num_sms(torch.device(device))
    plan = evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8)
    two = evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8, gluon_warps=2)
    assert (plan.gluon_warps, plan.warpgroup_mma, plan.merge_chunks, plan.wg_merge_chunks) == (4, True, 12, 8)
    assert GLUON_WG_MERGE_CHUNKS == 8 and GLUON_FP8_WG_ROWS == 8 and "wg_merge_chunks=8" in repr(plan)
    for name in PLAN_LAUNCH_VALUES:
        assert getattr(plan, name) == getattr(two, name), name
    # told 8 q rows a KV head (GQA 8, or 4 x q_len 2): four; told 16: two
    assert evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8, num_q_heads=8).gluon_warps == 4
    assert evenflow.DecodePlan(4, 1000, 1, q_len=2, device=device, kv_dtype=FP8, num_q_heads=4).gluon_warps == 4
    assert evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8, num_q_heads=16).gluon_warps == 2
    assert evenflow.DecodePlan(4, 1000, 1, q_len=2, device=device, kv_dtype=FP8, num_q_heads=8).gluon_warps == 2
    # another ring than the default 3 slots (deeper rings were measured at two warps, round AV3): two
    for kw in (dict(kv_dtype=FP8, num_stages=2, num_programs=2 * sms), dict(kv_dtype=FP8, num_stages=4),
               dict(kv_dtype=FP8, gluon=False),
               dict(kv_dtype=FP8, page_size=32), dict(kv_dtype=torch.bfloat16), dict(),
               dict(kv_dtype=FP8, head_dim=64)):
        plan = evenflow.DecodePlan(4, 1000, 1, device=device, **kw)
        assert plan.gluon_warps == 2, kw
    for hkv in (2, 8):
        assert evenflow.DecodePlan(4, 1000, hkv, device=device, kv_dtype=FP8).gluon_warps == 2, hkv
    # the mma.sync form stays opt-in: warpgroup_mma=False still needs gluon_warps=4
    with pytest.raises(ValueError, match=r"warpgroup_mma=False .*needs gluon_warps=4.*got gluon_warps=None \(2\)"):
        evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8, warpgroup_mma=False)
    # merge_chunks given: every call's batch; the explicit warpgroup plan's two-warp calls take the two-warp default's
    for m in (8, 12):
        plan = evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8, merge_chunks=m)
        assert (plan.merge_chunks, plan.wg_merge_chunks) == (m, m)
    plan = evenflow.DecodePlan(4, 1000, 8, device=device, kv_dtype=FP8, gluon_warps=4)
    assert (plan.merge_chunks, plan.wg_merge_chunks) == (12, 8)
    # the warpgroup form's register cap, once a plan: none at 2 programs an SM, 128 at 4 (16 warps an SM); 0 on
    # plans without the form
    assert evenflow.DecodePlan(4, 1000, 1, device=device, kv_dtype=FP8).wg_max_regs == 0
    assert plan.wg_max_regs == (128 if plan.per_sm == 4 else 0), plan.per_sm
    assert evenflow.DecodePlan(4, 1000, 8, device=device, kv_dtype=FP8).wg_max_regs == 0
    plan = evenflow.DecodePlan(4, 1000, 8, device=device, kv_dtype=FP8, gluon_warps=4, warpgroup_mma=False)
    assert plan.merge_chunks == 8


def test_fp8_plan_takes_the_gluon_kernel_by_kv_heads_and_warps(device):
    """An fp8 plan is built for the Gluon kernel (4 programs an SM; at one KV head and two warps 2, round AU) at any
    KV-head count at 2 warps a program (the default, round AL2), from 2 KV heads at 1 (round AF5: at one KV head, the
    TP8 slice of most GQA models, the Triton kernel at 2 an SM), unless ``gluon=True``; ``gluon=False`` never; a bf16
    plan never. Bad values are refused by name."""
    from evenflow.attention.plan import (
        DEFAULT_PROGRAMS_PER_SM,
        GLUON_FP8_DEEP_TILES,
        GLUON_FP8_MIN_KV_HEADS,
        GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM,
        GLUON_FP8_PROGRAMS_PER_SM,
    )

    assert GLUON_FP8_MIN_KV_HEADS == {1: 2, 2: 1, 4: 1}
    sms = _runtime.num_sms(torch.device(device))
    for hkv, kv, gluon, warps, want in ((1, FP8, None, 1, False), (2, FP8, None, 1, True), (8, FP8, None, 1, True),
                                        (1, FP8, None, None, True), (1, FP8, None, 2, True), (1, FP8, None, 4, True),
                                        (1, FP8, True, 1, True), (8, FP8, False, None, False),
                                        (1, None, True, None, False), (8, torch.bfloat16, True, None, False)):
        plan = evenflow.DecodePlan(2, 100, hkv, device=device, kv_dtype=kv, gluon=gluon, gluon_warps=warps)
        assert plan.takes_gluon == want, (hkv, kv, gluon, warps)
        pps = DEFAULT_PROGRAMS_PER_SM if not want else (
            GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM if hkv == 1 and (warps or 2) in (2, 4) else GLUON_FP8_PROGRAMS_PER_SM)
        assert plan.num_programs == pps * sms and f"gluon={gluon}" in repr(plan), (hkv, kv, gluon)
        assert plan.per_sm == pps, (hkv, warps, plan.per_sm)
        # not given: four warps on a Gluon plan at one KV head (round AW), else two
        assert f"gluon_warps={warps or (4 if want and hkv == 1 else 2)}" in repr(plan), repr(plan)
    # one KV head, the default four warps (the warpgroup form for fp8-q calls, two warps for the others): 2 programs
    # an SM, each padded from 3 ring slots to 5 (81 KB: two fit an SM's 228 KB, a third launched early by the next
    # call does not)
    plan = evenflow.DecodePlan(2, 100, 1, device=device, kv_dtype=FP8)
    assert (plan.per_sm, plan.gluon_stages, plan.resident_pad) == (2, 3, 2) and GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM == 2
    assert plan.gluon_warps == 4 and plan.warpgroup_mma
    assert evenflow.DecodePlan(2, 100, 1, device=device, kv_dtype=FP8, num_programs=4 * sms).per_sm == 4
    # the default: two warps beside 3 ring slots, their outputs meeting in the idle ring (48 KB a program, no pad),
    # chunks of at most 16 tiles reading 2 tiles ahead; two warps beside 2 slots and a 16 KB output buffer (48 KB, no
    # pad); one warp beside 2 slots (round AB's best), whose unused slot pads it to 49 KB, one tile loop
    sms4 = GLUON_FP8_PROGRAMS_PER_SM
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8)
    assert (plan.gluon_warps, plan.gluon_stages, plan.deep_ring_tiles, plan.resident_pad, plan.per_sm) == \
        (2, 3, GLUON_FP8_DEEP_TILES, 0, sms4) and GLUON_FP8_DEEP_TILES == 16 and sms4 == 4
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, num_stages=2)
    assert (plan.gluon_warps, plan.gluon_stages, plan.deep_ring_tiles, plan.resident_pad) == (2, 2, 0, 0)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=1)
    assert (plan.gluon_warps, plan.gluon_stages, plan.deep_ring_tiles, plan.resident_pad) == (1, 2, 0, 1)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=1, num_stages=3)
    assert (plan.gluon_stages, plan.deep_ring_tiles, plan.resident_pad) == (3, 0, 0)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, num_stages=4, num_programs=3 * sms)
    assert (plan.gluon_warps, plan.gluon_stages, plan.deep_ring_tiles, plan.per_sm) == (2, 4, 16, 3)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, deep_ring_tiles=0)
    assert (plan.gluon_warps, plan.deep_ring_tiles) == (2, 0) and "deep_ring_tiles=0" in repr(plan)
    # the fused merge's batch (round AR): 12 chunks only where the Gluon kernel's ring holds them (3 or more slots);
    # by default (round AS) on two-warp plans there, 8 everywhere else
    assert evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, merge_chunks=12).merge_chunks == 12
    assert evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, merge_chunks=8).merge_chunks == 8
    assert "merge_chunks=12" in repr(evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8))
    assert evenflow.DecodePlan(2, 100, 1, device=device, kv_dtype=FP8, gluon=True).merge_chunks == 12
    assert evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, num_stages=4,
                               num_programs=3 * sms).merge_chunks == 12  # two warps, 4 slots
    assert evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=1,
                               num_stages=3).merge_chunks == 8  # one warp: 12 allowed, not the default
    for kw in (dict(), dict(kv_dtype=torch.bfloat16), dict(kv_dtype=FP8, gluon_warps=1),
               dict(kv_dtype=FP8, num_stages=2), dict(kv_dtype=FP8, gluon=False),
               dict(kv_dtype=FP8, combine="kernel"), dict(kv_dtype=FP8, page_size=32),
               dict(kv_dtype=FP8, head_dim=64), dict(kv_dtype=FP8, num_warps=4)):
        assert evenflow.DecodePlan(2, 100, 8, device=device, **kw).merge_chunks == 8, kw
    for kw, named in ((dict(kv_dtype=FP8, num_stages=2), "num_stages=2 .2 slots."),
                      (dict(kv_dtype=FP8, gluon=False), "gluon=False"), (dict(), "kv_dtype=None"),
                      (dict(kv_dtype=FP8, gluon_warps=1), "gluon_warps=1"),
                      (dict(kv_dtype=FP8, page_size=16), "page_size=16"),
                      (dict(kv_dtype=FP8, combine="kernel"), "combine='kernel'")):
        with pytest.raises(ValueError, match=f"merge_chunks=12 stages that many chunks.*{named}"):
            evenflow.DecodePlan(2, 100, 8, device=device, merge_chunks=12, **kw)
    with pytest.raises(ValueError,
                       match="gluon_warps=4 .four warps a program: the warpgroup form.*needs a ring of 3 or more"):
        evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=4, num_stages=2)
    evenflow.DecodePlan(2, 100, 8, device=device, gluon_warps=4, num_stages=2)  # no Gluon kernel: nothing to refuse
    with pytest.raises(ValueError, match="gluon_warps=4 .the warpgroup form. takes calls of at most 8 q rows"):
        evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=4, num_q_heads=128)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=4, merge_chunks=12)
    assert plan.merge_chunks == 12
    for bad in (0, 10, 16):
        with pytest.raises(ValueError, match="merge_chunks must be"):
            evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, merge_chunks=bad)
    with pytest.raises(TypeError, match="merge_chunks"):
        evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, merge_chunks=12.0)
    # the warpgroup form (round AR): the default's ring, bins and reading ahead, at one KV head too, where since
    # round AV it holds the two-warp default's 2 programs an SM (padded the same: 5 slots)
    plan = evenflow.DecodePlan(2, 100, 1, device=device, kv_dtype=FP8, gluon_warps=4)
    assert (plan.takes_gluon, plan.gluon_stages, plan.deep_ring_tiles, plan.resident_pad, plan.per_sm) == \
        (True, 3, GLUON_FP8_DEEP_TILES, 2, GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM) and "gluon_warps=4" in repr(plan)
    plan = evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=4)
    assert (plan.resident_pad, plan.per_sm, plan.min_pad) == (0, sms4, 0)
    # four warps on mma.sync (round AV): 2 an SM at any KV-head count (its registers), its 3-slot ring padded to the
    # 4 slots where the warps' outputs meet, without PDL too; under PDL the pad that keeps an SM to 2 (5 slots)
    for hkv in (1, 8):
        plan = evenflow.DecodePlan(2, 100, hkv, device=device, kv_dtype=FP8, gluon_warps=4, warpgroup_mma=False,
                                   gluon=True)
        assert (plan.per_sm, plan.gluon_stages, plan.min_pad, plan.resident_pad) == (2, 3, 1, 2), hkv
    with pytest.raises(ValueError, match="gluon_warps=4"):
        evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon_warps=4, warpgroup_mma=False,
                            num_stages=2)
    assert evenflow.DecodePlan(2, 100, 8, device=device, kv_dtype=FP8, gluon=False).deep_ring_tiles == 0
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="gluon"):
            evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=FP8, gluon=bad)
    # the Gluon kernel reads pages of 64 or 128 tokens: an fp8 plan at 16 or 32 is built for the Triton kernel that
    # runs its calls (round AO), and gluon=True there is refused by name
    for page, want in ((16, False), (32, False), (64, True), (128, True)):
        plan = evenflow.DecodePlan(2, 256, 8, page_size=page, device=device, kv_dtype=FP8)
        pps = GLUON_FP8_PROGRAMS_PER_SM if want else DEFAULT_PROGRAMS_PER_SM
        assert (plan.takes_gluon, plan.num_programs, plan.deep_ring_tiles > 0) == (want, pps * sms, want), page
    for page in (16, 32):
        with pytest.raises(ValueError, match=f"gluon=True.*page_size={page}"):
            evenflow.DecodePlan(2, 256, 8, page_size=page, device=device, kv_dtype=FP8, gluon=True)


def test_plan_kv_dtype_is_checked(device):
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM, GLUON_FP8_PROGRAMS_PER_SM

    sms = _runtime.num_sms(torch.device(device))
    assert evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=FP8).num_programs == GLUON_FP8_PROGRAMS_PER_SM * sms
    assert evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=torch.bfloat16).num_programs == \
        DEFAULT_PROGRAMS_PER_SM * sms
    assert evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=FP8, num_programs=7).num_programs == 7
    assert "kv_dtype=torch.float8_e4m3fn" in repr(evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=FP8))
    for bad in (torch.float16, "fp8", torch.float8_e5m2):
        with pytest.raises(ValueError, match="kv_dtype"):
            evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=bad)
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 128, 64, 1, device=device)
    plan = evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=FP8).update(sl)
    with pytest.raises(ValueError, match="plan was built for kv_dtype"):
        evenflow.decode_attention(q, k, v, pt, sl, plan=plan)


def test_plan_told_an_fp8_q_takes_four_warps_at_two_to_four_kv_heads_and_checks_the_calls_q(device):
    """Round AX: ``q_dtype`` tells a plan its calls' q dtype. Told an fp8 q, a plan for the Gluon kernel at 2-4 KV
    heads takes four warps at 2 programs an SM, uncapped (every plan value an explicit ``gluon_warps=4, num_programs=2
    x SMs`` plan has); at one KV head the four-warp default as before; at 8 KV heads, told a bf16 q, not told, or
    told more than 8 q rows a KV head, the two-warp default at 4 an SM. An explicit ``gluon_warps=4`` plan takes 2 an
    SM at up to 4 KV heads (4 at 8). A call whose q is not the told dtype raises; a bad ``q_dtype`` raises by name."""
    from evenflow.attention.plan import GLUON_FP8_WG_MAX_KV_HEADS

    assert GLUON_FP8_WG_MAX_KV_HEADS == 4
    sms = _runtime.num_sms(torch.device(device))
    for hkv in (1, 2, 4):
        told = evenflow.DecodePlan(4, 1000, hkv, device=device, kv_dtype=FP8, q_dtype=FP8)
        given = evenflow.DecodePlan(4, 1000, hkv, device=device, kv_dtype=FP8, gluon_warps=4, num_programs=2 * sms)
        assert (told.gluon_warps, told.per_sm, told.wg_max_regs, told.wg_merge_chunks) == (4, 2, 0, 8), told
        for name in PLAN_LAUNCH_VALUES:
            assert getattr(told, name) == getattr(given, name), (hkv, name)
        assert "q_dtype=torch.float8_e4m3fn" in repr(told)
        # explicit four warps without q_dtype: 2 an SM at up to 4 KV heads
        assert evenflow.DecodePlan(4, 1000, hkv, device=device, kv_dtype=FP8, gluon_warps=4).per_sm == 2, hkv
    for hkv, kw in ((8, dict(q_dtype=FP8)), (2, dict(q_dtype=torch.bfloat16)), (4, dict()),
                    (2, dict(q_dtype=FP8, num_q_heads=32)), (4, dict(q_dtype=FP8, num_stages=4, num_programs=2 * sms)),
                    (2, dict(q_dtype=FP8, gluon_warps=2)), (2, dict(q_dtype=FP8, gluon=False))):
        plan = evenflow.DecodePlan(4, 1000, hkv, device=device, kv_dtype=FP8, **kw)
        assert plan.gluon_warps == 2, (hkv, kw)
        want = 2 if "num_programs" in kw else (4 if plan.takes_gluon else 2)
        assert plan.per_sm == want and plan.takes_gluon == ("gluon" not in kw), (hkv, kw, plan.per_sm)
    assert evenflow.DecodePlan(4, 1000, 8, device=device, kv_dtype=FP8, gluon_warps=4).per_sm == 4
    for bad in (torch.float16, "fp8", torch.float8_e5m2, torch.float32):
        with pytest.raises(ValueError, match="q_dtype must be one of"):
            evenflow.DecodePlan(2, 100, 2, device=device, kv_dtype=FP8, q_dtype=bad)
    q, qs, k, v, pt, sl = make_inputs([100, 64], 2, 2, 128, 64, 1, kv_dtype=FP8, device=device)
    q8, qs8, _, _, _, _ = make_inputs([100, 64], 2, 2, 128, 64, 1, kv_dtype=FP8, q_dtype=FP8, device=device)
    told8 = evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=FP8, q_dtype=FP8, gluon=False).update(sl)
    told16 = evenflow.DecodePlan(2, 1000, 2, device=device, kv_dtype=FP8, q_dtype=torch.bfloat16,
                                 gluon=False).update(sl)
    with pytest.raises(ValueError, match="plan was built for q_dtype torch.float8_e4m3fn, q is torch.bfloat16"):
        evenflow.decode_attention(q, k, v, pt, sl, plan=told8, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="plan was built for q_dtype torch.bfloat16, q is torch.float8_e4m3fn"):
        evenflow.decode_attention(q8, k, v, pt, sl, plan=told16, q_scale=qs8, k_scale=1.0, v_scale=1.0)
    # the told dtype's calls run, within the rule of the reference
    check(q8, qs8, k, v, pt, sl, 1, plan=told8, k_scale=1.0, v_scale=1.0, what="told fp8 q")
    check(q, qs, k, v, pt, sl, 1, plan=told16, k_scale=1.0, v_scale=1.0, what="told bf16 q")


def test_plan_bound_counts_the_budget_roundings_and_an_items_tokens(device):
    """Round CP's review: the plan's int32 bound left out the budget's roundings and an item's tokens, so legal plans
    at a huge max_seq_len or min_tiles wrapped: ``prog_start`` negative (rows 55-62 of a 63-request batch never
    written, a read before the plan's buffers) or ``n * TILE`` (an all-zero output where the static path attends).
    Those plans are refused now, by the bound's message; the largest max_seq_len a small plan takes runs its update
    and call over lengths that the page table clamps, bins in order and output equal to the static path's."""
    from evenflow.attention.plan import MAX_SEQ_LEN
    for b, kw in ((63, dict(num_programs=6, min_tiles=1)), (1, dict(num_programs=66, min_tiles=31_580_642)),
                  (1, dict(num_programs=4, min_tiles=1, item_cost_max_tiles=None))):
        with pytest.raises(ValueError, match="too large for the plan's int32 tile and token indices"):
            evenflow.DecodePlan(b, MAX_SEQ_LEN, 1, device=device, **kw)
    B = 3
    for kw in (dict(num_programs=4, min_tiles=1), dict(num_programs=4, min_tiles=1, item_cost_max_tiles=None)):
        def takes(n):
            try:
                evenflow.DecodePlan(B, n, 1, device=device, **kw)
                return True
            except ValueError:
                return False
        lo, hi = 1, MAX_SEQ_LEN  # the largest max_seq_len taken (the bound is monotone in it)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if takes(mid) else (lo, mid - 1)
        assert lo > 2**28, f"{kw}: a plan of {B} requests refused past max_seq_len {lo}"
        plan = evenflow.DecodePlan(B, lo, 1, device=device, **kw)
        sl = torch.full((B,), lo, dtype=torch.int32, device=device)
        plan.update(sl)
        start = plan.as_dict()["prog_start"].cpu()
        assert int(start.min()) >= 0 and bool((start[1:] >= start[:-1]).all()), start.tolist()
        g = torch.Generator().manual_seed(5)
        k, v = (torch.randn(2, 64, 1, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
        pt = torch.zeros(B, 1, dtype=torch.int32, device=device)  # every length clamped to one page of 64
        q = torch.randn(B, 1, 64, generator=g).to(torch.bfloat16).to(device)
        out = poisoned((B, 1, 64), torch.bfloat16, device)
        _, lse = evenflow.decode_attention(q, k, v, pt, sl, plan=plan, out=out, return_lse=True)
        ref, ref_lse = evenflow.decode_attention(q, k, v, pt, sl, return_lse=True)
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
        assert_within_one_ulp(out, ref, f"{kw}: the plan's output against the static path's")
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=0)  # one chunk each: the same fp32 sums


def test_out_and_lse_that_share_memory_with_an_input_are_refused(device):
    """Round CP's review: decode and prefill took an ``out`` or ``lse`` over the KV cache, q or the page table, so the
    kernels wrote what others read (a cache corrupted in silence). Each is refused naming both, and a separate buffer
    still runs."""
    from test_prefill import make_inputs as prefill_inputs

    q, _, k, v, pt, sl = make_inputs([70, 5], 2, 2, 64, 16, 1, device=device)
    rows, hq, d = q.shape
    over_k = k.view(-1)[: rows * hq * d].view(rows, hq, d)
    with pytest.raises(ValueError, match="out overlaps k_cache in memory"):
        evenflow.decode_attention(q, k, v, pt, sl, out=over_k)
    out = torch.empty(rows, hq, d, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="lse overlaps out in memory"):
        evenflow.decode_attention(q, k, v, pt, sl, out=out, return_lse=True,
                                  lse=out.view(-1).view(torch.float32)[: rows * hq].view(rows, hq))
    with pytest.raises(ValueError, match="out overlaps q in memory"):
        evenflow.decode_attention(q, k, v, pt, sl, out=q)
    o = evenflow.decode_attention(q, k, v, pt, sl, out=out)
    assert o is out and torch.isfinite(out.float()).all()
    q, k, v, cu, pt, sl = prefill_inputs([3, 2], [5, 0], 4, 2, 64, 16, device=device)
    T = q.shape[0]
    with pytest.raises(ValueError, match="out overlaps v_cache in memory"):
        evenflow.prefill_attention(q, k, v, cu, pt, sl, 3, out=v.view(-1)[: T * 4 * 64].view(T, 4, 64))
    out = torch.empty(T, 4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="lse overlaps out in memory"):
        evenflow.prefill_attention(q, k, v, cu, pt, sl, 3, out=out, return_lse=True,
                                   lse=out.view(-1).view(torch.float32)[: T * 4].view(T, 4))
    assert evenflow.prefill_attention(q, k, v, cu, pt, sl, 3, out=out) is out
