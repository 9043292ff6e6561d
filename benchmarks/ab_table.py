"""Print an A/B table (µs and frac_of_floor per impl) from a benchmark result file, or from the files of several
passes of one A/B run.

    python benchmarks/ab_table.py benchmarks/results/h200/decode.json [--impls a,b,c]
    python benchmarks/ab_table.py p1/decode.json p2/decode.json --impls evenflow,evenflow-g-mb8

One line per measured point (case, variant and the batch or M where the file has them) of the first file, one
column per impl (its µs and frac_of_floor there), then each impl's speed-up over the first (its µs / theirs: above 1
means the first impl is slower), in every pass given (an A/B run's passes, e.g. the second with the rows reversed,
each speed-up taken within its own pass): for reading a device round's output at a glance. A point or impl a pass
lacks, or holds as an error, shows "—".
"""
import argparse
import json
import sys


def _points(rows: list[dict]) -> dict[tuple, dict]:
    by: dict[tuple, dict] = {}
    for r in rows:
        if "us" in r:
            key = (r["case"], r.get("variant", ""), r.get("batch", r.get("M", "")))
            if r["impl"] in by.setdefault(key, {}):
                raise ValueError(f"two rows for {key} {r['impl']}: the file has a key this table does not show")
            by[key][r["impl"]] = r
    return by


def table(rows: list[dict], impls: list[str] | None = None, passes: tuple = ()) -> str:
    """``rows``: a result file's rows; ``passes``: the rows of further passes of the same run, whose speed-ups
    follow the first's, one column an impl and pass."""
    impls = impls or list(dict.fromkeys(r["impl"] for r in rows if "us" in r))
    runs = [_points(rows)] + [_points(p) for p in passes]
    tags = [""] if not passes else [f" (p{k + 1})" for k in range(len(runs))]
    head = "| case | variant | batch/M | " + " | ".join(f"{i} µs (frac)" for i in impls)
    head += "".join(f" | speed-up of {i} over {impls[0]}{t}" for i in impls[1:] for t in tags) + " |"
    lines = [head, "|" + "---|" * (3 + len(impls) + (len(impls) - 1) * len(tags))]
    for key, got in runs[0].items():
        case, variant, batch = key  # batch: the batch or M column
        cells = [f"{got[i]['us']:.1f} ({got[i].get('frac_of_floor', float('nan')):.2f})" if i in got else "—"
                 for i in impls]
        ratios = []
        for i in impls[1:]:
            for run in runs:
                g = run.get(key, {})
                base = g.get(impls[0])
                ratios.append(f"{base['us'] / g[i]['us']:.3f}" if base and i in g else "—")
        lines.append(f"| {case} | {variant} | {batch} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="a result file, or one a pass of an A/B run, in pass order")
    p.add_argument("--impls", default=None, help="comma-separated, in column order (default: as found)")
    a = p.parse_args(argv)
    runs = []
    for f in a.files:
        try:
            runs.append(json.load(open(f))["rows"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"files: {f}: not a result file ({e})")
    impls = a.impls.split(",") if a.impls else None
    found = {r["impl"] for r in runs[0]}
    missing = [i for i in impls or () if i not in found]
    if missing:
        p.error(f"impls: {', '.join(missing)} not in {a.files[0]} (impls: {', '.join(sorted(found))})")
    print(table(runs[0], impls, tuple(runs[1:])))


if __name__ == "__main__":
    sys.exit(main())
