"""The transformers adapter on a GPU at Qwen3-30B-A3B's MoE dimensions (hidden 2048, 128 experts of 768, top-8; one
layer, a small vocabulary, random weights exact in bf16): logits within the tolerance rule against the same model in
fp64, at a decode-sized and a prefill-sized batch."""
import pytest
import torch

from evenflow.testing import assert_within_rule
from test_integration_transformers import models

pytestmark = pytest.mark.gpu
ev_tf = pytest.importorskip("evenflow.integrations.transformers")


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
