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


def exact_dots() -> None:
    """Patch the interpreter's ``tl.dot`` (idempotent) to sum each output element in fp64 and round it once to the
    accumulator's dtype, so an element's value does not depend on the shape of the tile it is computed in.

    The interpreter hands a dot to ``np.matmul`` in fp32, and which OpenBLAS kernel runs it (and so in what order
    each element's products are added) depends on the operands' shapes and on the machine: on an AVX2-only CPU a
    64-row and a 128-row tile gave one element two different fp32 sums, so the tests that compare loop forms or
    tilings bit for bit (prefill's row blocks, the MoE's tiles, the router's batch invariance) held on one machine
    and failed on another. Products of bf16, f16 or fp8 values are exact in fp64 and so are their sums at the
    tests' sizes (a few hundred terms of 16-bit products), so each element is the correctly rounded sum of its
    products, whatever the tile. Operands of other dtypes (integers) take the interpreter's own dot."""
    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "evenflow_exact", False):
        return
    plain = builder.create_dot
    floats = (np.float16, np.float32, np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interp._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interp._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        acc = d.data.dtype
        if a_data.dtype not in floats or b_data.dtype not in floats or acc not in floats:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a_data.astype(np.float64), b_data.astype(np.float64))
        return interp.TensorHandle(exact.astype(acc) + d.data, d.dtype.scalar)

    create_dot.evenflow_exact = True
    create_dot.plain = plain
    builder.create_dot = create_dot
