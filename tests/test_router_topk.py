"""Scoring + top-k (``select_experts``) and the fused ``route`` against the PyTorch reference.

Ids are compared exactly wherever the selection is decided by more than rounding:
softmax selects on the logit itself (exact); sigmoid selects on sigmoid(l) + bias,
whose fp32 value may differ in the last bit between Triton and torch, so a row whose
k-th and (k+1)-th fp64 keys are within ``KEY_TOL`` may legitimately pick either;
there the chosen set must still be a valid top-k within KEY_TOL. Weights follow the
tolerance rule with baseline = the same rules computed by PyTorch in fp32.
"""
import pytest
import torch

import evenflow
from evenflow.reference import router as R
from evenflow.testing import assert_exact, assert_within_rule, poisoned

KEY_TOL = 1e-6  # a few fp32 ulps of keys of size ~1


def _keys64(logits, scoring, bias):
    lg = logits.double().cpu()
    if scoring == "softmax":
        return lg
    return torch.sigmoid(lg) + (bias.double().cpu() if bias is not None else 0.0)


def _check_selection(ids, weights, logits, top_k, scoring, bias, renorm, scale, what):
    ref_ids, ref_w = R.route_ref(logits.cpu(), top_k, scoring, bias.cpu() if bias is not None else None,
                                 renorm, scale)
    ids, weights = ids.cpu(), weights.cpu()
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ((ids >= 0) & (ids < logits.shape[1])).all(), f"{what}: id out of range"
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), f"{what}: duplicate id in a row"
    key = _keys64(logits, scoring, bias)
    srt = key.sort(-1, descending=True).values
    if top_k < key.shape[1]:
        clear = (srt[:, top_k - 1] - srt[:, top_k]) > KEY_TOL
    else:
        clear = torch.ones(key.shape[0], dtype=torch.bool)
    if scoring == "softmax":
        clear[:] = True  # selection on the logit is exact: no rounding can reorder it
    # Where the decision is clear: same ids in the same order (ties -> lowest id).
    assert_exact(ids[clear], ref_ids[clear], f"{what}: ids")
    # Everywhere: the chosen keys are a top-k within KEY_TOL.
    chosen = torch.gather(key, 1, ids.long())
    kth = srt[:, top_k - 1:top_k]
    assert (chosen >= kth - KEY_TOL).all(), f"{what}: a chosen expert is not in the top-k"
    # Weights: compare on the clear rows against fp64, baseline = PyTorch fp32.
    _, base_w = R.route_ref(logits.cpu(), top_k, scoring, bias.cpu() if bias is not None else None,
                            renorm, scale, dtype=torch.float32)
    if clear.any():
        assert_within_rule(weights[clear], ref_w[clear], base_w[clear], what=f"{what}: weights")


CASES = [
    # (T, E, top_k, scoring, has_bias, renormalize, routed_scaling)
    (7, 8, 2, "softmax", False, True, 1.0),
    (13, 40, 6, "softmax", False, False, 1.0),
    (5, 128, 8, "softmax", False, True, 1.0),
    (9, 192, 8, "sigmoid", True, True, 2.826),  # Hy3
    (6, 256, 8, "sigmoid", True, True, 2.5),  # DeepSeek-V3 style
    (4, 512, 16, "sigmoid", False, False, 1.0),  # the largest supported E and top_k
    (3, 12, 12, "softmax", False, True, 1.0),  # top_k == E
    (17, 33, 1, "sigmoid", True, False, 1.0),  # E one past a power of two, top-1
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in CASES])
def test_select_experts_matches_reference(device, case):
    t, e, k, scoring, has_bias, renorm, scale = case
    logits = torch.randn(t, e, device=device) * 2
    bias = torch.randn(e, device=device) * 0.1 if has_bias else None
    ids, w = poisoned((t, k), torch.int32, device), poisoned((t, k), torch.float32, device)
    evenflow.select_experts(logits, k, scoring, bias, renorm, scale, out=(ids, w))
    _check_selection(ids, w, logits, k, scoring, bias, renorm, scale, str(case))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_ties_go_to_the_lowest_expert_id(device, scoring):
    # Integer logits from a small range: most rows hold many exactly equal keys.
    t, e, k = 24, 48, 8
    logits = torch.randint(-2, 3, (t, e), device=device).float()
    bias = None
    if scoring == "sigmoid":  # equal (logit, bias) pairs tie exactly; distinct ones differ by >> 1 ulp
        bias = torch.randint(0, 2, (e,), device=device).float() * 0.25
    ids, w = evenflow.select_experts(logits, k, scoring, bias)
    ref_ids, _ = R.route_ref(logits.cpu(), k, scoring, bias.cpu() if bias is not None else None)
    assert_exact(ids, ref_ids, f"{scoring} ties")
    # And explicitly: an all-equal row picks experts 0..k-1 in order.
    flat = torch.zeros(2, e, device=device)
    ids, w = evenflow.select_experts(flat, k, scoring)
    assert ids.cpu().tolist() == [list(range(k))] * 2
    torch.testing.assert_close(w.cpu(), torch.full((2, k), 1.0 / k), rtol=0, atol=2e-7)


@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
def test_nan_logits_stay_in_range_and_show(device, scoring, with_bias):
    """A NaN logit is never selected and makes its row's weights NaN under both scorings (round CP's review: sigmoid
    without a bias left the expert out and gave finite weights, in silence, as its reference did); other rows are
    untouched, and the reference states the same rule."""
    logits = torch.randn(3, 16, device=device)
    logits[1, 5] = float("nan")
    bias = torch.rand(16, device=device) * 0.1 if with_bias else None
    ids, w = evenflow.select_experts(logits, 4, scoring, bias)
    assert ((ids >= 0) & (ids < 16)).all() and (ids[1] != 5).all()
    assert torch.isnan(w[1]).all() and torch.isfinite(w[[0, 2]]).all()
    ref_ids, ref_w = R.route_ref(logits.cpu(), 4, scoring, bias.cpu() if with_bias else None)
    assert torch.isnan(ref_w[1]).all() and torch.isfinite(ref_w[[0, 2]]).all()
    assert torch.equal(ids.cpu(), ref_ids)


def test_nan_bias_shows_in_the_weights(device):
    """Round CK's review: a NaN bias entry was never selected and so only left its expert out, the weights finite
    (wrong, in silence). Now every weight of a row whose selection key is NaN somewhere is NaN, as a NaN logit makes
    them, and the ids stay in range; the reference states the same rule and a clean bias gives finite weights."""
    logits = torch.randn(5, 16, device=device)
    for nan_at in (slice(None), 6):
        bias = torch.zeros(16, device=device)
        bias[nan_at] = float("nan")
        ids, w = evenflow.select_experts(logits, 4, "sigmoid", bias)
        assert ((ids >= 0) & (ids < 16)).all() and (ids != 6).all()
        assert torch.isnan(w).all()
        ref_ids, ref_w = R.route_ref(logits.cpu(), 4, "sigmoid", bias.cpu())
        assert torch.isnan(ref_w).all() and torch.equal(ids.cpu(), ref_ids)
    ids, w = evenflow.select_experts(logits, 4, "sigmoid", torch.zeros(16, device=device))
    assert torch.isfinite(w).all()


def test_outputs_that_share_memory_with_an_input_are_refused(device):
    """Round CK's review: out= buffers of valid shape and dtype that alias an input made the kernels read what they
    write (router_gemm into a view of x: NaN; route's ids and weights over one buffer: ids far outside [0, E)),
    with no error; routed_scaling past fp32's range gave inf weights. Each is refused naming its argument, and a
    separate buffer still runs."""
    w = torch.randn(32, 64, device=device)
    rw = evenflow.RouterWeight(w)
    buf = torch.randn(4, 64, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out overlaps x in memory"):
        evenflow.router_gemm(buf, rw, out=buf.view(torch.float32))
    ids = torch.empty(4, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"out\[0\] \(ids\) overlaps out\[1\] \(weights\) in memory"):
        evenflow.route(buf, rw, 2, out=(ids, ids.view(torch.float32)))
    logits = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"out\[1\] \(weights\) overlaps logits in memory"):
        evenflow.select_experts(logits, 2, out=(ids, logits.view(-1)[:8].view(4, 2)))
    # Round CP's review: an out= over the fp32 source weight would be written by a kernel, which no version counter
    # sees, so the split would go stale in silence (the bf16 paths reading the old weight, the fp32 ones the new)
    with pytest.raises(ValueError, match="out overlaps w in memory"):
        evenflow.router_gemm(buf, rw, out=w.view(-1)[:4 * 32].view(4, 32))
    with pytest.raises(ValueError, match=r"out\[1\] \(weights\) overlaps w in memory"):
        evenflow.route(buf, rw, 2, out=(ids, w[0, :8].view(4, 2)))
    with pytest.raises(ValueError, match=r"out\[0\] \(ids\) overlaps w in memory"):
        evenflow.route(buf, rw, 2, out=(w[0, :8].view(torch.int32).view(4, 2), torch.empty(4, 2, device=device)))
    with pytest.raises(ValueError, match="^w: the number of experts must be <= 512, got 513"):
        evenflow.route(torch.zeros(1, 8, device=device, dtype=torch.bfloat16),
                       evenflow.RouterWeight(torch.zeros(513, 8, device=device)), 2)
    for bad in (1e39, -1e39):
        with pytest.raises(ValueError, match="routed_scaling must be within fp32's range"):
            evenflow.route(buf, rw, 2, routed_scaling=bad)
    out = torch.empty(4, 32, device=device)
    assert evenflow.router_gemm(buf, rw, out=out) is out
    ids2, w2 = evenflow.route(buf, rw, 2, out=(ids, torch.empty(4, 2, device=device)), routed_scaling=-2.0)
    assert ids2 is ids and (w2 < 0).all()


def test_fullgraph_compile_traces_the_overlap_checks(device):
    """Round CL: the overlap checks of round CK read tensors' addresses, which torch.compile cannot trace, so a
    fullgraph compile of route failed (an H100 ran the router's GPU compile test, CL3). They are skipped while
    tracing; the custom ops the compiled code runs check the same at run time: a compiled call with an aliased out=
    is still refused, and separate buffers give the eager results bit for bit."""
    rw = evenflow.RouterWeight(torch.randn(32, 64, device=device))
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    bias = torch.randn(32, device=device)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def step(x, out, ids, wt):
        logits = evenflow.router_gemm(x, rw, out=out)
        r = evenflow.route(x, rw, 2, "sigmoid", bias)
        s = evenflow.select_experts(logits, 2, out=(ids, wt))
        return logits, r, s

    def buffers():
        return (torch.empty(4, 32, device=device), torch.empty(4, 2, dtype=torch.int32, device=device),
                torch.empty(4, 2, device=device))

    got, want = step(x, *buffers()), (lambda o, i, w: (evenflow.router_gemm(x, rw, out=o),
                                                       evenflow.route(x, rw, 2, "sigmoid", bias),
                                                       evenflow.select_experts(o, 2, out=(i, w))))(*buffers())
    assert any("evenflow" in t for t in seen), seen
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)
    out, ids, _ = buffers()
    with pytest.raises(ValueError, match=r"weights overlaps logits in memory"):
        step(x, out, ids, out.view(-1)[:8].view(4, 2))


def test_empty_batch(device):
    ids, w = evenflow.select_experts(torch.empty(0, 8, device=device), 2)
    assert ids.shape == (0, 2) and w.shape == (0, 2)
    rw = evenflow.RouterWeight(torch.randn(8, 32, device=device))
    ids, w = evenflow.route(torch.empty(0, 32, dtype=torch.bfloat16, device=device), rw, 2)
    assert ids.shape == (0, 2)


def test_route_is_gemm_then_select(device):
    m, n, k = 11, 64, 96
    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    rw = evenflow.RouterWeight(w)
    bias = torch.randn(n, device=device) * 0.01
    for scoring, b in (("softmax", None), ("sigmoid", bias)):
        ids, wt = evenflow.route(x, rw, 8, scoring, b, True, 2.0)
        logits = evenflow.router_gemm(x, rw)
        ids2, wt2 = evenflow.select_experts(logits, 8, scoring, b, True, 2.0)
        assert_exact(ids, ids2, "route ids")
        assert torch.equal(wt, wt2)
        # End to end against the oracle: fp64 logits -> fp64 routing. Baseline for the
        # weights: PyTorch's fp32 two-product logits -> fp32 routing. Ids must match
        # wherever the fp64 keys' k-th / (k+1)-th gap exceeds the logits' error (1e-5).
        lg64 = R.router_logits_fp64(x.cpu(), w.cpu())
        bc = b.cpu() if b is not None else None
        ref_ids, ref_w = R.route_ref(lg64, 8, scoring, bc, True, 2.0)
        _, base_w = R.route_ref(R.split_logits_fp32(x.cpu(), *(t.cpu() for t in rw.parts)), 8, scoring, bc,
                                True, 2.0, dtype=torch.float32)
        srt = _keys64(lg64, scoring, bc).sort(-1, descending=True).values
        clear = (srt[:, 7] - srt[:, 8]) > 1e-5
        assert clear.sum() >= m - 2, "test inputs should be mostly clear-cut"
        assert_exact(ids.cpu()[clear], ref_ids[clear], f"route {scoring} ids vs fp64")
        assert_within_rule(wt.cpu()[clear], ref_w[clear], base_w[clear], what=f"route {scoring} weights vs fp64")


def test_route_topk_agreement_with_fp64_not_worse_than_pytorch_split(device):
    # Over many tokens: experts our route picks that the fp64 oracle does not ("flips")
    # are no more than PyTorch's fp32 two-product path makes (the same split math).
    # The GPU test also compares with cuBLAS FP32 at real shapes.
    m, n, k, top_k = 512, 64, 256, 8
    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    rw = evenflow.RouterWeight(w)
    ids, _ = evenflow.route(x, rw, top_k)
    ref = R.router_logits_fp64(x.cpu(), w.cpu())
    ref_ids = ref.topk(top_k, dim=-1).indices
    base_ids = R.split_logits_fp32(x.cpu(), *(t.cpu() for t in rw.parts)).topk(top_k, dim=-1).indices

    def flips(a):
        return int(sum(len(set(r) - set(s)) for r, s in zip(a.tolist(), ref_ids.tolist())))

    assert flips(ids.cpu()) <= flips(base_ids)


def test_route_bad_inputs(device):
    rw = evenflow.RouterWeight(torch.randn(16, 32, device=device))
    x = torch.randn(2, 32, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="scoring"):
        evenflow.route(x, rw, 2, "relu")
    with pytest.raises(ValueError, match="top_k"):
        evenflow.route(x, rw, 17)
    with pytest.raises(ValueError, match="top_k"):
        evenflow.route(x, rw, 0)
    with pytest.raises(ValueError, match="bias"):
        evenflow.route(x, rw, 2, "softmax", torch.zeros(16, device=device))
    with pytest.raises(ValueError, match="bias must have shape"):
        evenflow.route(x, rw, 2, "sigmoid", torch.zeros(15, device=device))
    with pytest.raises(TypeError, match="bias must have dtype"):
        evenflow.route(x, rw, 2, "sigmoid", torch.zeros(16, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^logits: the number of experts must be <= 512"):
        evenflow.select_experts(torch.zeros(2, 513, device=device), 2)
    with pytest.raises(TypeError, match="logits must have dtype"):
        evenflow.select_experts(torch.zeros(2, 8, device=device, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="out\\[0\\]"):
        evenflow.select_experts(torch.zeros(2, 8, device=device), 2,
                                out=(torch.empty(2, 3, dtype=torch.int32, device=device),
                                     torch.empty(2, 2, device=device)))
    with pytest.raises(TypeError, match=r"out must be a pair \(ids, weights\)"):
        evenflow.select_experts(torch.zeros(2, 8, device=device), 2, out=torch.empty(2, 2, device=device))
    with pytest.raises(ValueError, match="logits must have at least one expert column"):
        evenflow.select_experts(torch.zeros(2, 0, device=device), 1)
    with pytest.raises(TypeError, match="routed_scaling must be a float, got str"):
        evenflow.route(x, rw, 2, routed_scaling="2.5")
    for bad in (float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="routed_scaling must be finite"):
            evenflow.route(x, rw, 2, routed_scaling=bad)
    with pytest.raises(TypeError, match="renormalize must be a bool, got 1"):
        evenflow.route(x, rw, 2, renormalize=1)
    with pytest.raises(TypeError, match="batch_invariant must be a bool, got 'yes'"):
        evenflow.route(x, rw, 2, batch_invariant="yes")
    with pytest.raises(TypeError, match="w must be an evenflow.RouterWeight"):
        evenflow.route(x, torch.randn(16, 32, device=device), 2)
    # top_k over N where N is under the kernel's limit of 16 (the test above trips the limit instead)
    small = evenflow.RouterWeight(torch.randn(8, 32, device=device))
    with pytest.raises(ValueError, match="top_k must be <= 8"):
        evenflow.route(x, small, 9)
    with pytest.raises(TypeError, match="top_k must be an int"):
        evenflow.route(x, rw, 2.0)
    with pytest.raises(ValueError, match="bias must be contiguous"):
        evenflow.route(x, rw, 2, "sigmoid", torch.zeros(16, 2, device=device)[:, 0])
    with pytest.raises(ValueError, match="bias is on meta, expected"):
        evenflow.route(x, rw, 2, "sigmoid", torch.zeros(16, device="meta"))
    with pytest.raises(ValueError, match="x is on meta, expected"):
        evenflow.route(x.to("meta"), rw, 2)
    logits = torch.zeros(2, 8, device=device)
    with pytest.raises(TypeError, match=r"out\[1\] \(weights\) must have dtype"):
        evenflow.select_experts(logits, 2, out=(torch.empty(2, 2, dtype=torch.int32, device=device),
                                                torch.empty(2, 2, dtype=torch.float64, device=device)))
    with pytest.raises(ValueError, match=r"out\[1\] \(weights\) must have shape"):
        evenflow.select_experts(logits, 2, out=(torch.empty(2, 2, dtype=torch.int32, device=device),
                                                torch.empty(2, 3, device=device)))
    with pytest.raises(ValueError, match="logits must be 2-D"):
        evenflow.select_experts(torch.zeros(8, device=device), 2)
    with pytest.raises(ValueError, match="logits must have a unit stride in its last dimension"):
        evenflow.select_experts(torch.zeros(8, 2, device=device).t(), 2)


def test_batch_invariant_route(device):
    w = torch.randn(32, 64, device=device) * 0.02
    x = torch.randn(9, 64, device=device).to(torch.bfloat16)
    rw = evenflow.RouterWeight(w)
    ids, wt = evenflow.route(x, rw, 4, batch_invariant=True)
    ids1, wt1 = evenflow.route(x[4:5], rw, 4, batch_invariant=True)
    assert torch.equal(ids1, ids[4:5]) and torch.equal(wt1, wt[4:5])


def test_opcheck_route_topk_op(device):
    logits = torch.randn(5, 24, device=device)
    bias = torch.randn(24, device=device)
    ids = torch.empty(5, 4, dtype=torch.int32, device=device)
    w = torch.empty(5, 4, device=device)
    torch.library.opcheck(torch.ops.evenflow.route_topk.default, (logits, bias, ids, w, 4, True, True, 2.0, False))
    torch.library.opcheck(torch.ops.evenflow.route_topk.default, (logits, None, ids, w, 4, False, False, 1.0, False))
    # route's form: the kernel writes zeros over the logits it read (declared: the op mutates logits)
    torch.library.opcheck(torch.ops.evenflow.route_topk.default,
                          (logits.clone(), bias, ids, w, 4, True, True, 2.0, False, True))
    cleared = logits.clone()
    torch.ops.evenflow.route_topk(cleared, bias, ids, w, 4, True, True, 2.0, False, True)
    assert torch.count_nonzero(cleared).item() == 0


# (rows, warps) a program: round CM's tiles (and "cm", its rule by expert count), one warp a row (the default)
TILES = [(16, 4), (8, 4), (4, 4), (2, 1), (1, 1), "cm"]


@pytest.mark.parametrize("case", CASES[:6], ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in CASES[:6]])
def test_every_topk_tile_selects_as_the_reference(device, case, monkeypatch):
    """The tile (``topk.TOPK_TILE``: one row a one-warp program, the default, or round CM's) changes how the
    selection's reductions are laid out over threads, never what it selects: each tile against the reference, and in
    the interpreter (which sums in one order whatever the tile) bit for bit the default tile."""
    import evenflow.router.topk as K

    t, e, k, scoring, has_bias, renorm, scale = case
    g = torch.Generator().manual_seed(t * 100 + e)
    logits = torch.randn(t, e, generator=g).to(device)
    logits[0, : e // 4] = logits[0, e // 4 : e // 2]  # ties inside a row
    bias = (torch.randn(e, generator=g) * 0.1).to(device) if has_bias else None
    default = evenflow.select_experts(logits, k, scoring, bias, renorm, scale)
    for tile in TILES:
        monkeypatch.setattr(K, "TOPK_TILE", tile)
        ids, w = evenflow.select_experts(logits, k, scoring, bias, renorm, scale)
        _check_selection(ids, w, logits, k, scoring, bias, renorm, scale, f"tile {tile}")
        if device == "cpu":
            assert torch.equal(ids, default[0]) and torch.equal(w, default[1]), tile


@pytest.mark.skipif(not evenflow._runtime.interpreting(), reason="records launches through the interpreter")
def test_one_row_topk_tile_keeps_its_reductions_inside_a_warp(monkeypatch):
    """sm_90 builds of the default tile (``topk.TOPK_TILE = None``: one row a one-warp program, round CP's default
    after CP1 timed it 1.46-4.2x faster than round CM's on an H200) at 128 / 192 / 384 experts: no barrier but the PDL
    prologue's and no spill (round CM's 16-row, 4-warp tile, ``"cm"``, crosses warps through 80-114 barriers at
    E > 128: docs/perf-notes/router.md, round CN)."""
    import evenflow.router.topk as K

    CC = pytest.importorskip("evenflow._compile_check")
    monkeypatch.setattr(K, "TOPK_TILE", None)
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for e, k, scoring in ((128, 8, "softmax"), (192, 8, "sigmoid"), (384, 12, "sigmoid")):
            evenflow.select_experts(torch.zeros(3, e), k, scoring)
    stats = CC.compile_stats(launches)
    assert len(stats) == 3 and not [s["error"] for s in stats if "error" in s]
    for s in stats:
        assert "BLOCK_T=1," in s["describe"] and "num_warps=1" in s["describe"], s["describe"]
        assert s["spill_bytes"] == 0, s["describe"]
        assert sum(op.startswith("BAR") for op in s["sequence"]) <= 1, s["describe"]

