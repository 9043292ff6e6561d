"""Multi-GPU MoE (TP and EP) and TP attention: every rank checked against the unsplit layer, then timed.

One process per GPU (NCCL); on a CPU-only machine the same code runs over gloo at
tiny shapes through the Triton interpreter (checks only, nothing is timed):

    torchrun --nproc-per-node 8 benchmarks/multigpu.py --out benchmarks/results/h200-x8 [--quick]
    torchrun --nproc-per-node 2 benchmarks/multigpu.py --tiny        # CPU smoke run (gloo)

Layers (Hy3, ../reference shapes; BF16 weights):

* ``hy3-moe-tp`` — E192 top-8, H4096, I1536 split over the ranks (TP8: I/8 = 192 per rank),
  every rank holds every expert's slice; y = all_reduce(fused_moe(shard)).
* ``hy3-moe-ep`` — the same layer, experts split (EP8: 24 local experts of full I), global
  ids, ``ep_rank``; y = all_reduce(fused_moe(local experts)).
* ``tp8:<case>`` attention — decode attention of the TP head slice (64/8 heads over 8
  ranks: 8 q / 1 kv per rank), heads gathered only for the check (the o-projection that
  follows in a model owns the all-reduce).

Per layer and batch: each rank's all-reduced (gathered) output is checked against
the unsplit float64 layer with the tolerance rule (``evenflow.testing``; baseline =
PyTorch doing the same split math in bf16 / fp32, all-reduced by the same collective);
any rank failing makes the row an error row. Then per-layer latency as a CUDA-graph
replay (``us``: the max over ranks of each rank's median; ``us_min_rank`` beside it)
and eagerly (``eager_us``). For MoE rows, ``compute_us`` (fused MoE alone) and
``allreduce_us`` (the all-reduce of [batch, H] bf16 alone) are measured too.

Floors: MoE = per-rank max(bytes of the hit expert shards + activations / copy
bandwidth, FLOPs / bf16 rate) + all-reduce bytes (2 (n-1)/n * T*H*2 per rank) / the
measured NCCL bus bandwidth; attention = KV bytes of the live tokens of the head slice
+ q + o / copy bandwidth. Peers: SGLang's Triton fused MoE (``evenflow.bench.peers.sglang``)
with the same all-reduce; FlashInfer decode (``evenflow.bench.peers.flashinfer``) on
the same slice. A peer that cannot run becomes an ``error`` row.

NVLink multicast stays off: the environment of ``evenflow.parallel.NO_MULTICAST_ENV`` is
set before the process group exists, and no multicast API is called.
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from evenflow import parallel as par
from evenflow.reference.attention import decode_attention_ref_batched, shuffled_page_tables
from evenflow.reference.moe import moe_dense_reference

par.disable_multicast()  # before anything can create an NCCL communicator

HY3 = dict(experts=192, top_k=8, hidden=4096, inter=1536, q_heads=64, kv_heads=8, head_dim=128, page=64)
TINY = dict(experts=8, top_k=2, hidden=64, inter=64, q_heads=4, kv_heads=2, head_dim=64, page=16)
BATCHES = (1, 4, 16, 64, 256, 512, 1024, 4096)
QUICK_BATCHES = (4, 64, 512)
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


@dataclass
class MoELayout:
    name: str  # "tp" | "ep"
    w13: torch.Tensor  # this rank's shard
    w2: torch.Tensor
    ep_rank: int
    first_expert: int


def moe_layout(kind: str, w13, w2, rank: int, world: int) -> MoELayout:
    if kind == "tp":
        a, b = par.shard_moe_tp(w13, w2, rank, world)
        return MoELayout("tp", a, b, 0, 0)
    a, b = par.shard_moe_ep(w13, w2, rank, world)
    return MoELayout("ep", a, b, rank, rank * a.shape[0])


def moe_bind(impl: str, lay: MoELayout, shapes: dict, world: int):
    """(x, ids, tw, out) -> (layer fn, compute-only fn); PeerUnavailable when the impl cannot run."""
    from evenflow.bench.harness import PeerUnavailable

    ntot = shapes["experts"]
    if impl == "evenflow":
        import evenflow

        ew = evenflow.MoEWeights.bf16(lay.w13, lay.w2)

        def bind(x, ids, tw, out):
            compute = lambda: evenflow.fused_moe(x, ids, tw, ew, ep_rank=lay.ep_rank,  # noqa: E731
                                                 num_experts_total=ntot, out=out)
            return (lambda: par.all_reduce(compute())), compute
        return bind
    if impl == "sglang-triton":
        from evenflow.bench.peers.sglang import SGLangFusedMoE

        if not torch.cuda.is_available():
            raise PeerUnavailable("sglang-triton needs a CUDA GPU")
        peer = SGLangFusedMoE("bf16", lay.w13, lay.w2, ep_rank=lay.ep_rank,
                              num_experts_total=ntot if lay.name == "ep" else None)

        def bind(x, ids, tw, out):
            compute = peer.bind(x, ids, tw)
            return (lambda: par.all_reduce(compute())), compute
        return bind
    raise ValueError(f"unknown impl {impl!r}")


def moe_floor(lay: MoELayout, shapes: dict, ids: torch.Tensor, tokens: int, world: int, ceil: dict,
              busbw_GBps: float) -> float:
    """Per-rank weight-read/FLOP floor of the slowest rank plus the all-reduce byte floor, µs."""
    from evenflow.bench import harness as H

    h = shapes["hidden"]
    i_r = lay.w2.shape[2]
    e_r = lay.w13.shape[0]
    worst = 0.0
    for r in range(world):  # the layer ends when the most loaded rank ends
        first = r * e_r if lay.name == "ep" else 0
        local = ids.long() - first
        m = (local >= 0) & (local < e_r)
        distinct, pairs = int(torch.unique(local[m]).numel()), int(m.sum())
        nbytes = distinct * 3 * h * i_r * 2 + int(m.any(1).sum()) * h * 2 + tokens * h * 2 + ids.numel() * 8
        worst = max(worst, H.floor_us(nbytes, 6 * h * i_r * pairs, ceilings=ceil, rate="bf16_TFLOPs"))
    ar_bytes = 2 * (world - 1) / world * tokens * h * 2
    return worst + ar_bytes / (busbw_GBps * 1e3)


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
    return reduce_time(busbw, dev, dist.ReduceOp.MIN)


def run_moe(args, shapes, res, ceil, busbw, dev, rank, world, timing: bool) -> None:
    from evenflow.bench import harness as H
    from evenflow.testing import assert_within_rule

    log(f"[multigpu] building full MoE weights {shapes} on every rank")
    w13, w2 = make_moe_weights(shapes, dev, args.seed)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if timing else 0
    gen = torch.Generator().manual_seed(args.seed + 1)
    bias = torch.randn(shapes["experts"], generator=gen)
    layouts = [k for k in ("tp", "ep") if k in args.layouts]
    for kind in layouts:
        lay = moe_layout(kind, w13, w2, rank, world)
        case = f"hy3-moe-{kind}{world}" if not args.tiny else f"tiny-moe-{kind}{world}"
        # Weight copies so a small batch's working set is not timed out of L2 (same count on every rank).
        shard_bytes = 3 * shapes["hidden"] * lay.w2.shape[2] * 2  # one expert's shard
        hit_per_rank = min(lay.w13.shape[0], shapes["top_k"]) if kind == "tp" else 1
        n_copies = max(1, min(MAX_ROTATE, math.ceil(2 * l2 / (hit_per_rank * shard_bytes)))) if timing else 1
        copies = [lay] + [MoELayout(lay.name, lay.w13.clone(), lay.w2.clone(), lay.ep_rank, lay.first_expert)
                          for _ in range(n_copies - 1)]
        binders: dict = {}
        for impl in args.impls:
            try:
                binders[impl] = [moe_bind(impl, c, shapes, world) for c in copies]
                err = None
            except H.PeerUnavailable as e:
                err = f"unavailable: {e}"
            except Exception as e:
                err = _err(e)
            err = agree(err is None, err or "", dev)
            if err is not None:
                binders[impl] = err
        for batch in H.progress(args.batches, f"moe-{kind}") if rank == 0 else args.batches:
            inputs = []
            for _ in range(n_copies):
                ids, tw = make_routing(batch, shapes, gen, bias)
                x = torch.randn(batch, shapes["hidden"], generator=gen).bfloat16()
                inputs.append((x.to(dev), ids.to(dev), tw.to(dev)))
            x0, ids0, tw0 = inputs[0]
            ref = moe_dense_reference(x0, ids0, tw0, w13, w2, 0, torch.float64)  # the unsplit layer
            base = moe_dense_reference(x0, ids0, tw0, lay.w13, lay.w2, lay.first_expert,
                                       torch.bfloat16).to(torch.bfloat16)
            par.all_reduce(base)  # same split math in bf16, through the same collective
            fl = moe_floor(lay, shapes, ids0.cpu(), batch, world, ceil, busbw) if timing else None
            for impl in args.impls:
                row = dict(case=case, variant="bf16", impl=impl, batch=batch, layout=kind, ranks=world)
                if over_budget(args, dev):
                    if rank == 0:
                        res.add_error(error=f"skipped: time budget {args.budget_s:.0f}s spent", **row)
                    continue
                if isinstance(binders[impl], str):
                    if rank == 0:
                        res.add_error(error=binders[impl], **row)
                    continue
                outs = [torch.empty(batch, shapes["hidden"], dtype=torch.bfloat16, device=dev)
                        for _ in range(n_copies)]
                fns = [binders[impl][j](*inputs[j], outs[j]) for j in range(n_copies)]
                err, msg = None, ""
                try:
                    y = fns[0][0]()
                    err = assert_within_rule(y, ref, base, what=f"{case} {impl} batch {batch} rank {rank}")
                except Exception as e:
                    msg = _err(e)
                bad = agree(not msg, msg, dev)
                errs = [None] * world
                dist.all_gather_object(errs, err)
                if bad is not None:
                    if rank == 0:
                        res.add_error(error=bad, **row)
                    continue
                log(f"  {case} {impl} batch {batch}: every rank within the rule (max err {max(errs):.2e})")
                if not timing:
                    if rank == 0:
                        res.add_check(max_abs_err=max(errs), **row)
                    continue
                try:
                    timed = time_layer([f for f, _ in fns], dev)
                    compute = time_layer([c for _, c in fns], dev, eager=False)
                    ar = time_layer([(lambda o=o: par.all_reduce(o)) for o in outs], dev, eager=False)
                    msg = ""
                except Exception as e:
                    msg = _err(e)
                bad = agree(not msg, msg, dev)
                if rank == 0:
                    if bad is not None:
                        res.add_error(error=bad, **row)
                    else:
                        res.add(us=timed["us"], eager_us=timed["eager_us"], floor_us=fl,
                                us_min_rank=timed["us_min"], compute_us=compute["us"], allreduce_us=ar["us"],
                                max_abs_err=max(errs), rotated=n_copies, **row)
        del copies, binders
    del w13, w2


def time_layer(fns, dev, eager: bool = True) -> dict:
    """Graph-replay (and eager) median µs on every rank; max and min over ranks."""
    from evenflow.bench import harness as H

    dist.barrier()
    us = H.time_graph(fns)
    out = {"us": reduce_time(us, dev, dist.ReduceOp.MAX), "us_min": reduce_time(us, dev, dist.ReduceOp.MIN)}
    if eager:
        dist.barrier()
        out["eager_us"] = reduce_time(H.time_eager(fns, reps=20), dev, dist.ReduceOp.MAX)
    return out


# ----------------------------------------------------------------------------- attention (TP heads)

def attention_inputs(lengths, shapes, dev, seed: int):
    """Full-head q [B, Hq, D], caches [pages, P, Hkv, D] bf16 (shuffled pages), page table, lengths."""
    p, hq, hkv, d = shapes["page"], shapes["q_heads"], shapes["kv_heads"], shapes["head_dim"]
    tables, pool = shuffled_page_tables(lengths, p, generator=torch.Generator().manual_seed(seed))
    gd = torch.Generator(device=dev).manual_seed(seed)
    k = torch.randn(pool, p, hkv, d, generator=gd, device=dev).bfloat16()
    v = torch.randn(pool, p, hkv, d, generator=gd, device=dev).bfloat16()
    q = torch.randn(len(lengths), hq, d, generator=gd, device=dev).bfloat16()
    return q, k, v, tables[0].to(dev), torch.tensor(lengths, dtype=torch.int32, device=dev)


def attention_math(q, k, v, table, lens, dtype) -> torch.Tensor:
    """Plain paged decode attention (scale 1/sqrt(D)) in ``dtype``: the library's oracle."""
    return decode_attention_ref_batched(q, k, v, table, lens, dtype=dtype)[0]


def attention_bind(impl: str, q, k, v, table, lens, shapes):
    from evenflow.bench.harness import PeerUnavailable

    if impl == "evenflow":
        import evenflow

        plan = evenflow.DecodePlan(len(lens), table.shape[1] * shapes["page"], k.shape[2],
                                   page_size=shapes["page"], device=q.device)
        plan.update(lens)
        out = torch.empty_like(q)
        return lambda: evenflow.decode_attention(q, k, v, table, lens, plan=plan, out=out)
    if impl.startswith("flashinfer"):
        from evenflow.bench.peers import flashinfer as fi

        if not torch.cuda.is_available():
            raise PeerUnavailable("flashinfer needs a CUDA GPU")
        wrapper = fi.FlashInferDecode(impl, table, lens, num_q_heads=q.shape[1], num_kv_heads=k.shape[2],
                                      head_dim=q.shape[2], page_size=shapes["page"], q_dtype=q.dtype,
                                      kv_dtype=k.dtype, sm_scale=1.0 / math.sqrt(q.shape[2]))
        return wrapper.runner(q, k, v)
    raise ValueError(f"unknown impl {impl!r}")


def run_attention(args, shapes, res, ceil, dev, rank, world, timing: bool) -> None:
    from evenflow.bench import harness as H
    from evenflow.testing import assert_within_rule

    cases = TINY_ATT if args.tiny else {c: ATT_CASES[c] for c in args.att_cases}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if timing else 0
    for name, lengths in (H.progress(cases.items(), "attention") if rank == 0 else cases.items()):
        case = f"tp{world}:{name}"
        q, k, v, table, lens = attention_inputs(lengths, shapes, dev, args.seed + 7)
        ref = attention_math(q, k, v, table, lens, torch.float64)
        base = attention_math(q, k, v, table, lens, torch.float32).to(torch.bfloat16)
        q_r, k_r, v_r = par.shard_attention_heads(q, k, v, rank, world)
        del k, v
        hq_r, hkv_r, d = q_r.shape[1], k_r.shape[2], q_r.shape[2]
        nbytes = 2 * sum(lengths) * hkv_r * d * 2 + len(lengths) * hq_r * d * 4
        n_copies = max(1, min(MAX_ROTATE, math.ceil(3 * l2 / nbytes))) if timing else 1
        rot = [(q_r, k_r, v_r)] + [(q_r.clone(), k_r.clone(), v_r.clone()) for _ in range(n_copies - 1)]
        impls = ["evenflow"] + ([i for i in args.att_peers if i] if timing else [])
        for impl in impls:
            row = dict(case=case, variant="bf16-kv", impl=impl, ranks=world, heads=f"{hq_r}q/{hkv_r}kv")
            if over_budget(args, dev):
                if rank == 0:
                    res.add_error(error=f"skipped: time budget {args.budget_s:.0f}s spent", **row)
                continue
            fns, msg, err = [], "", None
            try:
                fns = [attention_bind(impl, a, b, c, table, lens, shapes) for a, b, c in rot]
                o = par.all_gather_heads(fns[0]().view(len(lengths), hq_r, d))
            except H.PeerUnavailable as e:
                msg, o = f"unavailable: {e}", None
            except Exception as e:
                msg, o = _err(e), None
            bad = agree(not msg, msg, dev)
            if bad is None:
                try:
                    err = assert_within_rule(o, ref, base, what=f"{case} {impl} rank {rank} gathered heads")
                except AssertionError as e:
                    msg = _err(e)
                bad = agree(not msg, msg, dev)
            if bad is not None:
                if rank == 0:
                    res.add_error(error=bad, **row)
                continue
            errs = [None] * world
            dist.all_gather_object(errs, err)
            log(f"  {case} {impl}: every rank within the rule (max err {max(errs):.2e})")
            if not timing:
                if rank == 0:
                    res.add_check(max_abs_err=max(errs), **row)
                continue
            try:
                timed = time_layer(fns, dev)
                msg = ""
            except Exception as e:
                timed, msg = None, _err(e)
            bad = agree(not msg, msg, dev)
            if rank == 0:
                if bad is not None:
                    res.add_error(error=bad, **row)
                else:
                    res.add(us=timed["us"], eager_us=timed["eager_us"], us_min_rank=timed["us_min"],
                            floor_us=H.floor_us(nbytes, ceilings=ceil), max_abs_err=max(errs),
                            rotated=n_copies, **row)
        del rot, q_r, k_r, v_r


# ----------------------------------------------------------------------------- driver

class CheckLog:
    """Rank 0's record of a run without timing (CPU / --tiny): checks only, failures fail the run."""

    def __init__(self):
        self.rows: list[dict] = []

    def add_check(self, **row) -> None:
        self.rows.append(row)

    def add_error(self, *, error: str, **row) -> None:
        self.rows.append(dict(row, error=error))
        print(f"  FAILED {row}: {error}", flush=True)

    def report(self, world: int) -> int:
        bad = [r for r in self.rows if "error" in r]
        for r in self.rows:
            print(f"  {'FAILED' if 'error' in r else 'ok'} {r}")
        print(f"[multigpu] {len(self.rows) - len(bad)} of {len(self.rows)} checks passed on {world} ranks "
              "(nothing timed without CUDA)", flush=True)
        return 1 if bad or not self.rows else 0


def _csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v]


def _extra_args(p):
    p.add_argument("--tiny", action="store_true", help="tiny shapes, checks only (automatic without CUDA)")
    p.add_argument("--layouts", type=_csv(str), default=["tp", "ep"], help="MoE layouts: tp,ep (empty: none)")
    p.add_argument("--batches", type=_csv(int), default=None, help="comma list of token counts")
    p.add_argument("--impls", type=_csv(str), default=["evenflow", "sglang-triton"], help="MoE impls")
    p.add_argument("--att-cases", type=_csv(str), default=None, help="comma list of " + ",".join(ATT_CASES))
    p.add_argument("--att-peers", type=_csv(str), default=["flashinfer-cuda", "flashinfer-tc"],
                   help="attention peers (flashinfer-cuda, flashinfer-tc, flashinfer-fa3; empty: none)")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("EVENFLOW_BENCH_BUDGET_S", 480)),
                   help="stop timing after this many seconds; the rest become error rows (results still written)")


def main(argv=None) -> int:
    from evenflow.bench import harness as H

    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_extra_args)
    args.t0 = time.time()
    if "RANK" not in os.environ:
        sys.exit("run under torchrun, one process per GPU: torchrun --nproc-per-node N benchmarks/multigpu.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    timing = cuda and not args.tiny
    args.tiny = args.tiny or not cuda
    if not timing:  # peers need a GPU; a check-only run proves our code paths
        args.impls = [i for i in args.impls if i == "evenflow"]
    shapes = TINY if args.tiny else HY3
    args.batches = args.batches or ((3, 9) if args.tiny else QUICK_BATCHES if args.quick else BATCHES)
    args.att_cases = args.att_cases or list(QUICK_ATT if args.quick else ATT_CASES)
    for c in args.att_cases:
        if c not in ATT_CASES:
            sys.exit(f"--att-cases: unknown case {c!r} (choose from {', '.join(ATT_CASES)})")
    log(f"[multigpu] {world} ranks, backend {dist.get_backend()}, timing {timing}, "
        f"multicast env {par.NO_MULTICAST_ENV}")
    status = 0
    try:
        if timing:
            ceil = H.measure_ceilings(verbose=rank == 0)
            ceil["nccl_busbw_GBps"] = round(measure_busbw(dev, world), 1)
            log(f"[multigpu] NCCL all-reduce bus bandwidth {ceil['nccl_busbw_GBps']} GB/s")
            out = args.out or Path(__file__).resolve().parent / "results" / f"{H.gpu_slug()}-x{world}"
            res = H.Results("multigpu", ceilings=ceil, out=out, meta={
                "ranks": world, "shapes": shapes, "multicast_env": par.NO_MULTICAST_ENV,
                "us": "max over ranks of each rank's CUDA-graph replay median (layer incl. all-reduce)",
                "floor": "MoE: slowest rank's max(bytes/copy, flops/bf16) + 2(n-1)/n*T*H*2 B / NCCL busbw; "
                         "attention: live KV of the head slice + q + o / copy"}) if rank == 0 else None
        else:
            ceil, res = {}, CheckLog()
        if args.layouts:
            run_moe(args, shapes, res, ceil, ceil.get("nccl_busbw_GBps"), dev, rank, world, timing)
        if not args.no_attention:
            run_attention(args, shapes, res, ceil, dev, rank, world, timing)
        if rank == 0:
            if timing:
                res.finish(x="batch", group="case", plot=not args.no_plot,
                           columns=["case", "impl", "batch", "us", "eager_us", "compute_us", "allreduce_us",
                                    "floor_us", "frac_of_floor", "max_abs_err", "error"])
            else:
                status = res.report(world)
    except Exception:
        traceback.print_exc()
        status = 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
