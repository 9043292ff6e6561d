"""vLLM adapter: evenflow's paged decode and prefill attention as a vLLM (v1 engine) attention backend. It holds no
math: it maps vLLM's batch metadata and KV cache onto :func:`evenflow.decode_attention` (on a
:class:`evenflow.DecodePlan` updated once a step and shared by every layer), :func:`evenflow.prefill_attention` and
:func:`evenflow.attention.prologue.store_kv`.

    import evenflow.integrations.vllm as ev_vllm
    ev_vllm.register()   # vLLM's CUSTOM backend -> evenflow's (the package's "vllm.general_plugins" entry point also
                         # calls it in every vLLM process: worker processes, ``vllm serve``)
    llm = vllm.LLM(model, dtype="bfloat16", block_size=64, attention_config={"backend": "CUSTOM"})

The backend takes vLLM's ``CUSTOM`` slot, the one vLLM keeps for out-of-tree backends: a name of its own would be a
new member of vLLM's backend enum, which pickles by value and so cannot be read in a process started by spawn (a
worker, an engine core) before the plugin has run there.

What vLLM hands the backend, and what it does with it (vLLM 0.34's ``vllm.v1.attention.backend`` interface):

- The metadata builder runs once a step for the layers that share a KV cache spec. vLLM orders a batch with its
  decodes first (``reorder_batch_threshold``); the builder splits it (vLLM's ``split_decodes_and_prefills``, decodes
  of one query length, 1 to 4: a speculative verification's rows), updates the DecodePlan from the decodes' lengths
  (one small kernel, no host sync), and makes the prefills' query offsets (one subtraction on the device). The plan
  holds up to ``MAX_BATCH`` (2048) requests; a step with more decodes (``max_num_seqs`` above it) runs the static
  split-KV schedule.
- The attention impl's ``forward`` writes the step's K / V rows into the paged cache at vLLM's slots (``store_kv``:
  bf16, or fp8 e4m3 at the layer's per-tensor ``k_scale`` / ``v_scale``; the first ``num_actual_tokens`` rows, not
  a captured batch's padding), then runs the decode kernel on the decodes' rows and the prefill kernel (causal over
  each request's cached prefix: chunked prefill and prefix-cache hits) on the rest, writing into vLLM's output
  buffer.
- The KV cache: vLLM's per-layer tensor ``[num_blocks, Hkv, block_size, 2 * D]`` (K then V in the last dimension),
  read in place as K and V ``[num_blocks, block_size, Hkv, D]`` views (the kernels take any strides with a unit last
  one, so any of vLLM's layouts; ``LBNHC``, a block's slots then heads, is the one asked for:
  :meth:`EvenflowAttentionBackend.supported_kv_cache_layouts`).

What it takes: decoder self-attention, bf16 models, head_dim 64 / 128 / 256, a GQA group of at most 16, block sizes
16 / 32 / 64 / 128, a KV cache of ``auto`` / ``bfloat16`` / ``fp8`` / ``fp8_e4m3``. What it refuses, naming the cause:
ALiBi, sliding windows, logit softcapping, attention sinks, other attention types, fp16 / fp32 models, fused output
quantisation. CUDA graphs: the builder reports ``AttentionCGSupport.NEVER``, so vLLM captures the rest of the model
piecewise and runs attention eagerly (a full-graph decode would need the plan's update captured with the batch padded
to the graph's size: not built).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import evenflow
from evenflow._checks import check_int, check_scaling
from evenflow.attention.plan import HEAD_DIMS, MAX_BATCH, MAX_GQA_GROUP
from evenflow.attention.prologue import store_kv

try:
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadata,
        AttentionMetadataBuilder,
        AttentionType,
        CommonAttentionMetadata,
    )
    from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers, split_decodes_and_prefills
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError as e:  # vLLM missing, or older than the v1 backend interface this module is written against
    raise ImportError(f"evenflow.integrations.vllm needs vLLM >= 0.34 (its vllm.v1.attention backend interface): {e}") \
        from e

NAME = "CUSTOM"  # vLLM's AttentionBackendEnum member for an out-of-tree backend (the layer looks get_name() up)
BLOCK_SIZES = (16, 32, 64, 128)
MAX_DECODE_QUERY_LEN = 4  # decode_attention's q_len: one new token, or a speculative verification's rows
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_KV_CACHE_DTYPES = ("auto", "bfloat16", *_FP8_CACHE_DTYPES)


def register() -> None:
    """Make vLLM's ``CUSTOM`` attention backend evenflow's (select it with ``attention_config={"backend": "CUSTOM"}``
    or ``--attention-backend CUSTOM``). Idempotent; the ``vllm.general_plugins`` entry point calls it in every vLLM
    process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM,
                     f"{EvenflowAttentionBackend.__module__}.{EvenflowAttentionBackend.__qualname__}")


@dataclass
class EvenflowMetadata(AttentionMetadata):
    """One step's batch as the kernels take it: decodes first (``num_decodes`` requests of ``decode_query_len`` rows
    each, on ``plan``), then prefills (``num_prefills`` requests, query offsets ``prefill_cu_seqlens`` from 0)."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    max_query_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32, each request's cached tokens including this step's
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # int64, num_actual_tokens entries (then -1 for a captured batch's padding rows)
    decode_query_len: int = 1
    plan: evenflow.DecodePlan | None = None
    prefill_cu_seqlens: torch.Tensor | None = None  # [num_prefills + 1] int32


class EvenflowMetadataBuilder(AttentionMetadataBuilder[EvenflowMetadata]):
    """Splits a step's batch into decodes and prefills and updates the decode plan (one per decode query length,
    sized from vLLM's ``max_num_seqs`` and its block table's width)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        if self.reorder_batch_threshold > MAX_DECODE_QUERY_LEN:
            raise ValueError(f"the {NAME} attention backend decodes at most {MAX_DECODE_QUERY_LEN} query rows a "
                             f"request (num_speculative_tokens <= {MAX_DECODE_QUERY_LEN - 1}); this configuration "
                             f"asks {self.reorder_batch_threshold}")
        if kv_cache_spec.block_size not in BLOCK_SIZES:
            raise ValueError(f"the {NAME} attention backend takes block sizes {list(BLOCK_SIZES)}, got "
                             f"{kv_cache_spec.block_size}")
        # the plan serves up to MAX_BATCH requests; a step with more decodes (max_num_seqs above it) runs the static
        # split-KV schedule
        self.max_batch = min(vllm_config.scheduler_config.max_num_seqs, MAX_BATCH)
        # these layers' q heads (a model's layers may differ, and the plan is told its calls' count), None if vLLM
        # holds no such layers (a builder made outside an engine): the plan is then told nothing
        self.num_q_heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
        if kv_cache_spec.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
            # (vLLM picks this backend only for the dtypes it lists; a spec made otherwise would plan a bf16 cache)
            raise ValueError(f"the {NAME} attention backend holds bf16 or fp8 e4m3 caches (kv_cache_spec.dtype "
                             f"bfloat16, float8_e4m3fn or uint8), got {kv_cache_spec.dtype}")
        self.kv_dtype = torch.bfloat16 if kv_cache_spec.dtype == torch.bfloat16 else torch.float8_e4m3fn
        self._plans: dict[tuple[int, int], evenflow.DecodePlan] = {}

    def _plan(self, q_len: int, block_table: torch.Tensor) -> evenflow.DecodePlan:
        spec = self.kv_cache_spec
        key = (q_len, block_table.shape[1])
        plan = self._plans.get(key)
        if plan is None:
            plan = evenflow.DecodePlan(self.max_batch, block_table.shape[1] * spec.block_size, spec.num_kv_heads,
                                       page_size=spec.block_size, q_len=q_len, device=block_table.device,
                                       kv_dtype=self.kv_dtype, num_q_heads=self.num_q_heads,
                                       head_dim=spec.head_size, q_dtype=torch.bfloat16)
            self._plans[key] = plan
        return plan

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> EvenflowMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise NotImplementedError(f"the {NAME} attention backend is causal only")
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        num_decode_tokens = int(num_decode_tokens)
        m = EvenflowMetadata(num_actual_tokens=cm.num_actual_tokens, num_decodes=num_decodes,
                             num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
                             max_query_len=cm.max_query_len, seq_lens=cm.seq_lens,
                             block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping)
        if num_decodes:
            qsl = cm.query_start_loc_cpu
            m.decode_query_len = int(qsl[1] - qsl[0])
            if m.decode_query_len * num_decodes != num_decode_tokens:  # e.g. a full graph's zero-length padding
                raise ValueError(f"the {NAME} attention backend decodes requests of one query length: "
                                 f"{num_decodes} decodes hold {num_decode_tokens} tokens, the first "
                                 f"{m.decode_query_len}")
            if num_decodes <= self.max_batch:
                m.plan = self._plan(m.decode_query_len, cm.block_table_tensor).update(cm.seq_lens[:num_decodes])
        if num_prefills:
            qsl = cm.query_start_loc[num_decodes:num_decodes + num_prefills + 1]
            m.prefill_cu_seqlens = qsl - qsl[:1]
        return m


class EvenflowAttentionImpl(AttentionImpl[EvenflowMetadata]):
    """One attention layer: stores the step's K / V rows, then attends (decode kernel, prefill kernel)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        check_int("head_size", head_size)
        scale = check_scaling("scale", scale, positive=True)
        refusals = [what for what, bad in (
            (f"attention type {attn_type!r} (decoder self-attention only)", attn_type != AttentionType.DECODER),
            ("ALiBi", alibi_slopes is not None),
            (f"a sliding window ({sliding_window})", sliding_window is not None),
            (f"logit softcapping ({logits_soft_cap})", logits_soft_cap not in (None, 0, 0.0)),
            ("attention sinks", sinks is not None),
            (f"head_size {head_size} (takes {list(HEAD_DIMS)})", head_size not in HEAD_DIMS),
            (f"{num_heads} q heads over {num_kv_heads} kv heads (a GQA group of 1-{MAX_GQA_GROUP})",
             num_heads % num_kv_heads != 0 or num_heads // num_kv_heads > MAX_GQA_GROUP),
            (f"kv_cache_dtype {kv_cache_dtype!r} (takes {list(_KV_CACHE_DTYPES)})",
             kv_cache_dtype not in _KV_CACHE_DTYPES),
        ) if bad] + [f"argument {k}={v!r}" for k, v in unsupported.items() if v not in (None, False)]
        if refusals:
            raise NotImplementedError(f"the {NAME} attention backend does not take " + "; ".join(refusals))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.fp8 = kv_cache_dtype in _FP8_CACHE_DTYPES

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layer cache ``[num_blocks, Hkv, block_size, 2 * D]`` as K and V ``[num_blocks, block_size, Hkv,
        D]`` views (fp8 caches, which vLLM allocates as bytes, viewed as e4m3)."""
        dtypes = (torch.float8_e4m3fn, torch.uint8) if self.fp8 else (torch.bfloat16,)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in dtypes:
            raise TypeError(f"kv_cache must be a tensor of {' or '.join(map(str, dtypes))} (kv_cache_dtype "
                            f"{self.kv_cache_dtype!r}), got {getattr(kv_cache, 'dtype', type(kv_cache).__name__)}")
        if kv_cache.dim() != 4 or kv_cache.shape[1] != self.num_kv_heads or kv_cache.shape[3] != 2 * self.head_size:
            raise ValueError(f"kv_cache must be vLLM's layer cache [num_blocks, num_kv_heads {self.num_kv_heads}, "
                             f"block_size, 2 * head_size {2 * self.head_size}], got shape {tuple(kv_cache.shape)}")
        if self.fp8 and kv_cache.dtype != torch.float8_e4m3fn:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        kv = kv_cache.transpose(1, 2)
        return kv[..., :self.head_size], kv[..., self.head_size:]

    def _scales(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (layer._k_scale, layer._v_scale) if self.fp8 else (None, None)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: EvenflowMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output is None:
            raise ValueError(f"the {NAME} attention backend writes into vLLM's output buffer: output must be given")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"the {NAME} attention backend has no fused output quantisation")
        m = attn_metadata
        if m is None:  # vLLM's profiling run: no batch, nothing to attend (zeros, as vLLM's own backends give)
            return output.fill_(0)
        k_cache, v_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        nd, n = m.num_decode_tokens, m.num_actual_tokens
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            # this step's rows into the cache at vLLM's flat slots (block * block_size + offset); rows past
            # num_actual_tokens are a captured batch's padding, whose slots vLLM marks -1: never stored
            store_kv(key[:n], value[:n], k_cache, v_cache, m.slot_mapping[:n].long(), k_scale=k_scale,
                     v_scale=v_scale)
        if m.num_decodes:
            b = m.num_decodes
            evenflow.decode_attention(query[:nd], k_cache, v_cache, m.block_table[:b], m.seq_lens[:b], plan=m.plan,
                                      k_scale=k_scale, v_scale=v_scale, sm_scale=self.scale, out=output[:nd])
        if m.num_prefills:
            b0, b1 = m.num_decodes, m.num_decodes + m.num_prefills
            evenflow.prefill_attention(query[nd:n], k_cache, v_cache, m.prefill_cu_seqlens, m.block_table[b0:b1],
                                       m.seq_lens[b0:b1], m.max_query_len, k_scale=k_scale, v_scale=v_scale,
                                       sm_scale=self.scale, out=output[nd:n])
        return output


class EvenflowAttentionBackend(AttentionBackend):
    """evenflow's balanced decode and paged prefill attention, for vLLM's v1 engine (see the module docstring)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # forward stores the step's K / V rows first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[EvenflowAttentionImpl]:
        return EvenflowAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[EvenflowMetadataBuilder]:
        return EvenflowMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size in BLOCK_SIZES  # the decode plan's page is the cache's block

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the decode / prefill split and the decodes' query length are read from the CPU copy

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_DIMS)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major == 9  # Hopper: what the kernels (the fp8 ones in Gluon, for sm_90) are built for

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)
