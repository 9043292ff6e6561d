"""Compile every kernel launch for a GPU target on a machine that has no GPU.

The Triton interpreter runs kernels as NumPy and cannot see GPU compile errors
(a non-constexpr global, a block shape the MMA lowering rejects, a loop-carried
dtype change). Triton's own compiler, though, runs without a GPU: it lowers to
PTX and assembles a cubin with the ptxas shipped in its wheel. This module joins
the two:

1. :func:`record_launches` runs launchers *under the interpreter* but, instead of
   executing each kernel, records what was launched: the kernel, every argument's
   type, every constexpr's value, ``num_warps``/``num_stages``. With
   :func:`emulate_gpu` active, launchers choose what they would choose on an H200
   (no interpreter workarounds, 132 SMs), so real GPU shapes can be recorded with
   CPU tensors (``torch.empty`` of a real size costs no time: nothing is executed).
2. :func:`compile_launches` compiles each distinct launch for ``sm_90`` in a fresh
   process with the interpreter off, and returns the failures.

``tests/test_sm90_compile.py`` drives every operator's launcher through its
configurations this way, in CI. Usage::

    with emulate_gpu(), record_launches() as launches:
        evenflow.decode_attention(...)          # CPU tensors, real shapes
    failures = compile_launches(launches)      # [] when everything compiled
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch

from evenflow import _runtime

__all__ = ["Launch", "record_launches", "emulate_gpu", "compile_launches", "compile_stats"]

_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.bool: "i1",
}
# Largest dynamic shared memory of one block (cudaDevAttrMaxSharedMemoryPerBlockOptin):
# the compiler accepts more and the launch then fails with "out of resource".
SHARED_LIMIT = {90: 232448, 100: 232448}
_COMPILE_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch, reduced to what the compiler needs."""

    module: str
    name: str
    file: str  # where to load the module from when it is not importable by name (tests)
    signature: tuple  # ((param, type-string), ...), type "constexpr" for constexprs
    constexprs: tuple  # ((param, value), ...)
    options: tuple  # ((option, value), ...)
    aligned: tuple = ()  # params a GPU launch would specialise as divisible by 16
    gluon: bool = False  # a Gluon kernel (``triton.experimental.gluon``), compiled from its own AST source

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.module}.{self.name}[{consts}; {opts}]"


def _is_constexpr(annotation) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return "constexpr" in annotation
    import triton.language as tl

    return annotation is tl.constexpr or getattr(annotation, "__name__", "") == "constexpr"


def _type_of(name: str, v) -> str:
    if isinstance(v, torch.Tensor):
        if v.dtype not in _TORCH_TO_TRITON:
            raise TypeError(f"argument {name}: no Triton type for {v.dtype}")
        return "*" + _TORCH_TO_TRITON[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(v).__name__} for a compile check")


def _make_launch(fn, args, kwargs, gluon: bool = False) -> Launch:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    values = {}
    for p, v in zip(params, args):
        values[p.name] = v
    options = {}
    for k, v in kwargs.items():
        if k in sig.parameters:
            values[k] = v
        elif k in _COMPILE_OPTIONS:
            options[k] = v
    signature, constexprs, aligned = [], [], []
    for p in params:
        if p.name not in values:
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: argument {p.name} was not passed")
            values[p.name] = p.default
        v = values[p.name]
        if _is_constexpr(p.annotation) or v is None:
            v = v.value if hasattr(v, "value") and not isinstance(v, torch.Tensor) else v
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, v))
        else:
            signature.append((p.name, _type_of(p.name, v)))
            if _divisible_by_16(v):
                aligned.append(p.name)
    return Launch(fn.__module__, fn.__name__, fn.__code__.co_filename, tuple(signature), tuple(constexprs),
                  tuple(sorted(options.items())), tuple(aligned), gluon)


def _divisible_by_16(v) -> bool:
    # What Triton's JIT specialises on a GPU (tt.divisibility = 16): 16-byte aligned
    # pointers and integers that are multiples of 16. Compiling without it gives other
    # code (no vectorised or pipelined copies, other shared memory and register counts).
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


@contextlib.contextmanager
def record_launches(execute: bool = False):
    """Record every interpreted kernel launch (and run it only if ``execute``).

    Gluon kernels (which the interpreter cannot run) are recorded too, when a launcher under
    :func:`emulate_gpu` picks one; with ``execute`` such a launch raises."""
    if not _runtime.interpreting():
        raise RuntimeError("record_launches needs the Triton interpreter (TRITON_INTERPRET=1)")
    from triton.runtime.interpreter import InterpretedFunction

    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:  # a Triton without Gluon: no Gluon launch to record
        GluonJITFunction = type("NoGluon", (), {"run": None})

    launches: list[Launch] = []
    original = InterpretedFunction.run
    original_gluon = GluonJITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(_make_launch(self.fn, args, kwargs))
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    def run_gluon(self, *args, grid, warmup, **kwargs):
        launches.append(_make_launch(self.fn, args, kwargs, gluon=True))
        if execute:
            raise RuntimeError(f"{self.fn.__name__} is a Gluon kernel: the interpreter cannot run it")
        return None

    InterpretedFunction.run = run
    GluonJITFunction.run = run_gluon
    try:
        yield launches
    finally:
        InterpretedFunction.run = original
        GluonJITFunction.run = original_gluon


@contextlib.contextmanager
def emulate_gpu(sms: int = 132):
    """Make launchers choose as on a GPU with ``sms`` SMs (see ``evenflow._runtime``)."""
    before = _runtime._EMULATED_SMS
    _runtime._EMULATED_SMS = sms
    try:
        yield
    finally:
        _runtime._EMULATED_SMS = before


def _to_json(launches) -> list[dict]:
    seen, out = set(), []
    for la in launches:
        if la in seen:
            continue
        seen.add(la)
        out.append({"module": la.module, "name": la.name, "file": la.file, "signature": dict(la.signature),
                    "constexprs": dict(la.constexprs), "options": dict(la.options), "aligned": list(la.aligned),
                    "gluon": la.gluon,
                    "describe": la.describe()})
    return out


def _run_worker(launches, arch: int, timeout: float, stats: bool):
    todo = _to_json(launches)
    if not todo:
        return []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(todo, f)
        path = f.name
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "evenflow._compile_check", path, str(arch)] + (["--stats"] if stats else [])
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        raise RuntimeError(f"compile worker crashed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compile_launches(launches, arch: int = 90, timeout: float = 1800.0) -> list[str]:
    """Compile each distinct launch for ``sm_<arch>`` in a fresh process; return failure messages."""
    try:
        return _run_worker(launches, arch, timeout, stats=False)
    except RuntimeError as e:
        return [str(e)]


def compile_stats(launches, arch: int = 90, timeout: float = 1800.0) -> list[dict]:
    """Compile each distinct launch and report what residency depends on.

    One dict per distinct launch: ``describe``, ``regs`` (per thread, from ptxas), ``spill_bytes`` (stores),
    ``shared`` (bytes per program), ``num_warps``, ``loops`` (SASS instruction counts per loop trip,
    :func:`sass_loops`), ``sequence`` (the whole kernel's SASS opcodes in address order, :func:`sass_guarded`),
    ``ops`` (the same counted by opcode), ``load_waves`` and ``loop_load_waves`` (memory round trips as built and
    as needed, :func:`load_waves`), ``mma`` (which MMA instructions the PTX uses, :func:`mma_counts`), ``marks``
    (:func:`ptx_marks`), ``mark_counts`` (:func:`ptx_mark_counts`), ``float_ops`` (:func:`ptx_float_ops`); or ``error``
    when the launch does not compile.
    """
    return _run_worker(launches, arch, timeout, stats=True)


def mma_counts(ptx: str) -> dict:
    """Static counts of Hopper warpgroup MMAs (``wgmma.mma_async``) and warp-level MMAs
    (``mma.sync``) in ``ptx``: which tensor-core path a kernel took. ``wgmma_types`` /
    ``mma_sync_types`` count them by operand types (``"e4m3.e4m3"``: fp8 at the fp8 rate;
    ``"f16.f16"``: e.g. e4m3 values upcast to f16)."""
    import collections
    import re

    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.\w+\.(\w+)\.(\w+)", ptx)
    ms = re.findall(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.\w+\.(\w+)\.(\w+)", ptx)
    return {"wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync"),
            "wgmma_types": dict(collections.Counter(f"{a}.{b}" for a, b in wg)),
            "mma_sync_types": dict(collections.Counter(f"{a}.{b}" for a, b in ms))}


PTX_MARKS = ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "ld.global", "cp.async", "atom.",
             "red.", "st.global", "prefetch.global.L2", "atom.global", "red.global")
# ("red." also matches "ld.shared" / "st.shared": "atom.global" and "red.global" name global atomics alone)


def ptx_marks(ptx: str) -> dict:
    """Where each of ``PTX_MARKS`` first occurs in the kernel body of ``ptx`` (character offset
    from ``.entry``, -1 if absent): the order of a kernel's PDL wait against its first memory
    operations, in straight-line code before any loop."""
    body = ptx[ptx.index(".entry"):]
    return {m: body.find(m) for m in PTX_MARKS}


def ptx_mark_counts(ptx: str) -> dict:
    """How often each of ``PTX_MARKS`` occurs in the kernel body of ``ptx`` (e.g. one PDL wait on every path that
    reaches one: a kernel whose early exit waits has two)."""
    body = ptx[ptx.index(".entry"):]
    return {m: body.count(m) for m in PTX_MARKS}


def ptx_float_ops(ptx: str) -> list[str]:
    """The kernel body's fp32 arithmetic and warp shuffles in PTX order, operands left out but a butterfly
    shuffle's lane offset: ``["mul.f32", "fma.rn.f32", "shfl.bfly 16", "add.f32", ...]``. Two builds whose
    sequences differ reduce in different trees (e.g. a different register layout of the same ``tl.sum``); the same
    sequence is the same operations in the same order (what the data layout feeds them aside)."""
    import re

    body = ptx[ptx.index(".entry"):]
    out = []
    for line in body.splitlines():
        m = re.match(r"\s*(?:@!?%\w+\s+)?((?:fma|mul|add|sub|neg|max|min)(?:\.\w+)*\.f32)\s", line)
        if m:
            out.append(m.group(1))
            continue
        m = re.match(r"\s*(?:@!?%\w+\s+)?shfl\.sync\.bfly\.b32\s+[^,]+,\s*[^,]+,\s*(\d+),", line)
        if m:
            out.append(f"shfl.bfly {m.group(1)}")
    return out


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that the bundled ptxas reports for ``ptx``."""
    import re

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spill = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return (int(regs[-1]) if regs else -1), (int(spill[-1]) if spill else 0)


def sass_text(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin (the tool in Triton's wheel)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.cubin")
        with open(src, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", src], capture_output=True, text=True, check=True).stdout


def sass_guarded(text: str) -> list[tuple[int, str, str, str]]:
    """SASS text as (address, guard predicate or "", opcode, operands) (the opcode stops at the first lower-case
    letter: ``HGMMA.64`` + ``x128x16.F32 R24, ...``)."""
    import re

    insts = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            insts.append((int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4).strip()))
    return insts


# opcodes that write no register (their first operand is a source)
_NO_DEST = ("ST", "RED.", "BAR", "BRA", "EXIT", "ACQBULK", "PREEXIT", "NOP", "DEPBAR", "LDGDEPBAR", "CCTL",
            "MEMBAR", "FENCE", "ERRBAR", "WARPSYNC", "RET", "CALL", "YIELD", "BSSY", "BSYNC", "LDGSTS", "UTMA")
# global memory reads whose result lands in a register: loads and returning atomics. Not LDGSTS (asynchronous
# copies: waited on by DEPBAR, not by a read of their register), nor shared-memory reads (LDS, ATOMS)
_GLOBAL_LOADS = ("LDG.", "LD.", "ATOMG.", "ATOM.")


def _is_pred(operand: str) -> bool:
    """A predicate operand (``P0``, ``!P3``, ``PT``, ``UP1``, ``UPT``)."""
    import re

    return re.fullmatch(r"!?U?P(\d|T)", operand.strip()) is not None


def _regs(operand: str, width: int = 1) -> list[str]:
    """The registers an operand names (``R4``, ``R2.64`` as R2 R3, ``UR6``, ``P0``, ``UP1``; never RZ / PT; ``PR``,
    all of P0-P6 at once, as P2R / R2P move them), a register operand widened to ``width`` consecutive registers."""
    import re

    out = []
    for name, wide in re.findall(r"(?<![A-Za-z0-9_])(U?R\d+|U?P\d)(\.64)?(?![0-9])", operand):
        if name.lstrip("U").startswith("R"):
            prefix, base = name[:len(name) - len(name.lstrip("UR"))], int(name.lstrip("UR"))
            out += [f"{prefix}{base + i}" for i in range(max(width, 2 if wide else 1))]
        else:
            out.append(name)
    for prefix in re.findall(r"(?<![A-Za-z0-9_])(U?)PR(?![A-Za-z0-9_])", operand):
        out += [f"{prefix}P{i}" for i in range(7)]
    return out


def _dest_width(op: str, args: str) -> int:
    """Registers a destination operand of ``op`` covers."""
    import re

    if op.startswith("HGMMA"):  # HGMMA.64 + x<N>x<K>.<acc>: a warpgroup's 64 x N accumulator, N / 2 fp32 a thread
        m = re.match(r"x(\d+)x\d+\.(F32|F16)", args)
        return int(m.group(1)) // (2 if m.group(2) == "F32" else 4) if m else 1
    if op.startswith("HMMA"):  # HMMA.<shape>.<acc>[.<inputs>]: m16n8 accumulator, 4 fp32 or 2 x f16x2 registers
        parts = op.split(".")
        return 4 if len(parts) > 2 and parts[2] == "F32" else 2
    if op.startswith("LDSM"):  # LDSM.16.M88.<n> / .MT88.<n>: n matrices, a register each
        m = re.search(r"\.(\d)$", op)
        return int(m.group(1)) if m else 1
    if op.startswith("CS2R"):
        return 1 if ".32" in op else 2
    if ".128" in op:
        return 4
    if ".64" in op or "WIDE" in op or op.startswith(("DADD", "DMUL", "DFMA", "F2F.F64", "I2F.F64")):
        return 2
    return 1


def _src_widths(op: str, n: int) -> list[int]:
    """Registers each of ``n`` register source operands of ``op`` covers (the 64-bit addend of ``.WIDE``, the MMA
    fragments, fp64 operands; one elsewhere)."""
    if op.startswith("HMMA"):
        acc = _dest_width(op, "")
        return ([4, 2, acc] + [1] * n)[:n]
    if op.startswith(("DADD", "DMUL", "DFMA", "DSETP")):
        return [2] * n
    if "WIDE" in op and n:
        return [1] * (n - 1) + [2]
    return [1] * n


def _backward_branches(insts: list[tuple[int, str, str, str]]) -> list[tuple[int, int]]:
    """(target, branch address) of every backward branch: the loops of straight-line SASS."""
    import re

    loops = []
    for addr, _, op, args in insts:
        tgt = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if tgt is not None and int(tgt.group(1), 16) < addr:
            loops.append((int(tgt.group(1), 16), addr))
    return loops


def loop_load_waves(insts: list[tuple[int, str, str, str]]) -> list[dict]:
    """:func:`load_waves` of each loop's body on its own (values from before the loop count as ready): one dict a
    loop with global loads, ``start`` / ``end`` (addresses), ``instructions``, ``loads``, ``needed`` and ``issued``
    (the most over its loads: the round trips one trip of the loop costs against those its data need) and ``late``
    (its loads issued behind a wait they do not depend on: a trip can need 2 for one chain and still lose one on
    another load, which the maxima do not show). A loop nested in another is counted in both."""
    out = []
    for a, b in sorted(set(_backward_branches(insts))):
        body = [i for i in insts if a <= i[0] <= b]
        waves = load_waves(body)
        if waves:
            out.append({"start": a, "end": b, "instructions": len(body), "loads": len(waves),
                        "needed": max(w["needed"] for w in waves), "issued": max(w["issued"] for w in waves),
                        "late": sum(w["issued"] > w["needed"] for w in waves)})
    return out


def load_waves(insts: list[tuple[int, str, str, str]]) -> list[dict]:
    """Dependent memory round trips of each global load in straight-line SASS (:func:`sass_guarded`), as built
    and as the data allow: one dict a load, ``address``, ``opcode``, ``needed`` (1 + the most round trips behind
    any load its address or guard derives from: what the data force), ``issued`` (1 + the most round trips of any
    load whose result, or a value derived from it, an instruction before it reads: a warp waits for a load at the
    first read of its result, so a load issued after that read starts only once the other returned) and
    ``in_loop`` (between a backward branch's target and the branch: a loop's loads for its next trip come after
    this trip's reads by design). ``issued > needed`` outside loops marks a load the scheduler put behind a wait
    it does not depend on: its latency runs after another's instead of beside it (round BO: ptxas did this to
    the router's one-block x loads and to the MoE reduce's rows). The code is read in address order: a load
    after a loop counts the loop's reads as waits, which the source order may force (a GEMM's epilogue loads
    after its K loop), and a read in a branch not taken counts too. Only data dependences are followed: a load
    that a branch on a loaded value orders (the partials a K split's last arrival reads after its arrival atomic)
    reads as late though it cannot move. Registers are tracked by name, predicates
    included (``PR`` as all of them), and returning atomics count as loads; an approximation of the scoreboard,
    for reading builds, not a simulator."""
    loops = _backward_branches(insts)
    taint: dict[str, frozenset] = {}  # register -> the loads its value derives from
    needed: dict[int, int] = {}
    issued: dict[int, int] = {}
    waited = 0  # the most round trips of any load read so far
    out = []
    for addr, guard, op, args in insts:
        operands = [a.strip() for a in args.split(",")] if args else []
        # destinations: the first operand, and the second where either is a predicate (ISETP P0, PT / LOP3.LUT
        # P0, R5 / SHFL PT, R10 / ATOMG PT, R2 / IADD3 R2, P0 / LEA R4, P1); memory operands are never written
        n_dest = 0
        if operands and not op.startswith(_NO_DEST):
            n_dest = 2 if len(operands) > 1 and (_is_pred(operands[0]) or _is_pred(operands[1])) else 1
        dests = [o for o in operands[:n_dest] if "[" not in o]
        srcs = [o for o in operands[n_dest:]] + [o for o in operands[:n_dest] if "[" in o]
        widths = iter(_src_widths(op, sum(1 for o in srcs if _regs(o))))  # one a source operand that names registers
        src_regs = [r for o in srcs for r in (_regs(o, next(widths)) if _regs(o) else [])] + _regs(guard)
        deps = frozenset().union(*(taint.get(r, frozenset()) for r in src_regs))
        if deps:
            waited = max(waited, max(issued[d] for d in deps))
        is_load = op.startswith(_GLOBAL_LOADS)
        if is_load:
            needed[addr] = 1 + max((needed[d] for d in deps), default=0)
            issued[addr] = 1 + waited
            out.append({"address": addr, "opcode": op, "needed": needed[addr], "issued": issued[addr],
                        "in_loop": any(a <= addr <= b for a, b in loops)})
        value = frozenset((addr,)) if is_load else deps
        for operand in dests:
            for r in _regs(operand, _dest_width(op, args)):
                taint[r] = value | taint.get(r, frozenset()) if guard else value
    return out


def sass_loop_bodies(cubin: bytes) -> list[list[tuple[str, str]]]:
    """The loops of a cubin's SASS (:func:`sass_guarded`), largest first: one list per backward branch of its
    body's instructions from the branch target to the branch, each as (opcode, operands)."""
    return _loop_bodies(sass_guarded(sass_text(cubin)))


def _loop_bodies(insts: list[tuple[int, str, str, str]]) -> list[list[tuple[str, str]]]:
    loops = [[(op, args) for ad, _, op, args in insts if a <= ad <= b] for a, b in _backward_branches(insts)]
    return sorted(loops, key=lambda body: -len(body))


def sass_loops(cubin: bytes) -> list[dict]:
    """The loops of a cubin's SASS: one dict per backward branch, largest first.

    ``instructions``: SASS instructions from the branch target to the branch (one trip of the
    loop body, the branch included); ``ops``: how many of them each opcode is (``LDS.U8``,
    ``HMMA.16816.F32``, ...). This is what an issue-bound loop's speed depends on.
    """
    return _loop_stats(sass_guarded(sass_text(cubin)))


def _loop_stats(insts: list[tuple[int, str, str, str]]) -> list[dict]:
    import collections

    return [{"instructions": len(body), "ops": dict(collections.Counter(op for op, _ in body).most_common())}
            for body in _loop_bodies(insts)]


def _compile_main(path: str, arch: int, stats: bool = False) -> None:
    import collections
    import importlib
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for item in json.load(open(path)):
        try:
            module = importlib.import_module(item["module"])
        except ImportError:
            spec = importlib.util.spec_from_file_location(item["module"], item["file"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[item["module"]] = module
            spec.loader.exec_module(module)
        fn = getattr(module, item["name"])
        try:
            # the JIT skips the alignment specialisation on do_not_specialize parameters
            plain = {p.name for p in getattr(fn, "params", []) if p.do_not_specialize}
            names = list(item["signature"])
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                     if n in item.get("aligned", ()) and n not in plain}
            if item.get("gluon"):
                from triton.experimental.gluon._runtime import GluonASTSource as source
            else:
                source = ASTSource
            src = source(fn=fn, signature=item["signature"], constexprs=item["constexprs"], attrs=attrs)
            compiled = triton.compile(src, target=target, options=item["options"])
            if stats:
                regs, spill = _ptxas_usage(compiled.asm["ptx"], arch)
                sass = sass_guarded(sass_text(compiled.asm["cubin"]))  # one disassembly for every SASS reading
                sequence = [op for _, _, op, _ in sass]
                failures.append({"describe": item["describe"], "regs": regs, "spill_bytes": spill,
                                 "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
                                 "loops": _loop_stats(sass), "sequence": sequence,
                                 "ops": dict(collections.Counter(sequence)), "load_waves": load_waves(sass),
                                 "loop_load_waves": loop_load_waves(sass),
                                 "mma": mma_counts(compiled.asm["ptx"]), "marks": ptx_marks(compiled.asm["ptx"]),
                                 "mark_counts": ptx_mark_counts(compiled.asm["ptx"]),
                                 "float_ops": ptx_float_ops(compiled.asm["ptx"])})
                continue
            if compiled.metadata.shared > SHARED_LIMIT.get(arch, SHARED_LIMIT[90]):
                failures.append(f"{item['describe']}: needs {compiled.metadata.shared} B of shared memory, "
                                f"sm_{arch} gives a block at most {SHARED_LIMIT.get(arch, SHARED_LIMIT[90])} B")
        except Exception as e:  # report every failure, not just the first
            msg = str(e).strip().splitlines()[-12:]
            inner, seen = e, {id(e)}  # a CompilationError names the call site; what failed is its innermost cause
            while True:
                nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
                if nxt is None or id(nxt) in seen:
                    break
                inner = nxt
                seen.add(id(nxt))
            if inner is not e:
                msg += [f"caused by {type(inner).__name__}:"] + str(inner).strip().splitlines()[-12:]
            text = f"{item['describe']}: {type(e).__name__}: " + "\n".join(msg)
            failures.append({"describe": item["describe"], "error": text} if stats else text)
    print(json.dumps(failures))


if __name__ == "__main__":
    if _runtime.interpreting():
        raise SystemExit("run with TRITON_INTERPRET=0")
    _compile_main(sys.argv[1], int(sys.argv[2]), stats="--stats" in sys.argv[3:])
