"""Router GEMM on sm_90 without a GPU: shared memory of forced and small-M configs.

A config's pipeline depth is capped by the shared memory it needs (GemmConfig.fit_smem):
round-3 forced configs (128x128x64 at 4 stages, 16x64x256 at 4 stages) needed 262 KB and
319 KB with the pipelined K loop, past sm_90's 227 KB, and failed to launch on the H200.
Launches are recorded through the interpreter at real shapes (nothing executes) and
compiled for sm_90 with the divisibility hints a real launch gets (without them Triton
does not pipeline and the shared memory read back would be that of a plain loop).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.router.dispatch import SMEM_LIMIT, GemmConfig
from tests_support_router import load_tuner, one_block_table_entries

CC = pytest.importorskip("evenflow._compile_check")

FORCED = [GemmConfig(128, 128, 64, 1, 8, 4), GemmConfig(16, 64, 256, 8, 4, 4)]


def test_fit_smem_caps_stages_to_the_limit():
    big, wide = FORCED
    assert big.stage_bytes(3) == (128 * 64 + 3 * 128 * 64) * 2 == 65536
    assert big.fit_smem(3).num_stages == 3 and big.fit_smem(3).smem_bytes(3) <= SMEM_LIMIT
    assert wide.fit_smem(3).num_stages == 2  # 106496 B a stage
    assert wide.fit_smem(2).num_stages == 3  # 73728 B a stage
    for c in (big, wide):
        for terms in (2, 3):
            f = c.fit_smem(terms)
            assert f.smem_bytes(terms) <= SMEM_LIMIT < f.smem_bytes(terms, f.num_stages + 1) or f == c
            assert (f.block_m, f.block_n, f.block_k, f.split_k, f.num_warps) == \
                (c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps)
    small = GemmConfig(16, 32, 128, 16, 4, 4)
    assert small.fit_smem(3) is small  # fits: unchanged
    assert GemmConfig(path="torch-fp32").fit_smem(3) == GemmConfig(path="torch-fp32")
    assert GemmConfig(16, 32, 128, 16, 4, 8).fit_smem(3, limit=100_000).num_stages == 3
    with pytest.raises(ValueError, match="shared memory"):
        GemmConfig(128, 128, 256, 1, 8, 2).fit_smem(3)  # 256 KB for one stage


def test_red_chunk_bounds_registers():
    # <= 64 registers a thread of partials in flight, <= 16 partials
    assert GemmConfig(16, 32, 128).red_chunk() == 16
    assert GemmConfig(16, 16, 128, num_warps=2).red_chunk() == 16
    assert GemmConfig(16, 32, 128, num_warps=2).red_chunk() == 8
    assert GemmConfig(64, 64, 64).red_chunk() == 2
    assert GemmConfig(128, 64, 64, num_warps=8).red_chunk() == 2
    assert GemmConfig(128, 128, 64).red_chunk() == 1
    # a launch's split count caps it at its next power of two (round AH5)
    assert [GemmConfig(16, 32, 128).red_chunk(s) for s in (1, 2, 3, 8, 11, 16, 40)] == [1, 2, 4, 8, 16, 16, 16]
    assert GemmConfig(64, 64, 64).red_chunk(16) == 2
    for c in (GemmConfig(bm, bn, 64, num_warps=w) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)
              for w in (2, 4, 8)):
        assert 1 <= c.red_chunk() <= 16
        assert c.red_chunk() == 1 or c.red_chunk() * c.block_m * c.block_n <= 64 * 32 * c.num_warps, c


_WORKER = r"""
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
DIV = ("p_x", "p_whi", "p_wlo", "p_wlo2", "p_out", "p_part", "p_count", "N", "K", "stride_xm", "stride_wn",
       "stride_om")
out = []
for item in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(item["module"]), item["name"])
    names = list(item["signature"])
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIV}
    ck = triton.compile(ASTSource(fn=fn, signature=item["signature"], constexprs=item["constexprs"], attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=item["options"])
    out.append([item["describe"], ck.metadata.shared])
print(json.dumps(out))
"""


def _compile_shared(launches, tmp_path):
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(CC._to_json(launches)))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _WORKER, str(path)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_forced_and_small_m_configs_fit_sm90_shared_memory(tmp_path):
    small = [GemmConfig(16, 32, 64, 32, 4, 6), GemmConfig(16, 64, 128, 12, 4, 4)]  # tuner's small-M kind
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for terms in (3, 2):
            rw = evenflow.RouterWeight(torch.randn(768, 6144) * 0.02, terms=terms)
            for cfg in FORCED + small:
                evenflow.router_gemm(torch.empty(16, 6144, dtype=torch.bfloat16), rw, config=cfg)
    ce = [(dict(la.constexprs), dict(la.options)["num_stages"]) for la in launches]
    stages = {(c["BLOCK_M"], c["BLOCK_K"], c["NUM_TERMS"]): s for c, s in ce}
    # the two forced configs were capped (three / two weight terms)
    assert stages[128, 64, 3] == 3 and stages[128, 64, 2] == 4 and stages[16, 256, 3] == 2, stages
    assert stages[16, 256, 2] == 3 and stages[16, 64, 3] == 6, stages
    assert not CC.compile_launches(launches)
    for describe, shared in _compile_shared(launches, tmp_path):
        assert shared <= SMEM_LIMIT, f"{describe}: {shared} B of shared memory"
        assert shared > 0, describe


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_fp32_simt_configs_compile_for_sm90():
    # The CUDA-core small-M path at real shapes (K tails too), every block shape the tuner offers.
    cfgs = {GemmConfig(bm, bn, bk, 1, wp, 1, "fp32-simt")
            for bm in (1, 4, 16) for bn, bk, wp in ((1, 512, 4), (1, 1024, 8), (1, 2048, 8), (2, 1024, 8),
                                                     (2, 256, 8), (2, 512, 8))}
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for n, k in ((192, 4096), (768, 6144), (200, 4100)):
            rw = evenflow.RouterWeight(torch.randn(n, k) * 0.02)
            for cfg in cfgs:
                evenflow.router_gemm(torch.empty(cfg.block_m, k, dtype=torch.bfloat16), rw, config=cfg)
    assert {la.name for la in launches} == {"router_gemm_fp32_kernel"}
    assert not CC.compile_launches(launches)


_PTX_WORKER = r"""
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for item in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(item["module"]), item["name"])
    names = list(item["signature"])
    plain = {p.name for p in fn.params if p.do_not_specialize}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in item["aligned"] if a not in plain}
    ck = triton.compile(ASTSource(fn=fn, signature=item["signature"], constexprs=item["constexprs"], attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=item["options"])
    out.append([item["describe"], ck.asm["ptx"]])
print(json.dumps(out))
"""


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_every_router_kernel_waits_for_the_kernel_ahead_before_touching_memory(tmp_path):
    # Round AD: on an sm_90 GPU every router launch (the three GEMM paths and the top-k kernel of route)
    # uses programmatic dependent launch by default; each kernel must then execute griddepcontrol.wait
    # before its first global load, async copy or atomic (else it could read x or logits the kernel
    # ahead has not written yet), and signal the next launch. The GEMMs ask L2 for their weight lines
    # before the wait (prefetch.global.L2, writing no register), and only with PDL unless told.
    cfgs = [GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt", "pdl-prefetch"),
            GemmConfig(4, 8, 128, 16, 4, 3, "fp32-splitk", "pdl-prefetch"),
            GemmConfig(64, 32, 256, 4, 4, 2, launch="pdl-prefetch")]
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(128, 2048) * 0.02)
        for cfg in cfgs:
            evenflow.router_gemm(torch.empty(cfg.block_m, 2048, dtype=torch.bfloat16), rw, config=cfg)
        evenflow.select_experts(torch.empty(4, 128), 8)
        # a config's launch "plain", and "pdl" (GemmConfig's default: no prefetch)
        evenflow.router_gemm(torch.empty(4, 2048, dtype=torch.bfloat16), rw,
                             config=GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt", "plain"))
        evenflow.router_gemm(torch.empty(64, 2048, dtype=torch.bfloat16), rw, config=GemmConfig(64, 32, 256, 4, 4, 2))
    names = [la.name for la in launches]
    assert names == ["router_gemm_fp32_kernel", "router_gemm_fp32_splitk_kernel", "router_gemm_kernel",
                     "route_topk_kernel", "router_gemm_fp32_kernel", "router_gemm_kernel"], names
    pdl = [dict(la.constexprs)["PDL"] for la in launches]
    assert pdl == [True, True, True, True, False, True], pdl
    prefetch = [dict(la.constexprs).get("PREFETCH_W", False) for la in launches]
    assert prefetch == [True, True, True, False, False, False], prefetch
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(CC._to_json(launches)))
    r = subprocess.run([sys.executable, "-c", _PTX_WORKER, str(path)], env={**os.environ, "TRITON_INTERPRET": "0"},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    ptxs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(ptxs) == 6
    for (describe, ptx), on, pf in zip(ptxs, pdl, prefetch):
        body = ptx[ptx.index(".entry"):]
        memory = [body.find(op) for op in ("ld.global", "cp.async", "atom.", "red.") if op in body]
        first = min(memory)
        wait = body.find("griddepcontrol.wait")
        if not on:
            assert wait < 0 and "griddepcontrol" not in body, describe
        else:
            assert 0 <= wait < first, describe
            assert "griddepcontrol.launch_dependents" in body, describe
        if pf:
            assert 0 <= body.find("prefetch.global.L2") < wait, describe
        else:
            assert "prefetch.global.L2" not in body, describe


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_preload_launch_loads_only_the_weight_before_the_wait(tmp_path):
    # Round BM: launch "pdl-preload" (fp32-simt) loads the weight's first K block into registers before
    # griddepcontrol.wait, and x only after it (the kernel ahead may write x). One K block of 2048 fp32 weights on
    # 8 warps is 8 a thread: two 16-byte loads before the wait, the bf16 x loads after it; no L2 prefetch (the
    # loads replace it). Passing prefetch_weights (here False) turns the preload off: no load before the wait.
    cfg = GemmConfig(1, 1, 2048, 1, 8, 1, "fp32-simt", "pdl-preload")
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(128, 2048) * 0.02)
        evenflow.router_gemm(torch.empty(1, 2048, dtype=torch.bfloat16), rw, config=cfg)
        evenflow.router_gemm(torch.empty(1, 2048, dtype=torch.bfloat16), rw, config=cfg, prefetch_weights=False)
    consts = [dict(la.constexprs) for la in launches]
    assert [(c["PDL"], c["PRELOAD_W"], c["PREFETCH_W"]) for c in consts] == [(True, True, False),
                                                                             (True, False, False)], consts
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(CC._to_json(launches)))
    r = subprocess.run([sys.executable, "-c", _PTX_WORKER, str(path)], env={**os.environ, "TRITON_INTERPRET": "0"},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (d_pre, ptx_pre), (d_off, ptx_off) = json.loads(r.stdout.strip().splitlines()[-1])
    for describe, ptx, before in ((d_pre, ptx_pre, 2), (d_off, ptx_off, 0)):
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        assert wait > 0 and "prefetch.global.L2" not in body, describe
        head, tail = body[:wait], body[wait:]
        assert head.count("ld.global") == before, (describe, head.count("ld.global"))
        assert head.count("ld.global.v4") == before and "ld.global" in tail, describe  # x after the wait


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_fp32_tc_builds_split_pairs_in_registers_without_spills():
    # Round AH: the fp32-tc path (the split-weight kernel reading the fp32 weight, split in registers) at every
    # tile the tuner offers up to M = 512 (M = 1-256 reach every kind), at the four benchmark shapes: it must
    # build for sm_90 within shared memory and within GemmConfig's estimate of it, with no spill, its K loop
    # streaming through cp.async (LDGSTS), and its conversions packed two values an instruction (F2FP ...
    # PACK_AB): no single-value F2F, which runs at the conversion unit's quarter rate (Triton's own casts gave
    # two a weight: docs/perf-notes/router.md, round AH).
    from evenflow.router.gemm import launch_shape

    tuner = load_tuner()

    todo = {}
    for n, k in ((192, 4096), (768, 6144), (384, 3072), (128, 2048)):
        for m in (1, 4, 16, 64, 256):
            for c in tuner.candidates(m, n, k, 132, plain=False):
                if c.path == "fp32-tc":
                    split = launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1] > 1
                    todo.setdefault((c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, split), (c, m, n, k))
    assert len(todo) >= 8, todo
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rws = {}
        for c, m, n, k in todo.values():
            rw = rws.setdefault((n, k), evenflow.RouterWeight(torch.randn(n, k) * 0.02))
            evenflow.router_gemm(torch.empty(m, k, dtype=torch.bfloat16), rw, config=c)
    assert {dict(la.constexprs)["W_FP32"] for la in launches} == {True}
    stats = CC.compile_stats(launches)
    errors = [s["error"] for s in stats if "error" in s]
    assert not errors, "\n\n".join(errors)
    assert len(stats) == len(todo)
    for (c, _, _, _), s in zip(todo.values(), stats):
        assert s["spill_bytes"] == 0 and s["shared"] <= min(SMEM_LIMIT, c.smem_bytes(3)), (s["describe"], s["shared"])
        loop = max(s["loops"], key=lambda lp: sum(v for op, v in lp["ops"].items() if "MMA" in op))
        ops = loop["ops"]
        assert any(op.startswith("LDGSTS") for op in ops), f"{s['describe']}: K loop not pipelined"
        assert not [op for op in ops if op.startswith("F2F.")], f"{s['describe']}: single conversions {ops}"
        assert ops.get("F2FP.BF16.F32.PACK_AB", 0) > 0, s["describe"]


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
@pytest.mark.parametrize("bm, bn, warps, bks", [(1, 1, 8, (1024, 2048)), (1, 2, 8, (1024, 2048)),
                                              (4, 1, 8, (1024, 2048)), (4, 2, 8, (1024, 2048)),
                                              (16, 1, 8, (1024, 2048)), (4, 2, 16, (2048, 4096))])
def test_fp32_simt_k_loop_does_not_route_its_operands_through_shared_memory(bm, bn, warps, bks):
    # Rounds BM / BN: the CUDA-core tile loads x and the weight in the layout of their product, so its K loop
    # touches shared memory and shuffles only for the per-block cross-warp sum of its BLOCK_M x BLOCK_N outputs,
    # whatever BLOCK_K is. A layout conversion of an operand (the earlier 3-D form's at BLOCK_M > 1: STS.128 / LDSM,
    # 9-25 barriers a block) moves BLOCK_K-proportional data through shared memory or shuffles, so its stores or
    # shuffles grow with BLOCK_K. The last case is K4096 M = 4's table tile on 16 warps, at twice its K: where K is
    # one block, router_gemm runs the one-block build, which has no loop (the next test holds it).
    k = 2 * max(bks)
    cfgs = [GemmConfig(bm, bn, bk, 1, warps, 1, "fp32-simt", "pdl-preload" if bm <= 4 else "pdl") for bk in bks]
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(192, k) * 0.02)
        for cfg in cfgs:
            evenflow.router_gemm(torch.empty(bm, k, dtype=torch.bfloat16), rw, config=cfg)
    stats = CC.compile_stats(launches)
    assert [s.get("error") for s in stats] == [None, None], stats
    shared = []
    for s in stats:
        ops = s["loops"][0]["ops"]  # the K loop: the kernel's only loop
        assert s["spill_bytes"] == 0 and ops.get("FFMA", 0) >= bm * bn, (s["describe"], ops)
        assert not [op for op in ops if op.startswith("LDSM")], (s["describe"], ops)
        shared.append(tuple(sum(v for op, v in ops.items() if op.startswith(kind)) for kind in ("STS", "BAR", "SHFL")))
    assert shared[0] == shared[1] and shared[0][0] <= bm * bn + 1 and shared[0][1] <= 3, (bm, bn, shared)


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
@pytest.mark.parametrize("bm, bn, bk, warps, pre", [(4, 2, 4096, 16, True), (4, 2, 4096, 8, True),
                                                    (1, 1, 4096, 8, True), (4, 2, 2048, 8, True),
                                                    (1, 1, 4096, 8, False), (4, 2, 4096, 16, False)])
def test_fp32_simt_one_block_build_has_no_k_loop_and_no_dead_loads(bm, bn, bk, warps, pre):
    # Round BO: where the whole K is one block (K = BLOCK_K: the table's K4096 / Qwen3 M = 1 and M = 4 tiles), the
    # loop build's one trip still issues the second block's loads, masked off, and keeps registers for them (its
    # trip count is a run-time value). The ONE_BLOCK build has no backward branch, issues each operand's global
    # loads once (half the loop build's LDG instructions: two blocks there, one here), and needs fewer registers
    # and fewer instructions. And it issues every x load (after the PDL wait, ``ACQBULK``) before its first
    # product: BM8's form of it put the 1 x 1 x 4096 tile's second x load after the first products, which wait for
    # the first, so the two loads' latencies ran in turn.
    from evenflow.router.gemm import _launch_fp32

    with CC.emulate_gpu(132), CC.record_launches() as launches:
        x, w = torch.empty(bm, bk, dtype=torch.bfloat16), torch.empty(192, bk)
        for one in (False, True):
            _launch_fp32(x, w, torch.empty(bm, 192), bm, bn, bk, warps, 1, True, False, pre, one)
    assert [dict(la.constexprs)["ONE_BLOCK"] for la in launches] == [False, True]
    loop, one = CC.compile_stats(launches)
    assert "error" not in loop and "error" not in one, (loop, one)

    def count(s, prefix):
        return sum(v for op, v in s["ops"].items() if op.startswith(prefix))
    assert len(loop["loops"]) == 1 and one["loops"] == [], (loop["loops"], one["loops"])
    assert count(loop, "LDG") == 2 * count(one, "LDG") > 0, (loop["ops"], one["ops"])
    assert count(one, "FFMA") + count(one, "FMUL") >= bm * bn * bk // (32 * warps)  # every product, once
    assert one["spill_bytes"] == 0 and one["regs"] < loop["regs"], (one["regs"], loop["regs"])
    total = [sum(v for op, v in s["ops"].items() if op != "NOP") for s in (loop, one)]
    assert total[1] < 0.85 * total[0], total
    seq = one["sequence"]
    wait = seq.index("ACQBULK")
    last_load = max(i for i, op in enumerate(seq) if op.startswith("LDG"))
    first_product = min(i for i, op in enumerate(seq) if op in ("FFMA", "FMUL"))
    assert wait < last_load < first_product, (wait, last_load, first_product)
    assert all(w["issued"] == w["needed"] == 1 for w in one["load_waves"]), one["load_waves"]


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_one_block_build_reduces_as_the_loop_build_at_the_tables_tiles():
    # Round BQ: the one-block build computes the same expression as the loop build's one trip (products, a tl.sum
    # over K, added to zeros), but bit-equal outputs also need the compiler to give both the same register layout,
    # which decides the reduction tree. On the GPU (BQ4) a 4 x 2 x 64 tile on 2 warps with the preload did not:
    # the loop build summed 4 chains of 2 products a thread and a 32-lane butterfly, the one-block build 2 chains
    # of 4 and a 16-lane butterfly (ulps apart, both within the rule). The table's tiles are what router_gemm runs:
    # at each of them both builds must issue the same fp32 operations and shuffles in the same order (BQ3 found
    # them bit-equal on the GPU at these tiles; tests/test_router_gpu.py checks it there).
    from evenflow.router.gemm import _launch_fp32

    entries = one_block_table_entries()  # every committed table's (the H200's and the H100's)
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        for m, n, k, c in entries:
            x, w = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k)
            pdl = c["launch"] != "plain"
            for one in (False, True):
                _launch_fp32(x, w, torch.empty(m, n), c["block_m"], c["block_n"], c["block_k"], c["num_warps"], 1,
                             pdl, c["launch"] == "pdl-prefetch", c["launch"] == "pdl-preload", one)
    assert [dict(la.constexprs)["ONE_BLOCK"] for la in launches] == [False, True] * len(entries)
    stats = CC.compile_stats(launches)
    by = {s["describe"]: s for s in stats}
    assert all("error" not in s for s in stats), stats
    for (m, n, k, c), (loop, one) in zip(entries, zip(launches[::2], launches[1::2])):
        a, b = by[loop.describe()]["float_ops"], by[one.describe()]["float_ops"]
        assert a and a == b, (m, n, k, c, a, b)
