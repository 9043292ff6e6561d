"""SGLang's Triton fused MoE (``outplace_fused_experts``) as a benchmark peer, outside a server.

Why an adapter: SGLang's fused-MoE module expects to live inside a running
server. Three things stand between it and a plain call (found on the device
machine; BENCH.md has a section on running SGLang's Triton fused MoE on a GPU machine):

1. It imports two helpers from ``sgl_kernel`` (a large CUDA wheel we do not carry):
   ``moe_sum_reduce`` and ``moe_align_block_size``. When ``sgl_kernel`` is absent we
   register a small stand-in module whose two functions forward to SGLang's *own*
   Triton sum-reduce and its JIT-built alignment kernel (same math, same package).
2. Its modules read the server's runtime config through ``get_exec()`` and
   ``get_parallel()``. We answer with single-GPU values: no fused all-reduce, no
   deterministic mode, no TP group. They must be plain Python bools, since Triton
   takes them as constexprs.
3. ``is_allocation_symmetric()`` (NCCL symmetric memory for the output) -> False.

Set ``EVENFLOW_SGLANG_SHIM=/path/to/module.py`` (or ``--sglang-shim`` in
``benchmarks/moe.py``) to load ``load()`` from another file instead of this adapter.

Layouts are SGLang's, the same as evenflow's ``MoEWeights``: ``w13 [E, 2I, H]`` (gate
rows then up rows), ``w2 [E, H, I]``; scales are dequantisation multipliers.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from types import SimpleNamespace

import torch

from evenflow.bench.harness import PeerUnavailable

__all__ = ["load", "SGLangFusedMoE", "local_expert_ids"]

_FUSED_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
# Every module on the fused-experts path that reads the server config at call time.
_CONFIG_READERS = (
    _FUSED_MODULE,
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
    "sglang.srt.layers.moe.utils",
    "sglang.kernels.ops.moe.fused_moe_triton_kernels",
)

_loaded: Callable | None = None


def _sgl_kernel_stand_in() -> types.ModuleType:
    mod = types.ModuleType("sgl_kernel")
    mod.__doc__ = "evenflow stand-in: forwards to SGLang's own Triton/JIT kernels (no sgl_kernel wheel)."

    def moe_sum_reduce(inp, out, routed_scaling_factor):
        from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

        scale = 1.0 if routed_scaling_factor is None else routed_scaling_factor
        moe_sum_reduce_triton(inp, out, scale)

    def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids,
                             num_tokens_post_pad, cumsum_buffer, pad_sorted_token_ids=False,
                             ignore_invalid_expert=False):
        # The JIT kernel buckets ids with a +1 offset, so id -1 (an expert on another
        # EP rank) lands in the dropped bucket 0 without the extra flag.
        from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit_align

        jit_align(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids,
                  num_tokens_post_pad, cumsum_buffer, pad_sorted_token_ids)

    mod.moe_sum_reduce = moe_sum_reduce
    mod.moe_align_block_size = moe_align_block_size
    return mod


def _load_from_file(path: str) -> Callable:
    spec = importlib.util.spec_from_file_location("evenflow_sglang_shim", path)
    if spec is None or spec.loader is None:
        raise PeerUnavailable(f"sglang shim {path!r} cannot be loaded as a module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load()


def load(shim: str | None = None) -> Callable:
    """SGLang's ``outplace_fused_experts`` ready for single-GPU calls; PeerUnavailable if it can't be."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if not torch.cuda.is_available():
        raise PeerUnavailable("sglang-triton needs a CUDA GPU")
    shim = shim or os.environ.get("EVENFLOW_SGLANG_SHIM")
    try:
        if shim:
            _loaded = _load_from_file(shim)
            return _loaded
        try:
            import sgl_kernel  # noqa: F401  (the real wheel, when present, is used as is)
        except ImportError:
            sys.modules.setdefault("sgl_kernel", _sgl_kernel_stand_in())
        fused = importlib.import_module(_FUSED_MODULE)
        exec_cfg = SimpleNamespace(moe=SimpleNamespace(enable_fused_moe_sum_all_reduce=False),
                                   deterministic=SimpleNamespace(enable_deterministic_inference=False))
        parallel_cfg = SimpleNamespace(tp_group=None)
        for name in _CONFIG_READERS:
            m = importlib.import_module(name)
            if hasattr(m, "get_exec"):
                m.get_exec = lambda: exec_cfg
            if hasattr(m, "get_parallel"):
                m.get_parallel = lambda: parallel_cfg
            if hasattr(m, "is_allocation_symmetric"):
                m.is_allocation_symmetric = lambda: False
        _loaded = fused.outplace_fused_experts
    except PeerUnavailable:
        raise
    except Exception as e:  # ImportError, or any import-time failure of a server module
        raise PeerUnavailable(f"sglang not importable: {type(e).__name__}: {e}") from e
    return _loaded


def local_expert_ids(topk_ids: torch.Tensor, ep_rank: int, num_local: int) -> torch.Tensor:
    """Global ids -> this rank's local ids, -1 for experts on other ranks (SGLang's EP convention)."""
    lo = ep_rank * num_local
    local = topk_ids.to(torch.int32) - lo
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


class SGLangFusedMoE:
    """One MoE layer through SGLang's Triton fused MoE.

    variant: "bf16" | "fp8-tensor" (per-expert weight scales ``[E]``, static activation
    scales, 1 element each) | "fp8-block" (``[E, 2I/128, H/128]``, ``[E, H/128, I/128]``).
    """

    def __init__(self, variant: str, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale=None, w2_scale=None,
                 a13_scale=None, a2_scale=None, ep_rank: int = 0, num_experts_total: int | None = None,
                 shim: str | None = None):
        self.fused = load(shim)
        self.variant = variant
        self.w13, self.w2 = w13, w2
        self.num_local = w13.shape[0]
        self.ep_rank = ep_rank
        self.ep = num_experts_total is not None and num_experts_total != self.num_local
        if variant == "bf16":
            self.kwargs = {}
        elif variant == "fp8-tensor":
            self.kwargs = dict(use_fp8_w8a8=True, w1_scale=w13_scale.float(), w2_scale=w2_scale.float(),
                               a1_scale=a13_scale.float().reshape(1), a2_scale=a2_scale.float().reshape(1))
        elif variant == "fp8-block":
            self.kwargs = dict(use_fp8_w8a8=True, w1_scale=w13_scale.float(), w2_scale=w2_scale.float(),
                               block_shape=[128, 128])
        else:
            raise ValueError(f"variant must be bf16, fp8-tensor or fp8-block, got {variant!r}")

    def prepare_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Routing-side work a server does before the MoE layer (EP remap); not timed."""
        if self.ep:
            return local_expert_ids(topk_ids, self.ep_rank, self.num_local)
        return topk_ids.to(torch.int32)

    def __call__(self, x: torch.Tensor, prepared_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.fused(x, self.w13, self.w2, topk_weights, prepared_ids, **self.kwargs)

    def bind(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A zero-arg callable for the timers (ids remapped once, outside the timed call)."""
        ids = self.prepare_ids(topk_ids)
        return lambda: self(x, ids, topk_weights)
