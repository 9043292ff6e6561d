"""Print an A/B table (µs and frac_of_floor per impl) from a benchmark result file.

    python benchmarks/ab_table.py benchmarks/results/h200/decode.json [--impls a,b,c]

One line per measured point (case, variant and the batch or M where the file has them), one
column per impl, then each impl's speed-up over the first (its µs / theirs: above 1 means the
first impl is slower): for reading a device round's output at a glance.
"""
import argparse
import json
import sys


def table(rows: list[dict], impls: list[str] | None = None) -> str:
    impls = impls or list(dict.fromkeys(r["impl"] for r in rows if "us" in r))
    by: dict[tuple, dict] = {}
    for r in rows:
        if "us" in r:
            key = (r["case"], r.get("variant", ""), r.get("batch", r.get("M", "")))
            if r["impl"] in by.setdefault(key, {}):
                raise ValueError(f"two rows for {key} {r['impl']}: the file has a key this table does not show")
            by[key][r["impl"]] = r
    head = "| case | variant | batch/M | " + " | ".join(f"{i} µs (frac)" for i in impls)
    head += "".join(f" | speed-up of {i} over {impls[0]}" for i in impls[1:]) + " |"
    lines = [head, "|" + "---|" * (3 + len(impls) + len(impls) - 1)]
    for (case, variant, batch), got in by.items():  # batch: the batch or M column
        cells = [f"{got[i]['us']:.1f} ({got[i].get('frac_of_floor', float('nan')):.2f})" if i in got else "—"
                 for i in impls]
        base = got.get(impls[0])
        ratios = [f"{base['us'] / got[i]['us']:.3f}" if base and i in got else "—" for i in impls[1:]]
        lines.append(f"| {case} | {variant} | {batch} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--impls", default=None, help="comma-separated, in column order (default: as found)")
    a = p.parse_args(argv)
    rows = json.load(open(a.file))["rows"]
    print(table(rows, a.impls.split(",") if a.impls else None))


if __name__ == "__main__":
    sys.exit(main())
