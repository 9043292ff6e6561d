"""Expert selection: scoring + top-k over fp32 router logits, and the fused ``route``.

``route`` runs the router GEMM into an fp32 buffer held by the ``RouterWeight`` and then
one small kernel that scores, selects and weights (scores never pass through bf16).

Rules (the reference in ``evenflow.reference.router`` implements the same ones):

* ``scoring="softmax"`` (Qwen, Mixtral): probabilities = softmax over all E experts;
  selection by logit (softmax is monotone, so selecting on the logit adds no ties
  from rounding); weight = probability, divided by the sum of the k chosen if
  ``renormalize``.
* ``scoring="sigmoid"`` (DeepSeek-V3, Hy3): score = sigmoid(logit); selection by
  score + ``bias`` (the bias steers the choice only); weight = score, divided by
  (sum of the k chosen + 1e-20) if ``renormalize``.
* Both multiply the weights by ``routed_scaling`` last.
* Order: key descending; equal keys go to the lowest expert id first (torch.topk
  promises no order on ties, so this rule is ours, and tested exactly).
* NaN logits are never selected (ids stay within [0, E)); they make their row's weights NaN. So does a NaN
  in ``bias``: every weight of a row whose selection key is NaN somewhere is NaN (a NaN bias entry
  would otherwise leave its expert out in silence).
"""
from __future__ import annotations

import torch

from evenflow import _runtime
from evenflow._checks import (
    check_bool,
    check_choice,
    check_int,
    check_no_overlap,
    check_out,
    check_pdl,
    check_scaling,
    check_tensor,
    checked_op,
)
from evenflow.router.gemm import GemmConfig, RouterWeight, _check_x, router_gemm_fresh
from evenflow.router.kernels import route_topk_kernel

__all__ = ["route", "select_experts", "MAX_EXPERTS", "MAX_TOP_K"]

MAX_EXPERTS = 512
MAX_TOP_K = 16
# The top-k kernel's tile, (rows, warps) a program. None (the default): one row a one-warp program, which keeps every
# reduction of the selection inside a warp (its sm_90 build at 192-384 experts: 1,072-2,952 instructions and one
# barrier, against 6,496-9,168 and 80-114 barriers; round CN) and ran the top-k 1.5-4.2x faster than round CM's tile
# at every measured point on an H200 (round CP, M = 1-4096, four router shapes; docs/perf-notes/router.md). "cm":
# round CM's tile, 16 rows (fewer past 256 experts) on 4 warps, kept for A/B; or any (rows, warps).
TOPK_TILE: tuple[int, int] | str | None = None


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never on other devices)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _topk_tile(block_e: int) -> tuple[int, int]:
    if TOPK_TILE is None:
        return 1, 1
    if TOPK_TILE == "cm":
        return max(1, min(16, 4096 // block_e)), 4
    return TOPK_TILE


def _launch_topk(logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor,
                 top_k: int, is_sigmoid: bool, renormalize: bool, routed_scaling: float, pdl: bool,
                 clear_logits: bool = False) -> None:
    # clear_logits: the kernel writes zeros over the logits once it has read them (``route``'s own buffer, kept
    # all zero between calls so that its atomic split-K GEMM needs no zeroing kernel)
    t, e = logits.shape
    if t == 0:
        return
    block_e = max(16, _runtime.next_power_of_2(e))
    block_t, warps = _topk_tile(block_e)
    route_topk_kernel[(_runtime.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, ids, weights,
        t, e, logits.stride(0), float(routed_scaling),
        TOP_K=top_k, TOP_K_P2=_runtime.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=block_e,
        IS_SIGMOID=is_sigmoid, HAS_BIAS=bias is not None, RENORMALIZE=renormalize, CLEAR_LOGITS=clear_logits,
        num_warps=warps, **_runtime.pdl_kwargs(pdl),
    )


# Eager calls skip torch.library's dispatch (tens of microseconds on the host); torch.compile
# traces the custom op (see router_gemm).
def _check_topk_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): :func:`select_experts`'s, on the op's arguments."""
    logits = a["logits"]
    check_bool("is_sigmoid", a["is_sigmoid"])
    t, _ = _check_selection(logits, a["top_k"], "sigmoid" if a["is_sigmoid"] else "softmax", a["bias"],
                            a["renormalize"], a["routed_scaling"])
    check_out("ids", a["ids"], (t, a["top_k"]), torch.int32, logits.device)
    check_out("weights", a["weights"], (t, a["top_k"]), torch.float32, logits.device)
    _check_outputs_apart(a["ids"], a["weights"], logits, a["bias"], "ids", "weights")
    check_pdl(a["pdl"], logits.device, allow_none=False)
    check_bool("clear_logits", a["clear_logits"])


_route_topk_op = torch.library.custom_op("evenflow::route_topk", checked_op(_launch_topk, _check_topk_op),
                                         mutates_args=("logits", "ids", "weights"))  # logits: with clear_logits


@_route_topk_op.register_fake
def _(logits, bias, ids, weights, top_k, is_sigmoid, renormalize, routed_scaling, pdl, clear_logits=False):
    return None


def _check_outputs_apart(ids, weights, logits, bias, ids_name: str, weights_name: str, w=None) -> None:
    """The selection's two outputs share no bytes with each other or with its inputs (and ``route``'s fp32 router
    weight ``w``: a write into it would bump no version counter, so the split would go stale in silence)."""
    check_no_overlap(ids_name, ids, **{weights_name: weights, "logits": logits, "bias": bias, "w": w})
    check_no_overlap(weights_name, weights, logits=logits, bias=bias, w=w)


def _check_route_args(e: int, top_k, scoring, bias, renormalize, routed_scaling, device, experts_from: str) -> None:
    """``experts_from``: the argument whose size gave ``e`` (named by the error where it is too large)."""
    check_choice("scoring", scoring, ("softmax", "sigmoid"))
    if e > MAX_EXPERTS:
        raise ValueError(f"{experts_from}: the number of experts must be <= {MAX_EXPERTS}, got {e}")
    check_int("top_k", top_k, 1, min(MAX_TOP_K, e))
    if bias is not None:
        if scoring != "sigmoid":
            raise ValueError("bias is only used with scoring='sigmoid' (selection-only expert bias)")
        check_tensor("bias", bias, dtypes=[torch.float32], shape=[e], device=device, contiguous=True)
    check_bool("renormalize", renormalize)
    check_scaling("routed_scaling", routed_scaling, fp32=True)


def _check_selection(logits, top_k, scoring, bias, renormalize, routed_scaling) -> tuple[int, int]:
    """fp32 logits [T, E] and the selection's arguments (:func:`select_experts` and a direct call of its op);
    (T, E)."""
    check_tensor("logits", logits, dtypes=[torch.float32], ndim=2, last_dim_contiguous=True)
    t, e = logits.shape
    if e < 1:
        raise ValueError("logits must have at least one expert column")
    _check_route_args(e, top_k, scoring, bias, renormalize, routed_scaling, logits.device, "logits")
    return t, e


def _selection_outputs(out, t: int, top_k: int, logits: torch.Tensor, bias: torch.Tensor | None,
                       w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights): ``out`` checked (a pair of int32 / fp32 ``[T, top_k]`` on the logits' device, apart from each
    other and from the inputs), or new tensors where it is None."""
    if out is None:
        return (torch.empty((t, top_k), dtype=torch.int32, device=logits.device),
                torch.empty((t, top_k), dtype=torch.float32, device=logits.device))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be a pair (ids, weights)")
    ids = check_out("out[0] (ids)", out[0], (t, top_k), torch.int32, logits.device)
    weights = check_out("out[1] (weights)", out[1], (t, top_k), torch.float32, logits.device)
    _check_outputs_apart(ids, weights, logits, bias, "out[0] (ids)", "out[1] (weights)", w)
    return ids, weights


def select_experts(logits: torch.Tensor, top_k: int, scoring: str = "softmax", bias: torch.Tensor | None = None,
                   renormalize: bool = True, routed_scaling: float = 1.0,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None, *, pdl: bool | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, top_k], weights fp32 [T, top_k]) from fp32 logits [T, E]; rules in the module doc.
    ``pdl``: programmatic dependent launch, as in :func:`router_gemm` (None: on where supported)."""
    t, _ = _check_selection(logits, top_k, scoring, bias, renormalize, routed_scaling)
    check_pdl(pdl, logits.device)
    ids, weights = _selection_outputs(out, t, top_k, logits, bias)
    (_route_topk_op if torch.compiler.is_compiling() else _launch_topk)(
        logits, bias, ids, weights, top_k, scoring == "sigmoid", bool(renormalize), float(routed_scaling),
        _runtime.pdl_supported(logits.device) if pdl is None else pdl)
    return ids, weights


def route(x: torch.Tensor, w: RouterWeight, top_k: int, scoring: str = "softmax", bias: torch.Tensor | None = None,
          renormalize: bool = True, routed_scaling: float = 1.0, *, batch_invariant: bool = False,
          round_x_to_bf16: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None,
          pdl: bool | None = None, config: GemmConfig | None = None,
          prefetch_weights: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMM (fp32 fidelity) then scoring + top-k: (ids int32 [M, top_k], weights fp32 [M, top_k]).
    ``pdl``: both kernels with programmatic dependent launch (see :func:`router_gemm`); the top-k
    kernel's launch then overlaps the GEMM's end. ``config`` and ``prefetch_weights`` are the GEMM's, as
    :func:`router_gemm` takes them (``prefetch_weights=False`` keeps a ``pdl-preload`` entry from loading the
    weight before the wait).

    The logits go through a buffer of ``w``'s (``RouterWeight.logits_buffer``). Eager calls keep it all zero between
    calls (``RouterWeight.zeros_kept``): the top-k kernel writes zeros over the logits it has read, so a GEMM that sums
    its K slices with float atomics (``GemmConfig.reduce="atomic"``) adds into it with no zeroing kernel ahead (one
    launch fewer a call). A call captured in a CUDA graph zeroes the buffer first instead, and so does every call of
    ``w`` after it (a replay leaves logits in the buffer). Every argument is checked before the GEMM launches, and a
    failed top-k launch zeroes the buffer before it raises."""
    if not isinstance(w, RouterWeight):
        raise TypeError(f"w must be an evenflow.RouterWeight, got {type(w).__name__}")
    w.check_fresh()  # first: a re-split may change N, which the checks and the logits buffer read
    n, k = w.shape
    _check_route_args(n, top_k, scoring, bias, renormalize, routed_scaling, w.device, "w")  # before the GEMM
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _check_x(x, k, w.device, round_x_to_bf16)  # raises, naming x
    logits = w.logits_buffer(x.shape[0])
    # checked before the GEMM launches
    ids, weights = _selection_outputs(out, x.shape[0], top_k, logits, bias, w.source)
    # Eager calls while the zeros are kept: no zeroing kernel ahead of an atomic GEMM, the top-k clears (one launch
    # fewer a call; round CN1, docs/perf-notes/router.md). A captured call launches round CM's kernels (the clear was
    # slower in CN1's graphs) and ends the kept zeros: its replays leave logits in the buffer. A compiled call zeroes
    # first and clears, so that eager calls after it still find zeros.
    compiling = torch.compiler.is_compiling()
    if not compiling and w.zeros_kept and _capturing(w.device):
        w.zeros_kept = False
    clear = w.zeros_kept
    zeroed = clear and not compiling
    router_gemm_fresh(x, w, logits, batch_invariant=batch_invariant, round_x_to_bf16=round_x_to_bf16, pdl=pdl,
                      config=config, prefetch_weights=prefetch_weights, own_out=True, out_zeroed=zeroed)
    try:
        (_route_topk_op if compiling else _launch_topk)(
            logits, bias, ids, weights, top_k, scoring == "sigmoid", bool(renormalize), float(routed_scaling),
            w.pdl_supported if pdl is None else pdl, clear)
    except BaseException:
        if zeroed:
            logits.zero_()  # the GEMM's sums are in it: keep the buffer's zeros for the next call
        raise
    return ids, weights
