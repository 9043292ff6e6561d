"""The transformers attention adapter (``enable_attention`` + ``PagedCache``) on a small random Qwen3-MoE: ``generate``
over a left-padded batch of unequal prompts, every step's logits against the same model in fp64 reading the whole
sequence at once (teacher forcing, no cache) under the tolerance rule, the baseline the stock bf16 model read the same
way; the paged store; and the refusals."""

import pytest
import torch

import evenflow
from evenflow.integrations.demo import generate_logits, left_padded, teacher_forced_logits
from evenflow.testing import assert_within_rule

transformers = pytest.importorskip("transformers", minversion="5.0")
ev_tf = pytest.importorskip("evenflow.integrations.transformers")

FP8 = torch.float8_e4m3fn
PROMPT, NEW = 7, 4
REAL = (7, 4, 2)  # real prompt tokens of the three rows, left-padded to PROMPT


def models(device, head_dim=64, **kw):
    """(fp64 oracle, stock bf16, bf16 for evenflow) of a tiny Qwen3-MoE with head_dim 64 (the kernels' smallest)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from evenflow.integrations.demo import twin_models

    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.update(kw)
    return twin_models(Qwen3MoeForCausalLM, Qwen3MoeConfig(**cfg), device)


def prompts(device, real=REAL, width=PROMPT, seed=0):
    return left_padded(real, 128, device, seed=seed, width=width)


def generate(model, cache, ids, mask, new=NEW):
    return generate_logits(model, ids, mask, new, cache=cache)


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "static"])
def test_generate_matches_the_fp64_model(device, plan, monkeypatch):
    """Prefill then decode steps through the paged cache: each step's logits within the rule of the fp64 model over
    the whole sequence; the prompt's padding never enters the cache (its lengths are the real tokens); the kernels
    ran (one prefill and NEW - 1 decode calls a layer)."""
    m64, stock, ev = models(device)
    ev_tf.enable_attention(ev)
    ev_tf.enable(ev)  # the MoE layers too: the whole model on evenflow
    calls = {"prefill": 0, "decode": 0}
    real_pf, real_dec = evenflow.prefill_attention, evenflow.decode_attention

    def count(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(evenflow, "prefill_attention", count("prefill", real_pf))
    monkeypatch.setattr(evenflow, "decode_attention", count("decode", real_dec))
    cache = ev_tf.PagedCache(ev, max_batch_size=4, max_cache_len=32, page_size=16, plan=plan)
    assert (cache.plan is not None) == plan
    ids, mask = prompts(device)
    seq, logits = generate(ev, cache, ids, mask)
    assert calls == {"prefill": 2, "decode": 2 * (NEW - 1)}, calls
    assert cache.seq_lens.tolist() == [n + NEW - 1 for n in REAL]  # the last token is generated, not yet cached
    assert cache.get_seq_length() == PROMPT + NEW - 1
    ref, base = teacher_forced_logits((m64, stock), seq, mask, NEW)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="generate's logits")


def test_pages_hold_the_real_tokens_only(device):
    """After a prefill, request b's first REAL[b] cached K rows are its real tokens' keys (the fp64 model's K within
    bf16 rounding), in order, and the padding landed in the spare page only."""
    m64, _, ev = models(device)
    ev_tf.enable_attention(ev)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
    ids, mask = prompts(device)
    keys = {}
    attn64 = m64.model.layers[0].self_attn
    hook = attn64.k_norm.register_forward_hook(lambda mod, inp, out: keys.__setitem__("k", out))
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # positions as generate gives them (real tokens from 0)
    with torch.no_grad():
        ev(ids, attention_mask=mask, position_ids=pos, cache=cache)
        m64(ids, attention_mask=mask, position_ids=pos)
    hook.remove()
    # the oracle's K after the norm, rotated by position: recompute it with the model's own rotary embedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    cos, sin = m64.model.rotary_emb(keys["k"], pos)
    k64 = keys["k"].transpose(1, 2)  # [B, Hkv, T, D]
    _, k64 = apply_rotary_pos_emb(k64, k64, cos, sin)
    layer = cache.layers[0]
    for b, n in enumerate(REAL):
        page = int(cache.step.page_table[b, 0])  # one page of 16 tokens holds each request's prompt here
        stored = layer.keys[page, :n].double().cpu()
        want = k64[b, :, PROMPT - n:].transpose(0, 1).cpu()  # [n, Hkv, D]
        assert torch.allclose(stored, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max())), b
        assert not layer.keys[page, n:].any()
    assert cache.seq_lens.tolist() == list(REAL)
    assert layer.keys[-1].any()  # the spare page took the padding rows (REAL has padding)


def test_a_pool_of_the_real_tokens_hands_out_pages_as_requests_grow(device):
    """A pool sized to the real tokens (not the padded rectangle): the prompt takes a page per request, a decode
    step that carries request 0 past its page hands it the next free one (so its pages are not contiguous), the
    logits stay within the rule; a pool one page short raises, naming the pool."""
    m64, stock, ev = models(device)
    ev_tf.enable_attention(ev)
    real, new = (15, 3), 4
    cache = ev_tf.PagedCache(ev, max_batch_size=2, max_cache_len=32, page_size=16, max_tokens=48)
    ids, mask = prompts(device, real=real, width=15, seed=3)
    seq, logits = generate(ev, cache, ids, mask, new=new)
    spare = cache.step.spare
    assert cache.max_tokens == 48 and spare == 3
    assert cache.step.page_table[:2].tolist() == [[0, 2], [1, spare]]
    assert cache.seq_lens.tolist() == [15 + new - 1, 3 + new - 1]
    ref, base = teacher_forced_logits((m64, stock), seq, mask, new)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="pooled generate's logits")
    cache.reset()
    assert cache.step.page_table[:2].eq(spare).all() and len(cache.step.free) == 3
    seq2, logits2 = generate(ev, cache, ids, mask, new=new)  # the same batch again after reset: the same logits
    assert torch.equal(logits2, logits)
    short = ev_tf.PagedCache(ev, max_batch_size=2, max_cache_len=32, page_size=16, max_tokens=32)
    with pytest.raises(ValueError, match="out of pages: this step needs 1 more of 16 tokens, 0 of 2 are free"):
        generate(ev, short, ids, mask, new=new)


def test_fp8_cache_within_the_rule_of_an_fp8_baseline(device, monkeypatch):
    """An fp8 e4m3 cache (K / k_scale, V / v_scale stored): the logits within the rule of the fp64 model, the
    baseline the stock bf16 model with its K and V rounded through the same fp8 format (so the allowance is the
    format's, not a looser tolerance)."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

    m64, stock, ev = models(device)
    ev_tf.enable_attention(ev)
    ks, vs = 1 / 64, 1 / 128

    def fq(x, s):
        return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)

    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=32, kv_dtype=FP8, k_scale=ks,
                             v_scale=vs)
    ids, mask = prompts(device, seed=1)
    seq, logits = generate(ev, cache, ids, mask)
    layer = cache.layers[1]
    assert layer.keys.dtype == FP8 and float(layer.keys[:3].float().abs().max()) < 448  # none saturated
    (ref,) = teacher_forced_logits((m64,), seq, mask, NEW)
    rope = qm.apply_rotary_pos_emb
    monkeypatch.setattr(qm, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: (lambda qk: (qk[0], fq(qk[1], ks)))(
        rope(q, k, cos, sin, **kw)))
    hooks = [lyr.self_attn.v_proj.register_forward_hook(lambda mod, inp, out: fq(out, vs))
             for lyr in stock.model.layers]
    (base,) = teacher_forced_logits((stock,), seq, mask, NEW)
    for h in hooks:
        h.remove()
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="fp8-cache generate's logits")


def test_an_extend_after_decode_steps(device):
    """A forward of several tokens on a cache that already decoded (prefill_attention over a cached prefix): the
    logits within the rule of the fp64 model reading the whole sequence."""
    m64, stock, ev = models(device)
    ev_tf.enable_attention(ev)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16)
    ids, mask = prompts(device, seed=2)
    seq, _ = generate(ev, cache, ids, mask, new=3)
    more = torch.randint(1, 128, (3, 4), generator=torch.Generator().manual_seed(5)).to(device)
    # the cache holds seq minus its last token: feed that token and three more
    ext = torch.cat([seq[:, -1:], more[:, :3]], 1)
    full = torch.cat([seq, more[:, :3]], 1)
    full_mask = torch.cat([mask, torch.ones(3, full.shape[1] - PROMPT, dtype=mask.dtype, device=device)], 1)
    with torch.no_grad():
        got = ev(ext, attention_mask=full_mask, cache=cache).logits
        ref, base = (m(full, attention_mask=full_mask).logits[:, -4:] for m in (m64, stock))
    assert cache.seq_lens.tolist() == [n + 3 - 1 + 4 for n in REAL]
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what="extend's logits")


def test_refusals(device):
    m64, _, ev = models(device)
    with pytest.raises(TypeError, match="head_dim 16"):
        ev_tf.enable_attention(models(device, head_dim=16)[2])
    with pytest.raises(TypeError, match="not a transformers PreTrainedModel"):
        ev_tf.enable_attention(torch.nn.Linear(2, 2))
    ev_tf.enable_attention(ev)
    ids, mask = prompts(device)
    with pytest.raises(ValueError, match="needs cache=evenflow.integrations.transformers.PagedCache"):
        with torch.no_grad():
            ev(ids, attention_mask=mask)  # transformers' own cache
    right = mask.flip(1)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        with torch.no_grad():
            ev(ids.flip(1), attention_mask=right, cache=cache)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=8, page_size=16)
    with pytest.raises(ValueError, match="holds 8 positions a request; this forward needs 9"):
        generate(ev, cache, ids, mask)
    cache = ev_tf.PagedCache(ev, max_batch_size=2, max_cache_len=16, page_size=16)
    with pytest.raises(ValueError, match="batch of 3 requests over the PagedCache's max_batch_size 2"):
        with torch.no_grad():
            ev(ids, attention_mask=mask, cache=cache)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
    with pytest.raises(NotImplementedError, match="beam search"):
        with torch.no_grad():
            ev.generate(input_ids=ids[:1], attention_mask=mask[:1], cache=cache, max_new_tokens=2, num_beams=2,
                        pad_token_id=0)
    with pytest.raises(ValueError, match="page_size must be one of"):
        ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=16, page_size=24)
    with pytest.raises(ValueError, match="kv_dtype must be"):
        ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=16, kv_dtype=torch.float16)
    with pytest.raises(TypeError, match="computes in bf16"):
        with torch.no_grad():
            ev_tf.enable_attention(m64)
            m64(ids, attention_mask=mask, cache=ev_tf.PagedCache(m64, max_batch_size=3, max_cache_len=16,
                                                                  page_size=16))
    with pytest.raises(RuntimeError, match="no backward"):
        ev(ids, attention_mask=mask, cache=ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16))


def test_store_kv_places_each_row_and_rounds_once(device):
    """``store_kv``: each row at its slot (page * P + offset), every other slot untouched; bf16 rows copied bit for
    bit into a bf16 cache; fp8 within half a step of x / scale (saturated at 448); bad slots named under
    check_inputs; a non-contiguous cache refused."""
    from evenflow.attention.prologue import store_kv

    g = torch.Generator().manual_seed(0)
    P, H, D = 16, 2, 64
    slots = torch.tensor([5, 40, 17, 63], dtype=torch.int64)
    k = (torch.randn(4, H, D, generator=g) * 3).to(torch.bfloat16)
    v = (torch.randn(4, H, D, generator=g) * 3).to(torch.bfloat16)
    k[0, 0, 0] = 4000.0  # saturates in fp8 at scale 0.25
    for dtype, scale in ((torch.bfloat16, None), (FP8, 0.25)):
        kc = torch.full((4, P, H, D), 7.0).to(dtype).to(device)
        vc = kc.clone()
        before = kc.clone()
        store_kv(k.to(device), v.to(device), kc, vc, slots.to(device), k_scale=scale, v_scale=scale)
        flat_k, flat_v, flat0 = (c.view(-1, H, D).float().cpu() for c in (kc, vc, before))
        others = torch.ones(4 * P, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(flat_k[others], flat0[others]) and torch.equal(flat_v[others], flat0[others])
        for got, x in ((flat_k[slots], k), (flat_v[slots], v)):
            if dtype == torch.bfloat16:
                assert torch.equal(got, x.float())
            else:
                want = (x.double() / scale).clamp(-448, 448)
                # e4m3: 3 mantissa bits, subnormal below 2^-6
                step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2 ** -6))) - 3)
                assert ((got.double() - want).abs() <= step / 2).all()
        if dtype == FP8:
            assert float(flat_k[5, 0, 0]) == 448.0  # 4000 / 0.25 saturated
    kc = torch.zeros(4, P, H, D, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"slots\[1\] = 64 outside \[0, 64\)"):
        store_kv(k.to(device), v.to(device), kc, kc.clone(), torch.tensor([0, 64, 1, 2], device=device),
                 check_inputs=True)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        hnd = torch.zeros(4, H, P, D, dtype=torch.bfloat16, device=device).transpose(1, 2)
        store_kv(k.to(device), v.to(device), hnd, hnd.clone(), slots.to(device))
