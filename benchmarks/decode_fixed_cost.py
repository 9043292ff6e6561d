"""Where a decode call's fixed cost goes: time against bytes, and the kernel timeline.

    python benchmarks/decode_fixed_cost.py --out DIR [--variants bf16,fp8]

For sweeps of batch x length (64 x 256..4K, 32 x 512..4K, the TP8 slice with one long request
of 32K..256K beside 31 of 1K..8K, TP8 32 x 1K..8K, plus 32x128+32x4K and 8x32K), ``evenflow``
is timed as ``benchmarks/decode.py`` times it (same inputs, CUDA-graph replay), then 5 replays
of its graph run under ``torch.profiler`` (CUDA activity): median duration per kernel name,
median gap between consecutive kernels (negative: launched with PDL before the one before it
ended) and the span per call. Last, per sweep, a least-squares fit ``us = a + s * floor_us``:
``a`` is the fixed cost of a call, ``s`` the time per floor-µs of KV streamed.
Writes ``DIR/decode_fixed_cost.json`` and prints the fits and the per-case table.
Diagnostic evidence for docs/perf-notes/decode.md (round N), not a result file of record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench  # noqa: E402  (benchmarks/decode.py: cases, inputs, impls)
from evenflow.bench import harness as H  # noqa: E402

SWEEPS = {
    "uniform64": ["64x256", "64x512", "64x1K", "64x2K", "64x4K"],
    "uniform32": ["32x512", "32x1K", "32x2K", "32x4K"],
    "tp8": ["tp8:1x32K+31x1K", "tp8:1x64K+31x2K", "tp8:1x128K+31x4K", "tp8:1x256K+31x8K"],
    "tp8u": ["tp8:32x1K", "tp8:32x2K", "tp8:32x4K", "tp8:32x8K"],
    "short": ["32x128+32x4K", "8x32K"],
}
VARIANTS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
PROFILED_REPLAYS = 5


def timeline(fns) -> dict:
    """Kernel medians, gap and span per call of ``PROFILED_REPLAYS`` replays of a graph of ``fns``."""
    from torch.profiler import ProfilerActivity, profile

    g, n_calls = H.capture_graph(fns)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            g.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    by: dict[str, list[float]] = {}
    for e in ev:
        by.setdefault(e["name"].split("(")[0][:40], []).append(e["dur"])
    gaps = [ev[i + 1]["ts"] - (ev[i]["ts"] + ev[i]["dur"]) for i in range(len(ev) - 1)]
    return {"kernels": {k: (len(v), round(statistics.median(v), 2)) for k, v in by.items()},
            "gap_med": round(statistics.median(gaps), 2) if gaps else None,
            "span_per_call": round((ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / (PROFILED_REPLAYS * n_calls), 2)}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (a, s) of y = a + s * x."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    s = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - s * mx, s


def gpu_setup(out: str, variants_arg: str, script: str) -> tuple[list[str], int, dict]:
    """(variants named by ``variants_arg``, the GPU's L2 bytes, ceilings measured now) for a
    decode diagnosis script writing to ``out``; exits with a message on a bad name or no GPU."""
    variants = bench._split(variants_arg, VARIANTS, "variants")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    os.makedirs(out, exist_ok=True)
    ceil = H.measure_ceilings(verbose=False)
    print("ceilings", ceil, flush=True)
    return variants, torch.cuda.get_device_properties(0).L2_cache_size, ceil


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for decode_fixed_cost.json")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS))
    args = ap.parse_args(argv)
    variants, l2, ceil = gpu_setup(args.out, args.variants, "decode_fixed_cost")
    rows = []
    for vname in variants:
        dt = VARIANTS[vname]
        for sweep, cases in SWEEPS.items():
            for cname in H.progress(cases, f"{vname} {sweep}"):
                case = bench.parse_case(cname)
                inp = bench.make_inputs(case, dt, "cuda", 0, l2)
                fns, _ = bench.build_fns("evenflow", inp)
                us = H.time_graph(fns)
                fl = H.floor_us(bench.floor_bytes(case, dt), ceilings=ceil)
                r = dict(case=cname, variant=vname, impl="evenflow", sweep=sweep, us=round(us, 3),
                         floor_us=round(fl, 3), frac=round(fl / us, 4), rotations=inp.rotations, **timeline(fns))
                rows.append(r)
                print(json.dumps(r), flush=True)
                del inp, fns
                torch.cuda.empty_cache()
    H.write_rows(args.out, "decode_fixed_cost.json", rows, ceilings=ceil)
    print("\nsweep fits (us = a + s * floor_us):")
    for vname in variants:
        for sweep in SWEEPS:
            pts = [(r["floor_us"], r["us"]) for r in rows if r["variant"] == vname and r["sweep"] == sweep]
            if len(pts) >= 3:
                a, s = fit(pts)
                print(f"{vname:5s} {sweep:10s} a={a:7.2f} us  s={s:.3f}  " +
                      "  ".join(f"{x:.0f}->{y:.1f}" for x, y in pts))
    print("\nkernel medians (us) per case:")
    for r in rows:
        print(f"{r['variant']:5s} {r['case']:22s} us={r['us']:8.2f} frac={r['frac']:.3f} span={r['span_per_call']} "
              f"gap={r['gap_med']} {r['kernels']}")


if __name__ == "__main__":
    main()
