"""Fused attention prologue benchmark: evenflow's qk_norm_rope_store_kv vs the unfused PyTorch steps, vs the floor.

    python benchmarks/prologue.py [--quick] [--cases qwen3-30b-a3b] [--ts 1,64,4096] [--impls evenflow,...]
                                  [--out DIR] [--no-plot]

Per (model shape, tokens T, variant): the QKV projection's output [T, (Hq + 2 Hkv) * 128] bf16 ~ N(0, 1), norm
weights ~ U(0.5, 1.5), a rotary table of 32K positions, a paged cache (page 64, pages in random order). T <= 256 is
a decode step (T requests, one new token each after 1-4K cached ones); larger T are prefill chunks (512 new tokens a
request after 0-2K cached ones). Variants: ``bf16`` (bf16 q and cache), ``fp8-kv`` (bf16 q, fp8 e4m3 cache at a
per-tensor scale), ``fp8-q-kv`` (fp8 q with its per-token-per-head scales, fp8 cache: the decode kernel's
HPC-Ops-style input). Each impl's q and written cache slots are checked against the fp64 oracle
(``evenflow.reference.prologue``) before it is timed as a CUDA-graph replay (``us``) and eagerly (``eager_us``).
Several input copies are rotated so a cycle of calls does not find its inputs in L2.

Peers (``evenflow.bench.peers.torch_prologue``): ``torch-unfused``, the steps as Hugging Face transformers writes
them plus the engines' slot-indexed cache write, eagerly (a kernel each); ``torch-compile``, the same steps through
``torch.compile`` (Inductor fuses the elementwise ones).

Floor: (qkv read + q written (+ its scales) + K and V written + positions read + each distinct rotary row read
once) / copy bandwidth + one empty kernel's launch time in a graph, both measured in this run.
"""
from __future__ import annotations

import math

import torch

import evenflow
from evenflow.attention.prologue import prologue_bytes
from evenflow.bench import harness as H
from evenflow.bench.peers import torch_prologue as peer
from evenflow.reference.attention import shuffled_page_tables
from evenflow.reference.prologue import qk_norm_rope_ref

MODELS = {"qwen3-30b-a3b": (32, 4, 128), "qwen3-235b-a22b-tp8": (8, 1, 128)}  # (Hq, Hkv, D) on one GPU
TS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK = {"cases": ("qwen3-30b-a3b",), "ts": (1, 64, 4096)}
FP8 = torch.float8_e4m3fn
VARIANTS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp8-kv": (torch.bfloat16, FP8), "fp8-q-kv": (FP8, FP8)}
IMPLS = ("evenflow", "torch-unfused", "torch-compile")
PAGE = 64
MAX_POS = 32768
KV_SCALE = 0.02  # an fp8 cache's per-tensor scale: normed, rotated K (|k| up to ~5) lands well inside e4m3's range
ROTATE_BYTES = 150 << 20  # > 2x L2
DECODE_MAX_T = 256
CHUNK = 512


def layout(t: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """(new tokens, cached prefix) per request: a decode step at T <= 256, prefill chunks above."""
    if t <= DECODE_MAX_T:
        return [1] * t, torch.randint(1024, 4096, (t,), generator=g).tolist()
    b = math.ceil(t / CHUNK)
    new = [CHUNK] * (b - 1) + [t - CHUNK * (b - 1)]
    return new, torch.randint(0, 2048, (b,), generator=g).tolist()


def call_bytes(hq: int, hkv: int, d: int, t: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
               rotary_rows: int | None = None) -> int:
    """Bytes one call must move (``evenflow.attention.prologue.prologue_bytes``; ``rotary_rows``: the point's distinct
    positions, each rotary row read once)."""
    return prologue_bytes(t, hq, hkv, d, q_dtype, kv_dtype, rotary_rows=rotary_rows)


def build(model: str, t: int, variant: str, device="cuda", seed: int = 0, copies: int | None = None) -> dict:
    """One point's tensors: ``copies`` sets of (qkv, q_out, q_scale) around one cache, page table and rotary table
    (as many copies, 1-16, as keep a cycle of calls out of L2 when ``copies`` is None)."""
    hq, hkv, d = MODELS[model]
    q_dtype, kv_dtype = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    new, prefix = layout(t, g)
    tables, pool = shuffled_page_tables([p + n for p, n in zip(prefix, new)], PAGE, generator=g)
    if copies is None:
        copies = max(1, min(16, math.ceil(ROTATE_BYTES / call_bytes(hq, hkv, d, t, q_dtype, kv_dtype))))
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)])
    cache = (pool, PAGE, hkv, d)
    k = torch.randn(cache, generator=g)
    v = torch.randn(cache, generator=g)
    if kv_dtype == FP8:
        k, v = k.to(FP8), v.to(FP8)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    to = dict(device=device)
    pt = dict(
        positions=pos.to(**to), cos_sin=evenflow.rope_cos_sin(MAX_POS, d, base=1e6, **to),
        k_cache=k.to(**to), v_cache=v.to(**to), page_table=tables[0].to(**to),
        cu_seqlens_q=torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, **to),
        qw=(torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).to(**to),
        kw=(torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).to(**to),
        qkvs=[torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(**to) for _ in range(copies)],
        q_dtype=q_dtype, kv_scale=KV_SCALE if kv_dtype == FP8 else 1.0, dims=(hq, hkv, d))
    pt["q_outs"] = [torch.empty(t, hq, d, dtype=q_dtype, **to) for _ in range(copies)]
    pt["s_outs"] = [torch.empty(t, hq, **to) if q_dtype == FP8 else None for _ in range(copies)]
    return pt


def _args(pt: dict, i: int) -> tuple:
    return (pt["qkvs"][i], pt["positions"], pt["cos_sin"], pt["k_cache"], pt["v_cache"], pt["page_table"],
            pt["cu_seqlens_q"])


def calls(impl: str, pt: dict) -> list:
    """One zero-argument call a copy of ``impl`` on the point's tensors."""
    s = pt["kv_scale"]
    if impl == "evenflow":
        return [lambda i=i: evenflow.qk_norm_rope_store_kv(
            *_args(pt, i), q_norm_weight=pt["qw"], k_norm_weight=pt["kw"], q_dtype=pt["q_dtype"],
            k_scale=s if s != 1.0 else None, v_scale=s if s != 1.0 else None, q_out=pt["q_outs"][i],
            q_scale_out=pt["s_outs"][i]) for i in range(len(pt["qkvs"]))]
    if impl == "torch-compile":
        # a fresh Dynamo cache a point: the peer's one step function meets a new shape at each point, and Dynamo's
        # recompile limit (8 a function) failed every point after the eighth (round BY's first run, an H100); a
        # cache holding only this point's entry also keeps its guard check as short as in a serving process
        torch._dynamo.reset()
    return [peer.make(*_args(pt, i), pt["qw"], pt["kw"], q_dtype=pt["q_dtype"], k_scale=s, v_scale=s,
                      compiled=impl == "torch-compile") for i in range(len(pt["qkvs"]))]


def check(pt: dict, out) -> dict:
    """The first copy's q (dequantised where fp8) and its written K / V slots against the fp64 oracle
    (``harness.check_output``: finite, close, cosine >= 0.999); returns the error figures."""
    hq, hkv, d = pt["dims"]
    q, qs = out
    ref_q, ref_k, ref_v = qk_norm_rope_ref(pt["qkvs"][0], pt["positions"], pt["cos_sin"], hkv, d, pt["qw"],
                                           pt["kw"])
    got_q = q.double() * (qs.double()[..., None] if qs is not None else 1.0)
    err = H.check_output(got_q.cpu(), ref_q, "q", rtol=2 ** -6 if qs is None else 2 ** -3)
    slot = peer.slots(pt["positions"], pt["page_table"], pt["cu_seqlens_q"], PAGE)
    fp8 = pt["k_cache"].dtype == FP8
    for name, ref in (("k_cache", ref_k), ("v_cache", ref_v)):
        got = pt[name].view(-1, hkv, d)[slot].double().cpu() * pt["kv_scale"]
        e = H.check_output(got, ref, name, rtol=2 ** -3 if fp8 else 2 ** -6)
        err = {k: max(err[k], e[k]) if k == "max_abs_err" else min(err[k], e[k]) for k in err}
    return err


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated model shapes (" + ", ".join(MODELS) + ")")
    p.add_argument("--ts", type=H.positive_ints, default=None, help="comma-separated token counts")
    p.add_argument("--variants", default=None, help="comma-separated variants (" + ", ".join(VARIANTS) + ")")
    p.add_argument("--impls", default=None, help="comma-separated impls (" + ", ".join(IMPLS) + ")")


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    cases = H.choices("--cases", args.cases, MODELS, QUICK["cases"] if args.quick else MODELS)
    ts = tuple(args.ts) if args.ts else (QUICK["ts"] if args.quick else TS)
    variants = H.choices("--variants", args.variants, VARIANTS, VARIANTS)
    impls = H.choices("--impls", args.impls, IMPLS, IMPLS)
    H._require_cuda("prologue")
    ceil = H.measure_ceilings()
    res = H.Results("prologue", ceilings=ceil, out=args.out)
    for case in cases:
        hq, hkv, d = MODELS[case]
        for variant in variants:
            series = f"{case} {variant}"  # the plot's panel: each model's bars apart
            for t in H.progress(ts, f"prologue {case} {variant}"):
                q_dtype, kv_dtype = VARIANTS[variant]
                pt = build(case, t, variant)
                rows = int(pt["positions"].unique().numel())
                floor = H.floor_us(bytes_moved=call_bytes(hq, hkv, d, t, q_dtype, kv_dtype, rows), ceilings=ceil,
                                   extra_us=ceil["launch_us"])
                for impl in impls:
                    try:
                        fns = calls(impl, pt)
                        chk = check(pt, fns[0]())
                        res.add(case=case, variant=variant, series=series, impl=impl, us=H.time_graph(fns),
                                eager_us=H.time_eager(fns), floor_us=floor, T=t, copies=len(fns),
                                max_abs_err=float(chk["max_abs_err"]), cosine=float(chk["cosine"]))
                    except H.PeerUnavailable as e:
                        res.add_error(case=case, variant=variant, series=series, impl=impl, error=str(e), T=t)
                    except Exception as e:  # a failing impl is a result row, not a lost run
                        res.add_error(case=case, variant=variant, series=series, impl=impl,
                                      error=f"{type(e).__name__}: {e}", T=t)
                del pt
                torch.cuda.empty_cache()
    _speedups(res)
    res.finish(x="T", group="series", columns=("case", "variant", "T", "impl", "us", "eager_us", "floor_us",
                                                "frac_of_floor", "vs_unfused", "vs_compile", "max_abs_err", "error"),
               plot=not args.no_plot)
    return 0


def _speedups(res: H.Results) -> None:
    """vs_unfused / vs_compile (peer us / our us) on the evenflow rows."""
    by = {(r["case"], r.get("variant"), r.get("T"), r["impl"]): r for r in res.rows if "us" in r}
    for (case, variant, t, impl), r in by.items():
        if impl != "evenflow":
            continue
        for p_impl, col in (("torch-unfused", "vs_unfused"), ("torch-compile", "vs_compile")):
            p = by.get((case, variant, t, p_impl))
            if p:
                r[col] = round(p["us"] / r["us"], 3)


if __name__ == "__main__":
    raise SystemExit(main())
