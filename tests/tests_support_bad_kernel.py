"""Two kernels for test_sm90_compile: one the GPU compiler rejects, one it accepts."""
import triton
import triton.language as tl

TWO = 2.0  # a plain global: the interpreter reads it, the GPU compiler refuses it
TWO_C = tl.constexpr(2.0)  # the correct spelling


@triton.jit
def bad_kernel(x_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o) + TWO)


@triton.jit
def good_kernel(x_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o) * 0.0 + TWO_C)
