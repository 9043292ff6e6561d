"""The tolerance rule's fp8 requantisation allowance (``moe_requant_allowance``), against cases built
to sit on a rounding midpoint and against other correct (and incorrect) implementations of the layer.

The FP8 formats round the intermediate silu(gate) * up to e4m3. An element that lies within fp32
error of a midpoint between two e4m3 values may round either way in a correct kernel, and one such
flip can move the output by more than the rule's bound (round V4). The allowance must cover exactly
that: a flip at a midpoint passes, a rounding-mode defect or a two-step error does not.
"""
import pytest
import torch

from evenflow.moe.quant import MoEWeights
from evenflow.reference.moe import (
    dequant_group,
    dequant_weights,
    moe_requant_allowance,
    moe_rule_terms,
    quant_fp8_group,
    quant_fp8_static,
    random_moe_weights,
    random_routing,
    requant_window,
)
from evenflow.testing import assert_within_rule

FP8 = torch.float8_e4m3fn


def test_allowance_is_zero_for_bf16(device):
    ew = random_moe_weights("bf16", 4, 64, 32, device)
    x = torch.randn(5, 64, device=device).bfloat16()
    ids, w = random_routing(5, 2, 4, device)
    assert not moe_requant_allowance(x, ids, w, ew).any()


def _midpoint_layer(device):
    """One token, one expert (top-1, weight 1), per-tensor fp8, built so that the intermediate's
    element 0 lies on the midpoint 12.5 between e4m3 12 and 13 (to fp32 rounding of the scale), and
    the down weights' column 0 is large: a flip there moves every output by ~a2 * 0.875."""
    h_size, i_size = 64, 64
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(1, 2 * i_size, h_size, generator=g) * 8).clamp(-448, 448).to(FP8)
    w13[0, 0, 0], w13[0, i_size, 0] = 128.0, 64.0  # gate 2.0, up 1.0 at scale 2^-6
    w2 = (torch.randn(1, h_size, i_size, generator=g) * 8).clamp(-448, 448).to(FP8)
    w2[0, :, 0] = 448.0  # 0.875 at scale 2^-9
    s13, s2, a13 = torch.tensor([2.0**-6]), torch.tensor([2.0**-9]), torch.tensor([2.0**-6])
    h0 = float(torch.nn.functional.silu(torch.tensor(2.0, dtype=torch.float64)))  # up = 1.0
    a2 = torch.tensor([h0 / 12.5], dtype=torch.float32)
    x = torch.zeros(1, h_size)
    x[0, 0] = 1.0  # 64 in e4m3 at a13 = 2^-6: every gate/up value is one exact product
    ew = MoEWeights.fp8_per_tensor(*(t.to(device) for t in (w13, w2, s13, s2, a13, a2)))
    ids = torch.zeros(1, 1, dtype=torch.int32, device=device)
    return ew, x.bfloat16().to(device), ids, torch.ones(1, 1, device=device)


def _moved(ref, ew, steps):
    """The layer's output with the intermediate's element 0 moved by ``steps`` e4m3 steps of 1 (between
    12 and 14 the e4m3 values are the integers), rounded to bf16."""
    _, w2 = dequant_weights(ew)
    return (ref + steps * float(ew.a2_scale) * w2[0, :, 0].double()[None, :]).bfloat16()


def test_a_flip_at_a_midpoint_needs_the_allowance_and_gets_exactly_it(device):
    ew, x, ids, w = _midpoint_layer(device)
    ref, base, allowance = moe_rule_terms(x, ids, w, ew)
    w13, _ = dequant_weights(ew)
    h_ref = quant_fp8_static(torch.nn.functional.silu(x.float() @ w13[0, :64].T) * (x.float() @ w13[0, 64:].T),
                             ew.a2_scale)[0, 0] / ew.a2_scale
    assert float(h_ref) in (12.0, 13.0), h_ref  # the oracle took one side of 12.5
    other = 1.0 if float(h_ref) == 12.0 else -1.0
    step = float(ew.a2_scale) * 0.875
    # the construction needs the baseline on the oracle's side too (else the plain bound already holds the flip)
    assert float((base.double() - ref).abs().max()) < step / 4, "the baseline rounded the midpoint element otherwise"
    flipped = _moved(ref, ew, other)
    # the flip is far beyond the rule's bound, and the allowance covers it element by element
    with pytest.raises(AssertionError, match="exceeds the rule's bound"):
        assert_within_rule(flipped, ref, base)
    assert_within_rule(flipped, ref, base, allowance=allowance)
    assert torch.allclose(allowance, torch.full_like(allowance, step), rtol=1e-6), "allowance != one flip's effect"
    # nothing more: two steps (a wrong value, not a rounding choice) still fail
    with pytest.raises(AssertionError, match="beyond its allowance"):
        assert_within_rule(_moved(ref, ew, 2 * other), ref, base, allowance=allowance)


def _other_kernel(x, ids, w, ew, rounding="nearest"):
    """The layer as another correct kernel might compute it: gate-up sums in fp32 in 32-deep chunks
    taken in reverse K order (another summation order than the oracle's and the baseline's), the
    kernels' activation quantisation, the down GEMM and weighted sum exact, rounded to bf16.
    ``rounding="toward_zero"``: the intermediate's e4m3 conversion truncates (a defect)."""
    w13, w2 = dequant_weights(ew)
    i_size = w2.shape[2]
    per_tensor = ew.format == "fp8_per_tensor"
    xq = quant_fp8_static(x.float(), ew.a13_scale) if per_tensor else dequant_group(*quant_fp8_group(x.float()))
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids.long() == e, as_tuple=True)
        if not tok.numel():
            continue
        gu = torch.zeros(tok.numel(), 2 * i_size, device=x.device)
        for k0 in reversed(range(0, xq.shape[1], 32)):
            gu = gu + xq[tok, k0:k0 + 32] @ w13[e][:, k0:k0 + 32].T
        h = torch.nn.functional.silu(gu[:, :i_size]) * gu[:, i_size:]
        if per_tensor:
            scale = ew.a2_scale.float()
            v = h / scale
        else:
            _, gs = quant_fp8_group(h)
            scale = gs.repeat_interleave(128, 1)
            v = h / scale
        q = v.clamp(-448, 448).to(FP8)
        if rounding == "toward_zero":  # one e4m3 step back toward zero wherever nearest rounded away from it
            bits = q.view(torch.uint8)
            away = (q.float().abs() > v.abs()) & ((bits & 0x7F) > 0)
            q = torch.where(away, bits - 1, bits).view(FP8)
        y.index_add_(0, tok, ((q.float() * scale).double() @ w2[e].double().T) * w[tok, slot].double()[:, None])
    return y.bfloat16()


@pytest.mark.parametrize("fmt", ["fp8_per_tensor", "fp8_block"])
def test_another_correct_order_passes_and_truncation_fails(device, fmt):
    """20 draws: another correct summation order passes with the allowance at every draw (no false
    alarm; at these sizes its flips stay below the plain bound too, so this half alone does not show the
    allowance is needed: the midpoint test above does); the same kernel with truncating requantisation
    fails at every draw, allowance or not (the allowance does not absorb a rounding-mode defect)."""
    for seed in range(20):
        g = torch.Generator(device=device).manual_seed(seed)
        ew = random_moe_weights(fmt, 8, 512, 256, device, generator=g)
        x = torch.randn(64, 512, device=device, generator=g).bfloat16()
        ids, w = random_routing(64, 4, 8, device, generator=g)
        ref, base, allowance = moe_rule_terms(x, ids, w, ew)
        assert_within_rule(_other_kernel(x, ids, w, ew), ref, base, allowance=allowance, what=f"seed {seed}")
        with pytest.raises(AssertionError):
            assert_within_rule(_other_kernel(x, ids, w, ew, "toward_zero"), ref, base, allowance=allowance)


@pytest.mark.parametrize("fmt", ["fp8_per_tensor", "fp8_block"])
def test_allowance_is_sparse(device, fmt):
    """A tripwire for an allowance grown loose: at a random draw only the few intermediate elements near a
    midpoint count, so most output rows of single-pair tokens get none. Its size is not bounded: one flip
    of a large element can exceed the rule's bound (round V4), which is why it exists."""
    g = torch.Generator(device=device).manual_seed(1)
    ew = random_moe_weights(fmt, 8, 512, 256, device, generator=g)
    x = torch.randn(256, 512, device=device, generator=g).bfloat16()
    ids, w = random_routing(256, 1, 8, device, generator=g)
    ref, base, allowance = moe_rule_terms(x, ids, w, ew)
    rows = int((allowance.amax(1) > 0).sum())
    assert rows < 256 // 2, f"{rows} of 256 rows have an allowance"


@pytest.mark.parametrize("fmt", ["fp8_per_tensor", "fp8_block"])
def test_windows_hold_every_perturbation_of_gate_and_up(device, fmt):
    """The window each intermediate element may round in, against brute force: gate and up moved by
    anything within their error bound (random points and the four corners), the intermediate and (block
    mode) the group scale recomputed in float64 from the definition, the e4m3 code reached lies within
    [code(v - dv), code(v + dv)] for every element. This checks the derivative and the scale term the
    allowance uses, with the bound inflated 1000x so that the windows are wide enough to matter."""
    g = torch.Generator(device=device).manual_seed(2)
    ew = random_moe_weights(fmt, 4, 256, 128, device, generator=g)
    x = torch.randn(16, 256, device=device, generator=g).bfloat16()
    ids, _ = random_routing(16, 2, 4, device, generator=g)
    one = torch.ones((), device=device)
    window = requant_window(x, ew, factor=2000.0)
    checked = 0
    for e in range(4):
        tok = torch.nonzero((ids == e).any(1)).flatten()
        gg, uu, dgu, s, v, dv = window(e, tok)
        lo, hi = _codes(v - dv, one), _codes(v + dv, one)
        gen = torch.Generator(device=device).manual_seed(3)
        corners = [(a, b) for a in (-1.0, 1.0) for b in (-1.0, 1.0)]
        for i in range(12):
            if i < 4:
                dg, du = (torch.full_like(gg, c * dgu) for c in corners[i])
            else:
                dg, du = ((torch.rand(gg.shape, device=device, generator=gen, dtype=gg.dtype) * 2 - 1) * dgu
                          for _ in range(2))
            h = torch.nn.functional.silu(gg + dg) * (uu + du)
            if fmt == "fp8_per_tensor":
                sp = s
            else:
                amax = h.abs().reshape(h.shape[0], -1, 128).amax(-1).clamp_min(1e-10)
                sp = (amax / 448.0).repeat_interleave(128, 1)
            code = _codes(h / sp, one)
            bad = (code < torch.minimum(lo, hi)) | (code > torch.maximum(lo, hi))
            assert not bad.any(), f"{int(bad.sum())} codes outside their window (dgu {dgu:.2e})"
            checked += code.numel()
        # the windows are not trivially everything: most elements still have a single code
        assert float((lo == hi).double().mean()) > 0.5
    assert checked > 0


def _codes(v, one):
    from evenflow.reference.moe import _fp8_static
    return _fp8_static(v, one).double()


def _draw_with_an_allowance(device, fmt, inter):
    """(generator, weights, x, ids, w, allowance) of a 32-token top-2 draw over 4 experts (hidden 256) whose
    allowance is not zero somewhere (seed 4)."""
    g = torch.Generator(device=device).manual_seed(4)
    ew = random_moe_weights(fmt, 4, 256, inter, device, generator=g)
    x = torch.randn(32, 256, device=device, generator=g).bfloat16()
    ids, w = random_routing(32, 2, 4, device, generator=g)
    allowance = moe_requant_allowance(x, ids, w, ew)
    assert allowance.any(), "the draw has no element near a midpoint; pick another seed"
    return g, ew, x, ids, w, allowance


@pytest.mark.parametrize("fmt", ["fp8_per_tensor", "fp8_block"])
def test_allowance_follows_the_layer(device, fmt):
    """The allowance scales with |routed_scaling|, moves with the expert ids of another EP rank (the same
    experts as global ids of rank 2), ignores the shared output (added after, never rounded to fp8), and
    the baseline's own flips are counted once: the rule's bound is taken net of the allowance."""
    g, ew, x, ids, w, base_al = _draw_with_an_allowance(device, fmt, 128)
    assert torch.allclose(moe_requant_allowance(x, ids, w, ew, routed_scaling=-2.5), 2.5 * base_al)
    assert torch.equal(moe_requant_allowance(x, ids + 8, w, ew, ep_rank=2, num_experts_total=12), base_al)
    shared = torch.randn(32, 256, device=device, generator=g).bfloat16()
    assert torch.equal(moe_requant_allowance(x, ids, w, ew, shared_output=shared), base_al)
    from evenflow.testing import error_bound
    ref = torch.zeros(2, 3, dtype=torch.float64)
    baseline = ref.clone()
    baseline[0, 1] = 0.5  # the baseline's own flip
    allow = torch.zeros_like(ref)
    allow[0, 1] = 0.5
    assert error_bound(ref, baseline, torch.bfloat16) == 1.0
    assert error_bound(ref, baseline, torch.bfloat16, allowance=allow) == 0.0


@pytest.mark.parametrize("fmt", ["fp8_per_tensor", "fp8_block"])
def test_shard_allowances_sum_to_the_split_layers(device, fmt):
    """benchmarks/multigpu.py checks a split layer with the sum of its shards' allowances (each rank
    requantises its own shard's intermediate). Split by experts (EP2) the sum is the unsplit layer's
    allowance; split along the intermediate (TP2, whole 128-groups) each shard's windows come from its own
    products' baseline errors (another GEMM shape, which may round differently), so the sum is about the
    layer's, not equal element for element: not zero, and within a factor 1.5 of it in total."""
    from evenflow import parallel as par

    _, ew, x, ids, w, full = _draw_with_an_allowance(device, fmt, 256)
    for kind in ("ep", "tp"):
        parts = []
        for rank in range(2):
            shard, ep_rank = par.shard_moe_weights(ew, kind, rank, 2)
            parts.append(moe_requant_allowance(x, ids, w, shard, ep_rank=ep_rank, num_experts_total=4))
        total = parts[0] + parts[1]
        if kind == "ep":
            torch.testing.assert_close(total, full, rtol=1e-12, atol=0)
        else:
            assert total.any() and 1 / 1.5 <= float(total.sum() / full.sum()) <= 1.5, (kind, total.sum(), full.sum())


def test_rule_check_reports_what_assert_within_rule_raises():
    """``rule_check`` (the demo's and the 2-GPU benchmark's check) returns, without raising, the failure
    ``assert_within_rule`` raises, the measured error and the bound: a pass, an error past the bound, one
    within its allowance, a non-finite output and a shape mismatch; a non-finite reference, baseline or allowance
    fails too (before round BX a NaN there made the bound NaN, and any error passed)."""
    from evenflow.testing import rule_check

    ref = torch.zeros(2, 3, dtype=torch.float64)
    base = ref.clone()
    base[0, 0] = 0.25  # bound 0.5
    allow = torch.zeros_like(ref)
    allow[1, 2] = 1.0
    cases = [(torch.full((2, 3), 0.5), None, ""), (torch.full((2, 3), 0.75), None, "exceeds the rule's bound"),
             (torch.tensor([[0.5, 0, 0], [0, 0, 1.5]]), allow, ""),
             (torch.tensor([[0.5, 0, 0], [0, 0, 1.75]]), allow, "beyond its allowance"),
             (torch.tensor([[float("nan"), 0, 0], [0, 0, 0]]), None, "non-finite"),
             (torch.zeros(3, 2), None, "shape")]
    for name in ("reference", "baseline", "allowance"):
        r, b, a = ref.clone(), base.clone(), allow.clone()
        {"reference": r, "baseline": b, "allowance": a}[name][1, 1] = float("nan")
        msg, _, _ = rule_check(torch.full((2, 3), 97.0).bfloat16(), r, b, allowance=a)
        assert f"non-finite values in the {name}" in msg, (name, msg)
        with pytest.raises(AssertionError, match=f"non-finite values in the {name}"):
            assert_within_rule(torch.zeros(2, 3).bfloat16(), r, b, allowance=a)
    for out, allowance, why in cases:
        out = out.bfloat16()
        msg, err, bound = rule_check(out, ref, base, allowance=allowance)
        assert (why in msg) if why else msg == "", (why, msg)
        if why in ("", "exceeds the rule's bound"):
            assert err == float((out.double() - ref).abs().max()) and bound == 0.5, (err, bound)  # ref 0: no ulp term
        if why:
            with pytest.raises(AssertionError, match=why):
                assert_within_rule(out, ref, base, allowance=allowance)
        else:
            assert assert_within_rule(out, ref, base, allowance=allowance) == err
