"""The transformers adapter on a GPU at Qwen3-30B-A3B's MoE dimensions (hidden 2048, 128 experts of 768, top-8; one
layer, a small vocabulary, random weights exact in bf16): logits within the tolerance rule against the same model in
fp64, at a decode-sized and a prefill-sized batch."""
import pytest
import torch

from evenflow.testing import assert_within_rule

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers", minversion="5.24")
ev_tf = pytest.importorskip("evenflow.integrations.transformers")

from test_integration_transformers import models  # noqa: E402


@pytest.mark.parametrize("shape", [(8, 1), (1, 64)])
def test_qwen3_moe_dimensions(shape):
    m64, stock, ev = models("cuda", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, vocab_size=512)
    assert ev_tf.enable(ev) == {"experts": 1, "routers": 1}
    ids = torch.randint(0, 512, shape, device="cuda")
    with torch.no_grad():
        ref, base, got = (m(ids).logits for m in (m64, stock, ev))
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what=f"logits {shape}")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_generate_with_paged_attention_at_qwen3_dimensions(kv_dtype, fuse, monkeypatch):
    """generate over a left-padded mix (one 700-token prompt and three short ones) with the attention and the MoE on
    evenflow at Qwen3-30B-A3B's attention dimensions (32 q / 4 kv heads of 128, 64-token pages, a DecodePlan): every
    step's logits within the rule of the fp64 model reading the whole sequence; the baseline the stock bf16 model
    (for an fp8 cache, with K and V rounded through fp8 at the same scales, as in the CPU test); with the fused
    prologue (one q / k / v GEMM and qk_norm_rope_store_kv) and without."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

    from evenflow.integrations.demo import generate_logits, left_padded, teacher_forced_logits

    m64, stock, ev = models("cuda", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, vocab_size=512, max_position_embeddings=1024)
    ev_tf.enable(ev)
    assert ev_tf.enable_attention(ev, fuse_prologue=fuse) == {"fused_prologue": 1 if fuse else 0}
    fp8 = kv_dtype == torch.float8_e4m3fn
    scales = dict(k_scale=1 / 64, v_scale=1 / 256) if fp8 else {}
    cache = ev_tf.PagedCache(ev, max_batch_size=4, max_cache_len=720, page_size=64, kv_dtype=kv_dtype, **scales)
    lens, new = (700, 33, 5, 130), 8
    ids, mask = left_padded(lens, 512, "cuda", seed=4)
    seq, got = generate_logits(ev, ids, mask, new, **ev_tf.cache_kwargs(ev, cache))
    assert cache.seq_lens.tolist() == [n + new - 1 for n in lens]
    (ref,) = teacher_forced_logits((m64,), seq, mask, new)
    if fp8:
        def fq(x, s):
            return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

        rope = qm.apply_rotary_pos_emb
        monkeypatch.setattr(qm, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: (
            lambda qk: (qk[0], fq(qk[1], scales["k_scale"])))(rope(q, k, cos, sin, **kw)))
        for lyr in stock.model.layers:
            lyr.self_attn.v_proj.register_forward_hook(lambda mod, inp, out: fq(out, scales["v_scale"]))
    (base,) = teacher_forced_logits((stock,), seq, mask, new)
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what=f"generate's logits ({kv_dtype})")


def test_beam_search_at_qwen3_dimensions():
    """Beam search (4 beams over a 700-token prompt and a 40-token one, 64-token pages, a DecodePlan): along every
    returned sequence the logits that chose its tokens are within the rule of the fp64 model reading it whole, so
    each reorder handed every row its beam's tokens (the CPU test's check at real sizes)."""
    from evenflow.integrations.demo import beam_search_logits, left_padded, teacher_forced_logits

    m64, stock, ev = models("cuda", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, vocab_size=512, max_position_embeddings=1024)
    ev_tf.enable(ev)
    ev_tf.enable_attention(ev)
    beams, lens, new = 4, (700, 40), 6
    cache = ev_tf.PagedCache(ev, max_batch_size=2 * beams, max_cache_len=720, page_size=64)
    moves, reorder = [], cache.reorder_cache
    cache.reorder_cache = lambda idx: moves.append(idx.tolist()) or reorder(idx)
    ids, mask = left_padded(lens, 512, "cuda", seed=5)
    seq, got = beam_search_logits(ev, ids, mask, new, beams, **ev_tf.cache_kwargs(ev, cache))
    assert any(m != list(range(2 * beams)) for m in moves), moves  # some reorder moved rows
    assert cache.seq_lens.tolist() == [n + new - 1 for n in lens for _ in range(beams)]
    ref, base = teacher_forced_logits((m64, stock), seq, mask.repeat_interleave(beams, 0), new)
    assert_within_rule(got.float().cpu(), ref.cpu(), base.float().cpu(), what="beam search's logits")
