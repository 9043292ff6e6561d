"""The Triton 3.6 interpreter's fp32 -> bf16 cast, made to round as a GPU's does (used by tests/conftest.py).

The interpreter truncates these casts (an explicit ``.to(tl.bfloat16)`` and the cast of a store into a bf16
tensor alike): up to one bf16 ulp of error, half an ulp on average, where a GPU rounds to nearest even (at most
half an ulp). Kernels tested in the interpreter would carry an error the GPU never makes, and the tolerance rule
would have to absorb it. Unlike the fp8 and bf16-dot workarounds (constexpr switches inside the kernels, see
``evenflow._runtime``), this one patches the interpreter for the test session only, so no kernel changes for it;
``tests/test_interpreter_workarounds.py`` shows the truncation without it and torch's cast bit for bit with it.
"""
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as interp


def bf16_round_to_nearest() -> None:
    """Patch the interpreter's builder (idempotent); the truncating cast stays reachable as
    ``InterpreterBuilder.cast_impl.truncating``."""
    builder = interp.InterpreterBuilder
    if getattr(builder.cast_impl, "evenflow_rne", False):
        return
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.asarray(src.data, dtype=np.float32).view(np.uint32)
            # round to nearest, ties to even, on the 16 bits kept (a carry moves into the exponent; past the
            # largest bf16 it gives inf); NaNs stay NaN (quiet; the payload is not kept)
            rne = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            quiet = (bits >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0)
            return interp.TensorHandle(np.where(nan, quiet, rne).astype(np.uint16), dst_type.scalar)
        return truncating(self, src, dst_type)

    cast_impl.evenflow_rne = True
    cast_impl.truncating = truncating
    builder.cast_impl = cast_impl
