"""Multi-rank layouts (evenflow.parallel): slicing exact, and split layers equal the unsplit one.

Two parts:

* Sharding helpers, no kernels: EP / TP / head slices are exactly the right rows,
  and the layer math (plain float64 here) of the shards sums (MoE) or concatenates
  (attention) to the unsplit layer's to rounding level.
* A real 2-process run (torch.multiprocessing spawn, gloo, CPU tensors through the
  Triton interpreter): each rank runs evenflow's operator on its shard, the MoE
  partials are all-reduced (bf16, as serving engines do) and attention heads
  gathered; every rank's result must equal the *unsplit* float64 oracle within the
  tolerance rule. The baseline of the rule is PyTorch doing the same split math in
  the same precision: bf16 matmuls with a bf16 intermediate on each rank's shard,
  each rank's output rounded to bf16, then summed in bf16 in rank order (what a
  bf16 all-reduce of two ranks does). Attention: fp32 math of the bf16 inputs,
  output rounded to bf16 (splitting heads changes no head's arithmetic).

The oracles here are written out in this file on purpose: independent of the
library's own reference modules (only the shuffled page layout is shared).
"""
from __future__ import annotations

import datetime
import math
import os
import traceback
from pathlib import Path

import pytest
import torch

from evenflow import parallel as par
from evenflow.reference.attention import shuffled_page_tables
from evenflow.testing import assert_exact, assert_within_rule

WORLD = 2
# Tiny MoE: hidden and both intermediate halves multiples of 16 (fused_moe's tile floor).
T, E, TOPK, HID, INTER = 7, 4, 2, 32, 32
ROUTED_SCALING = 2.5
# Tiny paged decode: 4 q / 2 kv heads -> 2 q / 1 kv per rank; lengths hit 1, 5 and 9 pages.
ATT_LENS, HQ, HKV, HEAD_DIM, PAGE = (5, 70, 130), 4, 2, 64, 16


# ----------------------------------------------------------------------------- inputs and oracles

def moe_inputs():
    """Deterministic tiny MoE problem (same on every rank): x, ids, weights, w13, w2, shared."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(T, HID, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * INTER, HID, generator=g) / math.sqrt(HID)).bfloat16()
    w2 = (torch.randn(E, HID, INTER, generator=g) / math.sqrt(INTER)).bfloat16()
    probs = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
    w, ids = probs.topk(TOPK, dim=-1)
    ids = ids.to(torch.int32)
    ids[0] = torch.tensor([2, 3], dtype=torch.int32)  # token 0: nothing on EP rank 0
    ids[1] = torch.tensor([1, 0], dtype=torch.int32)  # token 1: nothing on EP rank 1
    shared = torch.randn(T, HID, generator=g).bfloat16()
    return x, ids.contiguous(), w.float().contiguous(), w13, w2, shared


def moe_math(x, ids, w, w13, w2, first_expert=0, dtype=torch.float64):
    """sum_k w * down(silu(gate) * up) over the experts held in ``w13``/``w2`` (global ids from
    ``first_expert``), computed in ``dtype`` (bf16: intermediate rounded to bf16 too); fp64 result."""
    i = w2.shape[2]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids.long() == first_expert + e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok].to(dtype) @ w13[e].to(dtype).T
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        out = h @ w2[e].to(dtype).T
        y.index_add_(0, tok, out.double() * w[tok, slot].double()[:, None])
    return y


def moe_oracle():
    x, ids, w, w13, w2, shared = moe_inputs()
    return ROUTED_SCALING * moe_math(x, ids, w, w13, w2) + shared.double()


def moe_split_baseline(shards):
    """PyTorch, same split math in bf16: per-rank bf16 output, bf16 sum in rank order."""
    x, ids, w, _, _, shared = moe_inputs()
    total = None
    for r, (w13_r, w2_r, first) in enumerate(shards):
        part = ROUTED_SCALING * moe_math(x, ids, w, w13_r, w2_r, first, torch.bfloat16)
        if r == 0:
            part = part + shared.double()
        part = part.to(torch.bfloat16)
        total = part if total is None else (total + part)  # bf16 + bf16 -> bf16, one rounding
    return total


def attention_inputs():
    """q [B, HQ, D], k/v caches [pages, PAGE, HKV, D] bf16 with shuffled pages, page_table, seq_lens."""
    g = torch.Generator().manual_seed(4321)
    tables, pool = shuffled_page_tables(ATT_LENS, PAGE, generator=g)
    k = torch.randn(pool, PAGE, HKV, HEAD_DIM, generator=g).bfloat16()
    v = torch.randn(pool, PAGE, HKV, HEAD_DIM, generator=g).bfloat16()
    q = torch.randn(len(ATT_LENS), HQ, HEAD_DIM, generator=g).bfloat16()
    return q, k, v, tables[0], torch.tensor(ATT_LENS, dtype=torch.int32)


def attention_math(q, k, v, table, lens, dtype=torch.float64):
    """Plain paged decode attention (softmax scale 1/sqrt(D)) in ``dtype``: [B, Hq, D]."""
    b_, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.zeros(b_, hq, d, dtype=dtype)
    for b, n in enumerate(lens.tolist()):
        pages = table[b, :-(-n // PAGE)].long()
        kk = k[pages].reshape(-1, hkv, d)[:n].to(dtype)
        vv = v[pages].reshape(-1, hkv, d)[:n].to(dtype)
        qb = q[b].to(dtype).view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", qb, kk) / math.sqrt(d), dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, vv).reshape(hq, d)
    return out


# ----------------------------------------------------------------------------- helpers, no kernels

def test_split_range_and_bad_arguments():
    assert [par.split_range(192, r, 8) for r in (0, 7)] == [(0, 24), (168, 192)]
    with pytest.raises(ValueError, match="divisible"):
        par.split_range(10, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        par.split_range(8, 2, 2)
    with pytest.raises(TypeError, match="world_size"):
        par.split_range(8, 0, 2.0)
    # round CK's review: size was taken unchecked (-4 gave reversed ranges, 4.0 float bounds, "4" a formatting error)
    for bad, err in ((-4, ValueError), (4.0, TypeError), (True, TypeError), ("4", TypeError)):
        with pytest.raises(err, match="size must be"):
            par.split_range(bad, 0, 2)
    with pytest.raises(ValueError, match="w2"):
        par.shard_moe_ep(torch.zeros(4, 8, 16), torch.zeros(4, 16, 3), 0, 2)
    with pytest.raises(ValueError, match="odd"):
        par.shard_moe_tp(torch.zeros(4, 7, 16), torch.zeros(4, 16, 3), 0, 1)
    with pytest.raises(TypeError, match="w13"):
        par.shard_moe_tp([1, 2], torch.zeros(4, 16, 4), 0, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        par.head_ranges(8, 1, 0, 2)  # Hy3 has 8 kv heads: TP16 would have to replicate them
    with pytest.raises(ValueError, match="multiple"):
        par.head_ranges(6, 4, 0, 2)
    with pytest.raises(TypeError, match="num_q_heads must be an int, got float"):
        par.head_ranges(8.0, 4, 0, 2)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1, got 0"):
        par.head_ranges(8, 0, 0, 2)
    q, kv = torch.zeros(2, 8, 16), torch.zeros(3, 4, 2, 16)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor"):
        par.shard_attention_heads(q, None, kv, 0, 2)
    with pytest.raises(ValueError, match="q must be 3-D"):
        par.shard_attention_heads(q[0], kv, kv, 0, 2)
    with pytest.raises(ValueError, match="k_cache and v_cache must be 4-D .* of one shape"):
        par.shard_attention_heads(q, kv, kv[:2], 0, 2)
    with pytest.raises(ValueError, match="q head_dim 8 != k_cache head_dim 16"):
        par.shard_attention_heads(q[..., :8], kv, kv, 0, 2)


def test_ep_shards_are_expert_slices():
    w13 = torch.randn(6, 8, 16)
    w2 = torch.randn(6, 16, 4)
    scale = torch.rand(6)
    parts = [par.shard_moe_ep(w13, w2, r, 3, scale) for r in range(3)]
    for r, (a, b, s) in enumerate(parts):
        assert a.is_contiguous() and b.is_contiguous()
        assert torch.equal(a, w13[2 * r:2 * r + 2]) and torch.equal(b, w2[2 * r:2 * r + 2])
        assert torch.equal(s, scale[2 * r:2 * r + 2])
    with pytest.raises(ValueError, match="per_expert"):
        par.shard_moe_ep(w13, w2, 0, 3, torch.rand(5))


def test_tp_shards_keep_gate_and_up_aligned():
    e, i, h = 3, 8, 16
    w13 = torch.arange(e * 2 * i * h, dtype=torch.float32).reshape(e, 2 * i, h)
    w2 = torch.arange(e * h * i, dtype=torch.float32).reshape(e, h, i)
    a, b = par.shard_moe_tp(w13, w2, 1, 4)
    assert a.shape == (e, 4, h) and b.shape == (e, h, 2) and a.is_contiguous() and b.is_contiguous()
    assert torch.equal(a[:, :2], w13[:, 2:4]) and torch.equal(a[:, 2:], w13[:, i + 2:i + 4])
    assert torch.equal(b, w2[:, :, 2:4])
    # every gate row, up row and down column lands on exactly one rank
    gates = torch.cat([par.shard_moe_tp(w13, w2, r, 4)[0][:, :2] for r in range(4)], 1)
    ups = torch.cat([par.shard_moe_tp(w13, w2, r, 4)[0][:, 2:] for r in range(4)], 1)
    downs = torch.cat([par.shard_moe_tp(w13, w2, r, 4)[1] for r in range(4)], 2)
    assert torch.equal(torch.cat([gates, ups], 1), w13) and torch.equal(downs, w2)


def test_block_scales_tp():
    e, i, h = 2, 256, 384
    s13 = torch.rand(e, 2 * i // 128, h // 128)
    s2 = torch.rand(e, h // 128, i // 128)
    a, b = par.shard_block_scales_tp(s13, s2, i, 1, 2)
    assert torch.equal(a, s13[:, [1, 3]]) and torch.equal(b, s2[:, :, 1:2])
    with pytest.raises(ValueError, match="multiple of the scale block"):  # Hy3 TP8: I/8 = 192
        par.shard_block_scales_tp(torch.rand(1, 24, 32), torch.rand(1, 32, 12), 1536, 0, 8)
    with pytest.raises(ValueError, match="block must be >= 1"):  # (a ZeroDivisionError before round BX)
        par.shard_block_scales_tp(s13, s2, i, 1, 2, block=0)
    with pytest.raises(TypeError, match="intermediate_size must be an int"):
        par.shard_block_scales_tp(s13, s2, float(i), 1, 2)
    # round CK's review: a w2_scale of another layer (other experts, other hidden blocks) was sharded unchecked
    for bad in (torch.rand(e + 3, h // 128, i // 128), torch.rand(e, h // 128 + 4, i // 128)):
        with pytest.raises(ValueError, match="w2_scale .* must be \\[E, H/128, I/128\\] of w13_scale's"):
            par.shard_block_scales_tp(s13, bad, i, 1, 2)


def test_split_math_sums_to_unsplit_in_fp64():
    x, ids, w, w13, w2, _ = moe_inputs()
    full = moe_math(x, ids, w, w13, w2)
    ep = sum(moe_math(x, ids, w, *par.shard_moe_ep(w13, w2, r, WORLD), first_expert=r * E // WORLD)
             for r in range(WORLD))
    tp = sum(moe_math(x, ids, w, *par.shard_moe_tp(w13, w2, r, WORLD)) for r in range(WORLD))
    scale = full.abs().max().item()
    assert scale > 0.1
    assert (ep - full).abs().max().item() <= 1e-12 * scale
    assert (tp - full).abs().max().item() <= 1e-12 * scale


def _fp8_layer(fmt, device):
    """Tiny whole-layer MoEWeights of ``fmt`` (E 4, H 128, I 256: whole 128-blocks per TP-2 rank),
    on the device the kernels run on (MoEWeights checks it)."""
    from evenflow.moe.quant import MoEWeights

    g = torch.Generator().manual_seed(99)
    e, h, i = 4, 128, 256
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(device)
    if fmt == "bf16":
        return MoEWeights.bf16(w13.bfloat16(), w2.bfloat16())
    if fmt == "fp8_per_tensor":
        s13, s2 = (w.abs().amax(dim=(1, 2)) / 448 for w in (w13, w2))
        q13 = (w13 / s13[:, None, None]).to(torch.float8_e4m3fn)
        q2 = (w2 / s2[:, None, None]).to(torch.float8_e4m3fn)
        return MoEWeights.fp8_per_tensor(q13, q2, s13, s2, torch.tensor([0.02], device=device),
                                          torch.tensor([0.004], device=device))

    def block(w):
        n, k = w.shape[1] // 128, w.shape[2] // 128
        s = w.reshape(e, n, 128, k, 128).abs().amax(dim=(2, 4)) / 448
        q = w / s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        return q.to(torch.float8_e4m3fn), s
    (q13, s13), (q2, s2) = block(w13), block(w2)
    return MoEWeights.fp8_block(q13, q2, s13, s2)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_per_tensor", "fp8_block"])
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_shard_moe_weights_reassemble_and_sum_to_unsplit(fmt, layout, device):
    from evenflow.reference.moe import dequant_weights, moe_reference

    full = _fp8_layer(fmt, device)
    shards = [par.shard_moe_weights(full, layout, r, WORLD) for r in range(WORLD)]
    for r, (ew, ep_rank) in enumerate(shards):
        assert ew.format == fmt and ep_rank == (r if layout == "ep" else 0)
        assert ew.w13.dtype == full.w13.dtype and ew.w13.is_contiguous() and ew.w2.is_contiguous()
        if fmt == "fp8_per_tensor":
            assert torch.equal(ew.a13_scale, full.a13_scale) and torch.equal(ew.a2_scale, full.a2_scale)
    # dequantised shards are exact slices of the dequantised layer
    d13, d2 = dequant_weights(full)
    parts = [dequant_weights(ew) for ew, _ in shards]
    if layout == "ep":
        assert torch.equal(torch.cat([a for a, _ in parts]), d13) and torch.equal(torch.cat([b for _, b in parts]), d2)
    else:
        i_r = full.intermediate_size // WORLD
        assert torch.equal(torch.cat([a[:, :i_r] for a, _ in parts], 1), d13[:, :full.intermediate_size])
        assert torch.equal(torch.cat([a[:, i_r:] for a, _ in parts], 1), d13[:, full.intermediate_size:])
        assert torch.equal(torch.cat([b for _, b in parts], 2), d2)
    # with the format's activation quantisation, the shards' layers sum to the unsplit one (fp64)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 128, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]).to(torch.int32).to(device)
    w = torch.rand(5, 2, generator=g).to(device)
    ref = moe_reference(x, ids, w, full)
    split = sum(moe_reference(x, ids, w, ew, ep_rank=er, num_experts_total=4) for ew, er in shards)
    assert ref.abs().max().item() > 1e-3
    assert (split - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()


def test_shard_moe_weights_bad_arguments(device):
    full = _fp8_layer("fp8_block", device)
    with pytest.raises(TypeError, match="ew"):
        par.shard_moe_weights(full.w13, "ep", 0, 2)
    with pytest.raises(ValueError, match="layout"):
        par.shard_moe_weights(full, "dp", 0, 2)
    with pytest.raises(ValueError, match="rank"):
        par.shard_moe_weights(full, "ep", 2, 2)
    with pytest.raises(ValueError, match="multiple of the scale block"):  # I/4 = 64: half a block per rank
        par.shard_moe_weights(full, "tp", 0, 4)
    with pytest.raises(ValueError, match="divisible"):
        par.shard_moe_weights(full, "ep", 0, 3)


def test_head_ranges_hy3_and_split_attention_concatenates():
    assert par.head_ranges(64, 8, 3, 8) == ((24, 32), (3, 4))  # Hy3 TP8: 8 q / 1 kv per rank
    q, k, v, table, lens = attention_inputs()
    full = attention_math(q, k, v, table, lens)
    parts = [attention_math(*par.shard_attention_heads(q, k, v, r, WORLD), table, lens) for r in range(WORLD)]
    assert torch.equal(torch.cat(parts, dim=1), full)  # same per-head arithmetic, bit for bit
    with pytest.raises(ValueError, match="head_dim"):
        par.shard_attention_heads(q[..., :16], k, v, 0, WORLD)


def test_collectives_need_a_process_group(monkeypatch):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.fail("a test left a process group initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        par.all_reduce(torch.zeros(3))
    with pytest.raises(RuntimeError, match="init_process_group"):
        par.all_gather_heads(torch.zeros(1, 2, 3))
    with pytest.raises(TypeError, match="t must"):
        par.all_reduce([1.0])
    with pytest.raises(TypeError, match="accumulate_fp32 must be a bool"):
        par.all_reduce(torch.zeros(3), accumulate_fp32="no")
    with pytest.raises(TypeError, match="o must be a torch.Tensor, got list"):
        par.all_gather_heads([1.0])
    with pytest.raises(ValueError, match=r"o must be a 3-D tensor \[T, H_local, D\], got shape \(1, 2\)"):
        par.all_gather_heads(torch.zeros(1, 2))
    for k in par.NO_MULTICAST_ENV:
        monkeypatch.setenv(k, "1" if k == "NCCL_NVLS_ENABLE" else "0")
    par.disable_multicast()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


# ----------------------------------------------------------------------------- 2 processes, gloo

def _rank_ep(rank):
    import evenflow

    x, ids, w, w13, w2, shared = moe_inputs()
    a, b = par.shard_moe_ep(w13, w2, rank, WORLD)
    y = evenflow.fused_moe(x, ids, w, evenflow.MoEWeights.bf16(a, b), ep_rank=rank, num_experts_total=E,
                           shared_output=shared if rank == 0 else None, routed_scaling=ROUTED_SCALING)
    return par.all_reduce(y)


def _rank_tp(rank):
    import evenflow

    x, ids, w, w13, w2, shared = moe_inputs()
    a, b = par.shard_moe_tp(w13, w2, rank, WORLD)
    y = evenflow.fused_moe(x, ids, w, evenflow.MoEWeights.bf16(a, b), ep_rank=0, num_experts_total=E,
                           shared_output=shared if rank == 0 else None, routed_scaling=ROUTED_SCALING)
    return par.all_reduce(y)


def _rank_attention(rank, use_plan):
    import evenflow

    q, k, v, table, lens = attention_inputs()
    q_r, k_r, v_r = par.shard_attention_heads(q, k, v, rank, WORLD)
    plan = None
    if use_plan:
        plan = evenflow.DecodePlan(len(ATT_LENS), table.shape[1] * PAGE, HKV // WORLD, page_size=PAGE,
                                   device="cpu")
        plan.update(lens)
    o = evenflow.decode_attention(q_r, k_r, v_r, table, lens, plan=plan)
    return par.all_gather_heads(o)


def _rank_accumulate(rank):
    """all_reduce(accumulate_fp32=True) of tensors an fp32 sum would narrow (round CK's review: it took every
    dtype through fp32) and of a bf16 one it widens."""
    big = torch.tensor([2 ** 40 + 1 + rank], dtype=torch.int64)
    wide = torch.tensor([1 + 1e-12 * (rank + 1), 0.1], dtype=torch.float64)
    narrow = torch.tensor([256.0, 1.0], dtype=torch.bfloat16)  # still summed (through fp32) and rounded back
    return [par.all_reduce(t, accumulate_fp32=True) for t in (big, wide, narrow)]


CHECKS = {
    "accumulate": _rank_accumulate,
    "ep": _rank_ep,
    "tp": _rank_tp,
    "attention-plan": lambda r: _rank_attention(r, True),
    "attention-static": lambda r: _rank_attention(r, False),
}


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    results = {}
    try:
        for name, fn in CHECKS.items():
            # Failures are symmetric across ranks here (same code, same inputs), so a rank
            # never waits in a collective that its peer skipped.
            try:
                results[name] = fn(rank)
            except Exception:
                results[name] = traceback.format_exc(limit=6)
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        # Both ranks leave their last collective before either tears gloo down: without this, a rank
        # destroying its group while its peer's connection threads still ran aborted now and then
        # ("terminate called without an active exception", about 1 run in 6 on a 2-core machine).
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import numpy
    import torch.multiprocessing as mp

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        # The Triton 3.6 interpreter fails on loops with kernel-argument bounds under
        # numpy >= 2.4 (a known defect); CI pins numpy<2.4 and runs this simulation.
        # GPU machines (numpy 2.5) cover multi-rank runs with benchmarks/multigpu.py.
        pytest.skip(f"the Triton interpreter needs numpy<2.4 (found {numpy.__version__})")
    d = tmp_path_factory.mktemp("ranks")
    # The ranks exchange CPU tensors over gloo, so their kernels must run in the
    # interpreter even on a GPU machine (where the multi-GPU benchmark covers NCCL):
    # spawned children take the environment as it is at spawn time.
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mp.spawn(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    out = [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]
    assert all(set(o) == set(CHECKS) for o in out), "a rank did not report every check"
    return out


def _results(two_ranks, name):
    outs = [r[name] for r in two_ranks]
    for rank, o in enumerate(outs):
        if isinstance(o, str):
            pytest.fail(f"rank {rank} failed the {name} check:\n{o}")
    return outs


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_two_rank_moe_all_reduced_equals_unsplit(two_ranks, layout):
    outs = _results(two_ranks, layout)
    _, _, _, w13, w2, _ = moe_inputs()
    if layout == "ep":
        shards = [(*par.shard_moe_ep(w13, w2, r, WORLD), r * E // WORLD) for r in range(WORLD)]
    else:
        shards = [(*par.shard_moe_tp(w13, w2, r, WORLD), 0) for r in range(WORLD)]
    ref = moe_oracle()
    base = moe_split_baseline(shards)
    for rank, y in enumerate(outs):
        assert y.dtype == torch.bfloat16 and y.shape == (T, HID)
        assert_within_rule(y, ref, base, what=f"{layout} rank {rank} all-reduced")
    assert_exact(outs[0], outs[1], what="all-reduced output, rank 0 vs rank 1")


def test_two_rank_fp32_accumulation_widens_only(two_ranks):
    """accumulate_fp32 sums a bf16 tensor through fp32 and leaves wider ones (int64, fp64) to their own exact sums
    (through fp32 the int64 lost its last bit and the fp64 its last ~30)."""
    for big, wide, narrow in _results(two_ranks, "accumulate"):
        assert big.dtype == torch.int64 and big.tolist() == [2 * (2 ** 40 + 1) + 1]
        assert wide.dtype == torch.float64
        assert wide.tolist() == [(1 + 1e-12) + (1 + 2e-12), 0.1 + 0.1]
        assert narrow.dtype == torch.bfloat16 and narrow.tolist() == [512.0, 2.0]


@pytest.mark.parametrize("schedule", ["plan", "static"])
def test_two_rank_attention_heads_gathered_equal_unsplit(two_ranks, schedule):
    outs = _results(two_ranks, f"attention-{schedule}")
    q, k, v, table, lens = attention_inputs()
    ref = attention_math(q, k, v, table, lens)
    base = attention_math(q, k, v, table, lens, torch.float32).to(torch.bfloat16)
    for rank, o in enumerate(outs):
        assert o.shape == (len(ATT_LENS), HQ, HEAD_DIM)
        assert_within_rule(o, ref, base, what=f"attention ({schedule}) rank {rank} gathered heads")
    assert_exact(outs[0], outs[1], what="gathered heads, rank 0 vs rank 1")
