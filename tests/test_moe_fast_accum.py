"""fused_moe(fp8_accum="fast" / "promoted"): plumbing, argument rules and tile rules (CPU interpreter; runs on a
GPU too).

The fast mode feeds e4m3 tiles to fp8 MMAs with the hardware's reduced-precision accumulation
(kernels.py, FAST_ACC). The interpreter computes those dots exactly (fp32 sums), so in the
interpreter the fast mode must meet the default mode's rule against the same fp32 baseline as
tests/test_moe.py: this checks the scales, the block-128 promotion and the launcher, not the
hardware's numerics. Run on a GPU (benchmarks/device.sh runs every tests/test_moe*.py there),
the fast mode's baseline is its own, ``moe_fast_accum_baseline``, as in tests/test_moe_gpu.py (the promoted
mode's: the same with per-tensor products promoted per 128-deep K block).
The real shapes against the fast-accumulation baseline (``moe_fast_accum_baseline``:
``torch._scaled_mm(use_fast_accum=True)``) are in tests/test_moe_gpu.py; the sm_90 build (fp8
wgmma, no spills) in tests/test_sm90_compile.py.
"""
import dataclasses

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.moe.fused import MoEConfig, check_config, choose_config
from evenflow.reference.moe import (
    moe_fast_accum_baseline,
    moe_reference,
    moe_rule_terms,
    random_moe_weights,
    random_routing,
)
from evenflow.testing import assert_within_rule, poisoned

FP8_FORMATS = ["fp8_per_tensor", "fp8_block"]
# multiples of 32 (fast per-tensor needs K-steps >= 32), and of 128 for block scales
SIZES = {"fp8_per_tensor": (64, 64), "fp8_block": (256, 128)}


def check_moe(y, x, ids, w, ew, what, accum="exact", **kw):
    """The rule of tests/test_moe.py: fp64 oracle, baseline fp32 math on the fp8 values (the
    interpreter's fp8 dots are exact); on a GPU the fp8-MMA modes' baselines are their own."""
    fast = False if accum == "exact" or _runtime.interpreting() else accum
    ref, base, allowance = moe_rule_terms(x, ids, w, ew, fast_accum=fast, **kw)
    return assert_within_rule(y, ref, base, what=what, allowance=allowance)


@pytest.mark.parametrize("accum", ["exact", "promoted", "fast"])
@pytest.mark.parametrize("ep", [False, True], ids=["no-ep", "ep"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fast_accum_matches_reference(device, fmt, ep, accum):
    """Every fp8 format, EP on and off, both modes, on the tile classes each batch gets: pair
    tiles (T = 1), 16-row index tiles (T = 3), and above 16 rows per expert the fast mode's own
    64-row tiles (40 expected rows per expert: T = 40 on one rank, 120 over three)."""
    h, i = SIZES[fmt]
    e_local, ranks = 2, 3 if ep else 1
    ep_rank = 1 if ep else 0
    ew = random_moe_weights(fmt, e_local, h, i, device)
    for t, k in ((1, 2), (3, 2), (40 * ranks, 2)):
        x = torch.randn(t, h, device=device).bfloat16()
        ids, w = random_routing(t, k, e_local * ranks, device)
        if ep:
            ids[0, 0] = ep_rank * e_local  # at least one pair on this rank
        out = poisoned((t, h), torch.bfloat16, device)
        y = evenflow.fused_moe(x, ids, w, ew, ep_rank=ep_rank, num_experts_total=e_local * ranks, out=out,
                               fp8_accum=accum)
        check_moe(y, x, ids, w, ew, f"{fmt} {accum} T={t} ep_rank={ep_rank}", accum, ep_rank=ep_rank)


@pytest.mark.parametrize("accum", ["fast", "promoted"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fast_accum_forced_tiles_split_k_and_shared(device, fmt, accum):
    """Forced configs of the fp8-MMA modes: 64/128-row tiles, a gate-up and down K split (32-deep
    per-tensor steps: promoted per 32 products), with shared_output and routed_scaling."""
    h, i = SIZES[fmt]
    ew = random_moe_weights(fmt, 4, h, i, device)
    base = choose_config(5, 3, 4, h, i, ew.mode, fast_acc=True)
    bk = 128 if fmt == "fp8_block" else 32
    cfgs = [
        MoEConfig(64, 128 if fmt == "fp8_block" else 64, bk, 64, bk, 8, 3),
        MoEConfig(128, 128 if fmt == "fp8_block" else 64, bk, 64, bk, 8, 3),
        dataclasses.replace(base, gu_block_k=bk, down_block_k=bk, gu_split_k=2,
                            down_split_k=2 if i % (2 * bk) == 0 else 1),
    ]
    t = 9
    x = torch.randn(t, h, device=device).bfloat16()
    ids, w = random_routing(t, 3, 4, device)
    shared = torch.randn(t, h, device=device).bfloat16()
    for cfg in cfgs:
        check_config(cfg, h, i, ew.mode, fast_acc=True)
        y = evenflow.fused_moe(x, ids, w, ew, shared_output=shared, routed_scaling=1.5, config=cfg,
                               fp8_accum=accum, out=poisoned((t, h), torch.bfloat16, device))
        check_moe(y, x, ids, w, ew, f"{fmt} {accum} {cfg}", accum, shared_output=shared, routed_scaling=1.5)


def test_fast_accum_argument_errors(device):
    ew8 = random_moe_weights("fp8_per_tensor", 4, 64, 64, device)
    x = torch.randn(3, 64, device=device).bfloat16()
    ids, w = random_routing(3, 2, 4, device)
    for bad in ("Fast", "fp8", "", None, 1, True):
        with pytest.raises(ValueError, match="fp8_accum"):
            evenflow.fused_moe(x, ids, w, ew8, fp8_accum=bad)
    # bf16 weights: the mode applies to FP8 weights only
    ew16 = random_moe_weights("bf16", 4, 64, 32, device)
    for accum in ("fast", "promoted"):
        with pytest.raises(ValueError, match=f"fp8_accum='{accum}' applies to FP8 weights only"):
            evenflow.fused_moe(x, ids, w, ew16, fp8_accum=accum)
    evenflow.fused_moe(x, ids, w, ew16, fp8_accum="exact")  # the default is accepted everywhere
    # per-tensor sizes of 16 that are not of 32 (80 x 48): fine by default, refused in fast mode
    ew_16 = random_moe_weights("fp8_per_tensor", 4, 80, 48, device)
    x80 = torch.randn(3, 80, device=device).bfloat16()
    for accum in ("fast", "promoted"):
        with pytest.raises(ValueError, match=f"fp8_accum='{accum}' needs hidden .80. and intermediate .48."):
            evenflow.fused_moe(x80, ids, w, ew_16, fp8_accum=accum)
    ew_h = random_moe_weights("fp8_per_tensor", 4, 64, 48, device)
    with pytest.raises(ValueError, match="fp8_accum"):
        evenflow.fused_moe(x, ids, w, ew_h, fp8_accum="fast")
    # a forced config with 16-deep K steps: valid by default, refused in fast mode
    cfg = dataclasses.replace(choose_config(3, 2, 4, 64, 64, 1), gu_block_k=16)
    evenflow.fused_moe(x, ids, w, ew8, config=cfg)
    for accum in ("fast", "promoted"):
        with pytest.raises(ValueError, match="fp8_accum='fast' / 'promoted'.*K-steps"):
            evenflow.fused_moe(x, ids, w, ew8, config=cfg, fp8_accum=accum)


def test_check_config_rejects_16_deep_k_steps_in_fast_mode():
    h, i = 256, 128
    for mode in (1, 2):
        base = choose_config(4, 2, 4, h, i, mode, fast_acc=True)
        check_config(base, h, i, mode, fast_acc=True)
        if mode == 2:  # block mode's K steps are 128 by its own rule
            continue
        for field in ("gu_block_k", "down_block_k"):
            cfg = dataclasses.replace(base, **{field: 16})
            check_config(cfg, h, i, mode)  # the default mode takes 16-deep steps (f16 products)
            with pytest.raises(ValueError, match="fp8_accum='fast'"):
                check_config(cfg, h, i, mode, fast_acc=True)


@pytest.mark.parametrize("mode", [1, 2])
def test_choose_config_fast_never_16_deep_and_wgmma_above_16_rows(mode):
    """choose_config(fast_acc=True): K-steps >= 32 at every batch and shape (multiples of 32;
    down K = 96: 32-deep steps); above 16 rows per expert 64/128-row tiles on 8 warps (fp8
    wgmma on sm_90), 128 rows only per-tensor (block mode's extra product tile would spill);
    at <= 16 rows the default mode's tiles (mma.sync: same numerics)."""
    shapes = [(128, 128, 8, 2048, 768), (192, 192, 8, 4096, 192), (24, 192, 8, 4096, 1536), (8, 8, 2, 256, 128)]
    if mode == 1:
        shapes += [(8, 8, 2, 96, 96), (4, 4, 2, 160, 32)]
    for e_loc, e_tot, k, h, i in shapes:
        if mode == 2 and i % 128:
            continue  # not a block-128 shape (Hy3 TP8's I = 192)
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384):
            cfg = choose_config(t, k, e_loc, h, i, mode, num_experts_total=e_tot, sms=132, fast_acc=True)
            check_config(cfg, h, i, mode, fast_acc=True)
            assert min(cfg.gu_block_k, cfg.down_block_k) >= 32, (t, h, i, cfg)
            rows = t * k / e_tot
            exact = choose_config(t, k, e_loc, h, i, mode, num_experts_total=e_tot, sms=132)
            if rows > 16:
                assert cfg.block_m in (64, 128) and cfg.num_warps == 8, (t, h, i, cfg)
                assert cfg.block_m == (128 if mode == 1 and rows > 128 else 64), (t, cfg)
            elif min(exact.gu_block_k, exact.down_block_k) >= 32:
                assert cfg == exact, (t, h, i, cfg, exact)


def test_tuned_lookup_keeps_fast_keys_apart(tmp_path):
    import json

    from evenflow.moe.fused import _load_tuned, tuned_config, tuned_key

    a = MoEConfig(64, 128, 128, 128, 128, 8, 3, 1, 1)
    b = MoEConfig(32, 64, 128, 64, 128, 4, 4, 1, 1)
    bad = MoEConfig(32, 64, 16, 64, 128, 4, 4, 1, 1)  # 16-deep gate-up steps: not for the fast mode
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"configs": {tuned_key(8, 8, 2, 256, 128, 1): {"64": b.as_list()},
                                         tuned_key(8, 8, 2, 256, 128, 1, "fast"): {"64": a.as_list(),
                                                                                 "512": bad.as_list()}}}))
    assert tuned_key(8, 8, 2, 256, 128, 1, "fast") == tuned_key(8, 8, 2, 256, 128, 1) + "-fast"
    assert tuned_key(8, 8, 2, 256, 128, 1, "promoted") == tuned_key(8, 8, 2, 256, 128, 1) + "-prom"
    with pytest.raises(ValueError, match="accum must be one of"):
        tuned_key(8, 8, 2, 256, 128, 1, True)
    _load_tuned.cache_clear()

    def get(t, fast, promote=False):
        accum = ("promoted" if promote else "fast") if fast else "exact"
        return tuned_config(t, 2, 8, 256, 128, 1, num_experts_total=8, device=None, path=str(p), accum=accum)
    assert get(100, False) == b and get(100, True) == a
    assert get(100, True, promote=True) is None  # the promoted mode reads its own keys only
    with pytest.warns(UserWarning, match="ignoring tuned MoE config"):
        assert get(600, True) is None  # the heuristic takes over, never the default mode's entry
    p.write_text(json.dumps({"configs": {tuned_key(8, 8, 2, 256, 128, 1): {"64": b.as_list()}}}))
    _load_tuned.cache_clear()
    assert get(100, False) == b and get(100, True) is None
    _load_tuned.cache_clear()


@pytest.mark.skipif(not _runtime.interpreting(), reason="records interpreter launches")
def test_exact_is_the_default_and_builds_the_kernels_with_fast_acc_off():
    """fp8_accum="exact" (and leaving it out) launches the GEMM kernels with FAST_ACC=0, the
    constexpr under which the sm_90 build is the one from before the mode existed (checked by
    compiling; docs/perf-notes/moe.md, round J); "fast" with FAST_ACC=1, "promoted" with 2."""
    from evenflow._compile_check import record_launches

    for fmt in ("bf16", *FP8_FORMATS):
        h, i = SIZES.get(fmt, (64, 32))
        ew = random_moe_weights(fmt, 4, h, i)
        x = torch.randn(5, h).bfloat16()
        ids, w = random_routing(5, 2, 4)
        for kw, want in (({}, 0), ({"fp8_accum": "exact"}, 0), ({"fp8_accum": "fast"}, 1),
                         ({"fp8_accum": "promoted"}, 2)):
            if fmt == "bf16" and want:
                continue
            with record_launches(execute=True) as launches:
                y = evenflow.fused_moe(x, ids, w, ew, **kw)
            gemms = [la for la in launches if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
            assert len(gemms) == 2
            assert all(type(c) is int and c == want for c in (dict(la.constexprs)["FAST_ACC"] for la in gemms)), \
                (fmt, kw)
            if not kw:
                y_default = y
            elif kw["fp8_accum"] == "exact":
                assert torch.equal(y, y_default), "fp8_accum='exact' is the default"


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fast_accum_baseline_builder(device, fmt):
    """moe_fast_accum_baseline (the GPU tests' baseline) computes the layer: within the rule of
    the fp64 oracle against the default fp32 baseline, with EP, shared output and scaling. On a
    CPU its _scaled_mm sums exactly in fp32, so it sits at fp32 rounding from that baseline; on
    a GPU with fast accumulation it is farther (that is what it is for), so this runs on a CPU."""
    if device != "cpu":
        pytest.skip("on a GPU the baseline is meant to differ (fast accumulation)")
    h, i = SIZES[fmt]
    ew = random_moe_weights(fmt, 3, h, i)
    t = 11
    x = torch.randn(t, h).bfloat16()
    ids, w = random_routing(t, 3, 6)
    ids[0] = torch.tensor([3, 4, 5], dtype=torch.int32)  # all on rank 1
    shared = torch.randn(t, h).bfloat16()
    kw = {"ep_rank": 1, "shared_output": shared, "routed_scaling": 2.0}
    got = moe_fast_accum_baseline(x, ids, w, ew, **kw)
    assert got.dtype == torch.float32 and got.shape == (t, h)
    ref = moe_reference(x, ids, w, ew, dtype=torch.float64, **kw)
    base = moe_reference(x, ids, w, ew, dtype=torch.float32, **kw)
    assert_within_rule(got, ref, base, what=f"{fmt} fast baseline on CPU")
    prom = moe_fast_accum_baseline(x, ids, w, ew, promoted=True, **kw)
    assert_within_rule(prom, ref, base, what=f"{fmt} promoted baseline on CPU")
    if fmt == "fp8_block":  # block weights promote per 128 in both modes: the same baseline
        assert torch.equal(prom, got)
    with pytest.raises(ValueError, match="FP8 weights"):
        moe_fast_accum_baseline(x, ids, w, random_moe_weights("bf16", 3, h, 32))


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fast_accum_compile(device, fmt):
    """torch.compile's path passes fp8_accum on to the custom op (its opcheck with "fast" is
    tests/test_moe.py::test_opcheck)."""
    h, i = SIZES[fmt]
    ew = random_moe_weights(fmt, 4, h, i, device)
    x = torch.randn(3, h, device=device).bfloat16()
    ids, w = random_routing(3, 2, 4, device)
    eager = evenflow.fused_moe(x, ids, w, ew, check_ids=False, fp8_accum="fast")
    seen = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "evenflow.fused_moe_" in str(n.target):
                pos = [a.name for a in n.target._schema.arguments].index("fp8_accum")
                seen.append(n.args[pos] if len(n.args) > pos else n.kwargs.get("fp8_accum"))
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def layer(x, ids, w):
        return evenflow.fused_moe(x, ids, w, ew, check_ids=False, fp8_accum="fast")

    assert torch.equal(layer(x, ids, w), eager)
    assert seen == ["fast"], seen
