"""route() benchmark: the router GEMM with scoring and top-k, against the routing path engines run natively.

    python benchmarks/route.py [--quick] [--cases qwen3-30b-a3b,K4096-N192] [--ms 1,16,512] [--impls a,b]
                               [--out DIR]

Issue 4's targets read the router GEMM alone (``benchmarks/router.py``); this file times what a MoE layer calls:
token activations in, expert ids and weights out. Impls:

- ``evenflow``: ``evenflow.route`` (the dispatch's GEMM, then the top-k kernel on the fp32 logits).
- ``evenflow-gemm``: ``evenflow.router_gemm`` alone at the same point (so ``route``'s cost over its GEMM shows).
- ``torch-fp32``: what an engine's native routing runs when the router keeps FP32 weights: ``torch.mm(x.float(),
  w.t())`` (cuBLAS FP32, the cast of x included), then PyTorch's softmax / sigmoid, ``torch.topk`` on the selection
  key (scores, plus the expert bias for sigmoid routing), the weights gathered, renormalised and scaled.
- ``torch-fp32-compiled`` (only when named in ``--impls``): the same function through ``torch.compile``
  (``fullgraph``, one compile a point: seconds each).

Each point draws fp32 weights ~ N(0, 0.02^2), bf16 x ~ N(0, 1) and (sigmoid cases) a bias ~ N(0, 0.1^2), in as
many copies as keep a cycle of calls out of L2 (the router benchmark's rotation). Every impl's selection is checked
against the fp64 reference (``evenflow.reference.router.route_ref`` on the fp64 product): ``id_flips`` (ids of a row
not in the reference's set, summed over rows) and ``max_abs_err`` of the weights where a row's set agrees. It is
then timed eagerly with L2 flushed (``eager_us``, first: a ``route`` call captured in a CUDA graph ends the
eager path's kept zeros, ``RouterWeight.zeros_kept``) and as a CUDA-graph replay (``us``).

Floor: the bytes a call must move (the fp32 weight, bf16 x, int32 ids and fp32 weights) at the run's copy bandwidth
plus one empty kernel's launch in a graph: the router benchmark's floor with the ids and weights in place of the
logits. The ``evenflow-gemm`` rows write the logits, so theirs is the router benchmark's floor itself. ``vs_torch``:
torch-fp32's time over the row's (graph and eager: ``vs_torch``, ``vs_torch_eager``).

The selection rules per case: Qwen3-30B-A3B top-8 softmax; DeepSeek-V3 top-8 sigmoid with a bias and scaling 2.5
(its config's ``routed_scaling_factor``; its expert groups are not modelled); the K=4096 N=192 and LongCat-Lite shapes
top-8 / top-12 sigmoid with a bias (a rule chosen here). LongCat-Chat's 768 experts are over ``route``'s 512, so the
router benchmark's fourth shape has no case here.
"""
from __future__ import annotations

import functools
import sys

import torch

import evenflow
import router as router_bench  # benchmarks/ is the script's directory: the rotation and the launch-floor step
from evenflow.bench import harness as H
from evenflow.reference import router as R

# case -> (K, N, top_k, scoring, routed_scaling)
CASES = {"qwen3-30b-a3b": (2048, 128, 8, "softmax", 1.0), "K4096-N192": (4096, 192, 8, "sigmoid", 1.0),
         "deepseek-v3": (7168, 256, 8, "sigmoid", 2.5), "longcat-lite": (3072, 384, 12, "sigmoid", 1.0)}
MS = (1, 4, 16, 64, 256, 1024, 4096)
QUICK = {"cases": ("qwen3-30b-a3b", "K4096-N192"), "ms": (1, 16, 512)}
IMPLS = ("evenflow", "evenflow-gemm", "torch-fp32", "torch-fp32-compiled")
DEFAULT_IMPLS = IMPLS[:3]
PEER = "torch-fp32"


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated case names (" + ",".join(CASES) + ")")
    p.add_argument("--ms", type=H.positive_ints, default=None, help="comma-separated M values")
    p.add_argument("--impls", default=None, help="comma-separated impls, timed in this order (default: "
                   + ",".join(DEFAULT_IMPLS) + "; also " + ",".join(IMPLS[len(DEFAULT_IMPLS):]) + ")")


def torch_route(x: torch.Tensor, w: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None,
                routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's native routing on an FP32 router weight: cuBLAS FP32 logits, PyTorch scoring and ``torch.topk``,
    the selected scores renormalised and scaled. (ids int64 [M, top_k], weights fp32 [M, top_k])."""
    logits = torch.mm(x.float(), w.t())
    if scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        return ids, weights / weights.sum(-1, keepdim=True) * routed_scaling
    scores = torch.sigmoid(logits)
    key = scores if bias is None else scores + bias
    ids = torch.topk(key, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scaling


def selection_errors(ids: torch.Tensor, weights: torch.Tensor, ref_ids: torch.Tensor,
                     ref_weights: torch.Tensor) -> tuple[int, float]:
    """(ids not in the reference's set of their row, summed over rows; max abs weight error, each expert's weight
    compared with the reference's weight of that expert, over the rows whose set agrees: 0.0 where none does)."""
    if ids.shape != ref_ids.shape or weights.shape != ids.shape:
        raise ValueError(f"selection shapes differ: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, "
                         f"reference {tuple(ref_ids.shape)}")
    ids, ref_ids = ids.long(), ref_ids.long()
    match = ids.unsqueeze(-1) == ref_ids.unsqueeze(-2)  # [M, k, k]: our slot i holds the reference's slot j
    hit = match.any(-1)
    flips = int((~hit).sum())
    rows = hit.all(-1)
    if not bool(rows.any()):
        return flips, 0.0
    ref_of_ours = (match.to(ref_weights.dtype) * ref_weights.unsqueeze(-2)).sum(-1)  # the reference's weight
    err = (weights.double() - ref_of_ours.double()).abs()[rows]
    return flips, float(err.max())


def route_bytes(m: int, n: int, k: int, top_k: int) -> int:
    """Bytes one call must move: the fp32 weight, bf16 x, int32 ids and fp32 weights."""
    return n * k * 4 + m * k * 2 + m * top_k * 8


def add_speedups(rows: list[dict]) -> None:
    """``vs_torch`` / ``vs_torch_eager`` (torch-fp32's time over the row's) on every other timed row of a point."""
    peer = {(r["case"], r.get("M")): r for r in rows if r["impl"] == PEER and "us" in r}
    for r in rows:
        p = peer.get((r["case"], r.get("M")))
        if r["impl"] == PEER or p is None or "us" not in r:
            continue
        r["vs_torch"] = round(p["us"] / r["us"], 3)
        if r.get("eager_us") and p.get("eager_us"):
            r["vs_torch_eager"] = round(p["eager_us"] / r["eager_us"], 3)


def _calls(impl: str, ws: list, xs: list, bias, top_k: int, scoring: str, scaling: float) -> list:
    """One call a copy of ``impl`` (its buffers allocated here, before any capture)."""
    m, n = xs[0].shape[0], ws[0].shape[0]
    if impl.startswith("evenflow"):
        rws = [evenflow.RouterWeight(w) for w in ws]
        for rw in rws:  # this M's workspace and logits buffer (reserve would resolve every M up to it)
            rw.workspace(m, rw.config(m))
            rw.logits_buffer(m)
    if impl == "evenflow-gemm":
        outs = [torch.empty(m, n, device=w.device) for w in ws]
        return [lambda x=x, rw=rw, o=o: evenflow.router_gemm(x, rw, o) for x, rw, o in zip(xs, rws, outs)]
    if impl == "evenflow":
        outs = [(torch.empty(m, top_k, dtype=torch.int32, device=w.device), torch.empty(m, top_k, device=w.device))
                for w in ws]
        return [lambda x=x, rw=rw, o=o: evenflow.route(x, rw, top_k, scoring, bias, routed_scaling=scaling, out=o)
                for x, rw, o in zip(xs, rws, outs)]
    fn = torch_route
    if impl == "torch-fp32-compiled":
        torch._dynamo.reset()
        fn = torch.compile(torch_route, fullgraph=True, dynamic=False)
    return [functools.partial(fn, x, w, top_k, scoring, bias, scaling) for x, w in zip(xs, ws)]


def main(argv=None) -> int:
    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_extra)
    cases = H.choices("--cases", args.cases, tuple(CASES), QUICK["cases"] if args.quick else tuple(CASES))
    ms = tuple(args.ms) if args.ms else (QUICK["ms"] if args.quick else MS)
    impls = H.choices("--impls", args.impls, IMPLS, DEFAULT_IMPLS)
    ceil = H.measure_ceilings()
    res = H.Results("route", ceilings=ceil, out=args.out)
    torch.manual_seed(0)
    for case in cases:
        k, n, top_k, scoring, scaling = CASES[case]
        for m in H.progress(ms, f"route {case}"):
            ws, xs = router_bench.rotated_copies(m, n, k)
            bias = torch.randn(n, device=ws[0].device) * 0.1 if scoring == "sigmoid" else None
            ref_ids, ref_w = R.route_ref(R.router_logits_fp64(xs[0], ws[0]), top_k, scoring, bias,
                                         routed_scaling=scaling)
            floors = {impl: H.floor_us(bytes_moved=router_bench._call_bytes(m, n, k) if impl == "evenflow-gemm"
                                       else route_bytes(m, n, k, top_k), ceilings=ceil, extra_us=ceil["launch_us"])
                      for impl in impls}  # the GEMM alone writes the [M, N] logits, not the ids and weights
            for impl in impls:
                try:
                    fns = _calls(impl, ws, xs, bias, top_k, scoring, scaling)
                    out = fns[0]()
                    fields = dict(floor_us=floors[impl], M=m, K=k, N=n, top_k=top_k, scoring=scoring)
                    if impl == "evenflow-gemm":
                        chk = H.check_output(out, R.router_logits_fp64(xs[0], ws[0]), f"{case} M={m} {impl}")
                        fields["max_abs_err"] = float(chk["max_abs_err"])
                    else:
                        flips, err = selection_errors(*out, ref_ids, ref_w)
                        fields.update(id_flips=flips, max_abs_err=err)
                    eager = H.time_eager(fns)
                    res.add(case=case, impl=impl, us=H.time_graph(fns), eager_us=eager, **fields)
                except Exception as e:  # a failing impl is a result row, not a lost run
                    res.add_error(case=case, impl=impl, error=H.error_line(e), M=m)
            del ws, xs
            torch.cuda.empty_cache()
    res.settle_copy()
    router_bench._lowest_launch(res, ceil)
    add_speedups(res.rows)
    res.finish(x="M", group="case", columns=("case", "M", "impl", "us", "eager_us", "floor_us", "frac_of_floor",
                                             "id_flips", "max_abs_err", "vs_torch", "vs_torch_eager", "error"),
               plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
