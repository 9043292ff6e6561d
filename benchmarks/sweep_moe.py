"""Sweep fused_moe tile configs on a few points (one GPU run): which config wins where.

    python benchmarks/sweep_moe.py [--quick] [--out DIR] [--index-only] [--only hy3-tp8/fp8,fp8-block/1]
                                   [--index-batches 1,2,8,...]

Most of the time is Triton compiling each config (a few s per config); ``--quick`` keeps 6
configs per point, ``--only`` selects points by substring of ``case/variant/batch``.

Points: Qwen3 bf16 batch 1 (weight streaming, split-K), Hy3 EP8 bf16 batch 32,
Qwen3 bf16 batch 1024 (large tiles), the FP8 batch-1 split-K points (Hy3 TP8
fp8 per-tensor, Hy3 EP8 / Qwen3 fp8-block), Qwen3 fp8-block batch 2, fp8 at batch 512
(Hy3 TP8 per-tensor, Qwen3 block: 64-row wgmma tiles vs 32-row mma.sync). Each config
is checked against the fp32 reference, then graph-timed with rotated weight copies;
``default`` is what ``choose_config`` picks. The index build is timed alone too,
one-program (``index-1prog``) against the two-launch build (``index-multi``),
at every point.

``--index-only``: only the index build, alone in a CUDA graph, for Qwen3 (128 experts),
Hy3 TP8 (192 local experts: E_PAD 256) and Hy3 EP8 (24 of 192) at T = 1 ... 4096
(``--index-batches``), both builds at every T (``default`` marks the one ``fused_moe``
takes), with the benchmark's routing (biased, seed 0), the ``block_m`` and split-K
counter workspace that ``choose_config`` gives that call; writes <out>/moe_index.json and
prints a T x (case, build) table last. Otherwise: <out>/moe_sweep.json (+ md table).
Use them to retune ``choose_config`` and ``evenflow.moe.routing.MULTI_PROGRAM_PAIRS``.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as B  # noqa: E402  (benchmarks/moe.py: cases, weights, routing, floor)

POINTS = [("qwen3-30b-a3b", "bf16", 1), ("hy3-ep8", "bf16", 32), ("qwen3-30b-a3b", "bf16", 1024),
          ("hy3-tp8", "fp8-tensor", 1), ("hy3-ep8", "fp8-block", 1), ("qwen3-30b-a3b", "fp8-block", 1),
          ("qwen3-30b-a3b", "fp8-block", 2), ("hy3-tp8", "fp8-tensor", 512), ("qwen3-30b-a3b", "fp8-block", 512)]
INDEX_CASES = ("qwen3-30b-a3b", "hy3-tp8", "hy3-ep8")
INDEX_BATCHES = (1, 2, 8, 32, 64, 128, 256, 512, 1024, 4096)
INDEX_BUILDS = (("index-1prog", False), ("index-multi", True))


def index_call(case: B.MoECase, ids: torch.Tensor, t: int, multi_program: bool | None):
    """A zero-argument call of the index build as ``fused_moe`` makes it at batch t (bf16 config:
    its block_m and, with split-K, the counter workspace the build zeroes)."""
    from evenflow.moe.fused import choose_config
    from evenflow.moe.routing import build_moe_index, max_tiles

    cfg = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, 0,
                        num_experts_total=case.num_experts_total)
    zero = None
    if cfg.gu_split_k > 1:
        n = max_tiles(ids.numel(), case.num_local, cfg.block_m) * (case.inter // cfg.gu_block_n)
        zero = torch.zeros(n, dtype=torch.int32, device=ids.device)
    return lambda: build_moe_index(ids, case.num_local, case.ep_rank, cfg.block_m, zero=zero,
                                   multi_program=multi_program)


def index_table(rows: list[dict]) -> str:
    """Markdown: one line per T, one column per (case, build); * marks the build fused_moe takes."""
    cols = [(c, b) for c in INDEX_CASES for b, _ in INDEX_BUILDS]
    ts = sorted({r["batch"] for r in rows})
    cell = {(r["case"], r["variant"], r["batch"]): r for r in rows}
    head = "| T | " + " | ".join(f"{c.split('-')[0] if c.startswith('qwen') else c} {b[6:]}" for c, b in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for t in ts:
        vals = []
        for c, b in cols:
            r = cell.get((c, b, t))
            vals.append("" if r is None else r.get("error", "")[:12] if "us" not in r else
                        f"{r['us']:.1f}{'*' if r.get('default') else ''}")
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def run_index_only(args) -> None:
    """Time the two index builds alone (graph replay) over cases x batches; see the module docstring."""
    from evenflow.bench import harness as H
    from evenflow.moe.routing import MULTI_PROGRAM_PAIRS

    batches = [int(v) for v in args.index_batches.split(",") if v]
    res = H.Results("moe_index", ceilings=H.measure_ceilings(), out=args.out,
                    meta={"what": "build_moe_index alone, CUDA-graph replay (8 calls per graph), median us",
                          "routing": "benchmarks/moe.py make_routing: softmax(N(0,1) + fixed N(0,1) expert bias), "
                                     "seed 0 per case",
                          "default": f"fused_moe takes index-multi above {MULTI_PROGRAM_PAIRS} pairs"})
    for name in H.progress(INDEX_CASES, "index build"):
        case = B.CASES[name]
        gen = torch.Generator(device="cpu").manual_seed(0)
        bias = B.expert_bias(case.num_experts_total, gen)
        for t in batches:
            ids, _ = B.make_routing(t, case, gen, bias)
            ids = ids.cuda()
            stats = B.routing_stats(ids, case)
            for label, multi in INDEX_BUILDS:
                common = dict(case=name, variant=label, impl="evenflow", batch=t, pairs=ids.numel(),
                              local_pairs=stats.local_pairs, default=multi == (ids.numel() > MULTI_PROGRAM_PAIRS))
                try:
                    us = H.time_graph([index_call(case, ids, t, multi)])
                except Exception as e:  # a build that fails is a row, not the end of the sweep
                    res.add_error(error=f"{type(e).__name__}: {e}"[:200], **common)
                    continue
                res.add(us=us, **common)
    res.finish(x="batch", group="case", plot=not args.no_plot,
               columns=["case", "variant", "batch", "pairs", "us", "default", "error"])
    print("\n## index build alone, us (graph replay; * = the build fused_moe takes)\n\n"
          + index_table(res.rows), flush=True)


def configs(case: B.MoECase, variant: str, t: int, quick: bool = False):
    """(label, MoEConfig) pairs to try at one point; the first is the default."""
    from evenflow.moe.fused import choose_config

    mode = {"bf16": 0, "fp8-tensor": 1, "fp8-block": 2}[variant]
    d = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, mode,
                      num_experts_total=case.num_experts_total)
    out = [("default", d)]
    r = dataclasses.replace
    if t <= 32:
        for gs in (1, 2, 4, 8, 16):
            for ds in (1, 2, 4):
                out.append((f"gs{gs}-ds{ds}", r(d, gu_split_k=gs, down_split_k=ds)))
        out.append(("gs-default-st4", r(d, num_stages=4)))
        if mode != 2:
            out.append(("gn32", r(d, gu_block_n=32)))
        else:
            out.append(("dn128", r(d, down_block_n=128)))
    else:
        for bm in (32, 64, 128):
            for bn in (64, 128):
                for nw in (4, 8):
                    out.append((f"bm{bm}-bn{bn}-w{nw}", r(d, block_m=bm, gu_block_n=bn, down_block_n=bn,
                                                        num_warps=nw, gu_split_k=1, down_split_k=1)))
        out.append(("bm64-bn128-w8-st4", r(d, block_m=64, gu_block_n=128, down_block_n=128, num_warps=8,
                                           num_stages=4, gu_split_k=1, down_split_k=1)))
    valid = []
    from evenflow.moe.fused import check_config
    for label, c in out:
        try:
            check_config(c, case.hidden, case.inter, mode)
        except ValueError:
            continue
        valid.append((label, c))
    return valid[:6] if quick else valid


def main() -> None:
    import evenflow
    from evenflow.bench import harness as H

    def extra(p):
        p.add_argument("--index-only", action="store_true", help="time only the index builds")
        p.add_argument("--index-batches", default=",".join(map(str, INDEX_BATCHES)),
                       help="--index-only: comma-separated batches")
        p.add_argument("--only", default="", help="comma-separated substrings: sweep only matching points")

    args = H.parse_args(__doc__.splitlines()[0], extra=extra)
    if args.index_only:
        run_index_only(args)
        return
    wanted = [w for w in args.only.split(",") if w]
    points = [pt for pt in POINTS if not wanted or any(w in "/".join(map(str, pt)) for w in wanted)]
    ceil = H.measure_ceilings()
    res = H.Results("moe_sweep", ceilings=ceil)
    gen = torch.Generator(device="cpu").manual_seed(0)  # routing, activations (CPU, then moved)
    wgen = torch.Generator(device="cuda").manual_seed(0)  # weights are drawn on the GPU

    def time_index(pt, case, ids, t):
        for label, multi in INDEX_BUILDS:
            res.add(case=pt, variant=label, impl="evenflow", us=H.time_graph([index_call(case, ids, t, multi)]),
                    floor_us=None)

    for name, variant, t in points:
        case = B.CASES[name]
        raw = B.make_weights(case, variant, "cuda", wgen)
        bias = B.expert_bias(case.num_experts_total, gen)
        if variant == "fp8-tensor":
            B.calibrate_static_scales(raw, case, "cuda", gen, bias)
        ids, tw = B.make_routing(t, case, gen, bias)
        stats = B.routing_stats(ids, case)
        nbytes, flops = B.floor_work(case, variant, t, stats)
        rate = "bf16_TFLOPs" if variant == "bf16" else "fp8_TFLOPs"
        floor = H.floor_us(bytes_moved=nbytes, flops=flops, ceilings=ceil, rate=rate)
        n_rot = B.rotations(stats.distinct_experts * B.expert_bytes(case, variant), 60 * 2**20)
        copies = [raw] + [raw.clone() for _ in range(n_rot - 1)]
        ews = []
        for w in copies:
            if variant == "bf16":
                ews.append(evenflow.MoEWeights.bf16(w.w13, w.w2))
            elif variant == "fp8-tensor":
                ews.append(evenflow.MoEWeights.fp8_per_tensor(w.w13, w.w2, w.w13_scale, w.w2_scale,
                                                              w.a13_scale, w.a2_scale))
            else:
                ews.append(evenflow.MoEWeights.fp8_block(w.w13, w.w2, w.w13_scale, w.w2_scale))
        x = torch.randn(t, case.hidden, generator=gen).bfloat16().cuda()
        ids, tw = ids.cuda(), tw.cuda()
        ref = B.reference_moe(x, ids, tw, raw, case)
        pt = f"{name}/{variant}/T{t}"
        time_index(pt, case, ids, t)
        for label, cfg in H.progress(configs(case, variant, t, args.quick), pt):
            fns = [lambda ew=ew, c=cfg: evenflow.fused_moe(x, ids, tw, ew, ep_rank=case.ep_rank,
                                                           num_experts_total=case.num_experts_total, config=c)
                   for ew in ews]
            try:
                H.check_output(fns[0](), ref, f"{pt} {label}")
                us = H.time_graph(fns)
            except Exception as e:  # a config that fails is a row, not the end of the sweep
                res.add_error(case=pt, variant=label, impl="evenflow", error=f"{type(e).__name__}: {e}"[:200])
                continue
            res.add(case=pt, variant=label, impl="evenflow", us=us, floor_us=floor, config=str(cfg))
    res.finish(x="case", group="variant")


if __name__ == "__main__":
    main()
