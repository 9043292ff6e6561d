"""sm_90 build statistics of the MoE layer's decode-batch launches, on a CPU (no GPU needed).

    TRITON_INTERPRET=1 python benchmarks/moe_decode_sass.py [--defer on|off|table] [--formats bf16,...]

For each case of benchmarks/moe.py and each weight format, the T = 1 and 2 configs of the tuned table
(the heuristic's where the table has none) are driven through ``fused_moe`` under
``evenflow._compile_check.emulate_gpu`` (the launches an H200 would get, recorded, not run), with the
gate-up's K-split reduction deferred to the down GEMM forced on (``--defer on``: the launches the tuner's
``+defer`` candidates make; a split of 2 where the config has none), off, or as the table says. Every
distinct gate-up and down launch is compiled for sm_90 and printed with its registers, spill and the
SASS of its main loop: instructions per trip and the MMA and special-function (MUFU) counts. This is the
check behind the deferred operand's cost (docs/perf-notes/moe.md, rounds P and Q).
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
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=1 (the launches are recorded by the interpreter, compiled for sm_90)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import evenflow
    import moe as B
    from evenflow._compile_check import compile_stats, emulate_gpu, record_launches
    from evenflow.moe import fused as F
    from evenflow.reference.moe import random_moe_weights

    e_small = 4  # the expert count changes no constexpr; real weight tensors would be gigabytes
    table = os.path.join(F.CONFIG_DIR, "h200.json")
    formats = [f for f in args.formats.split(",") if f]
    with emulate_gpu(132), record_launches() as launches:
        for case in B.CASES.values():
            h, i = case.hidden, case.inter
            for fmt, mode in (("bf16", 0), ("fp8_per_tensor", 1), ("fp8_block", 2)):
                if fmt not in formats or (mode == 2 and i % 128):
                    continue
                ew = random_moe_weights(fmt, e_small, h, i)
                for t in (1, 2):
                    kw = dict(num_experts_total=case.num_experts_total)
                    cfg = (F.tuned_config(t, case.top_k, case.num_local, h, i, mode, device=None, path=table, **kw)
                           or F.choose_config(t, case.top_k, case.num_local, h, i, mode, **kw))
                    if args.defer != "table":
                        on = args.defer == "on"
                        cfg = dataclasses.replace(cfg, gu_split_k=max(2, cfg.gu_split_k) if on else cfg.gu_split_k,
                                                  gu_defer=int(on))
                    print(f"{case.name} {fmt} T={t}: {cfg.as_list()}")
                    evenflow.fused_moe(torch.randn(t, h).bfloat16(),
                                       torch.randint(0, e_small, (t, case.top_k), dtype=torch.int32),
                                       torch.rand(t, case.top_k), ew, config=cfg)
    gemms = [la for la in launches if la.name in ("moe_gate_up_kernel", "moe_down_kernel")]
    print("\n| kernel | MODE | BLOCK_N | BLOCK_K | SPLIT_K | DEFER / GU_SPLIT | warps | regs | spill | loop instr "
          "| MMA | MUFU.EX2 |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
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
              f"| {loop['ops'].get('MUFU.EX2', 0)} |")


if __name__ == "__main__":
    main()
