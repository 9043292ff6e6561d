"""evenflow.attention: paged decode attention balanced by live KV length, paged prefill / extend attention, and the
fused attention prologue (QK-norm, RoPE, fp8 q, paged KV store) that feeds them (re-exported by evenflow)."""
from evenflow.attention.decode import decode_attention, validate_inputs
from evenflow.attention.plan import DecodePlan
from evenflow.attention.prefill import prefill_attention, validate_prefill_inputs
from evenflow.attention.prologue import qk_norm_rope_store_kv, validate_prologue_inputs
from evenflow.reference.prologue import rope_cos_sin

__all__: list[str] = ["DecodePlan", "decode_attention", "prefill_attention", "qk_norm_rope_store_kv", "rope_cos_sin",
                      "validate_inputs", "validate_prefill_inputs", "validate_prologue_inputs"]
