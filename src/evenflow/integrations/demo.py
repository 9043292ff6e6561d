"""``evenflow demo`` hook for the engine adapters: a Qwen3-MoE model in Hugging Face transformers with its MoE layers
on evenflow (``evenflow.integrations.transformers.enable``), its logits checked against the same model in fp64 under
the tolerance rule (baseline: the stock bf16 model); then ``generate`` over a left-padded batch of unequal prompts
with its attention on evenflow too (``enable_attention`` over a ``PagedCache``), every step's logits checked against
the fp64 model reading the whole sequence (teacher forcing). On a GPU: one layer at Qwen3-30B-A3B's dimensions (a
small vocabulary), a forward of 32 tokens and the generate timed eagerly beside the stock model; two tiny layers on a
CPU. The end-to-end benchmark is ``benchmarks/e2e_transformers.py``."""
from __future__ import annotations

import copy

import torch

# a transformers this adapter cannot run on (missing, or older than it needs) makes the demo's integrations section
# "not available", naming the version, as a missing optional dependency does
import evenflow.integrations.transformers  # noqa: F401
from evenflow.testing import error_bound


def twin_models(model_cls, cfg, device, scale: float = 0.1, seed: int = 0, experts: bool = True) -> list:
    """Three copies of ``model_cls(cfg)`` holding one set of random weights exact in bf16 (N(0, scale^2) rounded):
    the fp64 oracle, a stock bf16 model and a bf16 one to put on evenflow, each with a config of its own (transformers
    keeps the experts implementation there), the first two on transformers' eager experts. The demo and the tests
    compare the third against the first under the tolerance rule, the second giving the baseline."""
    torch.manual_seed(seed)
    m64 = model_cls(copy.deepcopy(cfg)).double().eval()
    with torch.no_grad():  # exact in bf16: the oracle computes with the very values the bf16 models hold
        for p in m64.parameters():
            p.copy_((torch.randn_like(p) * scale).to(torch.bfloat16).double())
    state = {k: v.float() for k, v in m64.state_dict().items()}
    out = [m64.to(device)]
    for _ in range(2):
        m = model_cls(copy.deepcopy(cfg)).eval()
        m.load_state_dict(state)
        out.append(m.to(device=device, dtype=torch.bfloat16))
    for m in out[:2] if experts else ():  # (experts=False: a dense model)
        m.set_experts_implementation("eager")
    return out


def left_padded(lens, vocab: int, device, seed: int = 0, width: int | None = None):
    """(ids, mask) ``[B, width]`` of random prompts of ``lens`` real tokens (ids 1..vocab-1), left-padded with id 0 to
    ``width`` (default the longest), as generate takes a batch of unequal prompts."""
    width = max(lens) if width is None else width
    if any(n < 0 or n > width for n in lens):
        raise ValueError(f"lens {list(lens)}: each must be in [0, width {width}]")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, width - n:] = 1
    return (ids * mask).to(device), mask.to(device)


def generate_logits(model, ids, mask, new: int, **kw):
    """Greedy ``generate`` of exactly ``new`` tokens: (sequences, logits ``[B, new, vocab]``, each step's)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits, 1)


def beam_search_logits(model, ids, mask, new: int, beams: int, **kw):
    """Beam search of exactly ``new`` tokens returning every beam: (sequences ``[B * beams, ...]``, the logits that
    chose each of a sequence's tokens ``[B * beams, new, vocab]``: at step t, those of the row ``beam_indices`` names,
    i.e. the beam the sequence's history sat on then)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             num_beams=beams, num_return_sequences=beams, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **kw)
    rows = out.beam_indices[:, :new]
    if bool((rows < 0).any()):
        raise RuntimeError("beam search ended a sequence early: no logits for some of its steps")
    return out.sequences, torch.stack([out.logits[t][rows[:, t]] for t in range(new)], 1)


def teacher_forced_logits(models, seq, mask, steps: int) -> list:
    """Each model's logits at the positions that produced ``seq``'s last ``steps`` tokens, reading ``seq`` whole (no
    cache; the generated tokens unpadded after the prompt's ``mask``)."""
    full = torch.cat([mask, torch.ones(seq.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype,
                                       device=mask.device)], 1)
    first = mask.shape[1] - 1
    with torch.no_grad():
        return [m(seq, attention_mask=full).logits[:, first:first + steps] for m in models]


def run_demo(ctx) -> list[dict]:
    try:
        from transformers import Qwen3MoeConfig
    except ImportError as e:  # the adapter is optional: say why it was not shown, fail nothing else
        return [{"operator": "transformers adapter", "case": "-", "check": f"not run: {e}", "ok": None, "us": None,
                 "floor_us": None, "peers": {}}]
    dims = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128) if ctx.gpu else \
        dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # (64: the paged kernels' smallest)
    layers = 1 if ctx.gpu else 2  # (the fp64 oracle of one layer at these dimensions is 5 GB)
    cfg = Qwen3MoeConfig(vocab_size=512, num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=256,
                         decoder_sparse_step=1, mlp_only_layers=[], **dims)
    from transformers import Qwen3MoeForCausalLM

    import evenflow.integrations.transformers as ev_tf

    m64, stock, ev = twin_models(Qwen3MoeForCausalLM, cfg, ctx.device, scale=0.05)
    if ctx.gpu:
        stock.set_experts_implementation("grouped_mm")  # transformers' default, the peer timed below
    ev_tf.enable(ev)
    tokens = 32 if ctx.gpu else 6
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    with torch.no_grad():
        ref, base, got = (m(ids).logits for m in (m64, stock, ev))
    err = float((got.double() - ref).abs().max())
    bound = error_bound(ref, base, torch.bfloat16)
    case = f"qwen3-moe {layers} layer(s), {tokens} tokens" + (" (qwen3-30b-a3b dims)" if ctx.gpu else " (tiny)")
    row = {"operator": "transformers Qwen3-MoE (enable)", "case": case,
           "check": f"logits max|err| {err:.1e} <= bound {bound:.1e}",
           "ok": bool(torch.isfinite(got.float()).all()) and err <= bound, "us": None, "floor_us": None, "peers": {}}
    if ctx.gpu:
        H = ctx.harness

        def forward(m):
            def run():
                with torch.no_grad():
                    return m(ids).logits
            return run

        row["us"] = H.time_eager(forward(ev), reps=20)
        row["peers"]["transformers-grouped_mm"] = H.time_eager(forward(stock), reps=20)
    return [row, _generate_row(ctx, m64, stock, ev, layers)]


def _generate_row(ctx, m64, stock, ev, layers: int) -> dict:
    import evenflow.integrations.transformers as ev_tf

    ev_tf.enable_attention(ev)
    lens, new, page = ((1024, 64, 64, 64), 8, 64) if ctx.gpu else ((7, 4, 2), 3, 16)
    ids, mask = left_padded(lens, 512, ctx.device, seed=2)
    cache = ev_tf.PagedCache(ev, max_batch_size=len(lens), max_cache_len=max(lens) + new, page_size=page)
    seq, got = generate_logits(ev, ids, mask, new, **ev_tf.cache_kwargs(ev, cache))
    ref, base = teacher_forced_logits((m64, stock), seq, mask, new)
    err = float((got.double() - ref).abs().max())
    bound = error_bound(ref, base, torch.bfloat16)
    mix = "+".join(f"{lens.count(n)}x{n}" for n in dict.fromkeys(lens))
    row = {"operator": "transformers generate (enable_attention, PagedCache)",
           "case": f"qwen3-moe {layers} layer(s), prompts {mix}, {new} new tokens",
           "check": f"every step's logits max|err| {err:.1e} <= bound {bound:.1e} (fp64, teacher-forced)",
           "ok": bool(torch.isfinite(got.float()).all()) and err <= bound, "us": None, "floor_us": None, "peers": {}}
    if ctx.gpu:
        H = ctx.harness

        def run(model, **kw):
            def go():
                for c in kw.values():  # (the PagedCache, under the keyword this transformers takes)
                    c.reset()
                return generate_logits(model, ids, mask, new, **kw)
            return go

        row["us"] = H.time_eager(run(ev, **ev_tf.cache_kwargs(ev, cache)), reps=5, warmup=1)
        row["peers"]["transformers-sdpa"] = H.time_eager(run(stock), reps=5, warmup=1)
    return row
