"""evenflow.attention: paged decode attention balanced by live KV length (re-exported by evenflow)."""
from evenflow.attention.decode import decode_attention, validate_inputs
from evenflow.attention.plan import DecodePlan

__all__: list[str] = ["DecodePlan", "decode_attention", "validate_inputs"]
