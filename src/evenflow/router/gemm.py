"""Router GEMM at FP32 fidelity on BF16 tensor cores: weight split, launcher, dispatch.

The split (done once, at load time)::

    w_hi = bf16(w)                    # round to nearest even (torch's cast)
    w_lo = bf16((w - w_hi) * 256)     # w - w_hi is exact in fp32; *256 is exact
    w   ~= w_hi + w_lo / 256          # |w - (w_hi + w_lo/256)| <= 2^-17 |w|
    w_lo2 = bf16(((w - w_hi) * 256 - w_lo) * 256)          # third term (terms=3, the default)
    w   ~= w_hi + (w_lo + w_lo2 / 256) / 256               # <= 2^-26 |w|: all 24 bits of fp32

Three terms are the default: the two-term split (2^-17) made about twice the top-k
flips of FP32 cuBLAS in simulation (its representation error, std ~3e-6 at K=4096,
is twice FP32's accumulation error); three terms represent every normal fp32 weight
exactly, for 1.5x the weight bytes of fp32 (docs/perf-notes/router.md). ``terms=2`` keeps
the faster two-product form for callers that accept 2^-17.

Why round-to-nearest rather than the truncation the HPC-Ops write-up describes:
nearest halves both rounding steps, so the two-term bound is 2^-17 |w| instead of
2^-15 |w| for truncation — two bits for the same work. (Derivation in
docs/perf-notes/router.md and tests/test_router_gemm.py.)

Stale split: ``RouterWeight`` remembers the source tensor's version counter and data
pointer. If the source is modified in place (``w.copy_(...)``, an optimizer step, a
weight reload) the next call raises ``RuntimeError`` — or re-splits when the weight
was made with ``auto_refresh=True``. The check is a host-side integer compare (no
sync); it is skipped while ``torch.compile`` traces. A re-split checks the source as the
constructor does and may take a new shape (``w.data = ...``): every call checks its inputs
against the fresh split. Writes that bypass the version counter cannot be seen: through
``w.data`` (``param.data.copy_(...)``), a NumPy view, or a collective that writes into the tensor
(``torch.distributed.broadcast`` / ``all_reduce``, as weight syncs between trainer and server do:
they leave ``_version`` as it was). Call ``refresh()`` after those (until
then the bf16 paths would read the old split and the fp32 paths the new weight; a table entry with launch
``pdl-preload`` reads the fp32 weight before waiting for the kernel ahead, so a call right after such a
write needs ``refresh()`` first or ``prefetch_weights=False``: see ``router_gemm``). An inference
tensor (made under ``torch.inference_mode``) has no version counter and is refused. A re-split of the
same shape writes the new parts over the old ones in place, so a CUDA graph captured before it reads the
new split on its next replay (a replay runs no host check: call ``refresh()`` after updating the weight);
a new shape allocates new parts, and graphs captured before must be captured again.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from evenflow import _runtime
from evenflow._checks import (
    check_bool,
    check_choice,
    check_int,
    check_no_overlap,
    check_out,
    check_pdl,
    check_tensor,
    checked_op,
)
from evenflow.router.dispatch import (
    INVARIANT_PATHS,
    GemmConfig,
    choose_config,
    device_facts,
    launch_shape,
    smem_limit,
    split_red_chunk,
    splitk_red_chunk,
)
from evenflow.router.kernels import (
    router_gemm_fp32_kernel,
    router_gemm_fp32_splitk_kernel,
    router_gemm_kernel,
    zero_out_kernel,
)

__all__ = ["RouterWeight", "router_gemm", "split_weight"]

LO_SCALE = 256.0


def split_weight(w: torch.Tensor, terms: int = 2) -> tuple[torch.Tensor, ...]:
    """(w_hi, w_lo) or, with ``terms=3``, (w_hi, w_lo, w_lo2) of an fp32 weight; bf16, w's shape.

    The default is DESIGN.md's two-term split; :class:`RouterWeight` takes three terms unless told otherwise.

    Every step is exact in fp32 except the bf16 roundings (see module docstring).
    """
    check_int("terms", terms, 2, 3)
    w_hi = w.to(torch.bfloat16)
    r = (w - w_hi.float()) * LO_SCALE
    w_lo = r.to(torch.bfloat16)
    if terms == 2:
        return w_hi.contiguous(), w_lo.contiguous()
    w_lo2 = ((r - w_lo.float()) * LO_SCALE).to(torch.bfloat16)
    return w_hi.contiguous(), w_lo.contiguous(), w_lo2.contiguous()


class RouterWeight:
    """An fp32 router weight ``[N, K]`` split once into bf16 parts, plus workspace.

    ``terms``: 3 (default, exact for normal fp32 weights) or 2 (2^-17 |w|, fewer bytes/FLOPs).
    ``auto_refresh``: re-split when the source changed in place, instead of raising.
    Keep one ``RouterWeight`` per stream: the split-K workspace is reused by every call.
    Before capturing a CUDA graph or compiling with torch.compile, call
    ``reserve(max_tokens)``: it allocates the workspace and resolves the dispatch for
    every M up to ``max_tokens``, so nothing grows or is looked up inside the capture.
    """

    def __init__(self, w: torch.Tensor, *, terms: int = 3, auto_refresh: bool = False):
        _check_source(w)
        self.terms = check_int("terms", terms, 2, 3)
        self.auto_refresh = check_bool("auto_refresh", auto_refresh)
        self.source = w
        self._part = torch.empty(0, dtype=torch.float32, device=w.device)
        self._count = torch.zeros(0, dtype=torch.int32, device=w.device)
        self._logits = torch.zeros(0, dtype=torch.float32, device=w.device)  # route's (logits_buffer)
        self._logits_view = self._logits.view(0, 0)  # logits_buffer's last view, handed back while its shape fits
        # route's eager calls keep the logits buffer all zero between calls until one is captured in a CUDA graph
        self.zeros_kept = True
        self._facts = device_facts(w.device)
        self._smem = smem_limit(w.device)
        # compiled kernels on sm_90+ (programmatic dependent launch): looked up once, not on every call
        self.pdl_supported = _runtime.pdl_supported(w.device)
        self._configs: dict[tuple[int, bool], GemmConfig] = {}
        self._split()

    def _split(self) -> None:
        w = self.source
        with torch.no_grad():  # a Parameter's split parts carry no autograd history
            parts = split_weight(w, self.terms)
            # one look from the host: a NaN / Inf in w, or a finite entry past bf16's range, makes the high part
            # non-finite (the low parts are finite wherever it is)
            if not bool(torch.isfinite(parts[0]).all()):
                if not bool(torch.isfinite(w).all()):
                    raise ValueError("w must be finite (NaN/Inf in a router weight)")
                raise ValueError(f"w: entries up to {float(w.abs().max()):.4g} in magnitude; the split's high part is "
                                 f"bf16, whose largest finite value is {torch.finfo(torch.bfloat16).max:.4g}")
            old = getattr(self, "parts", None)
            if old is not None and all(o.shape == p.shape for o, p in zip(old, parts)):
                for o, p in zip(old, parts):  # in place: graphs captured before keep reading live tensors
                    o.copy_(p)
                parts = old
            self.parts = parts
        self.w_hi, self.w_lo = self.parts[0], self.parts[1]
        self.w_lo2 = self.parts[2] if self.terms == 3 else None
        self._shape = tuple(self.w_hi.shape)  # (N, K), read several times a call
        self._version = w._version
        self._ptr = w.data_ptr()

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def device(self) -> torch.device:
        return self.w_hi.device

    def check_fresh(self) -> None:
        """Raise (or re-split, with auto_refresh) if the source weight changed since the split."""
        if torch.compiler.is_compiling():
            return
        w = self.source
        if w._version != self._version or w.data_ptr() != self._ptr:
            if self.auto_refresh:
                self.refresh()
                return
            raise RuntimeError(
                "RouterWeight is stale: its source weight was modified in place after the split; "
                "make a new RouterWeight, call .refresh(), or construct it with auto_refresh=True")

    def refresh(self) -> None:
        """Re-split from the (modified) source weight (checked as the constructor checks it; it may have a new
        shape). The same shape: the parts are written in place (a CUDA graph captured before reads them on its
        next replay); a new shape: new parts, and the graphs must be captured again."""
        w = self.source
        _check_source(w)
        if w.device != self.device:
            raise ValueError(f"w moved from {self.device} to {w.device} since the split; make a new RouterWeight")
        if tuple(w.shape) != self.shape:
            self._configs.clear()  # the dispatch's choices were for the old N and K
        self._split()

    def reserve(self, max_tokens: int) -> None:
        """Allocate workspace for up to ``max_tokens`` rows (all configs the dispatch may pick)."""
        check_int("max_tokens", max_tokens, 1)
        # Each config is sized for the largest M that dispatches to it (a small-M split-K
        # config sized at max_tokens rows would hold ~100 MB of partials for nothing).
        # (and for both settings of torch.use_deterministic_algorithms, which may change after the capture)
        largest = {self.config(m, inv, det): m for inv in (False, True) for det in (False, True)
                   for m in range(1, max_tokens + 1)}
        for c, m in largest.items():
            self.workspace(m, c)
        self.logits_buffer(max_tokens)

    def config(self, m: int, batch_invariant: bool = False, deterministic: bool | None = None) -> GemmConfig:
        """The dispatch's choice for ``m`` rows, memoised (``reserve`` fills it for torch.compile). ``deterministic``
        (default: ``torch.are_deterministic_algorithms_enabled()``): a table entry that sums its K slices with float
        atomics runs with the counter's in-order sum instead (the same tile and split)."""
        det = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
        key = (m, bool(batch_invariant), det)
        cfg = self._configs.get(key)
        if cfg is None:
            n, k = self.shape
            cfg = choose_config(m, n, k, self.device, batch_invariant, self._facts, self.terms)
            if det and cfg.reduce == "atomic":
                cfg = replace(cfg, reduce="counter")
            cfg = cfg.fit_smem(self.terms, self._smem)
            self._configs[key] = cfg
        return cfg

    def workspace(self, m: int, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials, counters) big enough for ``m`` rows under ``cfg``; grown, never shrunk.

        One pair serves every split-K path and every M: a launch writes the partials it
        reads back and leaves the counters it used at zero. (Growing replaces the tensors:
        a CUDA graph captured before would keep the old addresses; ``reserve`` first.)
        """
        n, k = self.shape
        need_part, need_count = cfg.workspace_sizes(m, n, k)
        if self._part.numel() < need_part:
            self._part = torch.empty(need_part, dtype=torch.float32, device=self.device)
        if self._count.numel() < need_count:
            self._count = torch.zeros(need_count, dtype=torch.int32, device=self.device)
        return self._part, self._count

    def logits_buffer(self, m: int) -> torch.Tensor:
        """``route``'s fp32 logits ``[m, N]``: a view of one buffer, grown (never shrunk) for larger ``m``. While
        ``zeros_kept`` (until a ``route`` call of this weight is captured in a CUDA graph) it holds zeros between
        ``route`` calls (the top-k kernel writes them back over what it read), which an eager atomic split-K GEMM adds
        into without a zeroing kernel: write nothing into it."""
        n, _ = self.shape
        compiling = torch.compiler.is_compiling()  # a traced call takes its view of the buffer itself
        if self._logits_view.shape == (m, n) and not compiling:
            return self._logits_view  # the last call's: no slice and view a call (round CO, host time)
        if self._logits.numel() < m * n:
            self._logits = torch.zeros(m * n, dtype=torch.float32, device=self.device)
        view = self._logits[: m * n].view(m, n)
        if not compiling:
            self._logits_view = view
        return view

    def __repr__(self) -> str:
        n, k = self.shape
        return (f"RouterWeight(N={n}, K={k}, terms={self.terms}, device={self.device}, "
                f"auto_refresh={self.auto_refresh})")


def _check_source(w) -> None:
    check_tensor("w", w, dtypes=[torch.float32], ndim=2, contiguous=True)
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"w must have N >= 1 and K >= 1, got shape {tuple(w.shape)}")
    if w.is_inference():
        raise ValueError("w is an inference tensor (made under torch.inference_mode): it has no version counter, "
                         "so a change in place could not be detected; build the RouterWeight from a tensor made "
                         "outside inference_mode")


# ----------------------------------------------------------------------------- custom op

def _launch_split(x: torch.Tensor, w_hi: torch.Tensor, w_lo: torch.Tensor, w_lo2: torch.Tensor,
                  out: torch.Tensor, part: torch.Tensor, count: torch.Tensor, num_terms: int, block_m: int,
                  block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int, pdl: bool,
                  prefetch_w: bool, w_fp32: bool = False, atomic: bool = False, preload_w: bool = False,
                  out_zeroed: bool = False) -> None:
    # num_terms == 2: w_lo2 is never read (callers pass w_lo in its place).
    # w_fp32 (path fp32-tc): w_hi is the fp32 weight, split in registers; w_lo / w_lo2 are never read.
    # atomic: reduce="atomic" (out zeroed first, the slices' partials added into it; no workspace read)
    # preload_w (launch "pdl-preload", fp32-tc): where every K slice is one BLOCK_K step, that step's weight loaded
    # before the PDL wait (the kernel's loop-free PRELOAD_W build); elsewhere the L2 prefetch in its place.
    # out_zeroed: out holds zeros already (route's logits buffer), so an atomic launch adds into it without the
    # zeroing kernel
    m, k = x.shape
    n = w_hi.shape[0]
    if preload_w and not w_fp32:
        raise ValueError("preload_w needs the fp32 weight (w_fp32: path fp32-tc)")
    if m == 0:
        return
    k_split, split, grid = launch_shape(m, n, k, block_m, block_n, block_k, split_k)
    preload = preload_w and k_split == block_k  # else the L2 prefetch in its place
    _zero_or_check_workspace(atomic, out, pdl, part, count, split, split * m * n, grid[0], out_zeroed)
    router_gemm_kernel[grid](
        x, w_hi, w_lo, w_lo2, out, part, count,
        m, n, k, k_split, split,
        x.stride(0), w_hi.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SPLIT=split > 1,
        EVEN_K=(k % block_k == 0), NUM_TERMS=num_terms, DOT_F32=_runtime.dot_needs_fp32(),
        RED_CHUNK=split_red_chunk(block_m, block_n, num_warps, split),
        PREFETCH_W=(prefetch_w or preload_w) and not preload, W_FP32=w_fp32, RED_ATOMIC=atomic and split > 1,
        PRELOAD_W=preload, num_warps=num_warps, num_stages=num_stages, **_runtime.pdl_kwargs(pdl),
    )


# zero_out_kernel's tile: one program covers 16 rows of up to 512 columns (the router's N), 4 warps
_ZERO_BLOCK_M, _ZERO_BLOCK_N = 16, 512


def _zero_out(out: torch.Tensor, pdl: bool) -> None:
    """``out.zero_()`` as a kernel of ours ahead of an atomic split-K launch: under PDL it lets the GEMM launch
    first and waits for the kernel ahead before writing (``zero_out_kernel``); a memset would do neither."""
    m, n = out.shape
    zero_out_kernel[(_runtime.cdiv(m, _ZERO_BLOCK_M), _runtime.cdiv(n, _ZERO_BLOCK_N))](
        out, m, n, out.stride(0), BLOCK_M=_ZERO_BLOCK_M, BLOCK_N=_ZERO_BLOCK_N, num_warps=4,
        **_runtime.pdl_kwargs(pdl))


def _launch_fp32_splitk(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, part: torch.Tensor,
                        count: torch.Tensor, block_m: int, block_n: int, block_k: int, split_k: int,
                        num_warps: int, num_stages: int, pdl: bool, prefetch_w: bool, atomic: bool = False,
                        out_zeroed: bool = False) -> None:
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return
    k_split, split, grid = launch_shape(m, n, k, block_m, block_n, block_k, split_k)
    _zero_or_check_workspace(atomic, out, pdl, part, count, split, grid[0] * split * block_m * block_n,
                             grid[0], out_zeroed)  # (tile-major, padded)
    router_gemm_fp32_splitk_kernel[grid](
        x, w, out, part, count,
        m, n, k, k_split, split,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SPLIT=split > 1, EVEN_K=(k % block_k == 0),
        RED_CHUNK=splitk_red_chunk(block_m, block_n, num_warps), NUM_STAGES=num_stages, PREFETCH_W=prefetch_w,
        RED_ATOMIC=atomic and split > 1, num_warps=num_warps, num_stages=num_stages, **_runtime.pdl_kwargs(pdl),
    )


def _zero_or_check_workspace(atomic: bool, out: torch.Tensor, pdl: bool, part: torch.Tensor, count: torch.Tensor,
                             split: int, need_part: int, need_count: int, out_zeroed: bool = False) -> None:
    """Ahead of a split-K launch of ``split`` slices: with atomics (and more than one slice) zero ``out`` (unless
    ``out_zeroed``: it holds zeros already), which then takes the slices' sums, and read no workspace; else check the
    workspace the counter's reduction indexes."""
    if atomic and split > 1:
        if not out_zeroed:
            _zero_out(out, pdl)
    else:
        _check_workspace(part, count, split, need_part, need_count)


def _check_workspace(part: torch.Tensor, count: torch.Tensor, split: int, need_part: int, need_count: int) -> None:
    """Never index past the split-K workspace (a caller may pass its own, e.g. through the custom ops): the partials
    and counters a launch of ``split`` K slices reads and writes (``GemmConfig.workspace_sizes``'s counts)."""
    if split > 1 and (part.numel() < need_part or count.numel() < need_count):
        raise ValueError(f"split-K workspace too small: {part.numel()} partials / {count.numel()} counters for "
                         f"{need_part} / {need_count} (size it with RouterWeight.workspace)")


def _launch_fp32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_m: int, block_n: int,
                 block_k: int, num_warps: int, num_stages: int, pdl: bool, prefetch_w: bool,
                 preload_w: bool = False, one_block: bool = False) -> None:
    # preload_w: the first weight block loaded before the PDL wait (launch "pdl-preload"); it replaces the prefetch.
    # one_block: the kernel's K-loop-free build, where K <= block_k (the kernel's ONE_BLOCK; router_gemm asks for it
    # wherever K is one block)
    m, k = x.shape
    n = w.shape[0]
    if one_block and k > block_k:
        raise ValueError(f"one_block needs K <= block_k, got K={k} and block_k={block_k}")
    if m == 0:
        return
    router_gemm_fp32_kernel[(_runtime.cdiv(n, block_n), _runtime.cdiv(m, block_m))](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=(k % block_k == 0),
        PREFETCH_W=prefetch_w and not preload_w, PRELOAD_W=preload_w, ONE_BLOCK=one_block,
        num_warps=num_warps, num_stages=num_stages, **_runtime.pdl_kwargs(pdl),
    )


# The custom ops wrap the launchers for torch.compile / opcheck. Eager calls go to the
# launchers directly: torch.library's dispatch costs tens of microseconds per call on
# the host, more than the kernel itself at small M (perf notes, round 5).
# Called directly (or by compiled code), an op checks what its kernel indexes first (``checked_op``).


def _check_op_tensors(a: dict, weights: tuple[str, ...], w_dtype: torch.dtype) -> tuple[int, int]:
    """x [M, K] bf16, each of ``weights`` [N, K] of ``w_dtype`` (unit stride along K), out [M, N] fp32, one
    device; (M, N)."""
    x = check_tensor("x", a["x"], dtypes=[torch.bfloat16], ndim=2, last_dim_contiguous=True)
    m, k = x.shape
    n = None  # the first weight's rows, which the others must match
    for name in weights:
        n = check_tensor(name, a[name], dtypes=[w_dtype], shape=[n, k], device=x.device,
                         last_dim_contiguous=True).shape[0]
    check_out("out", a["out"], (m, n), torch.float32, x.device)
    check_no_overlap("out", a["out"], x=x, **{name: a[name] for name in weights})
    check_pdl(a["pdl"], x.device, allow_none=False)
    check_pdl(a["prefetch_w"], x.device, allow_none=False, name="prefetch_w")
    return m, n


def _check_op_workspace(a: dict) -> None:
    check_tensor("part", a["part"], dtypes=[torch.float32], device=a["x"].device, contiguous=True)
    check_tensor("count", a["count"], dtypes=[torch.int32], device=a["x"].device, contiguous=True)


def _check_split_op(a: dict) -> None:
    check_bool("w_fp32", a["w_fp32"])
    check_bool("atomic", a["atomic"])
    check_bool("preload_w", a["preload_w"])
    check_bool("out_zeroed", a["out_zeroed"])
    check_choice("num_terms", a["num_terms"], (2, 3))
    # every term is addressed with w_hi's row stride
    names = ("w_hi", "w_lo", "w_lo2")
    _check_op_tensors(a, names, torch.float32 if a["w_fp32"] else torch.bfloat16)
    for name in names[1:]:
        if a[name].stride(0) != a["w_hi"].stride(0):
            raise ValueError(f"{name} must have w_hi's row stride {a['w_hi'].stride(0)}, got {a[name].stride(0)}")
    GemmConfig(a["block_m"], a["block_n"], a["block_k"], a["split_k"], a["num_warps"], a["num_stages"],
               "fp32-tc" if a["w_fp32"] else "triton")
    _check_op_workspace(a)


def _check_fp32_op(a: dict) -> None:
    _check_op_tensors(a, ("w",), torch.float32)
    check_bool("preload_w", a["preload_w"])
    check_bool("one_block", a["one_block"])
    GemmConfig(a["block_m"], a["block_n"], a["block_k"], 1, a["num_warps"], a["num_stages"], "fp32-simt")


def _check_fp32_splitk_op(a: dict) -> None:
    _check_op_tensors(a, ("w",), torch.float32)
    check_bool("atomic", a["atomic"])
    check_bool("out_zeroed", a["out_zeroed"])
    GemmConfig(a["block_m"], a["block_n"], a["block_k"], a["split_k"], a["num_warps"], a["num_stages"],
               "fp32-splitk")
    _check_op_workspace(a)


_router_gemm_op = torch.library.custom_op("evenflow::router_gemm_split", checked_op(_launch_split, _check_split_op),
                                          mutates_args=("out", "part", "count"))
_router_gemm_fp32_op = torch.library.custom_op("evenflow::router_gemm_fp32", checked_op(_launch_fp32, _check_fp32_op),
                                               mutates_args=("out",))
_router_gemm_fp32_splitk_op = torch.library.custom_op("evenflow::router_gemm_fp32_splitk",
                                                      checked_op(_launch_fp32_splitk, _check_fp32_splitk_op),
                                                      mutates_args=("out", "part", "count"))


@_router_gemm_op.register_fake
def _(x, w_hi, w_lo, w_lo2, out, part, count, num_terms, block_m, block_n, block_k, split_k, num_warps,
      num_stages, pdl, prefetch_w, w_fp32=False, atomic=False, preload_w=False, out_zeroed=False):
    return None


@_router_gemm_fp32_op.register_fake
def _(x, w, out, block_m, block_n, block_k, num_warps, num_stages, pdl, prefetch_w, preload_w=False, one_block=False):
    return None


@_router_gemm_fp32_splitk_op.register_fake
def _(x, w, out, part, count, block_m, block_n, block_k, split_k, num_warps, num_stages, pdl, prefetch_w,
      atomic=False, out_zeroed=False):
    return None


def _check_x(x: torch.Tensor, k: int, device: torch.device, round_x_to_bf16: bool) -> torch.Tensor:
    check_bool("round_x_to_bf16", round_x_to_bf16)
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and round_x_to_bf16:
        x = x.to(torch.bfloat16)
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        raise TypeError("x must be bfloat16; pass round_x_to_bf16=True to round an fp32 x to bf16 here")
    check_tensor("x", x, dtypes=[torch.bfloat16], ndim=2, shape=[None, k], device=device,
                 last_dim_contiguous=True)
    return x


def router_gemm(x: torch.Tensor, w: RouterWeight, out: torch.Tensor | None = None, *,
                batch_invariant: bool = False, round_x_to_bf16: bool = False,
                config: GemmConfig | None = None, pdl: bool | None = None,
                prefetch_weights: bool | None = None) -> torch.Tensor:
    """fp32 ``x @ w^T`` from bf16 ``x [M, K]`` and a split fp32 weight ``w [N, K]``: fp32 ``[M, N]``.

    ``batch_invariant``: row i is bitwise the same whatever M is and whatever the other
    rows hold (one fixed config, fixed K split, no float atomics; paths ``triton``, ``fp32-tc``
    and ``fp32-splitk``).
    Outside it, a table entry may sum its K slices with float atomics (``GemmConfig.reduce="atomic"``, round
    BW): the last bits of a result may then differ from call to call. Under
    ``torch.use_deterministic_algorithms(True)`` such an entry runs with the counter's in-order sum instead
    (the same tile and split), and a forced atomic config raises ``RuntimeError``.
    ``config``: force a launch configuration (tests, tuning); otherwise the dispatch table.
    ``pdl``: launch the kernel with programmatic dependent launch (it waits at its top for the
    kernel ahead, so its launch overlaps that kernel's end; results are the same bits). None
    (default): as the config says (``GemmConfig.launch``: the tuned table's choice) where supported
    (compiled kernels on sm_90+), True: on (ValueError where not supported), False: off. The cuBLAS
    paths (``torch-*``) ignore it.
    ``prefetch_weights``: the first row tile's programs ask L2 for their weight lines before that
    wait, so the weight reads overlap the kernel ahead too (a hint: L2 never holds stale lines, so
    this is safe whatever the kernel ahead writes). None (default): as the config says, with PDL;
    True needs compiled kernels as PDL does.
    Where the config says ``pdl-preload`` (the table's choice for some small-M ``fp32-simt`` entries, round BM; on
    ``fp32-tc`` where every K slice is one step, round BW) and ``prefetch_weights`` is None, each program *loads*
    its first weight block into registers before the wait instead: faster, but it would read old values if the
    kernel right before the call wrote the fp32 weight. A forward pass only reads it; an in-place update through
    ``RouterWeight`` (``refresh``, ``auto_refresh`` or a new ``RouterWeight``) runs the split's kernels between the
    write and the call, so the write has completed first. Pass ``prefetch_weights=False`` (or ``True``: the L2 hint
    alone) for a call that follows a kernel writing the weight with nothing in between, e.g. inside a CUDA graph
    that updates the weight, or after a write that bypasses the version counter (``w.data.copy_``).
    """
    if not isinstance(w, RouterWeight):
        raise TypeError(f"w must be an evenflow.RouterWeight (split once at load time), got {type(w).__name__}")
    w.check_fresh()  # first: a re-split may change the shape every check below reads
    return router_gemm_fresh(x, w, out, batch_invariant=batch_invariant, round_x_to_bf16=round_x_to_bf16,
                             config=config, pdl=pdl, prefetch_weights=prefetch_weights)


def router_gemm_fresh(x: torch.Tensor, w: RouterWeight, out: torch.Tensor | None = None, *,
                      batch_invariant: bool = False, round_x_to_bf16: bool = False,
                      config: GemmConfig | None = None, pdl: bool | None = None,
                      prefetch_weights: bool | None = None, own_out: bool = False,
                      out_zeroed: bool = False) -> torch.Tensor:
    """:func:`router_gemm` on a ``w`` its caller has just checked fresh (``route`` checks it before it reads N).
    ``own_out``: ``out`` is ``w.logits_buffer(M)`` (``route``'s), which no caller holds, so neither its form nor its
    overlap with ``x`` is checked (round CM: ``route``'s own host time 64 -> 56 us at T = 1, best of three, launches
    stubbed). ``out_zeroed``: ``out`` holds zeros (``route``'s eager calls keep its buffer so), so an atomic split-K
    launch skips its zeroing kernel."""
    n, k = w.shape
    check_bool("batch_invariant", batch_invariant)
    x = _check_x(x, k, w.device, round_x_to_bf16)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    elif not own_out:
        check_out("out", out, (m, n), torch.float32, x.device)
        check_no_overlap("out", out, x=x, w=w.source)  # a write into w would not bump its version counter
    check_pdl(pdl, w.device)
    check_pdl(prefetch_weights, w.device, name="prefetch_weights")
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be an evenflow.GemmConfig or None, got {type(config).__name__}")
    if m == 0:
        return out
    if config is None:
        config = w.config(m, batch_invariant)  # memoised, capped by shared memory, the counter's where deterministic
    else:
        if batch_invariant and config.path not in INVARIANT_PATHS:
            raise ValueError(f"config.path must be one of {INVARIANT_PATHS} in batch-invariant mode, "
                             f"got {config.path!r}")
        if config.reduce == "atomic" and (batch_invariant or torch.are_deterministic_algorithms_enabled()):
            why = ("config.reduce='atomic' sums the K slices in the order they arrive (last bits may differ from call "
                   "to call): not in batch-invariant mode nor under torch.use_deterministic_algorithms(True); use "
                   "reduce='counter'")
            if batch_invariant or not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(why)
            warnings.warn(why, stacklevel=3)  # use_deterministic_algorithms(True, warn_only=True): PyTorch's way
        # Forced configs: num_stages capped so the pipeline fits in shared memory (a
        # deeper one fails to launch on the GPU; the interpreter would not notice).
        config = config.fit_smem(w.terms, w._smem)
    use_pdl = (w.pdl_supported and config.launch != "plain") if pdl is None else pdl
    pf = (use_pdl and config.launch == "pdl-prefetch") if prefetch_weights is None else prefetch_weights
    pre = use_pdl and config.launch == "pdl-preload" and prefetch_weights is None
    eager = not torch.compiler.is_compiling()
    if config.path == "fp32-simt":
        (_launch_fp32 if eager else _router_gemm_fp32_op)(
            x, w.source, out, config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages,
            use_pdl, pf, pre, w.source.shape[1] <= config.block_k)  # K from the weight: static under compile
        return out
    if config.path == "fp32-splitk":
        part, count = w.workspace(m, config)
        (_launch_fp32_splitk if eager else _router_gemm_fp32_splitk_op)(
            x, w.source, out, part, count, config.block_m, config.block_n, config.block_k, config.split_k,
            config.num_warps, config.num_stages, use_pdl, pf, config.reduce == "atomic", out_zeroed)
        return out
    if config.path == "torch-fp32":
        if x.is_cuda and eager and _runtime.cublas_fp32_is_reduced():
            raise RuntimeError(
                "config.path 'torch-fp32' runs cuBLAS under PyTorch's matmul precision, which allows TF32 now "
                "(torch.set_float32_matmul_precision / torch.backends.cuda.matmul.allow_tf32): its logits would "
                "carry a 10-bit mantissa product; choose another path or set the precision to 'highest'")
        torch.mm(x.float(), w.source.detach().t(), out=out)  # a Parameter's autograd refuses out=
        return out
    if config.path == "torch-split2":
        _torch_split2(x, w, out)
        return out
    part, count = w.workspace(m, config)
    if config.path == "fp32-tc":  # the fp32 source, split in registers (same terms, same bits)
        parts = (w.source, w.source, w.source)
    else:
        parts = (w.w_hi, w.w_lo, w.parts[-1])
    (_launch_split if eager else _router_gemm_op)(
        x, *parts, out, part, count, w.terms, config.block_m, config.block_n,
        config.block_k, config.split_k, config.num_warps, config.num_stages, use_pdl, pf, config.path == "fp32-tc",
        config.reduce == "atomic", pre, out_zeroed)
    return out


def _torch_split2(x: torch.Tensor, w: RouterWeight, out: torch.Tensor) -> None:
    """Plain path: one torch bf16 product per split term, fp32 output (cuBLAS on a GPU)."""
    if x.is_cuda:
        prods = [torch.mm(x, p.t(), out_dtype=torch.float32) for p in w.parts]
    else:  # CPU has no mm(out_dtype=): widen first (products of bf16 are exact in fp32)
        prods = [torch.mm(x.float(), p.float().t()) for p in w.parts]
    lo = prods[1] if w.terms == 2 else torch.add(prods[1], prods[2], alpha=1.0 / LO_SCALE)
    torch.add(prods[0], lo, alpha=1.0 / LO_SCALE, out=out)
