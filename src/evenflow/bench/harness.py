"""The one benchmark harness every evenflow benchmark uses (see BENCH.md in the design docs).

What it guarantees:

* Ceilings measured in the same run: device copy bandwidth (read + write bytes of a
  large device-to-device copy), dense bf16 and fp8 matmul rates, and the cost of an
  empty kernel inside a CUDA graph. Floors are computed from these, never from
  datasheets. The copy is timed after COPY_WARM_MS of copies, as the best of COPY_READINGS medians (round AN: one
  cold median scattered by ~2% on a fresh machine, and one run's read 3.94 TB/s, 6% under later calls' 4.21).
* Timings are medians. ``time_graph`` captures one call per rotated input copy in a
  single CUDA graph and divides the replay time by the number of calls: that is how
  serving engines run decode-step operators, and rotation keeps a case that fits in
  L2 from being timed out of cache; ~10 ms of warm replays precede the timed ones
  ("warm-up excluded"). ``time_eager`` cycles through the same copies with L2 flushed
  before each timed call.
* Every impl's output is checked (finite, close to the reference) before it is timed.
* Results go to ``benchmarks/results/<gpu>/<name>.json`` in the fixed schema, with a
  markdown table (printed last) and a PNG plot beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from evenflow._runtime import gpu_slug  # re-exported: the results folders are named by it

__all__ = [
    "PeerUnavailable", "header", "measure_ceilings", "measure_copy_TBps", "time_graph", "time_eager", "floor_us",
    "Floor", "Results", "progress", "check_output", "parse_args", "gpu_slug", "results_dir",
]


class PeerUnavailable(Exception):
    """A peer that cannot run here (not installed, fails to build); becomes an ``error`` row."""


def error_line(e: BaseException, limit: int = 300) -> str:
    """The reason an ``error`` row keeps for ``e``: its message's first line, and where a later line names an error
    (a JIT build's compiler output, whose first line only says the build failed) the first such line too; cut at
    ``limit`` characters (``repr(e)`` for an empty message)."""
    text = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not text:
        return repr(e)[:limit]
    cause = next((ln for ln in text[1:] if "error" in ln.lower()), None)
    return (text[0] + (f" ... {cause}" if cause else ""))[:limit]


# ----------------------------------------------------------------------------- header

def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("EVENFLOW_COMMIT", "unknown")


def source_digest() -> str:
    """sha1 (12 hex) of evenflow's Python sources, its tuned-config tables (``*.json``) and
    the benchmark scripts, paths included.

    Identifies the code a result came from where git is absent (a copied tree on a GPU
    machine). To match a result to a commit, check the commit out and call this.
    """
    import hashlib

    pkg = Path(__file__).resolve().parents[1]
    roots = [pkg] + ([pkg.parents[1] / "benchmarks"] if (pkg.parents[1] / "benchmarks").is_dir() else [])
    h = hashlib.sha1()
    for root in roots:
        for f in sorted([*root.rglob("*.py"), *(root.rglob("*.json") if root == pkg else ())]):
            if "__pycache__" in f.parts:
                continue
            h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def header() -> dict:
    """Machine header written into every result file."""
    import triton

    import evenflow

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu, sms = props.name, props.multi_processor_count
    else:
        gpu, sms = "cpu (Triton interpreter)", 0
    return {
        "gpu": gpu, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda or "none", "evenflow": evenflow.__version__, "commit": _git_commit(),
        "source_sha1": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0],
    }


def write_rows(out: str | os.PathLike, filename: str, rows: Sequence[dict], *, indent: int | None = 1,
               **extra) -> Path:
    """A diagnostic's rows as JSON, ``{"header": header(), **extra, "rows": rows}``, at ``out/filename`` (the folder
    made if missing): for probes, sweeps and splits whose output is evidence for the notes, not a result file of
    record. ``indent=None`` writes one line (large timelines)."""
    path = Path(out) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"header": header(), **extra, "rows": list(rows)}, f, indent=indent)
    return path


def results_dir(out: str | os.PathLike | None = None) -> Path:
    """Where result files go: ``out`` if given, else ``$EVENFLOW_RESULTS``, else the repo's results/<gpu>."""
    if out:
        return Path(out)
    if os.environ.get("EVENFLOW_RESULTS"):
        return Path(os.environ["EVENFLOW_RESULTS"])
    root = Path(__file__).resolve().parents[3]
    base = root / "benchmarks" / "results" if (root / "benchmarks").is_dir() else Path.cwd() / "evenflow-results"
    return base / gpu_slug()


# ----------------------------------------------------------------------------- timing

class NoGPU(RuntimeError):
    """A timing asked for on a machine without a CUDA GPU (``evenflow bench`` says it in one line)."""


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise NoGPU(f"{what} needs a CUDA GPU; timings on the CPU interpreter mean nothing")


_L2_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    global _L2_FLUSH
    if _L2_FLUSH is None:
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        _L2_FLUSH = torch.empty(max(2 * l2, 128 << 20) // 4, dtype=torch.int32, device="cuda")
    _L2_FLUSH.zero_()


def time_eager(fns: Sequence[Callable[[], object]] | Callable[[], object], *, reps: int = 50,
               warmup: int = 5) -> float:
    """Median µs of one eager call, cycling through ``fns``; L2 flushed before each call."""
    _require_cuda("time_eager")
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _flush_l2()
        start[i].record()
        fns[i % len(fns)]()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))
    return times[len(times) // 2]


def kernel_times(fns: Sequence[Callable[[], object]] | Callable[[], object], reps: int, *,
                 warmup: bool = True) -> tuple[list[tuple[str, float]], float]:
    """Device time of the kernels a call launches, under ``torch.profiler`` (CUDA activity): [(kernel name, mean
    device µs per call)] in launch order (launches of one name summed), and their sum. ``fns`` cycled ``reps`` times,
    each run once before the trace (compiles, warm-up) unless ``warmup=False``. The sum is the GPU's work whatever
    the host adds between launches: the part of an eagerly timed call that the kernels own."""
    from torch.profiler import ProfilerActivity, profile

    _require_cuda("kernel_times")
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if warmup:
        for f in fns:
            f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(reps):
            fns[r % len(fns)]()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] = total.get(ev.name, 0.0) + ev.device_time
    rows = [(name, t / reps) for name, t in total.items()]
    return rows, sum(t for _, t in rows)


WARM_US = 10_000.0  # GPU time of warm replays before a graph is timed
WARM_MAX_REPLAYS = 200  # at most this many of them (µs-long graphs would otherwise take thousands)
COPY_WARM_MS = 1000.0  # GPU time of copies measure_ceilings runs before it times the copy ceiling
COPY_READINGS = 5  # medians of COPY_REPS copies each; the copy ceiling is the best of them
COPY_REPS = 20
LAUNCH_CALLS = 200  # empty kernels in the graph empty_launch_us times (round BF4: 20 scattered the term by 0.3 µs)
GRAPH_WARM = 12  # graphs measure_ceilings makes and drops first (round BG3: a process's first six ran ~25% faster)
COPY_DRIFT = 0.02  # a run's two copy readings this far apart are pointed out (Results.settle_copy)


def capture_graph(fns: Sequence[Callable[[], object]] | Callable[[], object], *,
                  min_calls: int = 8) -> tuple[torch.cuda.CUDAGraph, int]:
    """(CUDA graph, calls in it): ``fns`` run once outside the capture (compiles, allocator),
    then captured in order, the list repeated until the graph holds at least ``min_calls``."""
    _require_cuda("capture_graph")
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    calls = fns * max(1, math.ceil(min_calls / len(fns)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles, allocator) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    return g, len(calls)


def time_graph(fns: Sequence[Callable[[], object]] | Callable[[], object], *, reps: int = 30,
               min_calls: int = 8, agree_warm: Callable[[int], int] | None = None) -> float:
    """Median µs per call of a CUDA graph that holds one call per entry of ``fns`` (per input copy or draw).

    The list is repeated until the graph holds at least ``min_calls`` calls, so the
    graph launch itself is amortised; with several copies, consecutive calls touch
    different memory, so a case that fits in L2 is not timed from cache.
    ``agree_warm``: for graphs that hold collectives, maps this process's count of warm
    replays to the count every process uses (e.g. the max over ranks): each process derives
    its own from its own replay time, and replays of a graph with an all-reduce in it that
    differ in number between ranks wait on each other forever.
    """
    g, n_calls = capture_graph(fns, min_calls=min_calls)
    # Warm replays for ~10 ms of GPU time before timing: a point's first impl follows host
    # work (allocation, weight splits, capture) and was timed up to ~6% slower than the same
    # kernel timed later in the same point (router round K4, µs-long calls), which fits a GPU
    # clock still ramping up; a few ms of back-to-back replays settle it. (Round P6: the 1-8% gaps
    # left after that are run-to-run spread; the first-timed row is not consistently the slower.)
    _warm(g, agree_warm)
    us = _median_ms(g.replay, reps) * 1e3 / n_calls
    del g
    return us


def _warm(g: torch.cuda.CUDAGraph, agree: Callable[[int], int] | None = None) -> None:
    one_us = _median_ms(g.replay, reps=1) * 1e3
    n = min(WARM_MAX_REPLAYS, math.ceil(WARM_US / max(one_us, 1.0)))
    for _ in range(n if agree is None else agree(n)):
        g.replay()


def time_graphs(named: dict[str, Sequence[Callable[[], object]]], *, rounds: int = 30,
                min_calls: int = 8) -> dict[str, float]:
    """Median µs per call of each entry's CUDA graph (as :func:`time_graph` builds it), timed in
    interleaved rounds: every entry's graph is captured and warmed first, then each round replays
    every graph once, in order, and each replay is timed on its own, so no entry is favoured by
    the order a script lists them in. A diagnostic: each replay follows other entries' graphs on
    other memory, a colder state than back-to-back calls (router round P6: Qwen3 M = 1 read 2.8 us
    here against 2.3 with :func:`time_graph`); the result files use :func:`time_graph`."""
    graphs = {name: capture_graph(fns, min_calls=min_calls) for name, fns in named.items()}
    for g, _ in graphs.values():
        _warm(g)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (g, _) in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    return {name: sorted(ts)[len(ts) // 2] * 1e3 / graphs[name][1] for name, ts in times.items()}


# ----------------------------------------------------------------------------- ceilings

def _median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def empty_launch_us(pdl: bool = False) -> float:
    """µs per call of an empty Triton kernel in a graph of back-to-back calls (``launch_us``); with ``pdl``,
    each launched with programmatic dependent launch and waiting at its top for the one ahead (``pdl_enter``,
    as evenflow's kernels do): the launch cost a chain of PDL kernels pays (``launch_pdl_us``). The graph holds
    LAUNCH_CALLS calls: at 20 the graph's own launch and the timing events, shared by too few calls, put 0.70-1.07
    µs on one kernel and the lowest of 15 readings moved 0.70-0.89 between processes; at 200 every reading of three
    processes fell in 0.682-0.708 (round BF4), the process's graph state settled first (round BG3,
    :func:`warm_graph_state`)."""
    from evenflow._kernels.common import empty_pdl_kernel
    from evenflow._runtime import pdl_kwargs

    buf = torch.empty(1, device="cuda")
    return time_graph([lambda: empty_pdl_kernel[(1,)](buf, **pdl_kwargs(pdl))], min_calls=LAUNCH_CALLS)


def warm_graph_state() -> None:
    """Makes, replays and drops GRAPH_WARM graphs of empty kernels, once a device in a process, so that what a
    benchmark times next runs in the state its later rows do. In round BG3 (four processes) the first six such graphs
    of a process ran 0.507-0.526 µs a call and the seventh and every later one 0.686-0.705, a graph made early and
    held included (it slowed once the others were made), 10 s apart or back to back: a state the process reaches by
    the count of graphs it has made, and keeps. A launch term read in the first state (BG1's router: 0.56 against
    0.755 after its sweep) set that run's floors 0.5-19% low, and its first few rows ran in a state no later row did."""
    dev = torch.cuda.current_device()
    if dev in _GRAPH_STATE_WARM:
        return
    for _ in range(GRAPH_WARM):
        empty_launch_us()
    _GRAPH_STATE_WARM.add(dev)


_GRAPH_STATE_WARM: set[int] = set()  # devices whose graph state this process has settled (warm_graph_state)


def measure_copy_TBps() -> float:
    """The copy ceiling alone: read + write TB/s of a 1 GiB device-to-device copy (warmed, best of several medians)."""
    _require_cuda("measure_copy_TBps")
    n = 1 << 30  # 1 GiB source, 1 GiB destination: far beyond L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    # Copy for COPY_WARM_MS of GPU time, then keep the best of COPY_READINGS medians: at the top of a process the copy
    # read as low as 3.94 TB/s (round AN1), where another call's copy read 4.13-4.20 cold and 4.21 after ~2 s of
    # copies (AN2), and one median after 300 ms of copies still scattered by 2.8% between two calls (AN4); the floor
    # is only as good as this figure.
    for _ in range(max(1, math.ceil(COPY_WARM_MS / _median_ms(copy, reps=3)))):
        copy()
    copy_ms = min(_median_ms(copy, reps=COPY_REPS) for _ in range(COPY_READINGS))
    return round(2 * n / copy_ms / 1e9, 3)


def measure_ceilings(verbose: bool = True) -> dict:
    """Copy bandwidth (TB/s, read+write), bf16/fp8 dense matmul rates (TFLOP/s), empty-kernel µs; first the
    process's graph state settled (:func:`warm_graph_state`), as every benchmark calls this before its rows."""
    _require_cuda("measure_ceilings")
    warm_graph_state()
    copy_TBps = measure_copy_TBps()  # its 2 GiB released before the matmuls
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    bf16_ms = _median_ms(lambda: torch.mm(a, b), reps=10)
    fp8 = float("nan")
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major B, as cuBLASLt fp8 wants
        one = torch.ones((), device="cuda")
        fp8_ms = _median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps=10)
        fp8 = 2 * m**3 / fp8_ms / 1e9
    except (RuntimeError, AttributeError) as e:  # older GPUs have no fp8 matmul
        print(f"[ceilings] fp8 matmul unavailable: {e}", file=sys.stderr)
    a = b = a8 = b8 = None
    ceil = {
        "copy_TBps": copy_TBps,
        "bf16_TFLOPs": round(2 * m**3 / bf16_ms / 1e9, 1),
        "fp8_TFLOPs": round(fp8, 1) if fp8 == fp8 else None,
        "launch_us": round(empty_launch_us(), 3),
    }
    if verbose:
        print(f"[ceilings] {ceil}", flush=True)
    return ceil


class Floor(float):
    """A floor in µs (a ``float``: it compares, rounds and serialises as one) that keeps its terms, so the run can
    derive it again from another copy reading (:meth:`Results.settle_copy`): ``parts``, one (bytes time at
    ``copy_TBps``, FLOP time) pair per piece of work whose larger term is its floor (one for a call; one a rank for
    a layer whose slowest rank ends it, :meth:`worst`), the floor the largest of them, plus ``extra_us`` (a term added
    on top, e.g. a launch). Arithmetic on it gives a plain ``float``: pass an added term as ``floor_us(extra_us=...)``
    or :meth:`plus`."""

    parts: tuple[tuple[float, float], ...]
    extra_us: float
    copy_TBps: float | None

    def __new__(cls, parts: Sequence[tuple[float, float]], extra_us: float = 0.0,
                copy_TBps: float | None = None) -> Floor:
        parts = tuple((float(m), float(c)) for m, c in parts)
        if not parts:
            raise ValueError("parts: empty")
        self = super().__new__(cls, max(max(m, c) for m, c in parts) + extra_us)
        self.parts, self.extra_us, self.copy_TBps = parts, float(extra_us), copy_TBps
        return self

    def __reduce__(self):  # pickle and copy rebuild it with its terms
        return Floor, (self.parts, self.extra_us, self.copy_TBps)

    def with_copy(self, copy_TBps: float) -> Floor:
        """The same floor with its bytes terms at another copy bandwidth (the piece that sets it may change)."""
        if not self.copy_TBps:
            return self
        r = self.copy_TBps / copy_TBps
        return Floor(tuple((m * r, c) for m, c in self.parts), self.extra_us, copy_TBps)

    def with_extra(self, extra_us: float) -> Floor:
        """The same floor with ``extra_us`` as its added term in place of its own (e.g. another launch reading)."""
        return Floor(self.parts, extra_us, self.copy_TBps)

    def plus(self, extra_us: float) -> Floor:
        """The floor with ``extra_us`` more added on top."""
        return self.with_extra(self.extra_us + extra_us)

    @staticmethod
    def worst(floors: Sequence[Floor]) -> Floor:
        """The floor of work that ends when the slowest of ``floors`` ends (e.g. a layer over ranks), kept as all
        their pieces, so another copy reading picks the slowest again. They must share one copy reading and
        added term."""
        if not floors:
            raise ValueError("floors: empty")
        first = floors[0]
        if any(f.copy_TBps != first.copy_TBps or f.extra_us != first.extra_us for f in floors):
            raise ValueError("floors: they differ in copy reading or added term")
        return Floor(tuple(p for f in floors for p in f.parts), first.extra_us, first.copy_TBps)


def floor_us(bytes_moved: float = 0.0, flops: float = 0.0, *, ceilings: dict,
             rate: str = "bf16_TFLOPs", extra_us: float = 0.0) -> Floor:
    """The physical floor in µs: the larger of bytes / copy bandwidth and flops / matmul rate (plus ``extra_us``)."""
    copy = ceilings["copy_TBps"]
    t_mem = bytes_moved / (copy * 1e12) * 1e6
    t_cmp = flops / (ceilings[rate] * 1e12) * 1e6 if flops else 0.0
    return Floor(((t_mem, t_cmp),), extra_us, copy)


# ----------------------------------------------------------------------------- checks & progress

def check_output(out: torch.Tensor, ref: torch.Tensor, what: str, *, rtol: float = 2e-2,
                 atol: float = 2e-2, min_cos: float | None = 0.999) -> dict:
    """Raise unless ``out`` is finite and close to ``ref``; return the error figures.

    A benchmark sanity check (correctness is proved by the tests): it catches a
    broken build or a peer fed the wrong layout before a meaningless time is recorded.
    """
    o, r = out.detach().float(), ref.detach().float()
    if o.shape != r.shape:
        raise AssertionError(f"{what}: shape {tuple(o.shape)} != reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        raise AssertionError(f"{what}: non-finite output")
    err = (o - r).abs().max().item() if o.numel() else 0.0
    scale = r.abs().max().item() if r.numel() else 0.0
    cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item() if o.numel() else 1.0
    if err > atol + rtol * scale or (min_cos is not None and cos < min_cos):
        raise AssertionError(f"{what}: max|err| {err:.3e} (ref max {scale:.3e}), cosine {cos:.6f}")
    return {"max_abs_err": err, "cosine": cos}


def with_switches(module, switches: dict, fn: Callable[[], object]):
    """fn() with the module-level switches ``switches`` (name -> value) of ``module`` set, then put back, also when
    fn raises: a benchmark's knob row for a switch the API does not take (its launches, and so a CUDA graph captured
    around them, keep the choice)."""
    saved = {name: getattr(module, name) for name in switches}
    for name, value in switches.items():
        setattr(module, name, value)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def switched(module, switches: dict, fns: Sequence[Callable[[], object]]) -> list:
    """Each of ``fns`` as a call made with ``module``'s ``switches`` set (:func:`with_switches`): a benchmark's knob row
    from the calls of its row of record; ``fns`` as they are where there are no switches."""
    if not switches:
        return list(fns)
    return [lambda fn=fn: with_switches(module, switches, fn) for fn in fns]


def choices(flag: str, given: str | None, known, default) -> tuple:
    """A comma-separated option's values (``default`` where not given), each one of ``known``; ``SystemExit`` naming
    the flag and the unknown values otherwise."""
    values = tuple(given.split(",")) if given else tuple(default)
    bad = [v for v in values if v not in known]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad} (choose from {', '.join(known)})")
    return values


def target(targets: list[dict], what: str, ok, value, kind: str, **extra) -> None:
    """Appends one check of an issue's target to ``targets``: ``{"target": what, "ok": ..., "value": ...,
    "kind": kind}`` (``kind``: the issue's sentence it checks, which :func:`report_targets` counts by), with any
    ``extra`` fields."""
    targets.append({"target": what, "ok": bool(ok), "value": value, "kind": kind, **extra})


def _shown(v, digits: int) -> str:
    """A target's value as :func:`report_targets` prints it: floats at ``digits`` decimals, under 0.01 in powers
    of ten."""
    if not isinstance(v, float):
        return f"{v}"
    return f"{v:.2e}" if 0 < abs(v) < 0.01 else f"{v:.{digits}f}"


def report_targets(issue: str, targets: list[dict], detail: Callable[[dict], str] | None = None) -> None:
    """Prints an issue's targets: how many are met, then per kind (in first-seen order), then each missed one with
    its value (``digits`` decimals where the target carries them, else 3) and ``detail(target)``'s words."""
    print(f"\n## {issue} targets: {sum(t['ok'] for t in targets)}/{len(targets)} met")
    for k in dict.fromkeys(t["kind"] for t in targets):
        these = [t for t in targets if t["kind"] == k]
        print(f"  {k}: {sum(t['ok'] for t in these)}/{len(these)}")
    for t in targets:
        if not t["ok"]:
            print(f"- MISSED {t['target']}: {_shown(t['value'], t.get('digits', 3))}" + (detail(t) if detail else ""))


def rows_by_point(rows: Sequence[dict], fields: Sequence[str], scored: Sequence[str]) -> dict[tuple, dict]:
    """A run's rows keyed by ``(*fields, impl)`` (missing fields as None), for scoring an issue's targets point by
    point; ``ValueError`` where a point has two rows of an impl in ``scored`` (a target must be scored from one)."""
    by: dict[tuple, dict] = {}
    for r in rows:
        key = (*(r.get(f) for f in fields), r.get("impl"))
        if key in by and key[-1] in scored:
            raise ValueError(f"two {key[-1]} rows at {key[:-1]}: a point is scored from one row of each impl")
        by[key] = r
    return by


def scored_points(rows: Sequence[dict], fields: Sequence[str], scored: Sequence[str], what: str,
                  is_point: Callable[[dict], bool], timed_fields: Sequence[str]) -> dict[tuple, dict]:
    """:func:`rows_by_point` of a run's rows after checking the rows of ``scored[0]`` (the impl whose targets are
    scored): each must be ``what``'s benchmark row (``is_point``; ``what`` with its article: "a router") and, where
    timed (``us``), carry a number in every one of ``timed_fields``. ``ValueError`` naming the row where one does
    not."""
    for i, r in enumerate(rows):
        if r.get("impl") != scored[0]:
            continue
        if not is_point(r):
            raise ValueError(f"row {i} is not {what} benchmark row ("
                             + ", ".join(f"{f} {r.get(f)!r}" for f in fields) + ")")
        if "us" in r and not all(isinstance(r.get(k), (int, float)) for k in timed_fields):
            raise ValueError(f"row {i} (" + ", ".join(f"{r.get(f)}" for f in fields) + ") is timed but has no "
                             + (", ".join(timed_fields[:-1]) + " or " if len(timed_fields) > 1 else "")
                             + timed_fields[-1])
    return rows_by_point(rows, fields, scored)


def recorded_rows(path: str, flag: str = "--rescore") -> list[dict]:
    """The rows of a result file, for a benchmark's ``--rescore`` (no GPU); ``SystemExit`` naming ``flag`` where
    ``path`` is not one."""
    try:
        return Results.load(path).rows
    except (OSError, ValueError) as e:
        raise SystemExit(f"{flag}: {path} is not a results file ({e})") from None


def rescore_file(path: str, score: Callable[[list[dict]], object], what: str, flag: str = "--rescore"):
    """``score`` of a result file's rows (a benchmark's ``--rescore``, no GPU); ``SystemExit`` naming ``flag`` and
    the file where it is not a result file, or ``score`` finds its rows are not ``what``'s (``ValueError``; ``what``
    with its article: "a router", "an MoE")."""
    try:
        return score(recorded_rows(path, flag))
    except ValueError as e:
        raise SystemExit(f"{flag}: {path}: not {what} results file ({e})") from None


def progress(items: Iterable, desc: str) -> Iterable:
    """Yield ``items`` printing one line per item with elapsed time (flushes, so logs stream)."""
    items = list(items)
    t0 = time.time()
    for i, it in enumerate(items):
        print(f"[{desc} {i + 1}/{len(items)} +{time.time() - t0:5.0f}s] {it}", flush=True)
        yield it


def positive_int(text: str) -> int:
    """An argparse ``type`` for one positive integer."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def positive_ints(text: str) -> list[int]:
    """An argparse ``type`` for a comma-separated list of positive integers (``--ms 1,16,512``)."""
    try:
        values = [positive_int(v) for v in text.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def check_out(p: argparse.ArgumentParser, out: str | None) -> None:
    """``--out`` made (and found writable) before any measuring, so a bad path does not lose a run at its end."""
    if out is None:
        return
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out!r}: {e.strerror or e}")
    if not os.access(path, os.W_OK):
        p.error(f"--out {out!r}: not writable")


def md_cell(text: str) -> str:
    """``text`` safe in a Markdown table cell (a ``|`` in it, as in ``max|err|``, would split the cell)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short sweep (a few cases)")
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    return args


# ----------------------------------------------------------------------------- results

_REQUIRED = ("case", "impl")


def impl_colors(rows: Sequence[dict]) -> dict[str, tuple]:
    """A colour for each row's ``impl``, in order of first appearance over all the rows (so an impl keeps its colour
    in every panel of a plot): matplotlib's tab10, then tab20's light shades, their greys left out (the floor's bar is
    grey); past those 18 the list starts again."""
    import matplotlib

    tab10, tab20 = matplotlib.colormaps["tab10"].colors, matplotlib.colormaps["tab20"].colors
    shades = [c for i, c in enumerate(tab10) if i != 7] + [c for i, c in enumerate(tab20[1::2]) if i != 7]
    for i, r in enumerate(rows):
        if "impl" not in r:
            raise ValueError(f"rows: row {i} has no 'impl'")
    order = list(dict.fromkeys(r["impl"] for r in rows))
    return {impl: shades[i % len(shades)] for i, impl in enumerate(order)}


def _put_floor(row: dict, floor: float, us: float | None = None) -> None:
    """A row's ``floor_us`` and, where it has a time, its ``frac_of_floor``, at the precision the result files use."""
    row["floor_us"] = round(float(floor), 3)
    if us is not None:
        row["frac_of_floor"] = round(float(floor) / float(us), 4)


class Results:
    """Collects rows and writes ``<name>.json`` (BENCH.md schema), ``<name>.md`` and ``<name>.png``."""

    def __init__(self, name: str, *, ceilings: dict | None, out: str | os.PathLike | None = None,
                 meta: dict | None = None, recorded: dict | None = None):
        # recorded: a written file's header and rows (``load``), kept as they are; else this machine's header, no rows
        self.name = name
        self.ceilings = ceilings or {}
        self.out = results_dir(out)
        self.meta = meta or {}
        self.rows: list[dict] = list(recorded["rows"]) if recorded else []
        self.header = recorded["header"] if recorded else header()
        self.recorded = recorded is not None
        self._floors: list[tuple[dict, Floor]] = []  # rows whose floors keep their terms (settle_copy)
        self._settled = False

    def add(self, *, case: str, impl: str, us: float, floor_us: float | None = None, **extra) -> dict:
        if not (isinstance(us, (int, float)) and math.isfinite(us) and us > 0):
            raise ValueError(f"us must be a positive time, got {us!r} for {case}/{impl}")
        row = {"case": case, **{k: v for k, v in extra.items() if k in ("variant",)}, "impl": impl,
               "us": round(float(us), 3)}
        if floor_us is not None:
            _put_floor(row, floor_us, us)
            if isinstance(floor_us, Floor):
                self._floors.append((row, floor_us))
        for k, v in extra.items():
            if k != "variant":  # 5 significant digits: an error of 3e-6 must not round to 0
                row[k] = float(f"{v:.5g}") if isinstance(v, float) else v
        self.rows.append(row)
        return row

    def add_error(self, *, case: str, impl: str, error: str, **extra) -> dict:
        row = {"case": case, **extra, "impl": impl, "error": str(error)[:500]}
        if isinstance(extra.get("floor_us"), Floor):
            self._floors.append((row, extra["floor_us"]))
            _put_floor(row, extra["floor_us"])
        self.rows.append(row)
        print(f"[{self.name}] {case} {extra.get('variant', '')} {impl}: {row['error']}", flush=True)
        return row

    # -- output
    def to_json(self) -> dict:
        return {"header": self.header, "ceilings": self.ceilings, **({"meta": self.meta} if self.meta else {}),
                "rows": self.rows}

    def markdown(self, columns: Sequence[str] | None = None) -> str:
        keys: list[str] = []
        for r in self.rows:
            for k in r:
                if k not in keys:
                    keys.append(k)
        cols = list(columns) if columns else keys
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            cells = []
            for c in cols:
                v = r.get(c, "")
                cells.append(md_cell(f"{v:.4g}" if isinstance(v, float) else str(v)))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def settle_copy(self) -> float | None:
        """Reads the copy ceiling again at the end of a run, and the floors take the higher of the two readings.

        The copy rate has spells of a few seconds, mostly at a process's start, that read 2.5-3% low (round BE);
        floors from such a reading would flatter every memory-bound ``frac_of_floor`` of the run by as much. Both
        readings are kept (``ceilings["copy_TBps_readings"]``, start and end); ``copy_TBps`` becomes the higher,
        and every row added with a :class:`Floor` gets its floor and fraction again from it (a benchmark that
        derives figures from the fractions calls this before it does; ``finish`` calls it otherwise); a run with no
        floors keeps its ``copy_TBps``. Where a row was given a floor without its terms (a plain number) it cannot
        be derived again: the floors then stay at the start's reading and a warning says by how much they may
        flatter the run. A reading that fails (a faulted GPU) keeps the start's too. Once a run; nothing where the
        run had no copy ceiling, the results were loaded from a file, or no GPU is here. Returns the floors'
        reading."""
        start = self.ceilings.get("copy_TBps")
        if self._settled or self.recorded or not start or not torch.cuda.is_available():
            return start
        self._settled = True
        try:
            end = measure_copy_TBps()
        except Exception as e:  # a faulted GPU: the results still get written, on the start's reading
            print(f"[{self.name}] warning: the copy ceiling could not be read again ({error_line(e)}): the floors "
                  f"stay at the start's reading", file=sys.stderr, flush=True)
            return start
        self.ceilings["copy_TBps_readings"] = [start, end]
        if end <= start or not any("floor_us" in r for r in self.rows):
            return start
        floored = {id(row) for row, _ in self._floors}
        plain = [i for i, r in enumerate(self.rows) if "floor_us" in r and id(r) not in floored]
        if plain:
            print(f"[{self.name}] warning: the copy ceiling read {start} TB/s at the start of this run and {end} at "
                  f"its end, and rows {plain[:5]}{'...' if len(plain) > 5 else ''} have floors without their terms: "
                  f"every floor stays at the start's reading, memory-bound rows' frac_of_floor up to "
                  f"{(end / start - 1) * 100:.1f}% high", file=sys.stderr, flush=True)
            return start
        self.ceilings["copy_TBps"] = end
        self.refloor(lambda fl: fl.with_copy(end))
        if end > start * (1 + COPY_DRIFT):
            print(f"[{self.name}] the copy ceiling read {start} TB/s at the start of this run and {end} at its end "
                  f"(a spell of low readings): the floors take {end}", file=sys.stderr, flush=True)
        return end

    def refloor(self, derive: Callable[[Floor], Floor]) -> None:
        """Every row added with a :class:`Floor` takes the floor ``derive`` makes of it (``with_copy``: another copy
        reading; ``with_extra``: another launch term), and its fraction again; later derivations start from it."""
        self._floors = [(row, derive(fl)) for row, fl in self._floors]
        for row, fl in self._floors:
            _put_floor(row, fl, row.get("us"))

    def finish(self, *, x: str = "case", group: str | None = "variant", y: str = "us",
               columns: Sequence[str] | None = None, plot: bool = True, logy: bool = True,
               settle: bool = True) -> Path:
        """Writes the JSON, markdown and plot, after reading the copy ceiling again (:meth:`settle_copy`; not with
        ``settle=False``, for a run leaving in a hurry, whose GPU may be stuck)."""
        if settle:
            self.settle_copy()
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.name}.json"
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        md = self.markdown(columns)
        hdr = self.header
        (self.out / f"{self.name}.md").write_text(
            f"# {self.name} — {hdr['gpu']}, torch {hdr['torch']}, triton {hdr['triton']}, "
            f"commit {hdr['commit']}, {hdr['date']}\n\nceilings: {self.ceilings}\n\n{md}\n")
        if plot:
            try:
                self.plot(x=x, group=group, y=y, logy=logy)
            except ImportError as e:
                print(f"[{self.name}] no plot: {e}", file=sys.stderr)
        print(f"\n## {self.name} ({hdr['gpu']})\n\n{md}\n\nwritten: {path}", flush=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Results:
        """A result file (``<name>.json``) read back, to plot it again: its rows, header, ceilings and meta as
        written (nothing measured or queried: no GPU needed); ``out`` is the file's folder, so :meth:`plot` writes
        ``<name>.png`` beside it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"path: {path} is not JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("header"), dict) or \
                not isinstance(data.get("rows"), list):
            raise ValueError(f"path: {path} is not a result file (a header object and a list of rows)")
        for i, r in enumerate(data["rows"]):
            missing = [k for k in _REQUIRED if not isinstance(r, dict) or k not in r]
            if missing:
                raise ValueError(f"path: {path}: row {i} has no {missing[0]!r}")
        return cls(path.stem, ceilings=data.get("ceilings"), out=path.parent, meta=data.get("meta"), recorded=data)

    def plot(self, *, x: str, group: str | None, y: str, logy: bool) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = [r for r in self.rows if y in r]
        if not ok:
            raise ImportError("nothing to plot: every row is an error row")
        colors = impl_colors(ok)  # one colour an impl in every panel
        groups = sorted({r.get(group, "") for r in ok}) if group else [""]
        fig, axes = plt.subplots(len(groups), 1, figsize=(max(8, 0.6 * len({r[x] for r in ok}) + 4),
                                                          4 * len(groups)), squeeze=False)
        for ax, gname in zip(axes[:, 0], groups):
            rows = [r for r in ok if not group or r.get(group, "") == gname]
            xs: list = []
            for r in rows:
                if r[x] not in xs:
                    xs.append(r[x])
            impls: list[str] = []
            for r in rows:
                if r["impl"] not in impls:
                    impls.append(r["impl"])
            w = 0.8 / max(1, len(impls) + 1)
            for j, impl in enumerate(impls):
                vals = {r[x]: r[y] for r in rows if r["impl"] == impl}
                ax.bar([i + j * w for i in range(len(xs))], [vals.get(c, 0) for c in xs], w, label=impl,
                       color=colors[impl])
            floors = {}
            for r in rows:
                if "floor_us" in r:
                    floors[r[x]] = r["floor_us"]
            if floors and y == "us":
                ax.bar([i + len(impls) * w for i in range(len(xs))], [floors.get(c, 0) for c in xs], w,
                       label="floor", color="black", alpha=0.35)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(xs))])
            ax.set_xticklabels([str(c) for c in xs], rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(f"{y} (lower is better)" if y == "us" else y)
            if logy:
                ax.set_yscale("log")
            ax.set_title(f"{self.name} {gname} — {self.header.get('gpu', '')}")
            ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        path = self.out / f"{self.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
