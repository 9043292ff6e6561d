"""MoE weight holder (validated and laid out once, at load time) and activation quantisation."""
from __future__ import annotations

import torch

from evenflow._checks import check_bool, check_pdl, check_same_device, check_tensor
from evenflow._runtime import cdiv, fp8_cast_needs_rounding, host_sync_allowed, next_power_of_2, pdl_kwargs
from evenflow.moe.kernels import moe_group_quant_kernel
from evenflow.moe.routing import MAX_EXPERTS

FP8 = torch.float8_e4m3fn
FORMATS = ("bf16", "fp8_per_tensor", "fp8_block")
MODE = {"bf16": 0, "fp8_per_tensor": 1, "fp8_block": 2}
# Up to this many (token, slot) pairs on 16-row tiles, each pair is a GEMM task of its own
# ("pair tiles", evenflow.moe.fused): no index build (one launch of ~3 us at T = 1, round I1's kernel split) and
# one dependent load before the weights instead of three. A pair whose expert another pair
# of the batch also hits re-reads that expert's weights: none at T = 1 (a token's top-k are
# distinct), ~1/16 more weight bytes at T = 2 of top-8 over 128 experts, ~13% at T = 4. Measured (H200, graph
# replay, the tuned entries' tiles, docs/perf-notes/moe.md round AK3): at 32 pairs (T = 4 of top-8) pair tiles took
# 0.85-0.96 of the index path's time on 6 of the 8 benchmark series, level on one, 1.5-2.2% more on one (Qwen3
# fp8-tensor, whose table entry keeps index tiles: MoEConfig.index_tiles); at 64 pairs 1.01-1.35x on all 8, at 128
# 1.1-1.5x; on two untuned TP8 shards and at 24 pairs 0.93-0.985 on 16 of 18 points (round AK6).
# Round I3 set 16; round AK raised it to 32.
PAIR_TILE_MAX_PAIRS = 32
# The narrowest gate-up N block a config may take (evenflow.moe.fused.check_config).
MIN_GU_BLOCK_N = 16


def counter_slots(inter: int) -> int:
    """Arrival counters a pair-tile call may need (intermediate size ``inter``): a K-split gate-up's, one per
    (pair, N block) on N blocks as narrow as ``MIN_GU_BLOCK_N``, then block mode's, one per (pair, 128-group)."""
    return PAIR_TILE_MAX_PAIRS * (inter // MIN_GU_BLOCK_N + inter // 128)


def _scalar_scale(name: str, s) -> torch.Tensor:
    check_tensor(name, s, dtypes=[torch.float32])
    if s.numel() != 1:
        raise ValueError(f"{name} must hold one element (a per-tensor scale), got shape {tuple(s.shape)}")
    return s.reshape(1).contiguous()


def _contiguous(*tensors):
    """The builders' copies of non-contiguous tensors (anything else passed on, for the constructor to name)."""
    return [t.contiguous() if isinstance(t, torch.Tensor) else t for t in tensors]


def _check_scale_values(scales: dict) -> None:
    """Scales finite, activation scales (divisors of the quantisation) positive; one look from the host, at load
    time, skipped where none may run (a trace, a capture)."""
    if not scales or not all(host_sync_allowed(t) for t in scales.values()):
        return
    valid = {name: torch.isfinite(t) & (t > 0) if name.startswith("a") else torch.isfinite(t)
             for name, t in scales.items()}
    ok = torch.stack([v.all() for v in valid.values()]).tolist()
    for (name, v), good in zip(valid.items(), ok):
        if not good:
            what = "positive and finite (the activations are divided by it)" if name.startswith("a") else "finite"
            raise ValueError(f"{name} must be {what}; found {scales[name][~v][:4].tolist()}")


def moe_weight_dims(w13, w2) -> tuple[int, int, int]:
    """(E, H, I) of gate-up weights ``w13`` [E, 2I, H] and down weights ``w2`` [E, H, I], any dtype.

    Checks only what relates the two (types, ranks, matching shapes, one device); the
    launchers and the sharding helpers of ``evenflow.parallel`` add their own rules.
    """
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    e, two_i, h = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 must have shape [E, 2*I, H], got odd second dim {two_i}")
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must have shape [E, H, I] = {(e, h, i)} to match w13 {tuple(w13.shape)}, "
                         f"got {tuple(w2.shape)}")
    check_same_device(w13=w13, w2=w2)
    return e, h, i


class MoEWeights:
    """Expert weights of one MoE layer (this rank's shard), ready for :func:`evenflow.fused_moe`.

    ``w13`` [E, 2I, H]: gate rows then up rows; ``w2`` [E, H, I]. Scales are
    dequantisation multipliers (real value = stored value * scale), as in SGLang's
    ``fused_experts``. Build with :meth:`bf16`, :meth:`fp8_per_tensor` or :meth:`fp8_block`, which make the
    tensors contiguous; the constructor takes them as they are and checks them as those do (shapes, dtypes, one
    device, contiguity; scales finite, activation scales positive), since the kernels walk them by the shapes
    and strides they assume. The tensors are read-only attributes, held without a copy; a scale tensor written in
    place afterwards is checked again by the next eager ``fused_moe`` call (:meth:`recheck_scales`).

    The holder also keeps the arrival counters of the decode path (``counters``, int32 on the
    weights' device, a few KB): where pair tiles split the gate-up along K (or, in block mode, an
    activation group over narrow N blocks), its programs count in there, and the last to arrive
    puts the counter back to zero, so no kernel of the call has to zero them first. They are zero
    between calls, so calls on one holder must not run at the same time (two streams at once); for
    that, give each stream its own holder over the same weight tensors, :meth:`sharing_weights`
    (``copy.copy`` would share the counters). Calls in one stream, and CUDA-graph replays in turn,
    are fine. A CUDA graph captured with a holder writes its counters: keep the holder alive while
    the graph may be replayed.
    """

    def __init__(self, fmt, w13, w2, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, *,
                 counters: bool = True):
        if not isinstance(fmt, str) or fmt not in MODE:
            raise ValueError(f"fmt must be one of {tuple(MODE)}, got {fmt!r}")
        _, taken = self.check_format(fmt, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)
        _check_scale_values(taken)
        self.format = fmt
        self._w13, self._w2 = w13, w2
        self._w13_scale, self._w2_scale = w13_scale, w2_scale
        self._a13_scale, self._a2_scale = taken.get("a13_scale"), taken.get("a2_scale")
        # checked above; their version counters say when one is written in place (an inference tensor, made under
        # torch.inference_mode, has none and is not watched)
        self._scales = {n: t for n, t in taken.items() if not t.is_inference()}
        self._scale_versions = [t._version for t in self._scales.values()]
        check_bool("counters", counters)
        self.counters = None
        if counters:
            # a normal tensor even if the holder is built under torch.inference_mode (a compiled call outside
            # it writes the counters back); static to torch.compile, so that CUDA-graph trees
            # (mode="reduce-overhead") take its in-place updates instead of skipping the graph
            with torch.inference_mode(False):
                self.counters = torch.zeros(counter_slots(w2.shape[2]), dtype=torch.int32, device=w13.device)
            torch._dynamo.mark_static_address(self.counters)

    def recheck_scales(self) -> None:
        """The scales' value checks again where one of the scale tensors was written in place since they last ran
        (a scale tensor the caller still holds: a recalibration, or a stray write): a holder's scales stay
        finite, its activation scales positive, or ``fused_moe`` raises naming them (a zero activation scale had
        given an all-zero output, a NaN one finite garbage). A host-side look at the tensors' version counters
        each call; the values are read (one sync) only after a write, and not where no sync may run (a capture,
        a trace), where the next eager call checks them. A scale made under ``torch.inference_mode`` has no
        version counter and is not watched."""
        versions = [t._version for t in self._scales.values()]
        if versions != self._scale_versions and all(host_sync_allowed(t) for t in self._scales.values()):
            try:
                _check_scale_values(self._scales)
            except ValueError as e:
                raise ValueError(f"{e} (written in place since the MoEWeights was built)") from None
            self._scale_versions = versions

    def sharing_weights(self, counters: bool = True) -> MoEWeights:
        """A holder over the same weight and scale tensors (no copy) with arrival counters of its own, for
        calls that run at the same time as this holder's on another stream. ``counters=False``: none kept,
        so every call whose gate-up counts arrivals zeroes a fresh counter buffer with one more kernel (the
        behaviour before round X; safe on any number of streams at once)."""
        return MoEWeights(self.format, self.w13, self.w2, self.w13_scale, self.w2_scale, self.a13_scale,
                          self.a2_scale, counters=counters)

    w13 = property(lambda self: self._w13, doc="[E, 2I, H]: gate rows then up rows")
    w2 = property(lambda self: self._w2, doc="[E, H, I]")
    w13_scale = property(lambda self: self._w13_scale, doc="fp8: per-expert [E] or block [E, 2I/128, H/128] scales")
    w2_scale = property(lambda self: self._w2_scale, doc="fp8: per-expert [E] or block [E, H/128, I/128] scales")
    a13_scale = property(lambda self: self._a13_scale, doc="fp8_per_tensor: the gate-up input's static scale [1]")
    a2_scale = property(lambda self: self._a2_scale, doc="fp8_per_tensor: the down input's static scale [1]")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def mode(self) -> int:
        return MODE[self.format]

    def __repr__(self) -> str:
        return (f"MoEWeights({self.format}, experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, device={self.w13.device})")

    @staticmethod
    def _check_pair(w13, w2, dtype, multiple):
        check_tensor("w13", w13, dtypes=[dtype], ndim=3)
        check_tensor("w2", w2, dtypes=[dtype], ndim=3)
        e, h, i = moe_weight_dims(w13, w2)
        if not 1 <= e <= MAX_EXPERTS:
            raise ValueError(f"w13 holds {e} experts; evenflow supports 1..{MAX_EXPERTS}")
        if h < multiple or i < multiple or h % multiple or i % multiple:
            raise ValueError(f"hidden ({h}) and intermediate ({i}) sizes must be positive multiples of {multiple} "
                             "for this weight format")
        return e, h, i

    @classmethod
    def check_format(cls, fmt, w13, w2, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None):
        """``fmt``'s checks of its tensors: ((E, H, I), the scales the format takes by name, per-tensor activation
        scales as one-element contiguous tensors); a scale the format does not take must be None; the weights and
        their scales contiguous (the kernels walk them by the shapes they assume). The constructor calls it, and so
        does a direct call of the fused MoE op (``fused._check_op``)."""
        if fmt == "bf16":
            e, h, i = cls._check_pair(w13, w2, torch.bfloat16, 16)
            taken = {}
        elif fmt == "fp8_per_tensor":
            # the dots are f16 MMAs of the exact e4m3 values ("f16 products", kernels.py): K-steps >= 16
            e, h, i = cls._check_pair(w13, w2, FP8, 16)
            check_tensor("w13_scale", w13_scale, dtypes=[torch.float32], shape=[e])
            check_tensor("w2_scale", w2_scale, dtypes=[torch.float32], shape=[e])
            taken = {"w13_scale": w13_scale, "w2_scale": w2_scale, "a13_scale": _scalar_scale("a13_scale", a13_scale),
                     "a2_scale": _scalar_scale("a2_scale", a2_scale)}
        elif fmt == "fp8_block":
            e, h, i = cls._check_pair(w13, w2, FP8, 128)
            check_tensor("w13_scale", w13_scale, dtypes=[torch.float32], shape=[e, 2 * i // 128, h // 128])
            check_tensor("w2_scale", w2_scale, dtypes=[torch.float32], shape=[e, h // 128, i // 128])
            taken = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        else:
            raise ValueError(f"fmt must be one of {tuple(MODE)}, got {fmt!r}")
        for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale), ("a13_scale", a13_scale),
                        ("a2_scale", a2_scale)):
            if name not in taken and s is not None:
                raise ValueError(f"{name} must be None for {fmt} weights")
        for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if t is not None:
                check_tensor(name, t, contiguous=True)
        check_same_device(w13=w13, **taken)
        return (e, h, i), taken

    @classmethod
    def bf16(cls, w13: torch.Tensor, w2: torch.Tensor) -> MoEWeights:
        return cls("bf16", *_contiguous(w13, w2))

    @classmethod
    def fp8_per_tensor(cls, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale) -> MoEWeights:
        """FP8 e4m3 weights with per-expert scales and static per-tensor activation scales (Hy3 style)."""
        return cls("fp8_per_tensor", *_contiguous(w13, w2, w13_scale, w2_scale), a13_scale, a2_scale)

    @classmethod
    def fp8_block(cls, w13, w2, w13_scale, w2_scale) -> MoEWeights:
        """FP8 e4m3 weights with 128x128 block scales [E, N/128, K/128] (Qwen3-FP8 / DeepSeek style)."""
        return cls("fp8_block", *_contiguous(w13, w2, w13_scale, w2_scale))


def quant_fp8_per_token_group(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 (or fp16 / fp32) -> (fp8 e4m3 [T, H], fp32 scales [T, H/128]), one scale per 128-wide row group.

    scale = max(amax, 1e-10) / 448, value = round_e4m3(x / scale) (saturating). ``pdl``: launch
    with programmatic dependent launch (inside :func:`evenflow.fused_moe`'s chain).
    """
    check_tensor("x", x, dtypes=[torch.bfloat16, torch.float16, torch.float32], ndim=2, last_dim_contiguous=True)
    check_pdl(pdl, x.device, allow_none=False)
    t, h = x.shape
    if h % 128 or h == 0:
        raise ValueError(f"x's last dimension ({h}) must be a positive multiple of 128 for per-token-group-128 "
                         "quantisation")
    q, s = group_quant_buffers(x)
    launch_group_quant(x, q, s, pdl)
    return q, s


def group_quant_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised outputs of :func:`quant_fp8_per_token_group` for a checked ``x`` [T, H]."""
    t, h = x.shape
    return (torch.empty(t, h, dtype=FP8, device=x.device),
            torch.empty(t, h // 128, dtype=torch.float32, device=x.device))


def launch_group_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, pdl: bool, overlap: bool = False) -> None:
    """The kernel of :func:`quant_fp8_per_token_group` into ``q``, ``s`` (:func:`group_quant_buffers`).
    ``overlap`` (with ``pdl``): the kernel ahead in the stream waited at its top for the kernels that wrote
    ``x`` and writes nothing this one reads, so this one runs beside it (``moe_group_quant_kernel``);
    ``q`` and ``s`` must then not be memory that kernel still uses (allocate them before launching it)."""
    t, h = x.shape
    if t == 0:
        return
    groups = min(next_power_of_2(h // 128), 16)
    moe_group_quant_kernel[(t, cdiv(h // 128, groups))](
        x, q, s, h // 128, x.stride(0), q.stride(0), s.stride(0),
        GROUPS=groups, FP8_ROUND=fp8_cast_needs_rounding(), OVERLAP=overlap and pdl, num_warps=4,
        **pdl_kwargs(pdl),
    )
