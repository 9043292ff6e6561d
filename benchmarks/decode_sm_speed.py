"""Would a plan that knows each SM's speed finish sooner? An offline test on timeline stamps (no GPU).

    python benchmarks/decode_sm_speed.py benchmarks/results/h200/history/round-o1/decode_timeline.raw.txt

Input: a ``decode_timeline.py`` result (its ``raw_last_replay`` stamps: per program its SM, tiles,
when its first item's metadata was in and when its last chunk ended). Per case, a program's time
per tile is (last chunk end - metadata) / tiles, and an SM's rate the mean over its programs.

1. How alike the per-SM rates of two cases are (Pearson correlation over SMs).
2. A what-if: give each program tiles in proportion to 1 / (its SM's rate measured on a
   *calibration* case), keeping the case's total, and assume each program keeps its own measured
   time per tile. The latest attention end of that plan beside the measured one and beside the
   in-sample ideal (weights from the case's own rates). ``--shrink A`` moves each calibrated
   rate A of the way from the mean to the SM's value (A = 1: as measured).

A plan sized by SM speed helps only if the calibrated rows beat ``now``. Round O1's stamps
(docs/perf-notes/decode.md, round P): they do not, except on the calibration case itself.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def per_program(raw: dict) -> dict:
    """Arrays per program: sm, tiles, start (us from the first entry) and time per tile (NaN when idle)."""
    sm = np.asarray(raw["sm"], dtype=np.int64)
    tiles = np.asarray(raw["tiles"], dtype=np.float64)
    t0 = min(raw["entry"])
    start = (np.asarray(raw["meta"], dtype=np.float64) - t0) / 1e3
    dur = (np.asarray(raw["last_end"], dtype=np.float64) - np.asarray(raw["meta"], dtype=np.float64)) / 1e3
    busy = tiles > 0
    rate = np.full(len(tiles), np.nan)
    rate[busy] = dur[busy] / tiles[busy]
    return {"sm": sm, "tiles": tiles, "start": start, "rate": rate, "busy": busy}


def sm_rates(p: dict, num_sms: int) -> np.ndarray:
    """Mean time per tile of each SM's busy programs (NaN for an SM with none)."""
    out = np.full(num_sms, np.nan)
    for s in range(num_sms):
        m = (p["sm"] == s) & p["busy"]
        if m.any():
            out[s] = p["rate"][m].mean()
    return out


def attention_end(p: dict, weights: np.ndarray | None = None) -> float:
    """Latest attention end (us) when busy programs get tiles in proportion to ``weights`` (None:
    the tiles they had), each at its own measured time per tile."""
    busy = p["busy"]
    tiles = p["tiles"]
    if weights is not None:
        w = np.where(busy, weights, 0.0)
        tiles = tiles[busy].sum() * w / w.sum()
    return float((p["start"] + tiles * np.nan_to_num(p["rate"]))[busy].max())


def calibrated_weights(p: dict, cal_rates: np.ndarray, shrink: float) -> np.ndarray:
    mean = np.nanmean(cal_rates)
    r = cal_rates[p["sm"]]
    r = np.where(np.isnan(r), mean, r)
    return 1.0 / (mean + shrink * (r - mean))


def analyse(rows: list[dict], shrink: float = 1.0, num_sms: int | None = None) -> dict:
    progs = {(r["case"], r["variant"]): per_program(r["raw_last_replay"]) for r in rows}
    n = num_sms or 1 + max(int(p["sm"].max()) for p in progs.values())
    rates = {k: sm_rates(p, n) for k, p in progs.items()}
    corr, what_if = {}, {}
    for a in progs:
        for b in progs:
            if a[1] == b[1] and a != b:
                x, y = (np.nan_to_num(rates[k], nan=np.nanmean(rates[k])) for k in (a, b))
                corr[(a, b)] = float(np.corrcoef(x, y)[0, 1])
        p = progs[a]
        own = np.where(p["busy"], 1.0 / np.where(p["busy"], p["rate"], 1.0), 0.0)
        what_if[a] = {"now": attention_end(p), "ideal": attention_end(p, own),
                      **{f"cal:{b[0]}": attention_end(p, calibrated_weights(p, rates[b], shrink))
                         for b in progs if b[1] == a[1] and b != a}}
    return {"corr": corr, "what_if": what_if}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="decode_timeline.py result JSON (with raw_last_replay stamps)")
    ap.add_argument("--shrink", type=float, default=1.0, help="calibrated rate = mean + A * (SM rate - mean)")
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        rows = [r for r in json.load(f)["rows"] if "raw_last_replay" in r]
    if not rows:
        raise SystemExit(f"{args.raw}: no rows with raw_last_replay stamps")
    res = analyse(rows, args.shrink)
    for (case, variant), w in res["what_if"].items():
        cal = " ".join(f"{k[4:]}={v:.1f}" for k, v in w.items() if k.startswith("cal:"))
        print(f"{case:18s} {variant:5s} now={w['now']:.1f} ideal={w['ideal']:.1f} | calibrated on: {cal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
