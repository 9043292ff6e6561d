"""The TMA probe's GEMM kernels compute the product they claim (interpreter at small tiles' multiples, and on a
GPU when present), so its timings compare equal work; its sm_90 builds load what each name says by TMA (CPU)."""
import os
import sys

import pytest
import torch

from evenflow import _runtime
from evenflow.testing import assert_within_rule

HERE = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, HERE)
import probe_moe_tma as probe  # noqa: E402
from tests_support_probes import sm90_builds_of  # noqa: E402


@pytest.mark.parametrize("name", list(probe.FORMULATIONS))
def test_formulation_matches_fp64(name, device):
    f = probe.FORMULATIONS[name]
    if device == "cuda":
        probe._tma_allocator()
    gen = torch.Generator(device=device).manual_seed(7)
    # 2 experts x 2 row blocks x 2 column blocks, 3 K steps; persistent kernels on 3 programs, so a program takes
    # tiles of different experts and rows one after another through the flattened loop
    e, r, n, k = 2, 2 * f.block_m, 2 * f.block_n, 3 * f.block_k
    x, idx, x_e, w = probe.make_inputs(e, r, n, k, device, gen)
    assert torch.equal(x_e, x[idx.flatten().long()])  # the by-expert layout holds the gathered rows
    out = probe.run_formulation(name, x, idx, x_e, w, num_sms=3)()
    ref = probe.reference(name, x_e, w, e, r)
    base = probe.reference(name, x_e, w, e, r, torch.float32).to(torch.bfloat16)  # bf16 in and out, fp32 sums
    assert_within_rule(out, ref, base, what=name)
    if f.ragged:  # the rows past each expert's count were never written (the output starts at zero)
        past = torch.arange(r, device=device)[None, :] >= probe.row_counts(e, r, device)[:, None]
        assert past.any() and not out.view(e, r, -1)[past].any()


def test_reference_is_the_gate_up_and_ragged_product():
    """The probe's reference, independently: a gate-up formulation's output is SiLU(x Wg^T) * (x Wu^T) of the
    weight's two halves (or its interleaved rows), a ragged one zero past each expert's count, by explicit loops
    over experts and rows."""
    gen = torch.Generator().manual_seed(3)
    e, r, n, k = 4, 64, 32, 16
    x, idx, x_e, w = probe.make_inputs(e, r, n, k, "cpu", gen)
    got = probe.reference("ptr-gur-bm128-bn256-w8", x_e, w, e, r)
    cnt = probe.row_counts(e, r, "cpu").tolist()
    assert cnt == [64, 48, 32, 16]
    for i in range(e):
        wg, wu = w[i * n:i * n + n // 2].double(), w[i * n + n // 2:(i + 1) * n].double()
        for m in range(r):
            row = x_e[i * r + m].double()
            want = torch.nn.functional.silu(wg @ row) * (wu @ row) if m < cnt[i] else torch.zeros(n // 2).double()
            torch.testing.assert_close(got[i * r + m], want, rtol=1e-12, atol=1e-12)
    # interleaved weights: gate j and up j are an expert's rows 2j and 2j + 1; every row written
    got = probe.reference("ptr-gui-bm128-bn256-w8", x_e, w, e, r)
    for i in range(e):
        wi = w[i * n:(i + 1) * n].double()
        for m in (0, r - 1):
            row = x_e[i * r + m].double()
            want = torch.nn.functional.silu(wi[0::2] @ row) * (wi[1::2] @ row)
            torch.testing.assert_close(got[i * r + m], want, rtol=1e-12, atol=1e-12)


def test_tiles_must_divide(device):
    x, idx, x_e, w = probe.make_inputs(1, 96, 256, 128, device, torch.Generator(device=device).manual_seed(0))
    with pytest.raises(ValueError, match="do not divide"):
        probe.run_formulation("ptr-bm128-bn128-w4", x, idx, x_e, w)


@pytest.mark.skipif(not _runtime.interpreting(), reason="compiles for sm_90 on the CPU (the GPU runs the kernel)")
def test_builds_load_by_tma_what_their_names_say():
    """sm_90: the weight tile by TMA (``UTMALDG``) in ``tmaw-*`` and ``tma2-*`` (there the activations too, no
    pointer copy left), none in ``ptr-*`` (its copies ``LDGSTS``); each loop has its MMAs on ``wgmma``; no spill and
    shared memory within an SM's 227 KB."""
    names = list(probe.FORMULATIONS)
    builds = sm90_builds_of(os.path.join(HERE, "probe_moe_tma.py"), names)
    for name in names:
        f, st = probe.FORMULATIONS[name], builds[name]
        ops = st["loop"]
        count = lambda prefix: sum(v for op, v in ops.items() if op.startswith(prefix))  # noqa: E731, B023
        assert count("UTMALDG") == f.w_tma * (2 if f.gate_up == 1 else 1) + (f.x_mode == 2), (name, ops)
        assert (count("LDGSTS") > 0) == (f.x_mode != 2), (name, ops)
        assert count("HGMMA") > 0, (name, ops)
        assert st["spill"] == 0 and st["shared"] <= 232448, (name, st)
