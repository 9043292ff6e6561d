"""Paged prefill / extend attention: launcher (checks, allocation, block choice) and its custom op.

==============  ===========================  ===================================================================
argument         shape                        dtype
==============  ===========================  ===================================================================
q                [T, Hq, D]                   bf16: every request's new tokens, request after request
k/v_cache        [num_pages, P, Hkv, D]       bf16 or fp8 e4m3 (NHD; strides as decode takes them), the new
                                              tokens' K and V already written (``qk_norm_rope_store_kv``)
cu_seqlens_q     [B + 1] int32                request b's rows are q[cu[b]:cu[b + 1]]; rows past cu[B] are padding
page_table       [B, max_pages] int32         pages in any order
seq_lens         [B] int32                    cached tokens of each request, its new ones included
max_seqlen_q     int                          a bound on any request's new tokens (the grid's size; a request with
                                              more is still computed whole, by fewer programs)
k/v_scale        float or fp32 tensor [1]     per-tensor dequant scale of the cache (K = stored K * k_scale)
out              [T, Hq, D] bf16
lse (optional)   [T, Hq] fp32                 natural log of sum(exp(score)); -inf where a row sees no key
==============  ===========================  ===================================================================

Causal: with L = seq_lens[b] and n = cu[b + 1] - cu[b], row i of request b (position L - n + i) sees keys
[0, L - n + i + 1): the cached prefix and the new tokens up to itself. Padding rows (before cu[0] or past cu[B]) and
rows that see no key get zeros. Where cu_seqlens_q decreases (refused by ``check_inputs``) requests overlap and the
rows they share are written by more than one program: their values are unspecified, though nothing is written
outside ``out``. Values inside device tensors are not read by the launcher by default (that would sync); the kernel
clamps them (boundaries to [0, T], lengths to the page table, page ids to the cache), so nothing is read or written
out of bounds. ``check_inputs=True`` checks them in the call (one sync; skipped under CUDA-graph capture and
torch.compile).
"""
from __future__ import annotations

import math

import torch

from evenflow import _runtime
from evenflow._checks import (
    check_bool,
    check_cu_seqlens_values,
    check_int,
    check_no_overlap,
    check_out,
    check_scaling,
    check_tensor,
    checked_op,
)
from evenflow.attention import prefill_kernels as PK
from evenflow.attention.decode import _scale_arg, check_kv_cache, check_scale_tensors, check_score_scale
from evenflow.attention.plan import MAX_GQA_GROUP

_LOG2E = math.log2(math.e)
MAX_ROW_BLOCKS = 1 << 15  # the grid's row-block dimension at most, under CUDA's 65535 (programs walk the rest)

# Round CA's loop forms (docs/perf-notes/prefill.md, "Round CA: the loop's shape"): the same keys in the same steps and
# order as the masked 64-row form before them, so the same outputs in the interpreter, bit for bit
# (tests/test_prefill.py), and on a GPU within the rule (there the compiler may fuse an unmasked step's score scale
# into its exponent, and 128-row blocks lay the MMAs out anew). SPLIT_LOOP and WIDE_ROWS are on since round CC, which
# timed them against that form (CC's knob rows, one H100: 2.50-2.71x on the long bf16 cases, 1.70-1.95x with fp8 KV,
# 1.13-1.27x on 64-row chunks). A third, the longest blocks first, measured 0.92-1.04x and was taken out.
SPLIT_LOOP = True  # the steps every row of a block sees without masks, one page id a step where the page allows
WIDE_ROWS = True  # 128-row blocks on 8 warps (a warpgroup's 64 rows each) for chunks of more than 64 rows, D <= 128
# Round CC's head packing: where a head's rows take a block of under 128 rows at D <= 128 (with WIDE_ROWS, chunks of
# at most 64 rows), several q heads of one KV head share a block (up to 128 rows), as the decode kernel packs its
# groups (CC6 / CC7, one H100: 1.82-1.90x at 64-row chunks, 2.43-2.59x at 16-row extends, both head shapes, bf16 and
# fp8 KV)
PACK_HEADS = True


def _blocks(max_seqlen_q: int, head_dim: int, wide: bool = False) -> tuple[int, int]:
    """(rows, BLOCK_N): a block's new rows of each q head it holds, 64 for prefill chunks (128 with ``wide`` past 64
    rows at D <= 128), 16 / 32 for short extends; 64-key steps (32 at d256). BLOCK_M is the rows times the heads a
    block packs (:func:`_heads_per_block`)."""
    block_m = 16 if max_seqlen_q <= 16 else 32 if max_seqlen_q <= 32 else 64
    if wide and max_seqlen_q > 64 and head_dim <= 128:
        block_m = 128
    return block_m, 32 if head_dim > 128 else 64


def _heads_per_block(block_m: int, head_dim: int, group: int, pack: bool) -> int:
    """q heads a block packs (``PACK_HEADS``): the largest power of two that divides the GQA group and keeps the
    block at most 128 rows, for blocks under 128 rows at D <= 128; else 1."""
    heads = 1
    if pack and head_dim <= 128:
        while group % (2 * heads) == 0 and 2 * heads * block_m <= 128:
            heads *= 2
    return heads


def _check(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, max_seqlen_q):
    """The host-side checks; returns (T, Hq, Hkv, D, B)."""
    check_tensor("q", q, dtypes=[torch.bfloat16], ndim=3, last_dim_contiguous=True)
    dev = q.device
    _, _, Hkv, D = check_kv_cache(k_cache, v_cache, dev)
    T, Hq, qd = q.shape
    if qd != D:
        raise ValueError(f"q head_dim {qd} != k_cache head_dim {D}")
    if Hq % Hkv or not 1 <= Hq // Hkv <= MAX_GQA_GROUP:
        raise ValueError(f"q heads ({Hq}) must be a multiple 1..{MAX_GQA_GROUP} of the kv heads ({Hkv})")
    if Hq > 65535:  # the grid's third dimension
        raise ValueError(f"q must have at most 65535 heads, got {Hq}")
    check_tensor("seq_lens", seq_lens, dtypes=[torch.int32], ndim=1, device=dev, contiguous=True)
    B = seq_lens.shape[0]
    if B < 1:
        raise ValueError("seq_lens is empty (batch 0): prefill_attention needs at least one request")
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=[torch.int32], shape=[B + 1], device=dev, contiguous=True)
    check_tensor("page_table", page_table, dtypes=[torch.int32], ndim=2, device=dev, last_dim_contiguous=True)
    if page_table.shape[0] != B:
        raise ValueError(f"page_table must have {B} rows (one per request in seq_lens), got {page_table.shape[0]}")
    if page_table.shape[1] < 1:
        raise ValueError("page_table must have at least one column")
    check_int("max_seqlen_q", max_seqlen_q, 1)
    return T, Hq, Hkv, D, B


def _prefill_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    page_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_scale_f: float, v_scale_f: float,
                    sm_scale: float, max_seqlen_q: int) -> None:
    T, Hq, D = q.shape
    _, P, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    if T == 0:
        return
    rows, block_n = _blocks(max_seqlen_q, D, WIDE_ROWS)  # a block's new rows (of each head it packs)
    heads = _heads_per_block(rows, D, Hq // Hkv, PACK_HEADS)
    block_m = heads * rows
    row_blocks = min(_runtime.cdiv(max_seqlen_q, rows), MAX_ROW_BLOCKS)
    PK.prefill_attention_kernel[(B + 1, row_blocks, Hq // heads)](
        q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, out, lse if lse is not None else out,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        sm_scale * _LOG2E * k_scale_f, v_scale_f, T, B, k_cache.shape[0], page_table.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        GROUP=Hq // Hkv, D=D, PAGE=P, BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        K_SCALE_T=k_scale is not None, V_SCALE_T=v_scale is not None, HAS_LSE=lse is not None,
        DOT_F32=_runtime.dot_needs_fp32(), SPLIT=SPLIT_LOOP, HEADS=heads,
        num_warps=8 if block_m >= 64 else 4, num_stages=2,
    )


def _check_prefill_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): the call's tensors as :func:`prefill_attention` checks them."""
    T, Hq, Hkv, D, B = _check(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["page_table"],
                              a["seq_lens"], a["max_seqlen_q"])
    dev = a["q"].device
    check_out("out", a["out"], [T, Hq, D], torch.bfloat16, dev)
    if a["lse"] is not None:
        check_out("lse", a["lse"], [T, Hq], torch.float32, dev)
    for name in ("k_scale", "v_scale"):
        if a[name] is not None:
            _scale_arg(name, a[name], dev)
    for name in ("k_scale_f", "v_scale_f", "sm_scale"):
        check_scaling(name, a[name], positive=True)


_prefill_op = torch.library.custom_op("evenflow::prefill_attention", mutates_args=("out", "lse"))(
    checked_op(_prefill_launch, _check_prefill_op))


@_prefill_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, out, lse, k_scale, v_scale, k_scale_f, v_scale_f,
      sm_scale, max_seqlen_q):
    return None


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, max_seqlen_q: int, *, k_scale=None,
                      v_scale=None, sm_scale: float | None = None, out=None, return_lse: bool = False, lse=None,
                      check_inputs: bool = False):
    """Causal attention of each request's new tokens over its paged KV cache (shapes in the module docstring).

    Returns ``out`` (bf16), or ``(out, lse)`` when ``return_lse``. ``check_inputs``: also check ``cu_seqlens_q``,
    ``seq_lens``, the page ids in use and scales given as tensors on the host (a sync; ValueError naming the first
    bad entry)."""
    T, Hq, Hkv, D, B = _check(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, max_seqlen_q)
    dev = q.device
    ks_t, ks_f = _scale_arg("k_scale", k_scale, dev)
    vs_t, vs_f = _scale_arg("v_scale", v_scale, dev)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else check_scaling("sm_scale", sm_scale, positive=True)
    check_score_scale(sm_scale, ks_f)
    check_bool("return_lse", return_lse)
    check_bool("check_inputs", check_inputs)
    if lse is not None and not return_lse:
        raise ValueError("lse is given but return_lse is False: pass return_lse=True to have it filled")
    if out is None:
        out = torch.empty(T, Hq, D, dtype=torch.bfloat16, device=dev)
    else:
        check_out("out", out, [T, Hq, D], torch.bfloat16, dev)
        # the kernels read these while they write out (round CP's review: an out over the cache was taken)
        check_no_overlap("out", out, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens,
                         cu_seqlens_q=cu_seqlens_q)
    if return_lse:
        if lse is None:
            lse = torch.empty(T, Hq, dtype=torch.float32, device=dev)
        else:
            check_out("lse", lse, [T, Hq], torch.float32, dev)
            check_no_overlap("lse", lse, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                             seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, out=out)
    if check_inputs and _runtime.host_sync_allowed(seq_lens):
        _check_values(k_cache, cu_seqlens_q, page_table, seq_lens, T)
        check_scale_tensors(ks_t, vs_t, sm_scale)
    op = _prefill_op if torch.compiler.is_compiling() else _prefill_launch
    op(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, out, lse, ks_t, vs_t, ks_f, vs_f, float(sm_scale),
       max_seqlen_q)
    return (out, lse) if return_lse else out


def prefill_work(new_tokens, seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 kv_bytes: int) -> tuple[int, int]:
    """(bytes, FLOPs) a call must move and do, the floor's terms: q read and the output written (bf16), each
    request's K and V read once (``kv_bytes`` an element), and 4 * D FLOPs per visible (row, key) pair and q head
    (row i of a request of n new rows and L tokens sees L - n + i + 1 keys). ``new_tokens`` and ``seq_lens``: per
    request, Python ints (host-side; benchmarks and the demo)."""
    byt, pairs = 0, 0
    for n, L in zip(new_tokens, seq_lens):
        byt += 2 * n * num_q_heads * head_dim * 2 + 2 * L * num_kv_heads * head_dim * kv_bytes
        pairs += n * (L - n) + n * (n + 1) // 2
    return byt, 4 * head_dim * num_q_heads * pairs


def validate_prefill_inputs(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens) -> None:
    """The checks of ``prefill_attention(..., check_inputs=True)`` alone (one host sync): ``cu_seqlens_q`` starts at
    0, never decreases and ends at most at q's rows; each length holds its request's new rows and fits the page
    table; each page id in use is inside the cache. ValueError names the first bad entry."""
    T, *_ = _check(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, 1)
    _check_values(k_cache, cu_seqlens_q, page_table, seq_lens, T)


def _check_values(k_cache, cu_seqlens_q, page_table, seq_lens, T: int) -> None:
    cu = check_cu_seqlens_values(cu_seqlens_q, T, "q")
    n = cu[1:] - cu[:-1]
    lens = seq_lens.long().cpu()
    P = k_cache.shape[1]
    cap = page_table.shape[1] * P
    bad = ((lens < n) | (lens > cap)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} outside [{int(n[b])}, {cap}] (its new tokens, and the "
                         "page table columns * page size)")
    cols = torch.arange(page_table.shape[1])
    used = cols[None, :] < ((lens + P - 1) // P)[:, None]
    pt = page_table.cpu()
    bad_page = used & ((pt < 0) | (pt >= k_cache.shape[0]))
    if bad_page.any():
        b, c = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(f"page_table[{b}, {c}] = {int(pt[b, c])} outside [0, {k_cache.shape[0]}) for a page in use")
