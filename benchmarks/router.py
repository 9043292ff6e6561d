"""Router GEMM benchmark: evenflow vs cuBLAS FP32 / TF32 / two bf16 products / bf16 weights, vs the floor.

    python benchmarks/router.py [--quick] [--cases K4096-N192,qwen3-30b-a3b] [--ms 1,16,512] [--impls a,b]
                                [--out DIR]
    python benchmarks/router.py --rescore benchmarks/results/h200/router.json   # issue 4's targets of a file (CPU)

Cases and names follow BENCH.md. Per (case, M): fp32 weights ~ N(0, 0.02^2), bf16
x ~ N(0, 1); each impl's output is checked against the fp64 product of the same
inputs (``max_abs_err``, and ``topk_flips``: experts of the top-8 that differ from the
fp64 top-8, summed over the M rows) before it is timed as a CUDA-graph replay (``us``)
and eagerly with L2 flushed (``eager_us``). Several weight/input copies are rotated
so a call never finds its weights in L2 (60 MB).

Floor (issue 4): (weight bytes N*K*4 — fp32, or the two bf16 parts — + x bytes M*K*2
+ output bytes M*N*4) / copy bandwidth + one empty kernel's launch time in a graph,
both measured in this run (the launch as the lowest of three readings, one before the points
and two after them: single readings ranged 0.67-0.97 us between runs; ``launch_us_readings``
keeps all three). Our kernels launch with programmatic dependent launch (PDL) where
supported, so back to back in a graph each one's launch overlaps the end of the one ahead; the
ceilings also carry ``launch_pdl_us``, an empty kernel's time in such a chain, which the floor
does not use (the issue defines it with a plain launch).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys

import torch

import evenflow
from evenflow.bench import harness as H
from evenflow.bench.peers import cublas
from evenflow.reference import router as R
from evenflow.router.dispatch import heuristic_splitk_config
from tune_router import simt_candidates  # benchmarks/ is the script's directory

CASES = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
         "qwen3-30b-a3b": (2048, 128)}
MS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK = {"cases": ("K4096-N192", "qwen3-30b-a3b"), "ms": (1, 16, 512, 4096)}
# evenflow: default RouterWeight (three terms, exact fp32 weights); evenflow-2term: terms=2;
# evenflow-fp32simt (M <= 64): the CUDA-core path on the fp32 weight, forced (the table's
# config when the table picked it, else the tuner's first candidate); evenflow-fp32splitk
# (M <= 16): the single-launch split-K CUDA-core path, forced the same way (table's config,
# else the untuned heuristic's); evenflow-nopdl / -pdl / -prefetch: the default's config launched "plain",
# "pdl" and "pdl-prefetch" (GemmConfig.launch, round AD; the default row launches as its table entry says);
# evenflow-counter: where the table's entry sums its K slices with float atomics (reduce "atomic", round BW), the
# same config with the counter's in-order sum (what torch.use_deterministic_algorithms runs); no row elsewhere.
LAUNCH_ROWS = {"evenflow-nopdl": "plain", "evenflow-pdl": "pdl", "evenflow-prefetch": "pdl-prefetch"}
IMPLS = ("evenflow", *LAUNCH_ROWS, "evenflow-counter", "evenflow-2term", "evenflow-invariant", "evenflow-fp32simt",
         "evenflow-fp32splitk", *cublas.PEERS)
TOP_K = 8
PEERS = ("cublas-fp32", "cublas-split2")  # the two the issue's ratio targets name
ROTATE_BYTES = 150 << 20  # > 2x L2


def _flips(out: torch.Tensor, ref_ids: torch.Tensor) -> int:
    ids = out.topk(TOP_K, dim=-1).indices.sort(-1).values
    # count experts in ours not in the reference, row by row (both sorted, width 8)
    hit = (ids.unsqueeze(-1) == ref_ids.unsqueeze(-2)).any(-1)
    return int((~hit).sum())


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated case names")
    p.add_argument("--ms", type=H.positive_ints, default=None, help="comma-separated M values")
    p.add_argument("--timing", choices=("sequential", "interleaved"), default="sequential",
                   help="graph replays of a point's impls timed one impl after the other (each right after its "
                        "capture), or captured together and timed in interleaved rounds")
    p.add_argument("--impls", default=None, help="comma-separated impls, timed in this order (default: all, "
                   + ",".join(IMPLS) + ")")
    p.add_argument("--rescore", default=None, metavar="JSON",
                   help="no run: issue 4's targets of a results file (e.g. router.json), re-derived from its rows "
                        "(CPU)")


def issue_targets(rows: list[dict]) -> list[dict]:
    """Issue 4's targets over a run's rows, point by point (case and M of every ``evenflow`` row, in the rows'
    order): max abs error against fp64 <= 1e-4; top-k flips no more than cuBLAS FP32's at the point; faster than
    cuBLAS FP32 at every M, >= 2.5x it at M >= 512; >= 1.3x the two cuBLAS bf16 products of the split at every M;
    within 2x of the floor (``frac_of_floor`` >= 0.5) at M <= 16. Ratios from the rows' graph times (``us``), so
    they need the peer's row in the same run: a point that did not run, or whose peer did not, is a missed target.
    ``ValueError`` where an ``evenflow`` row is not a router benchmark row (no M, an unknown case, a timed row
    without its error, flips or fraction) or a point has two rows of one impl."""
    by = H.scored_points(rows, ("case", "M"), ("evenflow", *PEERS), "a router",
                         lambda r: r.get("case") in CASES and isinstance(r.get("M"), int),
                         ("max_abs_err", "topk_flips", "frac_of_floor"))
    targets: list[dict] = []
    target = functools.partial(H.target, targets)
    for (case, m, impl), ours in by.items():
        if impl != "evenflow":
            continue
        name = f"{case} M={m}"
        if "us" not in ours:
            target(f"{name}: evenflow ran", False, ours.get("error", "not run"), "ran")
            continue
        target(f"{name}: max abs error <= 1e-4", ours["max_abs_err"] <= 1e-4, ours["max_abs_err"],
               "max abs error against fp64 <= 1e-4")
        fp32, split2 = (by.get((case, m, p), {}) for p in PEERS)
        for peer, row in zip(PEERS, (fp32, split2)):
            if "us" not in row:
                target(f"{name}: {peer} timed beside it", False, row.get("error", "no row"), "peers timed beside it")
        if "us" in fp32:
            target(f"{name}: top-k flips <= cublas-fp32's {fp32['topk_flips']}",
                   ours["topk_flips"] <= fp32["topk_flips"], ours["topk_flips"], "top-k flips <= cublas-fp32's")
            x = fp32["us"] / ours["us"]
            target(f"{name}: faster than cublas-fp32", x > 1.0, x, "faster than cublas-fp32 at every M")
            if m >= 512:
                target(f"{name}: >= 2.5x cublas-fp32", x >= 2.5, x, ">= 2.5x cublas-fp32 at M >= 512")
        if "us" in split2:
            x = split2["us"] / ours["us"]
            target(f"{name}: >= 1.3x cublas-split2", x >= 1.3, x, ">= 1.3x cublas-split2 at every M")
        if m <= 16:
            target(f"{name}: within 2x of the floor", ours["frac_of_floor"] >= 0.5, ours["frac_of_floor"],
                   "within 2x of the floor at M <= 16")
    return targets


def rescore(path: str, flag: str = "--rescore") -> list[dict]:
    """:func:`issue_targets` of a results file (no GPU); ``SystemExit`` naming ``flag`` where it is not a router
    one."""
    return H.rescore_file(path, issue_targets, "a router", flag)


def main(argv=None) -> int:
    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_extra)
    if args.rescore:
        H.report_targets("issue 4", rescore(args.rescore))
        return 0
    cases = H.choices("--cases", args.cases, tuple(CASES), QUICK["cases"] if args.quick else tuple(CASES))
    ms = tuple(args.ms) if args.ms else (QUICK["ms"] if args.quick else MS)
    impls = H.choices("--impls", args.impls, IMPLS, IMPLS)
    ceil = H.measure_ceilings()
    ceil["launch_pdl_us"] = round(H.empty_launch_us(pdl=True), 3)
    print(f"[ceilings] launch_pdl_us {ceil['launch_pdl_us']}", flush=True)
    res = H.Results("router", ceilings=ceil, out=args.out)
    torch.manual_seed(0)
    for case in cases:
        k, n = CASES[case]
        for m in H.progress(ms, f"router {case}"):
            call_bytes = _call_bytes(m, n, k)
            ws, xs = rotated_copies(m, n, k)
            ref = R.router_logits_fp64(xs[0], ws[0])
            ref_ids = ref.topk(TOP_K, dim=-1).indices.sort(-1).values
            floor = H.floor_us(bytes_moved=call_bytes, ceilings=ceil, extra_us=ceil["launch_us"])
            staged = {}  # --timing interleaved: impl -> (fns, row fields), timed together after the loop
            for impl in impls:
                try:
                    if (impl == "evenflow-fp32simt" and m > 64) or (impl == "evenflow-fp32splitk" and m > 16):
                        continue
                    if impl.startswith("evenflow"):
                        inv = impl == "evenflow-invariant"
                        rws = [evenflow.RouterWeight(w, terms=2 if impl == "evenflow-2term" else 3) for w in ws]
                        outs = [torch.empty(m, n, device="cuda") for _ in ws]
                        for rw in rws:  # workspace allocated before capture (for the deterministic config too)
                            for det in (False, True):
                                rw.workspace(m, rw.config(m, inv, deterministic=det))
                            rw.logits_buffer(m)
                        cfg = rws[0].config(m, inv)
                        if impl == "evenflow-fp32simt" and cfg.path != "fp32-simt":
                            cfg = simt_candidates(m)[0]
                        if impl == "evenflow-fp32splitk" and cfg.path != "fp32-splitk":
                            cfg = heuristic_splitk_config(m, n, k, torch.cuda.get_device_properties(0)
                                                          .multi_processor_count)
                        if impl in LAUNCH_ROWS:
                            cfg = dataclasses.replace(cfg, launch=LAUNCH_ROWS[impl])
                        if impl == "evenflow-counter":
                            if cfg.reduce != "atomic":
                                continue
                            cfg = rws[0].config(m, inv, deterministic=True)
                        fns = [lambda x=x, rw=rw, o=o, c=cfg: evenflow.router_gemm(x, rw, o, batch_invariant=inv,
                                                                                     config=c)
                               for x, rw, o in zip(xs, rws, outs)]
                        info = {"config": cfg.to_dict()}
                    else:
                        fns = [cublas.make(impl, x, w) for x, w in zip(xs, ws)]
                        info = {}
                    out = fns[0]()
                    chk = H.check_output(out, ref, f"{case} M={m} {impl}")
                    fields = dict(floor_us=floor, M=m, K=k, N=n, max_abs_err=float(chk["max_abs_err"]),
                                  topk_flips=_flips(out, ref_ids), timing=args.timing, **info)
                    if args.timing == "interleaved":
                        staged[impl] = (fns, fields)
                        continue
                    res.add(case=case, impl=impl, us=H.time_graph(fns), eager_us=H.time_eager(fns), **fields)
                except H.PeerUnavailable as e:
                    res.add_error(case=case, impl=impl, error=str(e), M=m)
                except Exception as e:  # a failing impl is a result row, not a lost run
                    res.add_error(case=case, impl=impl, error=f"{type(e).__name__}: {e}", M=m)
            if staged:
                us = H.time_graphs({impl: fns for impl, (fns, _) in staged.items()})
                for impl, (fns, fields) in staged.items():
                    res.add(case=case, impl=impl, us=us[impl], eager_us=H.time_eager(fns), **fields)
            del staged
            del ws, xs
            torch.cuda.empty_cache()
    res.settle_copy()  # the copy term at the higher of the run's two copy readings, before the launch term's
    _lowest_launch(res, ceil)
    _speedups(res)
    targets = issue_targets(res.rows)
    res.meta["targets"] = targets
    res.finish(x="M", group="case", columns=("case", "M", "impl", "us", "eager_us", "floor_us", "frac_of_floor",
                                             "max_abs_err", "topk_flips", "vs_fp32", "vs_split2", "error"),
               plot=not args.no_plot)
    H.report_targets("issue 4", targets)
    return 0


def rotated_copies(m: int, n: int, k: int, min_copies: int = 1) -> tuple[list, list]:
    """Weights [N, K] (fp32, std 0.02) and activations [M, K] (bf16) on the GPU, as many copies (1-16, at least
    ``min_copies``) as keep a cycle of calls through them out of L2, drawn all weights first from torch's generator."""
    copies = max(min_copies, min(16, math.ceil(ROTATE_BYTES / _call_bytes(m, n, k))))
    ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
    xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    return ws, xs


def probe_point(m: int, n: int, k: int) -> tuple[list, list, list, list, torch.Tensor, torch.Tensor, list]:
    """What the router probes time a point on: (weights, x copies, RouterWeights, outputs, the fp64 product, the
    PyTorch split baseline of the tests' rule, one ``router_gemm`` call a copy on the dispatch's pick (``entry``)),
    at least two rotated copies (GPU)."""
    ws, xs = rotated_copies(m, n, k, min_copies=2)
    rws = [evenflow.RouterWeight(w) for w in ws]
    outs = [torch.empty(m, n, device="cuda") for _ in ws]
    ref = R.router_logits_fp64(xs[0], ws[0])
    base = R.split_logits_fp32(xs[0], *rws[0].parts)
    entry = [lambda x=x, rw=rw, o=o: evenflow.router_gemm(x, rw, out=o) for x, rw, o in zip(xs, rws, outs)]
    return ws, xs, rws, outs, ref, base, entry


def _call_bytes(m: int, n: int, k: int) -> int:
    """Bytes one call must move: the fp32 weight, bf16 x and the fp32 logits."""
    return n * k * 4 + m * k * 2 + m * n * 4


def _lowest_launch(res: H.Results, ceil: dict) -> None:
    """The floors' launch term as the lowest of three empty-kernel readings: the one taken with the other
    ceilings before the points, and two after them. Single readings ranged 0.67-0.97 us between runs (the
    router files since round B; round AH: 0.973, 0.686 and 0.930 in three runs of one session), and at M <= 16
    the launch is most of the floor, so one high reading lifted every fraction there. The lowest is what an
    empty kernel was measured to take in the run; every reading is kept (``launch_us_readings``) and the
    floors and fractions are recomputed with the lowest. Since round BF each reading times a graph of 200 empty
    kernels (``harness.LAUNCH_CALLS``), which held three processes' readings within 0.682-0.708 us (BF4), and
    since round BG the ceilings settle the process's graph state before their reading (``warm_graph_state``:
    BG1's first reading, 0.56 us, was taken in the state of a process's first six graphs, ~25% faster)."""
    readings = [ceil["launch_us"]] + [round(H.empty_launch_us(), 3) for _ in range(2)]
    ceil["launch_us_readings"] = readings
    ceil["launch_us"] = min(readings)
    print(f"[ceilings] launch_us readings {readings}: {ceil['launch_us']} in the floors", flush=True)
    res.refloor(lambda fl: fl.with_extra(ceil["launch_us"]))  # each floor keeps its (settled) bytes term


def _speedups(res: H.Results) -> None:
    """Add vs_fp32 / vs_split2 (peer us / our us) to the evenflow rows, for the issue's targets."""
    by = {(r["case"], r.get("M"), r["impl"]): r for r in res.rows if "us" in r}
    for (case, m, impl), r in by.items():
        if not impl.startswith("evenflow"):
            continue
        for peer, col in (("cublas-fp32", "vs_fp32"), ("cublas-split2", "vs_split2")):
            p = by.get((case, m, peer))
            if p:
                r[col] = round(p["us"] / r["us"], 3)


if __name__ == "__main__":
    sys.exit(main())
