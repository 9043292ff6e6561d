"""Router GEMM peers through PyTorch (cuBLAS): the ways engines compute router logits today.

Each ``make_*`` takes bf16 ``x [M, K]`` and fp32 ``w [N, K]``, prepares what the peer
keeps across calls (outside any timed region) and returns a zero-argument callable
producing fp32 logits ``[M, N]``:

* ``cublas-fp32``  ``torch.mm(x.float(), w.t())`` with TF32 off; the cast of x included,
  as engines with FP32 router weights run it.
* ``cublas-tf32``  the same product with TF32 allowed.
* ``cublas-split2`` two bf16 cuBLAS products of the split weight with fp32 output,
  ``mm(x, w_hi^T) + mm(x, w_lo^T) / 256`` (``torch.mm(..., out_dtype=torch.float32)``;
  when that overload is missing it raises PeerUnavailable rather than change the math).
* ``bf16-weight``  ``torch.mm(x, bf16(w)^T)`` in bf16, widened to fp32: the cheap, lossy way.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from evenflow.bench.harness import PeerUnavailable

PEERS = ("cublas-fp32", "cublas-tf32", "cublas-split2", "bf16-weight")


class _TF32:
    def __init__(self, allow: bool):
        self.allow = allow

    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.allow

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def make_fp32(x: torch.Tensor, w: torch.Tensor, tf32: bool = False) -> Callable[[], torch.Tensor]:
    wt = w.t()
    flag = _TF32(tf32)

    def run():
        with flag:
            return torch.mm(x.float(), wt)
    return run


def make_split2(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    w_hi = w.to(torch.bfloat16)
    w_lo = ((w - w_hi.float()) * 256).to(torch.bfloat16)
    try:
        torch.mm(x[:1], w_hi.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError) as e:
        raise PeerUnavailable(f"torch.mm(out_dtype=float32) unavailable for bf16 here: {e}") from e
    hi_t, lo_t = w_hi.t(), w_lo.t()

    def run():
        hi = torch.mm(x, hi_t, out_dtype=torch.float32)
        return hi.add_(torch.mm(x, lo_t, out_dtype=torch.float32), alpha=1.0 / 256)
    return run


def make_bf16_weight(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    wt = w.to(torch.bfloat16).t()
    return lambda: torch.mm(x, wt).float()


def make(name: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The peer called ``name`` (one of PEERS) on these inputs."""
    if not x.is_cuda:
        raise PeerUnavailable("cuBLAS peers need a CUDA device")
    if name == "cublas-fp32":
        return make_fp32(x, w, tf32=False)
    if name == "cublas-tf32":
        return make_fp32(x, w, tf32=True)
    if name == "cublas-split2":
        return make_split2(x, w)
    if name == "bf16-weight":
        return make_bf16_weight(x, w)
    raise ValueError(f"unknown router peer {name!r}; choose from {PEERS}")
