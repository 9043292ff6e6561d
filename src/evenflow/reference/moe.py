"""Plain PyTorch oracle of the fused MoE (index build and forward).

Deliberately simple: loops over experts, weights dequantised to fp32, math in the
dtype the caller picks (float64 for the oracle, a lower one for the tolerance
rule's baseline). For FP8 weights the activations are quantised exactly the way
the kernels quantise them (same scale formula, same fp32 division, same e4m3
rounding), so comparing against this oracle measures the kernels' arithmetic
error, not the quantisation error that the format itself brings; pass
``quantize_activations=False`` for the end-to-end fidelity reference.

The layer computed, for this rank's experts E_loc = [ep_rank*E_local, (ep_rank+1)*E_local):

    y[t] = routed_scaling * sum_{slot: id in E_loc} w[t,slot] * down_e(silu(gate_e(x_t)) * up_e(x_t))
           + shared_output[t]
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
GROUP_AMAX_EPS = 1e-10


def quant_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 of fp32 ``x / scale`` (saturating), as the kernels do it; returns the dequantised fp32."""
    q = (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale.float()


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


def _expert_sum(x, local_ids, topk_weights, w13, w2, dtype, quant_in=None, quant_mid=None) -> torch.Tensor:
    """float64 sum over pairs of w * down_e(silu(gate_e(x)) * up_e(x)) for the experts in ``w13``/``w2``;
    ``local_ids`` index those experts (anything outside [0, E) belongs to another rank).
    ``quant_in``/``quant_mid`` model the kernels' activation quantisation (fp32 -> fp32)."""
    i_size = w2.shape[2]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok].float()
        if quant_in is not None:
            xe = quant_in(xe)
        gu = xe.to(dtype) @ w13[e].to(dtype).T
        h = torch.nn.functional.silu(gu[:, :i_size]) * gu[:, i_size:]
        if quant_mid is not None:
            h = quant_mid(h.float()).to(dtype)
        out = (h @ w2[e].to(dtype).T).double()
        y.index_add_(0, tok, out * topk_weights[tok, slot].double()[:, None])
    return y


def moe_dense_reference(x, topk_ids, topk_weights, w13, w2, first_expert: int = 0,
                        dtype=torch.float64) -> torch.Tensor:
    """The routed sum over plain (unquantised) expert weights ``w13`` [E, 2I, H], ``w2`` [E, H, I]
    whose global ids start at ``first_expert``, computed in ``dtype`` (bf16: the intermediate
    rounds to bf16 too, as in the kernels); float64 result, before any scaling.

    For tensor-parallel shards (w13/w2 sliced along I) and expert-parallel shards alike.
    """
    return _expert_sum(x, topk_ids.long() - first_expert, topk_weights, w13, w2, dtype)


def moe_reference(x, topk_ids, topk_weights, ew, ep_rank=0, num_experts_total=None,
                  shared_output=None, routed_scaling=1.0, dtype=torch.float64,
                  quantize_activations=True) -> torch.Tensor:
    """The MoE layer of this rank, returned in ``dtype`` (not rounded to bf16)."""
    w13, w2 = dequant_weights(ew)
    fmt = ew.format if quantize_activations else "bf16"
    quant_in = quant_mid = None
    if fmt == "fp8_per_tensor":
        quant_in = lambda a: quant_fp8_static(a, ew.a13_scale)
        quant_mid = lambda a: quant_fp8_static(a, ew.a2_scale)
    elif fmt == "fp8_block":
        quant_in = quant_mid = lambda a: dequant_group(*quant_fp8_group(a))
    y = _expert_sum(x, topk_ids.long() - ep_rank * w13.shape[0], topk_weights, w13, w2, dtype,
                    quant_in, quant_mid)
    y = y * routed_scaling
    if shared_output is not None:
        y = y + shared_output.double()
    return y.to(dtype)


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
