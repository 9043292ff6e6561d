"""Plain PyTorch oracles of decode attention and of its plan (deliberately simple loops)."""
from __future__ import annotations

import math

import torch

from evenflow._checks import check_sixteenths
from evenflow.reference.moe import fast_mm

TILE = 64
POOL_SLACK = 0.25  # shuffled page pools hold 25% more pages than the requests use


def shuffled_page_tables(lengths, page_size: int, rotations: int = 1, generator: torch.Generator | None = None,
                         slack: float = POOL_SLACK) -> tuple[torch.Tensor, int]:
    """Page tables ``[rotations, B, max_pages]`` int32 drawn from one shuffled pool; returns (tables, pool_pages).

    The pool holds ``ceil(used * (1 + slack))`` pages; a random permutation of all of them
    is dealt out in order, so every live entry of every rotation is a distinct page,
    pages are in random order, and some pages are never used. Entries past a request's
    last page are 0 (a valid page id: a kernel that wrongly reads them reads real data
    rather than faulting, and the output check catches it). Tests, demos and benchmarks
    all lay out their caches this way.
    """
    if page_size <= 0 or rotations <= 0:
        raise ValueError(f"page_size and rotations must be positive, got {page_size}, {rotations}")
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths must be a non-empty list of non-negative ints, got {lengths}")
    n_pages = [(n + page_size - 1) // page_size for n in lengths]
    max_pages = max(1, max(n_pages))
    used = sum(n_pages) * rotations
    pool = max(1, math.ceil(used * (1.0 + slack)))
    perm = torch.randperm(pool, generator=generator, dtype=torch.int64)
    tables = torch.zeros(rotations, len(lengths), max_pages, dtype=torch.int32)
    at = 0
    for r in range(rotations):
        for b, n in enumerate(n_pages):
            tables[r, b, :n] = perm[at:at + n].to(torch.int32)
            at += n
    return tables, pool


def dequant(x: torch.Tensor, scale) -> torch.Tensor:
    """fp64 values of a bf16/fp8 tensor times a per-tensor (float/tensor) or broadcast scale."""
    s = scale if scale is not None else 1.0
    if isinstance(s, torch.Tensor):
        s = s.double().cpu()
    return x.double().cpu() * s


def _dims(q, k_cache, seq_lens, q_len):
    """(B, q_len, Hq, D, page size, Hkv, group) of a decode call (q_len inferred when None)."""
    B = seq_lens.shape[0]
    if q_len is None:
        q_len = q.shape[0] // B
    _, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    return B, q_len, Hq, D, P, Hkv, Hq // Hkv


def decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, q_scale=None, k_scale=None, v_scale=None,
                         sm_scale=None, q_len=None, dtype=torch.float64, p_dtype=None, out_dtype=None):
    """Decode attention, one request at a time, gathering pages through the page table.

    Computes in ``dtype`` (float64 for the oracle). With ``p_dtype`` (e.g. bf16) the
    unnormalised probabilities are rounded to it before the product with V, and with
    ``out_dtype`` the result is rounded to it: that is the same-precision baseline of the
    tolerance rule (bf16 inputs, fp32 math, bf16 P and output, as the kernel does).
    Returns (out [B*q_len, Hq, D], lse [B*q_len, Hq]) with natural-log LSE, -inf and zero
    output for rows that see no token.
    """
    B, q_len, Hq, D, P, Hkv, G = _dims(q, k_cache, seq_lens, q_len)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    qd = q.double().cpu()
    if q_scale is not None:
        qd = qd * q_scale.double().cpu()[:, :, None]
    kd, vd = dequant(k_cache, k_scale), dequant(v_cache, v_scale)
    qd, kd, vd = qd.to(dtype), kd.to(dtype), vd.to(dtype)
    pt, lens = page_table.cpu().long(), seq_lens.cpu().long()
    out = torch.zeros(B * q_len, Hq, D, dtype=dtype)
    lse = torch.full((B * q_len, Hq), float("-inf"), dtype=dtype)
    for b in range(B):
        L = int(lens[b])
        if L <= 0:
            continue
        tok = torch.arange(L)
        pages = pt[b, tok // P]
        k = kd[pages, tok % P]  # [L, Hkv, D]
        v = vd[pages, tok % P]
        for r in range(q_len):
            vis = L - q_len + r + 1
            if vis <= 0:
                continue
            row = b * q_len + r
            for hq in range(Hq):
                h = hq // G
                s = (k[:vis, h] @ qd[row, hq]) * sm_scale
                m = s.max()
                p = torch.exp(s - m)
                den = p.sum()
                if p_dtype is not None:
                    p = p.to(p_dtype).to(dtype)
                out[row, hq] = (p @ v[:vis, h]) / den
                lse[row, hq] = m + torch.log(den)
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out, lse


def pack_quanta(shortest: int, raw_budget: int) -> list[int]:
    """The quanta a ``pack_short`` plan prices (``build_plan_ref``): for k = 1..8 items of the shortest length a
    bin, ``max(shortest, ceil(raw_budget / k))`` and the next 3 integers; none where the shortest item does not fit
    in the raw budget."""
    if not 0 < shortest <= raw_budget:
        return []
    return sorted({max(shortest, -(-raw_budget // k)) + j for k in range(1, 9) for j in range(4)})


def build_plan_ref(seq_lens, num_kv_heads: int, num_programs: int, min_tiles: int, max_seq_len: int,
                   align_items: bool = True, item_cost: int = 2, align_longer: bool | None = None,
                   item_cost_max_tiles: int | None = 4, align_growth: float = 1.25,
                   align_longer_growth: float = 1.0625, pack_short: bool = True):
    """The length-balanced schedule, built the slow obvious way.

    Items (b, h) request-outer; each item holds ceil(len / 64) tiles, plus ``item_cost``
    work units when it is non-empty and has at most ``item_cost_max_tiles`` tiles (``None``:
    any) (counted as tiles below; the defaults are DecodePlan's); bins of
    ``budget = max(ceil(total / num_programs), min_tiles)`` tiles are filled in order;
    with ``align_items`` the budget is first rounded up to a multiple of the shortest
    non-empty item's tiles, when that item fits in it and the rounding grows it by at most
    ``align_growth`` (the plan's default 1.25);
    with ``align_longer`` too, when that item is longer than the budget, it is raised to the
    item's tiles over ``n = item // budget`` (the item cut in ``n`` equal chunks) where ``n``
    divides it and that grows the budget by at most ``align_longer_growth`` (the plan's default 17/16)
    (``n = 1``: the item itself) (``None``: as ``align_items``, the plan's default).
    ``pack_short`` (``DecodePlan(pack_short=)``, on by default as there): where the shortest non-empty item's
    units ``s0`` fit in the raw budget ``b0 = max(ceil(total / num_programs), min_tiles)``, each quantum ``s`` in
    ``pack_quanta(s0, b0)`` is priced: every item's units rounded up to a multiple of ``s`` (the added units carry no
    tokens, as the item cost's), the budget the least multiple of ``s`` that holds the padded total in
    ``num_programs`` bins and is at least ``min_tiles``. The least such budget (the smaller ``s`` on a tie) replaces
    the rules above where it is at most 15/16 of theirs and its padded total stays within int32 tile indices (a plan
    of 2^30 units or more, or a raw budget as large, is not priced): then every item starts on a multiple of ``s``
    and the bins end on one, so no item of ``s`` units or fewer is cut.
    Returns the plan tensors (as ``DecodePlan.as_dict``) and the explicit bins: for each
    program a list of (item, first_tile, end_tile) chunks (empty items included where
    the bin that reaches them lists them).
    """
    if align_longer is None:
        align_longer = align_items
    check_sixteenths("align_growth", align_growth, 1.0, 2.0)  # DecodePlan's range
    grow_longer16 = check_sixteenths("align_longer_growth", align_longer_growth, 1.0, 2.0)
    lens = [min(max(int(x), 0), max_seq_len) for x in seq_lens.cpu().tolist()]
    B = len(lens)
    short = (lambda n: True) if item_cost_max_tiles is None else (lambda n: n <= item_cost_max_tiles)
    tiles = [-(-L // TILE) + (item_cost if L > 0 and short(-(-L // TILE)) else 0) for L in lens]
    items = [(b, h) for b in range(B) for h in range(num_kv_heads)]
    total = sum(tiles[b] for b, _ in items)
    budget = raw = max(-(-total // num_programs), min_tiles)
    nonzero = [n for n in tiles if n > 0]
    if align_items and nonzero:
        shortest = min(nonzero)
        if shortest <= budget:
            aligned = -(-budget // shortest) * shortest
            if aligned <= align_growth * budget:
                budget = aligned
        elif align_longer:
            n = shortest // budget
            if shortest % n == 0 and 16 * (shortest // n) <= grow_longer16 * budget:
                budget = shortest // n
    quantum = 1
    if pack_short and nonzero and total < 2**30 and raw < 2**30:
        best = None
        for s in pack_quanta(min(nonzero), raw):
            padded = num_kv_heads * sum(-(-n // s) * s for n in tiles)
            b = -(-max(-(-padded // num_programs), min_tiles) // s) * s
            if padded + num_programs * (b + 1) < 2**31 and (best is None or (b, s) < best[:2]):
                best = (b, s, padded)
        if best is not None and 16 * best[0] <= 15 * budget:
            budget, quantum, total = best
            tiles = [-(-n // quantum) * quantum for n in tiles]
    used = -(-total // budget)
    bins: list[list[tuple[int, int, int]]] = [[] for _ in range(num_programs)]
    p, room = 0, budget
    for i, (b, _) in enumerate(items):
        n, t = tiles[b], 0
        if n == 0:
            # an empty item on a bin edge belongs to the bin that ends there
            bins[p - 1 if (room == budget and p > 0) else p].append((i, 0, 0))
            continue
        while t < n:
            take = min(room, n - t)
            bins[p].append((i, t, t + take))
            t += take
            room -= take
            if room == 0:
                p, room = p + 1, budget
    req_end, acc = [], 0
    for n in tiles:
        acc += n * num_kv_heads
        req_end.append(acc)
    prog_start = []
    for q in range(num_programs + 1):
        if q == 0:
            prog_start.append(0)
            continue
        x = q * budget
        first = next((i for i, (b, h) in enumerate(items) if req_end[b] - (num_kv_heads - h - 1) * tiles[b] > x),
                     len(items))
        prog_start.append(first)
    bad = int(any(int(x) < 0 or int(x) > max_seq_len for x in seq_lens.cpu().tolist()))
    i32 = dict(dtype=torch.int32)
    plan = {"tiles": torch.tensor(tiles, **i32), "req_end": torch.tensor(req_end, **i32),
            "prog_start": torch.tensor(prog_start, **i32),
            "meta": torch.tensor([total, budget, used, bad, item_cost, quantum], **i32)}
    return plan, bins


def decode_attention_ref_batched(q, k_cache, v_cache, page_table, seq_lens, q_scale=None, k_scale=None,
                                 v_scale=None, sm_scale=None, q_len=None, dtype=torch.float64, p_dtype=None,
                                 out_dtype=None, fp8_scores=False):
    """Same math as :func:`decode_attention_ref`, looping over requests only and staying on
    the inputs' device (for real shapes on a GPU). Tests check it against the simple one.

    ``fp8_scores``: the scores of an e4m3 q and cache as PyTorch's fp8 GEMM with fast accumulation computes them
    on the tensor cores (:func:`evenflow.reference.moe.fast_mm`), then scaled in ``dtype``: the same-precision
    baseline of a kernel whose scores are an fp8 MMA's (the Gluon kernel's warpgroup form, which ``wgmma``
    accumulates the same way); on a CPU the products are exact and summed in fp32."""
    B, q_len, Hq, D, P, Hkv, G = _dims(q, k_cache, seq_lens, q_len)
    dev = q.device
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if fp8_scores and not q.dtype == k_cache.dtype == torch.float8_e4m3fn:
        raise ValueError(f"fp8_scores needs an e4m3 q and cache, got q {q.dtype}, cache {k_cache.dtype}")

    def scale(x, s):
        x = x.to(dtype)
        if s is None:
            return x
        return x * (s.to(dev, dtype) if isinstance(s, torch.Tensor) else s)

    qd = q.to(dtype)
    if q_scale is not None:
        qd = qd * q_scale.to(dtype)[:, :, None]
    out = torch.zeros(B * q_len, Hq, D, dtype=dtype, device=dev)
    lse = torch.full((B * q_len, Hq), float("-inf"), dtype=dtype, device=dev)
    lens = seq_lens.cpu().tolist()
    for b in range(B):
        L = int(lens[b])
        if L <= 0:
            continue
        tok = torch.arange(L, device=dev)
        pages = page_table[b].long()[tok // P]
        v = scale(v_cache[pages, tok % P], v_scale)  # [L, Hkv, D]
        if fp8_scores:  # the e4m3 values' products by the fp8 GEMM, then q's, k's and the softmax scales
            q8 = q[b * q_len:(b + 1) * q_len].view(q_len, Hkv, G, D)
            k8 = k_cache[pages, tok % P]
            s = torch.stack([fast_mm(q8[:, h].reshape(q_len * G, D), k8[:, h]).view(q_len, G, L)
                             for h in range(Hkv)], 1).to(dtype)
            qs = 1.0 if q_scale is None else q_scale[b * q_len:(b + 1) * q_len].to(dtype).view(q_len, Hkv, G, 1)
            s = scale(s * qs, k_scale) * sm_scale
        else:
            rows = qd[b * q_len:(b + 1) * q_len].view(q_len, Hkv, G, D)
            s = torch.einsum("rhgd,lhd->rhgl", rows, scale(k_cache[pages, tok % P], k_scale)) * sm_scale
        o, row_lse = _causal_softmax_pv(s, v, L - q_len + torch.arange(q_len, device=dev) + 1, p_dtype)
        out[b * q_len:(b + 1) * q_len] = o.reshape(q_len, Hq, D)
        lse[b * q_len:(b + 1) * q_len] = row_lse.reshape(q_len, Hq)
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out, lse


def _causal_softmax_pv(s, v, vis, p_dtype):
    """Rows of scores ``s`` [rows, Hkv, G, L] over one request's keys, row r seeing keys [0, vis[r]): (output
    [rows, Hkv, G, D] = softmax(s) @ v, natural-log LSE [rows, Hkv, G]); a row that sees no key gives zeros and
    -inf. ``p_dtype``: the unnormalised probabilities rounded to it before the product with ``v`` [L, Hkv, D]."""
    tok = torch.arange(s.shape[-1], device=s.device)
    s = s.masked_fill(tok[None, None, None, :] >= vis[:, None, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    if p_dtype is not None:
        p = p.to(p_dtype).to(s.dtype)
    o = torch.einsum("rhgl,lhd->rhgd", p, v) / torch.where(den > 0, den, torch.ones_like(den))
    return o, torch.where(den > 0, m + torch.log(den), float("-inf"))[..., 0]


def prefill_attention_ref(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, k_scale=None, v_scale=None,
                          sm_scale=None, dtype=torch.float64, p_dtype=None, out_dtype=None):
    """Causal attention of each request's new tokens over its cached prefix and themselves, one request at a time.

    Request b's rows are ``q[cu[b]:cu[b + 1]]``, its newest tokens: with L = seq_lens[b] (cached tokens, new ones
    included) and n new rows, row i sees keys [0, L - n + i + 1). Rows past cu[B] (padding) and rows that see no key
    get zeros and LSE -inf. ``dtype`` / ``p_dtype`` / ``out_dtype`` as in :func:`decode_attention_ref` (the oracle in
    fp64; the rule's baseline in fp32 with P and the output rounded to bf16). Stays on the inputs' device. Returns
    (out [T, Hq, D], lse [T, Hq]) with natural-log LSE."""
    T, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    dev = q.device
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)

    def scale(x, s):
        x = x.to(dtype)
        if s is None:
            return x
        return x * (s.to(dev, dtype) if isinstance(s, torch.Tensor) else s)

    out = torch.zeros(T, Hq, D, dtype=dtype, device=dev)
    lse = torch.full((T, Hq), float("-inf"), dtype=dtype, device=dev)
    cu = cu_seqlens_q.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    for b in range(len(lens)):
        n, L = cu[b + 1] - cu[b], int(lens[b])
        if n <= 0 or L <= 0:
            continue
        tok = torch.arange(L, device=dev)
        pages = page_table[b].long()[tok // P]
        k = scale(k_cache[pages, tok % P], k_scale)  # [L, Hkv, D]
        v = scale(v_cache[pages, tok % P], v_scale)
        rows = q[cu[b]:cu[b + 1]].to(dtype).view(n, Hkv, G, D)
        s = torch.einsum("rhgd,lhd->rhgl", rows, k) * sm_scale
        o, row_lse = _causal_softmax_pv(s, v, L - n + torch.arange(n, device=dev) + 1, p_dtype)
        out[cu[b]:cu[b + 1]] = o.reshape(n, Hq, D)
        lse[cu[b]:cu[b + 1]] = row_lse.reshape(n, Hq)
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out, lse


def prefill_rows_ref(q, k_cache, v_cache, cu_seqlens_q, page_table, seq_lens, rows, **kw):
    """:func:`prefill_attention_ref` of some rows only (``rows``: indices into q), each computed as the one-row
    request it is (its own length: its position + 1), so no request's whole score matrix is ever held; for checks at
    real prefill sizes. ``kw`` as :func:`prefill_attention_ref`. Returns (out [len(rows), Hq, D], lse)."""
    cu, lens = cu_seqlens_q.cpu().tolist(), seq_lens.cpu().tolist()
    owner, own_len = [], []
    for r in (int(x) for x in rows):
        b = next(b for b in range(len(lens)) if cu[b] <= r < cu[b + 1])
        owner.append(b)
        own_len.append(lens[b] - (cu[b + 1] - cu[b]) + (r - cu[b]) + 1)
    dev = q.device
    idx = torch.as_tensor(list(rows), device=dev)
    return prefill_attention_ref(q[idx], k_cache, v_cache, torch.arange(len(owner) + 1, dtype=torch.int32),
                                 page_table[torch.tensor(owner, device=dev)], torch.tensor(own_len, dtype=torch.int32),
                                 **kw)


def random_kv_caches(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, kv_dtype=torch.bfloat16,
                     hnd: bool = False, generator: torch.Generator | None = None, device=None):
    """Random paged K / V caches as the attention tests fill them: K ~ N(0, 1.5^2), V ~ N(0, 1) (fp8: scaled by 30
    and 40 and saturated, to be read back with scales 1/30 and 1/40); ``hnd``: stored [pages, Hkv, P, D] and returned
    as their NHD views."""
    shape = (num_pages, num_kv_heads, page_size, head_dim) if hnd else (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator, device=device) * 1.5
    v = torch.randn(shape, generator=generator, device=device)
    if kv_dtype == torch.float8_e4m3fn:
        k, v = (k * 30).clamp(-448, 448).to(kv_dtype), (v * 40).clamp(-448, 448).to(kv_dtype)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    if hnd:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v
