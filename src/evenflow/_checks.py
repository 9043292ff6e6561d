"""Argument checks for launchers. Every failure names the argument it is about."""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence

import torch

from evenflow._runtime import interpreting


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; raise TypeError/ValueError naming ``name``.

    ``shape`` entries that are None are not checked. ``device`` None means "the
    device kernels run on": CUDA on a GPU, CPU under the Triton interpreter.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
    else:
        want_type = "cpu" if interpreting() else "cuda"
        if t.device.type != want_type:
            raise ValueError(
                f"{name} is on {t.device}; evenflow kernels run on "
                f"{'the CPU (Triton interpreter)' if want_type == 'cpu' else 'a CUDA device'} here"
            )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    if last_dim_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension (got strides {t.stride()})")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All given tensors on one device; return it."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k} is on {v.device} but {items[0][0]} is on {dev}")
    return dev


FP32 = torch.finfo(torch.float32)


def check_out(name: str, out, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Validate a caller-provided output buffer."""
    check_tensor(name, out, dtypes=[dtype], shape=list(shape), device=device)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def check_bool(name: str, v, allow_none: bool = False):
    """``v`` a bool (not a truthy int, string or tensor), or None where ``allow_none``; returns it."""
    if not (isinstance(v, bool) or (allow_none and v is None)):
        raise TypeError(f"{name} must be a bool{' or None' if allow_none else ''}, got {v!r}")
    return v


def check_scaling(name: str, v, positive: bool = False, fp32: bool = False) -> float:
    """``v`` a finite real number (a bool is refused), above 0 where ``positive``, and within fp32's range where
    ``fp32`` (a number a kernel takes as an fp32, where a larger one would be inf); returns it as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if positive and f <= 0:
        raise ValueError(f"{name} must be > 0, got {f!r}")
    if fp32 and abs(f) > FP32.max:
        raise ValueError(f"{name} must be within fp32's range (|{name}| <= {FP32.max:.4g}: the kernels take it as "
                         f"an fp32), got {f!r}")
    return f


def check_fp32_scale(name: str, v) -> float:
    """``v`` (a scale the kernels take as an fp32 number; a Python number) a finite positive number in fp32's
    normal range: 0, below it (fp32 0 or subnormal, which the GPU flushes to 0), above it (inf), NaN or negative
    are refused by name. Returns it as a float."""
    try:
        f = float(v)
    except OverflowError:  # an int past float's range
        f = math.inf
    if not FP32.tiny <= f <= FP32.max:
        raise ValueError(f"{name} must be a finite positive number in fp32's normal range [{FP32.tiny:.4g}, "
                         f"{FP32.max:.4g}], got {f!r}")
    return f


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[first, past the last)`` a tensor's elements lie in (None when it has none)."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def check_no_overlap(name: str, out: torch.Tensor, /, **inputs) -> None:
    """``out`` (a buffer a kernel writes while it reads ``inputs``) shares no bytes with any of them (None
    skipped): the kernels' programs would read what others have written. The test is by span (the bytes from a
    tensor's first element to its last), so two views that interleave without sharing an element are refused
    too. Skipped while torch.compile traces (addresses are not traceable, and a fullgraph compile would fail): the
    custom op a compiled call runs checks the same at run time (:func:`checked_op`)."""
    if torch.compiler.is_compiling():
        return
    o = _span(out)
    if o is None:
        return
    for k, t in inputs.items():
        if t is None:
            continue
        r = _span(t)
        if r is not None and o[0] < r[1] and r[0] < o[1]:
            raise ValueError(f"{name} overlaps {k} in memory: the kernel would read what it writes (pass a "
                             "separate buffer)")


def check_int(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_sixteenths(name: str, v, lo: float, hi: float) -> int:
    """``v`` a number in [lo, hi] that is a whole number of sixteenths; returns ``16 * v`` as an int."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not (lo <= v <= hi and float(v * 16).is_integer()):
        raise ValueError(f"{name} must be a multiple of 1/16 in [{lo:g}, {hi:g}], got {v!r}")
    return int(v * 16)


def check_choice(name: str, v, choices: Sequence) -> None:
    if v not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {v!r}")


def check_pdl(pdl, device, allow_none: bool = True, name: str = "pdl") -> None:
    """``pdl`` (programmatic dependent launch, or another option that needs what it needs, called
    ``name``) is a bool (or None = automatic, where allowed), and True only where it can run
    (compiled kernels on an sm_90+ GPU)."""
    from evenflow._runtime import pdl_supported

    check_bool(name, pdl, allow_none)
    if pdl and not pdl_supported(device):
        raise ValueError(f"{name}=True: programmatic dependent launch needs compiled kernels on an sm_90+ GPU, "
                         f"not {device}" + ("; pass None (automatic) or False" if allow_none else "; pass False"))


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, rows: int, rows_of: str) -> torch.Tensor:
    """The values of a request-boundary tensor (one host sync): ``cu[0] == 0``, never decreasing, ``cu[-1] <=
    rows`` (the rows of ``rows_of``). Returns it as int64 on the CPU; ValueError names the first bad entry."""
    cu = cu_seqlens.long().cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    drops = (cu[1:] < cu[:-1]).nonzero()
    if drops.numel():
        b = int(drops[0, 0])
        raise ValueError(f"cu_seqlens_q must not decrease: cu_seqlens_q[{b + 1}] = {int(cu[b + 1])} < "
                         f"cu_seqlens_q[{b}] = {int(cu[b])}")
    if int(cu[-1]) > rows:
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu[-1])} is past the {rows} rows of {rows_of}")
    return cu


def checked_op(launch: Callable, check: Callable[[dict], None]) -> Callable:
    """``launch`` with ``check`` run first on its arguments (a dict of name -> value, defaults filled in).

    For the functions registered as ``torch.ops.evenflow.*`` custom ops: compiled code calls them, and so can
    anyone. The public functions check every argument before they call the launchers (eager calls skip the op,
    whose dispatch costs tens of microseconds), so these checks cover a direct call of an op with tensors of its
    caller's making: each tensor a kernel indexes, against the extents the launch derives from the others. They
    cannot see the values inside index tensors or a plan's buffers without a host sync; the kernels clamp or mask
    those where the public functions document it. The op's schema is ``launch``'s."""
    sig = inspect.signature(launch)

    @functools.wraps(launch)
    def op(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        check(bound.arguments)
        return launch(*args, **kwargs)

    # the schema from evaluated annotations (a module of ``from __future__ import annotations`` keeps them as
    # strings, which the op's inference would resolve in this module)
    op.__signature__ = inspect.signature(launch, eval_str=True)
    return op
