"""Measure router GEMM configs on this GPU and write the dispatch table (data, not code).

    python benchmarks/tune_router.py [--quick] [--cases K4096-N192,...] [--table PATH]

For every standard (K, N) and each M bucket (upper bounds 1, 2, 4, 8, 16, 32, 64, 128,
256, 512, 1024, 2048, 4096, 8192; M above the last uses the last), times each candidate
at M = the bucket's upper bound as a CUDA-graph replay with rotated weight copies,
after checking it against the fp64 product; the plain paths (``torch-fp32``,
``torch-split2``) compete too and win a bucket only where they are measured faster.
Batch-invariant mode gets one config per (K, N): the candidate with the lowest
geometric-mean time over M in (1, 16, 128, 1024, 8192). Writes ``src/evenflow/router/configs/<gpu>.json``
(or ``--table``) and, when ``$OUT`` is set, a copy under ``$OUT/router-configs/``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import evenflow
from evenflow.bench import harness as H
from evenflow.reference import router as R
from evenflow.router.dispatch import GemmConfig

CASES = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
         "qwen3-30b-a3b": (2048, 128)}
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_BUCKETS = (1, 16, 128, 1024, 8192)
ROTATE_BYTES = 150 << 20


def candidates(m: int, n: int, k: int, sms: int) -> list[GemmConfig]:
    out = []
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        for bn in (32, 64):
            for bk in (128, 256):
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                for split in (1, 2, 4, 8, 16, 32, 64):
                    if split > 1 and (split * bk > k or tiles * split > 4 * sms):
                        continue
                    out.append(GemmConfig(bm, bn, bk, split, 4, 4))
    else:
        for bm, bn, warps in ((64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8)):
            tiles = math.ceil(m / bm) * math.ceil(n / bn)
            for stages in (3, 4):
                for split in (1, 2, 4, 8):
                    if split > 1 and (tiles >= sms or split * 64 * 2 > k):
                        continue
                    out.append(GemmConfig(bm, bn, 64, split, warps, stages))
    out += [GemmConfig(path="torch-fp32"), GemmConfig(path="torch-split2")]
    return out


def invariant_candidates(n: int, k: int) -> list[GemmConfig]:
    out = []
    for bm, bn, warps in ((64, 64, 4), (32, 64, 4), (64, 32, 4)):
        for split in (1, 2, 4, 8, 16):
            if split * 128 <= k:
                out.append(GemmConfig(bm, bn, 128, split, warps, 3))
    return out


def _time(cfg, xs, rws, outs, ref, inv=False) -> float | None:
    fns = [lambda x=x, rw=rw, o=o: evenflow.router_gemm(x, rw, o, batch_invariant=inv, config=cfg)
           for x, rw, o in zip(xs, rws, outs)]
    try:
        out = fns[0]()
        err = (out.double() - ref).abs().max().item()
        if not math.isfinite(err) or err > 1e-3:
            print(f"  reject {cfg}: max|err| {err:.2e}", flush=True)
            return None
        return H.time_graph(fns, reps=20)
    except Exception as e:  # a config that fails to compile (e.g. shared memory) is skipped, and said so
        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated case names")
    p.add_argument("--table", default=None, help="output JSON (default src/evenflow/router/configs/<gpu>.json)")


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    cases = args.cases.split(",") if args.cases else tuple(CASES)
    buckets = QUICK_BUCKETS if args.quick else BUCKETS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name(0)
    table_path = Path(args.table) if args.table else (
        Path(evenflow.router.__file__).parent / "configs" / f"{H.gpu_slug(name)}.json")
    table = json.loads(table_path.read_text()) if table_path.is_file() else {}
    entries = [e for e in table.get("entries", []) if (e["K"], e["N"]) not in {CASES[c] for c in cases}]
    invariant = [e for e in table.get("batch_invariant", []) if (e["K"], e["N"]) not in {CASES[c] for c in cases}]
    summary = []
    t0 = time.time()
    torch.manual_seed(0)
    for case in cases:
        k, n = CASES[case]
        inv_times: dict[GemmConfig, list[float]] = {c: [] for c in invariant_candidates(n, k)}
        for m in H.progress(buckets, f"tune {case}"):
            copies = max(1, min(16, math.ceil(ROTATE_BYTES / (n * k * 4 + m * k * 2))))
            ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
            rws = [evenflow.RouterWeight(w) for w in ws]
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            outs = [torch.empty(m, n, device="cuda") for _ in range(copies)]
            ref = R.router_logits_fp64(xs[0], ws[0])
            best = None
            for cfg in candidates(m, n, k, sms):
                us = _time(cfg, xs, rws, outs, ref)
                if us is not None and (best is None or us < best[1]):
                    best = (cfg, us)
            for cfg in inv_times if m in QUICK_BUCKETS else ():
                us = _time(cfg, xs, rws, outs, ref, inv=True)
                inv_times[cfg].append(us if us is not None else float("inf"))
            if best is None:
                print(f"  no working config for {case} M={m}", flush=True)
                continue
            entries.append({"K": k, "N": n, "m_max": m, "us": round(best[1], 3), "config": best[0].to_dict()})
            summary.append((case, m, best[0], best[1]))
            print(f"  best M={m}: {best[0]} {best[1]:.2f} us  (+{time.time() - t0:.0f}s)", flush=True)
            del ws, rws, xs, outs
            torch.cuda.empty_cache()
        scored = [(math.exp(sum(math.log(t) for t in ts) / len(ts)), c) for c, ts in inv_times.items()
                  if ts and all(math.isfinite(t) for t in ts)]
        if scored:
            g, cfg = min(scored, key=lambda s: s[0])
            invariant.append({"K": k, "N": n, "geomean_us": round(g, 3), "config": cfg.to_dict()})
    table = {"gpu": name, "sms": sms, "header": H.header(), "entries": entries, "batch_invariant": invariant}
    text = json.dumps(table, indent=1) + "\n"
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(text)
    if os.environ.get("OUT"):
        extra = Path(os.environ["OUT"]) / "router-configs"
        extra.mkdir(parents=True, exist_ok=True)
        (extra / table_path.name).write_text(text)
    print("\n| case | M <= | path | BM | BN | BK | split | warps | stages | us |")
    print("|---" * 10 + "|")
    for case, m, c, us in summary:
        print(f"| {case} | {m} | {c.path} | {c.block_m} | {c.block_n} | {c.block_k} | {c.split_k} | "
              f"{c.num_warps} | {c.num_stages} | {us:.2f} |")
    print(f"\nwritten: {table_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
