"""What sets the small-M router kernel's time: an SM's intake or the split-K reduction? (round BH probe)

Round BH's CPU table (history/round-bh-cpu/) fits the fp32-splitk tuner timings at M = 16 to
``t ~ t0 + (bytes into the busiest SM) / r`` with r ~ 50 GB/s an SM, plus 1.1-3.5 us for a K split. Three
sweeps on the CUDA-core kernel (``fp32-splitk``, graph replay, rotated copies as the tuner times):

  intake: one 4 x 2 x 1024 tile a program, M = 4, N = 264 / 528 / 792 (132 / 264 / 396 programs: 1, 2, 3 an
          SM), K = 1024-8192; a program reads 16 B a K element (2 fp32 weight columns, 4 bf16 rows of x). If an
          SM's intake sets the time, it grows with the bytes an SM reads, whichever way they come; if each
          program's own chain does, 2 or 3 programs an SM cost no more than one.
  rows:   the same tile at K = 4096, N = 192, M = 4 / 8 / 12 / 16: 96 column tiles, 1-4 row tiles over the grid,
          so the weight's DRAM bytes stay the same while the bytes the busiest SM reads from L2 grow, 64 / 128 /
          192 / 192 KB (1, 2, 3 and 3 programs there: the weight columns again for every row tile, x once a
          program). The intake sweep cannot tell an SM's intake from the DRAM
          rate (each program there reads its own weight columns); this one can.
  chain:  4 x 2 x 64 tiles (one K step a split), M = 4, N = 192, K = 64 x s for s = 1, 2, 4, 8, 16 splits: the
          bytes are negligible, so the time over s = 1 is the reduction's (partial store, counter, last
          program's loads).

    python benchmarks/probe_router_chain.py [--out DIR]

Prints a table and writes ``probe_router_chain.json`` in the BENCH.md schema (default folder: the results'
``sweeps/``): a row a point, impl ``evenflow-fp32splitk``, the router benchmark's floor (the bytes a call moves at
the copy rate plus an empty kernel's launch), and sweep, M, N, K, split, programs and KB into the busiest SM. Rounds
BH3 / BH4 ran it in earlier forms: the same points, a raw JSON and a looser error check.
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import evenflow  # noqa: E402
import router as bench  # noqa: E402  (the router benchmark's bytes a call moves and its rotation size)
import tune_router as tuner  # noqa: E402  (its timing: graph replay after a check against the tests' rule)
from evenflow.bench import harness as H  # noqa: E402
from evenflow.reference import router as R  # noqa: E402
from evenflow.router.dispatch import GemmConfig  # noqa: E402
from evenflow.router.gemm import launch_shape  # noqa: E402
from evenflow.testing import error_bound  # noqa: E402


def _time(m: int, n: int, k: int, cfg: GemmConfig) -> float:
    """Median µs of ``cfg`` as the tuner times it: rotated copies, checked against the fp64 product first."""
    ws, xs = bench.rotated_copies(m, n, k, min_copies=2)
    rws = [evenflow.RouterWeight(w) for w in ws]
    outs = [torch.empty(m, n, device="cuda") for _ in ws]
    ref = R.router_logits_fp64(xs[0], ws[0])
    us = tuner._time(cfg, xs, rws, outs, ref, error_bound(ref, R.split_logits_fp32(xs[0], *rws[0].parts),
                                                          torch.float32))
    if us is None:
        raise SystemExit(f"{cfg} M={m} N={n} K={k}: rejected (see above)")
    return us


FAT = GemmConfig(4, 2, 1024, 1, 4, 5, "fp32-splitk")


def sweeps(sms: int) -> list[tuple[str, int, int, int, GemmConfig]]:
    """(sweep, M, N, K, config) of every point, in the order they run."""
    out = [("intake", 4, 2 * sms * per_sm, k, FAT) for per_sm in (1, 2, 3) for k in (1024, 2048, 4096, 8192)]
    out += [("rows", m, 192, 4096, FAT) for m in (4, 8, 12, 16)]
    out += [("chain", 4, 192, 64 * s, GemmConfig(4, 2, 64, s, 4, 3, "fp32-splitk")) for s in (1, 2, 4, 8, 16)]
    return out


def kb_into_busiest_sm(m: int, n: int, k: int, cfg: GemmConfig, sms: int) -> float:
    """KB the busiest SM reads when the launch's programs are dealt evenly: a program reads its x rows (bf16) and
    its fp32 weight columns over its K slice."""
    k_split, split, grid = launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
    programs = grid[0] * grid[1]
    return math.ceil(programs / sms) * (cfg.block_m * 2 + cfg.block_n * 4) * k_split / 1024


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0])
    if not torch.cuda.is_available():
        raise SystemExit("probe_router_chain needs a CUDA GPU")
    ceil = H.measure_ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = H.Results("probe_router_chain", ceilings=ceil, out=args.out or H.results_dir(None) / "sweeps")
    for sweep, m, n, k, cfg in sweeps(sms):
        us = _time(m, n, k, cfg)
        _, split, grid = launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
        kb = kb_into_busiest_sm(m, n, k, cfg, sms)
        # the router benchmark's floor: the bytes a call moves at the copy rate, plus an empty kernel's launch
        floor = H.floor_us(bytes_moved=bench._call_bytes(m, n, k), ceilings=ceil, extra_us=ceil["launch_us"])
        res.add(case=f"{sweep}:M{m}-N{n}-K{k}", variant=f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-split{split}",
                impl="evenflow-fp32splitk", us=us, floor_us=floor, M=m, N=n, K=k, sweep=sweep, split=split,
                programs=grid[0] * grid[1], kb_busiest_sm=kb)
        print(f"{sweep:7s} M={m:2d} N={n:4d} K={k:5d} split {split:2d} {grid[0] * grid[1]:5d} programs "
              f"{kb:5.0f} KB into the busiest SM  {us:7.3f} us", flush=True)
    res.finish(plot=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
