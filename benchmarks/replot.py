"""Plot a result file again from its JSON (no GPU): ``<name>.png`` beside ``<name>.json``, with the axes its
benchmark script plots it on. For a plot made by an older harness (colours: since round AQ one an impl in every
panel).

    python benchmarks/replot.py benchmarks/results/h200/decode.json [more.json ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evenflow.bench.harness import Results

# the x axis and panel key each benchmark's ``Results.finish`` plots with
AXES = {"decode": ("case", "variant"), "moe": ("batch", "series"), "router": ("M", "case"), "multigpu": ("x", "plot")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="result files (<name>.json) of " + ", ".join(AXES))
    args = p.parse_args(argv)
    for f in args.files:
        name = Path(f).stem
        if name not in AXES:
            p.error(f"files: {f}: no plot axes known for {name!r} (one of {', '.join(AXES)})")
        x, group = AXES[name]
        print(Results.load(f).plot(x=x, group=group, y="us", logy=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
