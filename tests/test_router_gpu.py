"""Router on the GPU at real shapes: accuracy targets, top-k flips, invariance, graphs, compile.

Standard inputs (BENCH.md): x bf16 ~ N(0, 1), w fp32 ~ N(0, 0.02^2).
"""
import pytest
import torch

import evenflow
from evenflow.reference import router as R
from evenflow.router.dispatch import GemmConfig
from evenflow.router.gemm import launch_shape
from evenflow.testing import assert_exact, assert_within_rule
from tests_support_router import load_tuner, one_block_table_entries

pytestmark = pytest.mark.gpu

SHAPES = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
          "qwen3-30b-a3b": (2048, 128)}
MS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("terms", [3, 2])
@pytest.mark.parametrize("case", list(SHAPES))
def test_max_abs_error_target_all_m(case, terms):
    # Issue 4 target: max |err| vs fp64 <= 1e-4 on the standard inputs, at every M,
    # with the dispatch's configs (tuned table when present). Also within the rule
    # against PyTorch doing the same split math in fp32 (round 1 failed this at split-K 1
    # and K >= 4096: the high product was chained through the MMA accumulator).
    k, n = SHAPES[case]
    rw = None
    for m in MS:
        x, w = _inputs(m, n, k, seed=m)
        rw = evenflow.RouterWeight(w, terms=terms)
        out = evenflow.router_gemm(x, rw)
        ref = R.router_logits_fp64(x, w)
        err = (out.double() - ref).abs().max().item()
        assert err <= 1e-4, f"{case} M={m}: max|err| {err:.2e} > 1e-4"
        base = R.split_logits_fp32(x, *rw.parts)
        assert_within_rule(out, ref, base, what=f"{case} M={m}")


@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 128, 16, 4, 4), GemmConfig(16, 64, 256, 8, 4, 4),
                                 GemmConfig(64, 64, 64, 1, 4, 3), GemmConfig(128, 64, 64, 2, 8, 3),
                                 GemmConfig(128, 128, 64, 1, 8, 4), GemmConfig(32, 32, 64, 5, 4, 2),
                                 GemmConfig(16, 32, 64, 32, 4, 6),  # small-M kind: wide split, deep pipeline
                                 # round AG: 16-wide tiles on 2 warps (tuner candidates at M <= 16)
                                 GemmConfig(16, 16, 128, 8, 2, 4), GemmConfig(16, 16, 64, 16, 2, 6),
                                 # round L kinds at M > 64: 128- and 256-deep K steps with wide splits
                                 GemmConfig(64, 64, 128, 12, 4, 3), GemmConfig(128, 64, 128, 8, 8, 2),
                                 GemmConfig(64, 32, 256, 8, 4, 2), GemmConfig(64, 64, 256, 8, 4, 1),
                                 GemmConfig(128, 32, 256, 8, 8, 2), GemmConfig(64, 32, 128, 8, 4, 2),
                                 GemmConfig(64, 32, 256, 8, 4, 1)],
                         ids=lambda c: (f"{c.block_m}x{c.block_n}x{c.block_k}-s{c.split_k}"
                                        f"-w{c.num_warps}-st{c.num_stages}"))
@pytest.mark.parametrize("terms", [3, 2])
def test_forced_configs_tails(cfg, terms):
    # N and K not multiples of the tiles, several M: masks compile and hold on the GPU.
    for m, n, k in ((1, 200, 4100), (37, 130, 2048), (300, 768, 6144)):
        x, w = _inputs(m, n, k)
        rw = evenflow.RouterWeight(w, terms=terms)
        out = torch.full((m, n), float("nan"), device="cuda")
        evenflow.router_gemm(x, rw, out, config=cfg)
        assert_within_rule(out, R.router_logits_fp64(x, w), R.split_logits_fp32(x, *rw.parts),
                           what=f"{cfg} M{m} N{n} K{k}")


def _fp32_tc_configs():
    """One fp32-tc config the tuner offers per build (tile, warps, stages, split or not), M = 1-256 candidates."""
    tuner = load_tuner()
    builds = {}
    for k, n in SHAPES.values():
        for m in (1, 4, 16, 64, 256):
            for c in tuner.candidates(m, n, k, 132, False):
                if c.path == "fp32-tc":
                    builds.setdefault((c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k > 1), c)
    return sorted(builds.values(), key=str)


@pytest.mark.parametrize("terms", [3, 2])
def test_fp32_tc_is_the_stored_split_bit_for_bit(terms):
    # Round AH: every fp32-tc tile the tuner offers, at the four shapes (M = 1, 16 and 37, a row tile and a
    # row past it), with K / N tails, under each launch mode: the same bits as the stored split's kernel at the
    # same config (the split in registers is split_weight's; its pre-scaled low terms leave the sums as they
    # were), within 1e-4 of fp64 and within the analytic bound of the split and any fp32 summation order. (Not
    # every tile passes the tolerance rule at every shape, with either weight: AH1 read 16 x 32 x 256 at split
    # 12 1.6e-6 against the rule's 1.4e-6 at K4096 M = 1; the tuner times only tiles that pass it, and the
    # table's picks are held to it by test_max_abs_error_target_all_m.)
    from dataclasses import replace
    cfgs = _fp32_tc_configs()
    assert len(cfgs) >= 8
    shapes = list(SHAPES.values()) + [(4100, 200)]
    for i, cfg in enumerate(cfgs):
        k, n = shapes[i % len(shapes)]
        for m in (1, 16, 37):
            x, w = _inputs(m, n, k, seed=i + m)
            rw = evenflow.RouterWeight(w, terms=terms)
            out = torch.full((m, n), float("nan"), device="cuda")
            evenflow.router_gemm(x, rw, out, config=replace(cfg, launch=("plain", "pdl", "pdl-prefetch")[i % 3]))
            stored = evenflow.router_gemm(x, rw, config=replace(cfg, path="triton"))
            assert_exact(out, stored, what=f"{cfg} M{m} N{n} K{k}")
            err = (out.double() - R.router_logits_fp64(x, w)).abs()
            mag = x.double().abs() @ w.double().abs().t()
            bound = ((2.0**-17 if terms == 2 else 0.0) + (k + 2) * 2.0**-24) * mag
            assert err.max().item() <= 1e-4 and bool((err <= bound).all()), f"{cfg} M{m} N{n} K{k}: {err.max():.2e}"


def _simt_configs():
    mod = load_tuner()
    return sorted({c for m in (1, 4, 16, 64) for c in mod.simt_candidates(m)}, key=str)


@pytest.mark.parametrize("cfg", _simt_configs(), ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}-w{c.num_warps}")
def test_fp32_simt_real_shapes_and_tails(cfg):
    # Every fp32-simt config the tuner may pick, on every standard shape plus K/N tails and
    # M beyond BLOCK_M (several row tiles): within the rule against PyTorch's own fp32 GEMM
    # (the same math: exact products, fp32 sums), the 1e-4, and deterministic.
    shapes = [(k, n) for k, n in SHAPES.values()] + [(4100, 200)]
    for k, n in shapes:
        for m in (1, 3, 16, 37):
            x, w = _inputs(m, n, k, seed=m)
            rw = evenflow.RouterWeight(w)
            out = torch.full((m, n), float("nan"), device="cuda")
            evenflow.router_gemm(x, rw, out, config=cfg)
            ref = R.router_logits_fp64(x, w)
            assert (out.double() - ref).abs().max().item() <= 1e-4
            assert_within_rule(out, ref, x.float() @ w.t(), what=f"{cfg} M{m} N{n} K{k}")
            assert torch.equal(out, evenflow.router_gemm(x, rw, config=cfg))


def test_split_k_deterministic_under_contention():
    # The last-arriving program sums the partials in split order: bitwise the same every run.
    x, w = _inputs(4, 192, 4096)
    rw = evenflow.RouterWeight(w)
    cfg = GemmConfig(16, 16, 128, 32, 4, 4)
    first = evenflow.router_gemm(x, rw, config=cfg)
    for _ in range(200):
        assert torch.equal(evenflow.router_gemm(x, rw, config=cfg), first)
    assert int(rw._count.abs().sum()) == 0


@pytest.mark.parametrize("case", ["K4096-N192", "longcat-chat"])
def test_batch_invariance_gpu(case):
    k, n = SHAPES[case]
    x, w = _inputs(1024, n, k)
    rw = evenflow.RouterWeight(w)
    full = evenflow.router_gemm(x, rw, batch_invariant=True)
    for m in (1, 3, 16, 100, 513):
        assert torch.equal(evenflow.router_gemm(x[:m], rw, batch_invariant=True), full[:m]), f"M={m}"
    for i in (0, 77, 1023):
        assert torch.equal(evenflow.router_gemm(x[i:i + 1], rw, batch_invariant=True), full[i:i + 1]), f"row {i}"


def _flips(ids, ref_ids):
    a, b = ids.long().sort(-1).values, ref_ids.long().sort(-1).values
    return int((~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)).sum())


@pytest.mark.parametrize("case", ["K4096-N192", "qwen3-30b-a3b"])
def test_topk_flips_vs_fp64_not_more_than_cublas(case):
    # Issue 4 target: over many tokens, experts that differ from the fp64 top-8 are no
    # more for evenflow (default RouterWeight: three terms, every fp32 weight exact) than
    # for cuBLAS FP32 (as engines call it) and for the same split math done in fp32 by
    # PyTorch. Round 1 (two terms, chained accumulation): 1 flip vs 0 for cuBLAS FP32.
    # Prediction for three terms: error std ~3e-7 vs FP32's ~1.5e-6 -> fewer flips
    # (docs/perf-notes/router.md).
    k, n = SHAPES[case]
    t = 65536
    x, w = _inputs(t, n, k, seed=7)
    rw = evenflow.RouterWeight(w)
    ids, _ = evenflow.route(x, rw, 8, "softmax")
    ref_ids = R.router_logits_fp64(x, w).topk(8, dim=-1).indices
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32_ids = torch.mm(x.float(), w.t()).topk(8, dim=-1).indices
    split_ids = R.split_logits_fp32(x, *rw.parts).topk(8, dim=-1).indices
    ours, fp32, split = _flips(ids, ref_ids), _flips(fp32_ids, ref_ids), _flips(split_ids, ref_ids)
    print(f"{case}: flips over {t} tokens: evenflow {ours}, cuBLAS FP32 {fp32}, fp32 split2 {split}")
    assert ours <= split, (ours, split)
    assert ours <= fp32, (ours, fp32)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_real_shape(scoring):
    k, n = SHAPES["K4096-N192"]
    x, w = _inputs(333, n, k)
    rw = evenflow.RouterWeight(w)
    bias = torch.randn(n, device="cuda") * 0.01 if scoring == "sigmoid" else None
    ids, wt = evenflow.route(x, rw, 8, scoring, bias, True, 2.826 if scoring == "sigmoid" else 1.0)
    logits = evenflow.router_gemm(x, rw)
    ref_ids, ref_w = R.route_ref(logits, 8, scoring, bias, True, 2.826 if scoring == "sigmoid" else 1.0)
    key = logits.double() if scoring == "softmax" else torch.sigmoid(logits.double()) + bias.double()
    srt = key.sort(-1, descending=True).values
    clear = ((srt[:, 7] - srt[:, 8]) > 1e-6).cpu()
    assert_exact(ids.cpu()[clear], ref_ids.cpu()[clear], "ids")
    _, base_w = R.route_ref(logits, 8, scoring, bias, True, 2.826 if scoring == "sigmoid" else 1.0,
                            dtype=torch.float32)
    assert_within_rule(wt.cpu()[clear], ref_w.cpu()[clear], base_w.cpu()[clear], what="weights")


def test_cuda_graph_capture_and_replay():
    k, n = SHAPES["K4096-N192"]
    x, w = _inputs(16, n, k)
    rw = evenflow.RouterWeight(w)
    rw.reserve(16)
    out = torch.empty(16, n, device="cuda")
    ids = torch.empty(16, 8, dtype=torch.int32, device="cuda")
    wt = torch.empty(16, 8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        evenflow.router_gemm(x, rw, out)
        evenflow.route(x, rw, 8, out=(ids, wt))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        evenflow.router_gemm(x, rw, out)
        evenflow.route(x, rw, 8, out=(ids, wt))
    for seed in range(3):
        x.copy_(_inputs(16, n, k, seed=100 + seed)[0])
        g.replay()
        torch.cuda.synchronize()
        _assert_same_routing(x, w, rw, (out, ids, wt), (evenflow.router_gemm(x, rw), *evenflow.route(x, rw, 8)))


def _assert_same_routing(x, w, rw, got, want):
    """Two runs of the same call ((logits, ids, weights) each) agree: bit for bit where the table's config for x's
    rows sums its K slices in a fixed order; where it sums them with float atomics (round BW: the slices meet in
    arrival order) within two summation orders of the same partials, 2 S u of their magnitude (bounded by
    |x| . |w|), both within 1e-4 of fp64, and the top-8 sets equal on rows whose 8th and 9th logits are further
    apart than that slack (a nearer pair may swap). The H200's table has atomic entries at K4096 and LongCat-Lite
    M = 16, the H100's (round CE) at M = 16 and 64 of every shape."""
    (m, k), n = x.shape, w.shape[0]
    cfg = rw.config(m)
    if cfg.reduce != "atomic":
        for a, b, what in zip(got, want, ("logits", "ids", "weights")):
            assert torch.equal(a, b), what
        return
    splits = launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)[1]
    slack = 2 * splits * 2.0**-24 * (x.double().abs() @ w.double().abs().t()).max().item()
    (out, ids, wt), (ref, ids2, wt2) = got, want
    assert (out - ref).abs().max().item() <= slack
    assert (out.double() - R.router_logits_fp64(x, w)).abs().max().item() <= 1e-4
    top9 = ref.topk(9, dim=-1).values
    clear = (top9[:, 7] - top9[:, 8]) > 2 * slack
    assert clear.sum().item() >= m // 2, "too few rows with a clear top-8 to compare"
    assert torch.equal(ids.sort(-1).values[clear], ids2.sort(-1).values[clear])
    assert torch.allclose(wt.sort(-1).values[clear], wt2.sort(-1).values[clear], rtol=1e-5, atol=0)


def test_torch_compile_fullgraph():
    k, n = SHAPES["qwen3-30b-a3b"]
    x, w = _inputs(8, n, k)
    rw = evenflow.RouterWeight(w)
    rw.reserve(8)

    def f(x):
        logits = evenflow.router_gemm(x, rw)
        ids, wt = evenflow.route(x, rw, 8)
        return logits, ids, wt

    # bit for bit where the table's entry for 8 rows sums in a fixed order; within two orders' slack where it is
    # atomic (the H100's Qwen3 M <= 16 entry, round CE)
    _assert_same_routing(x, w, rw, torch.compile(f, fullgraph=True)(x), f(x))


def test_torch_compile_fullgraph_fp32_tc():
    # the fp32-tc path through the custom op (LongCat-Chat M = 16 takes it from the table since round AH)
    k, n = SHAPES["longcat-chat"]
    x, w = _inputs(16, n, k)
    rw = evenflow.RouterWeight(w)
    cfg = GemmConfig(16, 32, 64, 11, 4, 6, "fp32-tc")
    rw.workspace(16, cfg)

    def f(x):
        return evenflow.router_gemm(x, rw, config=cfg)

    got = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(got, f(x))
    assert torch.equal(got, evenflow.router_gemm(x, rw, config=GemmConfig(16, 32, 64, 11, 4, 6)))


def test_opcheck_gpu():
    x, w = _inputs(5, 192, 512)
    rw = evenflow.RouterWeight(w)
    cfg = GemmConfig(16, 32, 128, 4)
    part, count = rw.workspace(5, cfg)
    out = torch.empty(5, 192, device="cuda")
    torch.library.opcheck(torch.ops.evenflow.router_gemm_split.default,
                          (x, rw.w_hi, rw.w_lo, rw.w_lo2, out, part, count, 3, 16, 32, 128, 4, 4, 4, True, True))



def _graph_of(steps) -> torch.cuda.CUDAGraph:
    """``steps()`` run once on a side stream (compiles and allocates outside capture), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        steps()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        steps()
    return g


def _replays(g: torch.cuda.CUDAGraph, outs, reps: int = 3):
    """Replay ``g`` ``reps`` times, ``outs`` filled with NaN before each (an unwritten output fails); yields
    the replay's index once it has finished."""
    for rep in range(reps):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        yield rep


@pytest.mark.parametrize("m, cfg", [(1, GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt")),
                                    (1, GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt", "pdl-preload")),
                                    (4, GemmConfig(4, 8, 128, 16, 4, 3, "fp32-splitk")),
                                    (16, GemmConfig(16, 32, 128, 16, 4, 4)), (512, GemmConfig(64, 32, 256, 4, 4, 2))],
                         ids=["simt-m1", "simt-m1-preload", "splitk-m4", "triton-m16", "triton-m512"])
def test_pdl_chain_in_graph_same_bits(m, cfg):
    # Round AD: router kernels launch with programmatic dependent launch (the tuned default almost
    # everywhere), waiting at their top for the kernel ahead, the GEMMs' first row tile asking L2 for the
    # weight lines before that. A graph chains, per step, a torch copy writing x, a router GEMM reading it
    # (split-K counters and partials shared by every step) and a top-k kernel reading the GEMM's logits;
    # each step's output must be the bits of the same call made eagerly without PDL.
    k, n = SHAPES["qwen3-30b-a3b"]
    srcs = [_inputs(m, n, k, seed=200 + i)[0] for i in range(6)]
    _, w = _inputs(m, n, k)
    rw = evenflow.RouterWeight(w)
    rw.workspace(m, cfg)
    x = torch.empty_like(srcs[0])
    outs = [torch.empty(m, n, device="cuda") for _ in srcs]
    ids = [torch.empty(m, 8, dtype=torch.int32, device="cuda") for _ in srcs]
    wts = [torch.empty(m, 8, device="cuda") for _ in srcs]

    def steps():
        for i, src in enumerate(srcs):
            x.copy_(src)
            # the preload (round BM) is the config's choice only where prefetch_weights is left at None
            evenflow.router_gemm(x, rw, outs[i], config=cfg, pdl=True,
                                 prefetch_weights=None if cfg.launch == "pdl-preload" else True)
            evenflow.select_experts(outs[i], 8, out=(ids[i], wts[i]), pdl=True)

    for rep in _replays(_graph_of(steps), outs):
        for i, src in enumerate(srcs):
            want = evenflow.router_gemm(src, rw, config=cfg, pdl=False)
            assert_exact(outs[i], want, f"rep {rep} step {i} logits")
            wid, wwt = evenflow.select_experts(want, 8, pdl=False)
            assert_exact(ids[i], wid, f"rep {rep} step {i} ids")
            assert_exact(wts[i], wwt, f"rep {rep} step {i} weights")


def test_preload_after_an_in_place_weight_update_reads_the_new_weight():
    # Round BM: launch "pdl-preload" loads the weight before its PDL wait. An in-place update of a RouterWeight's
    # source (auto_refresh) re-splits before the call, so the split's kernels sit between the write and the router
    # kernel: every call after an update must give the new weight's output, bit for bit the call without PDL.
    k, n = SHAPES["qwen3-30b-a3b"]
    x, w = _inputs(1, n, k)
    rw = evenflow.RouterWeight(w.clone(), auto_refresh=True)
    cfg = GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt", "pdl-preload")
    for i in range(8):
        new = _inputs(1, n, k, seed=400 + i)[1]
        rw.source.copy_(new)
        out = evenflow.router_gemm(x, rw, config=cfg)
        want = evenflow.router_gemm(x, rw, config=cfg, pdl=False)
        assert_exact(out, want, f"update {i}")
        assert_within_rule(out, R.router_logits_fp64(x, new), R.split_logits_fp32(x, *rw.parts),
                           what=f"update {i}")


@pytest.mark.parametrize("path", ["fp32-simt", "triton"])
def test_pdl_weight_prefetch_never_reads_old_weights(path):
    # Round AD: with PDL each GEMM program asks L2 for its weight lines before waiting for the kernel
    # ahead. Here the kernel ahead is the copy that writes those weights (a new weight every step of
    # the graph): the outputs must still be those of the new weights, bit for bit (L2 holds no stale
    # lines; the prefetch is only a hint). The launchers are called through the custom ops, which take
    # the weight tensors as they are (no RouterWeight freshness check).
    k, n = SHAPES["qwen3-30b-a3b"]
    m = 1 if path == "fp32-simt" else 512
    x, _ = _inputs(m, n, k)
    ws = [_inputs(1, n, k, seed=300 + i)[1] for i in range(6)]
    rws = [evenflow.RouterWeight(w) for w in ws]
    src = torch.empty_like(ws[0])
    parts = [torch.empty_like(p) for p in rws[0].parts]
    cfg = GemmConfig(64, 32, 256, 4, 4, 2)
    part, count = rws[0].workspace(m, cfg)
    outs = [torch.empty(m, n, device="cuda") for _ in ws]

    def steps():
        for i, rw in enumerate(rws):
            if path == "fp32-simt":
                src.copy_(rw.source)
                torch.ops.evenflow.router_gemm_fp32(x, src, outs[i], 1, 1, 2048, 8, 1, True, True)
            else:
                for dst, p in zip(parts, rw.parts):
                    dst.copy_(p)
                torch.ops.evenflow.router_gemm_split(x, *parts, outs[i], part, count, 3, cfg.block_m, cfg.block_n,
                                                     cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages,
                                                     True, True)

    for rep in _replays(_graph_of(steps), outs):
        for i, rw in enumerate(rws):
            cfg_i = GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt") if path == "fp32-simt" else cfg
            want = evenflow.router_gemm(x, rw, config=cfg_i, pdl=False, prefetch_weights=False)
            assert_exact(outs[i], want, f"rep {rep} step {i}")


def test_one_block_build_gives_the_loop_builds_bits_at_the_tables_tiles():
    # Round BQ: router_gemm runs the fp32-simt one-block build wherever K is one block. At the H200 table's tiles it
    # gives the loop build's output bit for bit (round BQ3 measured it at each; the sm_90 test checks that both
    # builds issue the same operations in the same order), within the rule of fp64 either way, so switching the
    # build changed no routing. Real shapes, each entry's own launch mode, every row of a 16-row bucket. Since round
    # CE the H100's table too: its LongCat-Lite M = 1 (16 warps) and M = 4 tiles are new.
    from evenflow import _runtime
    from evenflow.router.gemm import _launch_fp32

    entries = one_block_table_entries()  # every committed table's tiles, whichever GPU runs the test
    for m, n, k, c in entries:
        x, w = _inputs(m, n, k, seed=m + k)
        ref = R.router_logits_fp64(x, w)
        pdl = c["launch"] != "plain" and _runtime.pdl_supported(w.device)
        outs = []
        for one in (False, True):
            out = torch.full((m, n), float("nan"), device="cuda")
            _launch_fp32(x, w, out, c["block_m"], c["block_n"], c["block_k"], c["num_warps"], 1, pdl,
                         pdl and c["launch"] == "pdl-prefetch", pdl and c["launch"] == "pdl-preload", one)
            assert_within_rule(out, ref, x.float() @ w.t(), what=f"{c} M{m} N{n} K{k} one_block={one}")
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), (m, n, k, c)
