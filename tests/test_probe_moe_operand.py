"""The operand-order probe's GEMM kernels compute the product they claim (interpreter at the
probe's own tile sizes, and on a GPU when present), so its timings compare equal work; its Gluon
kernel's sm_90 build is what it was written to be (CPU)."""
import os
import sys

import pytest
import torch

from evenflow import _runtime
from evenflow.testing import assert_within_rule

HERE = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, HERE)
import probe_moe_operand as probe  # noqa: E402
from tests_support_probes import sm90_builds_of  # noqa: E402

GLUON = [n for n, f in probe.FORMULATIONS.items() if f.gluon]


@pytest.mark.parametrize("name", list(probe.FORMULATIONS))
def test_formulation_matches_fp64(name, device):
    f = probe.FORMULATIONS[name]
    if f.gluon and (device != "cuda" or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the Gluon kernel is sm_90 code (wgmma) and Gluon has no interpreter (its build: the tests below)")
    gen = torch.Generator(device=device).manual_seed(7)
    # two row tiles (a program at m0 > 0) and 6 K steps: the Gluon ring (4 slots, filled 2 steps ahead) wraps, its
    # loop (two steps a trip) runs 3 trips
    x, w = probe.make_inputs(2, 2 * f.block_m, f.block_n * 2, f.block_k * 6, device, gen)
    out = probe.run_formulation(name, x, w, dot_f32=_runtime.dot_needs_fp32())()
    ref = torch.bmm(x.double(), w.double().mT)
    base = torch.bmm(x.float(), w.float().mT)
    assert_within_rule(out, ref, base, what=name)


def test_tiles_must_divide(device):
    x, w = probe.make_inputs(1, 48, 128, 128, device, torch.Generator(device=device).manual_seed(0))
    with pytest.raises(ValueError, match="do not divide"):
        probe.run_formulation("rows-bm32-w4", x, w)
    x, w = probe.make_inputs(1, 64, 128, 192, device, torch.Generator(device=device).manual_seed(0))
    with pytest.raises(ValueError, match="odd number of 64-deep steps"):
        probe.run_formulation("gluon-rs-bn128-bm64", x, w)


def test_hazard_check_sees_writes_to_an_unfinished_wgmma():
    """The SASS check the Gluon build test relies on: a write to an in-flight MMA's A registers or accumulators is
    found, also across the loop's back edge; after the wait that retires the MMA it is not."""
    mma = [("WARPGROUP.ARRIVE", ""), ("HGMMA.64", "x64x16.F32 R24, R120, gdesc[UR4], R24"),
           ("HGMMA.64", "x64x16.F32 R24, R124, gdesc[UR8], R24, gsb0")]
    keep_one = [("WARPGROUP.DEPBAR.LE", "gsb0, 0x1")]
    load_a = [("LDS.U16", "R121, [R3+0x40]"), ("F2FP.F16.E4M3.UNPACK_B", "R121, R121")]
    # one register set: the next trip rewrites R121 while this trip's MMAs may still run (round AS5's loop)
    assert probe.wgmma_register_hazards(load_a + mma + keep_one)
    # the same write after a full wait is safe; so is an address register the MMAs do not use
    assert not probe.wgmma_register_hazards(load_a + mma + [("WARPGROUP.DEPBAR.LE", "gsb0, 0x0")])
    assert not probe.wgmma_register_hazards([("IMAD.WIDE", "R10, R2, 0x2, R4")] + mma + keep_one)
    # inside the group, before it is closed: an accumulator written between two of its MMAs (a .64 write's second
    # register)
    assert probe.wgmma_register_hazards(mma[:2] + [("LDS.64", "R54, [R3]")] + mma[2:] + keep_one)
    # A from shared memory (a descriptor): only the accumulators are the MMA's registers
    desc = [("HGMMA.64", "x64x16.F32 R24, gdesc[UR4], R24, gsb0")]
    assert not probe.wgmma_register_hazards(load_a + desc + keep_one)


@pytest.mark.skipif(not _runtime.interpreting(), reason="compiles for sm_90 on the CPU (the GPU runs the kernel)")
def test_gluon_swap_issues_each_steps_mmas_as_one_asynchronous_group():
    """Per K step of the sm_90 loop (two steps a trip, one register set each) and warp: the warpgroup's
    (BN / 64 / G) x (BK / 16) ``HGMMA.64`` of the step (G warpgroups a program) behind one arrive and one wait that
    keeps that group in flight (``gsb0, 0x1``; Triton-lang's swapped build waits for each to finish), no instruction
    writing a register of an unfinished MMA (the fault of round AS5's one-set loop, which this check finds 46-85 times
    in its builds), its share of the weights converted in registers (BN x BK / (256 x G) ``F2FP`` a thread a step:
    two e4m3 each) and nothing stored to shared memory; no spill, no ptxas warning or serialisation note, and an SM
    holds two warpgroups (two 4-warp programs, or one of 8)."""
    builds = sm90_builds_of(os.path.join(HERE, "probe_moe_operand.py"), GLUON)
    for name in GLUON:
        f, st = probe.FORMULATIONS[name], builds[name]
        ops = st["loop"]
        groups = f.num_warps // 4
        assert ops.get("HGMMA.64", 0) == 2 * (f.block_n // 64 // groups) * (f.block_k // 16), (name, ops)
        assert ops.get("WARPGROUP.ARRIVE") == 2 and st["depbars"] == ["gsb0, 0x1"] * 2, (name, st["depbars"])
        assert not st["hazards"], (name, st["hazards"][:5])
        assert ops.get("F2FP.F16.E4M3.UNPACK_B") == f.block_n * f.block_k // (32 * f.num_warps), (name, ops)
        assert not any(op.startswith("STS") for op in ops), (name, ops)
        assert st["spill"] == 0 and not st["ptxas_warnings"], (name, st)
        regs = -(-st["regs"] // 8) * 8  # allocated in units of 8 a thread
        programs = min(65536 // (regs * 32 * f.num_warps), 233472 // (st["shared"] + 1024))
        assert programs * groups >= 2, (name, st)
