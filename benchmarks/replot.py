"""Draw a result file's plot again from its JSON, on the axes its benchmark script plots it on (no GPU needed).

``<name>.png`` is written beside ``<name>.json``. Plots drawn before round AQ could give an impl a different colour
in each panel; a plot drawn again has one colour an impl.

    python benchmarks/replot.py benchmarks/results/h200/decode.json [more.json ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evenflow.bench.harness import Results

# the x axis and panel key of each script's ``Results.finish`` call (tests/test_bench_decode.py checks them against
# the scripts): decode.py, moe.py, router.py, route.py, multigpu.py, sweep_moe.py (its index sweep and its config sweep)
AXES = {"decode": ("case", "variant"), "moe": ("batch", "series"), "router": ("M", "case"), "multigpu": ("x", "plot"),
        "route": ("M", "case"), "moe_index": ("batch", "case"), "moe_sweep": ("case", "variant"),
        "prologue": ("T", "series"), "prefill": ("case", "variant"), "e2e_transformers": ("case", None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="result files (<name>.json) of " + ", ".join(AXES))
    args = p.parse_args(argv)
    for f in args.files:  # every name checked before anything is drawn
        if Path(f).stem not in AXES:
            p.error(f"files: {f}: no plot axes known for {Path(f).stem!r} (one of {', '.join(AXES)})")
    for f in args.files:
        x, group = AXES[Path(f).stem]
        try:
            print(Results.load(f).plot(x=x, group=group, y="us", logy=True))
        except (ValueError, ImportError) as e:
            p.error(f"files: {f}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
