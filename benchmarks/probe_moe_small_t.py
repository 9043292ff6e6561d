"""Probe: the fp8 layers at small batches on e4m3 MMAs (64-row warpgroup tiles) against the exact default.

    python benchmarks/probe_moe_small_t.py [--cases qwen3-30b-a3b,hy3-tp8,hy3-ep8] [--variants fp8-tensor,fp8-block]
                                           [--batches 1,4,16,64] [--out DIR]

Round BJ1 read the default (exact) fp8 GEMMs at T <= 64 as held by the instructions their K loops issue a byte (each
e4m3 weight converted to f16 for ``mma.sync``, the A tile converted by every warp), not by DRAM (BJ5 later put most of
their distance from the copy rate on each GEMM's size instead; docs/perf-notes/moe.md, "Round BJ"). The fp8-MMA modes
(``fp8_accum="fast"`` / ``"promoted"``) take the same 16-row ``mma.sync`` tiles there (Triton lowers an fp8 dot of
fewer than 64 rows to f16 products), so they were never faster at small T. This probe times, at the benchmark's
points (its weights, routing draws, weight copies rotated, CUDA-graph replay), each point's layer as:

- ``exact``: the default (the table's config);
- ``promoted`` / ``fast``: those modes with their own table or heuristic config (16-row tiles at small T);
- ``promoted-bm64`` / ``fast-bm64``: the same modes on 64-row index tiles, one warpgroup, no K split, so every dot is
  an e4m3 ``wgmma`` (no conversion in the loop), 128-deep K steps (64 where I is not a multiple of 128: the down
  GEMM of Hy3 TP8), gate-up N blocks 64 wide (block mode's 128), down 64;

and checks each output against the default's tolerance rule (``evenflow.reference.moe.moe_rule_terms`` with the
exact mode's baseline: the rule the issue's default must meet), printing the error over the rule's bound.
A diagnostic for the perf notes: its JSON is not a result file of record.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as M  # noqa: E402  (benchmarks/moe.py: cases, weights, routing)

VARIANTS = ("exact", "promoted", "fast", "promoted-bm64", "fast-bm64")


def bm64_config(case, ew, t: int, accum: str):
    """64-row index tiles on one warpgroup, no K split: every dot of the fp8-MMA modes an e4m3 wgmma."""
    from evenflow.moe.fused import check_config, choose_config

    d = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, ew.mode,
                      num_experts_total=case.num_experts_total, fast_acc=True)
    cfg = dataclasses.replace(d, block_m=64, num_warps=4, num_stages=3, gu_block_k=128,
                              down_block_k=128 if case.inter % 128 == 0 else 64,
                              gu_block_n=128 if ew.mode == 2 else 64, down_block_n=64, gu_split_k=1,
                              down_split_k=1, gu_defer=0, persistent=0, down_n_group=1, index_tiles=1)
    check_config(cfg, case.hidden, case.inter, ew.mode, fast_acc=accum != "exact")
    return cfg


def main(argv=None) -> None:
    import evenflow
    from evenflow.bench import harness as H
    from evenflow.reference.moe import moe_rule_terms
    from evenflow.testing import rule_check

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="qwen3-30b-a3b,hy3-tp8,hy3-ep8")
    p.add_argument("--variants", default="fp8-tensor,fp8-block")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--impls", default=",".join(VARIANTS))
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_moe_small_t.py needs a CUDA GPU")
    dev = "cuda"
    rows = []
    for case_name, case, variant, gen, bias, copies in M.rotated_series(a.cases, a.variants, dev):
        holders = [c.holder() for c in copies]
        kw = dict(ep_rank=case.ep_rank, num_experts_total=case.num_experts_total)
        for t in (int(b) for b in a.batches.split(",")):
            inputs = [M.draw_call(t, case, gen, bias, dev) for _ in copies]
            ref, bl, allow = moe_rule_terms(*inputs[0], holders[0], **kw)
            line = []
            for impl in a.impls.split(","):
                accum = impl.split("-")[0]
                call_kw = dict(kw, fp8_accum=accum)
                if impl.endswith("-bm64"):
                    call_kw["config"] = bm64_config(case, holders[0], t, accum)
                fns = [(lambda ew=ew, inp=inp, ckw=call_kw: evenflow.fused_moe(*inp, ew, **ckw))
                       for ew, inp in zip(holders, inputs)]
                out = fns[0]()
                msg, err, bound = rule_check(out, ref, bl, allowance=allow)
                us = H.time_graph(fns)
                rows.append(dict(case=case_name, variant=variant, batch=t, impl=impl, us=round(us, 3),
                                 max_abs_err=err, rule_bound=bound, rule_ok=not msg))
                # no local pair (expert parallelism at T = 1): the layer is zeros and the bound 0
                rel = f"{err / bound:5.2f}" if bound > 0 else f"{err:.1e} (bound 0)"
                line.append(f"{impl} {us:7.2f} us err/bound {rel}{'' if not msg else ' FAIL'}")
            print(f"{case_name}/{variant} T={t}: " + " | ".join(line), flush=True)
        del copies, holders  # (rotated_series frees the series' memory before the next)
    if a.out:
        H.write_rows(a.out, "probe_moe_small_t.json", rows)


if __name__ == "__main__":
    main()
