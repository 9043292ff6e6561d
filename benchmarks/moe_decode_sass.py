"""sm_90 build statistics of the MoE layer's GEMM launches, on a CPU (no GPU needed).

    TRITON_INTERPRET=1 python benchmarks/moe_decode_sass.py [--defer on|off|table] [--formats bf16,...]
        [--batches 1,2] [--configs table|heuristic] [--persistent N] [--experts 4|real]

For each case of benchmarks/moe.py and each weight format, the configs of the tuned table at each batch
(default T = 1 and 2; the heuristic's where the table has none, or everywhere with ``--configs heuristic``)
are driven through ``fused_moe`` under
``evenflow._compile_check.emulate_gpu`` (the launches an H200 would get, recorded, not run), with the
gate-up's K-split reduction deferred to the down GEMM forced on (``--defer on``: the launches the tuner's
``+defer`` candidates make; a split of 2 where the config has none), off, or as the table says, and with
``--persistent N`` the persistent GEMMs (``fused_moe(persistent=N)``, where a GEMM runs index tiles
without a K split). Every distinct gate-up and down launch is compiled for sm_90 and printed with its
registers, spill, the SASS of its main loop (instructions per trip, MMA and special-function (MUFU)
counts) and its shared memory. This is the check behind the deferred operand's cost and the persistent
loops' build (docs/perf-notes/moe.md, rounds P, Q and T).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--defer", choices=("on", "off", "table"), default="on")
    p.add_argument("--formats", default="bf16,fp8_per_tensor,fp8_block")
    p.add_argument("--batches", default="1,2", help="comma-separated token counts")
    p.add_argument("--configs", choices=("table", "heuristic"), default="table")
    p.add_argument("--persistent", type=int, default=None, help="fused_moe(persistent=N); default: the config's")
    p.add_argument("--experts", default="4", help="local experts of the weights built: a count, or 'real' (the "
                   "case's; the persistent loops' E_PAD follows it, nothing else does; real weights take GBs)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=1 (the launches are recorded by the interpreter, compiled for sm_90)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import evenflow
    import moe as B
    from evenflow._compile_check import compile_stats, emulate_gpu, record_launches
    from evenflow.moe import fused as F
    from evenflow.reference.moe import random_moe_weights

    # the expert count changes no constexpr but the persistent loops' E_PAD; real weight tensors are gigabytes
    table = os.path.join(F.CONFIG_DIR, "h200.json")
    formats = [f for f in args.formats.split(",") if f]
    with emulate_gpu(132), record_launches() as launches:
        for case in B.CASES.values():
            h, i = case.hidden, case.inter
            for fmt, mode in (("bf16", 0), ("fp8_per_tensor", 1), ("fp8_block", 2)):
                if fmt not in formats or (mode == 2 and i % 128):
                    continue
                e_loc = case.num_local if args.experts == "real" else int(args.experts)
                ew = random_moe_weights(fmt, e_loc, h, i)
                for t in (int(b) for b in args.batches.split(",") if b):
                    kw = dict(num_experts_total=case.num_experts_total)
                    tuned = args.configs == "table" and F.tuned_config(t, case.top_k, case.num_local, h, i, mode,
                                                                         device=None, path=table, **kw)
                    cfg = tuned or F.choose_config(t, case.top_k, case.num_local, h, i, mode, **kw)
                    if args.defer != "table":
                        on = args.defer == "on"
                        cfg = dataclasses.replace(cfg, gu_split_k=max(2, cfg.gu_split_k) if on else cfg.gu_split_k,
                                                  gu_defer=int(on))
                    print(f"{case.name} {fmt} T={t}: {cfg.as_list()}")
                    evenflow.fused_moe(torch.randn(t, h).bfloat16(),
                                       torch.randint(0, e_loc, (t, case.top_k), dtype=torch.int32),
                                       torch.rand(t, case.top_k), ew, config=cfg,
                                       **({} if args.persistent is None else {"persistent": args.persistent}))
    gemms = [la for la in launches if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
    print("\n| kernel | MODE | BLOCK_N | BLOCK_K | SPLIT_K | DEFER / GU_SPLIT | warps | regs | spill | loop instr "
          "| MMA | MUFU.EX2 | BLOCK_M | stages | PERSIST | shared KB | 2nd loop instr |\n" + "|---" * 17 + "|")
    for s in compile_stats(gemms):
        if "error" in s:
            print(f"| {s['describe'][:80]} | error: {s['error'][:120]} |")
            continue
        c = dict(re.findall(r"(\w+)=(\w+)", s["describe"]))
        loop = s["loops"][0] if s["loops"] else {"instructions": 0, "ops": {}}
        mma = sum(v for k, v in loop["ops"].items() if k.startswith(("HMMA", "HGMMA")))
        kern = "gate-up" if "gate_up" in s["describe"] else "down"
        split = c.get("DEFER") if kern == "gate-up" else c.get("GU_SPLIT")
        print(f"| {kern} | {c['MODE']} | {c['BLOCK_N']} | {c['BLOCK_K']} | {c['SPLIT_K']} | {split} | {c['num_warps']} "
              f"| {s['regs']} | {s['spill_bytes']} | {loop['instructions']} | {mma} "
              f"| {loop['ops'].get('MUFU.EX2', 0)} | {c['BLOCK_M']} | {c['num_stages']} | {c.get('PERSIST', '-')} "
              f"| {s['shared'] / 1024:g} | {s['loops'][1]['instructions'] if len(s['loops']) > 1 else '-'} |")


if __name__ == "__main__":
    main()
