"""evenflow.router: FP32-fidelity router GEMM on BF16 tensor cores and fused top-k routing."""
from evenflow.router.dispatch import GemmConfig
from evenflow.router.gemm import RouterWeight, router_gemm, split_weight
from evenflow.router.topk import route, select_experts

__all__ = ["RouterWeight", "router_gemm", "route", "select_experts", "split_weight", "GemmConfig"]
