"""Multi-GPU layouts of one host: slicing helpers for expert / tensor parallelism.

No math lives here beyond slicing and the sum of a collective; the operators
(:func:`evenflow.fused_moe`, :func:`evenflow.decode_attention`) already take the
shards as they are.

Layouts (``n`` ranks, this one ``r``; every split must be exact, or a ValueError says why)

=================  ==========================  =========================================
layout             input (unsplit)             shard of rank ``r``
=================  ==========================  =========================================
MoE EP             w13 [E, 2I, H], w2 [E,H,I]  experts [r*E/n, (r+1)*E/n) whole; topk_ids
                                               stay global, ``ep_rank=r``; pairs routed to
                                               other ranks add nothing; sum over ranks
MoE TP             same                        gate rows [r*I/n, (r+1)*I/n) and the same up
                                               rows (I + ...) of w13, the same columns of
                                               w2: SiLU(gate)*up is elementwise in I, so the
                                               down products of the slices sum to the layer
attention TP       q [T, Hq, D], caches        q heads [r*Hq/n, ...), kv heads [r*Hkv/n, ...)
                   [pages, P, Hkv, D]          (GQA groups stay whole); outputs concatenate
                                               along heads (the o-projection after it is the
                                               row-parallel GEMM + all-reduce)
=================  ==========================  =========================================

A rank's MoE output is a partial sum: all-reduce it (:func:`all_reduce`). The
shared expert and anything else added once must be added on one rank only
(``shared_output`` on rank 0, ``None`` elsewhere) or it is counted ``n`` times.

Multicast: NVLink SHARP (NVLS) and symmetric-memory multicast stay off on the
machines we validate on; call :func:`disable_multicast` before the process group
is initialised. Nothing here calls a multicast API.
"""
from __future__ import annotations

import os

import torch

from evenflow._checks import check_bool, check_int
from evenflow.moe.quant import MoEWeights, moe_weight_dims

__all__ = [
    "NO_MULTICAST_ENV", "disable_multicast", "split_range", "shard_moe_ep", "shard_moe_tp",
    "shard_block_scales_tp", "shard_moe_weights", "head_ranges", "shard_attention_heads", "all_reduce",
    "all_gather_heads",
]

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast() -> dict[str, str]:
    """Set the environment that keeps NCCL / symmetric memory off NVLink multicast; returns it.

    Must run before ``torch.distributed.init_process_group`` (NCCL reads it when the
    communicator is created). Overrides values already set: multicast stays off.
    """
    os.environ.update(NO_MULTICAST_ENV)
    return dict(NO_MULTICAST_ENV)


def _check_rank(rank, world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def split_range(size: int, rank: int, world_size: int, what: str = "size") -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank`` when ``size`` splits evenly over ``world_size``; ValueError if it does not."""
    check_int(what, size, 0)
    _check_rank(rank, world_size)
    if size % world_size:
        raise ValueError(f"{what} ({size}) must be divisible by world_size ({world_size})")
    part = size // world_size
    return rank * part, (rank + 1) * part


def shard_moe_ep(w13: torch.Tensor, w2: torch.Tensor, ep_rank: int, ep_size: int,
                 *per_expert: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Expert-parallel shard: experts ``[ep_rank*E/ep_size, (ep_rank+1)*E/ep_size)``, contiguous copies.

    ``per_expert``: further tensors whose first dim is the expert (per-expert or block
    scales); they are sliced the same way. Returns ``(w13_r, w2_r, *per_expert_r)``.
    """
    e, _, _ = moe_weight_dims(w13, w2)
    lo, hi = split_range(e, ep_rank, ep_size, "number of experts (w13.shape[0])")
    out = [w13[lo:hi].contiguous(), w2[lo:hi].contiguous()]
    for j, t in enumerate(per_expert):
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != e:
            raise ValueError(f"per_expert[{j}] must be a tensor with {e} experts in dim 0, "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        out.append(t[lo:hi].contiguous())
    return tuple(out)


def shard_moe_tp(w13: torch.Tensor, w2: torch.Tensor, tp_rank: int,
                 tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-parallel shard of every expert's intermediate dim: ``w13 [E, 2I/n, H]``, ``w2 [E, H, I/n]``.

    Rank r keeps gate rows ``[r*I/n, (r+1)*I/n)`` and up rows ``I + [r*I/n, (r+1)*I/n)``
    (stacked gate-then-up again, the layout fused_moe reads) and the same columns of w2.
    Per-expert and per-tensor fp8 scales apply to every slice unchanged.
    """
    _, _, i = moe_weight_dims(w13, w2)
    lo, hi = split_range(i, tp_rank, tp_size, "intermediate size (w2.shape[2])")
    w13_r = torch.cat([w13[:, lo:hi], w13[:, i + lo:i + hi]], dim=1).contiguous()
    return w13_r, w2[:, :, lo:hi].contiguous()


def shard_block_scales_tp(w13_scale: torch.Tensor, w2_scale: torch.Tensor, intermediate_size: int,
                          tp_rank: int, tp_size: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """TP shard of 128x128 block scales ``w13_scale [E, 2I/128, H/128]``, ``w2_scale [E, H/128, I/128]``.

    The intermediate slice must be whole blocks (``I/tp_size % block == 0``), or a
    block's scale would cover two ranks' rows: ValueError then (e.g. Hy3 TP8, I/8 = 192).
    """
    i = check_int("intermediate_size", intermediate_size, 1)
    check_int("block", block, 1)
    lo, hi = split_range(i, tp_rank, tp_size, "intermediate_size")
    if (hi - lo) % block:
        raise ValueError(f"intermediate_size / tp_size ({hi - lo}) must be a multiple of the scale block "
                         f"({block}) to shard block scales")
    for name, t, dim, n in (("w13_scale", w13_scale, 1, 2 * i // block), ("w2_scale", w2_scale, 2, i // block)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[dim] != n:
            raise ValueError(f"{name} must be 3-D with {n} blocks in dim {dim}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    # the two scales of one layer: the same experts, and w2's hidden blocks w13's
    if w2_scale.shape[0] != w13_scale.shape[0] or w2_scale.shape[1] != w13_scale.shape[2]:
        raise ValueError(f"w2_scale {tuple(w2_scale.shape)} must be [E, H/{block}, I/{block}] of w13_scale's E and "
                         f"H/{block} ({tuple(w13_scale.shape)})")
    bl, bh, nb = lo // block, hi // block, i // block
    s13 = torch.cat([w13_scale[:, bl:bh], w13_scale[:, nb + bl:nb + bh]], dim=1).contiguous()
    return s13, w2_scale[:, :, bl:bh].contiguous()


def shard_moe_weights(ew: MoEWeights, layout: str, rank: int, world_size: int) -> tuple[MoEWeights, int]:
    """This rank's shard of a whole layer's :class:`~evenflow.MoEWeights`, any format: ``(shard, ep_rank)``.

    ``layout`` "ep": whole experts, per-expert / block scales sliced with them,
    ``ep_rank=rank`` (pass it and ``num_experts_total`` to ``fused_moe``). "tp": every
    expert's intermediate slice; per-expert and static activation scales are shared
    unchanged, 128x128 block scales are sliced (the slice must be whole blocks), ``ep_rank=0``.
    Activation quantisation gives the same values on every rank as in the unsplit layer
    (static scales; per-token groups of 128 along H, or along whole blocks of I), so the
    shards' outputs sum to the unsplit layer's up to summation order.
    """
    if not isinstance(ew, MoEWeights):
        raise TypeError(f"ew must be an evenflow.MoEWeights, got {type(ew).__name__}")
    if layout not in ("ep", "tp"):
        raise ValueError(f"layout must be 'ep' or 'tp', got {layout!r}")
    _check_rank(rank, world_size)
    fmt = ew.format
    if layout == "ep":
        scales = () if fmt == "bf16" else (ew.w13_scale, ew.w2_scale)
        w13, w2, *s = shard_moe_ep(ew.w13, ew.w2, rank, world_size, *scales)
        s13, s2 = s if s else (None, None)
        ep_rank = rank
    else:
        w13, w2 = shard_moe_tp(ew.w13, ew.w2, rank, world_size)
        s13, s2 = ew.w13_scale, ew.w2_scale
        if fmt == "fp8_block":
            s13, s2 = shard_block_scales_tp(s13, s2, ew.intermediate_size, rank, world_size)
        ep_rank = 0
    if fmt == "bf16":
        return MoEWeights.bf16(w13, w2), ep_rank
    if fmt == "fp8_per_tensor":
        return MoEWeights.fp8_per_tensor(w13, w2, s13, s2, ew.a13_scale, ew.a2_scale), ep_rank
    return MoEWeights.fp8_block(w13, w2, s13, s2), ep_rank


def head_ranges(num_q_heads: int, num_kv_heads: int, tp_rank: int,
                tp_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((q_lo, q_hi), (kv_lo, kv_hi))`` of rank ``tp_rank``: whole GQA groups per rank."""
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        check_int(name, v, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    kv = split_range(num_kv_heads, tp_rank, tp_size, "num_kv_heads")
    group = num_q_heads // num_kv_heads
    return (kv[0] * group, kv[1] * group), kv


def shard_attention_heads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tp_rank: int,
                          tp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TP shard of decode attention inputs: ``q [T, Hq, D]`` and caches ``[pages, P, Hkv, D]`` -> this rank's heads.

    Contiguous copies (a rank owns its slice of the cache; in a server the cache is
    allocated per rank in the first place). Page table and lengths are shared as they are.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be 4-D [pages, P, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != k_cache head_dim {k_cache.shape[3]}")
    (qlo, qhi), (klo, khi) = head_ranges(q.shape[1], k_cache.shape[2], tp_rank, tp_size)
    return (q[:, qlo:qhi].contiguous(), k_cache[:, :, klo:khi].contiguous(),
            v_cache[:, :, klo:khi].contiguous())


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    return dist


def all_reduce(t: torch.Tensor, group=None, *, accumulate_fp32: bool = False) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` in place and return it (CUDA-graph capturable on NCCL).

    ``accumulate_fp32``: reduce an fp32 copy of a bf16 / fp16 ``t`` and round once at the end (twice the
    bytes on the wire for bf16; fp32, fp64 and integer tensors are summed as they are); by default the sum
    runs in ``t``'s dtype, as serving engines all-reduce bf16 activations.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    check_bool("accumulate_fp32", accumulate_fp32)
    dist = _dist()
    # only a narrower float gains from an fp32 sum (an fp64 or integer tensor would lose bits to it)
    if accumulate_fp32 and t.dtype.is_floating_point and t.dtype.itemsize < 4:
        acc = t.float()
        dist.all_reduce(acc, group=group)
        t.copy_(acc)
    else:
        dist.all_reduce(t, group=group)
    return t


def all_gather_heads(o: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``o [T, H_local, D]`` along heads, in rank order -> ``[T, n*H_local, D]``."""
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"o must be a torch.Tensor, got {type(o).__name__}")
    if o.dim() != 3:
        raise ValueError(f"o must be a 3-D tensor [T, H_local, D], got shape {tuple(o.shape)}")
    dist = _dist()
    n = dist.get_world_size(group)
    parts = [torch.empty_like(o) for _ in range(n)]
    dist.all_gather(parts, o.contiguous(), group=group)
    return torch.cat(parts, dim=1)
