"""End to end in Hugging Face transformers: a Qwen3-30B-A3B-shaped model, stock against evenflow's MoE and attention.

    python benchmarks/e2e_transformers.py [--quick] [--layers 8] [--batches 1,8,32,128] [--mixes 1x4096+15x256]
                                          [--parts forward,generate,graph] [--out DIR] [--no-plot]

The model: Qwen3-30B-A3B's dimensions (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, top-8, its
vocabulary) with ``--layers`` of its 48 layers and transformers' own random initialisation, bf16 on the GPU. Cases:
decode steps (batch B, one new token each after a 2048-token cache: ``decode-bB``) and prefills (``prefill-BxS``).
Impls: ``transformers-grouped_mm`` (transformers' default experts, its router), ``transformers-eager`` (its loop over
experts), ``evenflow-experts`` (``fused_moe`` as the experts implementation, transformers' router) and ``evenflow``
(``evenflow.integrations.transformers.enable``: experts and router). Each impl's logits are checked against the
default's (finite, cosine >= 0.999) before it is timed: a forward as transformers runs it (Python, launches, its
cache), eager, median; a decode step's cache is cropped back after each call; only the last position's logits are
computed (``logits_to_keep=1``, as ``generate`` asks). ``us`` is the whole forward, ``us_per_layer`` the same over the
layer count (the embedding and the vocabulary projection included once, so it over-states a layer's share on a
shallow model: at 8 layers and batch 1 the vocabulary projection's 0.6 GB read may cost more than the MoE layers'
~75 MB each, which shrinks ``vs_default``; ``--layers`` weighs it down), ``vs_default`` the default's time over the
impl's. No floor: these
rows measure what a user of the engine sees, not a kernel.

Generate cases (``generate-<mix>``, e.g. ``1x4096+15x256``: one 4096-token prompt and fifteen of 256, left-padded
into one batch as transformers' generate takes them): ``model.generate`` greedy, timed at 1 and at 1 + ``NEW``
new tokens; ``us`` is a decode step, (t(1 + NEW) - t(1)) / NEW, the prompt's prefill cancelled. Impls:
``transformers-sdpa`` (the stock model: sdpa over transformers' padded DynamicCache, its grouped_mm experts),
``transformers-sdpa-static`` (the same over its StaticCache, ``cache_implementation="static"``, eager:
``disable_compile``), ``evenflow-moe``
(``enable``: the MoE layers on evenflow, the stock attention and cache), ``evenflow-unfused`` (``enable`` and
``enable_attention(fuse_prologue=False)`` over a ``PagedCache``: each request's real tokens only, decode steps on a
DecodePlan, the model's own norms and rotation) and ``evenflow`` (the same with the fused prologue: one q / k / v
GEMM and ``qk_norm_rope_store_kv`` a layer). Each
impl's first-step logits are checked against the stock model's (cosine >= 0.999) before it is timed. ``kv_mb``: the
KV cache the impl holds (evenflow's pool of the real tokens plus the new ones in pages; transformers' padded
rectangle, computed).

Graph cases (``graph-<mix>``, the same mixes): one decode step of the mix after its prompts' prefill, captured in a
CUDA graph and replayed (``harness.time_graph``), so the host's Python and launches drop out and the row is the GPU's
step as an engine that captures its decode step sees it. Impls: ``transformers-sdpa-static`` (the stock model over
its StaticCache, which transformers builds for graph capture: lengths on the device, no host sync in the step),
``evenflow-moe`` (the same cache and attention, the MoE layers on evenflow), ``evenflow-unfused`` and ``evenflow``
(over a PagedCache, as in the generate cases). Each call is the step and then ``cache.crop(-1)`` (both caches keep
their lengths on the device), so every replay is the same step at the same lengths. ``floor_us``: the bytes the step
cannot avoid, read once at the run's copy rate: every layer's attention and router weights, the experts the stock
router picks (counted on the stock model's step), each request's real cached tokens (K and V) and the new one's, and
the vocabulary projection (``step_floor_bytes``); ``vs_default`` is the StaticCache row's time over the impl's.

``gpu_us``: the same step's device time, the kernels' durations summed under ``torch.profiler``
(``harness.kernel_times``), and ``gpu_vs_default`` the default's over the impl's. Eager timing includes the host:
where ``us`` is far above ``gpu_us`` the rows time the Python and the launches (round BV's first run on an H100 timed
20-50 ms a step at batch 1 and 32 alike, transformers' eager experts aside), and the kernels' work, what a
CUDA-graph-captured engine would see, is ``gpu_us``.
"""
from __future__ import annotations

import argparse
import copy
import gc

import torch

from evenflow.bench import harness as H

IMPLS = ("transformers-grouped_mm", "transformers-eager", "evenflow-experts", "evenflow")
BATCHES = (1, 8, 32, 128)
PREFILLS = ((1, 512), (4, 512))
MIXES = ("1x4096+15x256", "1x8192+31x256")
GEN_IMPLS = ("transformers-sdpa", "transformers-sdpa-static", "evenflow-moe", "evenflow-unfused", "evenflow")
GRAPH_IMPLS = ("transformers-sdpa-static", "evenflow-moe", "evenflow-unfused", "evenflow")
PAGED_IMPLS = ("evenflow-unfused", "evenflow")  # the impls over a PagedCache
NEW = 16  # decode steps a generate case times (over the prefill's)
QUICK = {"batches": (1, 32), "prefills": ((1, 512),), "mixes": ("1x4096+15x256",)}
CTX = 2048
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, decoder_sparse_step=1,
                     mlp_only_layers=[], rope_theta=1e6)


def build_model(layers: int, device="cuda", **overrides):
    """The Qwen3-30B-A3B-shaped model (``overrides`` replace dimensions: tests build a small one), bf16, eval."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": layers, **overrides})
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def set_impl(model, impl: str) -> None:
    """Put ``model`` (built by :func:`build_model`, stock routers) in ``impl``'s form; ``evenflow`` swaps the routers,
    so build a fresh model for every impl after it."""
    import evenflow.integrations.transformers as ev_tf

    if impl.startswith("transformers-"):
        model.set_experts_implementation(impl.split("-", 1)[1])
    elif impl == "evenflow-experts":
        ev_tf.register()
        model.set_experts_implementation("evenflow")
    elif impl == "evenflow":
        ev_tf.enable(model)
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def decode_step(model, batch: int, ctx: int, vocab: int):
    """(one decode step's forward, its logits' first call): a ``ctx``-token cache filled by a prefill, then each call
    appends one token per request and crops it off again."""
    from transformers import DynamicCache

    import evenflow.integrations.transformers as ev_tf

    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, ctx), generator=g).to(dev)
    nxt = torch.randint(0, vocab, (batch, 1), generator=g).to(dev)
    cache = DynamicCache(config=model.config)
    ckw = ev_tf.cache_kwargs(model, cache)  # the cache's keyword for this transformers
    with torch.no_grad():  # (the last position's logits only: batch x ctx x vocab of them would not fit at B = 128)
        model(prompt, use_cache=True, logits_to_keep=1, **ckw)
    pos = torch.full((batch, 1), ctx, device=dev)

    def step():
        with torch.no_grad():
            out = model(nxt, use_cache=True, position_ids=pos, **ckw).logits
        cache.crop(-1)
        return out

    return step


def prefill(model, batch: int, seq: int, vocab: int):
    dev = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(2)).to(dev)

    def run():  # a prefill keeps the last position's logits, as generate() asks
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    return run


def parse_mix(mix: str) -> list[int]:
    """``"1x4096+15x256"`` -> [4096] + [256] * 15 (prompt lengths, longest first as written)."""
    lens = []
    for part in mix.split("+"):
        try:
            n, length = (int(x) for x in part.split("x"))
        except ValueError:
            raise ValueError(f"mix {mix!r}: expected parts like 1x4096 joined by '+'") from None
        if n < 1 or length < 1:
            raise ValueError(f"mix {mix!r}: counts and lengths must be positive")
        lens += [length] * n
    return lens


def generate_case(model, impl: str, lens: list[int], vocab: int, page_size: int = 64):
    """(``run(new)``: ``model.generate`` of ``new`` greedy tokens over the left-padded prompts of ``lens``, returning
    the first step's logits; set up for ``impl`` (built by :func:`build_model` and put in its MoE form by
    :func:`set_gen_impl`))."""
    import evenflow.integrations.transformers as ev_tf
    from evenflow.integrations.demo import generate_logits, left_padded

    dev = next(model.parameters()).device
    width = max(lens)
    ids, mask = left_padded(lens, vocab, dev, seed=3)
    cache = None
    if impl in PAGED_IMPLS:  # a pool of the real tokens and the new ones, in pages
        cache = paged_cache(model, lens, NEW + 1, page_size)
        kv_bytes = cache_bytes(cache)
    else:  # transformers' caches: the padded rectangle, every request as long as the longest (the prompt and NEW
        kv_bytes = len(lens) * (width + NEW) * kv_bytes_per_token(model.config)  # of the 1 + NEW tokens: the last
        # one is not cached)

    def run(new: int):
        # (eager, as every impl here: over a StaticCache generate would otherwise compile the forward, once for each
        # cache length the two timings make)
        kw = {"cache_implementation": "static", "disable_compile": True} if impl == "transformers-sdpa-static" else {}
        if cache is not None:
            cache.reset()
            kw.update(ev_tf.cache_kwargs(model, cache))
        return generate_logits(model, ids, mask, new, **kw)[1][:, 0]

    run.kv_bytes = kv_bytes  # the KV cache's size at the longest timed generate
    return run


def kv_bytes_per_token(cfg) -> int:
    """K + V of one cached token over every layer, bf16."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * cfg.num_hidden_layers


def paged_cache(model, lens: list[int], extra: int, page_size: int):
    """A PagedCache for the left-padded mix ``lens`` and ``extra`` more positions a request: a pool of each request's
    real tokens and the extra ones, in pages."""
    import evenflow.integrations.transformers as ev_tf

    pool = sum(-(-(n + extra) // page_size) * page_size for n in lens)
    return ev_tf.PagedCache(model, max_batch_size=len(lens), max_cache_len=max(lens) + extra, page_size=page_size,
                            max_tokens=pool)


def cache_bytes(cache) -> int:
    """The K / V tensors a cache holds (a PagedCache's pool with its spare page; a StaticCache's rectangle once its
    layers are initialised)."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def graph_step(model, impl: str, lens: list[int], vocab: int, page_size: int = 64):
    """``step()``: one greedy-decode-shaped step of the left-padded mix ``lens`` (a random next token a request, the
    mask one position longer, generate's positions) after the prompts' prefill, then ``cache.crop(-1)``; it returns
    the step's logits ``[B, 1, vocab]``. Every call finds the cache as the prefill left it, so a CUDA graph can
    capture one call and replay it: transformers' StaticCache (``transformers-*`` and ``evenflow-moe``) and evenflow's
    PagedCache (``PAGED_IMPLS``) keep their lengths on the device, which the step moves on and the crop back, and
    neither syncs with the host in a decode step (the first call hands the paged requests the pages their next token
    needs; the crop keeps them). ``step.cache``: the cache it steps."""
    import evenflow.integrations.transformers as ev_tf
    from evenflow.integrations.demo import left_padded

    if impl not in GRAPH_IMPLS:
        raise ValueError(f"impl must be one of {GRAPH_IMPLS}, got {impl!r}")
    from transformers import StaticCache

    dev = next(model.parameters()).device
    ids, mask = left_padded(lens, vocab, dev, seed=3)
    batch, width = ids.shape
    cache = (paged_cache(model, lens, 1, page_size) if impl in PAGED_IMPLS
             else StaticCache(config=model.config, max_cache_len=width + 1))
    ckw = ev_tf.cache_kwargs(model, cache)
    step_mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
    pos = (step_mask.cumsum(-1) - 1).masked_fill_(step_mask == 0, 1)  # generate's positions for left padding
    nxt = torch.randint(1, vocab, (batch, 1), generator=torch.Generator().manual_seed(4)).to(dev)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos[:, :-1], use_cache=True, logits_to_keep=1, **ckw)
    step_pos = pos[:, -1:].contiguous()

    def step():
        with torch.no_grad():
            out = model(nxt, attention_mask=step_mask, position_ids=step_pos, use_cache=True, logits_to_keep=1,
                        **ckw).logits
        cache.crop(-1)
        return out

    step.cache = cache
    return step


def experts_hit(model, step) -> list[int]:
    """Distinct experts each MoE layer's router picks in one call of ``step``, read from the model's own routers
    (transformers' ``Qwen3MoeTopKRouter``: its third output, the top-k ids); call it on the stock model."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    if not routers:
        raise TypeError("experts_hit: the model has no Qwen3MoeTopKRouter (a stock Qwen3-MoE model is needed)")
    hit: dict[int, int] = {}
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: hit.__setitem__(i, int(out[2].unique().numel())))
             for i, r in enumerate(routers)]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return [hit[i] for i in range(len(routers))]


def step_floor_bytes(cfg, lens: list[int], hit: list[int]) -> int:
    """Bytes a decode step of the mix ``lens`` cannot avoid reading or writing (bf16): each layer's q / k / v / o and
    router weights, its norms, the ``hit[layer]`` experts' three projections, each request's real cached tokens' K
    and V and the new token's (read and written); the final norm and the vocabulary projection (one position a
    request). Activations (a few KB a layer) are left out."""
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if len(hit) != cfg.num_hidden_layers:
        raise ValueError(f"hit: {len(hit)} layers' counts for a {cfg.num_hidden_layers}-layer model")
    attn = h * (hq + 2 * hkv) * d + hq * d * h + 2 * d + 2 * h  # projections, q / k norms, the two layer norms
    router = cfg.num_experts * h
    kv = 2 * hkv * d * (sum(lens) + 2 * len(lens))  # cached tokens read, the new one written and read
    per_layer = sum(attn + router + 3 * h * e * n + kv for n in hit)
    return 2 * (per_layer + h + cfg.vocab_size * h)


def set_gen_impl(model, impl: str) -> None:
    """Put ``model`` (stock) in a generate impl's form."""
    import evenflow.integrations.transformers as ev_tf

    if impl not in GEN_IMPLS:
        raise ValueError(f"impl must be one of {GEN_IMPLS}, got {impl!r}")
    if impl.startswith("evenflow"):
        ev_tf.enable(model)
    if impl in PAGED_IMPLS:
        ev_tf.enable_attention(model, fuse_prologue=impl == "evenflow")


def _extra(p):
    p.add_argument("--layers", type=H.positive_int, default=8, help="layers of the model (Qwen3-30B-A3B has 48)")
    p.add_argument("--batches", type=H.positive_ints, default=None, help="comma-separated decode batch sizes")
    p.add_argument("--mixes", default=None, help="comma-separated generate mixes, e.g. 1x4096+15x256 ('' for none)")
    p.add_argument("--parts", type=parts, default=PARTS,
                   help=f"comma-separated parts to run, of {','.join(PARTS)} (default all): the decode / prefill "
                        "forwards, the generate cases, the graph-replayed decode steps")


PARTS = ("forward", "generate", "graph")


def parts(text: str) -> tuple[str, ...]:
    """An argparse ``type``: a comma-separated subset of :data:`PARTS`."""
    got = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in got if p not in PARTS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(PARTS)}, got {text!r}")
    return got


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    batches = tuple(args.batches) if args.batches else (
        QUICK["batches"] if args.quick else BATCHES)
    prefills = QUICK["prefills"] if args.quick else PREFILLS
    H._require_cuda("e2e_transformers")
    import transformers

    graph = "graph" in args.parts
    res = H.Results("e2e_transformers", ceilings=H.measure_ceilings() if graph else None, out=args.out,
                    meta={"transformers": transformers.__version__, "layers": args.layers, "ctx": CTX,
                          "shape": "qwen3-30b-a3b", "parts": list(args.parts)})
    base = build_model(args.layers)
    vocab = base.config.vocab_size
    cases = [(f"decode-b{b}", lambda m, b=b: decode_step(m, b, CTX, vocab), b) for b in batches]
    cases += [(f"prefill-{b}x{s}", lambda m, b=b, s=s: prefill(m, b, s, vocab), b * s) for b, s in prefills]
    for name, make, tokens in H.progress(cases if "forward" in args.parts else [], "e2e"):
        def prepare(model, impl, make=make, tokens=tokens):
            set_impl(model, impl)
            fn = make(model)

            def timed():
                us = H.time_eager(fn, reps=10)
                _, gpu = H.kernel_times(fn, reps=3, warmup=False)
                return us, {"tokens": tokens, "tokens_per_s": round(tokens / us * 1e6, 1), "gpu_us": round(gpu, 1)}
            return fn(), timed

        _impl_rows(res, base, name, IMPLS, prepare, args.layers)
    mixes = QUICK["mixes"] if args.quick else MIXES
    if args.mixes is not None:
        mixes = tuple(m for m in args.mixes.split(",") if m)
    for mix in H.progress(mixes if graph else [], "graph"):
        _graph_rows(res, base, mix, vocab, args.layers)
    for mix in H.progress(mixes if "generate" in args.parts else [], "generate"):
        _generate_rows(res, base, mix, vocab, args.layers)
    _speedups(res)
    res.finish(x="case", group=None, columns=("case", "impl", "us", "us_per_layer", "tokens_per_s", "vs_default",
                                              "gpu_us", "gpu_vs_default", "floor_us", "frac_of_floor", "kv_mb",
                                              "cosine", "error"),
               plot=not args.no_plot, settle=graph)
    return 0


def _impl_rows(res: H.Results, base, case: str, impls, prepare, layers: int) -> None:
    """One row per impl at ``case``: ``prepare(model, impl)`` puts a fresh copy of ``base`` in the impl's form and
    returns (its first logits, ``timed``); the logits are checked against the first impl's (finite only where that
    one failed: its error row says so), then ``timed()`` -> (us, extra fields). A failing impl is an error row, not
    a lost run."""
    ref = None
    for impl in impls:
        model = out = timed = None
        try:
            model = copy.deepcopy(base)
            out, timed = prepare(model, impl)
            if impl == impls[0]:
                ref = out.float()
            chk = H.check_output(out, out.float() if ref is None else ref, f"{case} {impl}", rtol=5e-2, atol=5e-2,
                                 min_cos=0.999)
            us, extra = timed()
            res.add(case=case, impl=impl, us=us, us_per_layer=us / layers, **extra,
                    max_abs_err=float(chk["max_abs_err"]), cosine=float(chk["cosine"]))
        except H.PeerUnavailable as e:
            res.add_error(case=case, impl=impl, error=str(e))
        except Exception as e:  # a failing impl is a result row, not a lost run
            res.add_error(case=case, impl=impl, error=f"{type(e).__name__}: {H.error_line(e)}")
        finally:
            # the impl's model, cache and graph gone before the next copy is made: ``timed`` holds them, and a
            # patched module (its forward bound to it) or a PagedCache (its layers name their owner) is a reference
            # cycle, freed by the collector only (round BV's 8K mix ran out of memory holding ~65 GB)
            model = out = timed = None
            gc.collect()
            torch.cuda.empty_cache()


def _generate_rows(res: H.Results, base, mix: str, vocab: int, layers: int) -> None:
    """A decode step of generate, (t(1 + NEW) - t(1)) / NEW, for every generate impl at ``mix``."""
    lens = parse_mix(mix)

    def prepare(model, impl):
        set_gen_impl(model, impl)
        run = generate_case(model, impl, lens, vocab)

        def timed():
            t1 = H.time_eager(lambda: run(1), reps=5, warmup=1)
            tn = H.time_eager(lambda: run(1 + NEW), reps=5, warmup=1)
            us = (tn - t1) / NEW
            g1, gn = (H.kernel_times(lambda n=n: run(n), 1, warmup=False)[1] for n in (1, 1 + NEW))
            return us, {"tokens": len(lens), "tokens_per_s": round(len(lens) / us * 1e6, 1), "prefill_us": t1,
                        "gpu_us": round((gn - g1) / NEW, 1),
                        "cached_tokens": sum(lens), "padded_tokens": max(lens) * len(lens),
                        "kv_mb": round(run.kv_bytes / 2 ** 20, 1)}
        return run(1), timed

    _impl_rows(res, base, f"generate-{mix}", GEN_IMPLS, prepare, layers)


def _graph_rows(res: H.Results, base, mix: str, vocab: int, layers: int) -> None:
    """A decode step of the mix captured in a CUDA graph and replayed (:func:`graph_step`), for every graph impl,
    with the step's floor (:func:`step_floor_bytes`; the experts counted on the first impl's, the stock model's, eager
    step before it is timed: every row has it unless that impl failed before the count)."""
    lens = parse_mix(mix)
    floor = {}

    def prepare(model, impl):
        set_gen_impl(model, impl)
        step = graph_step(model, impl, lens, vocab)
        if impl == GRAPH_IMPLS[0]:
            floor["us"] = H.floor_us(step_floor_bytes(model.config, lens, experts_hit(model, step)),
                                     ceilings=res.ceilings)

        def timed():
            us = H.time_graph(step, reps=10, min_calls=2)
            return us, {"tokens": len(lens), "tokens_per_s": round(len(lens) / us * 1e6, 1),
                        "cached_tokens": sum(lens), "padded_tokens": max(lens) * len(lens),
                        "kv_mb": round(cache_bytes(step.cache) / 2 ** 20, 1), "floor_us": floor.get("us")}
        return step()[:, 0], timed

    _impl_rows(res, base, f"graph-{mix}", GRAPH_IMPLS, prepare, layers)


def _speedups(res: H.Results) -> None:
    """vs_default: transformers' default time over each impl's, at the same case (grouped_mm experts for the
    forward cases, the stock model over its DynamicCache for the generate cases, over its StaticCache for the graph
    cases); gpu_vs_default: the same of the device times."""
    by = {(r["case"], r["impl"]): r for r in res.rows if "us" in r}
    for (case, _), r in by.items():
        d = by.get((case, GEN_IMPLS[0] if case.startswith("generate-") else
                    GRAPH_IMPLS[0] if case.startswith("graph-") else IMPLS[0]))
        if d:
            r["vs_default"] = round(d["us"] / r["us"], 3)
            if d.get("gpu_us") and r.get("gpu_us"):
                r["gpu_vs_default"] = round(d["gpu_us"] / r["gpu_us"], 3)


if __name__ == "__main__":
    raise SystemExit(main())
