"""Paged prefill / extend attention benchmark: evenflow's prefill_attention vs FlashInfer's paged prefill, vs the floor.

    python benchmarks/prefill.py [--quick] [--cases 1x8K,4x2K] [--heads qwen3-30b-a3b] [--impls evenflow,...]
                                 [--out DIR] [--no-plot]

Cases ``AxN[+P]``: A requests of N new tokens each after P cached ones (chunked prefill when P > 0), head shapes
Qwen3-30B-A3B (32 q / 4 kv heads) and Hy3 (64 / 8), head_dim 128, page 64, pages in random order; bf16 and fp8
(e4m3, per-tensor scales) caches. Each impl's output is checked against the fp64 oracle on a sample of rows (the
first and last 16 of each request, each computed as the one-row request it is) before it is timed. Prefill runs
eagerly in the engines, so ``us`` is the eager median (inputs rotated, L2 flushed between calls), and ``graph_us``
a CUDA-graph replay where the impl can be captured.

Peers: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` with its FA2 and FA3 kernels, causal, planned once per
batch outside timing (its FA3 kernel takes an fp8 cache only with an fp8 q: an error row).

Knob rows (named in ``--impls``): ``evenflow`` with ``evenflow.attention.prefill``'s module switches set otherwise
around its calls (``KNOBS``), each against the default form in the same run: ``evenflow-masked`` is the masked
one-head form before round CC (its record, round CA3), ``evenflow-narrow`` the unmasked steps on one-head 64-row blocks,
``evenflow-unpacked`` one q head a block where chunks have at most 64 rows (round CC's ``PACK_HEADS`` off).

Floor: the larger of (q read + output written + each request's K and V read once) / copy bandwidth and the causal
attention's FLOPs (4 * D per visible (row, key) pair and head) / the dense bf16 rate, both measured in this run.
"""
from __future__ import annotations

import torch

import evenflow
from evenflow.attention import prefill as prefill_mod
from evenflow.attention.prefill import prefill_work
from evenflow.bench import harness as H
from evenflow.bench.peers import flashinfer as fi
from evenflow.reference.attention import prefill_rows_ref, shuffled_page_tables

CASES = {"1x8K": (1, 8192, 0), "4x2K": (4, 2048, 0), "1x2K+30K": (1, 2048, 30720), "16x512+4K": (16, 512, 4096),
         "64x64+2K": (64, 64, 2048), "32x16+4K": (32, 16, 4096)}
HEADS = {"qwen3-30b-a3b": (32, 4), "hy3": (64, 8)}
QUICK = {"cases": ("4x2K", "1x2K+30K"), "heads": ("qwen3-30b-a3b",)}
VARIANTS = {"bf16-kv": torch.bfloat16, "fp8-kv": torch.float8_e4m3fn}
D, PAGE = 128, 64
KV_SCALE = 0.05
SAMPLE = 16
# knob row -> the module switches of evenflow.attention.prefill it sets around its calls (round CA's loop forms and
# round CC's head packing, all on by default since round CC)
KNOBS = {"evenflow-masked": {"SPLIT_LOOP": False, "WIDE_ROWS": False, "PACK_HEADS": False},
         "evenflow-narrow": {"WIDE_ROWS": False, "PACK_HEADS": False}, "evenflow-unpacked": {"PACK_HEADS": False}}
DEFAULT_IMPLS = ("evenflow", *fi.PREFILL_IMPLS)
IMPLS = (*DEFAULT_IMPLS, *KNOBS)


def build(case: str, heads: str, variant: str, device="cuda", seed: int = 0) -> dict:
    a, n, p = CASES[case]
    hq, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(seed)
    lens = [p + n] * a
    tables, pool = shuffled_page_tables(lens, PAGE, generator=g)
    kv = VARIANTS[variant]
    k = torch.randn(pool, PAGE, hkv, D, generator=g)
    v = torch.randn(pool, PAGE, hkv, D, generator=g)
    if kv == torch.float8_e4m3fn:
        k, v = (k / KV_SCALE).to(kv), (v / KV_SCALE).to(kv)
    else:
        k, v = k.to(kv), v.to(kv)
    to = dict(device=device)
    return dict(q=torch.randn(a * n, hq, D, generator=g).to(torch.bfloat16).to(**to), k=k.to(**to), v=v.to(**to),
                cu=torch.arange(0, a * n + 1, n, dtype=torch.int32, **to), pt=tables[0].to(**to),
                sl=torch.tensor(lens, dtype=torch.int32, **to), max_q=n,
                scale=KV_SCALE if kv == torch.float8_e4m3fn else None, heads=(hq, hkv))


def floor_terms(pt: dict) -> tuple[int, int]:
    """(bytes, FLOPs) one call must move and do (``evenflow.attention.prefill.prefill_work``)."""
    hq, hkv = pt["heads"]
    cu = pt["cu"].tolist()
    return prefill_work([b - a for a, b in zip(cu, cu[1:])], pt["sl"].tolist(), hq, hkv, D, pt["k"].element_size())


def sample_check(pt: dict, out: torch.Tensor) -> dict:
    """The first and last SAMPLE rows of each request against the fp64 oracle (``prefill_rows_ref``: each row as a
    one-row request, so the oracle never holds a whole request's scores)."""
    cu = pt["cu"].tolist()
    rows = sorted({a + i for a, b in zip(cu, cu[1:]) for i in (*range(min(SAMPLE, b - a)),
                                                               *range(max(0, b - a - SAMPLE), b - a))})
    ref, _ = prefill_rows_ref(pt["q"], pt["k"], pt["v"], pt["cu"], pt["pt"], pt["sl"], rows, k_scale=pt["scale"],
                              v_scale=pt["scale"])
    return H.check_output(out[torch.tensor(rows, device=out.device)], ref, "sampled rows")


def calls(impl: str, pt: dict, copies: int = 2) -> list:
    hq, hkv = pt["heads"]
    s = pt["scale"]
    outs = [torch.empty_like(pt["q"]) for _ in range(copies)]
    qs = [pt["q"]] + [pt["q"].clone() for _ in range(copies - 1)]
    if impl == "evenflow" or impl in KNOBS:  # (switches are read at launch: a graph captured inside keeps them)
        return H.switched(prefill_mod, KNOBS.get(impl, {}), [
            lambda q=q, o=o: evenflow.prefill_attention(q, pt["k"], pt["v"], pt["cu"], pt["pt"], pt["sl"],
                                                        pt["max_q"], k_scale=s, v_scale=s, out=o)
            for q, o in zip(qs, outs)])
    w = fi.FlashInferPrefill(impl, pt["cu"], pt["pt"], pt["sl"], num_q_heads=hq, num_kv_heads=hkv, head_dim=D,
                             page_size=PAGE, kv_dtype=pt["k"].dtype)
    return [w.runner(q, pt["k"], pt["v"], k_scale=s, v_scale=s, out=o) for q, o in zip(qs, outs)]


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated cases (" + ", ".join(CASES) + ")")
    p.add_argument("--heads", default=None, help="comma-separated head shapes (" + ", ".join(HEADS) + ")")
    p.add_argument("--impls", default=None, help="comma-separated impls (default " + ", ".join(DEFAULT_IMPLS)
                   + "; knob rows " + ", ".join(KNOBS) + ")")


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    cases = H.choices("--cases", args.cases, CASES, QUICK["cases"] if args.quick else CASES)
    heads = H.choices("--heads", args.heads, HEADS, QUICK["heads"] if args.quick else HEADS)
    impls = H.choices("--impls", args.impls, IMPLS, DEFAULT_IMPLS)
    H._require_cuda("prefill")
    ceil = H.measure_ceilings()
    res = H.Results("prefill", ceilings=ceil, out=args.out, meta={"flashinfer": fi.version()})
    for head in heads:
        for variant in VARIANTS:
            for case in H.progress(cases, f"prefill {head} {variant}"):
                pt = build(case, head, variant)
                byt, flops = floor_terms(pt)
                floor = H.floor_us(bytes_moved=byt, flops=flops, ceilings=ceil)
                for impl in impls:
                    try:
                        fns = calls(impl, pt)
                        chk = sample_check(pt, fns[0]())
                        try:
                            graph = H.time_graph(fns, reps=10, min_calls=2)
                        except Exception as e:  # a peer that cannot be captured keeps its eager time
                            graph = None
                            print(f"[prefill] {case} {impl}: no graph: {H.error_line(e)}", flush=True)
                        us = H.time_eager(fns)
                        res.add(case=f"{head}:{case}", variant=variant, impl=impl, us=us, graph_us=graph,
                                floor_us=floor, tflops=round(flops / us / 1e6, 1),
                                max_abs_err=float(chk["max_abs_err"]))
                    except H.PeerUnavailable as e:
                        res.add_error(case=f"{head}:{case}", variant=variant, impl=impl, error=str(e))
                    except Exception as e:  # a failing impl is a result row, not a lost run
                        res.add_error(case=f"{head}:{case}", variant=variant, impl=impl,
                                      error=f"{type(e).__name__}: {e}")
                del pt
                torch.cuda.empty_cache()
    _speedups(res)
    res.finish(x="case", group="variant", columns=("case", "variant", "impl", "us", "graph_us", "floor_us",
                                                   "frac_of_floor", "vs_best_flashinfer", "vs_evenflow", "max_abs_err",
                                                   "error"),
               plot=not args.no_plot)
    return 0


def _speedups(res: H.Results) -> None:
    """vs_best_flashinfer (the fastest FlashInfer impl's us / ours) on the evenflow rows and knob rows, and on each
    knob row vs_evenflow (the form of record's us / the knob's: above 1, the knob is faster)."""
    us = {(r["case"], r.get("variant"), r["impl"]): r["us"] for r in res.rows if "us" in r}
    for r in res.rows:
        if not (r["impl"] == "evenflow" or r["impl"] in KNOBS) or "us" not in r:
            continue
        point = (r["case"], r.get("variant"))
        peers = [us[(*point, p)] for p in fi.PREFILL_IMPLS if (*point, p) in us]
        if peers:
            r["vs_best_flashinfer"] = round(min(peers) / r["us"], 3)
        if r["impl"] in KNOBS and (*point, "evenflow") in us:
            r["vs_evenflow"] = round(us[(*point, "evenflow")] / r["us"], 3)


if __name__ == "__main__":
    raise SystemExit(main())
