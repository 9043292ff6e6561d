"""The operand-order probe's GEMM kernels compute the product they claim (interpreter at the
probe's own tile sizes, and on a GPU when present), so its timings compare equal work."""
import os
import sys

import pytest
import torch

from evenflow import _runtime
from evenflow.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import probe_moe_operand as probe  # noqa: E402


@pytest.mark.parametrize("name", list(probe.FORMULATIONS))
def test_formulation_matches_fp64(name, device):
    f = probe.FORMULATIONS[name]
    gen = torch.Generator(device=device).manual_seed(7)
    x, w = probe.make_inputs(2, f.block_m, f.block_n * 2, f.block_k * 2, device, gen)
    out = probe.run_formulation(name, x, w, dot_f32=_runtime.dot_needs_fp32())()
    ref = torch.bmm(x.double(), w.double().mT)
    base = torch.bmm(x.float(), w.float().mT)
    assert_within_rule(out, ref, base, what=name)


def test_tiles_must_divide(device):
    x, w = probe.make_inputs(1, 48, 128, 128, device, torch.Generator(device=device).manual_seed(0))
    with pytest.raises(ValueError, match="do not divide"):
        probe.run_formulation("rows-bm32-w4", x, w)
