"""Every kernel launch our launchers make at real GPU shapes compiles for sm_90 — on a CPU.

The interpreter cannot see GPU compile errors; round one on the H200 failed mostly on
them. Here each operator's launcher is driven (under ``emulate_gpu``: the choices it
would make on an H200) through its configurations at real shapes with CPU tensors,
its launches are recorded without being executed, and every distinct launch is
compiled by Triton's real compiler to a cubin (``evenflow._compile_check``).

Each operator owns one scenario function below; add a scenario whenever a launcher
gains a configuration (a new dtype path, block size, or dispatch branch).
"""
import dataclasses

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow._compile_check import compile_launches, emulate_gpu, record_launches
from evenflow.reference.moe import random_moe_weights

pytestmark = pytest.mark.skipif(not _runtime.interpreting(),
                                reason="records interpreter launches; on a GPU the real tests compile everything")

FP8 = torch.float8_e4m3fn


def _decode_launches():
    out = []
    # (Hq, Hkv, D, page, q_len, kv dtype, q fp8): the standard cases, TP8 slice, and the
    # API's ranges of head_dim, page size, GQA group and q_len.
    shapes = [(64, 8, 128, 64, 1, torch.bfloat16, False), (64, 8, 128, 64, 1, FP8, False),
              (64, 8, 128, 64, 1, FP8, True), (8, 1, 128, 64, 1, torch.bfloat16, False),
              (32, 4, 128, 16, 2, torch.bfloat16, False), (16, 4, 64, 32, 4, torch.bfloat16, False),
              (16, 1, 256, 128, 3, torch.bfloat16, False), (4, 4, 128, 64, 1, FP8, False)]
    lens = [32 * 1024] + [512] * 15
    for hq, hkv, d, page, q_len, kv_dtype, q_fp8 in shapes:
        b = len(lens)
        max_pages = (max(lens) + page - 1) // page
        num_pages = sum((n + page - 1) // page for n in lens) + 1
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        page_table = torch.arange(b * max_pages, dtype=torch.int32).reshape(b, max_pages) % num_pages
        k = torch.empty(num_pages, page, hkv, d, dtype=kv_dtype)
        v = torch.empty_like(k)
        q = torch.empty(b * q_len, hq, d, dtype=FP8 if q_fp8 else torch.bfloat16)
        kw = {}
        if kv_dtype == FP8:
            kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
        if q_fp8:
            kw["q_scale"] = torch.ones(b * q_len, hq)
        plan = evenflow.DecodePlan(b, max(lens), hkv, page_size=page, q_len=q_len, device="cpu")
        plan.update(seq_lens)
        for p in (plan, None):
            evenflow.decode_attention(q, k, v, page_table, seq_lens, plan=p, **kw)
        out.append(f"{hq}/{hkv} d{d} p{page} q{q_len} {kv_dtype}")
    return out


def _router_launches():
    for k, n in [(4096, 192), (6144, 768), (3072, 384), (2048, 128)]:
        w = evenflow.RouterWeight(torch.randn(n, k) * 0.02)
        for m in (1, 4, 16, 64, 128, 512, 1024, 4096, 8192):
            x = torch.empty(m, k, dtype=torch.bfloat16)
            evenflow.router_gemm(x, w)
            evenflow.router_gemm(x, w, batch_invariant=True)
        for scoring, bias in (("softmax", None), ("sigmoid", torch.zeros(n))) if n <= 512 else ():
            evenflow.route(torch.empty(16, k, dtype=torch.bfloat16), w, 8, scoring=scoring, bias=bias)


def _moe_launches():
    # Real hidden/intermediate sizes (they set the tiles); few experts, since the
    # expert count changes no constexpr and real weight tensors would be gigabytes.
    shapes = {"qwen3-30b-a3b": (2048, 768, 0), "hy3-tp8": (4096, 192, 0), "hy3-ep8": (4096, 1536, 3)}
    e_local, top_k = 4, 8
    for h, i, ep_rank in shapes.values():
        for fmt in ("bf16", "fp8_per_tensor", "fp8_block"):
            if fmt == "fp8_block" and i % 128:
                continue
            ew = random_moe_weights(fmt, e_local, h, i)
            total = e_local * 8 if ep_rank else e_local
            for t in (1, 4, 8, 64, 512, 4096):  # 4: 32 pairs, pair tiles since round AK
                x = torch.randn(t, h).bfloat16()
                ids = torch.randint(0, total, (t, top_k), dtype=torch.int32)
                w = torch.rand(t, top_k)
                evenflow.fused_moe(x, ids, w, ew, ep_rank=ep_rank, num_experts_total=total)
    # Decode batches with the gate-up's K-split reduction deferred to the down GEMM (gu_defer), as
    # the tuned table runs them at T = 1, 2 (the heuristic never defers)
    import dataclasses

    from evenflow.moe.fused import choose_config
    for h, i, _ in shapes.values():
        for fmt, mode in (("bf16", 0), ("fp8_per_tensor", 1), ("fp8_block", 2)):
            if mode == 2 and i % 128:
                continue
            ew = random_moe_weights(fmt, e_local, h, i)
            for t in (1, 2):
                cfg = choose_config(t, top_k, e_local, h, i, mode)
                cfg = dataclasses.replace(cfg, gu_split_k=max(2, cfg.gu_split_k), gu_defer=1)
                evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, e_local, (t, top_k),
                                   dtype=torch.int32), torch.rand(t, top_k), ew, config=cfg)
    # Block mode on 64-wide gate-up N blocks (each activation group requantised by its last program), as
    # the tuner offers them at decode and mid batches: index tiles, with and without a K-split gate-up, and the
    # persistent loop around them (round U: Triton 3.6 failed to build it flattened)
    h, i, _ = shapes["qwen3-30b-a3b"]
    ew = random_moe_weights("fp8_block", e_local, h, i)
    for t, gs, per_sm in ((4, 2, 0), (64, 1, 0), (256, 1, 0), (256, 1, 1)):
        cfg = dataclasses.replace(choose_config(t, top_k, e_local, h, i, 2), gu_block_n=64, gu_split_k=gs)
        evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, e_local, (t, top_k), dtype=torch.int32),
                           torch.rand(t, top_k), ew, config=cfg, pair_tiles=False, persistent=per_sm)
    # Persistent GEMMs (one flattened loop over tasks and K steps) at the large-batch configs
    for (h, i, _), fmts, batches in ((shapes["qwen3-30b-a3b"], ("bf16", "fp8_per_tensor", "fp8_block"), (512, 4096)),
                                     (shapes["hy3-tp8"], ("bf16", "fp8_per_tensor"), (4096,))):
        for fmt in fmts:
            ew = random_moe_weights(fmt, e_local, h, i)
            for t in batches:
                evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, e_local, (t, top_k),
                                   dtype=torch.int32), torch.rand(t, top_k), ew, persistent=1)
    # The tiny shapes of tests/test_moe.py run on the GPU too (round B: fp8 K=16 dots failed there),
    # with the split-K configs test_split_k forces.
    for fmt, (h, i) in {"bf16": (64, 32), "fp8_per_tensor": (64, 64), "fp8_block": (256, 128)}.items():
        ew = random_moe_weights(fmt, 6, h, i)
        for t, k in ((1, 1), (3, 2), (17, 4), (40, 1)):
            x = torch.randn(t, h).bfloat16()
            ids = torch.randint(0, 6, (t, k), dtype=torch.int32)
            evenflow.fused_moe(x, ids, torch.rand(t, k), ew)
        base = choose_config(5, 3, 6, h, i, ew.mode)
        down_bk = base.down_block_k if fmt == "fp8_block" else 16 if fmt == "bf16" else 32
        cfg = dataclasses.replace(base, gu_block_k=base.gu_block_k if fmt == "fp8_block" else
                                  min(base.gu_block_k, h // 2), down_block_k=down_bk, gu_split_k=2,
                                  down_split_k=2 if i % (2 * down_bk) == 0 else 1)
        evenflow.fused_moe(torch.randn(5, h).bfloat16(), torch.randint(0, 6, (5, 3), dtype=torch.int32),
                           torch.rand(5, 3), ew, config=cfg)
    # per-tensor fp8 at sizes of 16 (16-deep K steps: f16 MMAs of e4m3 values), as test_moe.py runs them
    for h, i in ((80, 48), (96, 48)):
        ew = random_moe_weights("fp8_per_tensor", 4, h, i)
        for t in (1, 3, 17):
            cfg = choose_config(t, 2, 4, h, i, 1)
            if h == 96:
                cfg = dataclasses.replace(cfg, gu_block_k=16, gu_split_k=2)
            evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, 4, (t, 2), dtype=torch.int32),
                               torch.rand(t, 2), ew, config=cfg)


def _prologue_launches():
    # (Hq, Hkv, D, page, T): Qwen3-30B-A3B (32 / 4, d128), its TP8 slice, Llama-style 8 kv heads, d64 and d256,
    # at a decode step and a prefill chunk; every dtype pair, rotation style and norm form at Qwen3's shape
    shapes = [(32, 4, 128, 64, 1), (32, 4, 128, 64, 4096), (4, 1, 128, 16, 64), (64, 8, 128, 128, 8),
              (16, 2, 64, 32, 16), (8, 1, 256, 64, 16)]
    forms = [dict(), dict(q_dtype=FP8), dict(rope_style="gptj", norm_before_rope=False), dict(rotary_dim=64),
             dict(norms=False)]
    for i, (hq, hkv, d, page, t) in enumerate(shapes):
        for kv_dtype in (torch.bfloat16, FP8):
            for form in forms if i == 0 else forms[:2]:
                form = dict(form)
                norms = form.pop("norms", True)
                w = torch.ones(d, dtype=torch.bfloat16) if norms else None
                b = 4
                pages = (t + page - 1) // page + 1
                evenflow.qk_norm_rope_store_kv(
                    torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16), torch.zeros(t, dtype=torch.int64),
                    evenflow.rope_cos_sin(t + 1, form.get("rotary_dim", d)),
                    torch.empty(b * pages, page, hkv, d, dtype=kv_dtype),
                    torch.empty(b * pages, page, hkv, d, dtype=kv_dtype),
                    torch.zeros(b, pages, dtype=torch.int32), torch.tensor([0, t, t, t, t], dtype=torch.int32),
                    q_norm_weight=w, k_norm_weight=w, k_scale=torch.ones(1) if kv_dtype == FP8 else None, **form)


def _prefill_launches():
    # (Hq, Hkv, D, page, new tokens a request): Qwen3-30B-A3B chunks and short extends, the Hy3 heads, d64 / d256,
    # every block size the launcher picks (16, 32, 64 rows; 128 where the chunk has more than 64 rows at D <= 128),
    # bf16 and fp8 caches, with and without LSE, in the default form (round CA's unmasked steps and 128-row blocks,
    # round CC's packed heads: 2-8 heads a block at the short shapes); then one head a block (the benchmark's
    # evenflow-unpacked), and at Qwen3's chunk its evenflow-masked and evenflow-narrow rows and the split loop off
    # alone (the masked loop on 128-row and packed blocks)
    from evenflow.attention import prefill as P
    from evenflow.bench.harness import with_switches

    _prefill_shapes()
    with_switches(P, {"PACK_HEADS": False}, _prefill_shapes)  # the knob row: one head a block at the short shapes
    for knobs in ({"SPLIT_LOOP": False, "WIDE_ROWS": False, "PACK_HEADS": False},
                  {"WIDE_ROWS": False, "PACK_HEADS": False}, {"SPLIT_LOOP": False}):
        with_switches(P, knobs, lambda: _prefill_shapes(first_only=True))


def _prefill_shapes(first_only=False):
    shapes = [(32, 4, 128, 64, 2048), (32, 4, 128, 64, 12), (64, 8, 128, 16, 30), (16, 2, 64, 32, 100),
              (8, 1, 256, 128, 70), (4, 4, 128, 64, 3)][:1 if first_only else None]
    for hq, hkv, d, page, n in shapes:
        for kv_dtype in (torch.bfloat16, FP8):
            b = 2
            pages = (n + 100 + page - 1) // page
            k = torch.empty(b * pages, page, hkv, d, dtype=kv_dtype)
            evenflow.prefill_attention(
                torch.empty(b * n, hq, d, dtype=torch.bfloat16), k, torch.empty_like(k),
                torch.tensor([0, n, 2 * n], dtype=torch.int32), torch.zeros(b, pages, dtype=torch.int32),
                torch.full((b,), n + 100, dtype=torch.int32), n, return_lse=kv_dtype == FP8,
                k_scale=torch.ones(1) if kv_dtype == FP8 else None)


@pytest.mark.parametrize("family", ["decode", "router", "moe", "prologue", "prefill"])
def test_every_launch_compiles_for_sm90(family):
    scenario = {"decode": _decode_launches, "router": _router_launches, "moe": _moe_launches,
                "prologue": _prologue_launches, "prefill": _prefill_launches}[family]
    with emulate_gpu(132), record_launches() as launches:
        scenario()
    assert launches, "the scenario launched no kernel"
    failures = compile_launches(launches)
    assert not failures, f"{len(failures)} launches fail to compile for sm_90:\n" + "\n\n".join(failures)


def test_the_check_catches_a_gpu_only_compile_error():
    """A plain global read inside a kernel runs in the interpreter but fails the GPU compiler."""
    from tests_support_bad_kernel import bad_kernel, good_kernel

    x = torch.zeros(64)
    with emulate_gpu(), record_launches(execute=True) as launches:
        bad_kernel[(1,)](x, BLOCK=64)  # runs fine in the interpreter ...
        good_kernel[(1,)](x, BLOCK=64)
    assert torch.all(x == 2.0)
    failures = compile_launches(launches)
    assert len(failures) == 1 and "bad_kernel" in failures[0]  # ... but not for sm_90


# fp8_accum="fast" (round J): (label, format, H, I, T, forced config or None for the heuristic at T).
# Qwen3's heuristic picks at T = 1024 (64-row tiles) and 4096 (per-tensor 128 rows, block mode 64),
# Hy3 TP8's at 4096 (I = 192: 64-wide gate-up N, 64-deep down K), and 16/32-row tiles (decode
# split-K on pair tiles, a forced 32-row tile), which compile to mma.sync on f16 values as the
# default mode does.
_FAST = [
    ("qwen3 fp8-tensor T=1024", "fp8_per_tensor", 2048, 768, 1024, None),
    ("qwen3 fp8-tensor T=4096", "fp8_per_tensor", 2048, 768, 4096, None),
    ("qwen3 fp8-block T=1024", "fp8_block", 2048, 768, 1024, None),
    ("qwen3 fp8-block T=4096", "fp8_block", 2048, 768, 4096, None),
    ("hy3-tp8 fp8-tensor T=4096", "fp8_per_tensor", 4096, 192, 4096, None),
    ("qwen3 fp8-tensor T=1", "fp8_per_tensor", 2048, 768, 1, None),
    ("qwen3 fp8-block T=1", "fp8_block", 2048, 768, 1, None),
    ("qwen3 fp8-tensor bm32", "fp8_per_tensor", 2048, 768, 512, [32, 64, 128, 64, 128, 4, 4, 1, 1]),
    ("qwen3 fp8-block bm32", "fp8_block", 2048, 768, 512, [32, 128, 128, 64, 128, 4, 4, 1, 1]),
]
# fp8_accum="promoted": per-tensor heuristic picks (128-row tiles), a 64-row tile with 32-deep steps, and block
# mode (the fast mode's build).
_PROMOTED = [
    ("qwen3 fp8-tensor T=4096", "fp8_per_tensor", 2048, 768, 4096, None),
    ("hy3-tp8 fp8-tensor T=4096", "fp8_per_tensor", 4096, 192, 4096, None),
    ("qwen3 fp8-tensor bm64 k32", "fp8_per_tensor", 2048, 768, 512, [64, 128, 32, 128, 32, 8, 3, 1, 1]),
    ("qwen3 fp8-block T=4096", "fp8_block", 2048, 768, 4096, None),
]


def test_fp8_quantisers_keep_nan_through_their_clamp():
    """Every kernel that rounds values to e4m3 (MoE's input quantisers, the gate-up's requantisation, the prologue's
    fp8 q and fp8 K / V store) clamps with NaN-propagating min / max in its sm_90 build (``min.NaN.f32`` /
    ``max.NaN.f32``), so a NaN reaches the hardware cast, which gives e4m3's NaN, as torch.clamp and the cast do in
    the reference (round BX's audit: the plain min / max turned NaN into -448 and the output finite). The bf16
    gate-up, which quantises nothing, has neither: the contrast the check must see."""
    from evenflow._compile_check import compile_stats

    with emulate_gpu(132), record_launches() as rec:
        for fmt in ("bf16", "fp8_per_tensor", "fp8_block"):
            h, i = (256, 128)
            ew = random_moe_weights(fmt, 4, h, i)
            for t in (2, 64):
                evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, 4, (t, 2), dtype=torch.int32),
                                   torch.rand(t, 2), ew)
        evenflow.qk_norm_rope_store_kv(
            torch.empty(4, 6 * 128, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64),
            evenflow.rope_cos_sin(5, 128), torch.empty(2, 64, 1, 128, dtype=FP8), torch.empty(2, 64, 1, 128, dtype=FP8),
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), k_scale=torch.ones(1),
            q_dtype=FP8)
    quantisers = [la for la in rec if la.name in ("moe_group_quant_kernel", "moe_tensor_quant_kernel",
                                                  "qk_norm_rope_store_kv_kernel")
                  or (la.name == "moe_gate_up_kernel" and dict(la.constexprs).get("MODE", 0) != 0)]
    plain = [la for la in rec if la.name == "moe_gate_up_kernel" and dict(la.constexprs).get("MODE", 0) == 0]
    names = {la.name for la in quantisers}
    assert names == {"moe_group_quant_kernel", "moe_tensor_quant_kernel", "qk_norm_rope_store_kv_kernel",
                     "moe_gate_up_kernel"}, names
    assert plain
    stats = compile_stats(quantisers + plain)
    for la, st in zip(quantisers + plain, stats):
        assert "error" not in st, st["error"]
        ops = set(st["float_ops"])
        if la in plain:
            assert not {"min.NaN.f32", "max.NaN.f32"} & ops, la.describe()
        else:
            assert {"min.NaN.f32", "max.NaN.f32"} <= ops, (la.describe(), sorted(o for o in ops if "m" in o[:3]))


def test_moe_fast_accum_compiles_to_fp8_wgmma():
    """fp8_accum="fast" on sm_90: the 64/128-row tiles the heuristic gives compile to wgmma on
    e4m3 operands (no f16 MMA, no conversion), with no register spill and within the shared-memory
    limit; the 16/32-row tiles compile too (mma.sync, no spill). A default-mode 64-row tile (the
    heuristic's until round S8) is compiled beside them: f16 wgmma (its e4m3 values upcast), the
    contrast the check must see. fp8_accum="promoted" compiles to the same e4m3 wgmma; in per-tensor
    mode its K loop adds every accumulator element once per step (one FADD per element and thread:
    the promotion), where the fast mode's loop has none."""
    from evenflow._compile_check import SHARED_LIMIT, compile_stats
    from evenflow.moe.fused import MoEConfig, choose_config

    launches, expect = [], []
    cases = [(*c, "fast") for c in _FAST] + [(*c, "promoted") for c in _PROMOTED] + [
        ("qwen3 fp8-tensor exact bm64", "fp8_per_tensor", 2048, 768, 512, [64, 128, 128, 128, 128, 8, 3, 1, 1],
         "exact")]
    for label, fmt, h, i, t, cfg, accum in cases:
        ew = random_moe_weights(fmt, 4, h, i)
        if cfg is None:  # the heuristic of the real layer (128 or 192 experts), forced on these 4
            e = 192 if i == 192 else 128
            cfg = choose_config(t, 8, e, h, i, ew.mode, num_experts_total=e, sms=132, fast_acc=accum != "exact")
        else:
            cfg = MoEConfig.from_list(cfg)
        with emulate_gpu(132), record_launches() as rec:
            evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, 4, (t, 8), dtype=torch.int32),
                               torch.rand(t, 8), ew, config=cfg, fp8_accum=accum)
        for la in rec:
            if la.name in ("moe_gate_up_kernel", "moe_down_kernel") and la not in launches:
                launches.append(la)
                expect.append((f"{label} {la.name}", cfg, accum, fmt, la.name))
    stats = compile_stats(launches)
    assert len(stats) == len(launches)
    for (what, cfg, accum, fmt, name), s in zip(expect, stats):
        assert "error" not in s, s["error"]
        assert s["shared"] <= SHARED_LIMIT[90], (what, s["shared"])
        mma = s["mma"]
        if cfg.block_m >= 64:
            want = "f16.f16" if accum == "exact" else "e4m3.e4m3"
            assert set(mma["wgmma_types"]) == {want} and mma["mma.sync"] == 0, (what, cfg, mma)
        else:
            assert mma["wgmma"] == 0 and mma["mma.sync"] > 0, (what, cfg, mma)
        if accum != "exact":
            assert s["spill_bytes"] == 0, (what, cfg, s["regs"], s["spill_bytes"])
            if cfg.block_m >= 64:  # no e4m3 -> f16 conversions in the K loop
                ops = s["loops"][0]["ops"]
                assert not any(op.startswith("F2FP") for op in ops), (what, s["loops"][0])
                if fmt == "fp8_per_tensor":
                    gate_up = name == "moe_gate_up_kernel"
                    per_thread = cfg.block_m * (cfg.gu_block_n * 2 if gate_up else cfg.down_block_n) // (
                        cfg.num_warps * 32)
                    fadd = sum(v for op, v in ops.items() if op.startswith("FADD"))
                    assert fadd == (per_thread if accum == "promoted" else 0), (what, cfg, fadd, per_thread)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_per_tensor", "fp8_block"])
def test_deferred_down_activates_each_row_once(fmt):
    """With the gate-up's K-split reduction deferred to the down GEMM (pair tiles), each K step
    adds the pair's partials and applies SiLU*up to one [BLOCK_K] row, then broadcasts it to the
    MMA tile. The sm_90 loop must do that work once per row element: one exp per thread per
    BLOCK_K / threads elements. Without a layout barrier in bf16, the compiler pulled the MMA
    operand layout back through the activation and ran it on every replicated element (round Q:
    16 exps, 735 instructions per K step at GU_SPLIT 8, against 1 and 192)."""
    import dataclasses

    from evenflow._compile_check import compile_stats
    from evenflow.moe.fused import choose_config

    launches = []
    for h, i, e in ((2048, 768, 128), (4096, 192, 192), (4096, 1536, 24)):
        if fmt == "fp8_block" and i % 128:
            continue
        ew = random_moe_weights(fmt, 4, h, i)
        for t in (1, 2):
            cfg = choose_config(t, 8, e, h, i, ew.mode, num_experts_total=e, sms=132)
            cfg = dataclasses.replace(cfg, gu_split_k=max(2, cfg.gu_split_k), gu_defer=1, num_warps=4)
            with emulate_gpu(132), record_launches() as rec:
                evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, 4, (t, 8), dtype=torch.int32),
                                   torch.rand(t, 8), ew, config=cfg)
            launches += [la for la in rec if la.name == "moe_down_kernel" and la not in launches]
    assert launches and all(dict(la.constexprs)["GU_SPLIT"] >= 2 for la in launches)
    for la, s in zip(launches, compile_stats(launches)):
        assert "error" not in s, s["error"]
        threads = 32 * dict(la.options)["num_warps"]
        exps = s["loops"][0]["ops"].get("MUFU.EX2", 0)
        assert 1 <= exps <= -(-dict(la.constexprs)["BLOCK_K"] // threads), (la.describe(), s["loops"][0])


def test_local_first_launch_compiles_without_spill():
    """The packed EP pair-tile launch (round Y: each program loads every pair's id and prefix-counts the local
    ones before its first weight load) compiles for sm_90 at the decode configs of the Hy3 EP8 shape (T = 1, 2, 4), in
    the three formats, with the gate-up's K split reduced by its last split and by the down GEMM: no register spill,
    and at most 16 registers a thread more than the same launch without the packing."""
    import dataclasses

    from evenflow._compile_check import compile_stats
    from evenflow.moe.fused import choose_config

    h, i, e_local = 4096, 1536, 4
    pairs = {True: [], False: []}
    for fmt, mode in (("bf16", 0), ("fp8_per_tensor", 1), ("fp8_block", 2)):
        ew = random_moe_weights(fmt, e_local, h, i)
        for t in (1, 2, 4):  # 4: 32 pairs (a 32-wide id vector), pair tiles since round AK
            for defer in (0, 1):
                cfg = choose_config(t, 8, e_local, h, i, mode, num_experts_total=8 * e_local, sms=132)
                cfg = dataclasses.replace(cfg, gu_split_k=max(2, cfg.gu_split_k), gu_defer=defer)
                for first in (True, False):
                    with emulate_gpu(132), record_launches() as rec:
                        evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, 8 * e_local, (t, 8),
                                           dtype=torch.int32), torch.rand(t, 8), ew, ep_rank=1,
                                           num_experts_total=8 * e_local, config=cfg, local_first=first)
                    pairs[first] += [la for la in rec if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
    assert pairs[True] and all(dict(la.constexprs)["LOCAL_FIRST"] for la in pairs[True])
    assert not any(dict(la.constexprs)["LOCAL_FIRST"] for la in pairs[False])
    # one stats dict per distinct launch: matched to each launch by its description, not by position
    packed = {st["describe"]: st for st in compile_stats(pairs[True])}
    plain = {st["describe"]: st for st in compile_stats(pairs[False])}
    for la, la0 in zip(pairs[True], pairs[False]):
        s, s0 = packed[la.describe()], plain[la0.describe()]
        assert "error" not in s and "error" not in s0, (la.describe(), s.get("error"), s0.get("error"))
        assert s["spill_bytes"] == 0, (la.describe(), s["regs"], s["spill_bytes"])
        assert s["regs"] <= s0["regs"] + 16, (la.describe(), s["regs"], s0["regs"])


@pytest.mark.parametrize("fmt, mode", [("fp8_per_tensor", 1), ("fp8_block", 2)])
def test_wide_down_tile_issues_fewer_instructions_a_column(fmt, mode, monkeypatch):
    """Round CF's ``fused.WIDE_DOWN_N`` (the default since round CG): the exact fp8 mode's 32-row down tile 128 wide
    instead of 64 (Qwen3-30B-A3B at T = 1024, 64 rows per expert) builds for sm_90 with no spill, and its K loop
    issues fewer instructions and fewer e4m3 -> f16 conversions an output column than the 64-wide tile's (the likely
    cause of the tuners' 0.91-1.01 timings, docs/perf-notes/moe.md "Round CF (CPU)"; the intermediate tile is
    converted once for twice the columns). Measured in round CF: 0.71x / 0.67x (per-tensor), 0.68x / 0.67x (block)."""
    from evenflow._compile_check import compile_stats
    from evenflow.moe import fused

    h, i, e, k, t = 2048, 768, 128, 8, 1024
    ew = random_moe_weights(fmt, e, h, i)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    per_col = {}
    for wide in (False, True):
        monkeypatch.setattr(fused, "WIDE_DOWN_N", wide)
        with emulate_gpu(132), record_launches() as rec:
            evenflow.fused_moe(torch.randn(t, h).bfloat16(), ids, torch.rand(t, k), ew)
        (down,) = [la for la in rec if la.name == "moe_down_kernel"]
        c = dict(down.constexprs)
        assert (c["BLOCK_M"], c["BLOCK_N"]) == (32, 128 if wide else 64), c
        (st,) = compile_stats([down])
        assert "error" not in st and st["spill_bytes"] == 0, (wide, st.get("error"), st.get("spill_bytes"))
        ops = st["loops"][0]["ops"]
        per_col[wide] = (sum(ops.values()) / c["BLOCK_N"],
                         sum(v for op, v in ops.items() if op.startswith("F2FP")) / c["BLOCK_N"])
    assert per_col[True][0] < 0.8 * per_col[False][0], per_col  # instructions a column
    assert per_col[True][1] < 0.75 * per_col[False][1], per_col  # conversions a column


@pytest.mark.parametrize("switch,steps,bits", [(("gate_up", "down"), 0, 0), (None, 1, 3), (None, 1, 2), (None, 1, 0)],
                         ids=["switch-whole-range", "config-both", "config-down", "default"])
def test_pair_prefetch_asks_l2_before_the_wait(monkeypatch, switch, steps, bits):
    """Round BK (``MoEConfig.prefetch``, or the knob rows' module switch ``fused.PAIR_PREFETCH``): on pair tiles under
    PDL each GEMM program it names reads its task (the pair's expert from topk_ids: a load, nothing else) and asks L2
    for its weight lines (its first K step, or with ``PAIR_PREFETCH_STEPS`` = 0 its whole range) before its PDL
    wait; no copy, atomic or store comes before the wait. The gate-up does so only behind a kernel of the layer that
    waited (the fp8 quantisation; a bf16 layer's gate-up is its first kernel and keeps the wait first). Off (the
    default config), no launch carries a prefetch and every kernel waits before its first memory operation. No spill
    either way."""
    import dataclasses

    from evenflow._compile_check import compile_stats
    from evenflow.moe import fused

    monkeypatch.setattr(fused, "PAIR_PREFETCH", switch)
    monkeypatch.setattr(fused, "PAIR_PREFETCH_STEPS", steps)
    named = (switch is not None and "gate_up" in switch) | 2 * (switch is not None and "down" in switch) \
        if switch is not None else bits
    launches = []
    # the last shape (Hy3 TP8's I = 192 in fp8) takes 64-deep down K steps, under a 128-byte line's 128 elements
    for (h, i, e_local, total, ep_rank), fmts in (((2048, 768, 4, 4, 0), ("bf16", "fp8_per_tensor", "fp8_block")),
                                                  ((4096, 1536, 4, 32, 1), ("fp8_per_tensor",)),
                                                  ((4096, 192, 4, 32, 1), ("fp8_per_tensor",))):
        for fmt in fmts:
            ew = random_moe_weights(fmt, e_local, h, i)
            for t in (1, 2):
                ids = torch.arange(t * 8, dtype=torch.int32).reshape(t, 8) % total
                cfg = dataclasses.replace(fused.choose_config(t, 8, e_local, h, i, ew.mode, num_experts_total=total,
                                                              sms=132), prefetch=bits)
                with emulate_gpu(132), record_launches() as rec:
                    evenflow.fused_moe(torch.randn(t, h).bfloat16(), ids, torch.rand(t, 8), ew, ep_rank=ep_rank,
                                       num_experts_total=total, config=cfg)
                launches += [la for la in rec if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
    assert len(launches) == 20, [la.name for la in launches]
    want, narrow = {}, 0
    for la in launches:
        c = dict(la.constexprs)
        assert c["PAIR_TILES"] and c["PDL"], la.describe()
        line = 64 if c["MODE"] == 0 else 128  # elements a 128-byte line
        gate_up = la.name == "moe_gate_up_kernel"
        on = bool(named & (1 if gate_up else 2)) and not (gate_up and c["MODE"] == 0)
        assert c["PREFETCH"] == (line if on else 0) and c["PREFETCH_STEPS"] == (steps if on else 0), la.describe()
        want[la.describe()] = on
        narrow += on and c["BLOCK_K"] < line
    assert any(want.values()) == bool(named)
    assert bool(narrow) == bool(named & 2), narrow  # a prefetching down GEMM of steps narrower than a line is built
    stats = compile_stats(launches)
    assert {s["describe"] for s in stats} == set(want)
    for s in stats:
        desc, m = s["describe"], s["marks"]
        assert "error" not in s, (desc, s["error"])
        assert s["spill_bytes"] == 0, (desc, s["regs"], s["spill_bytes"])
        wait = m["griddepcontrol.wait"]
        after = [m[op] for op in ("cp.async", "atom.", "red.", "st.global") if m[op] >= 0]
        assert 0 <= wait < min(after) and wait < m["griddepcontrol.launch_dependents"], desc
        waits = s["mark_counts"]["griddepcontrol.wait"]
        if want[desc]:
            assert 0 <= m["prefetch.global.L2"] < wait and 0 <= m["ld.global"] < wait, desc
            # the wait on both paths: program 0 waits before it exits even with no task (else a grid whose programs
            # all exit unwaited completes before the kernel ahead); the task's loads are the only ones before it: the
            # pair's id (with LOCAL_FIRST the pairs' id vector) and nothing the kernel ahead writes
            assert waits == 2, (desc, waits)
            # steps narrower than a line ask for whole lines (before round BK's review's fix, nothing)
            assert s["mark_counts"]["ld.global"] >= 1 and s["mark_counts"]["prefetch.global.L2"] >= 1, desc
        else:
            assert m["prefetch.global.L2"] < 0 and wait < m["ld.global"] and waits == 1, (desc, waits)


@pytest.mark.parametrize("split, shared", [(1, False), (2, False), (4, False), (1, True)])
def test_moe_reduce_issues_its_loads_in_two_round_trips(split, shared, monkeypatch):
    # Round BO: the top-k reduce's rows depend on the token's ids (two dependent round trips), but its sm_90 build
    # issued some rows, and one id, after sums that read earlier ones: 4 round trips at one K split, 10 at four
    # (Hy3 EP8 bf16 T = 1). The FENCED build's two branches keep every load ahead of the first read of any of them;
    # the shared output's row, whose address is known at the start, goes with the ids. Real Hy3 EP8 sizes (H = 4096,
    # top-8): the reduce's BLOCK_H follows the splits (1024 / 512 / 256), as at the benchmark's points. (The default
    # build until round BQ, evenflow-unfencedreduce's, fails this at every case.)
    from evenflow._compile_check import compile_stats
    from evenflow.moe import fused
    from evenflow.moe.fused import choose_config

    monkeypatch.setattr(fused, "REDUCE_FENCED", True)

    h, i, e, k, t = 4096, 1536, 4, 8, 2
    ew = random_moe_weights("bf16", e, h, i)
    cfg = dataclasses.replace(choose_config(t, k, e, h, i, 0), down_split_k=split)
    with emulate_gpu(132), record_launches() as rec:
        evenflow.fused_moe(torch.randn(t, h).bfloat16(), torch.randint(0, e, (t, k), dtype=torch.int32),
                           torch.rand(t, k), ew, config=cfg,
                           shared_output=torch.randn(t, h).bfloat16() if shared else None)
    red = [la for la in rec if la.name == "moe_reduce_kernel"]
    assert len(red) == 1 and dict(red[0].constexprs)["SPLIT_K"] == split
    (s,) = compile_stats(red)
    waves = s["load_waves"]
    assert len(waves) >= 2 + split and not any(w["in_loop"] for w in waves), waves
    assert max(w["needed"] for w in waves) == 2
    assert [w["issued"] for w in waves] == [w["needed"] for w in waves], waves


@pytest.mark.parametrize("t", [8, 64, 512])
def test_deep_k_bf16_tiles_build_without_spill(t, monkeypatch):
    """Round CG's ``fused.DEEP_K_BF16`` (on by default since CG2): bf16 Qwen3-30B-A3B at T = 8 / 64 / 512 (pair tiles,
    16-row and 32-row index tiles) launches both GEMMs 128 deep, and each builds for sm_90 within the shared-memory
    limit with no spill (the tuners ran these tiles as ``gk128`` on both cards)."""
    from evenflow._compile_check import compile_stats
    from evenflow.moe import fused

    h, i, e, k = 2048, 768, 128, 8
    ew = random_moe_weights("bf16", e, h, i)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    monkeypatch.setattr(fused, "DEEP_K_BF16", True)
    with emulate_gpu(132), record_launches() as rec:
        evenflow.fused_moe(torch.randn(t, h).bfloat16(), ids, torch.rand(t, k), ew)
    gemms = [la for la in rec if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
    assert len(gemms) == 2, [la.name for la in rec]
    for la, st in zip(gemms, compile_stats(gemms)):
        assert dict(la.constexprs)["BLOCK_K"] == 128, la.describe()
        assert "error" not in st and st["spill_bytes"] == 0, (la.describe(), st.get("error"), st.get("spill_bytes"))
