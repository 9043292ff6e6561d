"""Cost model of the decode plan's bins (CPU, no GPU): what an ``item_cost`` should change.

    python benchmarks/plan_model.py [--programs 264] [--tile-us 2.04] [--chunk-us 3.0]

Builds the plan of each decode benchmark case with the reference builder
(:func:`evenflow.reference.attention.build_plan_ref`) at item_cost 0, 1, 2 and prices every bin
as ``tile_us`` per 64-token tile it reads plus ``chunk_us`` per chunk it holds (each chunk pays
a prologue and an output or partial write). Defaults are calibrated on the H200 (decode.json,
round G4, bf16): 2.04 us a tile at 2 programs/SM is 8x32K's rate (124 tiles a program in
~259 us), and 64x512's time above its tiles (44.4 us for 16 tiles and 2 items a bin, less the
launches) is ~3 us a chunk. Prints the budget, the longest and the mean bin, and how many items
are cut (each cut is a partial write and a combine merge). A model to write predictions with,
not a measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode as bench  # noqa: E402  (the benchmark's cases)
from evenflow.reference.attention import build_plan_ref  # noqa: E402

TILE = 64


def bin_costs(lens: list[int], hkv: int, programs: int, item_cost: int, tile_us: float, chunk_us: float,
              min_tiles: int = 8) -> dict:
    sl = torch.tensor(lens, dtype=torch.int32)
    plan, bins = build_plan_ref(sl, hkv, programs, min_tiles, 1 << 30, item_cost=item_cost)
    tiles = plan["tiles"].tolist()
    costs, total_read = [], 0
    for chunks in bins:
        # unit t of an item is its tile t; the last item_cost units hold no tokens
        read = sum(1 for i, t0, t1 in chunks for t in range(t0, t1) if t < -(-lens[i // hkv] // TILE))
        costs.append(tile_us * read + chunk_us * len(chunks))
        total_read += read
    cut = {i for chunks in bins for i, t0, t1 in chunks if (t0, t1) != (0, tiles[i // hkv])}
    return {"budget": int(plan["meta"][1]), "max_us": max(costs), "mean_us": sum(costs) / len(costs),
            "cut_items": len(cut), "tiles_read": total_read}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=264, help="persistent programs (2 per SM on 132 SMs)")
    p.add_argument("--tile-us", type=float, default=2.04)
    p.add_argument("--chunk-us", type=float, default=3.0)
    p.add_argument("--costs", default="0,1,2", help="item_cost values to compare")
    p.add_argument("--cases", default=None, help="comma list of decode benchmark cases (default: all)")
    a = p.parse_args(argv)
    names = a.cases.split(",") if a.cases else bench.CASES
    costs = [int(c) for c in a.costs.split(",")]
    print("| case | " + " | ".join(f"item_cost {c}: budget / longest / mean bin (model us) / items cut"
                                   for c in costs) + " |")
    print("|---|" + "---|" * len(costs))
    for name in names:
        case = bench.parse_case(name)
        cells = []
        for c in costs:
            r = bin_costs(list(case.lengths), case.num_kv_heads, a.programs, c, a.tile_us, a.chunk_us)
            cells.append(f"{r['budget']} / {r['max_us']:.0f} / {r['mean_us']:.0f} / {r['cut_items']}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
