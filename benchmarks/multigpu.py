"""Multi-GPU MoE (TP and EP) and TP attention: every rank checked against the unsplit layer, then timed.

One process per GPU (NCCL); on a CPU-only machine the same code runs over gloo at
tiny shapes through the Triton interpreter (checks only, nothing is timed):

    torchrun --nproc-per-node 2 benchmarks/multigpu.py --out benchmarks/results/h200-x2 [--quick]
    torchrun --nproc-per-node 2 benchmarks/multigpu.py --tiny        # CPU smoke run (gloo)

Layers (Hy3 shapes of the HPC-Ops reference; any world size that divides them):

* ``hy3-moe-tp<n>-<format>`` — E192 top-8, H4096, I1536 with I split over the ranks (TP2:
  768 per rank, TP8: 192); y = all_reduce(fused_moe(shard)).
* ``hy3-moe-ep<n>-<format>`` — the same layer, experts split (EP2: 96 local experts of full
  I), global ids, ``ep_rank``; y = all_reduce(fused_moe(local experts)).
* ``hy3-moe-unsplit-<format>`` — the whole layer on rank 0's GPU alone (ranks=1), for the scaling.
  Formats: bf16, fp8_per_tensor (Hy3's shipped format), fp8_block.
* ``tp<n>:<case>`` attention — heads split over all ranks (64/8 heads: 32 q / 4 kv per rank on
  2 ranks), heads gathered for the check (the o-projection that follows owns the all-reduce);
  ``tp8-slice:<case>`` — with fewer ranks than kv heads, rank r runs slice r of the 8-way split
  (Hy3 TP8: 8 q / 1 kv); ``unsplit:<case>`` — all heads on rank 0 alone. bf16 and fp8 KV.

Phase 1 checks every evenflow layer against the unsplit float64 layer with the tolerance rule
(``evenflow.testing``; baseline = PyTorch doing the same split math in the working precision,
all-reduced by the same collective; MoE layers with the fp8 requantisation allowance, summed over
the ranks' shards as each requantises its own); phase 2 checks each impl again and times it: CUDA-graph
replay (``us``: the max over ranks of each rank's median; ``us_min_rank`` beside it) and eager
(``eager_us``); for MoE rows also ``compute_us`` (fused MoE alone) and ``allreduce_us``. A
PASS/FAIL table of every check ends the run; exit status 1 if any check failed.

Floors: MoE = per-rank max(bytes of the hit expert shards + activations / copy bandwidth,
FLOPs / bf16 or fp8 rate) + all-reduce bytes (2 (n-1)/n * T*H*2 per rank) / the measured NCCL
bus bandwidth; attention = live KV of the rank's heads + q + o / copy bandwidth. Peers: SGLang's
Triton fused MoE (``evenflow.bench.peers.sglang``) with the same all-reduce; FlashInfer decode
(``evenflow.bench.peers.flashinfer``) on the same slice. A peer that cannot run is an error row.

Never hangs: collectives time out (``--nccl-timeout-s``), an exception on any rank prints its
traceback and leaves the process at once (rank 0 writing what it has), and a watchdog ends every
rank at ``--hard-limit-s``. ``--budget-s`` turns rows not yet started into error rows.

NVLink multicast stays off: the environment of ``evenflow.parallel.NO_MULTICAST_ENV`` is
set before the process group exists, and no multicast API is called.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from evenflow import parallel as par
from evenflow.reference.attention import decode_attention_ref_batched, shuffled_page_tables

par.disable_multicast()  # before anything can create an NCCL communicator

HY3 = dict(experts=192, top_k=8, hidden=4096, inter=1536, q_heads=64, kv_heads=8, head_dim=128, page=64)
# Tiny: fp8 block scales need H and I/world in whole 128-blocks (I 256 splits 2 ways).
TINY = dict(experts=4, top_k=2, hidden=128, inter=256, q_heads=8, kv_heads=4, head_dim=64, page=16)
BATCHES = (1, 16, 128, 1024)
QUICK_BATCHES = (1, 32, 512)
FORMATS = ("bf16", "fp8_per_tensor", "fp8_block")
ATT_CASES = {"1x128K+31x4K": (1 << 17,) + (4096,) * 31, "64x4K": (4096,) * 64,
             "1x32K+63x512": (1 << 15,) + (512,) * 63, "2x64K+30x1K": (1 << 16,) * 2 + (1024,) * 30}
QUICK_ATT = ("1x128K+31x4K", "1x32K+63x512")
TINY_ATT = {"1x200+2x40": (200, 40, 40)}
MAX_ROTATE = 4
WEIGHT_STD = 0.02


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ----------------------------------------------------------------------------- rank agreement

def agree(ok: bool, msg: str, dev) -> str | None:
    """All ranks learn whether every rank is ok; returns the first failing rank's message (or None).

    Called before any timed collective, so a rank never waits in an all-reduce its peer skipped.
    """
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=dev)
    dist.all_reduce(flag)
    if int(flag) == 0:
        return None
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if ok else msg)
    return next(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)


def over_budget(args, dev) -> bool:
    """Whether rank 0's clock says the time budget is spent (one decision for all ranks)."""
    flag = torch.tensor([1 if time.time() - args.t0 > args.budget_s else 0], dtype=torch.int32, device=dev)
    dist.broadcast(flag, src=0)
    return bool(int(flag))


def reduce_time(us: float, dev, op) -> float:
    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return float(t)


# ----------------------------------------------------------------------------- MoE

SGL_VARIANT = {"bf16": "bf16", "fp8_per_tensor": "fp8-tensor", "fp8_block": "fp8-block"}
FP8_MAX = 448.0


def make_routing(tokens: int, shapes: dict, gen: torch.Generator, bias: torch.Tensor):
    """Global top-k ids (int32) and renormalised fp32 weights from softmax(N(0,1) + per-expert bias); CPU."""
    probs = torch.softmax(torch.randn(tokens, shapes["experts"], generator=gen) + bias, dim=-1)
    w, ids = probs.topk(shapes["top_k"], dim=-1)
    return ids.to(torch.int32).contiguous(), (w / w.sum(-1, keepdim=True)).float().contiguous()


def make_moe_weights(shapes: dict, dev, seed: int):
    """Full (unsplit) bf16 weights, identical on every rank (same seed, one expert at a time)."""
    e, h, i = shapes["experts"], shapes["hidden"], shapes["inter"]
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=dev)
    for j in range(e):
        w13[j] = torch.randn(2 * i, h, generator=g, device=dev) * WEIGHT_STD
        w2[j] = torch.randn(h, i, generator=g, device=dev) * WEIGHT_STD
    return w13, w2


def quant_expert_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 e4m3 + per-expert dequant scale [E] (amax / 448), one expert at a time."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for j in range(w.shape[0]):
        wf = w[j].float()
        s[j] = wf.abs().amax().clamp_min(1e-12) / FP8_MAX
        q[j] = (wf / s[j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def quant_expert_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 e4m3 + 128x128 block dequant scales [E, N/128, K/128], one expert at a time."""
    e, n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(e, n // block, k // block, dtype=torch.float32, device=w.device)
    for j in range(e):
        wb = w[j].float().reshape(n // block, block, k // block, block)
        s[j] = wb.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
        q[j] = (wb / s[j][:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(n, k)
    return q, s


def make_format(fmt: str, w13, w2, shapes: dict, dev, gen: torch.Generator):
    """The whole layer as ``evenflow.MoEWeights`` of ``fmt`` (identical on every rank)."""
    from evenflow.moe.quant import MoEWeights

    if fmt == "bf16":
        return MoEWeights.bf16(w13, w2)
    if fmt == "fp8_block":
        (q13, s13), (q2, s2) = quant_expert_block(w13), quant_expert_block(w2)
        return MoEWeights.fp8_block(q13, q2, s13, s2)
    (q13, s13), (q2, s2) = quant_expert_tensor(w13), quant_expert_tensor(w2)
    # Static activation scales from a calibration batch (amax * 1.25 / 448), as a deployment ships them.
    x = torch.randn(256, shapes["hidden"], generator=gen).to(dev, torch.bfloat16).float()
    i = shapes["inter"]
    amax = 0.0
    for e in range(min(8, shapes["experts"])):
        gu = x @ (q13[e].float() * s13[e]).T
        amax = max(amax, float((torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).abs().max()))
    a13 = (x.abs().max() * 1.25 / FP8_MAX).reshape(1).float()
    a2 = torch.tensor([amax * 1.25 / FP8_MAX], dtype=torch.float32, device=dev)
    return MoEWeights.fp8_per_tensor(q13, q2, s13, s2, a13, a2)


def clone_weights(ew):
    from evenflow.moe.quant import MoEWeights

    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return MoEWeights(ew.format, c(ew.w13), c(ew.w2), c(ew.w13_scale), c(ew.w2_scale), c(ew.a13_scale),
                      c(ew.a2_scale))


def moe_bind(impl: str, ew, ep_rank: int, num_total: int, split: bool):
    """bind(x, ids, tw, out) -> (layer fn, compute-only fn); PeerUnavailable when the impl cannot run.

    ``split``: the layer ends with the all-reduce of the partial outputs (not for the unsplit layer).
    """
    from evenflow.bench.harness import PeerUnavailable

    finish = par.all_reduce if split else (lambda y: y)
    if impl == "evenflow":
        import evenflow

        def bind(x, ids, tw, out):
            compute = lambda: evenflow.fused_moe(x, ids, tw, ew, ep_rank=ep_rank,  # noqa: E731
                                                 num_experts_total=num_total, out=out)
            return (lambda: finish(compute())), compute
        return bind
    if impl == "sglang-triton":
        from evenflow.bench.peers.sglang import SGLangFusedMoE

        if not torch.cuda.is_available():
            raise PeerUnavailable("sglang-triton needs a CUDA GPU")
        peer = SGLangFusedMoE(SGL_VARIANT[ew.format], ew.w13, ew.w2, w13_scale=ew.w13_scale, w2_scale=ew.w2_scale,
                              a13_scale=ew.a13_scale, a2_scale=ew.a2_scale, ep_rank=ep_rank,
                              num_experts_total=num_total if ew.num_experts != num_total else None)

        def bind(x, ids, tw, out):
            compute = peer.bind(x, ids, tw)
            return (lambda: finish(compute())), compute
        return bind
    raise ValueError(f"unknown impl {impl!r}")


def expert_shard_bytes(ew) -> int:
    """Bytes of one expert of this (shard of the) layer, scales included."""
    n = ew.w13[0].numel() * ew.w13.element_size() + ew.w2[0].numel() * ew.w2.element_size()
    if ew.w13_scale is not None and ew.w13_scale.dim() == 3:
        n += (ew.w13_scale[0].numel() + ew.w2_scale[0].numel()) * 4
    return n


def moe_floor(kind: str, ew, shapes: dict, ids: torch.Tensor, tokens: int, world: int, ceil: dict,
              busbw_GBps: float | None) -> float:
    """Per-rank weight-read/FLOP floor of the slowest rank plus the all-reduce byte floor, µs.

    ``kind`` "unsplit": one GPU, the whole layer, no all-reduce. FLOPs at the bf16 rate for
    bf16 weights, at the fp8 rate otherwise.
    """
    from evenflow.bench import harness as H

    h = shapes["hidden"]
    i_r, e_r = ew.intermediate_size, ew.num_experts
    ebytes = expert_shard_bytes(ew)
    rate = "bf16_TFLOPs" if ew.format == "bf16" else "fp8_TFLOPs"
    ranks = []
    for r in range(world if kind != "unsplit" else 1):  # the layer ends when the most loaded rank ends
        first = r * e_r if kind == "ep" else 0
        local = ids.long() - first
        m = (local >= 0) & (local < e_r)
        distinct, pairs = int(torch.unique(local[m]).numel()), int(m.sum())
        # the layer is fed bf16 rows whatever its weights' format (an fp8 layer quantises them inside)
        nbytes = distinct * ebytes + int(m.any(1).sum()) * h * 2 + tokens * h * 2 + ids.numel() * 8
        ranks.append(H.floor_us(nbytes, 6 * h * i_r * pairs, ceilings=ceil, rate=rate))
    worst = H.Floor.worst(ranks)  # every rank's terms kept: another copy reading may make another rank the slowest
    if kind == "unsplit" or not busbw_GBps:
        return worst
    ar_bytes = 2 * (world - 1) / world * tokens * h * 2
    return worst.plus(ar_bytes / (busbw_GBps * 1e3))


def measure_busbw(dev, world: int, nbytes: int = 256 << 20) -> float:
    """NCCL all-reduce bus bandwidth (GB/s) of a large bf16 message: 2 (n-1)/n * bytes / time."""
    t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    reps, times = 10, []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        dist.all_reduce(t)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    busbw = 2 * (world - 1) / world * nbytes / times[len(times) // 2] / 1e9
    del t
    return reduce_time(busbw, dev, dist.ReduceOp.MIN)


def n_rotations(ew, kind: str, shapes: dict, l2: int) -> int:
    """Weight copies so a small batch's working set is not timed out of L2 (same count on every rank)."""
    if not l2:
        return 1
    hit = min(ew.num_experts, shapes["top_k"]) if kind != "ep" else 1
    return max(1, min(MAX_ROTATE, math.ceil(2 * l2 / (hit * expert_shard_bytes(ew)))))


def build_binders(impls, layers: dict, num_total: int, split: bool) -> dict:
    """{impl: [bind per rotated copy]} or {impl: error string}; local (no collective)."""
    from evenflow.bench.harness import PeerUnavailable

    out: dict = {}
    for impl in impls:
        try:
            out[impl] = [moe_bind(impl, ew, layers["ep_rank"], num_total, split) for ew in layers["copies"]]
        except PeerUnavailable as e:
            out[impl] = f"unavailable: {e}"
        except Exception as e:
            out[impl] = _err(e)
    return out


def rule(out, ref, base, what: str, impl: str = "evenflow", allowance=None) -> tuple[str, float, float]:
    """("" or the failure, max |err|, the bound) of an output check.

    evenflow is held to the tolerance rule (evenflow.testing), with ``allowance`` (MoE layers: the fp8
    requantisation allowance of evenflow.reference.moe, summed over the ranks' shards). A peer gets the benchmark
    sanity check of the single-GPU benchmarks (finite, close, cosine; evenflow.bench.harness
    .check_output): peers quantise activations their own way (SGLang's fp8 paths differ from
    the reference's), so the rule we hold our kernels to is not theirs; its bound is NaN.
    """
    from evenflow.bench import harness as H
    from evenflow.testing import rule_check

    if not impl.startswith("evenflow"):
        try:
            chk = H.check_output(out, ref, what, rtol=5e-2, min_cos=0.999)  # as benchmarks/moe.py for fp8
            return "", chk["max_abs_err"], float("nan")
        except AssertionError as e:
            return _err(e), float("nan"), float("nan")
    msg, err, bound = rule_check(out, ref, base, what=what, allowance=allowance)
    return (_err(AssertionError(msg)), float("nan"), bound) if msg else ("", err, bound)


def record_check(msg, err, bound, row, impl, collective, world, rank, res, checks, dev) -> bool:
    """Agree on one check across ranks and record it on rank 0; True if it passed everywhere.

    ``msg`` is this rank's failure ("" if none). With ``collective`` every rank holds a
    share of the output, so the worst error and the tightest bound over ranks are kept.
    """
    bad = agree(not msg, msg, dev) if collective else (msg or None)
    if collective:
        errs = [None] * world
        dist.all_gather_object(errs, (err, bound))
    else:
        errs = [(err, bound)]
    if bad is not None:
        if rank == 0:
            res.add_error(error=bad, **row)
            checks.add(row, impl, bad)
        return False
    err, bound = max(e for e, _ in errs), min(b for _, b in errs)
    if rank == 0:
        checks.add(row, impl, "", err, bound)
    return True


def run_moe(args, shapes, res, checks, ceil, busbw, dev, rank, world, timing: bool) -> None:
    from evenflow.bench import harness as H
    from evenflow.reference.moe import moe_baseline, moe_reference, moe_requant_allowance

    log(f"[multigpu] building full MoE weights {shapes} on every rank")
    w13, w2 = make_moe_weights(shapes, dev, args.seed)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if timing else 0
    gen = torch.Generator().manual_seed(args.seed + 1)
    bias = torch.randn(shapes["experts"], generator=gen)
    ntot = shapes["experts"]
    prefix = "tiny" if args.tiny else "hy3"
    for fmt in args.formats:
        full = make_format(fmt, w13, w2, shapes, dev, gen)
        layouts: dict = {}
        for kind in args.layouts:
            try:
                ew, ep_rank = par.shard_moe_weights(full, kind, rank, world)
                msg = ""
            except Exception as e:  # e.g. fp8 block scales with I/world not whole 128-blocks
                ew, ep_rank, msg = None, 0, _err(e)
            bad = agree(not msg, msg, dev)
            if bad is not None:
                layouts[kind] = bad
                continue
            n_copies = n_rotations(ew, kind, shapes, l2)
            lay = {"ep_rank": ep_rank, "shard": ew, "copies": [ew] + [clone_weights(ew) for _ in range(n_copies - 1)]}
            lay["binders"] = build_binders(args.impls, lay, ntot, split=True)
            for impl, b in lay["binders"].items():  # every rank must agree before any collective
                bad = agree(not isinstance(b, str), b if isinstance(b, str) else "", dev)
                if bad is not None:
                    lay["binders"][impl] = bad
            layouts[kind] = lay
        single = None  # the unsplit layer on one GPU (rank 0), for the scaling
        if timing and args.single_gpu and rank == 0:
            n_copies = n_rotations(full, "unsplit", shapes, l2)
            single = {"ep_rank": 0, "shard": full,
                      "copies": [full] + [clone_weights(full) for _ in range(n_copies - 1)]}
            single["binders"] = build_binders(["evenflow"], single, ntot, split=False)
        n_inputs = max([len(v["copies"]) for v in layouts.values() if isinstance(v, dict)] +
                       [len(single["copies"]) if single else 1])
        for batch in H.progress(args.batches, f"moe-{fmt}") if rank == 0 else args.batches:
            inputs = []
            for _ in range(n_inputs):
                ids, tw = make_routing(batch, shapes, gen, bias)
                x = torch.randn(batch, shapes["hidden"], generator=gen).bfloat16()
                inputs.append((x.to(dev), ids.to(dev), tw.to(dev)))
            x0, ids0, tw0 = inputs[0]
            ref = moe_reference(x0, ids0, tw0, full, dtype=torch.float64)  # the unsplit layer
            for kind in args.layouts:
                lay = layouts[kind]
                case = f"{prefix}-moe-{kind}{world}-{fmt}"
                row = dict(case=case, variant=fmt, batch=batch, layout=kind, ranks=world)
                if isinstance(lay, str):
                    if rank == 0:
                        for impl in args.impls:
                            res.add_error(error=lay, impl=impl, **row)
                            checks.add(row, impl, lay)
                    continue
                ew = lay["shard"]
                # PyTorch doing the same split math in the working precision, through the same collective.
                base = moe_baseline(x0, ids0, tw0, ew, ep_rank=lay["ep_rank"], num_experts_total=ntot)
                par.all_reduce(base)
                # each rank requantises its own shard's intermediate (whole experts, or whole 128-groups of
                # I), so the split layer's allowance is the sum of the shards' (EP: the unsplit layer's; TP: about
                # it, each shard's windows from its own products' errors; tests/test_moe_rule.py)
                allow = moe_requant_allowance(x0, ids0, tw0, ew, ep_rank=lay["ep_rank"], num_experts_total=ntot)
                par.all_reduce(allow)
                fl = moe_floor(kind, ew, shapes, ids0.cpu(), batch, world, ceil, busbw) if timing else None
                for impl in args.impls:
                    time_moe_row(args, res, checks, dict(row, impl=impl), lay["binders"][impl], inputs, ref, base,
                                 fl, dev, rank, world, timing, split=True, allowance=allow)
            if single is not None or (timing and args.single_gpu):
                # Rank 0 alone runs the unsplit layer; the other ranks wait at the barrier.
                if rank == 0:
                    row = dict(case=f"{prefix}-moe-unsplit-{fmt}", variant=fmt, batch=batch, layout="unsplit",
                               ranks=1, impl="evenflow")
                    base = moe_baseline(x0, ids0, tw0, full)
                    fl = moe_floor("unsplit", full, shapes, ids0.cpu(), batch, 1, ceil, None)
                    time_moe_row(args, res, checks, row, single["binders"]["evenflow"], inputs, ref, base, fl,
                                 dev, rank, world, timing, split=False,
                                 allowance=moe_requant_allowance(x0, ids0, tw0, full))
                dist.barrier()
        del layouts, single, full
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del w13, w2


def time_moe_row(args, res, checks, row, binder, inputs, ref, base, fl, dev, rank, world, timing, split,
                 allowance=None) -> None:
    """Check then time one MoE row; ``split``: every rank takes part (collectives), else rank 0 alone;
    ``allowance``: the rule's fp8 requantisation allowance for this output (see :func:`rule`)."""
    ag = (lambda ok, m: agree(ok, m, dev)) if split else (lambda ok, m: None if ok else m)
    if (over_budget(args, dev) if split else time.time() - args.t0 > args.budget_s):
        if rank == 0:
            res.add_error(error=f"skipped: time budget {args.budget_s:.0f}s spent", **row)
            checks.add(row, row["impl"], "skipped: time budget spent")
        return
    if isinstance(binder, str):
        if rank == 0:
            res.add_error(error=binder, **row)
            checks.add(row, row["impl"], binder)
        return
    n = len(binder)
    batch, hidden = inputs[0][0].shape
    outs = [torch.empty(batch, hidden, dtype=torch.bfloat16, device=dev) for _ in range(n)]
    msg, err, bound = "", float("nan"), float("nan")
    try:
        fns = [binder[j](*inputs[j], outs[j]) for j in range(n)]
        y = fns[0][0]()
        msg, err, bound = rule(y, ref, base, f"{row['case']} {row['impl']} batch {batch} rank {rank}", row["impl"],
                               allowance)
    except Exception as e:
        msg = _err(e)
    if not record_check(msg, err, bound, row, row["impl"], split, world, rank, res, checks, dev) or not timing:
        return
    msg = ""
    try:
        timed = time_layer([f for f, _ in fns], dev, collective=split)
        if split:
            compute = time_layer([c for _, c in fns], dev, eager=False)
            ar = time_layer([(lambda o=o: par.all_reduce(o)) for o in outs], dev, eager=False)
    except Exception as e:
        msg = _err(e)
    bad = ag(not msg, msg)
    if rank == 0:
        if bad is not None:
            res.add_error(error=bad, **row)
        else:
            extra = dict(compute_us=compute["us"], allreduce_us=ar["us"], us_min_rank=timed["us_min"]) if split else {}
            res.add(us=timed["us"], eager_us=timed["eager_us"], floor_us=fl, max_abs_err=err, bound=bound,
                    rotated=n, x=f"{row['layout']} b{batch}", plot=f"moe {row['variant']}", **extra, **row)


def time_layer(fns, dev, eager: bool = True, collective: bool = True) -> dict:
    """Graph-replay (and eager) median µs; with ``collective``, on every rank, max and min over ranks."""
    from evenflow.bench import harness as H

    if collective:
        dist.barrier()
    # every rank replays the graph (an all-reduce in it, for the layer and all-reduce rows) the same
    # number of times: the warm-up count each rank derives from its own replay time, maxed over ranks
    agree_warm = (lambda n: int(reduce_time(n, dev, dist.ReduceOp.MAX))) if collective else None
    us = H.time_graph(fns, agree_warm=agree_warm)
    if not collective:
        return {"us": us, "us_min": us, "eager_us": H.time_eager(fns, reps=20) if eager else None}
    out = {"us": reduce_time(us, dev, dist.ReduceOp.MAX), "us_min": reduce_time(us, dev, dist.ReduceOp.MIN)}
    if eager:
        dist.barrier()
        out["eager_us"] = reduce_time(H.time_eager(fns, reps=20), dev, dist.ReduceOp.MAX)
    return out


# ----------------------------------------------------------------------------- attention (TP heads)

def attention_inputs(lengths, shapes, dev, seed: int, kv: str):
    """Full-head q [B, Hq, D] bf16, caches [pages, P, Hkv, D] (shuffled pages; bf16, or fp8 e4m3 with
    per-tensor scales amax/448), page table, lengths, (k_scale, v_scale) floats or None."""
    p, hq, hkv, d = shapes["page"], shapes["q_heads"], shapes["kv_heads"], shapes["head_dim"]
    tables, pool = shuffled_page_tables(lengths, p, generator=torch.Generator().manual_seed(seed))
    gd = torch.Generator(device=dev).manual_seed(seed)
    k = torch.randn(pool, p, hkv, d, generator=gd, device=dev).bfloat16()
    v = torch.randn(pool, p, hkv, d, generator=gd, device=dev).bfloat16()
    q = torch.randn(len(lengths), hq, d, generator=gd, device=dev).bfloat16()
    scales = (None, None)
    if kv == "fp8":
        ks, vs = (float(t.float().abs().max()) / FP8_MAX for t in (k, v))
        k = (k.float() / ks).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        v = (v.float() / vs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scales = (ks, vs)
    return q, k, v, tables[0].to(dev), torch.tensor(lengths, dtype=torch.int32, device=dev), scales


def attention_ref(q, k, v, table, lens, scales):
    """(fp64 oracle, baseline): the baseline is PyTorch in fp32 with probabilities rounded to bf16
    and a bf16 output, as the decode GPU tests use."""
    ks, vs = scales
    ref = decode_attention_ref_batched(q, k, v, table, lens, k_scale=ks, v_scale=vs, dtype=torch.float64)[0]
    base = decode_attention_ref_batched(q, k, v, table, lens, k_scale=ks, v_scale=vs, dtype=torch.float32,
                                        p_dtype=torch.bfloat16, out_dtype=torch.bfloat16)[0]
    return ref, base


def attention_bind(impl: str, q, k, v, table, lens, shapes, scales):
    from evenflow.bench.harness import PeerUnavailable

    ks, vs = scales
    if impl == "evenflow":
        import evenflow

        # the plan a user builds (README): told the cache's dtype (an fp8 cache: the Gluon kernel where it applies;
        # before round AP this benchmark's plans ran the Triton kernel on fp8 caches) and the calls' shape
        plan = evenflow.DecodePlan(len(lens), table.shape[1] * shapes["page"], k.shape[2],
                                   page_size=shapes["page"], device=q.device, kv_dtype=k.dtype,
                                   num_q_heads=q.shape[1], head_dim=q.shape[2])
        plan.update(lens)
        out = torch.empty_like(q)
        return lambda: evenflow.decode_attention(q, k, v, table, lens, plan=plan, k_scale=ks, v_scale=vs, out=out)
    if impl.startswith("flashinfer"):
        from evenflow.bench.peers import flashinfer as fi

        if not torch.cuda.is_available():
            raise PeerUnavailable("flashinfer needs a CUDA GPU")
        wrapper = fi.FlashInferDecode(impl, table, lens, num_q_heads=q.shape[1], num_kv_heads=k.shape[2],
                                      head_dim=q.shape[2], page_size=shapes["page"], q_dtype=q.dtype,
                                      kv_dtype=k.dtype, sm_scale=1.0 / math.sqrt(q.shape[2]))
        return wrapper.runner(q, k, v, k_scale=ks, v_scale=vs)
    raise ValueError(f"unknown impl {impl!r}")


def attention_layouts(world: int, shapes: dict) -> list[tuple[str, int]]:
    """(name, ways) of the head splits run: the split over all ranks, and (when the world has fewer
    ranks than kv heads) the one-kv-head slice, rank r running slice r of a kv_heads-way split
    (Hy3: the TP8 slice, 8 q / 1 kv heads)."""
    hkv = shapes["kv_heads"]
    out = [(f"tp{world}", world)]
    if world < hkv and hkv % world == 0:
        out.append((f"tp{hkv}-slice", hkv))
    return out


def run_attention(args, shapes, res, checks, ceil, dev, rank, world, timing: bool) -> None:
    from evenflow.bench import harness as H

    cases = TINY_ATT if args.tiny else {c: ATT_CASES[c] for c in args.att_cases}
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if timing else 0
    for kv in args.kv:
        for name, lengths in (H.progress(cases.items(), f"attention-{kv}") if rank == 0 else cases.items()):
            q, k, v, table, lens, scales = attention_inputs(lengths, shapes, dev, args.seed + 7, kv)
            ref, base = attention_ref(q, k, v, table, lens, scales)
            for split, ways in attention_layouts(world, shapes):
                q_r, k_r, v_r = par.shard_attention_heads(q, k, v, rank, ways)
                (qlo, qhi), _ = par.head_ranges(q.shape[1], k.shape[2], rank, ways)
                gather = ways == world  # the whole layer: heads of every rank gathered and checked
                row_ref, row_base = (ref, base) if gather else (ref[:, qlo:qhi], base[:, qlo:qhi])
                run_attention_row(args, res, checks, dict(case=f"{split}:{name}", variant=f"{kv}-kv", ranks=world,
                                  batch=len(lengths), heads=f"{qhi - qlo}q/{k_r.shape[2]}kv"),
                                  (q_r, k_r, v_r), table, lens, scales, row_ref, row_base, gather, shapes, ceil,
                                  l2, dev, rank, world, timing, collective=True)
                del q_r, k_r, v_r
            if timing and args.single_gpu:  # the unsplit layer on one GPU (rank 0), for the scaling
                if rank == 0:
                    run_attention_row(args, res, checks, dict(case=f"unsplit:{name}", variant=f"{kv}-kv", ranks=1,
                                      batch=len(lengths), heads=f"{q.shape[1]}q/{k.shape[2]}kv"),
                                      (q, k, v), table, lens, scales, ref, base, False, shapes, ceil, l2, dev,
                                      rank, world, timing, collective=False, impls=["evenflow"])
                dist.barrier()
            del q, k, v, ref, base
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def run_attention_row(args, res, checks, row, qkv, table, lens, scales, ref, base, gather, shapes, ceil, l2, dev,
                      rank, world, timing, collective, impls=None) -> None:
    from evenflow.bench import harness as H

    ag = (lambda ok, m: agree(ok, m, dev)) if collective else (lambda ok, m: None if ok else m)
    q_r, k_r, v_r = qkv
    hq_r, hkv_r, d = q_r.shape[1], k_r.shape[2], q_r.shape[2]
    lengths = lens.tolist()
    nbytes = 2 * sum(lengths) * hkv_r * d * k_r.element_size() + len(lengths) * hq_r * d * 4
    n_copies = max(1, min(MAX_ROTATE, math.ceil(3 * l2 / nbytes))) if timing else 1
    rot = [qkv] + [tuple(t.clone() for t in qkv) for _ in range(n_copies - 1)]
    if impls is None:
        impls = ["evenflow"] + ([i for i in args.att_peers if i] if timing else [])
    for impl in impls:
        row_i = dict(row, impl=impl)
        late = over_budget(args, dev) if collective else time.time() - args.t0 > args.budget_s
        if late:
            if rank == 0:
                res.add_error(error=f"skipped: time budget {args.budget_s:.0f}s spent", **row_i)
                checks.add(row_i, impl, "skipped: time budget spent")
            continue
        fns, msg, err, bound = [], "", float("nan"), float("nan")
        try:
            fns = [attention_bind(impl, a, b, c, table, lens, shapes, scales) for a, b, c in rot]
            o = fns[0]().view(len(lengths), hq_r, d)
            if gather:
                o = par.all_gather_heads(o)
            msg, err, bound = rule(o, ref, base, f"{row['case']} {impl} rank {rank}", impl)
        except H.PeerUnavailable as e:
            msg = f"unavailable: {e}"
        except Exception as e:
            msg = _err(e)
        if not record_check(msg, err, bound, row_i, impl, collective, world, rank, res, checks, dev) or not timing:
            continue
        try:
            timed, msg = time_layer(fns, dev, collective=collective), ""
        except Exception as e:
            timed, msg = None, _err(e)
        bad = ag(not msg, msg)
        if rank == 0:
            if bad is not None:
                res.add_error(error=bad, **row_i)
            else:
                res.add(us=timed["us"], eager_us=timed["eager_us"], us_min_rank=timed["us_min"],
                        floor_us=H.floor_us(nbytes, ceilings=ceil), max_abs_err=err, bound=bound,
                        rotated=n_copies, x=row["case"], plot=f"attention {row['variant']}", **row_i)
    del rot


# ----------------------------------------------------------------------------- driver

class Checks:
    """Rank 0's record of every correctness check: a PASS/FAIL table at the end of the run."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, row: dict, impl: str, error: str, err: float = float("nan"), bound: float = float("nan")) -> None:
        self.rows.append(dict(case=row["case"], variant=row["variant"], impl=impl, batch=row.get("batch", ""),
                              ranks=row["ranks"], error=error, err=err, bound=bound))

    def failed(self) -> list[dict]:
        """Rows that ran and failed (a peer that is unavailable or a budget skip is not a failure)."""
        return [r for r in self.rows if r["error"] and not r["error"].startswith(("skipped", "unavailable"))
                and "unavailable:" not in r["error"]]

    def table(self) -> str:
        lines = ["| result | case | variant | impl | batch | ranks | max abs err | bound | note |",
                 "|---|---|---|---|---|---|---|---|---|"]
        bad = self.failed()
        for r in self.rows:
            res = "PASS" if not r["error"] else "FAIL" if any(r is b for b in bad) else "n/a"
            lines.append(f"| {res} | {r['case']} | {r['variant']} | {r['impl']} | {r['batch']} | {r['ranks']} | "
                         f"{r['err']:.2e} | {r['bound']:.2e} | {r['error'][:160]} |")
        n_pass = sum(1 for r in self.rows if not r["error"])
        lines.append(f"\n{n_pass} PASS, {len(bad)} FAIL, {len(self.rows) - n_pass - len(bad)} not run "
                     "(peer unavailable or time budget) of " + str(len(self.rows)) + " checks")
        return "\n".join(lines)


class NoResults:
    """Stands in for harness.Results where nothing is timed (CPU / --tiny) and on ranks other than 0."""

    def add(self, **row) -> None:
        pass

    def add_error(self, **row) -> None:
        pass


def _csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v]


def _extra_args(p):
    p.add_argument("--tiny", action="store_true", help="tiny shapes, checks only (automatic without CUDA)")
    p.add_argument("--layouts", type=_csv(str), default=["tp", "ep"], help="MoE layouts: tp,ep (empty: none)")
    p.add_argument("--formats", type=_csv(str), default=list(FORMATS), help="MoE weight formats: " + ",".join(FORMATS))
    p.add_argument("--batches", type=_csv(int), default=None, help="comma list of token counts")
    p.add_argument("--impls", type=_csv(str), default=["evenflow", "sglang-triton"], help="MoE impls")
    p.add_argument("--att-cases", type=_csv(str), default=None, help="comma list of " + ",".join(ATT_CASES))
    p.add_argument("--kv", type=_csv(str), default=["bf16", "fp8"], help="attention KV formats: bf16,fp8")
    p.add_argument("--att-peers", type=_csv(str), default=["flashinfer-cuda", "flashinfer-tc"],
                   help="attention peers (flashinfer-cuda, flashinfer-tc, flashinfer-fa3; empty: none)")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--no-single-gpu", dest="single_gpu", action="store_false",
                   help="skip timing the unsplit layer on one GPU (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("EVENFLOW_BENCH_BUDGET_S", 200)),
                   help="start no new check/timing after this many seconds; the rest become error rows "
                        "(results still written)")
    p.add_argument("--hard-limit-s", type=float, default=None,
                   help="watchdog: every rank exits (rank 0 writing what it has) after this many seconds "
                        "(default budget + 70)")
    p.add_argument("--nccl-timeout-s", type=float, default=180.0,
                   help="timeout of every collective: a rank left waiting for a failed peer errors out")


def validate_args(args) -> None:
    for name, vals, allowed in (("--formats", args.formats, FORMATS), ("--layouts", args.layouts, ("tp", "ep")),
                                ("--kv", args.kv, ("bf16", "fp8")), ("--att-cases", args.att_cases, ATT_CASES),
                                ("--impls", args.impls, ("evenflow", "sglang-triton"))):
        for v in vals:
            if v not in allowed:
                raise SystemExit(f"{name}: unknown value {v!r} (choose from {', '.join(allowed)})")
    if args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be positive, got {args.budget_s}")


def finish_and_exit(state: dict, code: int) -> None:
    """Write what rank 0 has (``state["finish"]``, if set) and leave at once, never waiting on peers."""
    try:
        if state.get("finish"):
            state["finish"](settle=False)  # no second copy reading on a GPU a hung collective may hold
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_watchdog(limit_s: float, state: dict) -> None:
    """Exit the process after ``limit_s`` whatever it is doing (a hung compile or collective):
    rank 0 first writes the results it has. torchrun then ends the other ranks."""
    import threading

    def fire():
        print(f"[multigpu] rank {state['rank']}: hard limit {limit_s:.0f}s reached, exiting", flush=True)
        finish_and_exit(state, 3)

    t = threading.Timer(limit_s, fire)
    t.daemon = True
    t.start()


def main(argv=None) -> int:
    import datetime

    from evenflow.bench import harness as H

    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_extra_args)
    args.t0 = time.time()
    if "RANK" not in os.environ:
        sys.exit("run under torchrun, one process per GPU: torchrun --nproc-per-node N benchmarks/multigpu.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    timing = cuda and not args.tiny
    if not timing:  # peers need a GPU; a check-only run proves our code paths
        args.impls = [i for i in args.impls if i == "evenflow"]
    args.att_cases = args.att_cases or list(QUICK_ATT if args.quick else ATT_CASES)
    validate_args(args)
    shapes = TINY if args.tiny else HY3
    args.batches = args.batches or ((3, 9) if args.tiny else QUICK_BATCHES if args.quick else BATCHES)
    state = {"rank": rank}
    start_watchdog(args.hard_limit_s or args.budget_s + 70, state)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # a timed-out collective tears down, not hangs
    timeout = datetime.timedelta(seconds=args.nccl_timeout_s)
    if cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    log(f"[multigpu] {world} ranks, backend {dist.get_backend()}, timing {timing}, "
        f"multicast env {par.NO_MULTICAST_ENV}, budget {args.budget_s:.0f}s")
    checks, timed_checks = Checks(), Checks()
    try:
        res = NoResults()
        ceil: dict = {}
        if timing:
            ceil = H.measure_ceilings(verbose=rank == 0)
            ceil["nccl_busbw_GBps"] = round(measure_busbw(dev, world), 1)
            log(f"[multigpu] NCCL all-reduce bus bandwidth {ceil['nccl_busbw_GBps']} GB/s")
            if rank == 0:
                out = args.out or Path(__file__).resolve().parent / "results" / f"{H.gpu_slug()}-x{world}"
                res = H.Results("multigpu", ceilings=ceil, out=out, meta={
                    "kind": f"{H.gpu_slug()}-x{world}", "ranks": world, "shapes": shapes,
                    "multicast_env": par.NO_MULTICAST_ENV, "budget_s": args.budget_s,
                    "us": "max over ranks of each rank's CUDA-graph replay median (layer incl. all-reduce); "
                          "ranks=1 rows: the unsplit layer on rank 0's GPU alone",
                    "floor": "MoE: slowest rank's max(bytes/copy, flops/(bf16|fp8) rate) + 2(n-1)/n*T*H*2 B / "
                             "NCCL busbw; attention: live KV of the rank's heads + q + o / copy"})

                def finish(settle=True):
                    # one panel per format ("plot"), bars per layout and batch / attention case ("x")
                    res.finish(x="x", group="plot", plot=not args.no_plot, settle=settle,
                               columns=["case", "impl", "batch", "ranks", "us", "eager_us", "compute_us",
                                        "allreduce_us", "floor_us", "frac_of_floor", "max_abs_err", "bound",
                                        "error"])
                state["finish"] = finish
        # Phase 1 checks every evenflow layer (and compiles its kernels), so a spent time budget
        # can only cut timing rows, never a correctness check; phase 2 checks each impl again
        # on its own inputs right before timing it (peers and the unsplit one-GPU layer included).
        phases = [("check", False, checks)] + ([("time", True, timed_checks)] if timing else [])
        for phase, timed, ck in phases:
            a = copy.copy(args)
            if not timed:
                a.impls, a.single_gpu = ["evenflow"], False
            log(f"[multigpu] phase {phase} (+{time.time() - args.t0:.0f}s)")
            if args.layouts and args.formats:
                run_moe(a, shapes, res if timed else NoResults(), ck, ceil, ceil.get("nccl_busbw_GBps"), dev,
                        rank, world, timed)
            if not args.no_attention and args.kv:
                run_attention(a, shapes, res if timed else NoResults(), ck, ceil, dev, rank, world, timed)
        status = 0
        if rank == 0:
            state.pop("finish", None)
            if timing:
                finish()
                print("\n[multigpu] checks right before timing (every impl, unsplit one-GPU layer included):")
                print(timed_checks.table(), flush=True)
            print("\n[multigpu] evenflow split layers vs the unsplit single-GPU reference (tolerance rule):",
                  flush=True)
            print(checks.table(), flush=True)
            status = 1 if checks.failed() or timed_checks.failed() or not checks.rows else 0
            print(f"[multigpu] {'FAIL' if status else 'PASS'} after {time.time() - args.t0:.0f}s", flush=True)
        dist.barrier()
    except BaseException:
        # Never wait on peers after a failure: print, write what rank 0 has, and leave at once
        # (torchrun ends the other ranks; their collectives time out otherwise).
        traceback.print_exc()
        if rank == 0:
            print(timed_checks.table() + "\n" + checks.table(), flush=True)
        finish_and_exit(state if rank == 0 else {}, 1)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
