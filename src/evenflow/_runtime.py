"""Where evenflow's kernels run, and the few facts that depend on it.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is *decorated*,
so the choice between the GPU compiler and the CPU interpreter is made when
evenflow's kernel modules are imported. ``evenflow/__init__.py`` calls
:func:`select_backend` before importing any of them: without a CUDA device the
interpreter is switched on, so every operator still runs (slowly) on a CPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

# Set by ``evenflow._compile_check.emulate_gpu``: launchers then choose what they
# would choose on a GPU with this many SMs (constexpr switches, grid sizes) while the
# tensors stay on the CPU, so their launches can be recorded and compiled for sm_90.
_EMULATED_SMS: int | None = None


def emulating_gpu() -> bool:
    """True while launches are being recorded for a GPU compile check."""
    return _EMULATED_SMS is not None


# What select_backend found: whether the kernels evenflow decorates after it are interpreted. Triton fixes that for
# each kernel as it decorates it, so a later change of TRITON_INTERPRET changes nothing that runs; keeping the answer
# spares the environment read that launchers and checks made about 19 times a layer of an eager decode step (round
# CM's profile, docs/perf-notes.md "Host time of an eager call").
_INTERPRET: bool | None = None


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend() -> None:
    """Turn on the Triton interpreter when no CUDA device exists (idempotent), and keep the choice for
    :func:`interpreting`."""
    global _INTERPRET
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    _INTERPRET = _interpret_env()


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter: as ``TRITON_INTERPRET`` stood when
    :func:`select_backend` ran (``evenflow/__init__.py``, before any kernel module is imported)."""
    return _interpret_env() if _INTERPRET is None else _INTERPRET


def host_sync_allowed(t: torch.Tensor) -> bool:
    """Whether a look at ``t``'s values from the host may run now: never while torch.compile traces, nor while
    ``t``'s stream is captured into a CUDA graph (a sync there breaks the capture)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def kernel_device_ok(t: torch.Tensor) -> bool:
    """Kernels take CUDA tensors on a GPU and CPU tensors in the interpreter."""
    return t.device.type == ("cpu" if interpreting() else "cuda")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of two ints, for launchers' grids. ``triton.cdiv`` gives the same, but it is a
    ``constexpr_function`` in Triton 3.6, whose call from host code unwraps its arguments first: ~5 us a call
    under round CM's profile, several times a launch (docs/perf-notes.md, "Host time of an eager call")."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1), as ``triton.next_power_of_2`` gives it, without its
    ``constexpr_function`` wrapper's host cost (:func:`cdiv`). ``ValueError`` for ``n`` < 1 (Triton's gives 0 for 0,
    and a block of 0 is no block: a launcher asking for one has a bug)."""
    if n < 1:
        raise ValueError(f"next_power_of_2: n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


# Per CUDA device index: (compute capability, SM count). A device's properties do not change in a process, and
# launchers asked for them on every launch: ~25 us a time under round CM's profile of an eager generate.
_DEVICE_FACTS: dict[int, tuple[tuple[int, int], int]] = {}


def _device_facts(device) -> tuple[tuple[int, int], int]:
    dev = torch.device(device) if device is not None else torch.device("cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    facts = _DEVICE_FACTS.get(index)
    if facts is None:
        props = torch.cuda.get_device_properties(index)
        facts = _DEVICE_FACTS[index] = ((props.major, props.minor), props.multi_processor_count)
    return facts


def num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of ``device``; a small fixed count when interpreting.

    The interpreter runs programs one after another, so a persistent grid there
    only needs enough programs to exercise the multi-program logic.
    """
    if _EMULATED_SMS is not None:
        return _EMULATED_SMS
    if interpreting() or not torch.cuda.is_available():
        return 4
    return _device_facts(device)[1]


def dot_needs_fp32() -> bool:
    """The Triton 3.6 interpreter computes ``tl.dot`` of two bf16 operands wrongly.

    Kernels take this as a constexpr (``DOT_F32``) and upcast bf16 dot operands to
    fp32 through :func:`evenflow._kernels.common.dot_operand`. On a GPU it is False
    and the operands stay bf16 (tensor cores). ``tests/test_interpreter_workarounds.py``
    shows that the defect exists and that the upcast removes it.
    """
    return interpreting() and not emulating_gpu()


def cublas_fp32_is_reduced() -> bool:
    """Whether PyTorch lets cuBLAS run fp32 matmuls at reduced precision (TF32) now, by whichever of its two APIs
    set it: the per-backend ``fp32_precision`` (torch >= 2.9; reading the legacy flag raises once it is used) or
    ``allow_tf32`` / ``set_float32_matmul_precision``."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision not in ("ieee", "none")
    return bool(matmul.allow_tf32)


def fp8_cast_needs_rounding() -> bool:
    """The Triton 3.6 interpreter's cast to float8e4nv drops a binade on carry.

    Kernels take this as a constexpr (``FP8_ROUND``) and round to the e4m3 grid in
    fp32 first (:func:`evenflow._kernels.common.to_fp8e4`), after which the cast is
    exact. False on a GPU, where the hardware cast rounds correctly.
    """
    return interpreting() and not emulating_gpu()


def pdl_kwargs(pdl: bool) -> dict:
    """Launch keywords of a kernel that starts with ``pdl_enter(PDL)``: its PDL constexpr and,
    when on, Triton's ``launch_pdl`` launch option."""
    return {"PDL": bool(pdl), **({"launch_pdl": True} if pdl else {})}


def compiled_capability(device=None) -> tuple[int, int] | None:
    """Compute capability of the GPU that compiled kernels run on: (9, 0) while launches are
    recorded for an H200 (:func:`emulating_gpu`), None where nothing is compiled (the
    interpreter, no CUDA, a CPU device)."""
    if emulating_gpu():
        return (9, 0)
    if interpreting() or not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return None
    return _device_facts(dev)[0]


def pdl_supported(device=None) -> bool:
    """Whether kernels may use programmatic dependent launch (sm_90 and later, compiled code).

    With it, a kernel launched right after another starts its prologue while the first one
    finishes, and waits (``griddepcontrol.wait``) before touching memory; this hides the
    launch gap between two kernels of one operator. The interpreter runs no PTX.
    """
    cap = compiled_capability(device)
    return cap is not None and cap >= (9, 0)


def gpu_slug(name: str | None = None) -> str:
    """A GPU's short name: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb' (its first two words but
    the vendor's). It names the GPU's tuned-table file (``configs/<slug>.json`` of the router and of ``fused_moe``, as
    their tuners write it) and its folder under benchmarks/results/. Without a name: GPU 0's, or 'cpu'."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words[:2]) if words else "unknown"


def tuned_table_path(folder: str | os.PathLike, gpu_name: str) -> Path | None:
    """``folder/<gpu_slug(gpu_name)>.json`` where it is committed, else None (that GPU runs the heuristics)."""
    path = Path(folder) / f"{gpu_slug(gpu_name)}.json"
    return path if path.is_file() else None
