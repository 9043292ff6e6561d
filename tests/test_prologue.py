"""qk_norm_rope_store_kv (the fused attention prologue) against the fp64 oracle in reference/prologue.py.

Tolerance rule (evenflow.testing): q and each written cache slot within 2x the error of the same math done by
PyTorch in fp32 on the same bf16 inputs, rounded to the same output dtype, plus one ulp of that dtype at the
reference's magnitude. Every slot the call must not write is compared bit for bit with the cache before it.
"""
import math

import pytest
import torch

import evenflow
from evenflow.reference.attention import shuffled_page_tables
from evenflow.reference.prologue import qk_norm_rope_ref, quant_q_ref, store_kv_ref
from evenflow.testing import assert_within_rule

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def make_inputs(new, prefix, hq, hkv, d, page, kv_dtype=BF16, pad=0, rotary_dim=None, cs_dtype=torch.float32,
                pos_dtype=torch.int64, row_pad=0, device="cpu", seed=0):
    """A prefill/extend/decode step: request b adds ``new[b]`` tokens after ``prefix[b]`` cached ones; ``pad``
    padding tokens follow the live ones. Caches hold random values everywhere (a stray write changes bits)."""
    g = torch.Generator().manual_seed(seed)
    B = len(new)
    total = [p + n for p, n in zip(prefix, new)]
    tables, pool = shuffled_page_tables(total, page, generator=g)
    pt = tables[0]
    T = sum(new) + pad
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(T, width + row_pad, generator=g) * 2).to(BF16)  # sliced on the device (a copy to it packs rows)
    cu = torch.tensor([0] + [sum(new[:b + 1]) for b in range(B)], dtype=torch.int32)
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)] + [torch.full((pad,), 3)]).to(pos_dtype)
    r = d if rotary_dim is None else rotary_dim
    max_pos = max(total) + 5
    cos_sin = evenflow.rope_cos_sin(max_pos, r, base=10000.0, dtype=cs_dtype)
    kc = torch.randn(pool, page, hkv, d, generator=g)
    vc = torch.randn(pool, page, hkv, d, generator=g)
    if kv_dtype == FP8:
        kc, vc = (kc * 50).to(FP8), (vc * 50).to(FP8)
    else:
        kc, vc = kc.to(BF16), vc.to(BF16)
    qw = (torch.rand(d, generator=g) + 0.5).to(BF16)
    kw = (torch.rand(d, generator=g) + 0.5).float()
    to = dict(device=device)
    return dict(qkv=qkv.to(**to)[:, :width], positions=pos.to(**to), cos_sin=cos_sin.to(**to), k_cache=kc.to(**to),
                v_cache=vc.to(**to), page_table=pt.to(**to), cu_seqlens_q=cu.to(**to)), qw.to(**to), kw.to(**to)


def _step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` (bf16 or e4m3) at each |x|."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e.clamp_min(-6) - 3) if dtype == FP8 else torch.exp2(e.clamp_min(-126) - 7)


def assert_each_correctly_rounded(got, ref64, what, rel_noise=2.0 ** -18):
    """Element by element, beside the rule (whose bound is the tensor's: a few steps at its largest value): each
    output within half a step of its format of the oracle's value, plus fp32 noise (``rel_noise`` of the head's
    largest value). Rounding a value within that noise of the oracle's to nearest lands within half a step of it
    (the step taken above the noise, where a binade boundary is near); a result off by a constant factor, or rounded
    the wrong way, is not."""
    ref64 = ref64.double().cpu()
    noise = rel_noise * ref64.abs().amax(-1, keepdim=True)
    excess = (got.double().cpu() - ref64).abs() - 0.5 * _step(ref64.abs() + noise, got.dtype) - noise
    assert (excess <= 0).all(), f"{what}: an element beyond half a step of its format (worst by {excess.max():.3e})"


def _scale_value(s):
    return 1.0 if s is None else float(s) if not isinstance(s, torch.Tensor) else float(s.item())


def check(args, qw=None, kw=None, norm_before_rope=True, rope_style="neox", rotary_dim=None, q_dtype=BF16,
          k_scale=None, v_scale=None, eps=1e-6, what=""):
    """Run the prologue on copies of the caches and check q, q_scale, every written slot and every other slot."""
    kc0, vc0 = args["k_cache"].clone(), args["v_cache"].clone()
    q, qs = evenflow.qk_norm_rope_store_kv(**args, q_norm_weight=qw, k_norm_weight=kw, eps=eps,
                                           norm_before_rope=norm_before_rope, rope_style=rope_style,
                                           rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, q_dtype=q_dtype)
    hkv, d = kc0.shape[2], kc0.shape[3]
    kw_ = dict(num_kv_heads=hkv, head_dim=d, q_norm_weight=qw, k_norm_weight=kw, eps=eps,
               norm_before_rope=norm_before_rope, rope_style=rope_style)
    pos, cs = args["positions"], args["cos_sin"]
    ref = qk_norm_rope_ref(args["qkv"], pos, cs, **kw_)
    base = qk_norm_rope_ref(args["qkv"], pos, cs, dtype=torch.float32, **kw_)
    live = int(args["cu_seqlens_q"][-1])
    for x in (*ref, *base):
        x[live:] = 0  # padding tokens: q = 0 (and nothing written)
    if q_dtype == FP8:
        assert q.dtype == FP8 and qs.dtype == torch.float32 and qs.shape == q.shape[:2]
        rq8, rs = quant_q_ref(ref[0])
        bq8, _ = quant_q_ref(base[0])
        # the scale is amax / 448 of the rotated head: fp32 rounding of a few terms, not of the format
        torch.testing.assert_close(qs.cpu(), rs, rtol=2**-16, atol=0)
        assert_within_rule(q.cpu(), ref[0] / rs.double()[..., None], bq8, what=f"{what} fp8 q (scaled units)")
        # in the units of our own scale (within 2^-16 of the oracle's, so the noise allowed here is that)
        scaled = (ref[0] / qs.cpu().double()[..., None]).clamp(-448, 448)
        assert_each_correctly_rounded(q.cpu(), scaled, f"{what} fp8 q", rel_noise=2.0 ** -15)
    else:
        assert qs is None and q.dtype == BF16
        assert_within_rule(q.cpu(), ref[0], base[0].to(BF16), what=f"{what} q")
        assert_each_correctly_rounded(q.cpu(), ref[0], f"{what} q")
    ks, vs = _scale_value(k_scale), _scale_value(v_scale)
    common = (pos, args["page_table"], args["cu_seqlens_q"], ks, vs)
    bk, bv = store_kv_ref(kc0, vc0, base[1], base[2], *common)
    zeros = torch.zeros(kc0.shape, dtype=torch.float64)
    wk, wv = store_kv_ref(zeros, zeros, ref[1], ref[2], *common)  # the oracle's values, in fp64
    written = torch.zeros(kc0.shape[:2], dtype=torch.bool)
    cu, pt = args["cu_seqlens_q"].tolist(), args["page_table"].cpu()
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            p = int(pos[t])
            written[int(pt[b, p // kc0.shape[1]]), p % kc0.shape[1]] = True
    assert int(written.sum()) == live  # every live token owns a slot of its own
    bits = torch.uint8 if kc0.dtype == FP8 else torch.int16
    for name, got, old, want, b in (("k_cache", args["k_cache"], kc0, wk, bk), ("v_cache", args["v_cache"], vc0,
                                                                               wv, bv)):
        got = got.cpu()
        assert torch.equal(got.view(bits)[~written], old.cpu().view(bits)[~written]), \
            f"{what} {name}: a slot no token owns changed"
        if got.dtype == FP8:
            want = want.clamp(-448, 448)
        assert_within_rule(got[written], want[written], b[written], what=f"{what} {name} written slots")
        assert_each_correctly_rounded(got[written], want[written], f"{what} {name} written slots")
    return q, qs


# (new tokens per request, cached prefix, Hq, Hkv, D, page) shapes: decode (1 new), speculative (2-4 new), extend
# (a chunk after a prefix), prefill (no prefix), empty requests, page boundaries, padding
SHAPES = {
    "decode-g4-d128-p64": ([1, 1, 1], [70, 0, 129], 8, 2, 128, 64),
    "extend-g2-d64-p16-boundaries": ([5, 0, 17, 3], [11, 9, 0, 16], 4, 2, 64, 16),
    "prefill-g1-d256-p32": ([33, 7], [0, 0], 3, 3, 256, 32),
    "spec-g16-d64-p128": ([4, 2], [125, 0], 16, 1, 64, 128),
    "g8-three-kv-heads-d128-p32": ([3, 1], [31, 62], 24, 3, 128, 32),
    # one KV head (a TP8 slice): in the interpreter (4 SMs) key / value programs take several tokens each, the last
    # block ragged (on a GPU this call is too small for that: one token a program)
    "tp8-g8-one-kv-head-d128-p64": ([17, 1, 19], [60, 3, 0], 8, 1, 128, 64),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kv_dtype,q_dtype", [(BF16, BF16), (FP8, BF16), (FP8, FP8), (BF16, FP8)])
def test_shapes_and_dtypes(shape, kv_dtype, q_dtype, device):
    new, prefix, hq, hkv, d, page = SHAPES[shape]
    args, qw, kw = make_inputs(new, prefix, hq, hkv, d, page, kv_dtype, pad=2, device=device)
    scales = dict(k_scale=0.75, v_scale=torch.tensor([1.5], device=device)) if kv_dtype == FP8 else {}
    check(args, qw, kw, q_dtype=q_dtype, what=f"{shape} {kv_dtype} {q_dtype}", **scales)


@pytest.mark.parametrize("heads,d", [(1, 128), (8, 128), (32, 128), (3, 256), (64, 64)])
def test_row_blocks_fill_programs_without_starving_sms(heads, d):
    """The launcher's (heads, tokens) a program: powers of two, at most the block's 2048 elements (or one head row
    where a head is wider), tokens only where every SM still gets a program of this kind."""
    from evenflow.attention.prologue import _rows_block

    for sms in (4, 132):
        for t in (1, 3, 8, 100, 1000, 5000, 16384):
            h, k = _rows_block(heads, d, t, sms)
            assert h & (h - 1) == 0 and k & (k - 1) == 0 and h * k * d <= max(2048, d)
            blocks = -(-heads // h)
            assert k == 1 or -(-t // k) * blocks >= sms, (heads, d, t, sms, h, k)
            if t * blocks >= 2 * sms * 2048 // (h * d):  # rows enough: full blocks
                assert h * k * d >= min(2048, h * d * t), (heads, d, t, sms, h, k)


@pytest.mark.parametrize("norm", ["qk", "none", "q-only", "k-only"])
@pytest.mark.parametrize("norm_before_rope", [True, False])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_norm_and_rotation_forms(norm, norm_before_rope, rope_style, device):
    args, qw, kw = make_inputs([3, 2], [5, 60], 4, 2, 64, 16, device=device, seed=1)
    qw = qw if norm in ("qk", "q-only") else None
    kw = kw if norm in ("qk", "k-only") else None
    check(args, qw, kw, norm_before_rope=norm_before_rope, rope_style=rope_style, eps=1e-5,
          what=f"{norm} {norm_before_rope} {rope_style}")


@pytest.mark.parametrize("rotary_dim,rope_style,norm_before_rope,q_dtype", [
    (32, "neox", True, BF16), (64, "gptj", True, BF16), (2, "neox", True, BF16), (96, "neox", True, BF16),
    (48, "gptj", False, FP8), (64, "neox", False, FP8)])
def test_partial_rotary_dims(rotary_dim, rope_style, norm_before_rope, q_dtype, device):
    args, qw, kw = make_inputs([2, 3], [7, 0], 4, 2, 128, 32, rotary_dim=rotary_dim, device=device, seed=2)
    check(args, qw, kw, rotary_dim=rotary_dim, rope_style=rope_style, norm_before_rope=norm_before_rope,
          q_dtype=q_dtype, what=f"R={rotary_dim} {rope_style} {norm_before_rope} {q_dtype}")


@pytest.mark.parametrize("new,prefix", [([9], [30]), ([0, 3, 0, 2], [5, 17, 0, 64])])
def test_one_request_and_empty_requests_first(new, prefix, device):
    """B = 1 (a prefill), and empty requests first, between and last (the bisection skips them)."""
    args, qw, kw = make_inputs(new, prefix, 4, 2, 64, 16, FP8, pad=1, device=device, seed=12)
    check(args, qw, kw, q_dtype=FP8, k_scale=0.5, v_scale=0.25, what=f"{new}")


def test_bf16_table_int32_positions_strided_rows_and_scales(device):
    args, qw, kw = make_inputs([2, 4], [30, 1], 4, 1, 64, 32, cs_dtype=BF16, pos_dtype=torch.int32, row_pad=40,
                               device=device, seed=3)
    assert args["qkv"].stride(0) > args["qkv"].shape[1]
    check(args, qw, kw, k_scale=torch.tensor([0.5], device=device), v_scale=2.0, what="bf16 table, strides")


def test_hnd_cache_view(device):
    """A [num_pages, Hkv, P, D] cache passed as its NHD view (the layout decode_attention accepts)."""
    args, qw, kw = make_inputs([3, 1], [5, 40], 4, 2, 64, 16, device=device, seed=4)
    for name in ("k_cache", "v_cache"):
        args[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)
        assert not args[name].is_contiguous()
    check(args, qw, kw, what="hnd view")


def test_rope_matches_its_definition():
    """The oracle's tables and rotation against the formula written out for one element pair: a NeoX rotation
    of (x_i, x_{i+R/2}) by p * base^(-2i/R), a GPT-J rotation of (x_{2i}, x_{2i+1})."""
    from evenflow.reference.prologue import rotate

    cs = evenflow.rope_cos_sin(50, 8, base=500.0, dtype=torch.float64)
    x = torch.randn(1, 1, 8, dtype=torch.float64)
    p, i = 37, 2
    ang = p * 500.0 ** (-2 * i / 8)
    got = rotate(x, cs[p:p + 1, :4], cs[p:p + 1, 4:], "neox")[0, 0]
    assert math.isclose(got[i], x[0, 0, i] * math.cos(ang) - x[0, 0, i + 4] * math.sin(ang), rel_tol=1e-12)
    assert math.isclose(got[i + 4], x[0, 0, i + 4] * math.cos(ang) + x[0, 0, i] * math.sin(ang), rel_tol=1e-12)
    got = rotate(x, cs[p:p + 1, :4], cs[p:p + 1, 4:], "gptj")[0, 0]
    assert math.isclose(got[2 * i], x[0, 0, 2 * i] * math.cos(ang) - x[0, 0, 2 * i + 1] * math.sin(ang),
                        rel_tol=1e-12)
    assert math.isclose(got[2 * i + 1], x[0, 0, 2 * i + 1] * math.cos(ang) + x[0, 0, 2 * i] * math.sin(ang),
                        rel_tol=1e-12)


def test_padding_rows_are_zero_and_empty_batch(device):
    args, qw, kw = make_inputs([2, 0], [3, 0], 4, 2, 64, 16, pad=3, device=device, seed=5)
    args["qkv"][2:] = float("nan")  # padding rows may hold anything
    q, _ = check(args, qw, kw, what="padding")
    assert (q[2:] == 0).all()
    q8, s8 = evenflow.qk_norm_rope_store_kv(**args, q_dtype=FP8)
    assert (q8[2:].float() == 0).all() and torch.isfinite(s8).all()
    empty = dict(args, qkv=args["qkv"][:0], positions=args["positions"][:0],
                 cu_seqlens_q=torch.zeros_like(args["cu_seqlens_q"]))
    q, qs = evenflow.qk_norm_rope_store_kv(**empty)
    assert q.shape == (0, 4, 64) and qs is None
    # no request at all (B = 0): padding rows alone, q zero, nothing written
    none = dict(args, page_table=args["page_table"][:0], cu_seqlens_q=args["cu_seqlens_q"][:1],
                k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    q, _ = evenflow.qk_norm_rope_store_kv(**none, q_norm_weight=qw, k_norm_weight=kw)
    assert (q.float() == 0).all() and torch.equal(none["k_cache"], args["k_cache"])
    assert torch.equal(none["v_cache"], args["v_cache"])


def test_out_buffers_are_filled_in_place(device):
    args, qw, kw = make_inputs([2, 1], [0, 9], 4, 2, 64, 16, device=device, seed=6)
    ref_q, ref_s = evenflow.qk_norm_rope_store_kv(**{**args, "k_cache": args["k_cache"].clone(),
                                                     "v_cache": args["v_cache"].clone()}, q_dtype=FP8)
    q_out = torch.full((3, 4, 64), float("nan"), device=device).to(FP8)
    s_out = torch.full((3, 4), float("nan"), device=device)
    q, s = evenflow.qk_norm_rope_store_kv(**args, q_dtype=FP8, q_out=q_out, q_scale_out=s_out)
    assert q.data_ptr() == q_out.data_ptr() and s.data_ptr() == s_out.data_ptr()
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def test_bad_values_write_nothing_and_check_inputs_names_them(device):
    """A position past the page table, a page past the cache: the token writes nothing (the rest of the call
    goes on); ``check_inputs=True`` raises naming the entry."""
    args, qw, kw = make_inputs([2, 2], [3, 4], 4, 2, 64, 16, device=device, seed=7)
    cap = args["page_table"].shape[1] * 16
    cases = [
        ("positions", lambda a: a["positions"].__setitem__(1, cap), r"positions\[1\] = .* outside"),
        ("positions", lambda a: a["positions"].__setitem__(0, -1), r"positions\[0\] = -1 outside"),
        ("page_table", lambda a: a["page_table"].__setitem__((1, 0), a["k_cache"].shape[0]), r"page_table\[1, 0\]"),
        ("page_table", lambda a: a["page_table"].__setitem__((1, 0), -3), r"page_table\[1, 0\] = -3"),
    ]
    for _, spoil, pattern in cases:
        a = {k: v.clone() for k, v in args.items()}
        spoil(a)
        before = a["k_cache"].clone(), a["v_cache"].clone()
        with pytest.raises(ValueError, match=pattern):
            evenflow.qk_norm_rope_store_kv(**a, check_inputs=True)
        assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])
        evenflow.qk_norm_rope_store_kv(**a)  # no check: the bad token writes nothing, the good ones write
        changed = (a["k_cache"] != before[0]).any(-1).any(-1).nonzero()
        pos, pt = a["positions"].long(), a["page_table"]
        good = {(int(pt[b, int(pos[t]) // 16]), int(pos[t]) % 16) for b, t in ((0, 0), (0, 1), (1, 2), (1, 3))
                if 0 <= pos[t] < cap and 0 <= pt[b, int(pos[t]) // 16] < a["k_cache"].shape[0]}
        assert {tuple(x) for x in changed.tolist()} == good
    a = {k: v.clone() for k, v in args.items()}
    a["cu_seqlens_q"][1] = 5
    with pytest.raises(ValueError, match=r"cu_seqlens_q must not decrease"):
        evenflow.qk_norm_rope_store_kv(**a, check_inputs=True)
    a["cu_seqlens_q"][0] = 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        evenflow.validate_prologue_inputs(**a)
    a = {k: v.clone() for k, v in args.items()}
    a["cos_sin"] = a["cos_sin"][:4]
    with pytest.raises(ValueError, match=r"positions\[1\] = 4 outside \[0, 4\)"):
        evenflow.qk_norm_rope_store_kv(**a, check_inputs=True)


def test_argument_errors_name_the_argument(device):
    args, qw, kw = make_inputs([2, 1], [3, 4], 4, 2, 64, 16, device=device, seed=8)
    f = evenflow.qk_norm_rope_store_kv
    cases = [
        (TypeError, "qkv must have dtype", dict(qkv=args["qkv"].float())),
        (ValueError, "qkv's width", dict(qkv=args["qkv"][:, :-64])),
        (ValueError, "qkv must have a unit stride", dict(qkv=args["qkv"].t().contiguous().t())),
        (ValueError, "positions must have shape", dict(positions=args["positions"][:2])),
        (TypeError, "positions must have dtype", dict(positions=args["positions"].float())),
        (ValueError, "cos_sin must have shape", dict(cos_sin=args["cos_sin"][:, :32])),
        (TypeError, "v_cache must have dtype", dict(v_cache=args["v_cache"].to(FP8))),
        (ValueError, "page size", dict(k_cache=args["k_cache"][:, :8], v_cache=args["v_cache"][:, :8])),
        (ValueError, "cu_seqlens_q must have shape", dict(cu_seqlens_q=args["cu_seqlens_q"][:2])),
        (TypeError, "page_table must have dtype", dict(page_table=args["page_table"].long())),
        (ValueError, "q_norm_weight must have shape", dict(q_norm_weight=qw[:32])),
        (ValueError, "rope_style must be one of", dict(rope_style="llama")),
        (ValueError, "rotary_dim must be even", dict(rotary_dim=63)),
        (ValueError, "rotary_dim must be <= 64", dict(rotary_dim=128)),
        (ValueError, "q_dtype must be one of", dict(q_dtype=torch.float16)),
        (ValueError, "k_scale must be a finite positive number", dict(k_scale=0.0)),
        (ValueError, "v_scale must hold one element", dict(v_scale=torch.ones(2, device=device))),
        (ValueError, "eps must be > 0", dict(eps=0.0)),
        (TypeError, "norm_before_rope must be a bool", dict(norm_before_rope=1)),
        (ValueError, "q_out must have shape", dict(q_out=torch.empty(2, 4, 64, dtype=BF16, device=device))),
        (ValueError, "q_scale_out is only written", dict(q_scale_out=torch.empty(3, 4, device=device))),
    ]
    for err, pattern, bad in cases:
        with pytest.raises(err, match=pattern):
            f(**{**args, **{k: v for k, v in bad.items() if k in args}},
              **{k: v for k, v in bad.items() if k not in args})
    q, _ = f(**args)  # the same call with good arguments runs
    assert q.shape == (3, 4, 64)


def test_eps_scales_and_the_rotary_table_outside_fp32_are_refused(device):
    """Round CK's review of the prologue's number checks: an eps below fp32's smallest normal number (0 in the
    kernel's fp32, so an all-zero head gave NaN), float k / v scales outside fp32's normal range, scale tensors that
    are not such a number (under check_inputs=True, in the prologue and in store_kv), and a rotary table from a
    base that is not a positive finite number (NaN angles) or from sizes that are not ints, are refused by name; at
    eps = fp32's smallest normal an all-zero q head comes out zeros."""
    from evenflow.attention.prologue import store_kv

    args, qw, kw = make_inputs([2, 1], [3, 4], 4, 2, 64, 16, device=device, seed=8)
    f = evenflow.qk_norm_rope_store_kv
    for eps in (1e-50, 1e-40):
        with pytest.raises(ValueError, match="eps must be at least fp32's smallest normal number"):
            f(**args, q_norm_weight=qw, eps=eps)
    zero_head = dict(args, qkv=args["qkv"].clone())
    zero_head["qkv"][0, :64] = 0
    q, _ = f(**zero_head, q_norm_weight=qw, eps=torch.finfo(torch.float32).tiny)
    assert torch.equal(q[0, 0].float(), torch.zeros(64, device=device))
    fp32_range = "must be a finite positive number in fp32's normal range"
    for bad in (1e-50, 3e-39, 1e39):
        with pytest.raises(ValueError, match=f"k_scale {fp32_range}"):
            f(**args, k_scale=bad)
    k_rows = torch.randn(2, 2, 64, device=device)
    slots = torch.tensor([0, 1], device=device)
    for name in ("k_scale", "v_scale"):
        for bad in (float("nan"), -1.0, 1e-40):
            scale = torch.tensor([bad], device=device)
            with pytest.raises(ValueError, match=f"{name} {fp32_range}"):
                f(**args, **{name: scale}, check_inputs=True)
            with pytest.raises(ValueError, match=f"{name} {fp32_range}"):
                store_kv(k_rows, k_rows, args["k_cache"], args["v_cache"], slots, **{name: scale}, check_inputs=True)
    for base in (0.0, -1e4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="base must be"):
            evenflow.rope_cos_sin(8, 64, base=base)
    for kwargs, pattern in ((dict(max_pos=2.5), "max_pos must be an int"),
                            (dict(max_pos="8"), "max_pos must be an int"),
                            (dict(rotary_dim=64.0), "rotary_dim must be an int"),
                            (dict(dtype=torch.int32), "dtype must be a floating-point torch.dtype")):
        with pytest.raises(TypeError, match=pattern):
            evenflow.rope_cos_sin(**{"max_pos": 8, "rotary_dim": 64, **kwargs})
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        evenflow.rope_cos_sin(8, 63)


def test_feeds_decode_attention(device):
    """One decode step as an engine runs it: the prologue writes each request's new token into the cache and
    hands q (bf16, or fp8 with its scales) to decode_attention; the result is the oracle's attention over the
    oracle's cache, under decode's own tolerance rule (tests/test_decode.py)."""
    from evenflow.reference.attention import decode_attention_ref

    for kv_dtype, q_dtype in ((BF16, BF16), (FP8, FP8)):
        args, qw, kw = make_inputs([1, 1, 1], [40, 0, 64], 8, 2, 64, 16, kv_dtype, device=device, seed=9)
        sl = torch.tensor([41, 1, 65], dtype=torch.int32, device=device)
        ks = 0.05 if kv_dtype == FP8 else None
        kc0, vc0 = args["k_cache"].clone(), args["v_cache"].clone()
        q, qs = evenflow.qk_norm_rope_store_kv(**args, q_norm_weight=qw, k_norm_weight=kw, q_dtype=q_dtype,
                                               k_scale=ks, v_scale=ks)
        o = evenflow.decode_attention(q, args["k_cache"], args["v_cache"], args["page_table"], sl, q_scale=qs,
                                      k_scale=ks, v_scale=ks)
        kw_ = dict(num_kv_heads=2, head_dim=64, q_norm_weight=qw, k_norm_weight=kw)
        rq, rk, rv = qk_norm_rope_ref(args["qkv"], args["positions"], args["cos_sin"], **kw_)
        s = _scale_value(ks)
        common = (args["positions"], args["page_table"], args["cu_seqlens_q"], s, s)
        rkc, rvc = store_kv_ref(kc0.double(), vc0.double(), rk, rv, *common)  # the oracle's cache, in fp64
        ref, _ = decode_attention_ref(rq, rkc, rvc, args["page_table"], sl, k_scale=ks, v_scale=ks)
        # baseline: fp32 attention over what the prologue's precision gives (bf16 q and cache, or fp8 q and cache)
        bq, bk, bv = qk_norm_rope_ref(args["qkv"], args["positions"], args["cos_sin"], dtype=torch.float32, **kw_)
        bkc, bvc = store_kv_ref(kc0, vc0, bk, bv, *common)
        bq_in, bqs = quant_q_ref(bq) if q_dtype == FP8 else (bq.to(BF16), None)
        base, _ = decode_attention_ref(bq_in, bkc, bvc, args["page_table"], sl, q_scale=bqs, k_scale=ks, v_scale=ks,
                                       dtype=torch.float32, p_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
        assert_within_rule(o, ref, base, what=f"decode after the prologue ({kv_dtype}, {q_dtype})")


def test_opcheck(device):
    args, qw, kw = make_inputs([2, 1], [3, 4], 4, 2, 64, 16, device=device, seed=10)
    a = args
    q = torch.empty(3, 4, 64, dtype=BF16, device=device)
    op_args = (a["qkv"], a["positions"], a["cos_sin"], a["k_cache"], a["v_cache"], a["page_table"],
               a["cu_seqlens_q"], qw, kw, None, None, q, None, 1.0, 1.0, 1e-6, 64, False, True)
    torch.library.opcheck(torch.ops.evenflow.qk_norm_rope_store_kv.default, op_args,
                          test_utils=("test_schema", "test_faketensor"))
    bad = list(op_args)
    bad[11] = torch.empty(2, 4, 64, dtype=BF16, device=device)
    with pytest.raises(ValueError, match="q_out must have shape"):
        torch.ops.evenflow.qk_norm_rope_store_kv(*bad)


def test_compiled_calls_go_through_the_custom_op(device):
    args, qw, kw = make_inputs([2, 1], [3, 4], 4, 2, 64, 16, device=device, seed=11)
    eager_cache = args["k_cache"].clone(), args["v_cache"].clone()
    eager = evenflow.qk_norm_rope_store_kv(**{**args, "k_cache": eager_cache[0], "v_cache": eager_cache[1]},
                                           q_norm_weight=qw, k_norm_weight=kw, q_dtype=FP8)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def step(qkv, positions):
        return evenflow.qk_norm_rope_store_kv(qkv, positions, args["cos_sin"], args["k_cache"], args["v_cache"],
                                              args["page_table"], args["cu_seqlens_q"], q_norm_weight=qw,
                                              k_norm_weight=kw, q_dtype=FP8)

    q, qs = step(args["qkv"], args["positions"])
    assert any("evenflow.qk_norm_rope_store_kv" in t for t in seen), seen
    assert torch.equal(q.view(torch.uint8), eager[0].view(torch.uint8)) and torch.equal(qs, eager[1])
    assert torch.equal(args["k_cache"], eager_cache[0]) and torch.equal(args["v_cache"], eager_cache[1])
