"""Hugging Face transformers adapter: evenflow's fused MoE as an experts implementation, its FP32-fidelity router GEMM
with fused top-k in place of a MoE block's router, and (``enable_attention`` with a ``PagedCache``: the module
``transformers_paged``) its paged decode / prefill attention under ``generate``. It holds no math: it maps
transformers' modules and tensors onto :func:`evenflow.fused_moe`, :func:`evenflow.router_gemm`,
:func:`evenflow.select_experts`, :func:`evenflow.decode_attention` and :func:`evenflow.prefill_attention`.

Written against transformers 5 (its ``ExpertsInterface`` and the 3-D expert weights of ``@use_experts_implementation``
classes, e.g. Qwen3-MoE's ``Qwen3MoeExperts``: ``gate_up_proj [E, 2I, H]`` gate rows then up rows, ``down_proj
[E, H, I]``, which are :class:`evenflow.MoEWeights`' own layout, so nothing is copied).

    import evenflow.integrations.transformers as ev_tf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
    ev_tf.enable(model)        # experts -> evenflow.fused_moe; softmax top-k routers -> evenflow's router
    # or: ev_tf.register(); from_pretrained(..., experts_implementation="evenflow")
    ev_tf.enable_attention(model)   # attention -> evenflow's paged kernels, over:
    out = model.generate(**inputs, cache=ev_tf.PagedCache(model, max_batch_size=32, max_cache_len=8192))

What it takes: experts with SiLU-gated, concatenated, untransposed gate/up projections and no biases (the experts
module's ``has_gate``, ``is_concatenated``, ``is_transposed``, ``has_bias`` flags say so), in bf16, or in transformers'
fine-grained FP8 (``FP8Experts``: e4m3 weights in 128 x 128 blocks with fp32 ``*_scale_inv`` multipliers and dynamic
activations, as Qwen3-FP8 and DeepSeek checkpoints load; :meth:`evenflow.MoEWeights.fp8_block` over the same
tensors); anything else raises a ``TypeError`` naming the module and what it has (SwiGLU clamps or scales, a
custom gate, a norm after each expert, transformers' expert-parallel layout).

Routers: only those whose ``forward`` is Qwen3-MoE's code (softmax over all experts in fp32, top-k, optional
renormalisation: Qwen2/3-MoE, Qwen3-Next, OLMoE, ... in transformers 5.25) get evenflow's forward, installed on the
module itself, so its class, hooks, state dict and ``output_router_logits`` recording stay. It computes the logits at
FP32 fidelity from the router's weight (bf16 checkpoint weights are exact in fp32) and returns fp32 logits and routing
weights; the weight's fp32 split is made again after the weight is replaced, moved or written in place (its
version counter; writes through ``.data`` bump none: call :func:`refresh`). Other routers (DeepSeek-V3's sigmoid with a
correction bias and grouped top-k, ...) stay transformers' own. evenflow's kernels have no backward: a call autograd
would record raises.
"""
from __future__ import annotations

import functools
import types

import torch

import evenflow
from evenflow._checks import check_bool
from evenflow.integrations._common import held, normalised_source, refuse_autograd
from evenflow.integrations._common import refresh as refresh  # re-exported: the adapter's API
from evenflow.integrations.transformers_paged import NEEDS
from evenflow.integrations.transformers_paged import attention_forward as attention_forward
from evenflow.integrations.transformers_paged import cache_kwargs as cache_kwargs
from evenflow.integrations.transformers_paged import enable_attention as enable_attention
from evenflow.integrations.transformers_paged import is_fused_attention as is_fused_attention
from evenflow.integrations.transformers_paged import register_attention as register_attention
from evenflow.integrations.transformers_paged import require_transformers as _require_transformers

_require_transformers()

IMPLEMENTATION = "evenflow"


def _experts_interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:  # transformers missing, or older than the experts interface (5.0)
        raise ImportError(f"{NEEDS} (its ExpertsInterface): {e}") from e
    return ALL_EXPERTS_FUNCTIONS


FP8 = torch.float8_e4m3fn


def _refuse(module: torch.nn.Module, what: str) -> None:
    raise TypeError(f"{type(module).__name__}: evenflow's fused MoE {what}")


def _default_gate(fn) -> bool:
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return fn is _default_apply_gate


def _check_experts(module: torch.nn.Module) -> str:
    """The evenflow weight format of a transformers experts module (``"bf16"`` or ``"fp8_block"``), or TypeError
    naming the module and what it has that evenflow's fused MoE does not compute."""
    for flag, want in (("has_gate", True), ("is_concatenated", True), ("is_transposed", False), ("has_bias", False)):
        if getattr(module, flag, want) != want:
            _refuse(module, f"takes {flag}={want} experts, this module has {flag}={getattr(module, flag)}")
    act = getattr(module, "act_fn", None)
    if (act is not None and act is not torch.nn.functional.silu and not isinstance(act, torch.nn.SiLU)
            and type(act).__name__ != "SiLUActivation"):  # (a module or the function: LFM2-MoE holds F.silu)
        _refuse(module, f"computes SiLU(gate) * up; this module's act_fn is {type(act).__name__}")
    for extra in ("swiglu_alpha", "limit", "swiglu_limit", "gate_softcap", "up_softcap", "alpha"):  # SwiGLU variants
        if getattr(module, extra, None) is not None:
            _refuse(module, f"computes plain SiLU(gate) * up; this module sets {extra}={getattr(module, extra)}")
    if getattr(module, "has_post_expert_norm", False):
        _refuse(module, "has no norm after each expert; this module has has_post_expert_norm=True")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and not _default_gate(gate) and type(module).__name__ != "FP8Experts":
        # (FP8Experts' own _apply_gate is SiLU(gate) * up unless the variants refused above are set)
        _refuse(module, f"computes SiLU(gate) * up; {type(module).__name__} overrides _apply_gate")
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
    parameter changes (:func:`evenflow.integrations._common.held`)."""
    params = [module.gate_up_proj, module.down_proj]
    if module.gate_up_proj.dtype == FP8:
        params += [module.gate_up_proj_scale_inv, module.down_proj_scale_inv]

    def build():
        tensors = [p.detach() for p in params]
        if _check_experts(module) == "fp8_block":
            return evenflow.MoEWeights.fp8_block(*tensors)
        return evenflow.MoEWeights.bf16(*tensors)

    return held(module, "_evenflow_moe", params, build)


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``evenflow`` experts implementation: ``sum_k w_k * expert_k(x)`` of each token through
    :func:`evenflow.fused_moe` (hidden states cast to bf16 and the result back to their dtype). evenflow's kernels
    have no backward: a call that autograd would record raises (run under ``torch.no_grad()`` / inference mode)."""
    if not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
        _check_experts(module)  # refuses it by name (has_gate=False experts have up_proj), not an AttributeError
    refuse_autograd(module, (hidden_states, module.gate_up_proj))
    if getattr(module, "_is_expert_parallel", False):
        _refuse(module, "runs this rank's experts from global ids (evenflow.fused_moe's ep_rank); transformers' "
                        "expert-parallel layout is not mapped")
    # the ids come from the model's router (int64 taken as they are); no host check of their range, which would
    # sync once a layer (out-of-range ids are dropped by the kernels, never read or written out of bounds)
    y = evenflow.fused_moe(hidden_states.to(torch.bfloat16), top_k_index, top_k_weights.float(),
                           _moe_weights(module), check_ids=False)
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


@functools.cache
def _softmax_topk_form(cls: type) -> bool:
    """Whether router class ``cls`` computes exactly Qwen3-MoE's routing: logits = h @ W^T, softmax over all experts
    in fp32, top-k, optional renormalisation, ``(logits, weights, ids)`` returned. Judged by its ``forward``'s code
    being Qwen3's, which in transformers 5.25 holds for Qwen2/3-MoE, Qwen3-Next, the Qwen3-Omni text routers, OLMoE,
    FlexOlmo, Mellum and Qwen4-Exp; a router with anything more (sigmoid scores, a correction bias, grouped top-k,
    a scaling factor, extra inputs: DeepSeek-V3, GLM4-MoE, ...) is left as it is."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    form = normalised_source(Qwen3MoeTopKRouter.forward)
    return form is not None and normalised_source(cls.forward) == form


def _router_split(router: torch.nn.Module) -> evenflow.RouterWeight:
    """The router weight's fp32 split, made on first use and again after the weight changes
    (:func:`evenflow.integrations._common.held`)."""
    w = router.weight
    return held(router, "_evenflow_split", [w], lambda: evenflow.RouterWeight(w.detach().float().contiguous()))


def _router_forward(router: torch.nn.Module, hidden_states: torch.Tensor):
    """The router's forward on evenflow (installed on the instance, so its class, hooks and output recording stay):
    FP32-fidelity logits, softmax top-k with optional renormalisation; (fp32 logits, fp32 weights, int64 ids)."""
    w = router.weight
    refuse_autograd(router, (hidden_states, w))
    x = hidden_states.reshape(-1, w.shape[1])
    logits = evenflow.router_gemm(x.to(torch.bfloat16), _router_split(router))
    ids, weights = evenflow.select_experts(logits, int(router.top_k), "softmax",
                                           renormalize=bool(router.norm_topk_prob))
    return logits, weights, ids.long()


def _is_softmax_router(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(module, "top_k")
            and hasattr(module, "norm_topk_prob") and _softmax_topk_form(type(module)))


def is_evenflow_router(module: torch.nn.Module) -> bool:
    """Whether :func:`enable` put ``module``'s forward on evenflow."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _router_forward


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and m.gate_up_proj.dim() == 3 and isinstance(getattr(m, "down_proj", None), torch.Tensor)]


def enable(model: torch.nn.Module, *, routers: bool = True) -> dict:
    """Run ``model``'s MoE layers on evenflow: its experts through :func:`evenflow.fused_moe` (``experts_implementation
    "evenflow"``) and, with ``routers``, each router of Qwen3-MoE's softmax top-k form through evenflow's router GEMM
    and selection (the module stays, its forward is evenflow's: hooks, state dicts and ``output_router_logits`` keep
    working). Returns what was changed: ``{"experts": n, "routers": m}``. Raises ``TypeError`` for a model without 3-D
    experts modules, or naming an experts module it cannot compute."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a transformers model (a torch.nn.Module), got {type(model).__name__}")
    check_bool("routers", routers)
    register()
    experts = _experts_modules(model)
    if not experts:
        raise TypeError(f"model: {type(model).__name__} has no 3-D experts module (gate_up_proj / down_proj) for "
                        "evenflow's fused MoE")
    for m in experts:
        _check_experts(m)
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model: {type(model).__name__} is not a transformers PreTrainedModel")
    model.set_experts_implementation(IMPLEMENTATION)
    # Each experts module dispatches by its own config's implementation (transformers' experts interface); a class
    # without that interface keeps its own forward whatever is set (round CP's review: Llama4's experts were counted
    # as moved and never called evenflow)
    stays = [m for m in experts
             if getattr(getattr(m, "config", None), "_experts_implementation", None) != IMPLEMENTATION]
    if stays:
        raise TypeError(f"{type(stays[0]).__name__}: runs its own forward, which transformers' experts interface "
                        "does not dispatch (its class is not built with use_experts_implementation): evenflow's "
                        "fused MoE cannot take it")
    replaced = 0
    if routers:
        for m in model.modules():
            if _is_softmax_router(m) and not is_evenflow_router(m):
                m.forward = types.MethodType(_router_forward, m)
                replaced += 1
    return {"experts": len(experts), "routers": replaced}


def __getattr__(name: str):
    if name == "PagedCache":  # built on first use: transformers is imported only then
        from evenflow.integrations import transformers_paged

        return transformers_paged.PagedCache
    raise AttributeError(name)
