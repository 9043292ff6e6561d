"""DecodePlan: the device-built map equals the plain PyTorch builder exactly, and has the
properties the attention and combine kernels rely on (every tile once, budgets, slots)."""
import pytest
import torch

import evenflow
from evenflow.attention.plan import DEFAULT_ALIGN_GROWTH, DEFAULT_ALIGN_LONGER_GROWTH
from evenflow.reference.attention import build_plan_ref
from evenflow.testing import assert_exact

TILE = 64


def walk(plan_d, num_kv_heads, num_programs):
    """Replay the attention kernel's bin walk from the plan tensors (host, plain Python)."""
    tiles, req_end, prog_start = (plan_d[k].tolist() for k in ("tiles", "req_end", "prog_start"))
    total, budget = plan_d["meta"][0].item(), plan_d["meta"][1].item()
    n_items = len(tiles) * num_kv_heads
    bins = []
    for p in range(num_programs):
        g0, g1 = p * budget, min(p * budget + budget, total)
        i, chunks = prog_start[p], []
        while i < n_items:
            b, h = divmod(i, num_kv_heads)
            n = tiles[b]
            start = req_end[b] - (num_kv_heads - h) * n
            if not (start < g1 or (start == g1 and n == 0)):
                break
            chunks.append((i, max(start, g0) - start, min(start + n, g1) - start))
            i += 1
        bins.append(chunks)
    return bins


def make_plan(device, lens, hkv, np_, min_tiles, max_seq_len=1 << 20, align=True, item_cost=0, align_longer=False,
              cost_max=None, growth=DEFAULT_ALIGN_GROWTH, longer_growth=DEFAULT_ALIGN_LONGER_GROWTH, pack=False):
    """A plan of the alignment rules alone (``pack``: with ``pack_short``, on by default, tested on its own below)."""
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = evenflow.DecodePlan(max(len(lens), 1), max_seq_len, hkv, device=device, num_programs=np_,
                               min_tiles=min_tiles, align_items=align, item_cost=item_cost,
                               align_longer=align_longer, item_cost_max_tiles=cost_max,
                               align_growth=growth, align_longer_growth=longer_growth, pack_short=pack).update(sl)
    return plan, sl


def units(lens, item_cost=0, cost_max=None):
    """Work units per item of each request: its tiles, plus item_cost when non-empty and (with
    cost_max) of at most cost_max tiles."""
    return [-(-L // TILE) + (item_cost if L > 0 and (cost_max is None or -(-L // TILE) <= cost_max) else 0)
            for L in lens]


CASES = {
    # name: (lens, kv heads, programs, min_tiles) -- why
    "skewed": ([8192, 512, 512, 100, 64, 65, 1], 2, 6, 2),        # one long request spills over bins
    "uniform": ([256] * 8, 2, 4, 1),                               # bins cut on item edges exactly
    "zeros_between": ([0, 130, 0, 0, 640, 0], 3, 5, 1),            # empty items on and inside bin edges
    "all_zero": ([0, 0, 0], 2, 4, 8),                              # nothing to do: every item still finished
    "floor_wins": ([64, 64, 128], 1, 8, 8),                        # tiny batch: min_tiles caps the split
    "tile_edges": ([63, 64, 65, 127, 128, 129], 1, 3, 1),          # lengths one past a tile boundary
    "one_request": ([5000], 4, 7, 1),                              # single long request across all bins
    "short_items": ([130] * 6 + [1000], 2, 10, 1),                  # 3-tile items: budget 7 (9 aligned at growth 1.5)
    "slightly_long_items": ([2048] * 8, 2, 17, 1),                 # 32-tile items, budget 31 -> 32 (align_longer)
    "too_long_to_round": ([2048] * 8, 2, 18, 1),                   # budget 29: 32 > 29 * 17/16, no rounding
}


def expected_budget(lens, hkv, np_, mt, align, item_cost=0, align_longer=False, cost_max=None,
                    growth=DEFAULT_ALIGN_GROWTH, longer_growth=DEFAULT_ALIGN_LONGER_GROWTH):
    # the rule, restated: ceil(total / programs) floored at min_tiles; aligned to whole
    # shortest items when that item fits and the rounding grows it by at most `growth`; with
    # align_longer, raised to a shortest item longer than it cut in as many equal chunks as
    # whole budgets fit in it, when they divide it and that grows the budget by at most `longer_growth`
    tiles = units(lens, item_cost, cost_max)
    b0 = max(-(-hkv * sum(tiles) // np_), mt)
    q = min([n for n in tiles if n > 0], default=0)
    if align and 0 < q <= b0 and 16 * (-(-b0 // q) * q) <= int(growth * 16) * b0:
        return -(-b0 // q) * q
    if align and align_longer and b0 < q:
        n = q // b0
        if q % n == 0 and 16 * (q // n) <= int(longer_growth * 16) * b0:
            return q // n
    return b0


# align modes: (align_items, align_longer)
ALIGNS = pytest.mark.parametrize("align,longer", [(True, False), (False, False), (True, True)],
                                 ids=["aligned", "plain", "aligned-longer"])


# item cost: none, on every non-empty item, on items of at most 2 tiles
COSTS = pytest.mark.parametrize("item_cost,cost_max", [(0, None), (2, None), (2, 2)],
                                ids=["tiles", "item_cost2", "item_cost2-short"])


@COSTS
@ALIGNS
@pytest.mark.parametrize("name", list(CASES))
def test_device_plan_equals_reference(name, align, longer, item_cost, cost_max, device):
    lens, hkv, np_, mt = CASES[name]
    plan, sl = make_plan(device, lens, hkv, np_, mt, align=align, item_cost=item_cost, align_longer=longer,
                         cost_max=cost_max)
    ref, _ = build_plan_ref(sl, hkv, np_, mt, plan.max_seq_len,
                            pack_short=False, align_items=align, item_cost=item_cost,
                            align_longer=longer, item_cost_max_tiles=cost_max)
    got = plan.as_dict()
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(got[key], ref[key], what=f"{name}: {key}")


@COSTS
@ALIGNS
@pytest.mark.parametrize("name", list(CASES))
def test_plan_properties(name, align, longer, item_cost, cost_max, device):
    lens, hkv, np_, mt = CASES[name]
    plan, sl = make_plan(device, lens, hkv, np_, mt, align=align, item_cost=item_cost, align_longer=longer,
                         cost_max=cost_max)
    d = plan.as_dict()
    total, budget, used = d["meta"][:3].tolist()
    assert d["meta"][4].item() == item_cost
    tiles = units(lens, item_cost, cost_max)
    assert total == hkv * sum(tiles)
    assert budget == expected_budget(lens, hkv, np_, mt, align, item_cost, longer, cost_max)
    assert used == -(-total // budget) and used <= np_
    bins = walk(d, hkv, np_)
    _, ref_bins = build_plan_ref(sl, hkv, np_, mt, plan.max_seq_len,
                                 pack_short=False, align_items=align, item_cost=item_cost,
                                 align_longer=longer, item_cost_max_tiles=cost_max)
    assert bins == ref_bins, "the kernel's walk of the device plan differs from the reference bins"
    # every tile of every item exactly once; every item (empty ones too) finished once
    seen = {}
    for p, chunks in enumerate(bins):
        assert sum(t1 - t0 for _, t0, t1 in chunks) <= budget
        for i, t0, t1 in chunks:
            for t in range(t0, t1):
                key = (i, t)
                assert key not in seen, f"tile {key} in bins {seen[key]} and {p}"
                seen[key] = p
    want = {(b * hkv + h, t) for b, n in enumerate(tiles) for h in range(hkv) for t in range(n)}
    assert set(seen) == want
    # the token tiles the kernel reads from those units (unit u is tile u; the units past an
    # item's last tile hold no tokens): every tile of every item exactly once
    real = [(i, t) for p, chunks in enumerate(bins) for i, t0, t1 in chunks for t in range(t0, t1)
            if t < -(-lens[i // hkv] // TILE)]
    assert sorted(real) == sorted((b * hkv + h, t) for b, L in enumerate(lens) for h in range(hkv)
                                  for t in range(-(-L // TILE)))
    visits = [i for chunks in bins for i, t0, t1 in chunks if t0 == t1 == 0]
    empties = [b * hkv + h for b, n in enumerate(tiles) if n == 0 for h in range(hkv)]
    assert sorted(visits) == empties
    # partial slots: split chunks are 2p+1 (item starts in p) or 2p; unique and < 2 * NP
    slots = {}
    for p, chunks in enumerate(bins):
        for i, t0, t1 in chunks:
            n = tiles[i // hkv]
            if t0 == 0 and t1 == n:
                continue  # finished in place
            slot = 2 * p + (1 if t0 == 0 else 0)
            assert slot not in slots and slot < 2 * np_
            slots[slot] = i
    # the chunk count the combine derives equals the number of bins holding the item
    for i in set(slots.values()):
        holders = [p for p, chunks in enumerate(bins) if any(c[0] == i for c in chunks)]
        b, h = divmod(i, hkv)
        start = d["req_end"][b].item() - (hkv - h) * tiles[b]
        assert (start + tiles[b] - 1) // budget - start // budget + 1 == len(holders)
        assert holders == list(range(holders[0], holders[-1] + 1))


def test_align_items_keeps_short_items_whole(device):
    lens, hkv, np_, mt = CASES["short_items"]
    budgets, cut = {}, {}
    for align in (True, False):
        # 7 -> 9 is a growth of 1.29: over the default bound (1.25), under 1.5
        plan, _ = make_plan(device, lens, hkv, np_, mt, align=align, growth=1.5)
        budgets[align] = plan.as_dict()["meta"][1].item()
        bins = walk(plan.as_dict(), hkv, np_)
        cut[align] = sum(1 for chunks in bins for i, t0, t1 in chunks if i < 12 and (t0, t1) != (0, 3))
    assert (budgets[True], budgets[False]) == (9, 7)
    assert cut[True] == 0 < cut[False], "aligned bins hold the 3-tile items whole"
    assert make_plan(device, lens, hkv, np_, mt)[0].as_dict()["meta"][1].item() == 7


@pytest.mark.parametrize("lens,np_,budgets", [
    ([4096] * 32, 264, (63, 64)),                 # 32x4K on 132 SMs x 2: every item cut in two, or none
    ([65536] + [4096] * 15, 264, (61, 64)),       # 1x64K+15x4K: the 4K items whole when raised
    ([4096] * 32, 280, (59, 59)),                 # 64 > 59 * 17/16: left alone
])
def test_align_longer_keeps_slightly_long_items_whole(lens, np_, budgets, device):
    """With align_longer the budget rises to a shortest item at most 1/16 longer than it,
    so those items are no longer cut; a bigger gap keeps the plain budget."""
    hkv = 8
    got = {}
    for longer in (False, True):
        plan, _ = make_plan(device, lens, hkv, np_, 8, align_longer=longer)
        got[longer] = plan.as_dict()["meta"][1].item()
        bins = walk(plan.as_dict(), hkv, np_)
        cut = sum(1 for chunks in bins for i, t0, t1 in chunks if lens[i // hkv] == 4096 and (t0, t1) != (0, 64))
        if longer and budgets[1] > budgets[0]:
            assert cut == 0, "raised budget: every 4K item whole in one bin"
        elif budgets[1] > budgets[0]:
            assert cut > 0
    assert (got[False], got[True]) == budgets


@pytest.mark.parametrize("lens,np_,budgets", [
    ([32768] * 8, 528, (63, 64)),                  # 8x32K at 132 SMs x 4: 512-tile items in 8 chunks of 64
    ([32768] * 8, 264, (125, 128)),                # the same at 2 an SM: 4 chunks of 128
    ([65536] + [4096] * 15, 528, (31, 32)),        # 1x64K+15x4K at 4 an SM: the 4K items in halves
    ([32768] * 8, 600, (55, 55)),                  # 512 // 55 = 9 does not divide 512: left alone
    ([32768] * 8, 300, (110, 110)),                # 4 chunks of 128 > 110 * 17/16: left alone
])
def test_align_longer_cuts_every_heads_item_at_the_same_tiles(lens, np_, budgets, device):
    """Round AC: where the shortest item is several budgets long, align_longer raises the budget
    to that item over n = item // budget chunks if n divides it and that is at most 1/16 more; then
    uniform items are cut at the same tiles for every head (and every item of 8x32K is one fused
    merge group of 8 chunks at 4 programs an SM), where the plain budget's cuts drift."""
    hkv = 8
    got = {}
    for longer in (False, True):
        plan, sl = make_plan(device, lens, hkv, np_, 8, align_longer=longer)
        d = plan.as_dict()
        got[longer] = d["meta"][1].item()
        assert got[longer] == expected_budget(lens, hkv, np_, 8, True, align_longer=longer)
        bins = walk(d, hkv, np_)
        assert bins == build_plan_ref(sl, hkv, np_, 8, plan.max_seq_len,
                                      pack_short=False, align_longer=longer, item_cost=0)[1]
        shortest = -(-min(lens) // TILE)
        cuts = {}  # per item of the shortest length: its chunks' (first, end) tiles
        for chunks in bins:
            for i, t0, t1 in chunks:
                if -(-lens[i // hkv] // TILE) == shortest:
                    cuts.setdefault(i, []).append((t0, t1))
        same = len({tuple(c) for c in cuts.values()}) == 1
        if longer and budgets[1] > budgets[0]:
            assert same, "raised budget: every shortest item cut at the same tiles"
            n = shortest // budgets[0]
            assert all(len(c) == n for c in cuts.values())
        elif budgets[1] > budgets[0]:
            assert not same, "the plain budget's cuts drift from item to item"
    assert (got[False], got[True]) == budgets


@pytest.mark.parametrize("lens,hkv,np_,growth,budget,n", [
    # Qwen3-30B-A3B's slice (4 KV heads) at 1x32K+31x2K, 264 programs: ceil(6016 / 264) = 23; a 2K item
    # (32 tiles) is 32 / 23 = 1.39 of it: raised whole from a bound of 1.4375, cut by the plain budget below
    ([32768] + [2048] * 31, 4, 264, 1.5, 32, 1),
    ([32768] + [2048] * 31, 4, 264, 1.4375, 32, 1),
    ([32768] + [2048] * 31, 4, 264, 1.375, 23, 1),
    ([32768] + [2048] * 31, 4, 264, None, 23, 1),
    # 2x32K+30x4K at 4 KV heads, 528 programs: budget 23, the 4K items (64 tiles) in n = 2 chunks of 32
    ([32768] * 2 + [4096] * 30, 4, 528, 1.5, 32, 2),
    ([32768] * 2 + [4096] * 30, 4, 528, None, 23, 2),
    # 2x64K+30x1K at one KV head, 264 programs: budget 10; the 1K items (16 tiles) need a growth of 1.6
    ([65536] * 2 + [1024] * 30, 1, 264, 2.0, 16, 1),
    ([65536] * 2 + [1024] * 30, 1, 264, 1.5, 10, 1),
])
def test_align_longer_growth_bounds_the_raise(lens, hkv, np_, growth, budget, n, device):
    """Round AZ: ``align_longer`` raises the budget to the shortest item over n chunks only within
    ``align_longer_growth`` (default 17/16, the bound fixed before it was a parameter); raised, every
    shortest item is cut in the same n chunks (whole at n = 1), and the device plan is the reference's."""
    if growth is None:  # the default
        assert evenflow.DecodePlan(4, 100, 2, device=device).align_longer_growth == DEFAULT_ALIGN_LONGER_GROWTH
        growth = DEFAULT_ALIGN_LONGER_GROWTH
    assert DEFAULT_ALIGN_LONGER_GROWTH == 17 / 16
    plan, sl = make_plan(device, lens, hkv, np_, 8, align_longer=True, longer_growth=growth)
    d = plan.as_dict()
    assert d["meta"][1].item() == budget == expected_budget(lens, hkv, np_, 8, True, align_longer=True,
                                                            longer_growth=growth)
    assert d["meta"][2].item() == -(-d["meta"][0].item() // budget) <= np_
    ref, ref_bins = build_plan_ref(sl, hkv, np_, 8, plan.max_seq_len, pack_short=False, align_longer=True, item_cost=0,
                                   align_longer_growth=growth)
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(d[key], ref[key], what=f"longer growth {growth}: {key}")
    bins = walk(d, hkv, np_)
    assert bins == ref_bins
    shortest = -(-min(lens) // TILE)
    cuts = {}
    for chunks in bins:
        for i, t0, t1 in chunks:
            if -(-lens[i // hkv] // TILE) == shortest:
                cuts.setdefault(i, []).append((t0, t1))
    assert len(cuts) == hkv * lens.count(min(lens))
    raised = budget * n == shortest
    want = [(k * shortest // n, (k + 1) * shortest // n) for k in range(n)]
    assert all(c == want for c in cuts.values()) == raised, "raised: every shortest item in n equal chunks"


def test_align_longer_growth_default_follows_the_kernel_and_its_programs_an_sm(device):
    """Round AZ: a plan for the Gluon fp8 kernel at 4 programs an SM (8 KV heads, or 2-4 with a bf16 q) takes
    align_longer's bound of 2 by default, every other plan 17/16 (the Triton kernel; the Gluon kernel at 2 an SM: one
    KV head, an fp8 q told at 2-4); a bound given is kept. The default plan's budget is the reference's at its bound:
    2x32K+30x4K at 8 KV heads on 132 SMs (528 programs) 45 -> 64 tiles; on the interpreter's 4 SMs (16 programs) one
    33-tile request, 17 -> 33."""
    from evenflow import _runtime
    from evenflow.attention.plan import GLUON_SHARED_ALIGN_LONGER_GROWTH

    fp8 = torch.float8_e4m3fn
    assert GLUON_SHARED_ALIGN_LONGER_GROWTH == 2.0 and DEFAULT_ALIGN_LONGER_GROWTH == 17 / 16
    sms = _runtime.num_sms(torch.device(device))
    for kw, growth in ((dict(num_kv_heads=8, kv_dtype=fp8), 2.0), (dict(num_kv_heads=4, kv_dtype=fp8), 2.0),
                       (dict(num_kv_heads=2, kv_dtype=fp8, q_dtype=torch.bfloat16), 2.0),
                       (dict(num_kv_heads=4, kv_dtype=fp8, q_dtype=fp8), 17 / 16),
                       (dict(num_kv_heads=1, kv_dtype=fp8), 17 / 16),
                       (dict(num_kv_heads=8, kv_dtype=fp8, num_programs=2 * sms), 17 / 16),
                       (dict(num_kv_heads=8, kv_dtype=fp8, gluon=False), 17 / 16),
                       (dict(num_kv_heads=8), 17 / 16), (dict(num_kv_heads=8, num_programs=4 * sms), 17 / 16),
                       (dict(num_kv_heads=8, kv_dtype=fp8, align_longer_growth=1.0625), 17 / 16),
                       (dict(num_kv_heads=1, align_longer_growth=1.5), 1.5)):
        plan = evenflow.DecodePlan(32, 1 << 16, device=device, **kw)
        assert plan.align_longer_growth == growth, kw
        assert (growth == 2.0) == (plan.takes_gluon and plan.per_sm >= 4 and "align_longer_growth" not in kw), kw
    lens, budgets = (([32768] * 2 + [4096] * 30, (45, 64)) if sms == 132 else ([33 * 64], (17, 33)))
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    for growth, budget in zip((17 / 16, None), budgets):
        plan = evenflow.DecodePlan(32, 1 << 16, 8, device=device, kv_dtype=fp8, align_longer_growth=growth).update(sl)
        assert plan.num_programs == 4 * sms
        d = plan.as_dict()
        assert d["meta"][1].item() == budget == expected_budget(lens, 8, 4 * sms, 8, True, item_cost=2, cost_max=4,
                                                                align_longer=True,
                                                                longer_growth=plan.align_longer_growth)
        ref, _ = build_plan_ref(sl, 8, 4 * sms, 8, plan.max_seq_len, align_longer_growth=plan.align_longer_growth)
        for key in ("tiles", "req_end", "prog_start", "meta"):
            assert_exact(d[key], ref[key], what=f"bound {plan.align_longer_growth}: {key}")


@pytest.mark.parametrize("growth,budget", [(1.5, 128), (1.4375, 128), (1.375, 90), (1.25, 90), (None, 90)])
def test_align_growth_bounds_the_rounding(growth, budget, device):
    """2x32K+30x4K at 264 programs, 8 kv heads: ceil(23552 / 264) = 90 tiles; whole 4K items
    (64 tiles) need 128, a growth of 1.42. A bound of 1.5 (round E's default) rounds up, leaving
    80 programs without a bin; one under 1.42 (the default 1.25 since round O2) keeps 90 and
    cuts the 4K items instead."""
    lens = [32768] * 2 + [4096] * 30
    if growth is None:  # the default
        assert evenflow.DecodePlan(4, 100, 2, device=device).align_growth == DEFAULT_ALIGN_GROWTH == 1.25
        growth = DEFAULT_ALIGN_GROWTH
    plan, sl = make_plan(device, lens, 8, 264, 8, growth=growth)
    meta = plan.as_dict()["meta"]
    assert meta[1].item() == budget == expected_budget(lens, 8, 264, 8, True, growth=growth)
    assert meta[2].item() == -(-23552 // budget)
    ref, _ = build_plan_ref(sl, 8, 264, 8, plan.max_seq_len,
                            pack_short=False, item_cost=0, align_longer=False, align_growth=growth)
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(plan.as_dict()[key], ref[key], what=f"growth {growth}: {key}")


def test_plan_random_sweep(device):
    """Seeded random length mixes (log-uniform, with zeros) against the reference builder."""
    g = torch.Generator().manual_seed(1234)
    for trial in range(12):
        B = int(torch.randint(1, 40, (1,), generator=g))
        hkv = int(torch.randint(1, 5, (1,), generator=g))
        np_ = int(torch.randint(1, 20, (1,), generator=g))
        mt = int(torch.randint(1, 10, (1,), generator=g))
        lens = (2.0 ** (torch.rand(B, generator=g) * 14)).long()
        lens[torch.rand(B, generator=g) < 0.15] = 0
        longer = trial % 3 == 0
        align = trial % 2 == 0 or longer
        cost = trial % 4  # 0..3 units per non-empty item (of at most cost_max tiles)
        cost_max = None if trial % 3 == 1 else int(torch.randint(1, 9, (1,), generator=g))
        growth = (1.5, 1.25, 1.0, 2.0, 1.0625)[trial % 5]
        longer_growth = (1.0625, 1.5, 2.0, 1.0)[trial % 4]
        plan, sl = make_plan(device, lens.tolist(), hkv, np_, mt, align=align, item_cost=cost, align_longer=longer,
                             cost_max=cost_max, growth=growth, longer_growth=longer_growth)
        ref, ref_bins = build_plan_ref(sl, hkv, np_, mt, plan.max_seq_len,
                                       pack_short=False, align_items=align, item_cost=cost,
                                       align_longer=longer, item_cost_max_tiles=cost_max, align_growth=growth,
                                       align_longer_growth=longer_growth)
        assert plan.as_dict()["meta"][1].item() == expected_budget(
            lens.tolist(), hkv, np_, mt, align, cost, longer, cost_max, growth, longer_growth), f"trial {trial}"
        for key in ("tiles", "req_end", "prog_start", "meta"):
            assert_exact(plan.as_dict()[key], ref[key], what=f"trial {trial}: {key}")
        assert walk(plan.as_dict(), hkv, np_) == ref_bins


def _align_longer_plan_matches_reference(device, lens, hkv, np_, trial):
    """The device plan (min_tiles 1, align_longer, no item cost) against the reference builder,
    tensors and bins; its budget, checked against the rule restated; returned."""
    plan, sl = make_plan(device, lens, hkv, np_, 1, align_longer=True)
    ref, ref_bins = build_plan_ref(sl, hkv, np_, 1, plan.max_seq_len, pack_short=False, align_longer=True, item_cost=0)
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(plan.as_dict()[key], ref[key], what=f"trial {trial}: {key}")
    assert walk(plan.as_dict(), hkv, np_) == ref_bins
    budget = plan.as_dict()["meta"][1].item()
    assert budget == expected_budget(lens, hkv, np_, 1, True, align_longer=True)
    return budget


def test_align_longer_random_near_budget(device):
    """Seeded mixes whose shortest item sits just above the budget (where align_longer acts):
    device plan == reference, and the budget is the rule's."""
    g = torch.Generator().manual_seed(99)
    raised = 0
    for trial in range(8):
        hkv = int(torch.randint(1, 4, (1,), generator=g))
        q = int(torch.randint(17, 40, (1,), generator=g))  # shortest item's tiles
        B = int(torch.randint(2, 12, (1,), generator=g))
        lens = [q * TILE - int(torch.randint(0, TILE, (1,), generator=g))] + \
            [q * TILE * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(B - 1)]
        total = hkv * sum(units(lens))
        np_ = -(-total // (q - 1)) + int(torch.randint(0, 3, (1,), generator=g))  # budget q - 1 or a bit less
        budget = _align_longer_plan_matches_reference(device, lens, hkv, np_, trial)
        raised += budget == q > -(-total // np_)
    assert raised >= 2, "the sweep must reach the raised budget"


def test_align_longer_all_empty_with_huge_floor(device):
    """No non-empty item (shortest stays at INT32_MAX) and a min_tiles near 2^31: the rule
    must not overflow into a bogus budget."""
    plan, sl = make_plan(device, [0, 0], 1, 1, 2_100_000_000, align_longer=True)
    ref, _ = build_plan_ref(sl, 1, 1, 2_100_000_000, plan.max_seq_len, pack_short=False, align_longer=True, item_cost=0)
    assert_exact(plan.as_dict()["meta"], ref["meta"], what="meta")
    assert plan.as_dict()["meta"][1].item() == 2_100_000_000


def test_align_longer_default_follows_align_items(device):
    """Default since round I1: align_longer is on with align_items, off without it; the
    reference builder's default is the same rule (and its item cost, checked below)."""
    assert evenflow.DecodePlan(4, 100, 2, device=device).align_longer is True
    assert evenflow.DecodePlan(4, 100, 2, device=device, align_items=False).align_longer is False
    lens = [4096] * 32
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = evenflow.DecodePlan(32, 1 << 20, 8, device=device, num_programs=264, min_tiles=8).update(sl)
    ref, _ = build_plan_ref(sl, 8, 264, 8, plan.max_seq_len)
    assert_exact(plan.as_dict()["meta"], ref["meta"], what="meta")
    assert plan.as_dict()["meta"][1].item() == 64  # raised from 63: no 4K item cut


def test_default_item_cost_charges_short_items_only(device):
    """The default plan counts 2 extra units for every non-empty item of at most 4 tiles (256
    tokens), none for longer or empty ones; the device plan equals the reference with those
    options, and a plan with item_cost_max_tiles=None charges every item."""
    from evenflow.attention.plan import DEFAULT_ITEM_COST, DEFAULT_ITEM_COST_MAX_TILES

    assert (DEFAULT_ITEM_COST, DEFAULT_ITEM_COST_MAX_TILES) == (2, 4)
    lens = [128] * 6 + [0, 256, 257, 4096] * 2
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = evenflow.DecodePlan(len(lens), 1 << 20, 2, device=device, num_programs=9, min_tiles=1).update(sl)
    assert plan.as_dict()["tiles"].tolist() == [4] * 6 + [0, 6, 5, 64] * 2
    ref, _ = build_plan_ref(sl, 2, 9, 1, plan.max_seq_len)  # the reference's defaults are the plan's
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(plan.as_dict()[key], ref[key], what=key)
    every = evenflow.DecodePlan(len(lens), 1 << 20, 2, device=device, num_programs=9, min_tiles=1,
                                item_cost_max_tiles=None).update(sl)
    assert every.as_dict()["tiles"].tolist() == [4] * 6 + [0, 6, 7, 66] * 2


def test_plan_update_reuses_workspace_and_clamps(device):
    plan = evenflow.DecodePlan(4, 1000, 2, device=device, num_programs=3, min_tiles=1)
    ptrs = [t.data_ptr() for t in (plan.tiles, plan.req_end, plan.prog_start, plan.meta)]
    plan.update(torch.tensor([100, 200], dtype=torch.int32, device=device))
    assert not plan.clamped()
    plan.update(torch.tensor([100, 5000, -3], dtype=torch.int32, device=device))
    assert plan.clamped()
    # clamped to [0, max_seq_len]; the 2-tile item carries the default item cost (2 units)
    assert plan.as_dict()["tiles"].tolist() == [2 + 2, 16, 0]
    assert ptrs == [t.data_ptr() for t in (plan.tiles, plan.req_end, plan.prog_start, plan.meta)]


def test_plan_repr_names_its_options(device):
    r = repr(evenflow.DecodePlan(4, 100, 2, device=device, num_programs=3, item_cost=1, align_longer=True,
                                 warp_split=False, prefetch=False, align_growth=1.25, early_reads=False,
                                 spread_bins=False, align_longer_growth=1.5))
    for part in ("max_batch=4", "num_programs=3", "item_cost=1", "align_longer=True", "warp_split=False",
                 "prefetch=False", "align_growth=1.25", "pdl=None", "early_reads=False", "resident_cap=True",
                 "spread_bins=False", "align_longer_growth=1.5"):
        assert part in r, (part, r)


def test_plan_bad_arguments(device):
    with pytest.raises(ValueError, match="page_size"):
        evenflow.DecodePlan(4, 100, 2, page_size=48, device=device)
    with pytest.raises(ValueError, match="item_cost_max_tiles"):
        evenflow.DecodePlan(4, 100, 2, device=device, item_cost_max_tiles=0)
    with pytest.raises(ValueError, match="q_len"):
        evenflow.DecodePlan(4, 100, 2, q_len=5, device=device)
    with pytest.raises(ValueError, match="max_batch"):
        evenflow.DecodePlan(4096, 100, 2, device=device)
    with pytest.raises(ValueError, match=r"seq_lens.shape\[0\] \(batch\) must be >= 1"):
        evenflow.DecodePlan(4, 100, 2, device=device).update(torch.zeros(0, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="num_programs"):
        evenflow.DecodePlan(4, 100, 2, device=device, num_programs=2.5)
    with pytest.raises(ValueError, match="num_warps"):
        evenflow.DecodePlan(4, 100, 2, device=device, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        evenflow.DecodePlan(4, 100, 2, device=device, num_stages=0)
    with pytest.raises(ValueError, match="block_n"):
        evenflow.DecodePlan(4, 100, 2, device=device, block_n=32)
    with pytest.raises(ValueError, match="too large"):
        evenflow.DecodePlan(2048, 1 << 30, 64, device=device)
    with pytest.raises(ValueError, match="align_longer"):
        evenflow.DecodePlan(4, 100, 2, device=device, align_items=False, align_longer=True)
    with pytest.raises(TypeError, match="align_longer"):
        evenflow.DecodePlan(4, 100, 2, device=device, align_longer=1)
    with pytest.raises(TypeError, match="warp_split"):
        evenflow.DecodePlan(4, 100, 2, device=device, warp_split=1)
    # four warps on mma.sync (round AV) is a form of the Gluon fp8 plan at gluon_warps=4 only
    with pytest.raises(ValueError, match="warpgroup_mma=False"):
        evenflow.DecodePlan(4, 100, 2, device=device, kv_dtype=torch.float8_e4m3fn, warpgroup_mma=False)
    with pytest.raises(ValueError, match="warpgroup_mma=False"):
        evenflow.DecodePlan(4, 100, 2, device=device, gluon_warps=4, warpgroup_mma=False)  # no fp8 cache: Triton
    plan = evenflow.DecodePlan(4, 100, 2, device=device, kv_dtype=torch.float8_e4m3fn, gluon_warps=4,
                               warpgroup_mma=False, num_q_heads=32, q_len=1)  # 16 rows: past the warpgroup form's 8
    assert not plan.warpgroup_mma and "warpgroup_mma=False" in repr(plan)
    for name in ("early_reads", "resident_cap", "spread_bins", "launch_next", "warpgroup_mma"):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            evenflow.DecodePlan(4, 100, 2, device=device, **{name: 1})
    for bad in (0.9, 2.5, 1.3):
        with pytest.raises(ValueError, match="align_growth"):
            evenflow.DecodePlan(4, 100, 2, device=device, align_growth=bad)
        with pytest.raises(ValueError, match="align_growth"):
            build_plan_ref(torch.tensor([5]), 1, 1, 1, 100, align_growth=bad)
    for bad in (True, "1.5", None):
        with pytest.raises(TypeError, match="align_growth"):
            evenflow.DecodePlan(4, 100, 2, device=device, align_growth=bad)
    for bad in (0.9, 2.5, 1.3):
        with pytest.raises(ValueError, match="align_longer_growth must be a multiple of 1/16"):
            evenflow.DecodePlan(4, 100, 2, device=device, align_longer_growth=bad)
        with pytest.raises(ValueError, match="align_longer_growth"):
            build_plan_ref(torch.tensor([5]), 1, 1, 1, 100, align_longer_growth=bad)
    for bad in (True, "1.5"):  # None: the default by kernel (round AZ)
        with pytest.raises(TypeError, match="align_longer_growth must be a number"):
            evenflow.DecodePlan(4, 100, 2, device=device, align_longer_growth=bad)
    with pytest.raises(TypeError, match="prefetch"):
        evenflow.DecodePlan(4, 100, 2, device=device, prefetch=1)
    for kw, err, pattern in (
            (dict(max_seq_len=100.0), TypeError, "max_seq_len must be an int, got float"),
            (dict(max_seq_len=0), ValueError, "max_seq_len must be >= 1"),
            (dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be an int, got float"),
            (dict(num_kv_heads=257), ValueError, "num_kv_heads must be <= 256"),
            (dict(min_tiles=0), ValueError, "min_tiles must be >= 1, got 0"),
            (dict(item_cost="1"), TypeError, "item_cost must be an int, got str"),
            (dict(max_registers=300), ValueError, "max_registers must be <= 255, got 300"),
            # round CP's review: 4.0, 64.0 and False were taken (False as 0, which made a Triton-kernel plan)
            (dict(max_registers=False), TypeError, "max_registers must be an int, got bool"),
            (dict(max_registers=16), ValueError, r"max_registers must be 0 \(no cap\), 24-255 or None, got 16"),
            (dict(num_warps=4.0), TypeError, "num_warps must be an int, got float"),
            (dict(block_n=64.0), TypeError, "block_n must be an int, got float"),
            (dict(page_size=64.0), TypeError, "page_size must be an int, got float"),
            (dict(page_size=48), ValueError, r"page_size must be one of \[16, 32, 64, 128\], got 48"),
            (dict(align_items=1), TypeError, "align_items must be a bool, got 1"),
            (dict(kv_dtype=torch.float16), ValueError, "kv_dtype must be one of"),
            (dict(gluon=1), TypeError, "gluon must be a bool or None"),
            (dict(num_q_heads=3), ValueError, "num_q_heads must be num_kv_heads .2. times a GQA group of 1-16"),
            (dict(num_q_heads=34), ValueError, "num_q_heads must be num_kv_heads .2. times a GQA group of 1-16"),
            (dict(num_q_heads=0), ValueError, "num_q_heads must be >= 1"),
            (dict(num_q_heads=4.0), TypeError, "num_q_heads must be an int"),
            (dict(head_dim=128.0), TypeError, "head_dim must be an int"),
            (dict(head_dim=True), TypeError, "head_dim must be an int"),
            (dict(head_dim=96), ValueError, r"head_dim must be one of \[64, 128, 256\] or None, got 96")):
        with pytest.raises(err, match=pattern):
            evenflow.DecodePlan(**{**dict(max_batch=4, max_seq_len=100, num_kv_heads=2, device=device), **kw})
    elsewhere = "cuda" if torch.device(device).type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="device: kernels run on"):
        evenflow.DecodePlan(4, 100, 2, device=elsewhere)
    plan = evenflow.DecodePlan(4, 100, 2, device=device)
    with pytest.raises(ValueError, match="seq_lens is on meta"):
        plan.update(torch.ones(2, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="seq_lens"):
        plan.update(torch.tensor([1, 2], dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="batch"):
        plan.update(torch.zeros(5, dtype=torch.int32, device=device))


def test_plan_opcheck(device):
    plan = evenflow.DecodePlan(4, 1000, 2, device=device, num_programs=3, min_tiles=1)
    sl = torch.tensor([100, 0, 700], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.evenflow.decode_plan_update.default,
                          (sl, plan.tiles, plan.req_end, plan.prog_start, plan.meta, 2, 1000, 1, 4,
                           plan.align_items, plan.item_cost, plan.align_longer, plan.cost_max, 24, 17,
                           plan.pack_short),
                          test_utils=("test_schema", "test_faketensor"))


def test_align_longer_random_divisible_items(device):
    """Seeded mixes whose shortest item is n whole chunks of about one budget (n = 2..8), or one
    tile off that: device plan == reference bins, and the budget is the rule's (raised to a
    divisor of the item, or left alone)."""
    g = torch.Generator().manual_seed(7)
    raised = 0
    for trial in range(10):
        hkv = int(torch.randint(1, 5, (1,), generator=g))
        lo = 8 if trial % 4 == 3 else 17  # from 17, d is within 1/16 of d - 1
        d = int(torch.randint(lo, 40, (1,), generator=g))
        n = int(torch.randint(2, 9, (1,), generator=g))
        q = n * d + (trial % 3 == 2)  # every third: not a multiple of n
        B = int(torch.randint(2, 10, (1,), generator=g))
        lens = [q * TILE] + [q * TILE * int(torch.randint(1, 3, (1,), generator=g)) for _ in range(B - 1)]
        total = hkv * sum(units(lens))
        np_ = -(-total // (d - 1))  # budget d - 1 (or a little less): d is 1/16 above it from d = 17
        budget = _align_longer_plan_matches_reference(device, lens, hkv, np_, trial)
        raised += budget > -(-total // np_)
    assert raised >= 3, "the sweep must reach the raised case"


def _pack_plan(device, lens, hkv, np_, min_tiles, pack=True):
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = evenflow.DecodePlan(max(len(lens), 1), 1 << 20, hkv, device=device, num_programs=np_,
                               min_tiles=min_tiles, pack_short=pack).update(sl)
    return plan, sl


def _check_packed(device, lens, hkv, np_, min_tiles, what):
    """A pack_short plan: the device plan equals the reference exactly; its quantum divides the budget and every
    item's units, which round the item's own units up by less than one quantum; no item of at most a quantum is
    cut; the bins cover every unit once within the programs; where it packed, its budget is at most 15/16 of the
    plan without pack_short. Returns the quantum."""
    plan, sl = _pack_plan(device, lens, hkv, np_, min_tiles)
    d = plan.as_dict()
    ref, ref_bins = build_plan_ref(sl, hkv, np_, min_tiles, plan.max_seq_len, pack_short=True,
                                   align_longer_growth=plan.align_longer_growth)
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(d[key], ref[key], what=f"{what}: {key}")
    total, budget, used, _, cost, quantum = d["meta"].tolist()
    own = units(lens, cost, plan.item_cost_max_tiles)
    tiles = d["tiles"].tolist()
    assert budget % quantum == 0, what
    assert all(t % quantum == 0 and n <= t < n + quantum for t, n in zip(tiles, own)), what
    assert total == hkv * sum(tiles) and used == -(-total // budget) <= np_, what
    bins = walk(d, hkv, np_)
    assert bins == ref_bins, what
    covered = sorted((i, t) for chunks in bins for i, t0, t1 in chunks for t in range(t0, t1))
    assert covered == [(i, t) for i in range(len(lens) * hkv) for t in range(tiles[i // hkv])], what
    for chunks in bins:
        for i, t0, t1 in chunks:
            if 0 < tiles[i // hkv] <= quantum:
                assert (t0, t1) == (0, tiles[i // hkv]), f"{what}: item {i} of {tiles[i // hkv]} units cut"
    rules = _pack_plan(device, lens, hkv, np_, min_tiles, pack=False)[0].as_dict()["meta"]
    rules_budget = rules[1].item()
    if quantum > 1:
        assert 16 * budget <= 15 * rules_budget, what
        # a packed budget is never under the raw one (the plan kernel skips the pass where 16 x raw > 15 x the
        # rules' budget on that ground)
        assert budget >= max(-(-rules[0].item() // np_), min_tiles), what
    else:
        assert budget == rules_budget, what
    return quantum


def test_pack_short_two_lengths_by_hand(device):
    """fp8 2x64K+30x1K at 8 KV heads on 528 programs (the benchmark case): align_items takes 48 tiles (three 1K
    items a bin, 422 bins); pack_short pads the 1K items' 16 tiles to 21 units and the 64K items' 1024 to 1029,
    a budget of 42 with two 1K items a bin: 16 x 1029 + 240 x 21 = 21504 units in 512 bins."""
    lens = [64 * 1024] * 2 + [1024] * 30
    plan, _ = _pack_plan(device, lens, 8, 528, 8, pack=False)
    assert plan.as_dict()["meta"][:3].tolist() == [16 * 1024 + 240 * 16, 48, 422]
    assert _check_packed(device, lens, 8, 528, 8, "2x64K+30x1K") == 21
    plan, _ = _pack_plan(device, lens, 8, 528, 8)
    assert plan.as_dict()["meta"].tolist() == [21504, 42, 512, 0, 2, 21]
    assert plan.tiles[:3].tolist() == [1029, 1029, 21]


# name: (lens, kv heads, programs, min_tiles)
PACK_CASES = {
    "two-lengths-g2": ([130, 65, 1100, 200, 1100], 2, 8, 1),
    "phantom-chunks": ([1100, 130, 64, 200, 65, 300], 1, 10, 1),
    "empties": ([0, 0, 0, 1600, 200, 300, 0, 65], 1, 3, 1),
    "not-smaller": ([128] * 32 + [4096] * 32, 8, 528, 8),  # 35 against 36: kept
    "too-long": ([4096] * 8, 2, 17, 1),  # the shortest item does not fit the raw budget
    "all-empty": ([0, 0], 2, 4, 1),
    "huge-floor": ([64, 128, 4000], 1, 1, 2**30),  # a raw budget of 2^30 units: not priced (int32 headroom)
}


@pytest.mark.parametrize("name", list(PACK_CASES))
def test_pack_short_plan(name, device):
    lens, hkv, np_, mt = PACK_CASES[name]
    quantum = _check_packed(device, lens, hkv, np_, mt, name)
    assert (quantum > 1) == (name in ("two-lengths-g2", "phantom-chunks", "empties")), (name, quantum)


def test_pack_short_random_mixes(device):
    """Seeded mixes of a few long and many short requests and of any lengths, drawn until 6 whose reference plan
    packs and 4 whose does not (the reference picks them; the device plan is then checked on each): the
    properties above on all 10."""
    g = torch.Generator().manual_seed(11)
    want = {True: 6, False: 4}
    for trial in range(400):
        hkv = int(torch.randint(1, 5, (1,), generator=g))
        short = int(torch.randint(1, 1500, (1,), generator=g))
        longs = [int(x) for x in torch.randint(2000, 40000, (int(torch.randint(0, 3, (1,), generator=g)),),
                                                generator=g)]
        lens = longs + [short] * int(torch.randint(2, 40, (1,), generator=g))
        if trial % 3 == 2:
            lens = [int(x) for x in torch.randint(0, 5000, (int(torch.randint(1, 20, (1,), generator=g)),),
                                                  generator=g)]
        np_ = int(torch.randint(2, 200, (1,), generator=g))
        mt = int(torch.randint(1, 9, (1,), generator=g))
        ref, _ = build_plan_ref(torch.tensor(lens), hkv, np_, mt, 1 << 20, pack_short=True)
        packs = int(ref["meta"][5]) > 1
        if want[packs]:
            want[packs] -= 1
            assert (_check_packed(device, lens, hkv, np_, mt, f"trial {trial}: {lens}, {hkv}, {np_}, {mt}") > 1
                    ) == packs
        if not any(want.values()):
            return
    pytest.fail(f"the draw did not reach the packed and unpacked plans it needs (left: {want})")


def test_pack_short_bad_value(device):
    with pytest.raises(TypeError, match="pack_short"):
        evenflow.DecodePlan(4, 100, 2, device=device, pack_short=1)


def test_pack_short_is_the_default(device):
    """Since round BB1 a plan packs unless told not to, and the reference builder's default is the same: the default
    plan of 2x64K+30x1K at 8 KV heads on 528 programs is the packed one (42 tiles, quantum 21), equal to the
    reference's default."""
    from evenflow.attention.plan import DEFAULT_PACK_SHORT

    assert DEFAULT_PACK_SHORT is True and evenflow.DecodePlan(4, 100, 2, device=device).pack_short is True
    sl = torch.tensor([64 * 1024] * 2 + [1024] * 30, dtype=torch.int32, device=device)
    plan = evenflow.DecodePlan(32, 1 << 17, 8, device=device, num_programs=528, min_tiles=8).update(sl)
    ref, _ = build_plan_ref(sl, 8, 528, 8, plan.max_seq_len)
    for key in ("tiles", "req_end", "prog_start", "meta"):
        assert_exact(plan.as_dict()[key], ref[key], what=key)
    assert plan.as_dict()["meta"][[1, 5]].tolist() == [42, 21]
