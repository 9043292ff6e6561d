"""Plain PyTorch oracle of the fused MoE (index build and forward).

Deliberately simple: loops over experts, weights dequantised to fp32, math in the
dtype the caller picks (float64 for the oracle, a lower one for the tolerance
rule's baseline). For FP8 weights the activations are quantised exactly the way
the kernels quantise them (same scale formula, same fp32 division, same e4m3
rounding), so comparing against this oracle measures the kernels' arithmetic
error, not the quantisation error that the format itself brings; pass
``quantize_activations=False`` for the end-to-end fidelity reference.
``moe_fast_accum_baseline`` is the tolerance rule's baseline for the opt-in
``fp8_accum="fast"`` mode: the same layer through ``torch._scaled_mm(use_fast_accum=True)``, and
with ``promoted=True`` of ``fp8_accum="promoted"`` (those products summed per 128-deep K block in fp32).

The layer computed, for this rank's experts E_loc = [ep_rank*E_local, (ep_rank+1)*E_local):

    y[t] = routed_scaling * sum_{slot: id in E_loc} w[t,slot] * down_e(silu(gate_e(x_t)) * up_e(x_t))
           + shared_output[t]
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
GROUP_AMAX_EPS = 1e-10


def _fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values of fp32 ``x / scale`` (saturating), as the kernels quantise (not dequantised)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quant_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 of fp32 ``x / scale`` (saturating), as the kernels do it; returns the dequantised fp32."""
    return _fp8_static(x, scale).float() * scale.float()


def quant_fp8_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row-per-``group`` dynamic fp8 quantisation; returns (fp8 values [R, C], fp32 scales [R, C/group])."""
    r, c = x.shape
    xg = x.float().reshape(r, c // group, group)
    amax = xg.abs().amax(dim=-1).clamp_min(GROUP_AMAX_EPS)
    # Tensor / tensor: CUDA torch divides by a Python scalar as a multiply by its
    # reciprocal (1 ulp off IEEE division), which the kernel's div_rn does not do.
    s = amax / torch.full_like(amax, FP8_MAX)
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(r, c), s


def dequant_group(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    r, c = q.shape
    return (q.float().reshape(r, c // group, group) * s[..., None]).reshape(r, c)


def dequant_weights(ew) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) of an ``evenflow.MoEWeights`` as fp32 tensors."""
    if ew.format == "bf16":
        return ew.w13.float(), ew.w2.float()
    if ew.format == "fp8_per_tensor":
        return (ew.w13.float() * ew.w13_scale.float()[:, None, None],
                ew.w2.float() * ew.w2_scale.float()[:, None, None])
    w13 = ew.w13.float() * ew.w13_scale.float().repeat_interleave(128, 1).repeat_interleave(128, 2)
    w2 = ew.w2.float() * ew.w2_scale.float().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return w13, w2


def _routed_sum(x, local_ids, topk_weights, num_experts: int, expert) -> torch.Tensor:
    """float64 sum over pairs of w * expert(e, tok) for e in [0, num_experts): ``expert`` maps an
    expert and the token rows routed to it to their outputs; ``local_ids`` outside [0, E) belong
    to another rank."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(num_experts):
        tok, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if tok.numel():
            y.index_add_(0, tok, expert(e, tok).double() * topk_weights[tok, slot].double()[:, None])
    return y


def _scaled(y, routed_scaling, shared_output):
    """The layer's tail: routed_scaling times the routed sum, plus the shared experts' output."""
    y = y * routed_scaling
    return y if shared_output is None else y + shared_output.double()


def _expert_sum(x, local_ids, topk_weights, w13, w2, dtype, quant_in=None, quant_mid=None) -> torch.Tensor:
    """float64 sum over pairs of w * down_e(silu(gate_e(x)) * up_e(x)) for the experts in ``w13``/``w2``;
    ``local_ids`` index those experts (anything outside [0, E) belongs to another rank).
    ``quant_in``/``quant_mid`` model the kernels' activation quantisation (fp32 -> fp32)."""
    i_size = w2.shape[2]

    def expert(e, tok):
        xe = x[tok].float()
        if quant_in is not None:
            xe = quant_in(xe)
        gu = xe.to(dtype) @ w13[e].to(dtype).T
        h = torch.nn.functional.silu(gu[:, :i_size]) * gu[:, i_size:]
        if quant_mid is not None:
            h = quant_mid(h.float()).to(dtype)
        return h @ w2[e].to(dtype).T

    return _routed_sum(x, local_ids, topk_weights, w13.shape[0], expert)


def _activation_quant(ew):
    """(quant_in, quant_mid): the kernels' quantisation of the activations entering the gate-up and the down
    GEMM for ``ew``'s format, as fp32 -> dequantised fp32 maps; (None, None) for BF16 weights."""
    if ew.format == "fp8_per_tensor":
        return (lambda a: quant_fp8_static(a, ew.a13_scale)), (lambda a: quant_fp8_static(a, ew.a2_scale))
    if ew.format == "fp8_block":
        group = lambda a: dequant_group(*quant_fp8_group(a))  # noqa: E731
        return group, group
    return None, None


def moe_reference(x, topk_ids, topk_weights, ew, ep_rank=0, num_experts_total=None,
                  shared_output=None, routed_scaling=1.0, dtype=torch.float64,
                  quantize_activations=True) -> torch.Tensor:
    """The MoE layer of this rank, returned in ``dtype`` (not rounded to bf16)."""
    w13, w2 = dequant_weights(ew)
    quant_in, quant_mid = _activation_quant(ew) if quantize_activations else (None, None)
    y = _expert_sum(x, topk_ids.long() - ep_rank * w13.shape[0], topk_weights, w13, w2, dtype,
                    quant_in, quant_mid)
    return _scaled(y, routed_scaling, shared_output).to(dtype)


# ---------------------------------------------------------------- baseline of fp8_accum="fast"

def fast_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor | None = None,
             scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``scale_a * scale_b * (a8 @ b8.T)`` of e4m3 ``a8`` [M, K] and ``b8`` [N, K] by
    ``torch._scaled_mm(..., use_fast_accum=True)``: on sm_90 an fp8 tensor-core GEMM that
    accumulates with the hardware's reduced precision over the whole K (on a CPU, exact products
    and fp32 sums); without scales, the plain product. Rows of both are padded to a multiple of 16
    with zeros (an output depends on its own row and column only)."""
    m, n = a8.shape[0], b8.shape[0]

    def padded(x, rows):
        x = x.contiguous()
        if -rows % 16:
            x = torch.cat([x.view(torch.uint8), x.new_zeros(-rows % 16, x.shape[1], dtype=torch.uint8)]).view(x.dtype)
        return x

    # Unit scales in fresh tensors, the scales applied after in fp32 (one more rounding): on the
    # H200 cuBLASLt answered CUBLAS_STATUS_NOT_SUPPORTED for the per-tensor calls that passed
    # views such as w13_scale[e] (4 * e bytes into its storage) as scale pointers, and ran every
    # call with freshly allocated unit scales (round J4).
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    out = torch._scaled_mm(padded(a8, m), padded(b8, n).t(), one, one, out_dtype=torch.float32,
                           use_fast_accum=True)[:m, :n]
    if scale_a is None:
        return out
    return out * (scale_a.float().reshape(()) * scale_b.float().reshape(()))


def _fast_k_blocks(a8: torch.Tensor, b8: torch.Tensor):
    """(block index, the unscaled fast-accumulation product of that 128-deep K block; the last may be shorter),
    in K order."""
    for k0 in range(0, a8.shape[1], 128):
        yield k0 // 128, fast_mm(a8[:, k0:k0 + 128], b8[:, k0:k0 + 128])


def _fast_block_mm(a8: torch.Tensor, a_s: torch.Tensor, b8: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """Block-128 scaled product: per 128-deep K block, one fast-accumulation ``_scaled_mm`` of
    the e4m3 values with unit scales, times its activation-group scales ``a_s`` [M, K/128] and
    weight-block scales ``b_s`` [N/128, K/128], summed in fp32 in K order (promotion once per
    128: the DeepSeek-V3 recipe the kernels follow with fp8_accum="fast")."""
    acc = torch.zeros(a8.shape[0], b8.shape[0], dtype=torch.float32, device=a8.device)
    for kb, part in _fast_k_blocks(a8, b8):
        acc += part * (a_s[:, kb, None] * b_s[:, kb].repeat_interleave(128)[None, :])
    return acc


def _promoted_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled product with promotion once per 128-deep K block: one fast-accumulation
    ``_scaled_mm`` per block (the last may be shorter), summed in fp32 in K order, then scaled: the
    precision class of ``fused_moe(fp8_accum="promoted")``, whose per-tensor kernels promote every K
    step of at most 128."""
    acc = torch.zeros(a8.shape[0], b8.shape[0], dtype=torch.float32, device=a8.device)
    for _, part in _fast_k_blocks(a8, b8):
        acc += part
    return acc * (scale_a.float().reshape(()) * scale_b.float().reshape(()))


def _fast_gate_up(x, ew, promoted: bool = False):
    """``gate_up(e, tok)``: the fp32 gate-up product of expert ``e`` for token rows ``tok`` with fp8
    fast accumulation (``promoted``: per-tensor weights promoted once per 128-deep block, as block
    weights always are), on the activations quantised as the kernels quantise them."""
    if ew.format == "fp8_per_tensor":
        xq = _fp8_static(x, ew.a13_scale)
        mm = _promoted_mm if promoted else fast_mm
        return lambda e, tok: mm(xq[tok], ew.w13[e], ew.a13_scale, ew.w13_scale[e])
    xq, xs = quant_fp8_group(x.float())
    return lambda e, tok: _fast_block_mm(xq[tok], xs[tok], ew.w13[e], ew.w13_scale[e])


def moe_fast_accum_baseline(x, topk_ids, topk_weights, ew, ep_rank=0, num_experts_total=None, shared_output=None,
                            routed_scaling=1.0, promoted: bool = False) -> torch.Tensor:
    """The tolerance rule's baseline for ``fused_moe(..., fp8_accum="fast")``: the same layer
    computed by PyTorch with fp8 fast accumulation (fp32 result, not rounded to bf16).

    FP8 weights only. Each expert's GEMMs are ``torch._scaled_mm(use_fast_accum=True)`` on the
    e4m3 values the kernels multiply: per-tensor, one product over the whole K with scales
    (a13_scale, w13_scale[e]) and (a2_scale, w2_scale[e]); block-128, one product per 128-deep
    K block with unit scales, times its scales, summed in fp32 (:func:`_fast_block_mm`).
    Activations are quantised as the kernels do (:func:`quant_fp8_group` / the static scales);
    SiLU(gate) * up in fp32, the intermediate requantised, the top-k weighted sum in float64 as
    in :func:`moe_reference`. On a GPU (sm_90) this is the precision class of SGLang's Triton
    fused MoE; on a CPU ``_scaled_mm`` sums exactly in fp32, so there it equals the default
    mode's baseline up to fp32 rounding order. ``num_experts_total`` is accepted as by
    :func:`moe_reference` (this rank's experts follow from ``ep_rank`` and the weights).
    ``promoted`` (the baseline of ``fp8_accum="promoted"``): per-tensor products too are summed per
    128-deep K block and the blocks added in fp32 (:func:`_promoted_mm`); block-128 is unchanged.
    """
    if ew.format not in ("fp8_per_tensor", "fp8_block"):
        raise ValueError(f"moe_fast_accum_baseline needs FP8 weights, got {ew.format}")
    e_local, i_size = ew.num_experts, ew.intermediate_size
    gate_up = _fast_gate_up(x, ew, promoted)
    down_mm = _promoted_mm if promoted else fast_mm

    def expert(e, tok):
        gu = gate_up(e, tok)
        h = torch.nn.functional.silu(gu[:, :i_size]) * gu[:, i_size:]
        if ew.format == "fp8_per_tensor":
            return down_mm(_fp8_static(h, ew.a2_scale), ew.w2[e], ew.a2_scale, ew.w2_scale[e])
        hq, hs = quant_fp8_group(h)
        return _fast_block_mm(hq, hs, ew.w2[e], ew.w2_scale[e])

    y = _routed_sum(x, topk_ids.long() - ep_rank * e_local, topk_weights, e_local, expert)
    return _scaled(y, routed_scaling, shared_output).float()


def moe_baseline(x, topk_ids, topk_weights, ew, fast_accum: bool | str = False, **kw) -> torch.Tensor:
    """The tolerance rule's baseline for ``fused_moe``: the same layer done by PyTorch in the
    precision the kernels work in, rounded to bf16 like their output. BF16 weights: bf16
    matmuls with a bf16 intermediate; FP8 weights: fp32 matmuls of the fp8 values (exact
    products, fp32 sums, as the default mode's f16 MMAs); ``fast_accum`` (FP8 weights): ``True`` or
    ``"fast"`` for ``fp8_accum="fast"``, ``"promoted"`` for ``fp8_accum="promoted"``:
    :func:`moe_fast_accum_baseline`. ``kw``: ``ep_rank``, ``num_experts_total``, ``shared_output``,
    ``routed_scaling``."""
    if fast_accum:
        base = moe_fast_accum_baseline(x, topk_ids, topk_weights, ew, promoted=fast_accum == "promoted", **kw)
    else:
        dtype = torch.bfloat16 if ew.format == "bf16" else torch.float32
        base = moe_reference(x, topk_ids, topk_weights, ew, dtype=dtype, **kw)
    return base.to(torch.bfloat16)


def requant_window(x, ew, fast_accum: bool | str = False, factor: float = 2.0):
    """``window(e, tok)`` -> (g, u, dgu, s, v, dv) in float64 for local expert ``e`` and token rows ``tok``
    (FP8 formats): ``g``, ``u`` the oracle's gate and up values, ``dgu`` = ``factor`` x the largest error of
    PyTorch's same-precision gate-up product of that expert against them, ``s`` the requantisation scale,
    ``v`` = h / s the value the kernels round to e4m3, and ``dv`` how far a correct kernel's ``v`` may lie
    from it (see :func:`moe_requant_allowance`)."""
    w13, _ = dequant_weights(ew)
    i_size = ew.intermediate_size
    quant_in, _ = _activation_quant(ew)
    fast = _fast_gate_up(x, ew, fast_accum == "promoted") if fast_accum else None

    def window(e, tok):
        xq = quant_in(x[tok].float())
        gu64 = xq.double() @ w13[e].double().T
        gu_same = fast(e, tok) if fast_accum else xq @ w13[e].T
        dgu = factor * float((gu_same.double() - gu64).abs().max())
        g, u = gu64[:, :i_size], gu64[:, i_size:]
        sg = torch.sigmoid(g)
        silu = g * sg
        h = silu * u
        # the gate and up errors to first order, their second-order terms (the cross term silu'(g) dg du and
        # silu''(g) u dg^2 / 2, |silu''| <= 1/2), and the evaluation of silu(g) * u itself: the kernels' exp
        # (ex2.approx, relative error below 2^-22, carried into silu times (1 - sigmoid) |g|), their division
        # and product, and the oracle's rounding of h to fp32 (a unit of 2^-22 or less each)
        dsilu = sg * (1 + g * (1 - sg))
        dh = ((dsilu * u).abs() + silu.abs()) * dgu + (dsilu.abs() + u.abs() / 4) * dgu**2 \
            + h.abs() * (3 + (1 - sg) * g.abs()) * 2.0**-22
        if ew.format == "fp8_per_tensor":
            s = ew.a2_scale.double().reshape(())
            ds_rel = torch.zeros_like(h)
        else:  # the group scale amax / 448 moves with the group's largest deviation
            n = h.shape[0]
            amax = h.abs().reshape(n, -1, 128).amax(-1).clamp_min(GROUP_AMAX_EPS)
            s = (amax / FP8_MAX).repeat_interleave(128, 1)
            ds_rel = (dh.reshape(n, -1, 128).amax(-1) / amax).repeat_interleave(128, 1)
        v = h / s
        # the fp32 division h / s of the kernels and of the oracle: a unit of 2^-23 each
        return g, u, dgu, s, v, dh / s + v.abs() * (ds_rel + 2.0**-22)

    return window


def moe_requant_allowance(x, topk_ids, topk_weights, ew, ep_rank=0, num_experts_total=None, shared_output=None,
                          routed_scaling=1.0, fast_accum: bool | str = False, factor: float = 2.0) -> torch.Tensor:
    """[T, H] float64: how far the layer's output may move, element by element, because the FP8
    formats round the intermediate ``silu(gate) * up`` to e4m3 (zeros for BF16 weights).

    The kernels' fp32 intermediate differs from the oracle's by rounding. Where an element lies
    within that difference of a midpoint between two e4m3 values, a correct kernel may round it to
    either one, and the output then moves by one e4m3 step times the scale times the down weights'
    column: far more than the arithmetic error the tolerance rule bounds (round V4: one element of
    |h| = 5.54, 2.8e-7 from a midpoint, took a correct layer past the rule). This allowance lets
    exactly such elements round either way and nothing else:

    - the intermediate's possible deviation, per element: the gate and up products may be off by
      ``factor`` times the largest error of PyTorch's same-precision product of that expert (fp32
      sums of the exact fp8 products; with ``fast_accum``, the fast-accumulation GEMM, promoted per
      128-deep block where it is ``"promoted"``) against
      float64, carried through ``silu(g) * u`` by its derivatives, plus the rounding of the SiLU, the
      product and the division by the scale themselves (:func:`requant_window`);
    - block-128 mode: the group's scale (amax / 448) moves with the group's largest deviation;
    - the quantised value ``h / scale`` may then end on any e4m3 value between those of
      ``v - dv`` and ``v + dv``; that span (zero for all but the elements near a midpoint),
      dequantised, times |down weights| and |top-k weight| * |routed_scaling|, summed over the pairs.

    ``ep_rank``, ``num_experts_total`` and ``routed_scaling`` as in :func:`moe_reference`;
    ``shared_output`` is accepted and changes nothing (it is added after, never rounded to fp8).
    Pass the result to :func:`evenflow.testing.assert_within_rule` as ``allowance``. The activations
    entering the gate-up GEMM need none: the kernels quantise them with the oracle's exact fp32 operations.
    """
    if ew.format == "bf16":
        return torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    _, w2 = dequant_weights(ew)
    window = requant_window(x, ew, fast_accum, factor)
    one = torch.ones((), dtype=torch.float32, device=x.device)

    def expert(e, tok):  # the code span each intermediate element may end on, dequantised, through |down|
        *_, s, v, dv = window(e, tok)
        span = (_fp8_static(v + dv, one).double() - _fp8_static(v - dv, one).double()) * s
        return span @ w2[e].double().abs().T

    y = _routed_sum(x, topk_ids.long() - ep_rank * ew.num_experts, topk_weights.abs(), ew.num_experts, expert)
    return y * abs(routed_scaling)


def moe_rule_terms(x, topk_ids, topk_weights, ew, fast_accum: bool | str = False, **kw):
    """(oracle in float64, the rule's baseline, the requantisation allowance): the three terms of
    :func:`evenflow.testing.assert_within_rule` for ``fused_moe`` with these arguments (``fast_accum``
    as :func:`moe_baseline` takes it; ``kw``:
    ``ep_rank``, ``num_experts_total``, ``shared_output``, ``routed_scaling``)."""
    ref = moe_reference(x, topk_ids, topk_weights, ew, dtype=torch.float64, **kw)
    base = moe_baseline(x, topk_ids, topk_weights, ew, fast_accum=fast_accum, **kw)
    return ref, base, moe_requant_allowance(x, topk_ids, topk_weights, ew, fast_accum=fast_accum, **kw)


def moe_index_reference(topk_ids: torch.Tensor, num_local: int, ep_rank: int, block_m: int, max_tiles: int):
    """(counts, offsets, sorted_pairs, tile_expert, tile_row) as the kernel must produce them, int32."""
    flat = topk_ids.flatten().long().cpu() - ep_rank * num_local
    n = flat.numel()
    counts = torch.zeros(num_local, dtype=torch.int64)
    sorted_pairs, tiles = [], []
    for e in range(num_local):
        pairs = torch.nonzero(flat == e).flatten().tolist()  # ascending pair id
        counts[e] = len(pairs)
        for r in range(0, len(pairs), block_m):
            tiles.append((e, len(sorted_pairs) + r))
        sorted_pairs += pairs
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    sorted_pairs += [-1] * (n - len(sorted_pairs))
    tiles += [(-1, -1)] * (max_tiles - len(tiles))
    i32 = torch.int32
    return (counts.to(i32), offsets.to(i32), torch.tensor(sorted_pairs, dtype=i32),
            torch.tensor([a for a, _ in tiles], dtype=i32), torch.tensor([b for _, b in tiles], dtype=i32))


# ---------------------------------------------------------------- inputs for tests, demo and benchmarks

def random_moe_weights(fmt: str, num_experts: int, hidden: int, inter: int, device="cpu", generator=None):
    """Random ``evenflow.MoEWeights`` of format ``fmt`` with realistic magnitudes (N(0, 1/K) weights),
    quantised the way checkpoints are (per-expert amax, or 128x128 block amax, over 448)."""
    from evenflow.moe.quant import MoEWeights

    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, generator=generator) * inter**-0.5
    if fmt == "bf16":
        return MoEWeights.bf16(w13.bfloat16(), w2.bfloat16())
    if fmt == "fp8_per_tensor":
        s13 = w13.abs().amax((1, 2)) / FP8_MAX
        s2 = w2.abs().amax((1, 2)) / FP8_MAX
        # Static activation scales as a calibration would give: x ~ N(0,1) -> amax ~ 5;
        # the intermediate silu(g)*u with g, u ~ N(0,1) stays below ~ 10.
        a13 = torch.tensor([5.0 / FP8_MAX], device=device)
        a2 = torch.tensor([10.0 / FP8_MAX], device=device)
        return MoEWeights.fp8_per_tensor((w13 / s13[:, None, None]).to(torch.float8_e4m3fn),
                                         (w2 / s2[:, None, None]).to(torch.float8_e4m3fn), s13, s2, a13, a2)
    if fmt == "fp8_block":
        def blockq(w):
            e, n, k = w.shape
            s = w.abs().reshape(e, n // 128, 128, k // 128, 128).amax((2, 4)).clamp_min(1e-12) / FP8_MAX
            q = (w / s.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.float8_e4m3fn)
            return q, s
        q13, s13 = blockq(w13)
        q2, s2 = blockq(w2)
        return MoEWeights.fp8_block(q13, q2, s13, s2)
    raise ValueError(f"unknown format {fmt!r}")


def random_routing(num_tokens: int, top_k: int, num_experts: int, device="cpu", generator=None):
    """Top-k of a softmax over random logits (uneven per-expert loads), renormalised; ids int32."""
    logits = torch.randn(num_tokens, num_experts, device=device, generator=generator) * 2.0
    w, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return ids.to(torch.int32).contiguous(), (w / w.sum(-1, keepdim=True)).float().contiguous()
