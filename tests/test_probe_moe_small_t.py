"""The small-T probe (benchmarks/probe_moe_small_t.py) times what it says: its 64-row configs are valid layer
configs at every point it runs, and their builds are e4m3 warpgroup MMAs with no conversion in the K loop (CPU,
sm_90), where the exact mode's 16-row build converts every e4m3 value for f16 ``mma.sync`` products."""
import os
import sys

import pytest
import torch

from evenflow import _compile_check as CC
from evenflow import _runtime
from evenflow.moe import MoEWeights
from evenflow.moe.fused import check_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import moe as M  # noqa: E402
import probe_moe_small_t as probe  # noqa: E402

FP8 = torch.float8_e4m3fn


def _holder(case, variant, device="cpu"):
    # torch.empty of a real size: uninitialised, nothing is executed (on a GPU the holder takes GPU tensors only)
    e, h, i = case.num_local, case.hidden, case.inter
    kw = {"device": device}
    if variant == "fp8-tensor":
        return MoEWeights.fp8_per_tensor(torch.empty(e, 2 * i, h, dtype=FP8, **kw),
                                         torch.empty(e, h, i, dtype=FP8, **kw), torch.ones(e, **kw),
                                         torch.ones(e, **kw), torch.ones(1, **kw), torch.ones(1, **kw))
    return MoEWeights.fp8_block(torch.empty(e, 2 * i, h, dtype=FP8, **kw), torch.empty(e, h, i, dtype=FP8, **kw),
                                torch.ones(e, 2 * i // 128, h // 128, **kw), torch.ones(e, h // 128, i // 128, **kw))


def test_bm64_configs_are_valid_at_every_point(device):
    for name in ("qwen3-30b-a3b", "hy3-tp8", "hy3-ep8"):
        case = M.CASES[name]
        for variant in ("fp8-tensor", "fp8-block"):
            if variant in case.skip_variants:
                continue
            ew = _holder(case, variant, device)
            for t in (1, 4, 16, 64):
                for accum in ("promoted", "fast"):
                    cfg = probe.bm64_config(case, ew, t, accum)
                    assert (cfg.block_m, cfg.num_warps, cfg.gu_split_k, cfg.down_split_k) == (64, 4, 1, 1)
                    check_config(cfg, case.hidden, case.inter, ew.mode, fast_acc=True)
                    assert case.inter % cfg.down_block_k == 0 and case.hidden % cfg.gu_block_k == 0


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches on the CPU and builds them for sm_90")
def test_bm64_builds_are_e4m3_wgmma_and_exact_is_f16_mma_sync():
    import evenflow

    case = M.CASES["qwen3-30b-a3b"]
    ew = _holder(case, "fp8-tensor")
    t = 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, case.hidden).bfloat16()
    ids = torch.stack([torch.randperm(case.num_local, generator=g)[:8] for _ in range(t)]).int()
    w = torch.rand(t, 8)
    launches = {}
    for impl, kw in (("exact", {}), ("promoted-bm64", {"fp8_accum": "promoted",
                                                       "config": probe.bm64_config(case, ew, t, "promoted")})):
        with CC.emulate_gpu(), CC.record_launches(execute=False) as rec:
            evenflow.fused_moe(x, ids, w, ew, **kw)
        launches[impl] = [la for la in rec if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
        assert len(launches[impl]) == 2, impl
    stats = CC.compile_stats(launches["exact"] + launches["promoted-bm64"])
    assert all(not s.get("error") and s["spill_bytes"] == 0 for s in stats), stats
    for s in stats[:2]:  # exact: f16 products on mma.sync, each e4m3 value converted in the loop
        assert s["mma"]["wgmma"] == 0 and set(s["mma"]["mma_sync_types"]) == {"f16.f16"}, s["mma"]
        assert s["loops"][0]["ops"].get("F2FP.F16.E4M3.UNPACK_B", 0) > 0
    for s in stats[2:]:  # the probe's 64-row tiles: e4m3 wgmma, nothing converted in the loop
        assert set(s["mma"]["wgmma_types"]) == {"e4m3.e4m3"} and s["mma"]["mma.sync"] == 0, s["mma"]
        assert not any(op.startswith("F2FP") for op in s["loops"][0]["ops"]), s["loops"][0]["ops"]
