"""Measure fused_moe tile configs on this GPU and write the per-shape config table (data, not code).

    python benchmarks/tune_moe.py [--quick] [--budget-s 200] [--cases qwen3-30b-a3b,hy3-ep8]
                                  [--formats bf16,fp8-tensor,fp8-block] [--table PATH]

For each case (default: Qwen3-30B-A3B), weight format and batch bucket (1, 2, 4, ..., 1024, 4096;
a call uses the largest bucket <= its batch, and the heuristic below the first), times candidate
``MoEConfig``s at T = the bucket as CUDA-graph replays with rotated weight copies. A candidate
counts only if its output passes the tests' tolerance rule (``evenflow.testing.assert_within_rule``
against the fp64 oracle, with PyTorch's own bf16/fp32 run as the baseline, as in
tests/test_moe_gpu.py). ``choose_config``'s pick (``default``) is always timed first and wins
ties: a bucket's entry is the fastest passing candidate.

Writes ``src/evenflow/moe/configs/<gpu>.json`` (or ``--table``); when ``$OUT`` is set, also a
copy under ``$OUT/moe-configs/``. ``fused_moe`` reads the file as data (``tuned_config``) and
falls back to ``choose_config`` for shapes and batches it does not hold.

Budget: Triton compiles each distinct config once (~1-3 s for the gate-up + down pair; ~120
distinct configs for Qwen3's three formats): ``--workers`` processes compile them all first into
Triton's disk cache (~1 min on 8), then the timing pass (~0.1-0.5 s a candidate) runs in what is
left of ``--budget-s`` (the whole run, compiles included): each remaining (format, bucket)
gets an equal share of the time left and stops timing candidates (most promising first, the
default always) when its share is spent.
The candidates come from the round-5 notes (docs/perf-notes/moe.md): at decode only the K
splits, the N width and the pipeline depth vary (weight streaming); above 16 rows per expert the
tile shape and warps vary.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as B  # noqa: E402  (benchmarks/moe.py: cases, rotations)

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
QUICK_BUCKETS = [1, 16, 128, 512, 4096]
FORMATS = {"bf16": ("bf16", 0), "fp8-tensor": ("fp8_per_tensor", 1), "fp8-block": ("fp8_block", 2)}
ROOT = Path(__file__).resolve().parent.parent


def candidates(case, mode: int, t: int) -> list[tuple[str, object]]:
    """(label, MoEConfig) to time at batch t, most promising first; all pass check_config."""
    from evenflow.moe.fused import check_config, choose_config

    d = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, mode,
                      num_experts_total=case.num_experts_total)
    r = dataclasses.replace
    rows = t * case.top_k / case.num_experts_total
    out = [("default", d)]
    if rows <= 16:
        # decode / small batch: bound by streaming the hit experts' weights
        out += [("st4", r(d, num_stages=4)), ("st5", r(d, num_stages=5))]
        if mode != 2:
            out += [("gn32", r(d, gu_block_n=32)), ("gn32-st4", r(d, gu_block_n=32, num_stages=4))]
        out += [("dn128", r(d, down_block_n=128)), ("dn32", r(d, down_block_n=32))]
        for gs, ds in ((d.gu_split_k * 2, d.down_split_k), (max(1, d.gu_split_k // 2), d.down_split_k),
                       (d.gu_split_k, d.down_split_k * 2), (d.gu_split_k, max(1, d.down_split_k // 2))):
            out.append((f"gs{gs}-ds{ds}", r(d, gu_split_k=gs, down_split_k=ds)))
        if mode == 0:
            out += [("gk128", r(d, gu_block_k=128, down_block_k=128)),
                    ("gk128-st4", r(d, gu_block_k=128, down_block_k=128, num_stages=4))]
        out += [("bm32", r(d, block_m=32)), ("w8", r(d, num_warps=8))]
    else:
        for bm, gn, dn, nw, st in ((64, 64, 64, 4, 3), (64, 128, 128, 8, 3), (64, 64, 128, 4, 4),
                                   (128, 64, 128, 8, 3), (32, 64, 64, 4, 4), (64, 128, 128, 8, 4),
                                   (128, 128, 128, 8, 3), (32, 128, 64, 4, 3), (16, 64, 64, 4, 4),
                                   (128, 64, 64, 4, 3)):
            gn = 128 if mode == 2 else gn
            out.append((f"bm{bm}-gn{gn}-dn{dn}-w{nw}-st{st}",
                        r(d, block_m=bm, gu_block_n=gn, down_block_n=dn, num_warps=nw, num_stages=st,
                          gu_split_k=1, down_split_k=1)))
        if mode == 0 and d.block_m <= 32:  # 128-deep bf16 K tiles at >= 64x128 exceed 227 KB of smem (sm_90)
            out.append(("gk128", r(d, gu_block_k=128, down_block_k=128, num_stages=3)))
    seen, valid = set(), []
    for label, c in out:
        try:
            check_config(c, case.hidden, case.inter, mode)
        except ValueError:
            continue
        if c not in seen:
            seen.add(c)
            valid.append((label, c))
    return valid


def _precompile_worker(jobs) -> int:
    """Compile (fmt, hidden, inter, config) launches into Triton's on-disk cache: a small expert count and
    batch, but the same constexprs and argument alignments as the tuner's real launches."""
    import evenflow
    from evenflow.moe.fused import MoEConfig
    from evenflow.reference.moe import random_moe_weights, random_routing

    done, ews = 0, {}
    for fmt, h, i, cfg in jobs:
        if (fmt, h, i) not in ews:
            ews[(fmt, h, i)] = random_moe_weights(fmt, 8, h, i, "cuda")
        x = torch.randn(16, h, device="cuda").bfloat16()
        ids, tw = random_routing(16, 8, 8, "cuda")
        try:
            evenflow.fused_moe(x, ids, tw, ews[(fmt, h, i)], config=MoEConfig.from_list(cfg))
            done += 1
        except Exception:  # noqa: BLE001  (the timing pass reports it)
            pass
    torch.cuda.synchronize()
    return done


def precompile(jobs, workers: int) -> None:
    """Compile every candidate in parallel processes first, so the budget goes to timing."""
    import concurrent.futures
    import multiprocessing

    if workers <= 1 or len(jobs) < 2:
        return
    chunks = [jobs[w::workers] for w in range(workers)]
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        n = sum(ex.map(_precompile_worker, chunks))
    print(f"precompiled {n}/{len(jobs)} candidates in {time.time() - t0:.0f}s on {workers} processes", flush=True)


def _extra(p):
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="wall-clock budget (seconds); (format, bucket) points share what is left")
    p.add_argument("--cases", default="qwen3-30b-a3b", help="comma-separated case names of benchmarks/moe.py")
    p.add_argument("--formats", default="bf16,fp8-tensor,fp8-block")
    p.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                   help="processes compiling the candidates before the timing pass (1: compile as timed)")
    p.add_argument("--table", default=None, help="output JSON (default src/evenflow/moe/configs/<gpu>.json)")


def main() -> int:
    import evenflow
    from evenflow.bench import harness as H
    from evenflow.moe.fused import tuned_key
    from evenflow.reference.moe import moe_reference, random_moe_weights, random_routing
    from evenflow.testing import assert_within_rule

    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    t0 = time.time()
    buckets = QUICK_BUCKETS if args.quick else BUCKETS
    name = torch.cuda.get_device_name()
    gpu = "h200" if "H200" in name else name.lower().replace(" ", "-")
    table_path = Path(args.table) if args.table else ROOT / "src/evenflow/moe/configs" / f"{gpu}.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    table.update({"device": name, "torch": torch.__version__, "generated_by": "benchmarks/tune_moe.py",
                  "rule": "fastest config passing evenflow.testing.assert_within_rule; default wins ties"})
    configs, timings = table.setdefault("configs", {}), table.setdefault("timings", {})
    points = [(c, f, t) for c in args.cases.split(",") for f in args.formats.split(",") for t in buckets
              if f not in B.CASES[c].skip_variants]
    jobs, seen = [], set()
    for case_name, variant, t in points:
        case = B.CASES[case_name]
        fmt, mode = FORMATS[variant]
        for _, cfg in candidates(case, mode, t):
            job = (fmt, case.hidden, case.inter, cfg.as_list())
            if str(job) not in seen:
                seen.add(str(job))
                jobs.append(job)
    precompile(jobs, args.workers)  # counts against --budget-s too
    done = 0
    weights_cache: dict = {}
    for case_name, variant, t in points:
        case = B.CASES[case_name]
        fmt, mode = FORMATS[variant]
        key = tuned_key(case.num_local, case.num_experts_total, case.top_k, case.hidden, case.inter, mode)
        if (case_name, fmt) not in weights_cache:
            weights_cache.clear()
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(0)
            weights_cache[(case_name, fmt)] = [random_moe_weights(fmt, case.num_local, case.hidden, case.inter,
                                                                  "cuda", generator=g)]
        ews = weights_cache[(case_name, fmt)]
        g = torch.Generator(device="cuda").manual_seed(1000 + t)
        x = torch.randn(t, case.hidden, device="cuda", generator=g).bfloat16()
        ids, tw = random_routing(t, case.top_k, case.num_experts_total, "cuda", generator=g)
        touched = min(case.num_local, int(ids.unique().numel())) * B.expert_bytes(case, variant)
        n_rot = min(4, B.rotations(touched, 60 * 2**20))
        while len(ews) < n_rot:
            g2 = torch.Generator(device="cuda").manual_seed(len(ews))
            ews.append(random_moe_weights(fmt, case.num_local, case.hidden, case.inter, "cuda", generator=g2))
        kw = {"ep_rank": case.ep_rank, "num_experts_total": case.num_experts_total}
        ref = moe_reference(x, ids, tw, ews[0], dtype=torch.float64, **kw)
        base = moe_reference(x, ids, tw, ews[0], dtype=torch.bfloat16 if fmt == "bf16" else torch.float32,
                             **kw).to(torch.bfloat16)
        share = max(2.0, (args.budget_s - (time.time() - t0)) / (len(points) - done))
        start = time.time()
        best = None
        rows = {}
        cands = candidates(case, mode, t)
        for i, (label, cfg) in enumerate(cands):
            if i > 0 and time.time() - start > share:
                print(f"  {case_name} {variant} T={t}: share {share:.0f}s spent after {i}/{len(cands)} candidates")
                break
            fns = [lambda ew=ew, c=cfg: evenflow.fused_moe(x, ids, tw, ew, config=c, **kw) for ew in ews[:n_rot]]
            try:
                assert_within_rule(fns[0](), ref, base, what=f"{case_name} {variant} T={t} {label}")
                us = H.time_graph(fns)
            except Exception as e:  # a failing config is reported, never chosen
                rows[label] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            rows[label] = round(us, 2)
            if best is None or us < best[0]:
                best = (us, label, cfg)
        done += 1
        if best is not None:
            configs.setdefault(key, {})[str(t)] = best[2].as_list()
            dflt = rows.get("default")
            timings.setdefault(key, {})[str(t)] = {"best": best[1], "best_us": round(best[0], 2),
                                                   "default_us": dflt, "tried": rows}
            print(f"[{time.time() - t0:5.0f}s] {case_name} {variant} T={t}: best {best[1]} {best[0]:.1f} us "
                  f"(default {dflt}) over {len(rows)} candidates", flush=True)
        else:
            print(f"[{time.time() - t0:5.0f}s] {case_name} {variant} T={t}: no candidate passed: {rows}", flush=True)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    table_path.write_text(text)
    print(f"written: {table_path}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "moe-configs"
        out.mkdir(parents=True, exist_ok=True)
        (out / table_path.name).write_text(text)
        print(f"copy: {out / table_path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
