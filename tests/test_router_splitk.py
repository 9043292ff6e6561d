"""fp32-splitk: the small-M router GEMM on CUDA cores, K split over the GPU, reduced in one launch.

What is checked, and why:

* Values against the fp64 product (``evenflow.reference.router``) by the tolerance rule, with
  PyTorch's own fp32 GEMM as the baseline (the same math: the fp32 weight as stored, fp32
  sums), plus the analytic bound K u |x|.|w| (any fp32 summation order of K terms with one
  rounding per FMA stays inside it).
* The reduction: the output is bitwise the in-order fp32 sum of the per-split partials left in
  the workspace (the last program sums in split order, not arrival order), over one and
  several chunks of RED_CHUNK loads.
* The arrival counters are back at zero after every call, so the next call (or graph replay)
  starts clean: consecutive calls with different M and configs sharing one RouterWeight give
  bitwise what a fresh RouterWeight gives.
* Masked tails: N not a multiple of BLOCK_N, K not a multiple of BLOCK_K, M not a multiple of
  BLOCK_M (several row tiles), into NaN-poisoned outputs.
* Batch invariance under a fixed config; dispatch (heuristic, table); clear errors; opcheck.
* sm_90: every config the tuner and the heuristic can launch compiles, without spills, with
  a cp.async pipeline (recorded through the interpreter at real shapes).
* GPU (``@pytest.mark.gpu``): real shapes, 1e-4 and the rule, determinism under contention,
  CUDA-graph capture and replay with changing inputs, flips vs cuBLAS FP32.
"""

import dataclasses

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.reference import router as R
from evenflow.router import dispatch
from evenflow.router.dispatch import GemmConfig
from evenflow.router.gemm import launch_shape
from evenflow.testing import assert_fp32_gemm_within_bound, assert_within_rule, poisoned
from tests_support_router import load_benchmark, load_tuner, router_inputs, run_fp32_config


def _cfg(bm, bn, bk, split, warps=4, stages=3):
    return GemmConfig(bm, bn, bk, split, warps, stages, "fp32-splitk")


_inputs = router_inputs


_check = assert_fp32_gemm_within_bound  # the rule plus the analytic bound K u |x|.|w|


def _counters_zero(rw):
    return int(rw._count.abs().sum()) == 0


# ----------------------------------------------------------------------------- values, tails

CASES = [
    # (M, N, K, config): why
    (1, 40, 128, _cfg(1, 8, 32, 4)),           # M=1, 4 splits of one step each
    (1, 17, 100, _cfg(1, 4, 16, 3)),           # N one past a tile, K tail inside the last split
    (3, 24, 96, _cfg(4, 8, 16, 6, 2, 2)),      # BLOCK_M > M (masked rows), 2 warps, 2 stages
    (20, 9, 130, _cfg(8, 4, 32, 2)),           # several row tiles (M one past 2 x 8 + 4), K tail
    (16, 10, 384, _cfg(4, 2, 128, 1, 4, 5)),   # a fat tile four rows high at M = 16: row tiles over the grid
    (13, 11, 320, _cfg(8, 4, 64, 2, 4, 3)),    # eight rows high, two row tiles (the second masked), split 2
    (16, 20, 512, _cfg(8, 8, 32, 4, 8, 3)),    # an 8 x 8 tile on 8 warps, split 4 (round BH's widest), N tail
    (16, 33, 256, _cfg(16, 2, 16, 5, 4, 4)),   # uneven split: 16 blocks in 5 slices (4, 4, 4, 4)
    (5, 70, 64, _cfg(8, 16, 64, 1)),           # no split: direct store, no counter
    (2, 12, 640, _cfg(2, 4, 16, 40, 1, 3)),    # 32 + 8 splits: two reduction chunks (RED_CHUNK 32), 1 warp
]


@pytest.mark.parametrize("m,n,k,cfg", CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-{c[3].block_m}x{c[3].block_n}x{c[3].block_k}-s{c[3].split_k}"
                              for c in CASES])
def test_fp32_splitk_matches_fp64(device, m, n, k, cfg):
    x, w = _inputs(m, n, k, device)
    rw = run_fp32_config(x, w, cfg, f"{cfg} M={m} N={n} K={k}")
    assert _counters_zero(rw)


@pytest.mark.parametrize("cfg,m,k", [(GemmConfig(4, 2, 32, 1, 2, 1, "fp32-simt"), 6, 80), (_cfg(8, 4, 16, 3), 7, 96)],
                         ids=["fp32-simt", "fp32-splitk"])
def test_fp32_paths_large_values_and_strided_x(device, cfg, m, k):
    # both CUDA-core paths: weights and activations far from 1; x rows with a stride (a view
    # of a wider buffer); K not a multiple of the simt path's block
    n = 12
    xb = (torch.randn(m, k + 16, device=device) * 300).to(torch.bfloat16)
    x = xb[:, :k]
    w = torch.randn(n, k, device=device) * 1e3
    rw = evenflow.RouterWeight(w)
    _check(evenflow.router_gemm(x, rw, config=cfg), x, w, f"{cfg.path}: large values, strided x")


@pytest.mark.parametrize("splits", [5, 32, 33, 70])
def test_reduction_is_the_in_order_sum_of_the_partials(device, splits):
    # The workspace holds each split's partial, tile-major [tiles, splits, BM, BN]. The output
    # must be bitwise their fp32 sum taken one at a time in split order, for every tile, over
    # one chunk (5, 32) or several (33: a chunk of 32 and one of 1; 70: three).
    m, n, bm, bn, bk = 3, 10, 4, 4, 16
    k = bk * splits
    cfg = _cfg(bm, bn, bk, splits)
    assert cfg.red_chunk() == 32
    assert launch_shape(m, n, k, bm, bn, bk, splits)[1] == splits
    x, w = _inputs(m, n, k, device)
    rw = evenflow.RouterWeight(w)
    out = poisoned((m, n), torch.float32, device)
    evenflow.router_gemm(x, rw, out, config=cfg)
    _check(out, x, w, f"split {splits}")
    tiles_n = -(-n // bn)
    part = rw._part[: tiles_n * splits * bm * bn].view(tiles_n, splits, bm, bn).cpu()
    want = torch.zeros(tiles_n, bm, bn)
    for s in range(splits):
        want = want + part[:, s]
    want = want.permute(1, 0, 2).reshape(bm, tiles_n * bn)[:m, :n]
    assert torch.equal(out.cpu(), want)
    assert _counters_zero(rw)


# ----------------------------------------------------------------------------- workspace reuse


def test_consecutive_calls_share_one_workspace(device):
    # One RouterWeight, its workspace reused by calls with different M, tiles, split counts and
    # paths (the tensor-core split-K kernel uses the same counters). Each result must be bitwise
    # what a fresh RouterWeight gives (a counter left non-zero, or a partial read from another
    # call, would show) and every counter must be back at zero after every call.
    n, k = 24, 192
    x, w = _inputs(16, n, k, device)
    shared = evenflow.RouterWeight(w)
    plan = [(1, _cfg(1, 8, 32, 6)), (16, _cfg(16, 4, 16, 12, 4, 4)), (16, _cfg(16, 4, 16, 12, 4, 4)),
            (3, _cfg(4, 8, 16, 5)), (1, _cfg(1, 8, 32, 6)), (7, GemmConfig(16, 16, 32, 3, 4, 1)),
            (7, _cfg(8, 2, 16, 4, 2, 2)), (16, _cfg(16, 4, 16, 12, 4, 4)), (2, _cfg(2, 16, 64, 1))]
    for i, (m, cfg) in enumerate(plan):
        got = evenflow.router_gemm(x[:m], shared, config=cfg)
        assert _counters_zero(shared), f"call {i}: counters not reset"
        fresh = evenflow.router_gemm(x[:m], evenflow.RouterWeight(w), config=cfg)
        assert torch.equal(got, fresh), f"call {i} (M={m}, {cfg}) differs from a fresh workspace"
        if cfg.path == "fp32-splitk":
            _check(got, x[:m], w, f"call {i}")


def test_workspace_is_sized_once_and_reused(device):
    # reserve() sizes the workspace for every config the dispatch may pick up to max_tokens;
    # calls then never grow (replace) it, which a captured CUDA graph relies on.
    n, k = 40, 256
    x, w = _inputs(16, n, k, device)
    rw = evenflow.RouterWeight(w)
    cfg = _cfg(16, 4, 16, 8)
    need_part, need_count = cfg.workspace_sizes(16, n, k)
    assert need_part == 10 * 8 * 16 * 4 and need_count == 10
    rw.workspace(16, cfg)
    part, count = rw._part, rw._count
    for m in (16, 1, 9, 16):
        evenflow.router_gemm(x[:m], rw, config=cfg)
        assert rw._part is part and rw._count is count
    assert _counters_zero(rw)
    assert _cfg(16, 4, 16, 1).workspace_sizes(16, n, k) == (0, 0)  # no split, no workspace
    assert GemmConfig(path="torch-fp32").workspace_sizes(16, n, k) == (0, 0)


def test_reserve_sizes_each_config_for_its_own_m_range(device, monkeypatch):
    # reserve(max_tokens): every M up to max_tokens then runs without growing the workspace,
    # and a small-M split-K config is sized for its own M range, not for max_tokens rows.
    n, k = 24, 256
    small, big = _cfg(4, 8, 16, 8), GemmConfig(16, 16, 32, 2, 4, 1)
    monkeypatch.setattr("evenflow.router.gemm.choose_config",
                        lambda m, *a, **kw: small if m <= 4 else big)
    x, w = _inputs(40, n, k, device)
    rw = evenflow.RouterWeight(w)
    rw.reserve(40)
    want = max(small.workspace_sizes(4, n, k)[0], big.workspace_sizes(40, n, k)[0])
    assert rw._part.numel() == want < small.workspace_sizes(40, n, k)[0]
    part, count = rw._part, rw._count
    for m in (1, 4, 5, 40, 3):
        out = evenflow.router_gemm(x[:m], rw)
        if m <= 4:
            _check(out, x[:m], w, f"M={m}")
        assert rw._part is part and rw._count is count and _counters_zero(rw)


def test_too_small_workspace_raises(device):
    x, w = _inputs(4, 16, 64, device)
    out = torch.empty(4, 16, device=device)
    with pytest.raises(ValueError, match="workspace too small"):
        torch.ops.evenflow.router_gemm_fp32_splitk.default(
            x, w, out, torch.empty(8, device=device), torch.zeros(1, dtype=torch.int32, device=device),
            4, 4, 16, 4, 4, 2, False, False)


# ----------------------------------------------------------------------------- batch invariance


def test_fixed_config_is_batch_invariant(device):
    # One config for every M: a row's FMA chains, tree sum and split order depend only on the
    # config and K, so row i is bitwise the same at any M and whatever the other rows hold.
    n, k = 20, 160
    cfg = _cfg(8, 4, 32, 3)
    x, w = _inputs(37, n, k, device)
    rw = evenflow.RouterWeight(w)
    full = evenflow.router_gemm(x, rw, batch_invariant=True, config=cfg)
    for m in (1, 5, 8, 17):
        assert torch.equal(evenflow.router_gemm(x[:m], rw, batch_invariant=True, config=cfg), full[:m]), m
    for i in (0, 9, 36):
        assert torch.equal(evenflow.router_gemm(x[i:i + 1], rw, batch_invariant=True, config=cfg), full[i:i + 1])
    other = x.clone()
    other[1:] = (torch.randn_like(other[1:].float()) * 100).to(torch.bfloat16)
    assert torch.equal(evenflow.router_gemm(other, rw, batch_invariant=True, config=cfg)[0], full[0])


def test_batch_invariant_table_accepts_splitk_not_simt():
    table = {"batch_invariant": [{"K": 64, "N": 32, "terms": 3, "config": _cfg(16, 4, 16, 2).to_dict()}]}
    cfg = dispatch.choose_config(5, 32, 64, torch.device("cpu"), True, facts=(table, 132))
    assert cfg.path == "fp32-splitk"
    table["batch_invariant"][0]["config"] = GemmConfig(1, 1, 64, 1, 4, 1, "fp32-simt").to_dict()
    with pytest.raises(ValueError, match="batch-invariant"):
        dispatch.choose_config(5, 32, 64, torch.device("cpu"), True, facts=(table, 132))


# ----------------------------------------------------------------------------- dispatch


SHAPES = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
          "qwen3-30b-a3b": (2048, 128)}


@pytest.mark.parametrize("case", list(SHAPES))
def test_heuristic_picks_splitk_at_small_m_and_fills_the_gpu(case):
    k, n = SHAPES[case]
    for m in range(1, 17):
        c = dispatch.heuristic_config(m, n, k, sms=132)
        assert c.path == "fp32-splitk", (m, c)
        _, split, grid = launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)
        programs = grid[0] * grid[1]
        assert 132 <= programs <= 4 * 132, (m, c, programs)  # every SM reads a slice of W
        assert c.block_m >= m or m > 16
        assert c == c.fit_smem(3)  # the pipeline fits
    assert dispatch.heuristic_config(17, n, k, sms=132).path == "triton"


def test_table_entry_selects_splitk(device, monkeypatch):
    entries = [{"K": 64, "N": 16, "terms": 3, "m_max": 4, "config": _cfg(4, 4, 16, 2).to_dict()},
               {"K": 64, "N": 16, "terms": 3, "m_max": 64, "config": GemmConfig(16, 16, 16, 1).to_dict()}]
    assert dispatch._lookup(entries, 3, 16, 64, 3) == _cfg(4, 4, 16, 2)
    assert dispatch._lookup(entries, 5, 16, 64, 3).path == "triton"
    # through router_gemm and route(), the table's choice is taken
    monkeypatch.setattr("evenflow.router.gemm.choose_config",
                        lambda m, n, k, *a, **kw: dispatch._lookup(entries, m, n, k, 3))
    x, w = _inputs(3, 16, 64, device)
    rw = evenflow.RouterWeight(w)
    assert rw.config(3).path == "fp32-splitk"
    logits = evenflow.router_gemm(x, rw)
    _check(logits, x, w, "dispatched fp32-splitk")
    ids, wt = evenflow.route(x, rw, top_k=4)
    ids2, wt2 = evenflow.select_experts(logits, 4)
    assert torch.equal(ids, ids2) and torch.equal(wt, wt2)
    assert _counters_zero(rw)


def test_splitk_config_validation(device):
    with pytest.raises(ValueError, match="block_n"):
        _cfg(1, 3, 64, 2)
    with pytest.raises(ValueError, match="block_k"):
        _cfg(1, 4, 8, 2)
    with pytest.raises(ValueError, match="split_k"):
        _cfg(1, 4, 64, 0)
    with pytest.raises(ValueError, match="split_k"):
        _cfg(1, 4, 64, 300)
    with pytest.raises(ValueError, match="accumulators"):
        _cfg(16, 16, 256, 2, 4)  # 512 fp32 accumulators a thread
    with pytest.raises(ValueError, match="num_warps"):
        _cfg(1, 4, 64, 2, 3)
    c = _cfg(16, 16, 64, 8, 8, 4)
    assert c.stage_bytes(3) == 16 * 64 * 2 + 16 * 64 * 4
    assert c.fit_smem(3, limit=3 * c.stage_bytes(3)).num_stages == 3
    assert GemmConfig.from_dict(c.to_dict()) == c


def test_opcheck_router_gemm_fp32_splitk_op(device):
    x, w = _inputs(3, 16, 64, device)
    rw = evenflow.RouterWeight(w)
    cfg = _cfg(4, 4, 16, 2)
    part, count = rw.workspace(3, cfg)
    out = torch.empty(3, 16, device=device)
    torch.library.opcheck(torch.ops.evenflow.router_gemm_fp32_splitk.default,
                          (x, w, out, part, count, 4, 4, 16, 2, 4, 3, False, False))


def test_tuner_candidates_above_64_rows():
    """From a few hundred rows up the tuner offers 64-, 128- and 256-deep K steps with K slices
    of at least 256 (round L), shared memory within a block's limit for three weight parts, and
    L4's pick for Qwen3 at M = 512 (64x64, 128-deep steps, split 6) among them."""
    tuner = load_tuner()
    for k, n in SHAPES.values():
        for m in (128, 512, 2048):
            tri = [c for c in tuner.candidates(m, n, k, 132) if c.path == "triton"]
            assert {c.block_k for c in tri} == {64, 128, 256}
            for c in tri:
                k_slice = -(-k // c.split_k)
                assert c.split_k == 1 or k_slice >= 256, f"{c}: {k_slice}-deep slices at K={k}"
                assert c.fit_smem(3).num_stages >= 1
                assert c.fit_smem(3) == c, f"{c}: offered with more stages than shared memory holds"
    assert GemmConfig(64, 64, 128, 6, 4, 3) in tuner.candidates(512, 128, 2048, 132)


def test_tuner_times_the_table_entry_in_its_own_preload_mode():
    """The tuner re-times the bucket's table entry first (the incumbent a challenger must beat twice by > 1%):
    at the candidates' default launch, but an entry on "pdl-preload" as it runs, since its tiles are candidates of
    their own in that mode (round BN3: K4096 M = 4's entry timed at "pdl" read 3.60 us against its 3.00)."""
    tuner = load_tuner()
    simt = GemmConfig(4, 2, 4096, 1, 16, 1, "fp32-simt", "pdl-preload")
    splitk = GemmConfig(4, 2, 1024, 1, 4, 5, "fp32-splitk", "pdl-prefetch")
    table = {"entries": [{"K": 4096, "N": 192, "terms": 3, "m_max": 4, "config": simt.to_dict()},
                         {"K": 2048, "N": 128, "terms": 3, "m_max": 4, "config": splitk.to_dict()}]}
    assert tuner.table_incumbent(table, 4096, 192, 3, 4) == simt
    assert tuner.table_incumbent(table, 2048, 128, 3, 4) == dataclasses.replace(splitk, launch=GemmConfig().launch)
    plain_simt = GemmConfig(4, 2, 2048, 1, 8, 1, "fp32-simt", "pdl-prefetch")  # a simt entry on another mode
    table["entries"].append({"K": 3072, "N": 384, "terms": 3, "m_max": 4, "config": plain_simt.to_dict()})
    assert tuner.table_incumbent(table, 3072, 384, 3, 4) == dataclasses.replace(plain_simt,
                                                                                 launch=GemmConfig().launch)
    assert tuner.table_incumbent(table, 4096, 192, 3, 16) is None
    assert tuner.table_incumbent(table, 4096, 192, 2, 4) is None  # another term count is another bucket
    # the preload entry is among the bucket's candidates in that mode, so the tuner's list keeps it once
    assert simt in tuner.candidates(4, 192, 4096, 132)


def test_tuner_offers_splitk_first_and_merges_bucket_runs():
    tuner = load_tuner()
    for k, n in SHAPES.values():
        for m in (1, 4, 8, 16):
            cands = tuner.candidates(m, n, k, 132)
            assert cands[0] == dispatch.heuristic_splitk_config(m, n, k, 132)
            sk = [c for c in cands if c.path == "fp32-splitk"]
            # 1.5 and 3 programs an SM for each register block; at M <= 4 also the fat tiles (round AG2), on 2 warps
            # and with deeper pipelines too (round AU)
            bm = min(16, 1 << (m - 1).bit_length())
            # round BG: past M = 4 also the fat tiles four rows high, their row tiles over the grid; round BH: past
            # M = 8 eight rows high too, each at 64 accumulators a thread
            own = [c for c in sk if c.block_m == bm]
            assert 4 <= len(own) <= (12 if m > 4 else 44)
            fat = [c for c in sk if c.block_m != bm]
            assert all(c.block_m in (4, 8) and c.block_m < bm and c.split_k <= (4 if c.block_m * c.block_n >= 64 else 2)
                       for c in fat) and (m <= 4) == (own == sk)
            assert all(c.block_n * c.block_k <= 8 * 32 * c.num_warps for c in fat if c.block_m == 8)
            assert (m > 8) == any(c.block_m == 8 for c in fat)
            if m > 4:  # four-row tiles 4 and 8 columns wide; at M = 16 the 8 x 8 tiles split up to 4 ways
                assert {4, 8} <= {c.block_n for c in fat if c.block_m == 4 and c.block_k == 256}
                assert (m > 8) == any(c.block_m * c.block_n == 64 and c.split_k == 4 for c in fat)
            # round AH: an fp32-tc twin of every tensor tile of <= 64 weights a thread a K step, and no other
            fits = lambda c: c.block_n * c.block_k <= 64 * 32 * c.num_warps  # noqa: E731
            tile = lambda c: (c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps)  # noqa: E731
            tc = [c for c in cands if c.path == "fp32-tc"]
            assert {tile(c) for c in cands if c.path == "triton" and fits(c)} <= {tile(c) for c in tc}
            assert tc and all(fits(c) for c in tc)
        assert not [c for c in tuner.candidates(64, n, k, 132) if c.path == "fp32-splitk"]
        # round AH3: fp32-tc twins up to M = 512 at <= 32 weights a thread a K step, none beyond
        for m in (64, 512):
            cands = tuner.candidates(m, n, k, 132)
            tc = [c for c in cands if c.path == "fp32-tc"]
            assert {tile(c) for c in cands if c.path == "triton" and c.block_n * c.block_k <= 32 * 32 * c.num_warps} \
                == {tile(c) for c in tc}
        assert not [c for c in tuner.candidates(1024, n, k, 132) if c.path == "fp32-tc"]
    # --buckets 1,4,16 on K4096: its other buckets, other shapes and the invariant entries stay
    e = [{"K": 4096, "N": 192, "terms": 3, "m_max": mm, "config": {}} for mm in (1, 4, 16, 64, 8192)]
    e += [{"K": 2048, "N": 128, "terms": 3, "m_max": 1, "config": {}},
          {"K": 4096, "N": 192, "terms": 2, "m_max": 1, "config": {}}]
    inv = [{"K": 4096, "N": 192, "terms": 3, "config": {}}]
    table = {"entries": e, "batch_invariant": inv}
    kept, kept_inv = tuner.kept_entries(table, {(4096, 192, 3)}, (1, 4, 16), False)
    assert [(x["K"], x["m_max"], x.get("terms")) for x in kept] == \
        [(4096, 64, 3), (4096, 8192, 3), (2048, 1, 3), (4096, 1, 2)]
    assert kept_inv == inv
    kept, kept_inv = tuner.kept_entries(table, {(4096, 192, 3)}, None, True)  # a full run
    assert [(x["K"], x.get("terms")) for x in kept] == [(2048, 3), (4096, 2)] and kept_inv == []


def test_tuner_budget_bounds_timing_not_compiles():
    # Round CE1: the share was the wall time left since the run's start over the buckets left, so the first two
    # buckets (36 s and 24 s on an H100, mostly compiling) spent a 70 s budget before the third bucket timed
    # anything, and every bucket after got the 1 s floor (K4096 M = 16 timed 81 of 198 candidates). The share now
    # depends on the time spent timing only.
    tuner = load_tuner()
    budget, buckets = 70.0, 11
    timed, shares = 0.0, []
    for left in range(buckets, 0, -1):
        share = tuner.bucket_share(budget, timed, left)
        shares.append(share)
        timed += share  # each bucket spends its whole share timing (and any time compiling, which is not counted)
    assert shares == [pytest.approx(budget / buckets)] * buckets  # even, whatever the compiles took
    assert timed == pytest.approx(budget)  # the buckets together time for the budget, no more
    # a bucket that times less than its share leaves the rest to the buckets after it
    assert tuner.bucket_share(budget, 0.0, 2) == 35.0 and tuner.bucket_share(budget, 10.0, 1) == 60.0
    # an overspent budget still lets every bucket time its first candidates (1 s)
    assert tuner.bucket_share(budget, 100.0, 3) == 1.0


# ----------------------------------------------------------------------------- sm_90 compile


def _all_splitk_configs():
    """One (config, M, N, K) per compiled variant the tuner or the heuristic can launch at the
    standard shapes (the split count and M are runtime arguments: one compile covers them)."""
    tuner = load_tuner()
    out = {}
    for k, n in SHAPES.values():
        for m in (1, 2, 4, 8, 16):
            for c in tuner.splitk_candidates(m, n, k, 132):
                split = launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1]
                key = (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, split > 1)
                out.setdefault(key, (c, m, n, k))
    return list(out.values())


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_splitk_configs_compile_for_sm90_without_spills():
    CC = pytest.importorskip("evenflow._compile_check")
    cfgs = _all_splitk_configs()
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rws = {}
        for cfg, m, n, k in cfgs:
            rw = rws.setdefault((n, k), evenflow.RouterWeight(torch.randn(n, k) * 0.02))
            evenflow.router_gemm(torch.empty(m, k, dtype=torch.bfloat16), rw, config=cfg)
        # K and N tails (no cp.async there: masked K loads) and a no-split launch
        rw = evenflow.RouterWeight(torch.randn(200, 4100) * 0.02)
        for m in (1, 4, 16):
            evenflow.router_gemm(torch.empty(m, 4100, dtype=torch.bfloat16), rw)
        evenflow.router_gemm(torch.empty(1, 4096, dtype=torch.bfloat16), rws[192, 4096], config=_cfg(1, 16, 256, 1))
    assert {la.name for la in launches} == {"router_gemm_fp32_splitk_kernel"}
    stats = CC.compile_stats(launches)
    errors = [s["error"] for s in stats if "error" in s]
    assert not errors, "\n\n".join(errors)
    for s in stats:
        assert s["spill_bytes"] == 0, s["describe"]
        assert s["shared"] <= dispatch.SMEM_LIMIT, s["describe"]
        even = "EVEN_K=True" in s["describe"]
        piped = any(any(op.startswith("LDGSTS") for op in lp["ops"]) for lp in s["loops"])
        # the K loop streams through cp.async (the pipeliner took the loads) wherever K is even
        assert piped or not even, f"{s['describe']}: no cp.async in any loop"


# ----------------------------------------------------------------------------- GPU, real shapes


def test_tuner_offers_one_block_row_tiles_at_16_rows_only_where_k_is_one_block():
    """Round BQ: at the M = 16 bucket the tuner offers the M = 4 bucket's one-block simt tiles (4 rows, 2 weight rows,
    the whole K in one block) over the grid's rows, where K fits one block of at most 4096; not where K is longer
    (LongCat-Chat's 6144 would need the loop build, whose 128 values a thread spill), nor at other buckets. Round BR:
    the 4 x 4 and 8 x 2 tiles beside them (half the x, or half the weight, read over the grid)."""
    tuner = load_tuner()
    tiles = {(4, 2), (4, 4), (8, 2)}

    def one_block(m, n, k):
        return {(c.block_m, c.block_n, c.block_k, c.num_warps) for c in tuner.candidates(m, n, k, 132)
                if c.path == "fp32-simt" and (c.block_m, c.block_n) in tiles and c.block_k >= k}
    assert one_block(16, 128, 2048) == {(bm, bn, 2048, w) for bm, bn in tiles for w in (8, 16)}
    assert one_block(16, 384, 3072) == {(bm, bn, 4096, w) for bm, bn in tiles for w in (8, 16)}
    assert one_block(16, 768, 6144) == set()
    assert one_block(64, 128, 2048) == set()
    # the M = 4 bucket's own simt tiles of 2 weight rows stay (its loop-build 1 x 2048 tile over the rows is older)
    assert {(4, 2, 2048, 8), (4, 2, 2048, 16)} <= one_block(4, 128, 2048)


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_tuner_one_block_tiles_at_16_rows_build_for_sm90_without_spills():
    """Every one-block simt tile the tuner offers at the M = 16 bucket (round BR's among them), as router_gemm
    launches it (the preload, the ONE_BLOCK build) at the tuned shapes whose K is one block, builds for sm_90 without
    spilling (round BR: 48-128 registers; a spilling tile would stall on local memory where it should read x)."""
    CC = pytest.importorskip("evenflow._compile_check")
    tuner = load_tuner()
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for k, n in tuner.CASES.values():
            if k > 4096:
                continue
            rw = evenflow.RouterWeight(torch.randn(n, k) * 0.02)
            for c in tuner.candidates(16, n, k, 132):
                if c.path == "fp32-simt" and c.block_k >= k and c.block_m > 1:
                    cfg = dataclasses.replace(c, launch="pdl-preload")
                    evenflow.router_gemm(torch.empty(16, k, dtype=torch.bfloat16), rw, config=cfg)
    launches = list(launches)
    assert launches and all(dict(la.constexprs)["ONE_BLOCK"] and dict(la.constexprs)["PRELOAD_W"]
                            for la in launches)
    assert {(dict(la.constexprs)["BLOCK_M"], dict(la.constexprs)["BLOCK_N"]) for la in launches} >= {
        (4, 2), (4, 4), (8, 2)}
    for s in CC.compile_stats(launches):
        assert "error" not in s, s.get("error")
        assert s["spill_bytes"] == 0 and s["regs"] <= 128, (s["describe"], s["regs"], s["spill_bytes"])


def test_tuner_compile_only_builds_the_one_block_form_wherever_router_gemm_launches_it(monkeypatch):
    """``tune_router.py --compile-only`` compiles, for sm_90, the simt builds router_gemm launches: the loop-free
    one-block build (ONE_BLOCK) for exactly the candidate tiles whose block holds a whole K of the tuned shapes (K
    tails included), in both weight launches. Compiles are recorded here, not run (the script itself runs them)."""
    import types

    import triton

    tuner = load_tuner()
    built = []

    def record(src, target=None, options=None):
        built.append((src.fn.__name__, {src.fn.arg_names[i]: v for (i,), v in src.constants.items()}, dict(options)))
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0))

    monkeypatch.setattr(triton, "compile", record)
    assert tuner.compile_only() == 0
    expected = set()
    for k, n in tuner.CASES.values():
        for kk in (k, k + 4):
            for m in sorted(set(tuner.BUCKETS) | {2, 4, 8, 32, 128, 512, 2048}):
                for terms in (2, 3):
                    expected |= {(c.block_m, c.block_n, c.block_k, c.num_warps, kk % c.block_k == 0)
                                 for c in tuner.candidates(m, n, kk, tuner.H200_SMS, plain=False, terms=terms)
                                 if c.path == "fp32-simt" and kk <= c.block_k}
    simt = [(ce, o) for name, ce, o in built if name == "router_gemm_fp32_kernel"]
    for pre in (False, True):
        one = {(ce["BLOCK_M"], ce["BLOCK_N"], ce["BLOCK_K"], o["num_warps"], ce["EVEN_K"])
               for ce, o in simt if ce["ONE_BLOCK"] and ce["PRELOAD_W"] == pre}
        assert one == expected and expected, (pre, sorted(one ^ expected))
    assert (4, 2, 4096, 8, False) in expected  # LongCat-Lite's 3072 in one 4096 block


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SHAPES) + ["tails"])
def test_gpu_every_candidate_real_shapes(case):
    # Every config the tuner may pick at M <= 16 (and the heuristic's), at the real shape or
    # with K/N tails: within 1e-4 and the rule against PyTorch's fp32 GEMM, deterministic,
    # counters back at zero, nothing written outside the output (NaN-poisoned).
    tuner = load_tuner()
    k, n = SHAPES[case] if case != "tails" else (4100, 200)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x_all, w = _inputs(16, n, k, "cuda", seed=3)
    rw = evenflow.RouterWeight(w)
    for m in (1, 3, 16):  # the tuner's buckets' row tiles (1, 4, 16); 3 masks a row
        x = x_all[:m]
        ref = R.router_logits_fp64(x, w)
        for cfg in tuner.splitk_candidates(m, n, k, sms):
            out = torch.full((m, n), float("nan"), device="cuda")
            evenflow.router_gemm(x, rw, out, config=cfg)
            assert (out.double() - ref).abs().max().item() <= 1e-4, (m, cfg)
            assert_within_rule(out, ref, x.float() @ w.t(), what=f"{cfg} M{m} N{n} K{k}")
            assert torch.equal(out, evenflow.router_gemm(x, rw, config=cfg)), (m, cfg)
            assert _counters_zero(rw), (m, cfg)


@pytest.mark.gpu
def test_gpu_deterministic_under_contention():
    # 384 programs race for 24 counters; the last arriver sums in split order: bitwise the same.
    x, w = _inputs(4, 192, 4096, "cuda", seed=5)
    rw = evenflow.RouterWeight(w)
    for cfg in (_cfg(1, 8, 256, 16), _cfg(4, 8, 128, 32), _cfg(16, 8, 64, 48, 8, 5)):
        xm = x[: cfg.block_m]
        first = evenflow.router_gemm(xm, rw, config=cfg)
        for _ in range(200):
            assert torch.equal(evenflow.router_gemm(xm, rw, config=cfg), first), cfg
        assert _counters_zero(rw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3-30b-a3b", "longcat-chat"])
def test_gpu_cuda_graph_replay_changing_inputs(case):
    # Two graphs (M=1 and M=16) captured on one RouterWeight and replayed alternately with new
    # inputs: each replay must equal an eager call bitwise (counters were reset by the previous
    # replay, whichever graph it was) and the fp64 product within 1e-4.
    k, n = SHAPES[case]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, w = _inputs(1, n, k, "cuda", seed=11)
    rw = evenflow.RouterWeight(w)
    cfgs = {m: dispatch.heuristic_splitk_config(m, n, k, sms) for m in (1, 16)}
    for m, c in cfgs.items():
        rw.workspace(m, c)
    xs = {m: torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for m in cfgs}
    outs = {m: torch.empty(m, n, device="cuda") for m in cfgs}
    graphs = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m in cfgs:
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=m)[0])
            evenflow.router_gemm(xs[m], rw, outs[m], config=cfgs[m])
    torch.cuda.current_stream().wait_stream(s)
    part, count = rw._part, rw._count
    for m in cfgs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            evenflow.router_gemm(xs[m], rw, outs[m], config=cfgs[m])
        graphs[m] = g
    assert rw._part is part and rw._count is count  # nothing grew inside the capture
    for step in range(6):
        m = (1, 16)[step % 2]
        xs[m].copy_(_inputs(m, n, k, "cuda", seed=100 + step)[0])
        graphs[m].replay()
        torch.cuda.synchronize()
        assert _counters_zero(rw), step
        want = evenflow.router_gemm(xs[m], rw, config=cfgs[m])
        assert torch.equal(outs[m], want), step
        err = (outs[m].double() - R.router_logits_fp64(xs[m], w)).abs().max().item()
        assert err <= 1e-4, (step, err)


@pytest.mark.gpu
def test_gpu_batch_invariance_fixed_config():
    k, n = SHAPES["K4096-N192"]
    x, w = _inputs(100, n, k, "cuda", seed=9)
    rw = evenflow.RouterWeight(w)
    cfg = _cfg(16, 8, 64, 10, 8, 4)
    full = evenflow.router_gemm(x, rw, batch_invariant=True, config=cfg)
    for m in (1, 3, 16, 17, 64):
        assert torch.equal(evenflow.router_gemm(x[:m], rw, batch_invariant=True, config=cfg), full[:m]), m
    for i in (0, 15, 99):
        assert torch.equal(evenflow.router_gemm(x[i:i + 1], rw, batch_invariant=True, config=cfg), full[i:i + 1])


def _flips(ids, ref_ids):
    a, b = ids.long().sort(-1).values, ref_ids.long().sort(-1).values
    return int((~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["K4096-N192", "qwen3-30b-a3b"])
def test_gpu_topk_flips_not_more_than_cublas_fp32(case):
    # Issue 4 target for this path: over 65536 tokens (M=16 configs, 4096 row tiles), experts
    # differing from the fp64 top-8 are no more than cuBLAS FP32's.
    k, n = SHAPES[case]
    x, w = _inputs(65536, n, k, "cuda", seed=7)
    rw = evenflow.RouterWeight(w)
    cfg = dispatch.heuristic_splitk_config(16, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    logits = evenflow.router_gemm(x, rw, config=cfg)
    ref_ids = R.router_logits_fp64(x, w).topk(8, dim=-1).indices
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32_ids = torch.mm(x.float(), w.t()).topk(8, dim=-1).indices
    ours, fp32 = _flips(logits.topk(8, dim=-1).indices, ref_ids), _flips(fp32_ids, ref_ids)
    print(f"{case}: flips over 65536 tokens: fp32-splitk {ours}, cuBLAS FP32 {fp32}")
    assert ours <= fp32, (ours, fp32)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_dispatches_splitk(monkeypatch):
    k, n = SHAPES["qwen3-30b-a3b"]
    x, w = _inputs(8, n, k, "cuda", seed=2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr("evenflow.router.gemm.choose_config",
                        lambda m, n, k, *a, **kw: dispatch.heuristic_splitk_config(m, n, k, sms))
    rw = evenflow.RouterWeight(w)
    rw.reserve(8)

    def f(x):
        return evenflow.router_gemm(x, rw)

    got = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(got, f(x))
    assert _counters_zero(rw)


def test_router_chain_probe_sweeps_hold_what_they_claim():
    # benchmarks/probe_router_chain.py (round BH) reads each sweep as varying one thing; what launches must agree.
    probe = load_benchmark("probe_router_chain")
    sms = 132
    pts = probe.sweeps(sms)

    def shape(m, n, k, c):
        return launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)

    intake = [p for p in pts if p[0] == "intake"]
    for per_sm in (1, 2, 3):  # whole programs an SM, each over all of K (no split), its own weight columns
        run = [p for p in intake if p[2] == 2 * sms * per_sm]
        assert len(run) == 4
        for _, m, n, k, c in run:
            k_split, split, grid = shape(m, n, k, c)
            assert split == 1 and k_split == k and grid[0] == sms * per_sm
            assert probe.kb_into_busiest_sm(m, n, k, c, sms) == per_sm * 16 * k / 1024
    rows = [p for p in pts if p[0] == "rows"]
    # the weight's DRAM bytes held (one N and K, one weight), the programs (and the L2 bytes into an SM) growing with M
    assert len({(n, k) for _, _, n, k, _ in rows}) == 1
    kbs = [probe.kb_into_busiest_sm(m, n, k, c, sms) for _, m, n, k, c in rows]
    # 1, 2, 3 and 3 programs on the busiest SM: M = 12 and 16 put the same bytes there
    assert [shape(m, n, k, c)[2][0] for _, m, n, k, c in rows] == [96, 192, 288, 384] and kbs == [64, 128, 192, 192]
    chain = [p for p in pts if p[0] == "chain"]
    for _, m, n, k, c in chain:  # one 64-wide K step a split: the split is all that grows
        k_split, split, grid = shape(m, n, k, c)
        assert k_split == 64 and split == c.split_k and grid == (96, c.split_k)
