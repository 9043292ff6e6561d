"""CPU tests of the MoE benchmark's pure-Python parts: case generation, routing statistics,
floor arithmetic, quantisation helpers, and the torch-grouped-mm peer against the
benchmark's fp32 oracle (torch._grouped_mm runs on the CPU; its FP8 path is GPU-only)."""
import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from evenflow.bench.harness import PeerUnavailable
from tests_support_bench import rescored

_SPEC = importlib.util.spec_from_file_location("bench_moe", Path(__file__).parents[1] / "benchmarks" / "moe.py")
bm = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_moe"] = bm  # dataclasses look their module up there
_SPEC.loader.exec_module(bm)

TINY = bm.MoECase("tiny", 8, 8, 2, 32, 16)
TINY_EP = bm.MoECase("tiny-ep", 8, 4, 2, 32, 16, ep_rank=1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("case", list(bm.CASES.values()), ids=list(bm.CASES))
def test_routing_is_a_valid_top_k(case):
    ids, w = bm.make_routing(64, case, _gen(), bm.expert_bias(case.num_experts_total, _gen(1)))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == w.shape == (64, case.top_k)
    assert int(ids.min()) >= 0 and int(ids.max()) < case.num_experts_total
    assert all(len(set(r)) == case.top_k for r in ids.tolist()), "an expert chosen twice for one token"
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(64), atol=1e-6, rtol=0)


def test_routing_weights_are_renormalised_softmax_of_the_chosen_experts():
    gen = _gen(3)
    state = gen.get_state()
    ids, w = bm.make_routing(5, TINY, gen)
    gen.set_state(state)
    probs = torch.softmax(torch.randn(5, TINY.num_experts_total, generator=gen), -1)
    top = probs.gather(1, ids.long())
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))
    assert bool((probs.gather(1, ids.long()).min(-1).values >= probs.sort(-1).values[:, -TINY.top_k]).all())


def test_expert_bias_makes_loads_uneven():
    case = bm.CASES["qwen3-30b-a3b"]
    ids, _ = bm.make_routing(4096, case, _gen(), bm.expert_bias(case.num_experts_total, _gen(1)))
    loads = torch.bincount(ids.flatten().long(), minlength=case.num_experts_total).double()
    # Uniform routing would give max/mean ~1.3 at this size (multinomial noise); the bias makes it far larger.
    assert float(loads.max() / loads.mean()) > 2.0
    assert float(loads.min()) < 0.5 * float(loads.mean())


@pytest.mark.parametrize("case", [TINY, TINY_EP, bm.CASES["hy3-ep8"]], ids=lambda c: c.name)
def test_routing_stats_match_brute_force(case):
    ids, _ = bm.make_routing(37, case, _gen(5))
    lo = case.ep_rank * case.num_local
    pairs = [(t, e) for t, row in enumerate(ids.tolist()) for e in row if lo <= e < lo + case.num_local]
    st = bm.routing_stats(ids, case)
    assert st.distinct_experts == len({e for _, e in pairs})
    assert st.local_pairs == len(pairs)
    assert st.tokens_read == len({t for t, _ in pairs})


def test_routing_stats_edge_cases():
    one_expert = torch.full((6, 2), 5, dtype=torch.int32)
    one_expert[:, 1] = 6
    assert bm.routing_stats(one_expert, TINY) == bm.RoutingStats(2, 12, 6)
    # EP rank 1 owns experts 4..7: ids 0..3 are remote and count for nothing.
    remote = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    assert bm.routing_stats(remote, TINY_EP) == bm.RoutingStats(0, 0, 0)
    mixed = torch.tensor([[0, 4], [7, 3]], dtype=torch.int32)
    assert bm.routing_stats(mixed, TINY_EP) == bm.RoutingStats(2, 2, 2)


def test_expert_bytes_by_hand():
    q = bm.CASES["qwen3-30b-a3b"]  # H2048 I768: 3 * 2048 * 768 = 4,718,592 weights per expert
    assert bm.expert_bytes(q, "bf16") == 2 * 4_718_592
    assert bm.expert_bytes(q, "fp8-tensor") == 4_718_592 + 8
    # block scales: (1536/128)*(2048/128) + (2048/128)*(768/128) = 192 + 96 fp32
    assert bm.expert_bytes(q, "fp8-block") == 4_718_592 + 4 * 288
    with pytest.raises(ValueError):
        bm.expert_bytes(q, "int4")


def test_floor_work_by_hand():
    case = bm.CASES["hy3-ep8"]
    st = bm.RoutingStats(distinct_experts=3, local_pairs=5, tokens_read=4)
    nbytes, flops = bm.floor_work(case, "bf16", 16, st)
    per_expert = 2 * 3 * 4096 * 1536
    assert nbytes == 3 * per_expert + 4 * 4096 * 2 + 16 * 4096 * 2 + 16 * 8 * 8
    assert flops == 5 * 6 * 4096 * 1536
    # The harness turns them into a floor: whichever of bandwidth and compute binds.
    from evenflow.bench.harness import floor_us

    ceil = {"copy_TBps": 4.0, "bf16_TFLOPs": 600.0, "fp8_TFLOPs": 1200.0}
    assert math.isclose(floor_us(nbytes, flops, ceilings=ceil), nbytes / 4e12 * 1e6)
    big = bm.RoutingStats(distinct_experts=24, local_pairs=4096, tokens_read=3000)
    nb, fl = bm.floor_work(case, "fp8-tensor", 4096, big)
    assert math.isclose(floor_us(nb, fl, ceilings=ceil, rate="fp8_TFLOPs"), fl / 1.2e15 * 1e6)


def test_rotations():
    l2 = 60 << 20
    assert bm.rotations(200 << 20, l2) == 1
    assert bm.rotations(50 << 20, l2) == 3
    assert bm.rotations(1 << 20, l2) == bm.MAX_ROTATE
    assert bm.rotations(0, l2) == bm.MAX_ROTATE


def test_block_quant_round_trip_and_scale_layout():
    w = torch.randn(2, 256, 384, generator=_gen()) * 0.02
    q, s = bm.quant_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2, 3)
    # each block's amax maps to 448 exactly, so |q| reaches but never passes it
    assert float(q.float().abs().amax()) == 448.0
    deq = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    rel = ((deq - w).abs() / w.abs().clamp_min(1e-6))[w.abs() > 1e-3]
    assert float(rel.max()) <= 2.0**-4 + 1e-6  # e4m3 keeps 3 mantissa bits: half-ulp <= 2^-4 relative


def test_per_tensor_quant_scales():
    w = torch.randn(3, 32, 16, generator=_gen()) * 0.02
    q, s = bm.quant_per_tensor(w)
    assert s.shape == (3,)
    torch.testing.assert_close(s, w.abs().amax(dim=(1, 2)) / 448.0)
    assert float(q.float().abs().amax()) == 448.0


def _raw_weights(case, variant, seed=0):
    return bm.make_weights(case, variant, "cpu", _gen(seed), std=0.2)


def _reference64(x, ids, tw, w, case):
    """An fp64 loop over (token, slot) pairs: the oracle of the oracle."""
    y = torch.zeros(x.shape[0], case.hidden, dtype=torch.float64)
    for t, j in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        e = int(ids[t, j]) - case.ep_rank * case.num_local
        if 0 <= e < case.num_local:
            w13, w2 = (m.double() for m in w.dequant(e))
            gu = w13 @ x[t].double()
            a = torch.nn.functional.silu(gu[: case.inter]) * gu[case.inter:]
            y[t] += float(tw[t, j]) * (w2 @ a)
    return y


@pytest.mark.parametrize("case", [TINY, TINY_EP], ids=lambda c: c.name)
def test_benchmark_reference_matches_fp64_pair_loop(case):
    w = _raw_weights(case, "bf16")
    ids, tw = bm.make_routing(7, case, _gen(2))
    x = torch.randn(7, case.hidden, generator=_gen(4)).bfloat16()
    ref = bm.reference_moe(x, ids, tw, w, case)
    torch.testing.assert_close(ref.double(), _reference64(x, ids, tw, w, case), atol=1e-5, rtol=1e-5)


def test_fp8_tensor_reference_quantises_activations():
    case = bm.MoECase("tiny128", 4, 4, 2, 128, 128)
    w = _raw_weights(case, "fp8-tensor")
    gen = _gen(6)
    bm.calibrate_static_scales(w, case, "cpu", gen, bm.expert_bias(4, _gen(7)), tokens=16)
    assert w.a13_scale.shape == (1,) and w.a2_scale.shape == (1,)
    ids, tw = bm.make_routing(5, case, gen)
    x = torch.randn(5, case.hidden, generator=gen).bfloat16()
    q = bm.reference_moe(x, ids, tw, w, case)
    plain = bm.reference_moe(x, ids, tw, w, case, quantize_activations=False)
    diff = float((q - plain).abs().max())
    assert 0 < diff < 0.2 * float(plain.abs().max())  # quantisation changes the result, but only a little


@pytest.mark.parametrize("case", [TINY, TINY_EP], ids=lambda c: c.name)
def test_grouped_mm_peer_bf16_matches_reference(case):
    from evenflow.bench.peers.grouped_mm import GroupedMMMoE
    from evenflow.testing import assert_within_rule

    w = _raw_weights(case, "bf16")
    ids, tw = bm.make_routing(9, case, _gen(8))
    x = torch.randn(9, case.hidden, generator=_gen(9)).bfloat16()
    peer = GroupedMMMoE("bf16", w.w13, w.w2, ep_rank=case.ep_rank, num_experts_total=case.num_experts_total)
    y = peer.bind(x, ids, tw)()
    assert y.dtype == torch.bfloat16 and y.shape == (9, case.hidden)
    ref64 = _reference64(x, ids, tw, w, case)
    # Baseline for the rule: the same math with PyTorch's bf16 products, one pair at a time.
    base = torch.zeros_like(ref64)
    for t, j in itertools.product(range(9), range(case.top_k)):
        e = int(ids[t, j]) - case.ep_rank * case.num_local
        if 0 <= e < case.num_local:
            gu = (w.w13[e] @ x[t]).float()
            a = (torch.nn.functional.silu(gu[: case.inter]) * gu[case.inter:]).bfloat16()
            base[t] += float(tw[t, j]) * (w.w2[e] @ a).double()
    assert_within_rule(y, ref64, base.bfloat16(), what=f"grouped-mm peer {case.name}")
    if case.ep_rank:
        local = ((ids.long() >= 4) & (ids.long() < 8)).any(1)
        assert bool((y[~local] == 0).all()), "tokens with no local expert must give exactly 0"


def test_group_pairs_offsets_and_order():
    from evenflow.bench.peers.grouped_mm import group_pairs

    ids = torch.tensor([[5, 1], [1, 7], [6, 4]], dtype=torch.int32)
    order, key_sorted, offs = group_pairs(ids, ep_rank=1, num_local=4)  # local experts 4..7
    assert offs.dtype == torch.int32
    assert offs.tolist() == [1, 2, 3, 4]  # one pair each for experts 4, 5, 6, 7
    assert key_sorted.tolist() == [0, 1, 2, 3, 4, 4]
    assert order.tolist() == [5, 0, 4, 3, 1, 2]


def test_grouped_mm_peer_block_fp8_is_an_error_row_not_a_crash():
    from evenflow.bench.peers.grouped_mm import GroupedMMMoE

    w = bm.make_weights(bm.MoECase("b", 2, 2, 1, 128, 128), "fp8-block", "cpu", _gen())
    with pytest.raises(PeerUnavailable):
        GroupedMMMoE("fp8-block", w.w13, w.w2, **w.kwargs())
    with pytest.raises(ValueError, match="variant"):
        GroupedMMMoE("int4", w.w13, w.w2)


def test_sglang_peer_unavailable_here_and_ep_remap():
    from evenflow.bench.peers import sglang

    if not torch.cuda.is_available():
        with pytest.raises(PeerUnavailable):
            sglang.load()
    ids = torch.tensor([[0, 23, 24], [47, 48, 191]], dtype=torch.int32)
    local = sglang.local_expert_ids(ids, ep_rank=1, num_local=24)
    assert local.tolist() == [[-1, -1, 0], [23, -1, -1]]
    assert local.dtype == torch.int32


def test_case_table_matches_bench_md():
    q, tp, ep = (bm.CASES[n] for n in ("qwen3-30b-a3b", "hy3-tp8", "hy3-ep8"))
    assert (q.num_experts_total, q.top_k, q.hidden, q.inter) == (128, 8, 2048, 768)
    assert (tp.num_experts_total, tp.num_local, tp.hidden, tp.inter) == (192, 192, 4096, 192)
    assert (ep.num_experts_total, ep.num_local, ep.hidden, ep.inter) == (192, 24, 4096, 1536)
    assert "fp8-block" in tp.skip_variants and not q.skip_variants
    assert bm.BATCHES == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def test_cli_filters_parse():
    from evenflow.bench import harness as H

    args = H.parse_args("x", ["--quick", "--cases", "hy3-tp8", "--variants", "bf16,fp8-tensor",
                              "--batches", "1,8"], extra=bm._extra_args)
    assert args.quick and args.cases == ["hy3-tp8"] and args.variants == ["bf16", "fp8-tensor"]
    assert args.batches == [1, 8]


@pytest.mark.parametrize("row,accum", [("evenflow-fastacc", "fast"), ("evenflow-promoted", "promoted")])
@pytest.mark.parametrize("variant", ["bf16", "fp8-tensor", "fp8-block"])
def test_fastacc_row_is_opt_in_and_fp8_only(device, variant, row, accum, monkeypatch):
    """evenflow-fastacc (fused_moe(fp8_accum="fast")) and evenflow-promoted (fp8_accum="promoted") are knob rows
    on request; on bf16 each is an "unavailable" error row (not applicable), on fp8 it runs and passes the
    benchmark's own check against its fp32 oracle (whose max_abs_err / cosine the row records, as for every
    impl)."""
    from evenflow.bench import harness as H

    assert row in bm.IMPLS and row not in bm.DEFAULT_IMPLS
    assert bm.EVENFLOW_KNOBS[row] == {"fp8_accum": accum}
    case = bm.MoECase("tiny128", 4, 4, 2, 128, 128)
    w = bm.make_weights(case, variant, device, torch.Generator(device=device).manual_seed(0), std=0.1)
    if variant == "bf16":
        with pytest.raises(PeerUnavailable, match="not applicable to bf16"):
            bm.build_impl(row, w, case, None)
        return
    gen = _gen(3)
    if variant == "fp8-tensor":
        bm.calibrate_static_scales(w, case, device, gen, bm.expert_bias(4, _gen(7)), tokens=16)
    ids, tw = bm.make_routing(6, case, gen)
    x = torch.randn(6, case.hidden, generator=gen).bfloat16()
    x, ids, tw = x.to(device), ids.to(device), tw.to(device)
    import evenflow

    seen = []
    real = evenflow.fused_moe
    monkeypatch.setattr(evenflow, "fused_moe", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    fn = bm.build_impl(row, w, case, None)(x, ids, tw)
    # check_output raises where the row's output is not finite, past rtol, or under its cosine floor (0.999)
    H.check_output(fn(), bm.reference_moe(x, ids, tw, w, case), f"{row} {variant}", rtol=5e-2)
    assert [kw.get("fp8_accum") for kw in seen] == [accum], f"the row must call fused_moe(fp8_accum={accum!r})"


def test_zerokernel_row_takes_a_holder_without_counters(device, monkeypatch):
    """evenflow-zerokernel (the kept counters' A/B) is a knob row on request that calls fused_moe with a
    holder keeping no counters (so a pair-tile call whose gate-up splits K zeroes a fresh buffer with one more
    kernel), and gives the default row's result bit for bit; the default row's holder keeps them and launches
    no zeroing kernel. The heuristic is made to split the gate-up (the tiny case would not)."""
    import dataclasses

    from evenflow.moe import fused

    assert "evenflow-zerokernel" in bm.IMPLS and "evenflow-zerokernel" not in bm.DEFAULT_IMPLS
    real_choose = fused.choose_config
    monkeypatch.setattr(fused, "choose_config", lambda *a, **kw: dataclasses.replace(
        real_choose(*a, **kw), gu_block_k=64, gu_split_k=2, gu_defer=0))
    zeroings = []
    real_zero = fused.moe_zero_kernel

    class CountedZero:
        def __getitem__(self, grid):
            zeroings.append(grid)
            return real_zero[grid]

    monkeypatch.setattr(fused, "moe_zero_kernel", CountedZero())
    case = bm.MoECase("tiny128", 4, 4, 2, 128, 128)
    w = bm.make_weights(case, "bf16", device, torch.Generator(device=device).manual_seed(0), std=0.1)
    gen = _gen(3)
    ids, tw = bm.make_routing(2, case, gen)
    x = torch.randn(2, case.hidden, generator=gen).bfloat16()
    x, ids, tw = x.to(device), ids.to(device), tw.to(device)
    import evenflow

    holders = []
    real = evenflow.fused_moe
    monkeypatch.setattr(evenflow, "fused_moe", lambda *a, **kw: holders.append(a[3]) or real(*a, **kw))
    ys = []
    for name in ("evenflow", "evenflow-zerokernel"):
        ys.append(bm.build_impl(name, w, case, None)(x, ids, tw)())
        assert len(zeroings) == (name == "evenflow-zerokernel"), (name, zeroings)
    assert torch.equal(ys[0], ys[1])
    assert [h.counters is None for h in holders] == [False, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_module_switch_rows_launch_what_they_name_and_restore_the_switch(monkeypatch):
    """The rows that set a module switch of evenflow.moe.fused around each call: evenflow-gu2dot launches bf16's
    gate-up as two dots (ONE_DOT off) where evenflow launches one (on a 64-row tile, which the heuristic is made to
    pick), -fastacc-gu2dot and -promoted-gu2dot likewise for per-tensor fp8 in those modes, with the same output,
    and the switch is back at its value after each call; a row is refused where its switch does not apply (gu2dot on
    block-scaled fp8 and on per-tensor fp8's exact mode, serialquant on bf16)."""
    import dataclasses

    from evenflow import _compile_check as CC
    from evenflow.moe import fused

    real_choose = fused.choose_config
    monkeypatch.setattr(fused, "choose_config", lambda *a, **kw: dataclasses.replace(
        real_choose(*a, **kw), block_m=fused.GU_ONE_DOT_MIN_ROWS))

    case = bm.MoECase("tiny128", 4, 4, 2, 128, 128)
    gen = _gen(5)
    ids, tw = bm.make_routing(40, case, gen)
    x = torch.randn(40, case.hidden, generator=gen).bfloat16()
    assert set(bm.MODULE_SWITCHES.values()) <= set(vars(fused))
    before = {name: getattr(fused, name) for name in bm.MODULE_SWITCHES.values()}
    for variant, rows in (("bf16", ("evenflow", "evenflow-gu2dot")),
                          ("fp8-tensor", ("evenflow-fastacc", "evenflow-fastacc-gu2dot")),
                          ("fp8-tensor", ("evenflow-promoted", "evenflow-promoted-gu2dot"))):
        w = bm.make_weights(case, variant, "cpu", torch.Generator().manual_seed(0), std=0.1)
        if variant == "fp8-tensor":
            bm.calibrate_static_scales(w, case, "cpu", _gen(1), bm.expert_bias(case.num_experts_total, _gen(2)))
        ys, seen = [], []
        for name in rows:
            with CC.record_launches(execute=True) as launches:
                ys.append(bm.build_impl(name, w, case, None)(x, ids, tw)())
            seen.append([dict(ln.constexprs)["ONE_DOT"] for ln in launches if ln.name == "moe_gate_up_kernel"])
            assert {n: getattr(fused, n) for n in before} == before, name
        assert seen == [[True], [False]], (rows, seen)
        assert torch.equal(ys[0], ys[1]), rows
    for variant, row in (("fp8-block", "evenflow-gu2dot"), ("fp8-tensor", "evenflow-gu2dot"),
                         ("bf16", "evenflow-serialquant")):
        w = bm.make_weights(case, variant, "cpu", torch.Generator().manual_seed(0), std=0.1)
        with pytest.raises(PeerUnavailable, match="not applicable"):
            bm.build_impl(row, w, case, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_pair_prefetch_rows_set_the_prefetch_of_the_gemms_they_name(monkeypatch):
    """Round BK's rows (``fused.PAIR_PREFETCH`` / ``PAIR_PREFETCH_STEPS``), launched as on an H200 (pair tiles under
    PDL at T = 1) on a config whose ``prefetch`` names both GEMMs: evenflow takes the config's choice (first K step),
    -pf / -pfgu / -pfdown force the GEMMs they name over their whole K range, -pf1 / -pfgu1 / -pfdown1 over the first
    step, -nopf none (PREFETCH: 128 elements a line of e4m3 weights, 64 of bf16); a bf16 gate-up never takes it (the
    layer's first kernel there); the switches are back after each call."""
    import dataclasses

    from evenflow import _compile_check as CC
    from evenflow.moe import fused

    real_choose = fused.choose_config
    monkeypatch.setattr(fused, "choose_config", lambda *a, **kw: dataclasses.replace(real_choose(*a, **kw), prefetch=3))
    case = bm.MoECase("tiny256", 4, 4, 2, 256, 128)
    gen = _gen(6)
    ids, tw = bm.make_routing(1, case, gen)
    x = torch.randn(1, case.hidden, generator=gen).bfloat16()
    want = {"evenflow": (1, 1, 1), "evenflow-nopf": (0, 0, 0), "evenflow-pf": (1, 1, 0), "evenflow-pfgu": (1, 0, 0),
            "evenflow-pfdown": (0, 1, 0), "evenflow-pf1": (1, 1, 1), "evenflow-pfgu1": (1, 0, 1),
            "evenflow-pfdown1": (0, 1, 1)}
    for variant, line in (("fp8-tensor", 128), ("bf16", 64)):
        w = bm.make_weights(case, variant, "cpu", torch.Generator().manual_seed(0), std=0.1)
        if variant == "fp8-tensor":
            bm.calibrate_static_scales(w, case, "cpu", _gen(1), bm.expert_bias(case.num_experts_total, _gen(2)))
        for name, (gu, down, steps) in want.items():
            with CC.emulate_gpu(132), CC.record_launches() as launches:
                bm.build_impl(name, w, case, None)(x, ids, tw)()
            got = {ln.name: (dict(ln.constexprs)["PREFETCH"], dict(ln.constexprs)["PREFETCH_STEPS"])
                   for ln in launches if "PREFETCH" in dict(ln.constexprs)}
            gu = gu if variant != "bf16" else 0
            assert got == {"moe_gate_up_kernel": (gu * line, gu * steps),
                           "moe_down_kernel": (down * line, down * steps)}, (variant, name, got)
            assert fused.PAIR_PREFETCH is None and fused.PAIR_PREFETCH_STEPS == 1, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_decode_sass_script_reports_one_exp_per_row_element(capsys):
    """benchmarks/moe_decode_sass.py compiles the table's bf16 decode launches for sm_90 with the
    deferred reduction forced on and prints their loop statistics: every deferred down launch
    (GU_SPLIT > 0) shows the activation run once per row element (one MUFU.EX2 a K step)."""
    spec = importlib.util.spec_from_file_location("moe_decode_sass",
                                                  Path(__file__).parents[1] / "benchmarks" / "moe_decode_sass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--formats", "bf16"])
    rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines() if r.startswith("| down |")]
    assert len(rows) >= 3
    for r in rows:
        cells = [c.strip() for c in r]
        assert int(cells[5]) > 0 and cells[8] == "0" and cells[11] == "1", cells


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_load_waves_script_finds_the_reduce_round_trips(capsys, monkeypatch):
    """benchmarks/sass_load_waves.py over two MoE points (Hy3 EP8 bf16 at T = 1 and 2, the table's down splits 4 and
    2): the default reduce build loses round trips (2 needed, more issued) and is printed with the points that run
    it (fused.REDUCE_FENCED off); with it on, the default since round BQ, no reduce build is printed; an unknown
    family is refused by name."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))  # as the script's own imports find it
    import moe as B
    from evenflow.moe import fused

    spec = importlib.util.spec_from_file_location("sass_load_waves",
                                                  Path(__file__).parents[1] / "benchmarks" / "sass_load_waves.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(B, "CASES", {"hy3-ep8": B.CASES["hy3-ep8"]})
    monkeypatch.setattr(B, "BATCHES", (1, 2))
    monkeypatch.setitem(mod.FAMILIES, "moe", lambda: ((p, c) for p, c in mod._moe() if " bf16 " in p))
    monkeypatch.setattr(fused, "REDUCE_FENCED", False)
    mod.main(["--families", "moe"])
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in capsys.readouterr().out.splitlines()
            if r.startswith("| moe_reduce_kernel |")]
    assert {r[-1] for r in rows} == {"moe hy3-ep8 bf16 T=1", "moe hy3-ep8 bf16 T=2"}, rows
    assert all(r[3] == "2" and int(r[4]) > 2 for r in rows), rows
    monkeypatch.setattr(fused, "REDUCE_FENCED", True)
    mod.main(["--families", "moe"])
    assert "| moe_reduce_kernel |" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown"):
        mod.main(["--families", "moe,prefill"])


def test_plot_fp8_modes(tmp_path):
    """benchmarks/plot_fp8_modes.py: the points are the fp8 ones with a default and a peer time; each mode's bars are
    the peer's time over the mode's and the mode's max error over the exact mode's at that point; a PNG is written;
    a file with no such point is refused."""
    spec = importlib.util.spec_from_file_location("plot_fp8_modes", Path(__file__).parent.parent / "benchmarks"
                                                  / "plot_fp8_modes.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)

    def row(case, variant, batch, impl, us, err=1e-3):
        return {"case": case, "variant": variant, "batch": batch, "impl": impl, "us": us, "max_abs_err": err}

    rows = [row("q", "fp8-tensor", 512, "evenflow", 200.0, 2e-3), row("q", "fp8-tensor", 512, "sglang-triton", 180.0),
            row("q", "fp8-tensor", 512, "evenflow-promoted", 150.0, 5e-3),
            row("q", "fp8-tensor", 512, "evenflow-fastacc", 120.0, 8e-3),
            row("q", "fp8-block", 512, "evenflow", 300.0),  # no peer time: left out
            {"case": "q", "variant": "fp8-block", "batch": 512, "impl": "sglang-triton", "error": "unavailable"},
            row("q", "bf16", 512, "evenflow", 100.0), row("q", "bf16", 512, "sglang-triton", 90.0)]  # not fp8
    points, by = pm.mode_table(rows)
    assert points == [("q", "fp8-tensor", 512)]
    ratios = pm.mode_ratios(points, by)
    assert list(ratios) == ["exact (default)", "promoted", "fast"]
    for label, speed, err in (("exact (default)", 180 / 200, 1.0), ("promoted", 180 / 150, 2.5),
                              ("fast", 180 / 120, 4.0)):
        (k, s, e), = ratios[label]
        assert k == 0 and math.isclose(s, speed) and math.isclose(e, err), (label, s, e)
    res = tmp_path / "moe.json"
    res.write_text(json.dumps({"header": {"gpu": "test"}, "rows": rows}))
    png = pm.plot(res)
    assert png == tmp_path / "moe.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res.write_text(json.dumps({"rows": rows[4:]}))
    with pytest.raises(ValueError, match="no fp8 point"):
        pm.plot(res)


def test_issue_targets_say_why_a_ratio_went_unchecked():
    """The ratio targets of a point are one missed target where the peer cannot be compared, saying why: no SGLang
    row in the run, or either row timed eagerly only (no graph replay)."""
    ours = _moe_row("qwen3-30b-a3b", "bf16", 1, "evenflow", 10.0, frac_of_floor=0.9, cosine=1.0)
    eager = {**ours, "timing": "eager only, graph capture failed: RuntimeError: x"}
    peer = _moe_row("qwen3-30b-a3b", "bf16", 1, "sglang-triton", 20.0)
    for rows, why in (([ours], "no row"), ([eager, peer], "not timed as a graph replay"),
                      ([ours, {**peer, "timing": eager["timing"]}], "not timed as a graph replay")):
        unchecked = [t for t in bm.issue_targets(rows) if t["kind"] != "frac_of_floor >= 0.85 (T <= 512) / 0.6"]
        assert [(t["target"], t["ok"], t["value"]) for t in unchecked] == [
            ("qwen3-30b-a3b bf16 T=1: sglang-triton timed beside it", False, why)], rows


def test_series_that_cannot_run_give_an_error_row_for_every_batch_and_impl(tmp_path, monkeypatch):
    """BENCH.md: every row carries the size it measures. A variant a case cannot take (Hy3 TP8's I = 192 has no
    block-128 scales) and a series the time budget cut are written as an error row at each batch and impl, with
    nothing measured (no GPU here: the ceilings, the L2 size and the end-of-run copy reading are stood in for)."""
    from evenflow.bench import harness as H

    monkeypatch.setattr(H, "measure_ceilings", lambda *a, **k: {"copy_TBps": 4.0, "bf16_TFLOPs": 700.0,
                                                                "fp8_TFLOPs": 1400.0, "launch_us": 0.7})
    props = type("P", (), {"L2_cache_size": 1 << 20, "name": "stand-in", "multi_processor_count": 1})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: props)  # (on a GPU the header reads it too)
    monkeypatch.setattr(H.Results, "settle_copy", lambda self: None)
    ticks = iter([0.0] + [1e9] * 10)  # the budget is spent by the second series
    monkeypatch.setattr(bm.time, "time", lambda: next(ticks))
    args = H.parse_args("x", ["--cases", "hy3-tp8,hy3-ep8", "--variants", "fp8-block", "--batches", "1,8",
                              "--impls", "evenflow,sglang-triton", "--budget-s", "5", "--no-plot",
                              "--out", str(tmp_path)], extra=bm._extra_args)
    bm.validate(args)
    bm.run(args)
    rows = H.Results.load(tmp_path / "moe.json").rows
    got = sorted((r["case"], r["batch"], r["impl"], r["error"].split(":")[0]) for r in rows)
    want = sorted((c, b, i, why) for c, why in (("hy3-tp8", "n/a"), ("hy3-ep8", "skipped"))
                  for b in (1, 8) for i in ("evenflow", "sglang-triton"))
    assert got == want
    assert all("us" not in r and r["series"] == f"{r['case']}/fp8-block" for r in rows)


def _knob_gemm_constexprs(names, w, case, x, ids, tw, switch):
    """Runs each named row of the benchmark on one call through the interpreter, asserts the module switch
    ``switch`` of evenflow.moe.fused is back on after it and its output within the tolerance rule against the fp64
    oracle, and returns each row's gate-up and down launch constexprs."""
    from evenflow import _compile_check as CC
    from evenflow.moe import fused
    from evenflow.reference.moe import moe_rule_terms
    from evenflow.testing import rule_check

    ref, bl, allow = moe_rule_terms(x, ids, tw, w.holder(), num_experts_total=case.num_experts_total)
    consts = {}
    for name in names:
        with CC.record_launches(execute=True) as launches:
            y = bm.build_impl(name, w, case, None)(x, ids, tw)()
        assert getattr(fused, switch) is True, name
        msg, err, bound = rule_check(y, ref, bl, allowance=allow)
        assert not msg, (w.variant, name, msg)
        consts[name] = {ln.name: dict(ln.constexprs) for ln in launches
                        if ln.name in ("moe_gate_up_kernel", "moe_down_kernel")}
    return consts


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_narrowdown_row_launches_64_wide_down_tiles_within_the_rule():
    """evenflow-narrowdown (``fused.WIDE_DOWN_N`` off around each call: the default before round CG) launches the
    down GEMM of the exact fp8 mode's 32-row tiles (20 rows per expert here) 64 wide where evenflow's is 128, its
    n-group re-derived by the heuristic's rule, every other constexpr of both GEMMs the same, both outputs within the
    exact mode's tolerance rule, for both fp8 formats; the switch is back on after each call; bf16, which it does not
    change, is refused."""
    assert "evenflow-narrowdown" in bm.EVENFLOW_KNOBS and "evenflow-narrowdown" not in bm.DEFAULT_IMPLS
    case = bm.MoECase("tiny256", 2, 2, 1, 256, 128)
    gen = _gen(7)
    ids, tw = bm.make_routing(40, case, gen)
    x = torch.randn(40, case.hidden, generator=gen).bfloat16()
    for variant in ("fp8-tensor", "fp8-block"):
        w = bm.make_weights(case, variant, "cpu", torch.Generator().manual_seed(0), std=0.1)
        if variant == "fp8-tensor":
            bm.calibrate_static_scales(w, case, "cpu", _gen(1), bm.expert_bias(case.num_experts_total, _gen(2)))
        consts = _knob_gemm_constexprs(("evenflow", "evenflow-narrowdown"), w, case, x, ids, tw, "WIDE_DOWN_N")
        for name in consts:
            assert consts[name]["moe_down_kernel"]["BLOCK_M"] == 32, (variant, name)
        wide, base = consts["evenflow"], consts["evenflow-narrowdown"]
        assert (base["moe_down_kernel"]["BLOCK_N"], wide["moe_down_kernel"]["BLOCK_N"]) == (64, 128), variant
        # one K step (I = 128): the n-group rule gives a program all of H's n-blocks, 4 of 64 or 2 of 128
        assert (base["moe_down_kernel"]["N_GROUP"], wide["moe_down_kernel"]["N_GROUP"]) == (4, 2), variant
        assert base["moe_gate_up_kernel"] == wide["moe_gate_up_kernel"], variant
        assert {k: v for k, v in base["moe_down_kernel"].items() if k not in ("BLOCK_N", "N_GROUP")} == \
            {k: v for k, v in wide["moe_down_kernel"].items() if k not in ("BLOCK_N", "N_GROUP")}, variant
    w = bm.make_weights(case, "bf16", "cpu", torch.Generator().manual_seed(0), std=0.1)
    with pytest.raises(PeerUnavailable, match="not applicable to bf16"):
        bm.build_impl("evenflow-narrowdown", w, case, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the interpreter")
def test_shallowk_row_launches_64_deep_bf16_tiles_within_the_rule():
    """evenflow-shallowk (``fused.DEEP_K_BF16`` off around each call: the default before round CG) launches both
    GEMMs of bf16's 16-row tile (T = 8: 4 rows per expert) 64 deep where evenflow's are 128 deep, every other
    constexpr the same, both outputs within the tolerance rule; the switch is back on after each call; the fp8
    formats, which it does not change, are refused."""

    assert "evenflow-shallowk" in bm.EVENFLOW_KNOBS and "evenflow-shallowk" not in bm.DEFAULT_IMPLS
    case = bm.MoECase("tiny256", 4, 4, 2, 256, 128)
    gen = _gen(7)
    ids, tw = bm.make_routing(8, case, gen)
    x = torch.randn(8, case.hidden, generator=gen).bfloat16()
    w = bm.make_weights(case, "bf16", "cpu", torch.Generator().manual_seed(0), std=0.1)
    consts = _knob_gemm_constexprs(("evenflow", "evenflow-shallowk"), w, case, x, ids, tw, "DEEP_K_BF16")
    deep, base = consts["evenflow"], consts["evenflow-shallowk"]
    for kernel in ("moe_gate_up_kernel", "moe_down_kernel"):
        assert (base[kernel]["BLOCK_M"], base[kernel]["BLOCK_K"], deep[kernel]["BLOCK_K"]) == (16, 64, 128), kernel
        assert {k: v for k, v in base[kernel].items() if k != "BLOCK_K"} == \
            {k: v for k, v in deep[kernel].items() if k != "BLOCK_K"}, kernel
    for variant in ("fp8-tensor", "fp8-block"):
        w = bm.make_weights(case, variant, "cpu", torch.Generator().manual_seed(0), std=0.1)
        with pytest.raises(PeerUnavailable, match=f"not applicable to {variant}"):
            bm.build_impl("evenflow-shallowk", w, case, None)


def _moe_row(case, variant, batch, impl, us=None, **extra):
    row = {"case": case, "variant": variant, "batch": batch, "impl": impl, **extra}
    if us is not None:
        row["us"] = us
    return row


def test_issue_targets_score_each_sentence_of_issue_5(tmp_path, capsys):
    """Issue 5's targets from a run's rows: the floor fraction's two thresholds (0.85 up to 512 tokens, 0.6 above),
    "not slower" and the two 1.5x targets from the SGLang row's time over ours, cosine on Qwen3 fp8-block only, a
    point that did not run missed, an ``n/a:`` point (a format that cannot tile the shape) none of the issue's.
    Every expected verdict is written out by hand from the rows' numbers; then ``--rescore`` prints the same."""
    rows = [
        _moe_row("hy3-tp8", "fp8-tensor", 2, "evenflow", 10.0, frac_of_floor=0.86, cosine=0.99999),
        _moe_row("hy3-tp8", "fp8-tensor", 2, "sglang-triton", 14.9),  # 1.49x: not slower, short of 1.5x
        _moe_row("hy3-tp8", "fp8-tensor", 1024, "evenflow", 20.0, frac_of_floor=0.61, cosine=0.99999),
        _moe_row("hy3-tp8", "fp8-tensor", 1024, "sglang-triton", 19.96),  # 0.998x: slower, within 0.5%
        _moe_row("qwen3-30b-a3b", "fp8-block", 512, "evenflow", 30.0, frac_of_floor=0.84, cosine=0.9994),
        _moe_row("qwen3-30b-a3b", "fp8-block", 512, "sglang-triton", 45.0),  # 1.5x, but T > 2: no 1.5x target
        _moe_row("hy3-tp8", "fp8-tensor", 512, "evenflow", 20.0, frac_of_floor=0.85, cosine=0.99999),
        _moe_row("hy3-tp8", "fp8-tensor", 512, "sglang-triton", 30.0),  # 1.5x on the line: met (T <= 512)
        _moe_row("hy3-tp8", "bf16", 8, "evenflow", 10.0, frac_of_floor=0.9, cosine=1.0),
        _moe_row("hy3-tp8", "bf16", 8, "sglang-triton", 9.8),  # 0.98x: slower, not level
        _moe_row("hy3-ep8", "bf16", 1, "evenflow", 10.0, frac_of_floor=0.9, cosine=1.0),
        _moe_row("hy3-ep8", "bf16", 1, "sglang-triton", error="RuntimeError: no sglang"),  # ratios unchecked
        _moe_row("qwen3-30b-a3b", "bf16", 4096, "evenflow", error="skipped: time budget 60s spent"),
        _moe_row("hy3-tp8", "fp8-block", 1, "evenflow", error="n/a: I=192 is not a multiple of 128"),
        _moe_row("hy3-tp8", "fp8-block", 1, "sglang-triton", error="n/a: I=192 is not a multiple of 128"),
    ]
    targets = bm.issue_targets(rows)
    got = {t["target"]: t["ok"] for t in targets}
    assert got == {
        "hy3-tp8 fp8-tensor T=2: frac_of_floor >= 0.85": True,
        "hy3-tp8 fp8-tensor T=2: not slower than sglang-triton": True,
        "hy3-tp8 fp8-tensor T=2: >= 1.5x sglang-triton (T <= 2)": False,
        "hy3-tp8 fp8-tensor T=2: >= 1.5x sglang-triton (hy3-tp8 fp8-tensor, T <= 512)": False,
        "hy3-tp8 fp8-tensor T=1024: frac_of_floor >= 0.6": True,
        "hy3-tp8 fp8-tensor T=1024: not slower than sglang-triton": False,
        "qwen3-30b-a3b fp8-block T=512: frac_of_floor >= 0.85": False,
        "qwen3-30b-a3b fp8-block T=512: not slower than sglang-triton": True,
        "qwen3-30b-a3b fp8-block T=512: cosine >= 0.9995": False,
        "hy3-tp8 fp8-tensor T=512: frac_of_floor >= 0.85": True,
        "hy3-tp8 fp8-tensor T=512: not slower than sglang-triton": True,
        "hy3-tp8 fp8-tensor T=512: >= 1.5x sglang-triton (hy3-tp8 fp8-tensor, T <= 512)": True,
        "hy3-tp8 bf16 T=8: frac_of_floor >= 0.85": True,
        "hy3-tp8 bf16 T=8: not slower than sglang-triton": False,
        "hy3-ep8 bf16 T=1: frac_of_floor >= 0.85": True,
        "hy3-ep8 bf16 T=1: sglang-triton timed beside it": False,
        "qwen3-30b-a3b bf16 T=4096: evenflow ran": False,
    }
    (x,) = [t for t in targets if t["target"].endswith("T=1024: not slower than sglang-triton")]
    assert x["value"] == pytest.approx(19.96 / 20.0)
    path = tmp_path / "moe.json"
    out = rescored(bm.main, rows, path, capsys)
    assert "## issue 5 targets: 9/17 met" in out
    assert "  not slower than sglang-triton: 3/5" in out
    assert "  >= 1.5x sglang-triton at T <= 2: 0/1" in out
    assert "  >= 1.5x sglang-triton on hy3-tp8 fp8-tensor at T <= 512: 1/2" in out
    assert "- MISSED hy3-tp8 fp8-tensor T=1024: not slower than sglang-triton: 0.998 (level: within 0.5%)" in out
    assert "- MISSED hy3-tp8 bf16 T=8: not slower than sglang-triton: 0.980\n" in out  # not level
    assert "- MISSED hy3-ep8 bf16 T=1: sglang-triton timed beside it: RuntimeError: no sglang\n" in out
    assert "- MISSED qwen3-30b-a3b bf16 T=4096: evenflow ran: skipped: time budget 60s spent" in out
    assert "- MISSED qwen3-30b-a3b fp8-block T=512: cosine >= 0.9995: 0.99940\n" in out
    assert "- MISSED qwen3-30b-a3b fp8-block T=512: frac_of_floor >= 0.85: 0.840\n" in out
    path.write_text("[]")
    with pytest.raises(SystemExit, match="--rescore: .*moe.json is not a results file"):
        bm.main(["--rescore", str(path)])
    for bad, why in ((rows + rows[:1], "two evenflow rows at"),  # a point timed twice: which row counts?
                     ([{"case": "64x512", "variant": "bf16-kv", "impl": "evenflow", "us": 1.0}],
                      "not an MoE benchmark"),
                     ([{**rows[0], "cosine": None}], "has no frac_of_floor or cosine")):
        path.write_text(json.dumps({"header": {}, "rows": bad}))
        with pytest.raises(SystemExit, match=f"--rescore: .*moe.json: not an MoE results file .*{why}"):
            bm.main(["--rescore", str(path)])
