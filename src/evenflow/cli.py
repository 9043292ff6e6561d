"""The ``evenflow`` command: ``info``, ``demo`` and ``bench <name>``."""
from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

# Operator families that provide ``<family>.demo.run_demo(ctx)``, in the order of a decode step.
DEMO_FAMILIES = ("attention", "router", "moe", "integrations")


def _import_evenflow():
    import evenflow  # selects GPU or interpreter before any kernel is imported

    return evenflow


def cmd_info(_args) -> int:
    import torch
    import triton

    ev = _import_evenflow()
    from evenflow import _runtime

    print(f"evenflow {ev.__version__}")
    print(f"python   {sys.version.split()[0]}")
    print(f"torch    {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"triton   {triton.__version__}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        cc = (p.major, p.minor)
        mem = p.total_memory / 2**30
        print(f"device   {p.name}, {p.multi_processor_count} SMs, {mem:.0f} GiB, sm_{p.major}{p.minor}")
        fp8 = (p.major, p.minor) >= (8, 9)
    else:
        cc, fp8 = None, True
    if _runtime.interpreting():
        backend = "CPU (Triton interpreter: correct but slow; timings mean nothing)"
    elif torch.cuda.is_available():
        backend = "GPU (Triton compiler)"
    else:
        backend = "none: no CUDA GPU and TRITON_INTERPRET is off, so no kernel can run (set TRITON_INTERPRET=1)"
    print(f"backend  {backend}")
    print(f"exports  {', '.join(sorted(ev.__all__)) or '(none yet)'}")
    print("operators:")
    rows = [
        ("qk_norm_rope_store_kv", "bf16 qkv -> bf16 or fp8 q; bf16 or fp8 e4m3 KV cache", "attention"),
        ("decode_attention", "bf16 KV; fp8 e4m3 KV" + ("" if fp8 else " (needs sm_89+)"), "attention"),
        ("prefill_attention", "bf16 q; bf16 or fp8 e4m3 KV", "attention"),
        ("router_gemm / route", "bf16 x, fp32 weight (split into bf16 terms)", "router"),
        ("fused_moe", "bf16; fp8 per-tensor; fp8 block-128" + ("" if fp8 else " (fp8 needs sm_89+)"), "moe"),
    ]
    for name, dtypes, fam in rows:
        try:
            importlib.import_module(f"evenflow.{fam}.demo")
            state = "importable"
        except ImportError as e:
            state = f"not built yet ({e.name})"
        print(f"  {name:22s} {state:14s} {dtypes}")
    if cc is not None and cc < (8, 0):
        print("note: evenflow kernels need sm_80 or newer (bf16 tensor cores)")
    return 0


def _fmt_us(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v if len(v) < 40 else v[:37] + "..."
    return f"{v:.1f}"


def demo_table(rows: list[dict]) -> str:
    """The demo's Markdown table, a row per check; a peer that was not timed shows its reason cut short there, so
    each such reason follows the table whole (nothing a peer failed on is hidden). A check whose ``ok`` is None did not
    run (an optional dependency missing): "not run"."""
    from evenflow.bench.harness import md_cell

    lines = ["| operator | case | check | ok | us | floor us | peers (us) |", "|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        peers = r.get("peers") or {}
        ok = "not run" if r.get("ok", False) is None else "yes" if r.get("ok") else "NO"
        cells = [r.get("operator"), r.get("case"), r.get("check"), ok,
                 _fmt_us(r.get("us")), _fmt_us(r.get("floor_us")),
                 ", ".join(f"{k} {_fmt_us(v)}" for k, v in peers.items()) or "-"]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
        notes += [f"- {r.get('operator')} / {k}: {v}" for k, v in peers.items() if isinstance(v, str)]
    if notes:
        lines += ["", "peers not timed:", *notes]
    return "\n".join(lines)


def cmd_demo(args) -> int:
    ev = _import_evenflow()
    import torch

    from evenflow import _runtime
    from evenflow.bench import harness

    gpu = torch.cuda.is_available() and not _runtime.interpreting()
    ctx = SimpleNamespace(device="cuda" if gpu else "cpu", gpu=gpu, harness=harness)
    print(f"evenflow {ev.__version__} demo — one Qwen3-30B-A3B decode step")
    if gpu:
        print(f"on {torch.cuda.get_device_name(0)}: each operator is checked against its PyTorch reference, "
              "then timed as CUDA-graph replays beside its peers and the physical floor.")
    else:
        print("no GPU here: tiny shapes run through the Triton interpreter on the CPU and are checked against "
              "their PyTorch references. Timings on the CPU mean nothing, so none are shown.")
    all_rows = []
    for fam in DEMO_FAMILIES:
        try:
            mod = importlib.import_module(f"evenflow.{fam}.demo")
        except ImportError as e:
            print(f"\n[{fam}] not available: {e}")
            continue
        t0 = time.time()
        print(f"\n[{fam}] running ...", flush=True)
        try:
            rows = mod.run_demo(ctx)
        except Exception:  # a broken operator must not hide the others' results
            traceback.print_exc()
            rows = [{"operator": fam, "case": "-", "check": "raised (see traceback above)", "ok": False}]
        print(f"[{fam}] done in {time.time() - t0:.1f}s", flush=True)
        all_rows += rows
    print("\n" + demo_table(all_rows))
    skipped = sum(r.get("ok", False) is None for r in all_rows)
    failures = sum(r.get("ok", False) is False for r in all_rows)
    if not all_rows:
        print("no operators ran")
        return 1
    ran = len(all_rows) - skipped
    print(f"\n{ran - failures}/{ran} checks passed" + (f" ({skipped} not run)" if skipped else ""))
    return 1 if failures else 0


def _benchmarks_dir() -> Path:
    env = os.environ.get("EVENFLOW_BENCHMARKS")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "benchmarks").is_dir() and (parent / "pyproject.toml").is_file():
            return parent / "benchmarks"
    cwd = Path.cwd() / "benchmarks"
    if cwd.is_dir():
        return cwd
    raise SystemExit("evenflow bench: cannot find the benchmarks/ folder; run from a source checkout "
                     "or set EVENFLOW_BENCHMARKS")


def cmd_bench(args, rest: list[str]) -> int:
    bdir = _benchmarks_dir()
    names = sorted(p.stem for p in bdir.glob("*.py") if not p.stem.startswith("_"))
    if args.name is None:
        asked = bool({"-h", "--help"} & set(rest))
        print("usage: evenflow bench NAME [its options]  (evenflow bench NAME --help: NAME's options)\n"
              f"benchmarks: {', '.join(names)}", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    if args.name not in names:
        print(f"evenflow bench: unknown benchmark {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [str(bdir / f"{args.name}.py"), *rest]
    sys.path.insert(0, str(bdir))
    from evenflow.bench.harness import NoGPU

    try:
        runpy.run_path(str(bdir / f"{args.name}.py"), run_name="__main__")
    except NoGPU as e:  # (the harness's refusal to time without a GPU: one line, not a traceback)
        print(f"evenflow bench {args.name}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="evenflow", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, device, operators and dtypes supported here")
    sub.add_parser("demo", help="run every operator on one Qwen3-30B-A3B decode step, checked and timed")
    # (no help option of its own: `evenflow bench router --help` is the router benchmark's)
    b = sub.add_parser("bench", add_help=False, help="run benchmarks/<name>.py (extra arguments are passed on)")
    b.add_argument("name", nargs="?")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if rest:
        p.error(f"unrecognised arguments: {' '.join(rest)}")
    return {"info": cmd_info, "demo": cmd_demo}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
