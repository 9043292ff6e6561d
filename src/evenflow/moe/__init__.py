"""evenflow.moe: fused Mixture-of-Experts layer (public names re-exported by evenflow)."""
from evenflow.moe.fused import MoEConfig, fused_moe
from evenflow.moe.quant import MoEWeights, quant_fp8_per_token_group
from evenflow.moe.routing import MoEIndex, build_moe_index

__all__ = ["MoEWeights", "fused_moe", "build_moe_index", "MoEIndex", "MoEConfig", "quant_fp8_per_token_group"]
