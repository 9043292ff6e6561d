"""The router preload probe (benchmarks/probe_router_preload.py) computes the product it times: its kernel, with the
weight loaded before and after the PDL point, against an fp64 product under the tests' rule, with row and column
tails past the tile and several K steps; bad shapes are refused; the probe's variant list respects its register
limits."""
import os
import sys

import pytest
import torch

from evenflow.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import probe_router_preload as probe  # noqa: E402


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("form,m,n,k,bn,bk", [("tile", 1, 3, 256, 2, 64), ("tile", 5, 7, 512, 4, 128),
                                              ("tile", 16, 6, 384, 1, 128), ("rows", 1, 3, 256, 2, 64),
                                              ("rows", 5, 7, 512, 2, 128), ("rows", 3, 5, 384, 1, 128)])
def test_preload_tile_matches_fp64(device, preload, form, m, n, k, bn, bk):
    g = torch.Generator(device="cpu").manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    out = torch.full((m, n), float("nan"), device=device)
    probe.preload_launcher(x, w, out, bn, bk, 4, preload, pdl=device == "cuda", form=form)()
    ref = x.double() @ w.double().T
    assert_within_rule(out, ref, x.float() @ w.T, what=f"{form} preload={preload} {m}x{n}x{k}")


def test_preload_launcher_refuses_bad_shapes(device):
    x = torch.zeros(4, 300, dtype=torch.bfloat16, device=device)
    w = torch.zeros(2, 300, device=device)
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        probe.preload_launcher(x, w, torch.empty(4, 2, device=device), 1, 256, 4, True)
    with pytest.raises(ValueError, match="1-16 rows"):
        probe.preload_launcher(torch.zeros(17, 256, dtype=torch.bfloat16, device=device),
                               torch.zeros(2, 256, device=device), torch.empty(17, 2, device=device), 1, 256, 4, True)
    with pytest.raises(ValueError, match="must be bf16"):
        probe.preload_launcher(x.float(), w, torch.empty(4, 2, device=device), 1, 100, 4, True)
    with pytest.raises(ValueError, match="BLOCK_N 1 or 2"):
        probe.preload_launcher(x[:, :256], w[:, :256], torch.empty(4, 2, device=device), 4, 256, 4, True, form="rows")


@pytest.mark.parametrize("form", ["tile", "rows"])
@pytest.mark.parametrize("label,m,n,k", probe.POINTS)
def test_variants_within_register_limits(form, label, m, n, k):
    vs = probe.variants(m, n, k, form)
    assert vs, label
    bm = 1 << max(0, m - 1).bit_length() if form == "tile" else 1
    for bn, bk, steps, warps in vs:
        threads = 32 * warps
        assert bk * steps == k and steps <= 8
        assert bn * k <= 64 * threads and bm * bn * bk <= 64 * threads
