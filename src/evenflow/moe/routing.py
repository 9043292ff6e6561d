"""Index build for the fused MoE: per-expert pair ranges and the per-tile task map.

Everything is sized from upper bounds known on the host (``topk_ids.shape``,
the number of local experts, ``block_m``), so building the index never syncs
with the host and a CUDA graph can capture it. See ``kernels.py`` for the
layout of every tensor.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from evenflow._checks import check_bool, check_int, check_pdl, check_tensor
from evenflow._runtime import cdiv, next_power_of_2, pdl_kwargs
from evenflow.moe.kernels import moe_index_hist_kernel, moe_index_kernel, moe_index_place_kernel

MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_BLOCK_M = 256  # rows of a tile of the task map (the index kernels' tile-end histograms)
# Above this many pairs the index is built by two launches of one program per chunk of pairs
# (per-chunk counts; per-chunk prefix + scatter + task-map share) instead of one program
# walking every block in turn (docs/perf-notes/moe.md, round 5).
MULTI_PROGRAM_PAIRS = 256
_CHUNK = 256
_BLOCK = 128  # pairs per step of a program (= 32 * num_warps), and tiles per task-map step
# Up to SMALL_CHUNK_PAIRS pairs the chunks are _BLOCK pairs, one scatter step a program (round AI: each step
# is a serial chain of global loads, histogram, sort and gather); past it _CHUNK, half the chunks for the place
# kernel's sum over every chunk's histogram (one load step of 8192 // E_PAD chunks)
SMALL_CHUNK_PAIRS = 4096
# the chunk kernels walk whole _BLOCK steps and mask only the total pair count, not the chunk end
assert _CHUNK % _BLOCK == 0


class MoEIndex(NamedTuple):
    counts: torch.Tensor        # [E_local] int32
    offsets: torch.Tensor       # [E_local + 1] int32
    sorted_pairs: torch.Tensor  # [P] int32, -1 past offsets[E_local]
    tile_expert: torch.Tensor   # [max_tiles] int32, -1 unused
    tile_row: torch.Tensor      # [max_tiles] int32, -1 unused
    block_m: int


def max_tiles(num_pairs: int, num_local: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(n_e / block_m) over experts with sum_e n_e <= num_pairs.

    Each expert wastes at most block_m - 1 rows of its last tile, and every tile
    holds at least one pair.
    """
    if num_pairs == 0:
        return 0
    return min(num_pairs, (num_pairs + num_local * (block_m - 1)) // block_m)


def build_moe_index(topk_ids: torch.Tensor, num_local_experts: int, ep_rank: int = 0,
                    block_m: int = 16, zero: torch.Tensor | None = None,
                    multi_program: bool | None = None, pdl: bool = False, chunk: int | None = None) -> MoEIndex:
    """Lay out the (token, slot) pairs routed to this rank's experts by expert.

    ``topk_ids`` [T, k] int32/int64 global expert ids; this rank owns experts
    ``[ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts)``; pairs
    routed elsewhere (or to no valid expert) are dropped. ``zero`` (optional, int32,
    contiguous) is a workspace the same launch fills with zeros (the gate-up's
    split-K and activation-group counters), saving a memset launch. ``multi_program`` forces the one-program
    (False) or the two-launch (True) build; by default the size decides
    (``MULTI_PROGRAM_PAIRS``). Both give identical results. ``pdl``: launch with
    programmatic dependent launch (see :func:`evenflow.moe.fused.fused_moe`). ``chunk``: pairs a
    program of the two-launch build handles, a multiple of 128 (default: 128 up to
    ``SMALL_CHUNK_PAIRS`` pairs, else 256); any chunk gives the same index.
    """
    check_tensor("topk_ids", topk_ids, dtypes=[torch.int32, torch.int64], ndim=2, contiguous=True)
    check_int("num_local_experts", num_local_experts, 1, MAX_EXPERTS)
    check_int("ep_rank", ep_rank, 0)
    check_int("block_m", block_m, 16, MAX_BLOCK_M)
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    dev = topk_ids.device
    check_pdl(pdl, dev, allow_none=False)
    if zero is not None:
        check_tensor("zero", zero, dtypes=[torch.int32], contiguous=True, device=dev)
    num_pairs = topk_ids.numel()
    if chunk is None:
        chunk = _BLOCK if num_pairs <= SMALL_CHUNK_PAIRS else _CHUNK
    check_int("chunk", chunk, _BLOCK)
    if chunk % _BLOCK:
        raise ValueError(f"chunk must be a multiple of {_BLOCK}, got {chunk}")
    n_tiles = max_tiles(num_pairs, num_local_experts, block_m)
    counts = torch.empty(num_local_experts, dtype=torch.int32, device=dev)
    offsets = torch.empty(num_local_experts + 1, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_row = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    # 4 warps; every histogram input ([BLOCK_P] pair ids, [E_PAD] tile ends) has >= 128 elements
    # so no element is replicated across threads; tile-end histograms have BLOCK_T bins.
    e_pad = max(_BLOCK, next_power_of_2(num_local_experts))
    zero_buf = zero if zero is not None else counts
    num_zero = 0 if zero is None else zero.numel()
    e_first = ep_rank * num_local_experts
    if multi_program is None:
        multi_program = num_pairs > MULTI_PROGRAM_PAIRS
    else:
        check_bool("multi_program", multi_program)
    if not multi_program or num_pairs == 0:
        moe_index_kernel[(1,)](
            topk_ids, counts, offsets, sorted_pairs, tile_expert, tile_row, zero_buf,
            num_pairs, e_first, num_local_experts, n_tiles, num_zero,
            E_PAD=e_pad, BLOCK_P=_BLOCK, BLOCK_T=_BLOCK, BLOCK_M=block_m, num_warps=4, **pdl_kwargs(pdl),
        )
    else:
        chunks = cdiv(num_pairs, chunk)
        hist = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
        moe_index_hist_kernel[(chunks,)](topk_ids, hist, zero_buf, num_pairs, e_first, num_local_experts, num_zero,
                                         E_PAD=e_pad, BLOCK_P=_BLOCK, CHUNK=chunk, num_warps=4,
                                         **pdl_kwargs(pdl))
        moe_index_place_kernel[(chunks,)](
            topk_ids, hist, counts, offsets, sorted_pairs, tile_expert, tile_row,
            num_pairs, chunks, e_first, num_local_experts, n_tiles,
            E_PAD=e_pad, BLOCK_P=_BLOCK, CHUNK=chunk, BLOCK_C=max(1, 8192 // e_pad), BLOCK_T=_BLOCK,
            BLOCK_M=block_m, num_warps=4, **pdl_kwargs(pdl),
        )
    return MoEIndex(counts, offsets, sorted_pairs, tile_expert, tile_row, block_m)
