"""Split-K by exchange (``GemmConfig(reduce="exchange")``, round BI): the K slices' partials summed by a fixed
pairwise tree of atomic exchanges, in both split-K kernels (CUDA-core ``fp32-splitk``, tensor-core ``triton`` /
``fp32-tc``).

What is checked, and why:

* The sum is the tree the docstring of ``kernels._exchange_splits`` describes, bit for bit: the same config under
  ``reduce="counter"`` leaves every slice's partial in the workspace (the K loop is the same code), and the
  exchange's output must equal those partials summed pairwise (level 1 pairs slices (0, 1), (2, 3), ...; level 2
  the pairs' sums; a group with no partner carries on), written here in plain PyTorch. At two slices that is the
  counter's own sum (p0 + p1), so the two modes agree bitwise there.
* Values: within the tolerance rule and the analytic bound of the path (fp32 sums of the fp32 weight; the split's
  products), with masked tails (M, N, K not multiples of the tile) into NaN-poisoned outputs.
* The slots are back at zero after every call (a slot left holding a value would hand it to the next call), and
  calls of both modes, several M and configs, sharing one workspace give what a fresh one gives.
* Workspace sizes, a too-small workspace refused by the launcher, config validation, opcheck, batch invariance
  under a fixed config, and the sm_90 builds (no spill, the exchange's relaxed 64-bit atomics and no other in the PTX).
* GPU (``@pytest.mark.gpu``): real shapes, determinism under contention (arrival order changes from call to call
  there: the interpreter runs programs in one order), CUDA-graph replay with changing inputs.
"""
from dataclasses import replace

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.reference import router as R
from evenflow.router.dispatch import GemmConfig
from evenflow.router.gemm import launch_shape
from evenflow.testing import assert_fp32_gemm_within_bound, assert_within_rule, poisoned
from tests_support_router import load_tuner, router_inputs

_inputs = router_inputs


def _sk(bm, bn, bk, split, warps=4, stages=3, reduce="exchange"):
    return GemmConfig(bm, bn, bk, split, warps, stages, "fp32-splitk", reduce=reduce)


def _tc(bm, bn, bk, split, warps=2, stages=1, path="triton", reduce="exchange"):
    return GemmConfig(bm, bn, bk, split, warps, stages, path, reduce=reduce)


def _zero(rw):
    return int(rw._count.abs().sum()) == 0


def tree_sum(parts):
    """The exchange's sum of ``parts`` (split order): pairs at distance 1, then 2, 4, ...; the lower group's sum
    plus the upper's (fp32 addition commutes: the order inside a pair does not matter)."""
    vals = list(parts)
    step = 1
    while step < len(vals):
        for a in range(0, len(vals), 2 * step):
            if a + step < len(vals):
                vals[a] = vals[a] + vals[a + step]
        step *= 2
    return vals[0]


def _partials(cfg, m, n, k, rw):
    """Every slice's partial as ``cfg`` under ``reduce="counter"`` leaves it: [splits, m, n]."""
    _, split, _ = launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
    if cfg.path != "fp32-splitk":
        return rw._part[: split * m * n].view(split, m, n).cpu()
    bm, bn = cfg.block_m, cfg.block_n
    tm, tn = -(-m // bm), -(-n // bn)
    p = rw._part[: tm * tn * split * bm * bn].view(tm, tn, split, bm, bn).cpu()
    return p.permute(2, 0, 3, 1, 4).reshape(split, tm * bm, tn * bn)[:, :m, :n]


def _check(out, x, rw, w, cfg, what):
    if cfg.path == "fp32-splitk":
        return assert_fp32_gemm_within_bound(out, x, w, what)
    ref = R.router_logits_fp64(x.cpu(), w.cpu())
    return assert_within_rule(out, ref, R.split_logits_fp32(x.cpu(), *(t.cpu() for t in rw.parts)), what=what)


CASES = [
    # (M, N, K, config): why
    (3, 10, 32, _sk(4, 4, 16, 2)),              # two slices: one level
    (3, 10, 48, _sk(4, 4, 16, 3)),              # three: slice 2 has no partner at level 1
    (3, 10, 80, _sk(4, 4, 16, 5)),              # five: a lone group at two levels
    (2, 12, 176, _sk(2, 4, 16, 11, 1)),         # eleven, one warp (LongCat-Chat's M = 16 entry splits 11)
    (20, 9, 130, _sk(8, 4, 32, 2)),             # row tiles, N and K tails (the last slice short)
    (16, 20, 512, _sk(8, 8, 32, 4, 8, 3)),      # an 8 x 8 tile on 8 warps, split 4, N tail
    (16, 33, 256, _sk(16, 2, 16, 5, 4, 4)),     # split 5 asked, 16 blocks: 4 slices of 4
    (3, 40, 64, _tc(16, 32, 16, 4)),            # the tensor-core kernel: four slices, rows and N masked
    (5, 24, 112, _tc(16, 16, 16, 7)),           # seven slices
    (17, 40, 256, _tc(16, 32, 16, 16, 4, 2, "fp32-tc")),  # the fp32 weight split in registers, 16 slices, 2 row tiles
    (4, 40, 88, _tc(16, 32, 16, 3, 2, 1, "fp32-tc")),     # K tail: slices of 32, 32 and 24
]
_IDS = [f"{c[3].path}-M{c[0]}-N{c[1]}-K{c[2]}-{c[3].block_m}x{c[3].block_n}x{c[3].block_k}-s{c[3].split_k}"
        for c in CASES]


@pytest.mark.parametrize("m,n,k,cfg", CASES, ids=_IDS)
def test_exchange_is_the_tree_sum_of_the_partials(device, m, n, k, cfg):
    x, w = _inputs(m, n, k, device)
    split = launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)[1]
    assert split == cfg.split_k or (split, cfg.split_k) == (4, 5)  # the uneven case: 4 slices
    counted = evenflow.RouterWeight(w)
    by_counter = evenflow.router_gemm(x, counted, config=replace(cfg, reduce="counter"))
    want = tree_sum(_partials(cfg, m, n, k, counted))
    rw = evenflow.RouterWeight(w)
    out = poisoned((m, n), torch.float32, device)
    assert evenflow.router_gemm(x, rw, out, config=cfg) is out
    assert torch.equal(out.cpu(), want), f"{cfg}: not the tree sum of the slices' partials"
    assert _zero(rw), f"{cfg}: slots left non-zero"
    assert rw._part.numel() == 0  # the exchange keeps no partials
    if split == 2:
        assert torch.equal(out, by_counter)  # p0 + p1 either way
    _check(out, x, rw, w, cfg, f"{cfg} M={m} N={n} K={k}")
    assert torch.equal(out, evenflow.router_gemm(x, rw, config=cfg)), f"{cfg}: a second call differs"
    assert _zero(rw)


def test_calls_of_both_modes_share_one_workspace(device):
    # One RouterWeight; counter and exchange calls at several M, tiles and slice counts in a row. Each
    # result must be bitwise what a fresh RouterWeight gives (a slot or counter left non-zero would show),
    # and the counters' space is zero after every call.
    n, k = 24, 192
    x, w = _inputs(16, n, k, device)
    shared = evenflow.RouterWeight(w)
    plan = [(1, _sk(1, 8, 32, 6)), (16, _sk(16, 4, 16, 12, 4, 4)), (16, _sk(16, 4, 16, 12, 4, 4, "counter")),
            (3, _sk(4, 8, 16, 5)), (7, _tc(16, 16, 32, 3)), (7, _tc(16, 16, 32, 3, reduce="counter")),
            (1, _sk(1, 8, 32, 6)), (16, _tc(16, 16, 16, 12, 4, 1, "fp32-tc")), (2, _sk(2, 16, 64, 3))]
    for i, (m, cfg) in enumerate(plan):
        got = evenflow.router_gemm(x[:m], shared, config=cfg)
        assert _zero(shared), f"call {i}: {cfg} left the counters' space non-zero"
        fresh = evenflow.router_gemm(x[:m], evenflow.RouterWeight(w), config=cfg)
        assert torch.equal(got, fresh), f"call {i} (M={m}, {cfg}) differs from a fresh workspace"


def test_workspace_sizes_and_too_small_workspace(device):
    n, k = 40, 256
    cfg = _sk(16, 4, 16, 8)
    assert cfg.workspace_sizes(16, n, k) == (0, 2 * 10 * 8 * 16 * 4)  # int64 slots in int32 words
    assert replace(cfg, reduce="counter").workspace_sizes(16, n, k) == (10 * 8 * 16 * 4, 10)
    assert _sk(16, 4, 16, 1).workspace_sizes(16, n, k) == (0, 0)  # one slice: nothing to exchange
    assert _tc(16, 32, 16, 4).workspace_sizes(3, n, 64) == (0, 2 * 2 * 4 * 16 * 32)
    x, w = _inputs(4, 16, 64, device)
    out = torch.empty(4, 16, device=device)
    need = 2 * 4 * 2 * 4 * 4  # 4 column tiles x 2 slices x 4 x 4 elements, two words each
    small = torch.zeros(need - 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="workspace too small"):
        torch.ops.evenflow.router_gemm_fp32_splitk.default(
            x, w, out, torch.empty(0, device=device), small, 4, 4, 16, 2, 4, 2, False, False, True)
    rw = evenflow.RouterWeight(w)
    with pytest.raises(ValueError, match="workspace too small"):
        torch.ops.evenflow.router_gemm_split.default(
            x, *rw.parts, out, torch.empty(0, device=device), small, 3, 16, 16, 16, 2, 2, 1, False, False, False,
            True)
    # the launcher's own count: exactly the size passes (and leaves it zero)
    ok = torch.zeros(need, dtype=torch.int32, device=device)
    torch.ops.evenflow.router_gemm_fp32_splitk.default(
        x, w, out, torch.empty(0, device=device), ok, 4, 4, 16, 2, 4, 2, False, False, True)
    assert int(ok.abs().sum()) == 0
    assert_fp32_gemm_within_bound(out, x, w, "exact-size slots")


def test_reduce_validation_and_round_trip():
    with pytest.raises(ValueError, match="config.reduce must be one of"):
        _sk(4, 4, 16, 2, reduce="atomic")
    with pytest.raises(ValueError, match="config.reduce='exchange' needs a split-K path"):
        GemmConfig(1, 1, 1024, 1, 4, 1, "fp32-simt", reduce="exchange")
    with pytest.raises(ValueError, match="needs a split-K path"):
        GemmConfig(path="torch-fp32", reduce="exchange")
    for c in (_sk(4, 2, 1024, 2, 4, 5), _tc(16, 32, 64, 8, 4, 4, "fp32-tc"), GemmConfig()):
        assert GemmConfig.from_dict(c.to_dict()) == c
    # table entries written before round BI carry no "reduce": they are counter entries
    d = GemmConfig(16, 32, 64, 8).to_dict()
    del d["reduce"]
    assert GemmConfig.from_dict(d).reduce == "counter"


def test_opcheck_exchange_ops(device):
    x, w = _inputs(3, 16, 64, device)
    rw = evenflow.RouterWeight(w)
    cfg = _sk(4, 4, 16, 2)
    part, count = rw.workspace(3, cfg)
    out = torch.empty(3, 16, device=device)
    torch.library.opcheck(torch.ops.evenflow.router_gemm_fp32_splitk.default,
                          (x, w, out, part, count, 4, 4, 16, 2, 4, 3, False, False, True))
    cfg = _tc(16, 16, 16, 4)
    part, count = rw.workspace(3, cfg)
    torch.library.opcheck(torch.ops.evenflow.router_gemm_split.default,
                          (x, *rw.parts, out, part, count, 3, 16, 16, 16, 4, 2, 1, False, False, False, True))


def test_exchange_config_is_batch_invariant(device):
    # One config for every M: a row's partials and their tree depend neither on M nor on the other rows.
    n, k = 24, 160
    x, w = _inputs(19, n, k, device)
    rw = evenflow.RouterWeight(w)
    for cfg in (_sk(4, 8, 16, 5), _tc(16, 16, 16, 3, path="fp32-tc")):
        full = evenflow.router_gemm(x, rw, config=cfg, batch_invariant=True)
        for i in (0, 5, 18):
            assert torch.equal(evenflow.router_gemm(x[i:i + 1], rw, config=cfg, batch_invariant=True),
                               full[i:i + 1]), (cfg, i)
        assert torch.equal(evenflow.router_gemm(x[3:11], rw, config=cfg, batch_invariant=True), full[3:11]), cfg


def test_tuner_offers_each_split_launch_with_its_exchange_twin_at_small_m():
    tuner = load_tuner()
    for k, n in ((4096, 192), (6144, 768), (2048, 128)):
        for m in (1, 4, 16):
            cands = tuner.candidates(m, n, k, 132)
            split = [c for c in cands if c.path in ("triton", "fp32-tc", "fp32-splitk") and c.reduce == "counter"
                     and launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1] > 1]
            assert split, (m, n, k)
            for c in split:  # right after its original, so a budget cut takes both or neither
                i = cands.index(c)
                assert cands[i + 1] == replace(c, reduce="exchange"), (m, c)
            assert sum(c.reduce == "exchange" for c in cands) == len(split)
        for m in (64, 512):
            assert all(c.reduce == "counter" for c in tuner.candidates(m, n, k, 132))


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_exchange_builds_for_sm90_without_spills():
    CC = pytest.importorskip("evenflow._compile_check")
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for (k, n), cfgs in (((4096, 192), (_sk(4, 2, 1024, 2, 4, 3), _sk(8, 8, 256, 4, 8, 5),
                                            _tc(16, 16, 128, 16, 2, 4, "fp32-tc"))),
                             ((3072, 384), (_tc(16, 32, 128, 8, 4, 4, "fp32-tc"), _tc(16, 32, 64, 8, 4, 4)))):
            rw = evenflow.RouterWeight(torch.randn(n, k) * 0.02)
            for cfg in cfgs:
                evenflow.router_gemm(torch.empty(16, k, dtype=torch.bfloat16), rw, config=cfg)
    assert {la.name for la in launches} == {"router_gemm_fp32_splitk_kernel", "router_gemm_kernel"}
    stats = CC.compile_stats(launches)
    errors = [s["error"] for s in stats if "error" in s]
    assert not errors, "\n\n".join(errors)
    assert len(stats) == 5
    for s in stats:
        assert "RED_XCHG=True" in s["describe"], s["describe"]
        assert s["spill_bytes"] == 0, s["describe"]
        # the exchange's 64-bit atomics, relaxed; no counter (acq_rel add) and no other atomic
        assert s["atomics"] and all(".exch.b64" in a and "acq_rel" not in a for a in s["atomics"]), \
            f"{s['describe']}: {s['atomics']}"


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["K4096-N192", "longcat-chat", "longcat-lite", "qwen3-30b-a3b", "tails"])
def test_gpu_exchange_real_shapes(case):
    # Split configs of both kernels at M = 1, 3, 16 (the tuner's kinds at M <= 16): the tree sum of the
    # counter's partials bit for bit, within 1e-4 of fp64, and the slots back at zero.
    shapes = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
              "qwen3-30b-a3b": (2048, 128), "tails": (4100, 200)}
    k, n = shapes[case]
    x_all, w = _inputs(16, n, k, "cuda", seed=3)
    cfgs = (_sk(4, 2, 1024, 2, 4, 3), _sk(4, 2, 512, 4, 4, 5), _sk(8, 8, 256, 4, 8, 5), _sk(16, 16, 64, 8, 4, 5),
            _tc(16, 16, 128, 16, 2, 4, "fp32-tc"), _tc(16, 32, 64, 11, 4, 6, "fp32-tc"), _tc(16, 32, 128, 8, 4, 4))
    for m in (1, 3, 16):
        x = x_all[:m]
        ref = R.router_logits_fp64(x, w)
        for cfg in cfgs:
            counted = evenflow.RouterWeight(w)
            evenflow.router_gemm(x, counted, config=replace(cfg, reduce="counter"))
            want = tree_sum(_partials(cfg, m, n, k, counted))
            rw = evenflow.RouterWeight(w)
            out = torch.full((m, n), float("nan"), device="cuda")
            evenflow.router_gemm(x, rw, out, config=cfg)
            assert torch.equal(out.cpu(), want), (m, cfg)
            assert (out.double() - ref).abs().max().item() <= 1e-4, (m, cfg)
            assert _zero(rw), (m, cfg)


@pytest.mark.gpu
def test_gpu_exchange_deterministic_under_contention():
    # Hundreds of programs race for the slots; whoever comes second adds: bitwise the same, call after call.
    x, w = _inputs(16, 192, 4096, "cuda", seed=5)
    rw = evenflow.RouterWeight(w)
    for cfg in (_sk(1, 8, 256, 16), _sk(4, 8, 128, 32), _sk(16, 8, 64, 48, 8, 5), _tc(16, 16, 64, 64, 2, 4)):
        xm = x[: cfg.block_m]
        first = evenflow.router_gemm(xm, rw, config=cfg)
        for _ in range(200):
            assert torch.equal(evenflow.router_gemm(xm, rw, config=cfg), first), cfg
        assert _zero(rw), cfg


@pytest.mark.gpu
def test_gpu_exchange_cuda_graph_replay_changing_inputs():
    # Two graphs (M = 1 and 16, both exchanging) on one RouterWeight, replayed alternately with new inputs: each
    # replay equals an eager call bitwise (the slots were put back by the replay before) and fp64 within 1e-4.
    k, n = 6144, 768
    _, w = _inputs(1, n, k, "cuda", seed=11)
    rw = evenflow.RouterWeight(w)
    cfgs = {1: _sk(1, 8, 256, 8), 16: _tc(16, 32, 64, 11, 4, 6, "fp32-tc")}
    for m, c in cfgs.items():
        rw.workspace(m, c)
    xs = {m: torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for m in cfgs}
    outs = {m: torch.empty(m, n, device="cuda") for m in cfgs}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m in cfgs:
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=m)[0])
            evenflow.router_gemm(xs[m], rw, outs[m], config=cfgs[m])
    torch.cuda.current_stream().wait_stream(s)
    count = rw._count
    graphs = {}
    for m in cfgs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            evenflow.router_gemm(xs[m], rw, outs[m], config=cfgs[m])
        graphs[m] = g
    assert rw._count is count  # nothing grew inside the capture
    for step in range(6):
        m = (1, 16)[step % 2]
        xs[m].copy_(_inputs(m, n, k, "cuda", seed=100 + step)[0])
        graphs[m].replay()
        torch.cuda.synchronize()
        assert _zero(rw), step
        assert torch.equal(outs[m], evenflow.router_gemm(xs[m], rw, config=cfgs[m])), step
        err = (outs[m].double() - R.router_logits_fp64(xs[m], w)).abs().max().item()
        assert err <= 1e-4, (step, err)
