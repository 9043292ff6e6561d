"""The transformers attention adapter (``enable_attention`` + ``PagedCache``) on a small random Qwen3-MoE: ``generate``
over a left-padded batch of unequal prompts, every step's logits against the same model in fp64 reading the whole
sequence at once (teacher forcing, no cache) under the tolerance rule, the baseline the stock bf16 model read the same
way; the paged store; and the refusals."""

import pytest
import torch

import evenflow
from evenflow.testing import assert_within_rule

transformers = pytest.importorskip("transformers", minversion="5.24")
ev_tf = pytest.importorskip("evenflow.integrations.transformers")

from evenflow.integrations.demo import beam_search_logits, generate_logits, left_padded, teacher_forced_logits  # noqa: E402
from test_integration_transformers import models as moe_models  # noqa: E402

FP8 = torch.float8_e4m3fn
PROMPT, NEW = 7, 4
REAL = (7, 4, 2)  # real prompt tokens of the three rows, left-padded to PROMPT


def models(device, head_dim=64, **kw):
    """(fp64 oracle, stock bf16, bf16 for evenflow) of the MoE tests' tiny Qwen3-MoE at head_dim 64 (the kernels'
    smallest)."""
    return moe_models(device, head_dim=head_dim, **kw)


def sharp(models_, gain=4.0):
    """Scale every q / k norm weight by ``gain`` (exact in bf16), so the scores, and with them the rotary positions,
    weigh in the logits: at the random models' small scores a position error hides under the rule."""
    with torch.no_grad():
        for m in models_:
            for lyr in m.model.layers:
                lyr.self_attn.q_norm.weight.mul_(gain)
                lyr.self_attn.k_norm.weight.mul_(gain)
    return models_


def prompts(device, real=REAL, width=PROMPT, seed=0):
    return left_padded(real, 128, device, seed=seed, width=width)


def generate(model, cache, ids, mask, new=NEW):
    return generate_logits(model, ids, mask, new, **ev_tf.cache_kwargs(model, cache))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("plan", [True, False], ids=["plan", "static"])
def test_generate_matches_the_fp64_model(device, plan, fuse, monkeypatch):
    """Prefill then decode steps through the paged cache: each step's logits within the rule of the fp64 model over
    the whole sequence; the prompt's padding never enters the cache (its lengths are the real tokens); the kernels
    ran (one prefill and NEW - 1 decode calls a layer; fused: the prologue kernel stores K / V, unfused: store_kv)."""
    import evenflow.integrations.transformers_paged as tp

    m64, stock, ev = sharp(models(device))
    assert ev_tf.enable_attention(ev, fuse_prologue=fuse) == {"fused_prologue": 2 if fuse else 0}
    assert all(ev_tf.is_fused_attention(lyr.self_attn) == fuse for lyr in ev.model.layers)
    ev_tf.enable(ev)  # the MoE layers too: the whole model on evenflow
    calls = {"prefill": 0, "decode": 0, "prologue": 0, "store": 0}

    def count(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(evenflow, "prefill_attention", count("prefill", evenflow.prefill_attention))
    monkeypatch.setattr(evenflow, "decode_attention", count("decode", evenflow.decode_attention))
    monkeypatch.setattr(evenflow, "qk_norm_rope_store_kv", count("prologue", evenflow.qk_norm_rope_store_kv))
    monkeypatch.setattr(tp, "store_kv", count("store", tp.store_kv))
    cache = ev_tf.PagedCache(ev, max_batch_size=4, max_cache_len=32, page_size=16, plan=plan)
    assert (cache.plan is not None) == plan
    ids, mask = prompts(device)
    seq, logits = generate(ev, cache, ids, mask)
    forwards = 2 * NEW  # layers x forwards
    assert calls == {"prefill": 2, "decode": 2 * (NEW - 1), "prologue": forwards if fuse else 0,
                     "store": 0 if fuse else forwards}, calls
    assert cache.seq_lens.tolist() == [n + NEW - 1 for n in REAL]  # the last token is generated, not yet cached
    assert cache.get_seq_length() == PROMPT + NEW - 1
    ref, base = teacher_forced_logits((m64, stock), seq, mask, NEW)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="generate's logits")


def test_paged_cache_on_a_cache_base_with_read_only_size_properties(device, monkeypatch):
    """Some transformers 5 releases make ``max_batch_size`` / ``max_cache_len`` read-only properties of ``Cache``
    (computed from its layers); round BW's device machine had one, and PagedCache's constructor, which set them as
    attributes, raised there. On such a base it must build, report its own sizes and generate within the rule."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    import evenflow.integrations.transformers_paged as tp

    class ReadOnlySizes(Cache):
        @property
        def max_batch_size(self):
            return -1

        @property
        def max_cache_len(self):
            return -1

    monkeypatch.setattr(tp, "_cache_base", lambda: (ReadOnlySizes, CacheLayerMixin))
    paged = tp._cache_class.__wrapped__()
    assert issubclass(paged, ReadOnlySizes)
    m64, stock, ev = models(device)
    ev_tf.enable_attention(ev)
    cache = paged(ev, max_batch_size=3, max_cache_len=32, page_size=16)
    assert (cache.max_batch_size, cache.max_cache_len) == (3, 32)
    ids, mask = prompts(device)
    seq, logits = generate(ev, cache, ids, mask)
    ref, base = teacher_forced_logits((m64, stock), seq, mask, NEW)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="generate's logits")


def test_cache_kwargs_names_the_keyword_the_forward_takes():
    """``cache`` on the releases the adapter runs on, read through a ``torch.compile``d model's wrapped module (the
    wrapper's own forward takes ``*args, **kwargs``); ``past_key_values`` only for a forward that takes it and no
    ``cache``."""
    _, _, ev = models("cpu")
    marker = object()
    assert ev_tf.cache_kwargs(ev, marker) == {"cache": marker}
    assert ev_tf.cache_kwargs(torch.compile(ev), marker) == {"cache": marker}

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    assert ev_tf.cache_kwargs(Old(), marker) == {"past_key_values": marker}


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
        ev(ids, attention_mask=mask, position_ids=pos, **ev_tf.cache_kwargs(ev, cache))
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
    assert cache.step.table(2).tolist() == [[0, 2], [1, spare]]
    assert cache.step.page_table[:, -1].eq(spare).all()  # the fused prologue's padding column
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


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_fp8_cache_within_the_rule_of_an_fp8_baseline(device, fuse, monkeypatch):
    """An fp8 e4m3 cache (K / k_scale, V / v_scale stored): the logits within the rule of the fp64 model, the
    baseline the stock bf16 model with its K and V rounded through the same fp8 format (so the allowance is the
    format's, not a looser tolerance)."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

    m64, stock, ev = sharp(models(device))
    ev_tf.enable_attention(ev, fuse_prologue=fuse)
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


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_an_extend_after_decode_steps(device, fuse):
    """A forward of several tokens on a cache that already decoded (prefill_attention over a cached prefix), at the
    positions generate gives (real tokens counted from 0): the logits within the rule of the fp64 model reading the
    whole sequence. Unfused (the model's own rotation at the positions it is given), the same extend at the padded
    frame's positions (a position error of the padding's length for the padded rows) fails the rule, so the check
    sees positions; fused, the rotation is at each token's index among its request's real tokens whatever the
    positions given, so both extends are the right one, bit for bit."""
    m64, stock, ev = sharp(models(device))
    ev_tf.enable_attention(ev, fuse_prologue=fuse)
    ids, mask = prompts(device, seed=2)
    more = torch.randint(1, 128, (3, 3), generator=torch.Generator().manual_seed(5)).to(device)
    outs = {}
    for name in ("real", "padded frame"):
        cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16)
        seq, _ = generate(ev, cache, ids, mask, new=3)
        # the cache holds seq minus its last token: feed that token and three more
        ext = torch.cat([seq[:, -1:], more], 1)
        full = torch.cat([seq, more], 1)
        full_mask = torch.cat([mask, torch.ones(3, full.shape[1] - PROMPT, dtype=mask.dtype, device=device)], 1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0)
        ext_pos = pos[:, -4:] if name == "real" else torch.arange(full.shape[1] - 4, full.shape[1], device=device)[
            None].expand(3, -1)
        with torch.no_grad():
            outs[name] = ev(ext, attention_mask=full_mask, position_ids=ext_pos, **ev_tf.cache_kwargs(ev, cache)).logits
        assert cache.seq_lens.tolist() == [n + 3 - 1 + 4 for n in REAL]
    with torch.no_grad():
        ref, base = (m(full, attention_mask=full_mask, position_ids=pos).logits[:, -4:] for m in (m64, stock))
    assert_within_rule(outs["real"].cpu(), ref.cpu(), base.cpu(), what="extend's logits")
    from evenflow.testing import rule_check

    if fuse:
        assert torch.equal(outs["padded frame"], outs["real"])
        return
    msg, _, _ = rule_check(outs["padded frame"].cpu(), ref.cpu(), base.cpu(), what="extend at wrong positions")
    assert msg, "an extend at the padded frame's positions passed the rule: the check does not see positions"


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
            ev(ids.flip(1), attention_mask=right, **ev_tf.cache_kwargs(ev, cache))
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=8, page_size=16)
    with pytest.raises(ValueError, match="holds 8 positions a request; this forward needs 9"):
        generate(ev, cache, ids, mask)
    cache = ev_tf.PagedCache(ev, max_batch_size=2, max_cache_len=16, page_size=16)
    with pytest.raises(ValueError, match="batch of 3 requests over the PagedCache's max_batch_size 2"):
        with torch.no_grad():
            ev(ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache))
    with pytest.raises(ValueError, match="page_size must be one of"):
        ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=16, page_size=24)
    with pytest.raises(ValueError, match="kv_dtype must be"):
        ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=16, kv_dtype=torch.float16)
    with pytest.raises(TypeError, match="plan must be a bool, got 'no'"):  # it had built a plan (round CK's review)
        ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=16, plan="no")
    with pytest.raises(TypeError, match="computes in bf16"):
        with torch.no_grad():
            ev_tf.enable_attention(m64)
            m64(ids, attention_mask=mask, cache=ev_tf.PagedCache(m64, max_batch_size=3, max_cache_len=16,
                                                                  page_size=16))
    with pytest.raises(RuntimeError, match="no backward"):
        ev(ids, attention_mask=mask, cache=ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16))


def test_state_mistakes_raise_instead_of_mixing_batches(device):
    """A second batch on a cache that was not reset (even one whose width equals the positions the cache has
    seen, where transformers feeds the whole prompt again), generate with use_cache=False (every step would store
    the sequence again), and a mask pattern other than plain causal: each raises, naming the cause."""
    from transformers.masking_utils import bidirectional_mask_function

    from evenflow.integrations.transformers_paged import padding_mask

    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16)
    ids, mask = prompts(device)
    generate(ev, cache, ids, mask, new=3)  # the cache has seen 7 + 2 = 9 positions
    ids2, mask2 = prompts(device, real=(9, 5, 3), width=9, seed=1)
    with pytest.raises(ValueError, match="a cache that was not reset"):
        generate(ev, cache, ids2, mask2, new=2)
    cache.reset()
    generate(ev, cache, ids2, mask2, new=2)  # after reset the same call runs
    cache.reset()
    with pytest.raises(ValueError, match="use_cache=False"):
        with torch.no_grad():
            ev.generate(input_ids=ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache), max_new_tokens=3,
                        min_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=0)
    with pytest.raises(TypeError, match="'bidirectional_mask_function': evenflow's paged attention computes plain "
                                        "causal attention only"):
        padding_mask(3, 7, 7, mask_function=bidirectional_mask_function, attention_mask=mask.bool())


def test_a_sliding_window_is_refused_only_where_a_layer_slides(device):
    """A config's sliding window under the cache's length is refused (evenflow's paged attention is full causal),
    but only where some layer slides: round CP's review found a config whose ``layer_types`` are all full attention
    (Mellum's: ``sliding_window`` 1024 by default) refused for a window none of its layers has."""
    import copy
    _, _, ev = models(device)
    n = ev.config.num_hidden_layers
    for types, refused in ((None, "sliding window 16 under max_cache_len 32"), (["full_attention"] * n, None),
                           (["full_attention"] * (n - 1) + ["sliding_attention"], "layer types .*'sliding_attention'")):
        cfg = copy.deepcopy(ev.config)
        cfg.sliding_window, cfg.use_sliding_window = 16, True
        cfg.layer_types = types
        if refused:
            with pytest.raises(TypeError, match=refused):
                ev_tf.PagedCache(cfg, max_batch_size=1, max_cache_len=32, page_size=16, device=device)
        else:
            ev_tf.PagedCache(cfg, max_batch_size=1, max_cache_len=32, page_size=16, device=device)
    cfg.layer_types, cfg.use_sliding_window = None, False  # the config's own switch off: no layer slides
    ev_tf.PagedCache(cfg, max_batch_size=1, max_cache_len=32, page_size=16, device=device)


def test_a_paged_cache_under_another_attention_raises(device):
    """Round CP's review: a PagedCache's update stores nothing and hands back the forward's own K / V (evenflow's
    attention stores and attends), so under the model's stock attention (no enable_attention) each decode step
    attended to its new token alone, with no error, and the cache stayed empty. The next update after one whose
    handle no evenflow attention took now raises, naming the fix; after enable_attention the same cache runs."""
    _, _, ev = models(device)
    assert ev.config.num_hidden_layers >= 2  # the second layer's update finds the first one's left out
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16)
    ids, mask = prompts(device)
    with pytest.raises(RuntimeError, match="layer 0's cache.update was not followed by evenflow's paged attention"):
        generate(ev, cache, ids, mask, new=2)
    cache.reset()
    ev_tf.enable_attention(ev)
    _, logits = generate(ev, cache, ids, mask, new=2)
    assert torch.isfinite(logits).all() and cache.seen == PROMPT + 1


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_beam_search_continues_each_beam_on_its_own_tokens(device, fuse):
    """Beam search (3 beams, 3 returned, two unequal prompts): along every returned sequence, the logits that chose
    each of its tokens (``beam_indices`` names the row that made it at each step) are within the rule of the fp64
    model reading that sequence whole. That holds only if each reorder (recorded: some move rows) handed every row
    its beam's tokens; with the reorder made a no-op this check fails (0.085 against a bound of 0.0036:
    benchmarks/results/h200/history/round-bx-cpu/noop_checks.txt)."""
    m64, stock, ev = sharp(models(device))
    ev_tf.enable_attention(ev, fuse_prologue=fuse)
    beams, new = 3, 4
    cache = ev_tf.PagedCache(ev, max_batch_size=2 * beams, max_cache_len=32, page_size=16)
    ids, mask = prompts(device, real=(7, 3))
    moves, reorder = [], cache.reorder_cache
    cache.reorder_cache = lambda idx: moves.append(idx.tolist()) or reorder(idx)
    seq, path = beam_search_logits(ev, ids, mask, new, beams, **ev_tf.cache_kwargs(ev, cache))
    assert any(m != list(range(2 * beams)) for m in moves), moves
    ref, base = teacher_forced_logits((m64, stock), seq, mask.repeat_interleave(beams, 0), new)
    assert_within_rule(path.float().cpu(), ref.cpu(), base.float().cpu(), what="beam search's logits")
    assert cache.seq_lens.tolist() == [n + new - 1 for n in (7, 3) for _ in range(beams)]


def test_assisted_decoding_crops_the_rejected_draft(device):
    """Assisted decoding with a draft model of other weights (3 tokens a draft, no confidence cut-off): the main
    model verifies each draft in one forward (evenflow's prefill over the cached prefix) and ``crop`` drops the
    rejected tokens (recorded: drafts of 3 rejected). Every generated token's logits are within the rule of the fp64
    model reading the final sequence whole (with crop a no-op the stale draft tokens stay attended and this fails;
    0.107 against 0.0033: benchmarks/results/h200/history/round-bx-cpu/noop_checks.txt)."""
    from transformers import Qwen3MoeForCausalLM

    from evenflow.integrations.demo import twin_models
    from test_integration_transformers import tiny_config

    m64, stock, ev = sharp(models(device))
    draft = twin_models(Qwen3MoeForCausalLM, tiny_config(head_dim=64), device, seed=1)[1]
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    ev_tf.enable_attention(ev)
    cache = ev_tf.PagedCache(ev, max_batch_size=1, max_cache_len=32, page_size=16)
    assert cache.is_croppable
    crops, crop = [], cache.crop
    cache.crop = lambda n: crops.append(n) or crop(n)
    ids, mask = prompts(device, real=(5,), width=5)
    new = 8
    seq, logits = generate_logits(ev, ids, mask, new, assistant_model=draft, **ev_tf.cache_kwargs(ev, cache))
    assert min(crops) <= -2, crops
    ref, base = teacher_forced_logits((m64, stock), seq, mask, new)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="assisted decoding's logits")
    assert cache.seq_lens.tolist() == [5 + new - 1] and cache.get_seq_length() == 5 + new - 1


def _rows_of(cache, b):
    """Request ``b``'s cached K / V of every layer, in order (read through the host's page lists)."""
    step = cache.step
    n, pages = int(step.seq_lens[b]), step.pages[b]
    assert step.page_table[b, : len(pages)].tolist() == pages
    return [t.view(torch.uint8)[pages].flatten(0, 1)[:n].clone() for lyr in cache.layers
            for t in (lyr.keys, lyr.values)]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_row_selection_copies_each_rows_tokens_into_pages_of_its_own(device, kv_dtype):
    """``batch_select_indices`` / ``batch_repeat_interleave`` / ``reorder_cache`` after a prompt: each new row holds
    bit for bit its source row's tokens, in every layer, on pages no other row holds; a row that stays in place keeps
    its pages; the pool accounts for every page once; a selection that needs more pages than the pool and the
    dropped rows hold raises before it changes anything; bad indices raise naming the argument; a crop drops each
    request's last positions (its real tokens)."""
    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    real = (20, 4, 2)
    scales = dict(k_scale=0.05, v_scale=0.05) if kv_dtype == FP8 else {}
    cache = ev_tf.PagedCache(ev, max_batch_size=6, max_cache_len=32, page_size=16, max_tokens=96, kv_dtype=kv_dtype,
                             **scales)
    ids, mask = prompts(device, real=real, width=20, seed=2)
    with torch.no_grad():
        ev(ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache))
    step = cache.step

    def check(src, before):
        assert cache.seq_lens.tolist() == [real_now[j] for j in src]
        owned = [p for b in range(len(src)) for p in step.pages[b]]
        assert len(owned) == len(set(owned)) and not set(owned) & set(step.free)
        assert sorted(owned + step.free) == list(range(step.num_pages))
        assert step.page_table[len(src):].eq(step.spare).all()
        for b, j in enumerate(src):
            assert all(torch.equal(x, y) for x, y in zip(_rows_of(cache, b), before[j])), (b, j)

    real_now = list(real)
    before = [_rows_of(cache, b) for b in range(3)]
    pages0 = step.pages[0]
    cache.reorder_cache(torch.tensor([0, 2, 1]))  # row 0 stays: its pages too
    check([0, 2, 1], before)
    assert step.pages[0] is pages0
    real_now, before = [real_now[j] for j in (0, 2, 1)], [before[j] for j in (0, 2, 1)]
    src = [0, 0, 1, 1, 2, 2]
    kept = cache.seq_lens.clone()  # 6 rows (20, 20, 2, 2, 4, 4) would need 8 pages of 6: 6 to copy into, 4 at hand
    with pytest.raises(ValueError, match="out of pages: repeats needs 6 more of 16 tokens, 4 of 6 are free"):
        cache.batch_repeat_interleave(2)
    assert torch.equal(cache.seq_lens, kept) and step.batch == 3  # nothing changed
    cache.batch_select_indices(torch.tensor([1, 2, 1]))  # 3 rows: (2, 4, 2): 3 pages of 6
    check([1, 2, 1], before)
    real_now, before = [real_now[j] for j in (1, 2, 1)], [before[j] for j in (1, 2, 1)]
    cache.batch_repeat_interleave(2)
    check(src, before)
    real_now = [real_now[j] for j in src]
    for bad, msg in (([6], "indices: row 6 is not one of the batch's 6 rows"), ([], "indices: no rows"),
                     (torch.zeros(2, 2, dtype=torch.long), "indices: expected a 1-D tensor"),
                     ([0] * 7, "indices: 7 rows over the PagedCache's max_batch_size 6")):
        with pytest.raises(ValueError, match=msg):
            cache.batch_select_indices(bad)
    # round CK's review: a float or bool in a list was truncated into a row (reorder_cache([2.9, 0.1, 1.5]) took
    # rows 2, 0, 1); a list of anything but ints, or no list at all, is refused by name, also on an empty cache
    for bad, msg in (([2.9, 0.1, 1.5], "beam_idx: row indices must be ints, got 2.9"),
                     ([True, False, True], "beam_idx: row indices must be ints, got True"),
                     (1, "beam_idx: expected a 1-D tensor or a list of row indices, got int")):
        with pytest.raises(TypeError, match=msg):
            cache.reorder_cache(bad)
        with pytest.raises(TypeError, match=msg):
            ev_tf.PagedCache(ev, max_batch_size=2, max_cache_len=16, page_size=16).reorder_cache(bad)
    with pytest.raises(NotImplementedError, match="call PagedCache.reorder_cache"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="pass minus the number of positions"):
        cache.crop(3)
    with pytest.raises(ValueError, match="the cache has seen 20 positions"):
        cache.crop(-21)
    cache.crop(-3)  # the last 3 positions of 20: every request's last 3 real tokens (the 2s lose both)
    assert cache.seq_lens.tolist() == [max(0, n - 3) for n in real_now] and cache.get_seq_length() == 17


def test_a_crop_after_padding_that_follows_real_tokens_raises(device):
    """Round CK's review: an extend that masks a new position of a request already holding tokens (padding after its
    real tokens) stores that request's real tokens only, so its last positions are not all real tokens; a crop of
    positions then took a real prompt token off it, and the next step's logits drifted from the model's (0.038
    against the stock cache's 0.0005), with no error. Such a step now marks the cache and a crop after it raises;
    without the crop the step itself stays right (the row's logits within the rule of the fp64 model reading the
    same positions), and reset() clears the mark."""
    from transformers import DynamicCache

    m64, stock, ev = sharp(models(device))
    ev_tf.enable_attention(ev)
    g = torch.Generator().manual_seed(3)
    p, e1 = (torch.randint(1, 128, (2, n), generator=g).to(device) for n in (4, 2))
    m0 = torch.ones(2, 4, dtype=torch.long, device=device)
    m1 = torch.cat([m0, torch.tensor([[1, 1], [0, 1]], device=device)], 1)  # row 1: its first new position padding

    def pos(m, q):
        return (m.cumsum(1) - 1).clamp(min=0)[:, -q:]

    def run(model, cache):
        kw = ev_tf.cache_kwargs(model, cache)
        with torch.no_grad():
            model(p, attention_mask=m0, position_ids=pos(m0, 4), **kw)
            return model(e1, attention_mask=m1, position_ids=pos(m1, 2), **kw).logits[:, -1].double()

    cache = ev_tf.PagedCache(ev, 2, 16, page_size=16)
    got, ref, base = run(ev, cache), run(m64, DynamicCache(config=m64.config)), run(stock, DynamicCache(
        config=stock.config))
    assert_within_rule(got, ref, base, what="the extend's logits")
    assert cache.seq_lens.tolist() == [6, 5]
    with pytest.raises(ValueError, match=r"crop: a step since the last reset\(\) masked a new position"):
        cache.crop(-2)
    assert cache.seq_lens.tolist() == [6, 5]  # nothing taken off
    cache.reset()
    with torch.no_grad():
        ev(p, attention_mask=m0, position_ids=pos(m0, 4), **ev_tf.cache_kwargs(ev, cache))
    cache.crop(-2)  # every position real: the crop takes the last two tokens of each
    assert cache.seq_lens.tolist() == [2, 2]


def test_a_row_copy_failing_part_way_empties_the_cache(device, monkeypatch):
    """A reorder whose copy fails after writing over a replaced row's pages (here: the second layer's gather raises,
    as an out-of-memory would) leaves no row to trust: the cache is emptied (as reset) and the error raised, so the
    next forward cannot attend over half-copied pages; it takes a new prompt batch at once."""
    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16, max_tokens=48)
    ids, mask = prompts(device)
    with torch.no_grad():
        ev(ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache))
    calls, gather = [], torch.Tensor.index_select

    def failing(t, dim, index):
        calls.append(1)
        if len(calls) == 3:  # layer 1's keys: layer 0's K and V already written
            raise torch.OutOfMemoryError("no memory for the gathered pages")
        return gather(t, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", failing)
    with pytest.raises(torch.OutOfMemoryError):
        cache.reorder_cache(torch.tensor([0, 0, 0]))  # the pool is full: the copies go to rows 1 and 2's pages
    monkeypatch.undo()
    assert cache.get_seq_length() == 0 and cache.step.batch == 0 and len(cache.step.free) == 3
    generate(ev, cache, ids, mask, new=2)  # a new batch runs


def test_sampling_with_several_returns_and_a_cache_built_in_inference_mode(device):
    """num_return_sequences with sampling (generate repeats the prompts before the cache sees them) runs, each
    row's lengths its own prompt's; a cache built under inference mode serves generate outside it."""
    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    with torch.inference_mode():
        cache = ev_tf.PagedCache(ev, max_batch_size=6, max_cache_len=32, page_size=16)
    ids, mask = prompts(device)
    torch.manual_seed(0)
    with torch.no_grad():
        out = ev.generate(input_ids=ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache), max_new_tokens=3,
                          min_new_tokens=3, do_sample=True, num_return_sequences=2, pad_token_id=0)
    assert out.shape == (6, PROMPT + 3)
    assert cache.seq_lens.tolist() == [n + 2 for n in REAL for _ in range(2)]


def test_a_llama_model(device):
    """Another family (Llama: no QK-norm, GQA 4 / 1, not Qwen3's attention form, so not fused): generate's logits
    within the rule of its fp64 twin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from evenflow.integrations.demo import twin_models

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=64)
    m64, stock, ev = twin_models(LlamaForCausalLM, cfg, device, experts=False)
    assert ev_tf.enable_attention(ev) == {"fused_prologue": 0}
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=32, plan=True)
    ids, mask = prompts(device, seed=4)
    seq, logits = generate(ev, cache, ids, mask)
    ref, base = teacher_forced_logits((m64, stock), seq, mask, NEW)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="Llama generate's logits")


def test_fused_attention_follows_its_weights_and_falls_back_without_a_paged_cache(device):
    """The fused forward's held q / k / v projection follows an in-place write to a projection (and refresh
    after a write through .data); without a PagedCache the class's own forward runs (and with "evenflow" attention
    asks for one); the rotary table is the model's own (cos then sin, each frequency once)."""
    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    attn = ev.model.layers[0].self_attn
    ids, mask = prompts(device)

    def logits():
        cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
        with torch.no_grad():
            return ev(ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache)).logits

    before = logits()
    with torch.no_grad():
        attn.v_proj.weight.mul_(-1)  # in place: the held projection must follow
    flipped = logits()
    assert not torch.allclose(flipped, before)
    with torch.no_grad():
        attn.v_proj.weight.mul_(-1)
    assert torch.equal(logits(), before)
    attn.v_proj.weight.data.mul_(2)  # no version bump: refresh makes it follow
    ev_tf.refresh(ev)
    assert not torch.allclose(logits(), before)
    attn.v_proj.weight.data.mul_(0.5)
    ev_tf.refresh(ev)
    assert torch.equal(logits(), before)
    with pytest.raises(ValueError, match="needs cache=evenflow.integrations.transformers.PagedCache"):
        with torch.no_grad():
            ev(ids, attention_mask=mask)
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
    rows = (cache.step.pages_per_request + 1) * 16  # the spare column's position too
    # row p: cos(p f_i), then sin(p f_i), for the frequencies the model holds (its inv_freq buffer, cast to bf16 with
    # the model as transformers does) times its attention factor, computed here in fp64
    f = ev.model.rotary_emb.inv_freq.double().cpu()
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * f[None, :]
    scale = float(ev.model.rotary_emb.attention_scaling)
    want = torch.cat([ang.cos(), ang.sin()], 1) * scale
    assert cache.rope_table.shape == (rows, 64) and cache.rope_table.dtype == torch.float32
    torch.testing.assert_close(cache.rope_table.cpu().double(), want, rtol=0, atol=4e-6)  # fp32 angles up to ~32


def test_fused_forward_steps_aside_for_changed_modules_and_refuses_what_it_cannot_run(device, monkeypatch):
    """A projection wrapped or a norm hooked after enable_attention: that layer runs its own forward again (the
    wrapper's effect shows, the prologue kernel is not called for it); a projection that needs gradients refuses
    (no backward), as does the model cast to fp16 (bf16 only)."""
    _, _, ev = models(device)
    ev_tf.enable_attention(ev)
    ids, mask = prompts(device)
    calls = []
    real = evenflow.qk_norm_rope_store_kv
    monkeypatch.setattr(evenflow, "qk_norm_rope_store_kv", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        calls.clear()
        cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16)
        with torch.no_grad():
            return ev(ids, attention_mask=mask, **ev_tf.cache_kwargs(ev, cache)).logits

    before = run()
    assert len(calls) == 2
    attn = ev.model.layers[1].self_attn

    class Scaled(torch.nn.Module):  # an adapter-like wrapper around the projection
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight, self.bias = inner, inner.weight, inner.bias

        def forward(self, x):
            return 3 * self.inner(x)

    plain = attn.v_proj
    attn.v_proj = Scaled(plain)
    wrapped = run()
    assert len(calls) == 1 and not torch.allclose(wrapped, before)  # layer 1 unfused, the wrapper applied
    attn.v_proj = plain
    assert torch.equal(run(), before) and len(calls) == 2
    hook = attn.k_norm.register_forward_hook(lambda mod, inp, out: out * 0)
    hooked = run()
    assert len(calls) == 1 and not torch.allclose(hooked, before)
    hook.remove()
    attn.q_proj.weight.requires_grad_(True)
    for p in ev.parameters():
        if p is not attn.q_proj.weight:
            p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no backward"):
        ev(ids, attention_mask=mask, cache=ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=16, page_size=16))
    ev.to(torch.float16)
    with pytest.raises(TypeError, match="computes in bf16"):
        run()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_qwen3_model_with_yarn_rope_scaling(device, fuse):
    """Qwen3 (dense) with YaRN scaling (its attention factor 1.14 in the cos / sin): the fused prologue's table is
    the model's own, so generate's logits stay within the rule of the fp64 twin on a sharpened model; a
    length-dependent scaling (dynamic) gets no fused forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from evenflow.integrations.demo import twin_models

    def config(rope):
        return Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                           rope_parameters={"rope_theta": 10000.0, **rope})

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    m64, stock, ev = sharp(twin_models(Qwen3ForCausalLM, config(yarn), device, experts=False))
    assert ev.model.rotary_emb.attention_scaling > 1.1
    assert ev_tf.enable_attention(ev, fuse_prologue=fuse) == {"fused_prologue": 2 if fuse else 0}
    cache = ev_tf.PagedCache(ev, max_batch_size=3, max_cache_len=32, page_size=16)
    ids, mask = prompts(device, seed=6)
    seq, logits = generate(ev, cache, ids, mask)
    ref, base = teacher_forced_logits((m64, stock), seq, mask, NEW)
    assert_within_rule(logits.cpu(), ref.cpu(), base.cpu(), what="YaRN generate's logits")
    dynamic = Qwen3ForCausalLM(config({"rope_type": "dynamic", "factor": 2.0})).to(device=device,
                                                                                   dtype=torch.bfloat16)
    assert ev_tf.enable_attention(dynamic) == {"fused_prologue": 0}


def test_store_kv_places_each_row_and_rounds_once(device):
    """``store_kv``: bit for bit the prologue's store oracle (``store_kv_ref``, each token at its position's page
    and offset, divided by the scale, fp8 saturated at 448) given positions that are the slots on an identity page
    table, so every other slot untouched), also into the K / V halves of one [pages, P, H, 2 * D] buffer (an engine's
    layout) and into HND views, from rows at any strides (views of a fused projection, head-major rows); negative
    slots (an engine's padding rows) not written; slots past the cache named under check_inputs."""
    from evenflow.attention.prologue import store_kv
    from evenflow.reference.prologue import store_kv_ref

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
        want_k, want_v = store_kv_ref(before, before.clone(), k.float(), v.float(), slots,
                                      torch.arange(4, dtype=torch.int32)[None], torch.tensor([0, 4]),
                                      k_scale=scale or 1.0, v_scale=scale or 1.0)
        for got, want in ((kc, want_k), (vc, want_v)):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        if dtype == FP8:
            assert float(kc.view(-1, H, D)[5, 0, 0]) == 448.0  # 4000 / 0.25 saturated
        both = torch.cat([before, before.clone()], dim=-1)  # [pages, P, H, K then V]
        store_kv(k.to(device), v.to(device), both[..., :D], both[..., D:], slots.to(device), k_scale=scale,
                 v_scale=scale)
        assert torch.equal(both.cpu().view(torch.uint8), torch.cat([want_k, want_v], -1).view(torch.uint8))
        hnd_k = before.transpose(1, 2).contiguous().transpose(1, 2)  # [pages, P, H, D] over an HND buffer
        hnd_v = hnd_k.clone().transpose(1, 2).contiguous().transpose(1, 2)
        padded = torch.cat([slots, torch.tensor([-1, -7])]).to(device)  # two padding rows, written nowhere
        store_kv(torch.cat([k, k[:2] * 2]).to(device), torch.cat([v, v[:2] * 2]).to(device), hnd_k, hnd_v, padded,
                 k_scale=scale, v_scale=scale)
        for got, want in ((hnd_k, want_k), (hnd_v, want_v)):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        # rows read in place from strided views: K / V slices of one fused [N, (q + k + v) heads * D] projection
        # (row stride past H * D), and rows whose heads are further apart than D (a head-major buffer)
        qkv = torch.cat([torch.randn(4, 3 * D, generator=g).to(torch.bfloat16), k.flatten(1), v.flatten(1)], 1)
        k_view, v_view = (qkv.to(device)[:, (3 + i * H) * D:(3 + (i + 1) * H) * D].view(4, H, D) for i in (0, 1))
        k_hm = k.transpose(0, 1).contiguous().transpose(0, 1).to(device)  # stride(1) = 4 * D
        assert k_view.stride(0) == (3 + 2 * H) * D and k_hm.stride(1) == 4 * D
        for kk, vv in ((k_view, v_view), (k_hm, v_view)):
            kc2, vc2 = before.clone(), before.clone()
            store_kv(kk, vv, kc2, vc2, slots.to(device), k_scale=scale, v_scale=scale)
            for got, want in ((kc2, want_k), (vc2, want_v)):
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    kc = torch.zeros(4, P, H, D, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"slots\[1\] = 64 past the cache's 64 slots"):
        store_kv(k.to(device), v.to(device), kc, kc.clone(), torch.tensor([0, 64, 1, 2], device=device),
                 check_inputs=True)
    kc.zero_()  # past the cache: nothing written without check_inputs either (no sync to raise)
    store_kv(k.to(device), v.to(device), kc, kc.clone(), torch.tensor([0, 64, 1, 2], device=device))
    assert int((kc.cpu().view(-1, H, D).abs().sum((1, 2)) != 0).sum()) == 3
