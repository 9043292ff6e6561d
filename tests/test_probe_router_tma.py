"""The router TMA probe (benchmarks/probe_router_tma.py) computes the product it times: its kernel against an fp64
product, with row and column tails past the tile (the TMA boxes' out-of-bounds elements read as zero) and more than
one K step; and a K that is not a multiple of the step is refused."""
import os
import sys

import pytest
import torch

from evenflow.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import probe_router_tma as probe  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(4, 6, 512), (5, 7, 256), (16, 192, 1024)])
def test_tma_tile_matches_fp64(device, m, n, k):
    if device == "cuda":
        import triton

        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    g = torch.Generator(device="cpu").manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    out = torch.full((m, n), float("nan"), device=device)
    probe.tma_launcher(x, w, out, 4, 2, 256, 3, pdl=False)()
    ref = x.double() @ w.double().T
    assert_within_rule(out, ref, x.float() @ w.T, what=f"tma {m}x{n}x{k}")


def test_tma_launcher_refuses_a_k_tail(device):
    x = torch.zeros(4, 300, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        probe.tma_launcher(x, torch.zeros(2, 300, device=device), torch.empty(4, 2, device=device), 4, 2, 256, 3)
