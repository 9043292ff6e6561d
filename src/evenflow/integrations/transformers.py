"""Hugging Face transformers adapter: evenflow's fused MoE as an experts implementation, and its FP32-fidelity
router GEMM with fused top-k in place of a MoE block's router. It holds no math: it maps transformers' modules and
tensors onto :func:`evenflow.fused_moe`, :func:`evenflow.router_gemm` and :func:`evenflow.select_experts`.

Written against transformers 5 (its ``ExpertsInterface`` and the 3-D expert weights of ``@use_experts_implementation``
classes, e.g. Qwen3-MoE's ``Qwen3MoeExperts``: ``gate_up_proj [E, 2I, H]`` gate rows then up rows, ``down_proj
[E, H, I]``, which are :class:`evenflow.MoEWeights`' own layout, so nothing is copied).

    import evenflow.integrations.transformers as ev_tf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
    ev_tf.enable(model)        # experts -> evenflow.fused_moe; softmax top-k routers -> evenflow's router
    # or: ev_tf.register(); from_pretrained(..., experts_implementation="evenflow")

What it takes: experts with SiLU-gated, concatenated, untransposed gate/up projections and no biases (the experts
module's ``has_gate``, ``is_concatenated``, ``is_transposed``, ``has_bias`` flags say so), in bf16, or in transformers'
fine-grained FP8 (``FP8Experts``: e4m3 weights in 128 x 128 blocks with fp32 ``*_scale_inv`` multipliers and dynamic
activations, as Qwen3-FP8 and DeepSeek checkpoints load; :meth:`evenflow.MoEWeights.fp8_block` over the same
tensors); anything else raises a ``TypeError`` naming the module and what it has. Routers replaced: modules with a
``weight [E, H]``, ``top_k`` and ``norm_topk_prob`` and no bias (Qwen3-MoE's ``Qwen3MoeTopKRouter``: softmax over all
experts, top-k, optional renormalisation). The replacement computes the logits at FP32 fidelity from the router's
weight (bf16 checkpoint weights are exact in fp32) and returns fp32 routing weights; where the router's weight changes
in place (its version counter), it is split again before the next call.
"""
from __future__ import annotations

import torch

import evenflow

IMPLEMENTATION = "evenflow"


def _experts_interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:  # transformers missing, or older than the experts interface (5.0)
        raise ImportError("evenflow.integrations.transformers needs transformers >= 5 (its ExpertsInterface): "
                          f"{e}") from e
    return ALL_EXPERTS_FUNCTIONS


FP8 = torch.float8_e4m3fn


def _refuse(module: torch.nn.Module, what: str) -> None:
    raise TypeError(f"{type(module).__name__}: evenflow's fused MoE {what}")


def _check_experts(module: torch.nn.Module) -> str:
    """The evenflow weight format of a transformers experts module (``"bf16"`` or ``"fp8_block"``), or TypeError
    naming the module and what it has that evenflow's fused MoE does not compute."""
    for flag, want in (("has_gate", True), ("is_concatenated", True), ("is_transposed", False), ("has_bias", False)):
        if getattr(module, flag, want) != want:
            _refuse(module, f"takes {flag}={want} experts, this module has {flag}={getattr(module, flag)}")
    act = getattr(module, "act_fn", None)
    if act is not None and not isinstance(act, torch.nn.SiLU) and type(act).__name__ != "SiLUActivation":
        _refuse(module, f"computes SiLU(gate) * up; this module's act_fn is {type(act).__name__}")
    for extra in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"):  # FP8Experts' SwiGLU variants
        if getattr(module, extra, None) is not None:
            _refuse(module, f"computes plain SiLU(gate) * up; this module sets {extra}={getattr(module, extra)}")
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        _refuse(module, "needs gate_up_proj and down_proj tensors")
    if w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16:
        return "bf16"
    if w13.dtype == FP8 and w2.dtype == FP8:
        # transformers' fine-grained FP8 (Qwen3-FP8 / DeepSeek checkpoints): 128 x 128 weight blocks with fp32
        # dequant multipliers (``*_scale_inv``), activations quantised per token and 128-wide group on the fly
        if tuple(getattr(module, "block_size", None) or ()) != (128, 128):
            _refuse(module, f"takes fp8 weights in 128 x 128 blocks, this module's block_size is "
                            f"{getattr(module, 'block_size', None)}")
        if getattr(module, "activation_scheme", "dynamic") != "dynamic":
            _refuse(module, "quantises activations per token and 128-wide group (activation_scheme='dynamic'), "
                            f"this module's is {module.activation_scheme!r}")
        for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            sc = getattr(module, name, None)
            if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32:
                _refuse(module, f"takes fp32 block scales, this module's {name} is "
                                f"{None if sc is None else sc.dtype}")
        return "fp8_block"
    _refuse(module, f"takes bf16 or fp8 e4m3 experts, this module's gate_up_proj / down_proj are {w13.dtype} / "
                    f"{w2.dtype}")


def _moe_weights(module: torch.nn.Module) -> evenflow.MoEWeights:
    """The module's :class:`evenflow.MoEWeights` over its own parameters (no copy), built once and again only when a
    parameter is replaced or written in place."""
    fp8 = module.gate_up_proj.dtype == FP8
    params = [module.gate_up_proj, module.down_proj]
    if fp8:
        params += [module.gate_up_proj_scale_inv, module.down_proj_scale_inv]
    key = tuple((p.data_ptr(), p._version) for p in params)
    held = module.__dict__.get("_evenflow_moe")
    if held is None or held[0] != key:
        fmt = _check_experts(module)
        tensors = [p.detach() for p in params]
        ew = evenflow.MoEWeights.fp8_block(*tensors) if fmt == "fp8_block" else evenflow.MoEWeights.bf16(*tensors)
        held = (key, ew)
        module.__dict__["_evenflow_moe"] = held
    return held[1]


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``evenflow`` experts implementation: ``sum_k w_k * expert_k(x)`` of each token through
    :func:`evenflow.fused_moe` (hidden states cast to bf16 and the result back to their dtype)."""
    y = evenflow.fused_moe(hidden_states.to(torch.bfloat16), top_k_index.to(torch.int32), top_k_weights.float(),
                           _moe_weights(module))
    return y.to(hidden_states.dtype)


def register() -> None:
    """Make ``experts_implementation="evenflow"`` known to transformers (idempotent), for bf16 experts and for its
    fine-grained FP8 experts (``FP8Experts``, which dispatch through an interface of their own)."""
    interfaces = [_experts_interface()]
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        interfaces.append(ALL_FP8_EXPERTS_FUNCTIONS)
    except ImportError:  # a transformers without fine-grained FP8: bf16 experts only
        pass
    for interface in interfaces:
        if IMPLEMENTATION not in interface:
            interface.register(IMPLEMENTATION, experts_forward)


class EvenflowTopKRouter(torch.nn.Module):
    """A softmax top-k MoE router (Qwen3-MoE's contract: ``forward(h) -> (logits, weights, ids)``) on evenflow's
    FP32-fidelity router GEMM and fused selection. ``weight`` stays the original parameter (so state dicts and
    weight updates keep working); its fp32 split is made from it on first use and again after it changes."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.weight = router.weight
        self.top_k = int(router.top_k)
        self.norm_topk_prob = bool(router.norm_topk_prob)
        self.hidden_dim = router.weight.shape[1]
        self._split = None

    def _router_weight(self) -> evenflow.RouterWeight:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self._split is None or self._split[0] != key:
            self._split = (key, evenflow.RouterWeight(w.detach().float().contiguous()))
        return self._split[1]

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = evenflow.router_gemm(x.to(torch.bfloat16), self._router_weight())
        ids, weights = evenflow.select_experts(logits, self.top_k, "softmax", renormalize=self.norm_topk_prob)
        return logits, weights, ids.long()


def _is_softmax_router(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(module, "top_k")
            and hasattr(module, "norm_topk_prob") and getattr(module, "bias", None) is None
            and not isinstance(module, EvenflowTopKRouter))


def enable(model: torch.nn.Module, *, routers: bool = True) -> dict:
    """Run ``model``'s MoE layers on evenflow: its experts through :func:`evenflow.fused_moe` (``experts_implementation
    "evenflow"``) and, with ``routers``, each softmax top-k router through :class:`EvenflowTopKRouter`. Returns what
    was changed: ``{"experts": n, "routers": m}``. Raises ``TypeError`` for a model without experts modules it can
    run (and names the module whose weights it cannot take)."""
    register()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if not experts:
        raise TypeError(f"model: {type(model).__name__} has no 3-D experts module (gate_up_proj / down_proj) for "
                        "evenflow's fused MoE")
    for m in experts:
        _check_experts(m)
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model: {type(model).__name__} is not a transformers PreTrainedModel")
    model.set_experts_implementation(IMPLEMENTATION)
    replaced = 0
    if routers:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if _is_softmax_router(child):
                    setattr(parent, name, EvenflowTopKRouter(child))
                    replaced += 1
    return {"experts": len(experts), "routers": replaced}
