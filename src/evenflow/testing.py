"""Helpers that evenflow's tests (and users' tests of their integrations) share.

The tolerance rule
------------------
An evenflow kernel computes in a lower precision than its oracle. We accept its
output when its error against a float64 reference is at most ``factor`` (2 by
default) times the error that *PyTorch* makes doing the same math in the same
precision, plus one unit in the last place of the output dtype at the
reference's magnitude (so that an exact baseline, error 0, does not demand more
than the output format can represent):

    max|out - ref64| <= factor * max|torch_same_precision - ref64| + ulp(out.dtype) * max|ref64|

This is FlashAttention's rule ("at most 2x PyTorch's error in the same precision")
made explicit. It grows with the problem the way real rounding does (e.g. like
sqrt(K) for a K-long fp32 dot product) rather than by a hand-picked ``atol``.

One rounding the rule cannot see: an intermediate rounded to a coarse format (the fused MoE's
fp8 requantisation of silu(gate) * up) whose value lies within fp32 error of a rounding midpoint
may round either way in a correct kernel, and one such flip can move an output by more than the
bound. ``assert_within_rule(..., allowance=)`` takes, per output element, how far such choices may
move it (derived by :func:`evenflow.reference.moe.moe_requant_allowance`; zero elsewhere): each
element must be within the bound plus its allowance, and the baseline's error is counted net of it.
Integer metadata (plans, task maps, routing indices) is compared exactly.
"""
from __future__ import annotations

import torch

__all__ = ["assert_within_rule", "rule_check", "assert_exact", "poisoned", "error_bound"]

_ULP = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.bfloat16: 2.0**-7,
    torch.float16: 2.0**-10,
    torch.float8_e4m3fn: 2.0**-3,
}


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def error_bound(ref64: torch.Tensor, baseline: torch.Tensor, out_dtype: torch.dtype, factor: float = 2.0,
                allowance: torch.Tensor | None = None) -> float:
    """The largest error the rule allows (see module docstring). With ``allowance`` the baseline's own
    error is taken net of it element by element: a rounding choice the baseline makes is allowed once,
    by the allowance, not also multiplied into the bound."""
    ref64 = ref64.double().cpu()
    diff = (baseline.double().cpu() - ref64).abs()
    if allowance is not None:
        diff = (diff - allowance.double().cpu()).clamp_min(0.0)
    return factor * _max_abs(diff) + _ULP[out_dtype] * _max_abs(ref64)


def assert_within_rule(out: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor,
                       factor: float = 2.0, what: str = "output", allowance: torch.Tensor | None = None) -> float:
    """Assert ``out`` is within the tolerance rule (:func:`rule_check`); return the measured error."""
    msg, err, _ = rule_check(out, ref64, baseline, factor, what, allowance)
    assert not msg, msg
    return err


def rule_check(out: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, factor: float = 2.0,
               what: str = "output", allowance: torch.Tensor | None = None) -> tuple[str, float, float]:
    """The tolerance rule's check without raising: ("" or why ``out`` fails it, max |out - ref64|, the bound)
    (NaN where the shapes do not match; the error is NaN where ``out`` is not finite).

    ``ref64``: the oracle in float64. ``baseline``: the same math done by PyTorch in
    the precision evenflow works in (e.g. bf16 inputs, fp32 accumulation).
    ``allowance`` (optional, ``ref64``'s shape): what each output element may move beyond the
    rule for a reason the rule cannot see and that is derived, not chosen; the one such reason
    today is an intermediate rounded to fp8 that lies at a rounding midpoint
    (:func:`evenflow.reference.moe.moe_requant_allowance`). Each element must then satisfy
    ``|out - ref64| <= bound + allowance``.
    NaN or Inf anywhere in ``out`` fails, whatever the bound; so does any in ``ref64``, ``baseline`` or
    ``allowance`` (a NaN there would make the bound NaN or infinite and every output pass: compare the finite
    part, e.g. the rows a request fills, and check the rest on its own).
    """
    nan = float("nan")
    if out.shape != ref64.shape:
        return f"{what}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}", nan, nan
    for name, t in (("reference", ref64), ("baseline", baseline), ("allowance", allowance)):
        if t is not None and not bool(torch.isfinite(t.detach().double()).all()):  # (double: fp8 has no isfinite)
            return f"{what}: non-finite values in the {name}: the rule's bound would not bound anything", nan, nan
    if allowance is not None:
        if allowance.shape != ref64.shape:
            return f"{what}: allowance shape {tuple(allowance.shape)} != reference's", nan, nan
        if not allowance.any():
            allowance = None  # (bf16 weights: the plain rule, and its message)
    bound = error_bound(ref64, baseline, out.dtype, factor, allowance)
    outd = out.detach().double().cpu()
    bad = ~torch.isfinite(outd)
    if bad.any():
        return f"{what}: non-finite values at {torch.nonzero(bad)[:5].tolist()}", nan, bound
    diff = (outd - ref64.double().cpu()).abs()
    err = _max_abs(diff)
    if allowance is None:
        if err > bound:
            return f"{what}: max abs error {err:.3e} exceeds the rule's bound {bound:.3e}", err, bound
    else:
        excess = _max_abs((diff - allowance.double().cpu()).clamp_min(0.0))
        if excess > bound:
            return (f"{what}: an element's error beyond its allowance, {excess:.3e}, exceeds the rule's bound "
                    f"{bound:.3e} (max abs error {err:.3e})"), err, bound
    return "", err, bound


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "metadata") -> None:
    """Exact equality for integer metadata, with the first mismatches shown."""
    a, e = actual.detach().cpu(), expected.detach().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    if not torch.equal(a, e):
        bad = torch.nonzero(a != e)[:5].tolist()
        raise AssertionError(f"{what}: {int((a != e).sum())} mismatches, first at {bad}: "
                             f"{[a[tuple(i)].item() for i in bad]} != {[e[tuple(i)].item() for i in bad]}")


def assert_within_one_ulp(a: torch.Tensor, b: torch.Tensor, what: str = "output") -> None:
    """Two bf16 results of the same fp32 sums taken in another order (each rounded once to
    bf16) differ by at most one bf16 unit in the last place of the larger magnitude."""
    a, b = a.float().cpu(), b.float().cpu()
    big = torch.maximum(a.abs(), b.abs())
    ulp = torch.where(big > 0, torch.exp2(torch.floor(torch.log2(big.clamp_min(1e-30))) - 7), 0.0)
    over = (a - b).abs() - ulp
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), f"{what}: NaN"
    assert (over <= 0).all(), f"{what}: differ by more than one bf16 ulp (worst excess {float(over.max()):.3e})"


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN (floats) or a sentinel (ints), so unwritten elements fail."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        if dtype in (torch.float8_e4m3fn,):
            t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(-7777 if dtype != torch.uint8 else 0xAB)
    return t


def assert_fp32_gemm_within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str = "output") -> float:
    """``out`` ~ x @ w.T for an fp32-accumulating GEMM: the tolerance rule against the fp64
    product (baseline: the same product in fp32), and the analytic bound of any fp32
    summation order, |err| <= K * 2^-24 * |x| @ |w|.T elementwise. Returns the max error."""
    x64, w64 = x.cpu().double(), w.cpu().double()
    ref = x64 @ w64.t()
    base = x.cpu().float() @ w.cpu().float().t()
    err = assert_within_rule(out, ref, base, what=what)
    mag = x64.abs() @ w64.abs().t()
    excess = ((out.cpu().double() - ref).abs() - x.shape[1] * 2.0**-24 * mag).max().item()
    assert excess <= 0, f"{what}: analytic bound exceeded by {excess:.3e}"
    return err
