"""Where one fused-MoE call's time goes: device time of each kernel it launches.

    python benchmarks/kernel_split.py [--cases qwen3-30b-a3b] [--variants bf16,fp8-tensor]
                                      [--batches 1,2] [--impls evenflow,sglang-triton] [--out DIR]

For each (case, variant, batch, impl) the call is run eagerly under ``torch.profiler``
(CUDA activity) ``--reps`` times with fresh weights copies rotated exactly as in
``benchmarks/moe.py`` (so no call finds its weights in L2), and each kernel's mean device
time per call is printed beside the sum (kernels of one name are summed: SGLang's two
``fused_moe_kernel`` launches, gate-up and down, are one row), and beside the call's CUDA-graph replay time: the
difference between the two is what the launches themselves cost (gaps between kernels).
Diagnostic evidence for the perf notes, not a result file of record.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as M  # noqa: E402  (benchmarks/moe.py: cases, weights, routing, impls)


def main(argv=None) -> None:
    from evenflow.bench import harness as H

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="qwen3-30b-a3b")
    p.add_argument("--variants", default="bf16,fp8-tensor")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--impls", default="evenflow,sglang-triton")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sglang-shim", default=None)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_split.py needs a CUDA GPU")
    dev = "cuda"
    out_rows = []
    for case_name, case, variant, gen, bias, copies in M.rotated_series(a.cases, a.variants, dev):
        for batch in (int(b) for b in a.batches.split(",")):
            inputs = [M.draw_call(batch, case, gen, bias, dev) for _ in copies]
            for impl in a.impls.split(","):
                try:
                    fns = [M.build_impl(impl, wc, case, a)(*inp) for wc, inp in zip(copies, inputs)]
                    rows, ksum = H.kernel_times(fns, a.reps)
                    graph_us = H.time_graph(fns)
                except Exception as e:  # a peer that cannot run is reported, not fatal
                    print(f"{case_name}/{variant} T={batch} {impl}: {type(e).__name__}: {e}"[:300])
                    continue
                print(f"\n{case_name}/{variant} T={batch} {impl}: {len(rows)} kernels, device sum "
                      f"{ksum:.1f} us, graph replay {graph_us:.1f} us")
                for name, t in rows:
                    print(f"    {t:8.2f} us  {name[:110]}")
                out_rows.append(dict(case=case_name, variant=variant, batch=batch, impl=impl,
                                     us=round(graph_us, 2), kernel_sum_us=round(ksum, 2),
                                     kernels=[[n, round(t, 2)] for n, t in rows]))
        del copies  # (rotated_series frees the series' memory before the next)
    if a.out:
        H.write_rows(a.out, "kernel_split.json", out_rows,
                     meta={"us": "graph replay of the call",
                           "kernel_sum_us": "sum of its kernels' profiled device times (eager, PDL)"})


if __name__ == "__main__":
    main()
