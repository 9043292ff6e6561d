"""SGLang adapter: evenflow's paged decode and prefill attention as an SGLang attention backend. It holds no math: it
maps SGLang's batch (``ForwardBatch``), its request-to-token table and its token-granular KV pool onto
:func:`evenflow.decode_attention` (on a :class:`evenflow.DecodePlan` updated once a step and shared by every layer)
and :func:`evenflow.prefill_attention`; SGLang's own pool stores the K / V rows.

    import evenflow.integrations.sglang as ev_sglang
    ev_sglang.register()   # the package's "sglang.srt.plugins" entry point also calls it in every SGLang process
    # python -m sglang.launch_server --model-path ... --attention-backend evenflow --page-size 64

What SGLang hands the backend, and what it does with it (SGLang 0.5.23's ``AttentionBackend`` interface):

- ``init_forward_metadata`` once a step. The page table is read from SGLang's request-to-token table: with a page
  size of P, SGLang's paged allocator gives each request whole pages of P consecutive slots, so request r's page i is
  ``req_to_token[r, i * P] // P`` (one gather and a division on the device). A decode step (one new token a request)
  then updates the DecodePlan from the requests' lengths (one small kernel, no host sync). An extend step (prefill,
  chunked prefill, prefix-cache hits, and SGLang's MIXED batches, whose decodes are one-token extends) makes the
  query offsets from the extend lengths.
- Each layer's ``forward_decode`` / ``forward_extend`` hands the step's K / V rows to SGLang's pool
  (``set_kv_buffer`` at the batch's ``out_cache_loc``: bf16, or fp8 e4m3 at the layer's ``k_scale`` / ``v_scale``,
  as SGLang stores them for every backend), then runs the decode kernel (every request one row) or the prefill
  kernel (causal over each request's cached prefix) on the pool's buffers in place, read as pages
  ``[num_pages, P, Hkv, D]``.
- CUDA graphs (SGLang's decode graphs): ``init_cuda_graph_state`` sizes the plan for the largest captured batch;
  the page-table gather and the plan's update are the graph-recordable part (``init_forward_metadata_in_graph``),
  so a replay rebuilds both from the batch SGLang copied into its static buffers. Padded rows (request 0, length
  ``get_cuda_graph_seq_len_fill_value()`` = 1) read SGLang's padding page and are discarded by SGLang.

What it takes: decoder self-attention of MHA / GQA models (SGLang's ``MHATokenToKVPool`` in its NHD layout), bf16
models, head_dim 64 / 128 / 256, a GQA group of at most 16, page sizes 16 / 32 / 64 / 128 (``--page-size``;
SGLang's default of 1 is refused by name), a KV cache of bf16 or ``fp8_e4m3`` (at a checkpoint's scales or those of
``--quantization-param-path``). The plan holds up to ``MAX_BATCH`` (2048) requests: decode graphs beyond it are
refused naming ``--cuda-graph-max-bs``, and an eager decode of more requests runs the static split-KV schedule.
SGLang's breakable prefill graphs are taken (attention runs eagerly between their segments); whole prefill graphs
(``--cuda-graph-backend-prefill full``) are declined step by step (``can_run_prefill_cuda_graph``). What it refuses,
naming the cause: MLA, fp16 / fp32 models, decode context parallelism, sliding windows (and SGLang's hybrid SWA
pools), logit capping, cross-attention and encoder-only layers, differing K / V head dims, the quantised-pool
formats (FP4, MXFP8), the HND pool layout, speculative decoding's verify and draft modes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

import evenflow
from evenflow.attention.plan import HEAD_DIMS, MAX_BATCH, MAX_GQA_GROUP

try:
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
except ImportError as e:  # SGLang missing, or without the backend interface this module is written against
    raise ImportError(f"evenflow.integrations.sglang needs SGLang >= 0.5.23 (its AttentionBackend interface): {e}") \
        from e

NAME = "evenflow"  # the --attention-backend name register() adds
PAGE_SIZES = (16, 32, 64, 128)
CUDA_GRAPH_SEQ_LEN_FILL = 1  # a captured batch's padded rows: request 0 (SGLang's padding row), one token


def register() -> None:
    """Add ``evenflow`` to SGLang's attention backends (``--attention-backend evenflow``, or ``--decode-attention-
    backend`` / ``--prefill-attention-backend``). Idempotent; the ``sglang.srt.plugins`` entry point calls it in
    every SGLang process (scheduler, workers)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(NAME)(EvenflowSGLangBackend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


@dataclass
class EvenflowSGLangMetadata:
    """One step's batch as the kernels take it: the page table and lengths of every request; a decode step's plan,
    or an extend step's query offsets and longest extend."""

    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32: each request's cached tokens, this step's included
    plan: evenflow.DecodePlan | None = None
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32 (extend)
    max_seqlen_q: int = 0


def _q_heads_of(model) -> int | None:
    """The q heads per rank of the model's attention layers, where they all agree (the plan is told it), else
    None."""
    heads = {m.tp_q_head_num for m in model.modules() if isinstance(m, RadixAttention)} if model is not None else ()
    return heads.pop() if len(heads) == 1 else None


def _dcp_size() -> int:
    """SGLang's decode-context-parallel width (1 where no parallel config is published: outside an engine)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_dcp_size)
    except (ImportError, RuntimeError, AttributeError, ValueError):  # nothing published: no engine, no DCP
        return 1


def _full_prefill_graphs() -> bool:
    """Whether SGLang captures whole prefill graphs (``--cuda-graph-backend-prefill full``; False where no config is
    published)."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend
        from sglang.srt.runtime_context import get_exec

        return get_exec().graph.cuda_graph_config.prefill.backend == Backend.FULL
    except (ImportError, RuntimeError, AttributeError, ValueError):  # ValueError: "namespace 'exec' not published"
        return False


def _kv_scale(layer, name: str):
    """The per-tensor scale SGLang's pool stored the layer's fp8 K or V at: its float (a checkpoint's scales set the
    float and the tensor together), else what ``--quantization-param-path`` sets (a plain float in the tensor's
    attribute), else the tensor itself (read on the device); None (1.0) where the layer has none."""
    f = getattr(layer, f"{name}_float", None)
    if f is not None:
        return float(f)
    t = getattr(layer, name, None)
    if t is None or isinstance(t, (int, float)):
        return t
    return t.reshape(1).float()


class EvenflowSGLangBackend(AttentionBackend):
    """evenflow's balanced decode and paged prefill attention for SGLang (see the module docstring)."""

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        mc = model_runner.model_config
        page = getattr(model_runner, "page_size", 1) or 1
        dcp = _dcp_size()
        refusals = [what for what, bad in (
            ("MLA models", getattr(mc, "attention_arch", None) == AttentionArch.MLA),
            (f"{getattr(mc, 'dtype', None)} models (bf16 only)",
             getattr(mc, "dtype", torch.bfloat16) != torch.bfloat16),
            (f"decode context parallelism (--dcp-size {dcp})", dcp > 1),
            ("encoder-decoder models", getattr(mc, "is_encoder_decoder", False)),
            (f"sliding-window models (sliding_window_size {getattr(model_runner, 'sliding_window_size', None)})",
             getattr(model_runner, "sliding_window_size", None) is not None),
            (f"KV pool {type(pool).__name__} (takes SGLang's MHATokenToKVPool)", type(pool) is not MHATokenToKVPool),
            (f"page size {page!r} (takes --page-size {' / '.join(map(str, PAGE_SIZES))})",
             type(page) is not int or page not in PAGE_SIZES),
        ) if bad]
        if not refusals:
            refusals = [what for what, bad in (
                (f"the pool's {pool.kv_cache_layout!r} layout (takes 'nhd')", pool.kv_cache_layout != "nhd"),
                ("a quantised pool format", pool.is_quantized_kv_cache),
                (f"KV cache dtype {pool.dtype} (takes bf16, float8_e4m3fn)",
                 pool.dtype not in (torch.bfloat16, torch.float8_e4m3fn)),
                (f"head_dim {pool.head_dim} (takes {list(HEAD_DIMS)})", pool.head_dim not in HEAD_DIMS),
                (f"a V head dim {pool.v_head_dim} unlike K's {pool.head_dim}", pool.v_head_dim != pool.head_dim),
                (f"a pool of {pool.size} slots plus a padding page, not whole pages of {page}",
                 (pool.size + page) % page != 0),
            ) if bad]
        if refusals:
            raise NotImplementedError(f"the {NAME} attention backend does not take " + "; ".join(refusals))
        self.device = torch.device(model_runner.device)
        self.page_size = page
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token  # [rows, max_context_len] int32 slots
        self.kv_dtype = pool.dtype
        self.num_kv_heads, self.head_dim = pool.head_num, pool.head_dim
        self.num_q_heads = _q_heads_of(getattr(model_runner, "model", None))
        self.max_seq_len = -(-self.req_to_token.shape[1] // page) * page
        # the plan serves up to MAX_BATCH requests (SGLang's request table is often larger: sized from
        # max_running_requests, which SGLang 0.5.23's kv_cache_configurator defaults to 2048-4096); an
        # eager decode of more runs the static schedule
        self._plan_batch = min(model_runner.req_to_token_pool.size, MAX_BATCH)
        self.plan: evenflow.DecodePlan | None = None
        self.forward_metadata: EvenflowSGLangMetadata | None = None
        self._layers_taken = weakref.WeakSet()  # the RadixAttention layers _check_layer has passed

    # --- metadata -----------------------------------------------------------------------------------------------

    def _decode_plan(self) -> evenflow.DecodePlan:
        if self.plan is None or self.plan.max_batch < self._plan_batch:
            self.plan = evenflow.DecodePlan(self._plan_batch, self.max_seq_len, self.num_kv_heads,
                                            page_size=self.page_size, q_len=1, device=self.device,
                                            kv_dtype=self.kv_dtype, num_q_heads=self.num_q_heads,
                                            head_dim=self.head_dim, q_dtype=torch.bfloat16)
        return self.plan

    def _page_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Each request's pages, in order: the first slot of every P-token run of its row, over P."""
        return self.req_to_token[:, ::self.page_size][req_pool_indices.long()] // self.page_size

    @staticmethod
    def _check_mode(forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2() or mode.is_dllm_extend() or \
                getattr(forward_batch, "spec_info", None) is not None:
            raise NotImplementedError(f"the {NAME} attention backend has no speculative-decoding or dLLM modes "
                                      f"(forward mode {mode.name})")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """The host-side part: an extend step's metadata (its longest extend is read on the host). A decode step's
        is all on the device (:meth:`init_forward_metadata_in_graph`)."""
        self._check_mode(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_idle() or mode.is_decode():
            return
        ext = forward_batch.extend_seq_lens
        cu = torch.zeros(ext.shape[0] + 1, dtype=torch.int32, device=ext.device)
        cu[1:] = torch.cumsum(ext, 0)
        lens_cpu = forward_batch.extend_seq_lens_cpu
        longest = max(lens_cpu) if lens_cpu is not None and len(lens_cpu) else int(ext.max()) if ext.numel() else 0
        self.forward_metadata = EvenflowSGLangMetadata(
            page_table=self._page_table(forward_batch.req_pool_indices),
            seq_lens=forward_batch.seq_lens.to(torch.int32), cu_seqlens_q=cu, max_seqlen_q=int(longest))

    def init_forward_metadata_in_graph(self, forward_batch):
        """The device-side part of a decode step: the page table and the plan's update (recorded in a captured
        decode graph, replayed on the batch SGLang copies into its static buffers)."""
        if not forward_batch.forward_mode.is_decode():
            return
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        plan = self._decode_plan()
        self.forward_metadata = EvenflowSGLangMetadata(
            page_table=self._page_table(forward_batch.req_pool_indices), seq_lens=seq_lens,
            plan=plan.update(seq_lens) if seq_lens.shape[0] <= plan.max_batch else None)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Decode graphs up to ``max_bs`` requests: the plan sized for them (built now, outside any capture)."""
        if max_bs > MAX_BATCH:
            raise NotImplementedError(f"the {NAME} attention backend captures decode graphs of at most {MAX_BATCH} "
                                      f"requests (the plan's bound), asked {max_bs}: lower --cuda-graph-max-bs")
        self._plan_batch = max(self._plan_batch, int(max_bs))
        self._decode_plan()

    def can_run_prefill_cuda_graph(self, forward_batch) -> bool:
        """SGLang's breakable prefill graphs run attention eagerly between their segments, on this step's metadata;
        a whole prefill graph would replay the extend metadata's tensors of its capture: such steps run eagerly."""
        return not _full_prefill_graphs()

    def get_cuda_graph_seq_len_fill_value(self):
        return CUDA_GRAPH_SEQ_LEN_FILL

    # --- layers -------------------------------------------------------------------------------------------------

    def _check_layer(self, layer, kwargs) -> None:
        """The layer's attention judged at its first call (its attributes are fixed at construction: a layer passed
        is not judged again on every step's host path); the call's extra arguments at every call."""
        extra = [f"argument {k}={v!r}" for k, v in kwargs.items() if v is not None and v is not False]
        if layer in self._layers_taken and not extra:
            return
        self._check_layer_fits_pool(layer)
        refusals = [what for what, bad in (
            (f"attention type {layer.attn_type} (decoder self-attention only)",
             layer.attn_type != AttentionType.DECODER or layer.is_cross_attention),
            (f"a sliding window ({layer.sliding_window_size})", layer.sliding_window_size not in (None, -1)),
            (f"logit capping ({layer.logit_cap})", bool(layer.logit_cap)),
            # Grok's position-dependent query temperature (SGLang's default -1: none)
            (f"xAI attention temperature (xai_temperature_len {getattr(layer, 'xai_temperature_len', -1)})",
             (getattr(layer, "xai_temperature_len", -1) or -1) > 0),
            (f"{layer.tp_q_head_num} q heads over {layer.tp_k_head_num} kv heads (a GQA group of 1-{MAX_GQA_GROUP})",
             layer.tp_q_head_num % layer.tp_k_head_num != 0
             or layer.tp_q_head_num // layer.tp_k_head_num > MAX_GQA_GROUP),
            (f"layer head dims {layer.qk_head_dim} / {layer.v_head_dim} over a pool of {self.head_dim}",
             layer.qk_head_dim != self.head_dim or layer.v_head_dim != self.head_dim),
        ) if bad] + extra
        if refusals:
            raise NotImplementedError(f"the {NAME} attention backend does not take " + "; ".join(refusals) +
                                      f" (layer {layer.layer_id})")
        self._layers_taken.add(layer)

    def _check_layer_fits_pool(self, layer) -> None:
        """ValueError where the layer does not match SGLang's pool: its layer_id outside the pool's layers (a negative
        one would index another layer's buffers from the end), or heads the pool does not hold (the kernels read the
        pool's kv heads, so a layer claiming others would attend with another GQA grouping than its model's)."""
        pool = self.token_to_kv_pool
        lid = layer.layer_id
        if isinstance(lid, bool) or not isinstance(lid, int) or \
                not 0 <= lid - pool.start_layer < pool.layer_num:
            raise ValueError(f"the {NAME} attention backend: layer.layer_id {lid!r} is outside the KV pool's layers "
                             f"[{pool.start_layer}, {pool.start_layer + pool.layer_num})")
        for name in ("tp_q_head_num", "tp_k_head_num"):
            heads = getattr(layer, name)
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise ValueError(f"the {NAME} attention backend: layer.{name} must be a positive int, got {heads!r} "
                                 f"(layer {lid})")
        if layer.tp_k_head_num != self.num_kv_heads:
            raise ValueError(f"the {NAME} attention backend: layer.tp_k_head_num {layer.tp_k_head_num} differs from "
                             f"the KV pool's head_num {self.num_kv_heads} (layer {lid})")

    def _layer_call(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs, decode: bool):
        """What both forwards do before their kernel: check the layer, find the step's metadata, hand the step's K / V
        rows to SGLang's pool (its own store), and give back the metadata, q as [T, Hq, D], the output buffer, the
        layer's buffers as pages and the per-tensor scales the pool stored them at (fp8; None, 1.0, for bf16 or a
        layer without scales)."""
        self._check_layer(layer, kwargs)
        m = self.forward_metadata
        if m is None or (m.cu_seqlens_q is None) != decode:  # a decode step's metadata has no query offsets
            step = "a decode" if decode else "an extend"
            raise RuntimeError(f"the {NAME} attention backend: forward_{'decode' if decode else 'extend'} before "
                               f"{step} step's init_forward_metadata")
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, layer.k_scale, layer.v_scale)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        caches = (pool.get_key_buffer(layer.layer_id).view(shape), pool.get_value_buffer(layer.layer_id).view(shape))
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        scales = (_kv_scale(layer, "k_scale"), _kv_scale(layer, "v_scale")) if fp8 else (None, None)
        q3 = q.reshape(-1, layer.tp_q_head_num, self.head_dim)
        return m, q3, q3.new_empty(q3.shape), caches, scales

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        m, q3, out, (k_cache, v_cache), (ks, vs) = self._layer_call(q, k, v, layer, forward_batch, save_kv_cache,
                                                                     kwargs, decode=True)
        evenflow.decode_attention(q3, k_cache, v_cache, m.page_table, m.seq_lens, plan=m.plan, k_scale=ks,
                                  v_scale=vs, sm_scale=layer.scaling, out=out)
        return out.view(q3.shape[0], -1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        m, q3, out, (k_cache, v_cache), (ks, vs) = self._layer_call(q, k, v, layer, forward_batch, save_kv_cache,
                                                                     kwargs, decode=False)
        evenflow.prefill_attention(q3, k_cache, v_cache, m.cu_seqlens_q, m.page_table, m.seq_lens, m.max_seqlen_q,
                                   k_scale=ks, v_scale=vs, sm_scale=layer.scaling, out=out)
        return out.view(q3.shape[0], -1)
