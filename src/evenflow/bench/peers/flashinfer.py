"""FlashInfer's paged decode and prefill attention (``BatchDecodeWithPagedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper``) as peers.

Written against FlashInfer 0.7.2 (the version measured in BENCH.md). Three impls,
named by the path they run:

==================  ==========================  ======================================
impl                wrapper arguments           kernel
==================  ==========================  ======================================
``flashinfer-cuda`` ``use_tensor_cores=False``  CUDA-core decode kernel (FA2 family)
``flashinfer-tc``   ``use_tensor_cores=True``,  FA2 prefill kernel used for decode
                    ``backend="fa2"``
``flashinfer-fa3``  ``use_tensor_cores=True``,  FA3 (Hopper) prefill kernel for decode
                    ``backend="fa3"``
==================  ==========================  ======================================

evenflow's layout is a page table ``[B, max_pages]`` int32 plus ``seq_lens [B]``;
FlashInfer wants CSR page lists (``indptr [B+1]``, ``indices [nnz_pages]``,
``last_page_len [B]``). :func:`paged_kv_layout` converts once, outside timing. The
wrapper is built in CUDA-graph mode (fixed batch, our own index buffers), as serving
engines build it for captured decode steps, and planned once per batch.

FP8 KV: the cache is passed as ``torch.float8_e4m3fn`` with ``kv_data_type`` set at
plan time and the per-tensor scales given to ``run()`` as Python floats
(``k_scale`` folds into the softmax scale; ``v_scale`` multiplies the output after
the kernel, an extra elementwise launch that is part of FlashInfer's cost).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from evenflow.bench.harness import PeerUnavailable, error_line

__all__ = ["DECODE_IMPLS", "PREFILL_IMPLS", "FlashInferDecode", "FlashInferPrefill", "import_flashinfer",
           "paged_kv_layout", "version"]

DECODE_IMPLS: dict[str, dict] = {
    "flashinfer-cuda": {"use_tensor_cores": False, "backend": "auto"},
    "flashinfer-tc": {"use_tensor_cores": True, "backend": "fa2"},
    "flashinfer-fa3": {"use_tensor_cores": True, "backend": "fa3"},
}

# Prefill: the FA2 and FA3 (Hopper) kernels of BatchPrefillWithPagedKVCacheWrapper, causal, planned once per batch
# (not in CUDA-graph mode: engines run prefill eagerly; the benchmark times both ways where the wrapper allows).
PREFILL_IMPLS: dict[str, str] = {"flashinfer-fa2": "fa2", "flashinfer-fa3": "fa3"}

# FlashInfer's recommended float workspace (split-KV partials); zeroed before first use.
WORKSPACE_BYTES = 128 << 20


def import_flashinfer():
    """The ``flashinfer`` module, or :class:`PeerUnavailable` saying why it cannot be imported."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a failing import of its own dependencies
        raise PeerUnavailable(f"flashinfer not importable: {type(e).__name__}: {error_line(e)}") from e
    return flashinfer


def version() -> str | None:
    try:
        return getattr(import_flashinfer(), "__version__", "unknown")
    except PeerUnavailable:
        return None


def paged_kv_layout(page_table: torch.Tensor, seq_lens: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """evenflow's ``page_table [B, max_pages]`` + ``seq_lens [B]`` -> FlashInfer's CSR page lists.

    Returns ``(indptr [B+1], indices [indptr[-1]], last_page_len [B])``, all int32 on
    ``page_table``'s device. Request ``b`` owns its first ``ceil(seq_lens[b] / page_size)``
    page-table entries, in order; ``last_page_len`` counts the tokens in its last page
    (1..page_size). FlashInfer has no encoding for an empty request, so a zero length
    is rejected. Runs on the host (one sync): this is set-up, never timed.
    """
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise TypeError("page_table must be a 2-D int32 tensor [B, max_pages]")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise TypeError("seq_lens must be a 1-D int32 tensor [B]")
    if seq_lens.shape[0] != page_table.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, page_table has {page_table.shape[0]} rows")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    lens = seq_lens.detach().to("cpu", torch.int64)
    if lens.numel() and int(lens.min()) <= 0:
        raise ValueError("seq_lens: FlashInfer's paged layout cannot express a request of length 0")
    n_pages = (lens + page_size - 1) // page_size
    max_pages = page_table.shape[1]
    if n_pages.numel() and int(n_pages.max()) > max_pages:
        raise ValueError(f"seq_lens: a request needs {int(n_pages.max())} pages, page_table holds {max_pages}")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(n_pages, 0)
    live = torch.arange(max_pages)[None, :] < n_pages[:, None]  # row-major: request by request, in order
    indices = page_table.detach().cpu()[live]
    last_page_len = lens - (n_pages - 1) * page_size
    dev = page_table.device
    return (indptr.to(dev, torch.int32), indices.to(dev, torch.int32), last_page_len.to(dev, torch.int32))


def _as_float(name: str, s) -> float | None:
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ValueError(f"{name} must hold one element (per-tensor scale), got shape {tuple(s.shape)}")
        return float(s.item())  # set-up only: FlashInfer takes per-tensor scales as host floats
    return float(s)


def _check_fa3_dtypes(fi, impl: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """:class:`PeerUnavailable` where FlashInfer's own ``utils.is_fa3_backend_supported`` says its FA3 kernel takes no
    such q / KV dtypes (0.7.2: an fp8 KV cache needs an fp8 q), before a JIT build that fails (fp8 KV with a bf16 q:
    ninja failed after 50-80 s in every decode record's log since round F3). A FlashInfer without that function is
    built as before."""
    check = getattr(getattr(fi, "utils", None), "is_fa3_backend_supported", None)
    if check is None:
        return
    try:  # (pos_encoding_mode NONE, no fp16 QK reductions, no custom mask) as a decode call plans it
        ok = check(0, False, False, q_dtype, kv_dtype)
    except TypeError:  # another signature: leave the answer to the build
        return
    if not ok:
        raise PeerUnavailable(f"{impl}: FlashInfer's is_fa3_backend_supported is False for q {q_dtype} with KV "
                              f"{kv_dtype} (its FA3 kernel takes an fp8 KV cache only with an fp8 q)")


def _ran_once(impl: str, run: Callable[[], torch.Tensor], device) -> Callable[[], torch.Tensor]:
    """``run`` after one call outside any graph capture (a failing kernel is reported here as
    :class:`PeerUnavailable`, not inside a capture)."""
    try:
        run()
        torch.cuda.synchronize(device)
    except Exception as e:
        raise PeerUnavailable(f"{impl}: run failed: {type(e).__name__}: {error_line(e)}") from e
    return run


class FlashInferDecode:
    """One FlashInfer decode wrapper planned for one batch (page table + lengths).

    Build it outside timing; :meth:`runner` binds the tensors and returns the zero-arg
    callable to time. Every failure (import, JIT build, plan, run) surfaces as
    :class:`PeerUnavailable` with the impl name and the reason.
    """

    def __init__(self, impl: str, page_table: torch.Tensor, seq_lens: torch.Tensor, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, out_dtype: torch.dtype | None = None, sm_scale: float | None = None):
        if impl not in DECODE_IMPLS:
            raise ValueError(f"impl must be one of {sorted(DECODE_IMPLS)}, got {impl!r}")
        fi = import_flashinfer()
        self.impl = impl
        self.batch = int(page_table.shape[0])
        self.kv_dtype = kv_dtype
        cfg = DECODE_IMPLS[impl]
        if cfg["backend"] == "fa3":
            _check_fa3_dtypes(fi, impl, q_dtype, kv_dtype)
        indptr, indices, last = paged_kv_layout(page_table, seq_lens, page_size)
        self.layout = (indptr, indices, last)
        dev = page_table.device
        self._plan_args = (indptr, indices, last, num_q_heads, num_kv_heads, head_dim, page_size)
        self._plan_kwargs = {"q_data_type": q_dtype, "kv_data_type": kv_dtype,
                             "o_data_type": out_dtype or q_dtype, "sm_scale": sm_scale}
        try:
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=cfg["use_tensor_cores"],
                paged_kv_indptr_buffer=torch.empty_like(indptr),
                paged_kv_indices_buffer=torch.empty_like(indices),
                paged_kv_last_page_len_buffer=torch.empty_like(last),
                backend=cfg["backend"])
            t0 = time.perf_counter()
            self.wrapper.plan(*self._plan_args, **self._plan_kwargs)  # first plan JIT-builds the kernels
            torch.cuda.synchronize(dev)
            self.first_plan_s = time.perf_counter() - t0
        except PeerUnavailable:
            raise
        except Exception as e:
            raise PeerUnavailable(f"{impl}: build/plan failed: {type(e).__name__}: {error_line(e)}") from e
        self.resolved_backend = getattr(self.wrapper, "resolved_backend", cfg["backend"])

    def plan_host_us(self, reps: int = 5) -> float:
        """Median host wall-clock µs of re-planning the same batch (FlashInfer plans on the host, per step)."""
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.wrapper.plan(*self._plan_args, **self._plan_kwargs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        return times[len(times) // 2]

    def runner(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_scale=None,
               v_scale=None, out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """Zero-arg callable running decode on ``q [B, Hq, D]`` and the NHD caches ``[pages, P, Hkv, D]``.

        Runs it once (so a failing kernel is reported here, not inside a graph capture).
        """
        if q.shape[0] != self.batch:
            raise ValueError(f"q has {q.shape[0]} rows, the wrapper was planned for batch {self.batch}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise TypeError(f"k_cache/v_cache must be {self.kv_dtype} as planned, got {k_cache.dtype}/{v_cache.dtype}")
        ks, vs = _as_float("k_scale", k_scale), _as_float("v_scale", v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=self._plan_kwargs["o_data_type"], device=q.device)
        wrapper = self.wrapper

        def run() -> torch.Tensor:
            return wrapper.run(q, (k_cache, v_cache), k_scale=ks, v_scale=vs, out=out)

        return _ran_once(self.impl, run, q.device)


class FlashInferPrefill:
    """One FlashInfer prefill wrapper planned for one batch of new rows (``cu_seqlens_q``) over the paged cache
    (page table + lengths, the new tokens included), causal with the new rows last: FlashInfer's append attention,
    the same attention as :func:`evenflow.prefill_attention`. Every failure surfaces as :class:`PeerUnavailable`."""

    def __init__(self, impl: str, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: torch.dtype,
                 q_dtype: torch.dtype = torch.bfloat16, sm_scale: float | None = None):
        if impl not in PREFILL_IMPLS:
            raise ValueError(f"impl must be one of {sorted(PREFILL_IMPLS)}, got {impl!r}")
        fi = import_flashinfer()
        self.impl, self.kv_dtype = impl, kv_dtype
        backend = PREFILL_IMPLS[impl]
        if backend == "fa3":
            _check_fa3_dtypes(fi, impl, q_dtype, kv_dtype)
        indptr, indices, last = paged_kv_layout(page_table, seq_lens, page_size)
        dev = page_table.device
        try:
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)
            t0 = time.perf_counter()
            self.wrapper.plan(cu_seqlens_q.to(torch.int32), indptr, indices, last, num_q_heads, num_kv_heads,
                              head_dim, page_size, causal=True, sm_scale=sm_scale, q_data_type=q_dtype,
                              kv_data_type=kv_dtype)
            torch.cuda.synchronize(dev)
            self.first_plan_s = time.perf_counter() - t0
        except PeerUnavailable:
            raise
        except Exception as e:
            raise PeerUnavailable(f"{impl}: build/plan failed: {type(e).__name__}: {error_line(e)}") from e

    def runner(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_scale=None,
               v_scale=None, out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """Zero-arg callable running the planned prefill on ``q [T, Hq, D]`` and the NHD caches; runs it once."""
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise TypeError(f"k_cache/v_cache must be {self.kv_dtype} as planned, got {k_cache.dtype}/{v_cache.dtype}")
        ks, vs = _as_float("k_scale", k_scale), _as_float("v_scale", v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        wrapper = self.wrapper

        def run() -> torch.Tensor:
            return wrapper.run(q, (k_cache, v_cache), k_scale=ks, v_scale=vs, out=out)

        return _ran_once(self.impl, run, q.device)
