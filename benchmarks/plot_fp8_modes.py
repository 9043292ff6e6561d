"""Plot the fused MoE's fp8 accumulation modes side by side from a benchmarks/moe.py result file.

    python benchmarks/plot_fp8_modes.py RESULTS.json [--out PNG]

The file must hold, at the same points, the default row ``evenflow`` (``fp8_accum="exact"``), the knob rows
``evenflow-promoted`` and/or ``evenflow-fastacc``, and ``sglang-triton`` (run ``benchmarks/moe.py --variants
fp8-tensor,fp8-block --impls evenflow,evenflow-fastacc,evenflow-promoted,sglang-triton``). Two panels, one bar group
per (case, variant, batch): the speed-up over SGLang (its time / the mode's; the line at 1 is level), and the max
error against the benchmark's fp32 oracle as a multiple of the exact mode's at that point. Points where a row is
missing or is an error row are left out of both panels (and listed on stderr).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = (("evenflow", "exact (default)"), ("evenflow-promoted", "promoted"), ("evenflow-fastacc", "fast"))
PEER = "sglang-triton"


def mode_table(rows: list[dict]) -> tuple[list[tuple], dict]:
    """(points, {(point, impl): row}) for the fp8 points where the default and the peer both have a time."""
    by = {}
    for r in rows:
        if r.get("us") and "batch" in r and r.get("variant", "").startswith("fp8"):
            by[(r["case"], r["variant"], r["batch"]), r["impl"]] = r
    points = sorted({p for p, i in by if i == "evenflow" and (p, PEER) in by})
    missing = sorted({p for p, i in by} - set(points))
    if missing:
        print(f"left out (no evenflow or {PEER} time): {missing}", file=sys.stderr)
    return points, by


def mode_ratios(points: list[tuple], by: dict) -> dict[str, list[tuple[int, float, float]]]:
    """{mode label: [(point index, speed-up over the peer, max error / the exact mode's)]} for the modes present."""
    res = {}
    for impl, label in MODES:
        vals = [(k, by[p, PEER]["us"] / by[p, impl]["us"],
                 by[p, impl]["max_abs_err"] / by[p, "evenflow"]["max_abs_err"])
                for k, p in enumerate(points) if (p, impl) in by]
        if vals:
            res[label] = vals
    return res


def plot(results: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results).read_text())
    points, by = mode_table(data["rows"])
    if not points:
        raise ValueError(f"{results}: no fp8 point with both an evenflow and a {PEER} row")
    ratios = mode_ratios(points, by)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(points) + 3), 8), sharex=True)
    w = 0.8 / len(ratios)
    for j, (label, vals) in enumerate(ratios.items()):
        ax1.bar([k + j * w for k, _, _ in vals], [v for _, v, _ in vals], w, label=label)
        ax2.bar([k + j * w for k, _, _ in vals], [e for _, _, e in vals], w, label=label)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_ylabel(f"speed-up over {PEER} (higher is better)")
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.set_ylabel("max |err| / the exact mode's (lower is better)")
    ax2.set_xticks([k + 0.4 - w / 2 for k in range(len(points))])
    ax2.set_xticklabels([f"{c} {v} T={t}" for c, v, t in points], rotation=35, ha="right", fontsize=8)
    gpu = data.get("header", {}).get("gpu", "")
    ax1.set_title(f"fused MoE fp8 accumulation modes -- {gpu}")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out) if out else Path(results).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a benchmarks/moe.py JSON with the evenflow, evenflow-promoted / -fastacc and "
                   f"{PEER} rows")
    p.add_argument("--out", default=None, help="PNG path (default: the results' path with .png)")
    args = p.parse_args(argv)
    print(f"written: {plot(args.results, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
