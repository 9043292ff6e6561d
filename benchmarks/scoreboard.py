"""Issues 3, 4 and 5's targets over the committed files of record, card by card, from their rows alone (CPU).

    python benchmarks/scoreboard.py                       # print the table
    python benchmarks/scoreboard.py --write               # (re)write benchmarks/results/targets.md
    python benchmarks/scoreboard.py --results DIR --check # exit 1 if DIR/targets.md is not what the files say

Each ``benchmarks/results/<card>/{decode,router,moe}.json`` is scored by its own benchmark's ``issue_targets`` /
``rescore`` (the code that scores a run as it ends), so the table is derived, never typed: one row a sentence of an
issue (the targets' ``kind``), one column a card, each cell met / checked. Below it, each file's sources
(``source_sha1``) and date, and the count of its missed targets; ``--rescore`` on a benchmark lists them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import decode  # benchmarks/: each benchmark's own scoring
import moe
import router
from evenflow.bench import harness as H

RESULTS = Path(__file__).resolve().parent / "results"
OPERATORS = (("decode", "issue 3 (decode attention)", lambda rows: decode.rescore_rows(rows)[1]),
             ("router", "issue 4 (router GEMM)", router.issue_targets),
             ("moe", "issue 5 (fused MoE)", moe.issue_targets))


def score(results: Path) -> dict:
    """``{operator: {card: (header, targets)}}`` for every card folder of ``results`` holding that operator's file,
    the H200 (the issues' card) first; ``SystemExit`` naming a file that is not its benchmark's."""
    out: dict = {}
    for name, _, scorer in OPERATORS:
        for path in sorted(results.glob(f"*/{name}.json"), key=lambda q: (q.parent.name != "h200", q.parent.name)):
            try:
                res = H.Results.load(path)
                targets = scorer(res.rows)
            except (OSError, ValueError) as e:
                raise SystemExit(f"scoreboard: {path} is not a {name} results file ({e})") from None
            out.setdefault(name, {})[path.parent.name] = (res.header, targets)
    return out


def table(scores: dict) -> str:
    """The markdown page: per issue, a row per sentence (kind) and a column per card, then each file's sources."""
    lines = ["# Issue targets over the files of record",
             "",
             "Written by `benchmarks/scoreboard.py --write` from the committed result files (each scored by its own",
             "benchmark's code); do not edit. A cell is targets met / targets checked on that card, one row a",
             "sentence of the issue; a point that did not run, or whose peer did not, counts as missed. Issue 5's two",
             "1.5x sentences both check Hy3 TP8 fp8-tensor at T <= 2. `python benchmarks/<name>.py --rescore FILE`",
             "lists each miss."]
    for name, title, _ in OPERATORS:
        cards = scores.get(name, {})
        if not cards:
            continue
        kinds = list(dict.fromkeys(t["kind"] for _, ts in cards.values() for t in ts))
        lines += ["", f"## {title}", "", "| target | " + " | ".join(cards) + " |", "|---" * (len(cards) + 1) + "|"]
        for k in kinds:
            cells = []
            for _, ts in cards.values():
                these = [t for t in ts if t["kind"] == k]
                cells.append(f"{sum(t['ok'] for t in these)} / {len(these)}" if these else "-")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("| **all** | " + " | ".join(f"**{sum(t['ok'] for t in ts)} / {len(ts)}**"
                                               for _, ts in cards.values()) + " |")
        lines += [""] + [f"- `{card}/{name}.json`: sources `{h.get('source_sha1', '?')}`, {h.get('gpu', '?')}, "
                         f"{str(h.get('date', '?'))[:10]}; {sum(not t['ok'] for t in ts)} missed"
                         for card, (h, ts) in cards.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (one sub-folder a card)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="write <results>/targets.md")
    g.add_argument("--check", action="store_true", help="exit 1 where <results>/targets.md differs from the files")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        raise SystemExit(f"--results: {args.results} is not a folder")
    page = table(score(args.results))
    target = args.results / "targets.md"
    if args.write:
        target.write_text(page)
        print(f"written: {target}")
    elif args.check:
        if not target.is_file() or target.read_text() != page:
            print(f"{target} is not what the result files say: run benchmarks/scoreboard.py --write", file=sys.stderr)
            return 1
        print(f"{target}: up to date")
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
