"""Cost model of the decode plan's bins (CPU, no GPU): what a plan option should change.

    python benchmarks/plan_model.py [--programs 264] [--tile-us 2.04] [--chunk-us 3.0] [--base-us 0]
                                    [--options cost0,cost1,cost2,alignup]
    python benchmarks/plan_model.py --fit RESULT.json [RESULT.json ...] --variant bf16-kv [--before-i1]

Builds the plan of each decode benchmark case with the reference builder
(:func:`evenflow.reference.attention.build_plan_ref`) under each plan option and prices every
bin as ``tile_us`` per 64-token tile it reads plus ``chunk_us`` per chunk it holds (each chunk
pays a prologue and an output or partial write); a case costs ``base_us`` (launches, the plan,
the combine's tail) plus its longest bin, or plus all its tiles at ``roof_us`` each (the copy
bandwidth shared by every program) when that is longer: a bin runs faster when fewer
programs share the bandwidth (2x32K+30x4K: 184 of 264 bins busy). Prints the budget, the longest and the mean bin, and
how many items are cut (each cut is a partial write and a combine merge).

``--fit`` calibrates ``tile_us``, ``chunk_us`` and ``base_us`` on measured result files
(decode.json rows that measured a plan option, one variant: in rounds I1-J2 ``evenflow``
is ``alignup`` and ``evenflow-noalignup`` is ``cost0`` (later files, where the default plan
charges short items, do not fit this map); files measured before I1, with
``--before-i1``, have ``evenflow`` = ``cost0``, ``evenflow-cost1/2`` and ``evenflow-alignup``):
a grid search for the least worst relative error over all rows, then the same table with the
fitted values, each case beside its measured time.
Round G's hand calibration (2.04 us a tile, 3 us a chunk, bf16) under-priced the extra cuts
of ``item_cost`` (round H1: predicted gains, measured losses); the fit uses every measured
plan variant at once. A model to write predictions with, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode as bench  # noqa: E402  (the benchmark's cases)
from evenflow.reference.attention import build_plan_ref  # noqa: E402

TILE = 64
# plan option name -> (DecodePlan keyword arguments, the benchmark row that measured it in files
# of rounds I1-I4 (align_longer the default, no item cost), the row that measured it before round
# I1 (align_longer off by default)). Since round J the default plan charges short items 2 units
# (``short2``): its rows are `evenflow` in later files, which --fit does not read yet.
_ALL = {"item_cost_max_tiles": None}
OPTIONS = {
    "cost0": ({"align_longer": False, "item_cost": 0}, "evenflow-noalignup", "evenflow"),
    "cost1": ({"item_cost": 1, "align_longer": False, **_ALL}, None, "evenflow-cost1"),
    "cost2": ({"item_cost": 2, "align_longer": False, **_ALL}, None, "evenflow-cost2"),
    "alignup": ({"align_longer": True, "item_cost": 0}, "evenflow", "evenflow-alignup"),
    "short2": ({"align_longer": True, "item_cost": 2, "item_cost_max_tiles": 4}, None, None),
}


def plan_bins(lens: list[int], hkv: int, programs: int, min_tiles: int = 8, **options) -> tuple[int, list, list]:
    """(budget, bins as [(reads, chunks)], cut items) of the reference plan."""
    sl = torch.tensor(lens, dtype=torch.int32)
    plan, bins = build_plan_ref(sl, hkv, programs, min_tiles, 1 << 30, **options)
    tiles = plan["tiles"].tolist()
    # unit t of an item is its tile t; with item_cost the last units hold no tokens
    shape = [(sum(1 for i, t0, t1 in chunks for t in range(t0, t1) if t < -(-lens[i // hkv] // TILE)), len(chunks))
             for chunks in bins]
    cut = {i for chunks in bins for i, t0, t1 in chunks if (t0, t1) != (0, tiles[i // hkv])}
    return int(plan["meta"][1]), shape, sorted(cut)


def price(shape: list, tile_us: float, chunk_us: float, base_us: float, roof_us: float = 0.0) -> tuple[float, float]:
    """(modelled case time, mean bin) of a plan's bins: the longest bin, or all tiles at the
    copy bandwidth (``roof_us`` a tile over the whole GPU) when that is longer, plus base."""
    costs = [tile_us * r + chunk_us * c for r, c in shape]
    reads = sum(r for r, _ in shape)
    return base_us + max(max(costs), roof_us * reads), sum(costs) / len(costs)


def _case_shapes(names, programs):
    shapes = {}
    for name in names:
        case = bench.parse_case(name)
        for opt, (kw, *_) in OPTIONS.items():
            shapes[(name, opt)] = plan_bins(list(case.lengths), case.num_kv_heads, programs, **kw)
    return shapes


def _measured(files, variant, before_i1=False):
    """{(case, option): us} from result files (a later file overrides an earlier one)."""
    row_to_opt = {rows[1 if before_i1 else 0]: opt for opt, (_, *rows) in OPTIONS.items()}
    row_to_opt.pop(None, None)
    got = {}
    for f in files:
        for r in json.load(open(f))["rows"]:
            if r.get("variant") == variant and r.get("impl") in row_to_opt and "us" in r:
                got[(r["case"], row_to_opt[r["impl"]])] = r["us"]
    return got


def fit(shapes, measured):
    """Grid search for (tile_us, chunk_us, base_us, roof_us) minimising the worst relative error."""
    import numpy as np

    tile = np.arange(0.30, 2.61, 0.02)
    chunk = np.arange(0.0, 8.01, 0.25)
    base = np.arange(0.0, 20.1, 1.0)
    roof = np.arange(0.0060, 0.0100, 0.0002)
    worst = np.zeros((len(tile), len(chunk), len(base), len(roof)))
    for k, us in measured.items():
        u = np.array(sorted(set(shapes[k][1])), dtype=float)  # distinct (reads, chunks) bins
        longest = (u[:, 0, None, None] * tile[None, :, None] + u[:, 1, None, None] * chunk[None, None, :]).max(0)
        reads = float(sum(r for r, _ in shapes[k][1]))
        t = base[None, None, :, None] + np.maximum(longest[:, :, None, None], reads * roof[None, None, None, :])
        worst = np.maximum(worst, np.abs(t / us - 1))
    i = np.unravel_index(np.argmin(worst), worst.shape)
    return float(worst[i]), float(tile[i[0]]), float(chunk[i[1]]), float(base[i[2]]), float(roof[i[3]])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=264, help="persistent programs (2 per SM on 132 SMs)")
    p.add_argument("--tile-us", type=float, default=2.04)
    p.add_argument("--chunk-us", type=float, default=3.0)
    p.add_argument("--base-us", type=float, default=0.0)
    p.add_argument("--roof-us", type=float, default=0.0, help="us a tile over the whole GPU at copy bandwidth")
    p.add_argument("--options", default="cost0,cost1,cost2,alignup,short2", help=f"plan options, from {list(OPTIONS)}")
    p.add_argument("--cases", default=None, help="comma list of decode benchmark cases (default: all)")
    p.add_argument("--fit", nargs="*", default=None, help="decode.json files to calibrate on")
    p.add_argument("--variant", default="bf16-kv", help="the variant --fit reads")
    p.add_argument("--before-i1", action="store_true", help="--fit files measured before round I1 (row names)")
    a = p.parse_args(argv)
    names = a.cases.split(",") if a.cases else bench.CASES
    opts = a.options.split(",")
    for o in opts:
        if o not in OPTIONS:
            raise SystemExit(f"--options: unknown option {o!r} (choose from {', '.join(OPTIONS)})")
    shapes = _case_shapes(names, a.programs)
    tile_us, chunk_us, base_us, roof_us = a.tile_us, a.chunk_us, a.base_us, a.roof_us
    measured = {}
    if a.fit:
        measured = {k: v for k, v in _measured(a.fit, a.variant, a.before_i1).items() if k[0] in names}
        if not measured:
            rows = [r[2 if a.before_i1 else 1] for r in OPTIONS.values()]
            raise SystemExit(f"--fit: no {a.variant} rows of {[r for r in rows if r]} in {a.fit}")
        err, tile_us, chunk_us, base_us, roof_us = fit(shapes, measured)
        print(f"fit on {len(measured)} measured {a.variant} rows: tile {tile_us:.2f} us, chunk {chunk_us:.2f} us, "
              f"base {base_us:.0f} us, roof {roof_us * 1000:.1f} ns a tile; worst relative error {err:.1%}\n")
    print("| case | " + " | ".join(f"{o}: budget / model us (measured) / mean bin / items cut" for o in opts) + " |")
    print("|---|" + "---|" * len(opts))
    for name in names:
        cells = []
        for o in opts:
            budget, shape, cut = shapes[(name, o)]
            t, mean = price(shape, tile_us, chunk_us, base_us, roof_us)
            m = measured.get((name, o))
            cells.append(f"{budget} / {t:.0f}{f' ({m:.0f})' if m else ''} / {mean:.0f} / {len(cut)}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
