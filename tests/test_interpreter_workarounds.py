"""The Triton 3.6 CPU interpreter's four defects, and proof that our workarounds fix them.

Each pair of tests shows the defect exists (so the workaround is needed) and that
the workaround removes it (so it is sufficient). On a GPU the "defect" tests are
skipped: there the fp8 and bf16-dot switches are False and nothing is patched. The
third defect, fp32 -> bf16 casts that truncate, and the fourth, dot sums whose order
follows the tile's shape and the CPU's BLAS kernel, are worked around for the test session
(``tests_support_interp``, applied by ``tests/conftest.py``), not inside the kernels.
"""
import pytest
import torch
import triton
import triton.language as tl

from evenflow import _runtime
from evenflow._kernels.common import dot_operand, round_to_fp8e4_grid, to_fp8e4

interp_only = pytest.mark.skipif(not _runtime.interpreting(), reason="interpreter defects only")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, DOT_F32: tl.constexpr):
    o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a_ptr + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b_ptr + o_k[:, None] * N + o_n[None, :])
    b_c = tl.dot(dot_operand(b_a, DOT_F32), dot_operand(b_b, DOT_F32), out_dtype=tl.float32)
    tl.store(c_ptr + o_m[:, None] * N + o_n[None, :], b_c)


def _run_dot(device, dot_f32):
    a = torch.randn(16, 32, device=device).to(torch.bfloat16)
    b = torch.randn(32, 16, device=device).to(torch.bfloat16)
    c = torch.full((16, 16), float("nan"), device=device)
    _dot_kernel[(1,)](a, b, c, 16, 16, 32, dot_f32)
    ref = a.double() @ b.double()
    return (c.double() - ref).abs().max().item()


@interp_only
def test_bf16_dot_is_wrong_without_workaround(device):
    assert _run_dot(device, False) > 1e-1


def test_bf16_dot_workaround_is_correct(device):
    # bf16 operands are exact in fp32; products of two 8-bit mantissas are exact in
    # fp32 and a 32-term sum stays within a few fp32 ulps of |c| (<~ 50 here).
    # On a GPU the kernel runs with DOT_F32=False (real bf16 tensor-core dot).
    assert _run_dot(device, _runtime.dot_needs_fp32()) < 1e-4


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, FP8_ROUND: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(y_ptr + o, to_fp8e4(x, FP8_ROUND), mask=m)


@triton.jit
def _grid_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, round_to_fp8e4_grid(tl.load(x_ptr + o, mask=m)), mask=m)


def _fp8_inputs(device):
    # Values that carry into the next binade (1.97 -> 2, 7.8 -> 8), ties, subnormals,
    # saturation, and a N(0, 4^2) sweep as in the defect report.
    special = torch.tensor([1.97, 7.80, -7.80, 1.0625, 1.1875, 0.0, 2.0**-9, 3 * 2.0**-10,
                            2.0**-7 * 1.03, 448.0, 470.0, -1000.0, 0.015625, 239.9], device=device)
    return torch.cat([special, torch.randn(4096, device=device) * 4])


def _fp8_cast(device, fp8_round):
    x = _fp8_inputs(device)
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    _cast_kernel[(1,)](x, y, x.numel(), fp8_round, BLOCK=triton.next_power_of_2(x.numel()))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)  # torch's cast: round to nearest even
    return y.float(), want.float()


@interp_only
def test_fp8_cast_is_wrong_without_workaround(device):
    got, want = _fp8_cast(device, False)
    assert (got != want).sum() > 10


def test_fp8_cast_workaround_is_exact(device):
    got, want = _fp8_cast(device, _runtime.fp8_cast_needs_rounding())
    assert torch.equal(got, want)


def test_round_to_fp8_grid_matches_torch(device):
    x = _fp8_inputs(device)
    y = torch.empty_like(x)
    _grid_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(y, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


@triton.jit
def _bf16_store_kernel(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(y_ptr + o, x.to(tl.bfloat16), mask=m)  # an explicit cast
    tl.store(z_ptr + o, x, mask=m)  # the store's own cast into a bf16 tensor


def _bf16_inputs(device):
    # ties to even both ways, a carry into the next binade, past the largest bf16, inf, NaN, zeros, a subnormal,
    # and a N(0, 1) sweep
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0x7FC00001,
                         0xFFC00000, 0x00000000, 0x80000000, 0x00018000], dtype=torch.int64).to(torch.int32)
    return torch.cat([bits.view(torch.float32).to(device), torch.randn(4096, device=device)])


def _bf16_casts(device):
    x = _bf16_inputs(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    z = torch.empty_like(y)
    _bf16_store_kernel[(1,)](x, y, z, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return x, y, z


def _same_bf16(a, b):
    # equal bit for bit, NaNs compared as NaNs
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


@interp_only
def test_bf16_cast_truncates_without_workaround(device, monkeypatch):
    from triton.runtime import interpreter as interp

    patched = interp.InterpreterBuilder.cast_impl
    assert getattr(patched, "evenflow_rne", False), "tests/conftest.py did not apply the bf16 rounding workaround"
    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", patched.truncating)
    x, y, z = _bf16_casts(device)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    normal = x.abs() >= torch.finfo(torch.float32).tiny  # (its subnormals come out wrong in yet another way)
    assert _same_bf16(y[normal], truncated[normal]) and _same_bf16(z[normal], truncated[normal])
    assert (y != x.to(torch.bfloat16)).sum() > 1000  # about half of the N(0, 1) sweep
    sub = (x != 0) & ~normal  # fp32 subnormals: neither truncated nor rounded
    assert sub.any() and not _same_bf16(y[sub], truncated[sub]) and not _same_bf16(y[sub], x[sub].to(torch.bfloat16))


def test_bf16_cast_rounds_to_nearest_even(device):
    # in the interpreter with tests/conftest.py's workaround, on a GPU by itself: torch's cast bit for bit
    x, y, z = _bf16_casts(device)
    want = x.to(torch.bfloat16)
    assert _same_bf16(y, want) and _same_bf16(z, want)


@triton.jit
def _tiled_dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """c = a @ b over row tiles of BLOCK_M rows, each program one tile."""
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n, o_k = tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a_ptr + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b_ptr + o_k[:, None] * N + o_n[None, :])
    b_c = tl.dot(dot_operand(b_a, DOT_F32), dot_operand(b_b, DOT_F32), out_dtype=tl.float32)
    tl.store(c_ptr + o_m[:, None] * N + o_n[None, :], b_c)


def _tiled_dot(a, b, block_m, exact=True):
    """``_tiled_dot_kernel``'s output at ``block_m`` rows a tile, with the session's dot or the interpreter's own."""
    from triton.runtime import interpreter as interp

    c = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device)
    patched = interp.InterpreterBuilder.create_dot
    if not exact:
        interp.InterpreterBuilder.create_dot = patched.plain
    try:
        _tiled_dot_kernel[(a.shape[0] // block_m,)](a, b, c, b.shape[1], a.shape[1], block_m,
                                                    _runtime.dot_needs_fp32())
    finally:
        interp.InterpreterBuilder.create_dot = patched
    return c


@interp_only
def test_dot_elements_do_not_depend_on_the_tile():
    """The fourth workaround (``tests_support_interp.exact_dots``): the interpreter's dot runs ``np.matmul`` in fp32,
    whose OpenBLAS kernel (and so each element's order of additions) depends on the tile's shape and the CPU; round
    CK found prefill's 64- and 128-row forms apart by an ulp on an AVX2-only CPU. With the patch every element is
    the correctly rounded fp32 sum of its bf16 products (the fp64 product, exact here, rounded once), so 16-, 64- and
    128-row tiles agree bit for bit. Whether the unpatched dot differs is the machine's: it is run, not asserted."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    exact = (a.double() @ b.double()).float()
    for block_m in (16, 64, 128):
        assert torch.equal(_tiled_dot(a, b, block_m), exact), block_m
    plain = [_tiled_dot(a, b, m, exact=False) for m in (16, 128)]
    assert all(torch.allclose(p, exact, rtol=1e-5, atol=1e-4) for p in plain)
