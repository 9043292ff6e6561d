"""Router GEMM at FP32 fidelity on BF16 tensor cores: weight split, launcher, dispatch.

The split (done once, at load time)::

    w_hi = bf16(w)                    # round to nearest even (torch's cast)
    w_lo = bf16((w - w_hi) * 256)     # w - w_hi is exact in fp32; *256 is exact
    w   ~= w_hi + w_lo / 256          # |w - (w_hi + w_lo/256)| <= 2^-17 |w|

Why round-to-nearest rather than the truncation the HPC-Ops write-up describes:
nearest halves both rounding steps, so the two-term bound is 2^-17 |w| instead of
2^-15 |w| for truncation — two bits for the same work. (Derivation in
docs/perf-notes/router.md and tests/test_router_gemm.py.)

Stale split: ``RouterWeight`` remembers the source tensor's version counter and data
pointer. If the source is modified in place (``w.copy_(...)``, an optimizer step, a
weight reload) the next call raises ``RuntimeError`` — or re-splits when the weight
was made with ``auto_refresh=True``. The check is a host-side integer compare (no
sync); it is skipped while ``torch.compile`` traces.
"""
from __future__ import annotations

import torch
import triton

from evenflow import _runtime
from evenflow._checks import check_int, check_out, check_tensor
from evenflow.router.dispatch import GemmConfig, choose_config, device_facts
from evenflow.router.kernels import router_gemm_kernel

__all__ = ["RouterWeight", "router_gemm", "split_weight"]

LO_SCALE = 256.0


def split_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_hi, w_lo) of an fp32 weight, both bf16 with w's shape (see module docstring)."""
    w_hi = w.to(torch.bfloat16)
    w_lo = ((w - w_hi.float()) * LO_SCALE).to(torch.bfloat16)
    return w_hi.contiguous(), w_lo.contiguous()


class RouterWeight:
    """An fp32 router weight ``[N, K]`` split once into two bf16 parts, plus workspace.

    ``auto_refresh``: re-split when the source changed in place, instead of raising.
    Keep one ``RouterWeight`` per stream: the split-K workspace is reused by every call.
    Before capturing a CUDA graph or compiling with torch.compile, call
    ``reserve(max_tokens)``: it allocates the workspace and resolves the dispatch for
    every M up to ``max_tokens``, so nothing grows or is looked up inside the capture.
    """

    def __init__(self, w: torch.Tensor, *, auto_refresh: bool = False):
        check_tensor("w", w, dtypes=[torch.float32], ndim=2, contiguous=True)
        if w.shape[0] < 1 or w.shape[1] < 1:
            raise ValueError(f"w must have N >= 1 and K >= 1, got shape {tuple(w.shape)}")
        self.auto_refresh = bool(auto_refresh)
        self.source = w
        self._part = torch.empty(0, dtype=torch.float32, device=w.device)
        self._count = torch.zeros(0, dtype=torch.int32, device=w.device)
        self._logits = torch.empty(0, dtype=torch.float32, device=w.device)
        self._facts = device_facts(w.device)
        self._configs: dict[tuple[int, bool], GemmConfig] = {}
        self._split()

    def _split(self) -> None:
        w = self.source
        if not bool(torch.isfinite(w).all()):
            raise ValueError("w must be finite (NaN/Inf in a router weight)")
        self.w_hi, self.w_lo = split_weight(w)
        self._version = w._version
        self._ptr = w.data_ptr()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w_hi.shape)

    @property
    def device(self) -> torch.device:
        return self.w_hi.device

    def check_fresh(self) -> None:
        """Raise (or re-split, with auto_refresh) if the source weight changed since the split."""
        if torch.compiler.is_compiling():
            return
        w = self.source
        if w._version != self._version or w.data_ptr() != self._ptr:
            if self.auto_refresh:
                self._split()
                return
            raise RuntimeError(
                "RouterWeight is stale: its source weight was modified in place after the split; "
                "make a new RouterWeight, call .refresh(), or construct it with auto_refresh=True")

    def refresh(self) -> None:
        """Re-split from the (modified) source weight."""
        self._split()

    def reserve(self, max_tokens: int) -> None:
        """Allocate workspace for up to ``max_tokens`` rows (all configs the dispatch may pick)."""
        check_int("max_tokens", max_tokens, 1)
        cfgs = {self.config(m, inv) for inv in (False, True) for m in range(1, max_tokens + 1)}
        for c in cfgs:
            self.workspace(max_tokens, c)
        self.logits_buffer(max_tokens)

    def config(self, m: int, batch_invariant: bool = False) -> GemmConfig:
        """The dispatch's choice for ``m`` rows, memoised (``reserve`` fills it for torch.compile)."""
        key = (m, bool(batch_invariant))
        cfg = self._configs.get(key)
        if cfg is None:
            n, k = self.shape
            cfg = choose_config(m, n, k, self.device, batch_invariant, self._facts)
            self._configs[key] = cfg
        return cfg

    def workspace(self, m: int, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials, counters) big enough for ``m`` rows under ``cfg``; grown, never shrunk."""
        n, _ = self.shape
        need_part = cfg.split_k * m * n if cfg.split_k > 1 else 0
        need_count = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) if cfg.split_k > 1 else 0
        if self._part.numel() < need_part:
            self._part = torch.empty(need_part, dtype=torch.float32, device=self.device)
        if self._count.numel() < need_count:
            self._count = torch.zeros(need_count, dtype=torch.int32, device=self.device)
        return self._part, self._count

    def logits_buffer(self, m: int) -> torch.Tensor:
        n, _ = self.shape
        if self._logits.numel() < m * n:
            self._logits = torch.empty(m * n, dtype=torch.float32, device=self.device)
        return self._logits[: m * n].view(m, n)

    def __repr__(self) -> str:
        n, k = self.shape
        return f"RouterWeight(N={n}, K={k}, device={self.device}, auto_refresh={self.auto_refresh})"


# ----------------------------------------------------------------------------- custom op

@torch.library.custom_op("evenflow::router_gemm_split", mutates_args=("out", "part", "count"))
def _router_gemm_op(x: torch.Tensor, w_hi: torch.Tensor, w_lo: torch.Tensor, out: torch.Tensor,
                    part: torch.Tensor, count: torch.Tensor, block_m: int, block_n: int, block_k: int,
                    split_k: int, num_warps: int, num_stages: int) -> None:
    m, k = x.shape
    n = w_hi.shape[0]
    if m == 0:
        return
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split = triton.cdiv(k, k_split)  # no program with an empty K range
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    router_gemm_kernel[grid](
        x, w_hi, w_lo, out, part, count,
        m, n, k, k_split,
        x.stride(0), w_hi.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        EVEN_K=(k % block_k == 0), DOT_F32=_runtime.dot_needs_fp32(),
        num_warps=num_warps, num_stages=num_stages,
    )


@_router_gemm_op.register_fake
def _(x, w_hi, w_lo, out, part, count, block_m, block_n, block_k, split_k, num_warps, num_stages):
    return None


def _check_x(x: torch.Tensor, k: int, device: torch.device, round_x_to_bf16: bool) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and round_x_to_bf16:
        x = x.to(torch.bfloat16)
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        raise TypeError("x must be bfloat16; pass round_x_to_bf16=True to round an fp32 x to bf16 here")
    check_tensor("x", x, dtypes=[torch.bfloat16], ndim=2, shape=[None, k], device=device,
                 last_dim_contiguous=True)
    return x


def router_gemm(x: torch.Tensor, w: RouterWeight, out: torch.Tensor | None = None, *,
                batch_invariant: bool = False, round_x_to_bf16: bool = False,
                config: GemmConfig | None = None) -> torch.Tensor:
    """fp32 ``x @ w^T`` from bf16 ``x [M, K]`` and a split fp32 weight ``w [N, K]``: fp32 ``[M, N]``.

    ``batch_invariant``: row i is bitwise the same whatever M is and whatever the other
    rows hold (one fixed config, fixed K split, no float atomics).
    ``config``: force a launch configuration (tests, tuning); otherwise the dispatch table.
    """
    if not isinstance(w, RouterWeight):
        raise TypeError(f"w must be an evenflow.RouterWeight (split once at load time), got {type(w).__name__}")
    n, k = w.shape
    x = _check_x(x, k, w.device, round_x_to_bf16)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    else:
        check_out("out", out, (m, n), torch.float32, x.device)
    w.check_fresh()
    if m == 0:
        return out
    if config is None:
        config = w.config(m, batch_invariant)
    elif batch_invariant and config.path != "triton":
        raise ValueError("config.path must be 'triton' in batch-invariant mode")
    if config.path == "torch-fp32":
        torch.mm(x.float(), w.source.t(), out=out)
        return out
    if config.path == "torch-split2":
        _torch_split2(x, w, out)
        return out
    part, count = w.workspace(m, config)
    _router_gemm_op(x, w.w_hi, w.w_lo, out, part, count, config.block_m, config.block_n, config.block_k,
                    config.split_k, config.num_warps, config.num_stages)
    return out


def _torch_split2(x: torch.Tensor, w: RouterWeight, out: torch.Tensor) -> None:
    """Plain path: two torch bf16 products with fp32 output (cuBLAS on a GPU)."""
    if x.is_cuda:
        hi = torch.mm(x, w.w_hi.t(), out_dtype=torch.float32)
        lo = torch.mm(x, w.w_lo.t(), out_dtype=torch.float32)
    else:  # CPU has no mm(out_dtype=): widen first (products of bf16 are exact in fp32)
        hi = torch.mm(x.float(), w.w_hi.float().t())
        lo = torch.mm(x.float(), w.w_lo.float().t())
    torch.add(hi, lo, alpha=1.0 / LO_SCALE, out=out)
