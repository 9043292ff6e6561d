"""Per-program timeline of the decode kernel: where a call's fixed cost goes inside the kernel.

    python benchmarks/decode_timeline.py --out DIR [--cases 64x512,8x32K,...] [--variants bf16,fp8] [--impl ROW]
    python benchmarks/decode_timeline.py --plot DIR/decode_timeline.json      # plot only (no GPU)

For each case, ``evenflow`` (the default plan, the inputs of ``benchmarks/decode.py``) is timed in
CUDA-graph replay, then the same calls with ``DecodePlan.record_timeline()`` (the kernel's STAMPS
build: every program writes globaltimer / clock64 stamps at its entry, after the PDL wait, once its
first item's metadata is in, at the end of its first and last chunk, and at its end, plus its SM
and its chunk, tile and merge counts). The graph is replayed ``--replays`` times; after each
replay the stamps of its last call (which ran right after the others, as in the benchmark) are
read back. Per case, medians over the replays of:

- ``span``: first program entry to last program end (the kernel as the timeline sees it);
- ``entry_spread``: first to last program entry (launch ramp);
- ``wait``, ``chain``: entry -> after the PDL wait -> first item's metadata (medians over programs);
- ``first_chunk`` and ``us_per_tile``: the first chunk's time; time per tile over each program's
  attention (metadata to last chunk end, over its tiles), median over programs;
- ``attn_end_p50`` / ``attn_end_max``: when programs finish their last chunk (from kernel start);
- ``end_p50`` / ``end_max``: when programs end; ``tail`` = end_max - attn_end_max (the merge or
  store after the last chunk of the last program);
- ``merges``, ``merge_us_med``: group merges per call, median time of one (chunk end -> merge end);
- ``idle_frac``: share of program slots idle within the span (ends before the last one, late starts).

Writes ``DIR/decode_timeline.json`` (summaries, plus the raw stamps of one replay per case) and,
where matplotlib is installed, ``DIR/decode_timeline.png`` (one Gantt chart per case).
Diagnostic evidence for docs/perf-notes/decode.md (round O), not a result file of record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as bench  # noqa: E402  (benchmarks/decode.py: cases, inputs)
import decode_fixed_cost as fixed_cost  # noqa: E402  (its GPU set-up and variants)
from evenflow.bench import harness as H  # noqa: E402

DEFAULT_CASES = ["64x512", "32x4K", "8x32K", "1x64K+15x4K", "2x32K+30x4K", "32x128+32x4K", "tp8:1x128K+31x4K"]
VARIANTS = fixed_cost.VARIANTS


def _fields():
    from evenflow.attention import kernels as K
    return K.STAMP_FIELDS


def summarize(st: dict[str, list[int]]) -> dict:
    """Summary (µs) of one call's stamps: ``st`` maps each STAMP_FIELDS name to a per-program list."""
    P = len(st["entry"])
    t0 = min(st["entry"])
    us = 1e-3

    def rel(name):
        return [(x - t0) * us for x in st[name]]

    entry, end, last_end = rel("entry"), rel("program_end"), rel("last_end")
    busy = [p for p in range(P) if st["chunks"][p] > 0]
    span = max(end)
    rates = [(st["last_end"][p] - st["meta"][p]) * us / st["tiles"][p] for p in busy if st["tiles"][p] > 0]
    merges = sum(st["merges"])
    per_merge = [st["merge_ns"][p] * us / st["merges"][p] for p in range(P) if st["merges"][p] > 0]
    idle = sum(span - (end[p] - entry[p]) for p in range(P)) / (span * P) if span > 0 else 0.0
    sms = st["sm"]
    per_sm: dict[int, int] = {}
    for s in sms:
        per_sm[s] = per_sm.get(s, 0) + 1
    return {
        "programs": P, "busy_programs": len(busy),
        "span": round(span, 2),
        "entry_spread": round(max(entry), 2),
        "wait": round(statistics.median((st["after_wait"][p] - st["entry"][p]) * us for p in range(P)), 2),
        "chain": round(statistics.median((st["meta"][p] - st["after_wait"][p]) * us for p in range(P)), 2),
        "first_chunk": round(statistics.median((st["first_end"][p] - st["meta"][p]) * us for p in busy), 2)
        if busy else None,
        "us_per_tile": round(statistics.median(rates), 4) if rates else None,
        "attn_end_p50": round(statistics.median(last_end[p] for p in busy), 2) if busy else None,
        "attn_end_max": round(max(last_end[p] for p in busy), 2) if busy else None,
        "end_p50": round(statistics.median(end), 2),
        "end_max": round(max(end), 2),
        "tail": round(max(end) - max(last_end[p] for p in busy), 2) if busy else None,
        "merges": merges,
        "merge_us_med": round(statistics.median(per_merge), 2) if per_merge else None,
        "idle_frac": round(idle, 4),
        "programs_per_sm": sorted({v: sum(1 for c in per_sm.values() if c == v) for v in per_sm.values()}.items()),
        # under PDL (round AE) programs enter while the call ahead drains; from the first release of the
        # wait (the call ahead's end): the last release, the attention ends and the kernel's end; and the
        # share of consecutive programs (bins) placed on the same SM (the plain launch's placement: ~0)
        "release_spread": round((max(st["after_wait"]) - min(st["after_wait"])) * us, 2),
        "attn_end_p50_from_release": round(statistics.median(
            (st["last_end"][p] - min(st["after_wait"])) * us for p in busy), 2) if busy else None,
        "attn_end_max_from_release": round(max(
            (st["last_end"][p] - min(st["after_wait"])) * us for p in busy), 2) if busy else None,
        "end_max_from_release": round((max(st["program_end"]) - min(st["after_wait"])) * us, 2),
        "adjacent_same_sm": round(sum(sms[p] == sms[p + 1] for p in range(P - 1)) / max(P - 1, 1), 4),
    }


def _median_summary(sums: list[dict]) -> dict:
    out = {}
    for k, v in sums[0].items():
        vals = [s[k] for s in sums]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(x is not None for x in vals):
            out[k] = round(statistics.median(vals), 4)
        else:
            out[k] = v
    return out


def run_case(cname: str, vname: str, replays: int, l2: int, ceilings: dict, impl: str = "evenflow") -> dict:
    case = bench.parse_case(cname)
    dt = VARIANTS[vname]
    inp = bench.knob_inputs(impl, bench.make_inputs(case, dt, "cuda", 0, l2))
    plan = bench.evenflow_plan(impl, inp)
    fns = bench.evenflow_calls(inp, plan)
    us_default = H.time_graph(fns)
    stamps = plan.record_timeline()
    us_stamped = H.time_graph(fns)
    g, n_calls = H.capture_graph(fns)
    for _ in range(20):
        g.replay()
    fields = _fields()
    sums, raw = [], None
    for _ in range(replays):
        stamps.zero_()
        g.replay()
        torch.cuda.synchronize()
        rows = stamps.cpu().tolist()
        st = {name: [row[j] for row in rows] for j, name in enumerate(fields)}
        if min(st["program_end"]) <= 0:
            raise RuntimeError(f"{cname} {vname}: a program wrote no end stamp")
        sums.append(summarize(st))
        raw = st
    plan.record_timeline(False)
    del g
    fl = H.floor_us(bench.floor_bytes(case, dt), ceilings=ceilings)
    return {"case": cname, "impl": f"{impl}-timeline", "variant": vname, "us": round(us_default, 3),
            "us_stamped": round(us_stamped, 3),
            "floor_us": round(fl, 3), "calls_per_replay": n_calls, "replays": replays,
            "summary": _median_summary(sums), "raw_last_replay": raw}


def plot(path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    n = len(rows)
    cols = 2
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(14, 3.2 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, r in zip(axes.flat, rows):
        st = r["raw_last_replay"]
        P = len(st["entry"])
        t0 = min(st["entry"])
        order = sorted(range(P), key=lambda p: (st["sm"][p], p))
        for y, p in enumerate(order):
            e, w, m = st["entry"][p] - t0, st["meta"][p] - t0, st["last_end"][p] - t0
            end = st["program_end"][p] - t0
            ax.barh(y, (m - e if st["chunks"][p] else end - e) / 1e3, left=e / 1e3, color="0.75", height=1.0)
            if st["chunks"][p]:
                ax.barh(y, (m - w) / 1e3, left=w / 1e3, color="tab:blue", height=1.0)
                ax.barh(y, (end - m) / 1e3, left=m / 1e3, color="tab:red", height=1.0)
        s = r["summary"]
        ax.set_title(f"{r['variant']} {r['case']}: {r['us']:.1f} us/call, span {s['span']:.1f}, "
                     f"floor {r['floor_us']:.1f}", fontsize=9)
        ax.set_xlabel("us from the first program's entry", fontsize=8)
        ax.set_ylabel("program (by SM)", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("decode kernel per program: grey = start (entry to first metadata), blue = attention, "
                 "red = after the last chunk (merge, store)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for decode_timeline.json (and .png)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of decode cases")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS))
    ap.add_argument("--impl", default="evenflow",
                    help="evenflow (default) or a plan knob row of benchmarks/decode.py (e.g. evenflow-triton)")
    ap.add_argument("--replays", type=int, default=9, help="graph replays read back per case (default 9)")
    ap.add_argument("--plot", metavar="JSON", help="only plot an existing decode_timeline.json")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    if not args.out:
        raise SystemExit("--out is required (or --plot JSON)")
    if args.replays < 1:
        raise SystemExit("--replays must be >= 1")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases:
        raise SystemExit("--cases: empty list")
    for c in cases:
        try:
            bench.parse_case(c)  # a bad name stops here, before any GPU work
        except ValueError as e:
            raise SystemExit(f"--cases: {e}") from None
    if args.impl != "evenflow" and args.impl not in bench.PLAN_KNOBS:
        raise SystemExit(f"--impl: evenflow or one of {', '.join(bench.PLAN_KNOBS)}; got {args.impl!r}")
    variants, l2, ceil = fixed_cost.gpu_setup(args.out, args.variants, "decode_timeline")
    rows = []
    for vname in variants:
        for cname in H.progress(cases, vname):
            r = run_case(cname, vname, args.replays, l2, ceil, args.impl)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "raw_last_replay"}), flush=True)
            torch.cuda.empty_cache()
    path = H.write_rows(args.out, "decode_timeline.json", rows, indent=None, ceilings=ceil)
    keys = ["span", "entry_spread", "wait", "chain", "first_chunk", "us_per_tile", "attn_end_p50", "attn_end_max",
            "end_max", "tail", "merges", "merge_us_med", "idle_frac"]
    print("\n| variant | case | us | stamped | floor | " + " | ".join(keys) + " |")
    print("|" + "---|" * (5 + len(keys)))
    for r in rows:
        s = r["summary"]
        print(f"| {r['variant']} | {r['case']} | {r['us']:.1f} | {r['us_stamped']:.1f} | {r['floor_us']:.1f} | " +
              " | ".join(str(s[k]) for k in keys) + " |")
    print("plot:", plot(path))


if __name__ == "__main__":
    main()
