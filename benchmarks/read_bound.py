"""Read bound: the share of its floor the simplest read of a point's own bytes reaches, as a bound on targets.

    python benchmarks/read_bound.py [--quick] [--from DIR] [--ops moe,decode] [--out DIR] [--no-plot]

A ``frac_of_floor`` target asks for a time near bytes / copy bandwidth. At a few MB that time is a few
microseconds, and a kernel launch, the first DRAM round trip and the ramp of the memory system to full
bandwidth are not small beside it. This script measures, for every ``evenflow`` row of the MoE and
decode result files in ``--from`` (default: this GPU's results folder), how long the simplest kernel
that does nothing but read the floor's bytes once takes:

* bytes: the row's own (``floor_bytes`` on decode rows; ``floor_us`` x the file's ``copy_TBps`` on MoE
  rows, whose floor is bytes-bound up to the batches where ``6 H I`` FLOPs a pair at the file's matmul
  rate take longer: those rows are reported as compute-bound and not timed);
* caches as the operator's benchmark had them: as many copies as the row says it cycled
  (``rotated`` / ``rotations``), one call per copy in one CUDA graph, back to back (``time_graph``);
* the kernel: contiguous int32 loads summed in registers, one value stored a program; the best of a
  few shapes (one 16 KB or 64 KB block a program, or 2-8 programs an SM striding over the buffer) and
  two launches: plain, and programmatic dependent launch waiting at its top for the call ahead
  (``pdl_enter``, as evenflow's kernels wait before their first data-dependent read).

``read-once`` rows: that time, this run's floor for the same bytes, and ``frac_of_floor`` = floor /
time: the most of the floor a kernel that reads the point's bytes once, launched in either way, reached
in this run. A target above it is out of reach for the point unless some kernel reads memory faster than
these (BENCH.md: plain Triton streaming reads reach 4.3-4.6 TB/s against a 4.2-4.3 copy) or reads
before the kernel ahead ends (which an operator whose addresses come from that kernel cannot); it is
a measured bound, not a proof. The floor counts output bytes written too, which the read kernel reads
instead (the same count).
MoE rows also get ``read-chain2``: the same bytes read by two kernels chained under PDL, 2/3 then
1/3 (an expert's gate-up and down weights), the second waiting for the first, as a layer's down GEMM
waits for its activations. Every row carries the source file's ``evenflow`` figure
(``record_frac``, from ``record_sha``'s run: another run than this one) for the plot.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from evenflow._checks import check_tensor
from evenflow._kernels.common import pdl_enter
from evenflow._runtime import num_sms, pdl_kwargs, pdl_supported
from evenflow.bench import harness as H

# a point is (op, case, variant, batch or None, bytes, copies, record frac, record source digest)
OPS = ("moe", "decode")
MOE_FILE, DECODE_FILE = "moe.json", "decode.json"
# read shapes: (name, BLOCK int32 elements, programs an SM or 0 = one block a program, warps)
SHAPES = (("block16k", 4096, 0, 4), ("block64k", 16384, 0, 8), ("stride2", 4096, 2, 4), ("stride4", 4096, 4, 4),
          ("stride8", 2048, 8, 4))
QUICK_SHAPES = (("block16k", 4096, 0, 4), ("stride4", 4096, 4, 4))
QUICK_BATCHES = (1, 8, 128)  # --quick: these MoE batches only (every decode case)
CHAIN_SPLIT = 2 / 3  # MoE gate-up share of an expert's weight bytes: 2 I H of 3 I H


@triton.jit
def read_sum_kernel(p_buf, p_out, n, BLOCK: tl.constexpr, STRIDED: tl.constexpr, PDL: tl.constexpr):
    """Sum of int32 elements [0, n) (wrapping), one partial a program in ``p_out[pid]``: with STRIDED,
    program i reads blocks i, i + programs, ...; else block i only. Nothing is read past n."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    if STRIDED:
        # int64 offsets: the last step past n must not wrap (the launcher also bounds n + grid * BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid.to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
            acc += tl.load(p_buf + start + o, mask=start + o < n, other=0)
        tl.store(p_out + pid, tl.sum(acc, axis=0))
    else:
        start = pid * BLOCK
        tl.store(p_out + pid, tl.sum(tl.load(p_buf + start + o, mask=start + o < n, other=0), axis=0))


def read_grid(n: int, block: int, per_sm: int, sms: int) -> int:
    """Programs of one read of ``n`` >= 1 elements: one a block, or ``per_sm`` an SM, never more than blocks."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    blocks = triton.cdiv(n, block)
    return blocks if per_sm == 0 else min(blocks, per_sm * sms)


def check_int32_offsets(n: int, grid: int, block: int) -> None:
    """The block kernel's offsets are int32 (pid * BLOCK + arange): n plus a grid's step must fit."""
    if n + grid * block > 2**31 - 1:
        raise ValueError(f"buf: {n} int32 elements; at most 2^31 - 1 - {grid * block} with this shape")


def launch_read(buf: torch.Tensor, out: torch.Tensor, shape: tuple, pdl: bool, sms: int) -> None:
    """One read of all of ``buf`` (int32, 1-D, contiguous) with ``shape`` from SHAPES; partials into ``out``."""
    check_tensor("buf", buf, dtypes=[torch.int32], ndim=1, contiguous=True)
    check_tensor("out", out, dtypes=[torch.int32], ndim=1, contiguous=True, device=buf.device)
    _, block, per_sm, warps = shape
    n = buf.numel()
    grid = read_grid(n, block, per_sm, sms)
    check_int32_offsets(n, grid, block)
    if out.numel() < grid:
        raise ValueError(f"out: {out.numel()} partials for a grid of {grid}")
    read_sum_kernel[(grid,)](buf, out, n, BLOCK=block, STRIDED=per_sm > 0, num_warps=warps, **pdl_kwargs(pdl))


def _field(row: dict, key: str, where: str):
    if row.get(key) is None:
        what = "/".join(str(row.get(k)) for k in ("case", "variant", "batch") if k in row)
        raise ValueError(f"{where}: row {what} has no {key!r}")
    return row[key]


def points_from_results(results_dir: Path, ops=OPS, moe_cases: dict | None = None) -> list[dict]:
    """The ``evenflow`` rows of the result files to bound (see the module docstring), as dicts with
    op, case, variant, batch, bytes, copies, record_frac, record_sha; compute-bound MoE rows get
    ``skip`` (why) and ``bytes`` None instead of being timed. ``moe_cases``: the MoE benchmark's cases
    (``benchmarks/moe.py``'s CASES), required with "moe" in ``ops``."""
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"ops: unknown {bad}; choose from {OPS}")
    if "moe" in ops and not moe_cases:
        raise ValueError("moe_cases: the MoE benchmark's cases are needed to tell compute-bound MoE rows apart")
    pts = []
    if "decode" in ops:
        data = json.loads((results_dir / DECODE_FILE).read_text())
        for r in data["rows"]:
            if r.get("impl") != "evenflow" or "us" not in r:
                continue
            pts.append(dict(op="decode", case=r["case"], variant=r["variant"], batch=None,
                            bytes=int(_field(r, "floor_bytes", DECODE_FILE)), copies=int(r.get("rotations", 1)),
                            record_frac=r["frac_of_floor"], record_sha=data["header"].get("source_sha1")))
    if "moe" in ops:
        data = json.loads((results_dir / MOE_FILE).read_text())
        ceil = data["ceilings"]
        for r in data["rows"]:
            if r.get("impl") != "evenflow" or "us" not in r:
                continue
            floor = _field(r, "floor_us", MOE_FILE)
            pt = dict(op="moe", case=r["case"], variant=r["variant"], batch=int(_field(r, "batch", MOE_FILE)),
                      bytes=int(round(floor * _field(ceil, "copy_TBps", MOE_FILE + " ceilings") * 1e6)),
                      copies=int(r.get("rotated", 1)), record_frac=r["frac_of_floor"],
                      record_sha=data["header"].get("source_sha1"))
            case = moe_cases.get(r["case"])
            if case is None:
                raise ValueError(f"{MOE_FILE}: case {r['case']!r} not among the MoE benchmark's cases")
            rate = _field(ceil, "bf16_TFLOPs" if r["variant"] == "bf16" else "fp8_TFLOPs", MOE_FILE + " ceilings")
            flops_us = 6 * case.hidden * case.inter * _field(r, "mean_local_pairs", MOE_FILE) / (rate * 1e12) * 1e6
            if flops_us >= 0.999 * floor:  # the floor is a FLOP time there: no bytes to read
                pt["skip"] = "compute-bound floor (FLOPs at the matmul rate), no read bound"
                pt["bytes"] = None
            pts.append(pt)
    return pts


def buffers(nbytes: int, copies: int, device) -> list[torch.Tensor]:
    """``copies`` int32 buffers of ones holding at least ``nbytes`` each (the decode benchmark's read-once rows too)."""
    n = max(1, math.ceil(nbytes / 4))
    return [torch.ones(n, dtype=torch.int32, device=device) for _ in range(copies)]


def _partials(n: int, shapes, sms: int, device) -> torch.Tensor:
    """A partials buffer large enough for a read of ``n`` elements with any of ``shapes``."""
    return torch.empty(max(read_grid(n, s[1], s[2], sms) for s in shapes), dtype=torch.int32, device=device)


def fastest_read(copies: list[list[torch.Tensor]], shapes, sms: int, pdls=(False, True)) -> tuple[float, str]:
    """(µs, shape and launch) of the fastest way, over ``shapes`` and the launches ``pdls`` (PDL only where the
    GPU has it), to read each copy's buffers one kernel after another (graph replay, one call a copy: a
    read-once of one buffer, or a chain of dependent reads of its parts)."""
    out = _partials(max(b.numel() for c in copies for b in c), shapes, sms, copies[0][0].device)
    best = (math.inf, "")
    for shape in shapes:
        for pdl in pdls:
            def call(bufs, shape=shape, pdl=pdl):
                for b in bufs:
                    launch_read(b, out, shape, pdl, sms)
            us = H.time_graph([lambda c=c: call(c) for c in copies])
            best = min(best, (us, f"{shape[0]} {'pdl' if pdl else 'plain'}"))
    return best


def chain_parts(buf: torch.Tensor) -> list[torch.Tensor]:
    """``buf`` as a MoE layer reads it: the first CHAIN_SPLIT (gate-up weights), then the rest (down)."""
    n = buf.numel()
    if n < 2:
        return [buf]
    cut = max(1, min(n - 1, int(n * CHAIN_SPLIT)))
    return [buf[:cut], buf[cut:]]


def check_read(sms: int, device, pdls=(False, True), shapes=SHAPES) -> None:
    """Every shape of ``shapes`` and launch sums a buffer exactly before anything is timed."""
    buf = torch.randint(-1000, 1000, (3 * 16384 * sms + 12345,), dtype=torch.int32, device=device)
    want = int(buf.long().sum())
    out = _partials(buf.numel(), shapes, sms, device)
    for shape in shapes:
        for pdl in pdls:
            out.zero_()
            launch_read(buf, out, shape, pdl, sms)
            got = int(out[:read_grid(buf.numel(), shape[1], shape[2], sms)].long().sum())
            if got != want:
                raise RuntimeError(f"read kernel {shape[0]} pdl={pdl}: sum {got}, expected {want}")


def plot(rows: list[dict], path: Path) -> None:
    """Read bound against bytes, per operator, with the record's evenflow figure and the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, op in zip(axes, OPS):
        sel = [r for r in rows if r.get("op") == op and r["impl"] == "read-once" and "us" in r]
        if not sel:
            continue
        mb = [r["bytes"] / 1e6 for r in sel]
        ax.scatter(mb, [r["frac_of_floor"] for r in sel], marker="^", color="tab:blue",
                   label="read-once (this run): the simplest read of the point's bytes")
        ax.scatter(mb, [r["record_frac"] for r in sel], marker="o", facecolors="none", edgecolors="tab:red",
                   label="evenflow (its result file's run)")
        if op == "moe":
            ch = [r for r in rows if r.get("op") == op and r["impl"] == "read-chain2" and "us" in r]
            ax.scatter([r["bytes"] / 1e6 for r in ch], [r["frac_of_floor"] for r in ch], marker="v",
                       color="tab:green", s=14, label="read-chain2 (two kernels under PDL)")
        for y, ls in ((0.85, "--"), (0.75, ":"), (0.6, "-.")):
            ax.axhline(y, color="grey", ls=ls, lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("bytes of the floor (MB)")
        ax.set_title(f"{op}: frac_of_floor (targets 0.85 / 0.75 / 0.6)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("frac_of_floor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = H.parse_args(__doc__, argv, extra=lambda ap: (
        ap.add_argument("--from", dest="src", default=None,
                        help="folder of moe.json / decode.json (default: this GPU's results folder)"),
        ap.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))))
    H._require_cuda("read_bound")
    ops = tuple(o for o in p.ops.split(",") if o)  # checked by points_from_results
    src = Path(p.src) if p.src else H.results_dir(None)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import moe as bench_moe  # the MoE benchmark's cases (hidden, intermediate sizes)

    pts = points_from_results(src, ops, bench_moe.CASES)
    if p.quick:
        pts = [pt for pt in pts if pt["batch"] is None or pt["batch"] in QUICK_BATCHES]
    dev = torch.device("cuda")
    sms = num_sms(dev)
    shapes = QUICK_SHAPES if p.quick else SHAPES
    pdls = (False, True) if pdl_supported(dev) else (False,)
    check_read(sms, dev, pdls)
    ceil = H.measure_ceilings()
    res = H.Results("read_bound", ceilings=ceil, out=p.out, meta={
        "source_files": {op: f"{src.name}/{MOE_FILE if op == 'moe' else DECODE_FILE}" for op in ops},
        "read": "int32 loads summed in registers; best of " + ", ".join(s[0] for s in shapes)
                + f" x ({', '.join('pdl' if x else 'plain' for x in pdls)} launch); graph replay cycling the "
                  "row's copies",
        "frac_of_floor": "floor (this run's copy_TBps) / read time: what the simplest read of the point's "
                         "bytes reached, launched in these ways"})
    labels = [f"{pt['op']} {pt['case']} {pt['variant']} {pt['batch'] or ''} "
              + (f"{pt['bytes'] / 1e6:.1f} MB" if pt["bytes"] else "(skipped)") for pt in pts]
    for i, _ in enumerate(H.progress(labels, "read bound")):
        pt = pts[i]
        common = dict(op=pt["op"], case=pt["case"], variant=pt["variant"],
                      **({"batch": pt["batch"]} if pt["batch"] is not None else {}),
                      bytes=pt["bytes"], copies=pt["copies"], record_frac=pt["record_frac"],
                      record_sha=pt["record_sha"])
        if "skip" in pt:
            res.add_error(impl="read-once", error=pt["skip"], **common)
            continue
        fl = H.floor_us(pt["bytes"], ceilings=ceil)
        bufs = buffers(pt["bytes"], pt["copies"], dev)
        us, how = fastest_read([[b] for b in bufs], shapes, sms, pdls)
        res.add(impl="read-once", us=us, floor_us=fl, read=how, **common)
        if pt["op"] == "moe":  # the second kernel waits for the first: under PDL where there is PDL
            us2, how2 = fastest_read([chain_parts(b) for b in bufs], shapes, sms, pdls[-1:])
            res.add(impl="read-chain2", us=us2, floor_us=fl, read=how2, **common)
        del bufs
        torch.cuda.empty_cache()
    path = res.finish(plot=False, columns=["op", "case", "variant", "batch", "impl", "us", "floor_us",
                                            "frac_of_floor", "record_frac", "bytes", "copies", "read"])
    if not p.no_plot:  # finish() printed the table
        try:
            plot(res.rows, path.with_suffix(".png"))
        except ImportError as e:
            print(f"[read_bound] no plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
