"""Index build of the fused MoE: compared EXACTLY with the PyTorch reference, plus its invariants."""
import pytest
import torch

from evenflow.moe.routing import build_moe_index, max_tiles
from evenflow.reference.moe import moe_index_reference
from evenflow.testing import assert_exact


def check_index(ids, e_local, ep_rank, block_m, multi_program=None):
    idx = build_moe_index(ids, e_local, ep_rank, block_m, multi_program=multi_program)
    n_tiles = max_tiles(ids.numel(), e_local, block_m)
    ref = moe_index_reference(ids, e_local, ep_rank, block_m, n_tiles)
    for got, want, name in zip(idx[:5], ref, ("counts", "offsets", "sorted_pairs", "tile_expert", "tile_row")):
        assert_exact(got, want, name)
    # invariants, independent of the reference's construction
    flat = ids.flatten().long().cpu() - ep_rank * e_local
    local = (flat >= 0) & (flat < e_local)
    sp, off = idx.sorted_pairs.cpu().long(), idx.offsets.cpu().long()
    kept = int(off[-1])
    assert kept == int(local.sum())
    assert sorted(sp[:kept].tolist()) == torch.nonzero(local).flatten().tolist()  # every local pair exactly once
    assert (sp[kept:] == -1).all()
    for e in range(e_local):
        seg = sp[off[e]:off[e + 1]]
        assert (flat[seg] == e).all() and (seg[1:] > seg[:-1]).all()  # contiguous range, ascending
    te, tr = idx.tile_expert.cpu().long(), idx.tile_row.cpu().long()
    covered = torch.zeros(kept, dtype=torch.int64)
    for e, r in zip(te.tolist(), tr.tolist()):
        if e < 0:
            assert r == -1
            continue
        rows = torch.arange(r, min(r + block_m, int(off[e + 1])))
        assert r >= off[e] and rows.numel() > 0
        covered[rows] += 1
    assert (covered == 1).all()  # the task map covers every kept row exactly once
    used = int((te >= 0).sum())
    assert (te[:used] >= 0).all() and (te[used:] == -1).all()


@pytest.mark.parametrize("t,k,e,block_m", [
    (1, 1, 1, 16),      # smallest
    (1, 8, 128, 16),    # decode step of Qwen3: 8 of 128 experts, 1 row each
    (17, 4, 8, 16),     # one past a tile boundary in places
    (33, 4, 4, 32),     # > 2 blocks of 64 pairs: running cursors across blocks
    (50, 2, 3, 64),
    (4, 16, 512, 16),   # E = 512 (histogram of 1024 bins), top-k 16
    (4, 8, 128, 16),    # 32 pairs: a decode step of 4 tokens at top-8
    (33, 1, 192, 16),   # 33 pairs on 192 experts: one past a 32-pair block
    (3, 7, 5, 16),      # 21 pairs on 5 experts, several pairs a tile
])
@pytest.mark.parametrize("multi_program", [False, True])
def test_index_matches_reference(device, t, k, e, block_m, multi_program):
    ids = torch.randint(0, e, (t, k), dtype=torch.int32, device=device)
    check_index(ids, e, 0, block_m, multi_program)


@pytest.mark.parametrize("multi_program", [False, True])
def test_index_expert_parallel(device, multi_program):
    # 6 local experts of 24 on rank 2: ids 12..17 kept, the others dropped.
    ids = torch.randint(0, 24, (40, 4), dtype=torch.int32, device=device)
    check_index(ids, 6, 2, 16, multi_program)


def test_index_multi_program_many_chunks(device):
    # 700 pairs: 6 chunks of 128 by default (the last one partial), skewed routing so experts span chunks,
    # EP rank 1 (half the pairs dropped); the default size rule and both builds agree.
    g = torch.Generator().manual_seed(11)
    ids = torch.multinomial(torch.linspace(1, 6, 20), 700 // 5 * 5, replacement=True, generator=g)
    ids = ids.view(140, 5).to(torch.int32).to(device)
    for multi in (False, True):
        check_index(ids, 10, 1, 32, multi)
    a = build_moe_index(ids, 10, 1, 32, multi_program=False)
    b = build_moe_index(ids, 10, 1, 32, multi_program=True)
    for x, y, name in zip(a[:5], b[:5], ("counts", "offsets", "sorted_pairs", "tile_expert", "tile_row")):
        assert_exact(x, y, name)


@pytest.mark.parametrize("chunk", [128, 256, 384])
def test_index_chunk_sizes_agree(device, chunk):
    # 700 pairs in chunks of 128 (6, the last partial), 256 or 384: the same index as one program, exactly
    g = torch.Generator().manual_seed(5)
    ids = torch.multinomial(torch.linspace(1, 6, 20), 700, replacement=True, generator=g)
    ids = ids.view(140, 5).to(torch.int32).to(device)
    a = build_moe_index(ids, 10, 1, 16, multi_program=False)
    b = build_moe_index(ids, 10, 1, 16, multi_program=True, chunk=chunk)
    for x, y, name in zip(a[:5], b[:5], ("counts", "offsets", "sorted_pairs", "tile_expert", "tile_row")):
        assert_exact(x, y, name)
    check_index(ids, 10, 1, 16, True)


@pytest.mark.parametrize("chunk,err", [(64, ValueError), (200, ValueError), (0, ValueError), (128.0, TypeError)])
def test_index_rejects_a_bad_chunk(device, chunk, err):
    ids = torch.randint(0, 8, (30, 3), dtype=torch.int32, device=device)
    with pytest.raises(err, match="chunk"):
        build_moe_index(ids, 8, 0, 16, multi_program=True, chunk=chunk)


def test_index_multi_program_zeroes_workspace(device):
    zero = torch.full((37,), 5, dtype=torch.int32, device=device)
    build_moe_index(torch.randint(0, 8, (30, 3), dtype=torch.int32, device=device), 8, 0, 16, zero=zero,
                    multi_program=True)
    assert_exact(zero, torch.zeros_like(zero), "zeroed workspace")


def test_index_multi_program_shares(device):
    # 2 chunks share a task map of 300 tiles (64 per step, so each program loops), E = 128 one-hot
    # tiles, a split-K counter workspace of 3000 (> 1024 per program, strided over the 2 programs)
    # and a rank where every pair is dropped.
    ids = torch.randint(0, 128, (60, 5), dtype=torch.int32, device=device)
    check_index(ids, 128, 0, 16, True)
    zero = torch.full((3000,), 7, dtype=torch.int32, device=device)
    build_moe_index(ids, 128, 0, 16, zero=zero, multi_program=True)
    assert_exact(zero, torch.zeros_like(zero), "zeroed workspace")
    check_index(ids, 64, 3, 16, True)  # ids < 128 never reach experts 192..255


def test_index_all_on_one_expert_and_none_local(device):
    check_index(torch.full((70, 1), 3, dtype=torch.int32, device=device), 4, 0, 16)
    check_index(torch.full((5, 2), 9, dtype=torch.int32, device=device), 4, 0, 16)  # nothing local
    check_index(torch.randint(0, 4, (9, 2), device=device), 4, 0, 16)  # int64 ids


def test_index_randomised(device):
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        e = int(torch.randint(1, 40, (1,), generator=g))
        k = int(torch.randint(1, min(e, 16) + 1, (1,), generator=g))
        t = int(torch.randint(1, 60, (1,), generator=g))
        ranks = int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.randint(0, e * ranks, (t, k), generator=g).to(torch.int32).to(device)
        rank = int(torch.randint(0, ranks, (1,), generator=g))
        check_index(ids, e, rank, 16 << int(torch.randint(0, 3, (1,), generator=g)))


def test_max_tiles_bound():
    assert max_tiles(0, 8, 16) == 0
    assert max_tiles(8, 128, 16) == 8            # every tile holds at least one pair
    assert max_tiles(32768, 128, 64) == (32768 + 128 * 63) // 64
    # the bound holds for any split of the pairs over the experts (the worst: n_e = 1 mod block_m)
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        e, bm = int(torch.randint(1, 64, (1,), generator=g)), 16 << int(torch.randint(0, 3, (1,), generator=g))
        n = torch.randint(0, 3 * bm, (e,), generator=g)
        if int(torch.randint(0, 2, (1,), generator=g)):
            n = n // bm * bm + 1
        assert int(((n + bm - 1) // bm).sum()) <= max_tiles(int(n.sum()), e, bm)
