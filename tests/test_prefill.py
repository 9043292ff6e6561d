"""prefill_attention (paged prefill / extend, causal over a cached prefix) against the fp64 oracle, under the
tolerance rule (evenflow.testing): the baseline is PyTorch in fp32 on the same bf16 / fp8 inputs, the unnormalised
probabilities rounded to bf16 before the product with V and the output rounded to bf16, as the kernel does."""
import math

import pytest
import torch

import evenflow
from evenflow.reference.attention import (
    decode_attention_ref,
    prefill_attention_ref,
    random_kv_caches,
    shuffled_page_tables,
)
from evenflow.testing import assert_within_rule, poisoned

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def make_inputs(new, prefix, hq, hkv, d, page, kv_dtype=BF16, pad=0, hnd=False, device="cpu", seed=0):
    """Request b has ``prefix[b]`` cached tokens and ``new[b]`` new ones (already in the cache); ``pad`` padding rows
    follow the live ones in q."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in zip(prefix, new)]
    tables, pool = shuffled_page_tables(lens, page, generator=g)
    k, v = random_kv_caches(pool, page, hkv, d, kv_dtype, hnd=hnd, generator=g)
    T = sum(new) + pad
    q = torch.randn(T, hq, d, generator=g).to(BF16)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    to = dict(device=device)
    return (q.to(**to), k.to(**to), v.to(**to), cu.to(**to), tables[0].to(**to),
            torch.tensor(lens, dtype=torch.int32, **to))


def check(q, k, v, cu, pt, sl, max_seqlen_q=None, k_scale=None, v_scale=None, sm_scale=None, what=""):
    T, hq, d = q.shape
    out = poisoned((T, hq, d), BF16, q.device)
    lse = poisoned((T, hq), torch.float32, q.device)
    if max_seqlen_q is None:
        max_seqlen_q = max(1, int((cu[1:] - cu[:-1]).max()))
    o, lse = evenflow.prefill_attention(q, k, v, cu, pt, sl, max_seqlen_q, k_scale=k_scale, v_scale=v_scale,
                                        sm_scale=sm_scale, out=out, return_lse=True, lse=lse)
    assert o.data_ptr() == out.data_ptr()
    kw = dict(k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    ref, ref_lse = prefill_attention_ref(q, k, v, cu, pt, sl, **kw)
    base, base_lse = prefill_attention_ref(q, k, v, cu, pt, sl, dtype=torch.float32, p_dtype=BF16, out_dtype=BF16,
                                           **kw)
    assert_within_rule(o.cpu(), ref.cpu(), base.cpu(), what=f"{what} output")
    # the rule's bound is the tensor's largest (rows that see one key reach |4|); a uniform scale error of the
    # output hides under it up to ~1.4%, so its bias is checked apart: the least-squares scale of the output on the
    # oracle (fp32 rounding of P and the output leave it within ~5e-5 of 1)
    r64, o64 = ref.double().cpu(), o.double().cpu()
    if (r64 != 0).any():  # (where no row sees a key the oracle is all zeros: the zero-row checks below hold it)
        bias = float((o64 * r64).sum() / (r64 * r64).sum())
        assert abs(bias - 1) <= 1e-3, f"{what}: output biased by a factor {bias:.6f}"
    lse_c, ref_lse, base_lse = lse.cpu(), ref_lse.cpu(), base_lse.cpu()
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse_c) & (lse_c < 0), dead), f"{what}: lse -inf exactly where no key is seen"
    assert (o.cpu()[dead] == 0).all(), f"{what}: rows that see no key (and padding rows) must be zero"
    assert_within_rule(lse_c[~dead], ref_lse[~dead], base_lse[~dead].float(), what=f"{what} lse")
    return o


# (new tokens per request, cached prefix, Hq, Hkv, D, page)
SHAPES = {
    "prefill-g4-d128-p64": ([70, 33], [0, 0], 8, 2, 128, 64),
    "extend-g2-d64-p16-page-edges": ([17, 1, 16, 0], [15, 16, 33, 9], 4, 2, 64, 16),
    "extend-g1-d256-p32": ([20, 5], [40, 0], 2, 2, 256, 32),
    "extend-g16-d64-p128": ([9, 40], [130, 1], 16, 1, 64, 128),
    "g8-three-kv-heads-d64-p32": ([3, 48], [61, 2], 24, 3, 64, 32),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kv_dtype", [BF16, FP8])
def test_shapes(shape, kv_dtype, device):
    new, prefix, hq, hkv, d, page = SHAPES[shape]
    inputs = make_inputs(new, prefix, hq, hkv, d, page, kv_dtype, pad=2, device=device)
    scales = dict(k_scale=1 / 30, v_scale=torch.tensor([1 / 40], device=device)) if kv_dtype == FP8 else {}
    check(*inputs, what=f"{shape} {kv_dtype}", **scales)


@pytest.mark.parametrize("max_seqlen_q", [1, 16, 33, 200])
def test_grid_bound_below_or_above_the_rows(max_seqlen_q, device):
    """max_seqlen_q sizes the grid only: below a request's rows, fewer programs walk all of its row blocks; above,
    the extra programs find no block."""
    inputs = make_inputs([100, 37, 1], [5, 70, 0], 4, 1, 64, 16, device=device, seed=1)
    check(*inputs, max_seqlen_q=max_seqlen_q, what=f"max_seqlen_q={max_seqlen_q}")


def test_sm_scale_hnd_view_and_scale_kinds(device):
    inputs = make_inputs([20, 3], [11, 50], 4, 2, 64, 16, FP8, hnd=True, device=device, seed=2)
    assert not inputs[1].is_contiguous()
    check(*inputs, k_scale=torch.tensor([0.02], device=device), v_scale=0.03, sm_scale=0.3, what="hnd fp8")


def test_matches_decode_attention_where_both_apply(device):
    """q_len new tokens a request (1-4, speculative verification) is a decode call too: both operators compute the
    same attention (under the rule against the same oracle, and within a few bf16 steps of each other)."""
    for q_len in (1, 3):
        B = 4
        q, k, v, cu, pt, sl = make_inputs([q_len] * B, [90, 0, 300, 17], 8, 2, 64, 64, device=device, seed=3)
        o_pre = check(q, k, v, cu, pt, sl, what=f"q_len {q_len}")
        o_dec = evenflow.decode_attention(q, k, v, pt, sl)
        ref, _ = decode_attention_ref(q, k, v, pt, sl, q_len=q_len)
        base, _ = decode_attention_ref(q, k, v, pt, sl, q_len=q_len, dtype=torch.float32, p_dtype=BF16,
                                       out_dtype=BF16)
        assert_within_rule(o_dec.cpu(), ref, base, what=f"decode q_len {q_len}")
        diff = (o_pre.float() - o_dec.float()).abs().max().item()
        assert diff <= 4 * 2 ** -8 * ref.abs().max().item(), diff


def test_rows_that_see_nothing_and_clamped_values(device):
    """A length under the request's new rows (its first rows see no key: zeros, LSE -inf), a length past the page
    table (clamped to it), and a page id past the cache (clamped): no fault, the rule holds for what the oracle sees
    of the clamped values, and check_inputs names each."""
    q, k, v, cu, pt, sl = make_inputs([6, 4], [3, 10], 4, 2, 64, 16, device=device, seed=4)
    sl_short = sl.clone()
    sl_short[0] = 2  # 6 new rows, 2 tokens: rows 0-3 see nothing
    check(q, k, v, cu, pt, sl_short, what="short length")
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2 outside \[6, "):
        evenflow.prefill_attention(q, k, v, cu, pt, sl_short, 6, check_inputs=True)
    cap = pt.shape[1] * 16
    sl_long = sl.clone()
    sl_long[1] = cap + 50
    out = evenflow.prefill_attention(q, k, v, cu, pt, sl_long, 6)
    sl_cap = sl_long.clone()
    sl_cap[1] = cap
    assert torch.equal(out, evenflow.prefill_attention(q, k, v, cu, pt, sl_cap, 6))
    with pytest.raises(ValueError, match=rf"seq_lens\[1\] = {cap + 50} outside"):
        evenflow.validate_prefill_inputs(q, k, v, cu, pt, sl_long)
    pt_bad = pt.clone()
    pt_bad[1, 0] = k.shape[0] + 5
    pt_clamped = pt.clone()
    pt_clamped[1, 0] = k.shape[0] - 1
    assert torch.equal(evenflow.prefill_attention(q, k, v, cu, pt_bad, sl, 6),
                       evenflow.prefill_attention(q, k, v, cu, pt_clamped, sl, 6))
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]"):
        evenflow.prefill_attention(q, k, v, cu, pt_bad, sl, 6, check_inputs=True)
    cu_late = cu.clone()
    cu_late[0] = 2  # rows 0-1 belong to no request: zeros, LSE -inf (the oracle's rows of request 0 start at 2)
    o, lse = evenflow.prefill_attention(q, k, v, cu_late, pt, sl, 6, return_lse=True)
    assert (o[:2] == 0).all() and torch.isinf(lse[:2]).all()
    ref, _ = prefill_attention_ref(q, k, v, cu_late, pt, sl)
    base, _ = prefill_attention_ref(q, k, v, cu_late, pt, sl, dtype=torch.float32, p_dtype=BF16, out_dtype=BF16)
    assert_within_rule(o.cpu(), ref.cpu(), base.cpu(), what="rows before cu[0]")
    cu_bad = cu.clone()
    cu_bad[1] = 99
    with pytest.raises(ValueError, match=r"cu_seqlens_q must not decrease"):
        evenflow.prefill_attention(q, k, v, cu_bad, pt, sl, 6, check_inputs=True)
    out = evenflow.prefill_attention(q, k, v, cu_bad, pt, sl, 6)  # boundaries clamped to q's rows: no fault
    assert torch.isfinite(out.float()).all()


# Round CA's loop forms and round CC's head packing (evenflow.attention.prefill's switches; all three on by default
# since round CC), each form set whole: the masked one-head form of record before them, each switch alone, split and
# wide unpacked (the benchmark's knob rows among them)
_SWITCHES = ("SPLIT_LOOP", "WIDE_ROWS", "PACK_HEADS")
FORMS = {"masked": (), "split": ("SPLIT_LOOP",), "wide": ("WIDE_ROWS",), "pack": ("PACK_HEADS",),
         "unpacked": ("SPLIT_LOOP", "WIDE_ROWS")}


def _set_form(m, P, form):
    for switch in _SWITCHES:
        m.setattr(P, switch, switch in FORMS[form])


# (new, prefix, Hq, Hkv, D, page, kv dtype, max_seqlen_q or None): the unmasked steps' page id at each page size
# (one a step at 64 / 128, one a key at 16 / 32), prefixes that end mid-page and mid-step, a grid bound under the
# rows (fewer programs walk every block) and over them, 128-row blocks at D 64 / 128
FORM_CASES = {
    "long-prefill-d128-p64": ([200, 65], [130, 0], 8, 2, 128, 64, BF16, None),
    "long-prefill-d64-p16-fp8": ([150, 7], [37, 300], 4, 1, 64, 16, FP8, None),
    "extend-d128-p128-fp8": ([70, 129], [0, 200], 4, 2, 128, 128, FP8, None),
    "grid-under-rows-d64-p32": ([300, 40], [5, 61], 4, 2, 64, 32, BF16, 33),
    "grid-over-rows-d256-p32": ([20, 5], [40, 0], 2, 2, 256, 32, BF16, 200),
    # packed heads: 8 heads of 16 rows (a short extend at group 8), 2 of 32 at group 6 (4 does not divide it),
    # group 3 (nothing to pack), 2 of 64 rows; a grid bound under the rows with packed heads
    "extend-g8-d128-p16": ([5, 12, 1], [40, 0, 17], 16, 2, 128, 16, BF16, None),
    "extend-g6-d64-p64-fp8": ([30, 2], [100, 63], 6, 1, 64, 64, FP8, None),
    "extend-g3-d128-p32": ([9, 20], [3, 70], 3, 1, 128, 32, BF16, None),
    "chunk-g2-d128-p64-under": ([64, 50], [70, 0], 4, 2, 128, 64, BF16, 20),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_loop_forms_compute_what_the_form_of_record_computes(form, device, monkeypatch):
    """Each of round CA's loop forms within the rule of the fp64 oracle, over padding rows and rows that see no key
    (a length under a request's new rows); in the interpreter, bit for bit the default form's output and LSE (the
    same keys in the same steps and order: only masks that select nothing, the page id's load and the rows a block
    holds change). The default (split, wide and packed) differs from each form in at least one
    switch, so every pair of forms is compared through it."""
    from evenflow.attention import prefill as P

    for name, (new, prefix, hq, hkv, d, page, kv, max_q) in FORM_CASES.items():
        q, k, v, cu, pt, sl = make_inputs(new, prefix, hq, hkv, d, page, kv, pad=3, device=device, seed=7)
        if name.startswith("grid-under"):
            sl[1] = 30  # 40 new rows, 30 tokens: rows 0-9 of request 1 see nothing
        scales = dict(k_scale=1 / 30, v_scale=1 / 40) if kv == FP8 else {}
        mq = max_q or max(new)
        base = evenflow.prefill_attention(q, k, v, cu, pt, sl, mq, return_lse=True, **scales)
        with monkeypatch.context() as m:
            _set_form(m, P, form)
            got = check(q, k, v, cu, pt, sl, max_seqlen_q=mq, what=f"{form} {name}", **scales)
            got_lse = evenflow.prefill_attention(q, k, v, cu, pt, sl, mq, return_lse=True, **scales)[1]
        if device == "cpu":
            assert torch.equal(got, base[0]), f"{form} {name}: output differs from the default form's"
            assert torch.equal(got_lse, base[1]), f"{form} {name}: LSE differs from the default form's"
    # values the kernel clamps, where each form takes its unmasked steps and one page id a step (page 64, D 128):
    # a length under a request's new rows (a negative prefix: its first rows see nothing), a length past the page
    # table, a page id past the cache and one below 0; every form computes what the default computes of them
    q, k, v, cu, pt, sl = make_inputs([150, 90], [0, 40], 4, 2, 128, 64, pad=2, device=device, seed=9)
    sl[0] = 100
    sl[1] = pt.shape[1] * 64 + 50
    pt[1, 0] = k.shape[0] + 3
    pt[0, 1] = -2
    base = evenflow.prefill_attention(q, k, v, cu, pt, sl, 150, return_lse=True)
    with monkeypatch.context() as m:
        _set_form(m, P, form)
        got = evenflow.prefill_attention(q, k, v, cu, pt, sl, 150, return_lse=True)
    assert torch.isfinite(got[0].float()).all()
    if device == "cpu":
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), f"{form}: clamped values"
    else:
        torch.testing.assert_close(got[0].float(), base[0].float(), rtol=0, atol=2 ** -7 * base[0].abs().max())


def test_argument_errors_name_the_argument(device):
    q, k, v, cu, pt, sl = make_inputs([3, 2], [5, 0], 4, 2, 64, 16, device=device, seed=5)
    f = evenflow.prefill_attention
    cases = [
        (TypeError, "q must have dtype", lambda: f(q.float(), k, v, cu, pt, sl, 3)),
        (ValueError, "q heads", lambda: f(q[:, :3], k, v, cu, pt, sl, 3)),
        (ValueError, "q head_dim", lambda: f(q[..., :32], k, v, cu, pt, sl, 3)),
        (TypeError, "v_cache must have dtype", lambda: f(q, k, v.to(FP8), cu, pt, sl, 3)),
        (ValueError, "page size", lambda: f(q, k[:, :8], v[:, :8], cu, pt, sl, 3)),
        (ValueError, "cu_seqlens_q must have shape", lambda: f(q, k, v, cu[:2], pt, sl, 3)),
        (TypeError, "cu_seqlens_q must have dtype", lambda: f(q, k, v, cu.long(), pt, sl, 3)),
        (ValueError, "page_table must have 2 rows", lambda: f(q, k, v, cu, pt[:1], sl, 3)),
        (ValueError, "seq_lens is empty", lambda: f(q, k, v, cu[:1], pt[:0], sl[:0], 3)),
        (ValueError, "max_seqlen_q must be >= 1", lambda: f(q, k, v, cu, pt, sl, 0)),
        (TypeError, "max_seqlen_q must be an int", lambda: f(q, k, v, cu, pt, sl, 3.0)),
        (ValueError, "sm_scale must be > 0", lambda: f(q, k, v, cu, pt, sl, 3, sm_scale=-1.0)),
        (ValueError, "k_scale must be a finite positive", lambda: f(q, k, v, cu, pt, sl, 3, k_scale=0.0)),
        (ValueError, "out must have shape", lambda: f(q, k, v, cu, pt, sl, 3, out=torch.empty(2, 4, 64, dtype=BF16,
                                                                                               device=device))),
        (ValueError, "lse is given but return_lse is False", lambda: f(q, k, v, cu, pt, sl, 3,
                                                                       lse=torch.empty(5, 4, device=device))),
    ]
    for err, pattern, call in cases:
        with pytest.raises(err, match=pattern):
            call()
    assert f(q, k, v, cu, pt, sl, 3).shape == (5, 4, 64)


def test_after_the_prologue(device):
    """A prefill chunk as an engine runs it: the prologue writes the chunk's K and V into the cache behind a cached
    prefix and hands q to prefill_attention; the result is the oracle's attention over the oracle's cache."""
    from evenflow.reference.prologue import qk_norm_rope_ref, store_kv_ref
    from test_prologue import make_inputs as prologue_inputs

    args, qw, kw = prologue_inputs([20, 7], [13, 40], 8, 2, 64, 16, device=device, seed=6)
    kc0, vc0 = args["k_cache"].clone(), args["v_cache"].clone()
    q, _ = evenflow.qk_norm_rope_store_kv(**args, q_norm_weight=qw, k_norm_weight=kw)
    sl = torch.tensor([33, 47], dtype=torch.int32, device=device)
    o = evenflow.prefill_attention(q, args["k_cache"], args["v_cache"], args["cu_seqlens_q"], args["page_table"], sl,
                                   20)
    a = {k: v.cpu() for k, v in args.items()}  # the oracles on the host
    qw, kw, kc0, vc0, sl = qw.cpu(), kw.cpu(), kc0.cpu(), vc0.cpu(), sl.cpu()
    common = (a["positions"], a["page_table"], a["cu_seqlens_q"])
    rq, rk, rv = qk_norm_rope_ref(a["qkv"], a["positions"], a["cos_sin"], 2, 64, qw, kw)
    rkc, rvc = store_kv_ref(kc0.double(), vc0.double(), rk, rv, *common)
    ref, _ = prefill_attention_ref(rq, rkc, rvc, a["cu_seqlens_q"], a["page_table"], sl)
    bq, bk, bv = qk_norm_rope_ref(a["qkv"], a["positions"], a["cos_sin"], 2, 64, qw, kw, dtype=torch.float32)
    bkc, bvc = store_kv_ref(kc0, vc0, bk, bv, *common)
    base, _ = prefill_attention_ref(bq.to(BF16), bkc, bvc, a["cu_seqlens_q"], a["page_table"], sl,
                                    dtype=torch.float32, p_dtype=BF16, out_dtype=BF16)
    assert_within_rule(o.cpu(), ref, base, what="prefill after the prologue")


def test_opcheck_and_direct_call_checks(device):
    q, k, v, cu, pt, sl = make_inputs([3, 2], [5, 0], 4, 2, 64, 16, device=device, seed=7)
    out = torch.empty(5, 4, 64, dtype=BF16, device=device)
    lse = torch.empty(5, 4, device=device)
    args = (q, k, v, cu, pt, sl, out, lse, None, None, 1.0, 1.0, 1 / math.sqrt(64), 3)
    torch.library.opcheck(torch.ops.evenflow.prefill_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    op = torch.ops.evenflow.prefill_attention.default
    bad = list(args)
    bad[6] = out[:2]
    with pytest.raises(ValueError, match="out must have shape"):
        op(*bad)
    bad = list(args)
    bad[7] = lse[:, :2]
    with pytest.raises(ValueError, match="lse must have shape"):
        op(*bad)
    bad = list(args)
    bad[3] = cu[:2]
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        op(*bad)


def test_compiled_calls_go_through_the_custom_op(device):
    q, k, v, cu, pt, sl = make_inputs([9, 4], [5, 30], 4, 2, 64, 16, device=device, seed=8)
    eager = evenflow.prefill_attention(q, k, v, cu, pt, sl, 9)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def step(q, sl):
        return evenflow.prefill_attention(q, k, v, cu, pt, sl, 9)

    got = step(q, sl)
    assert any("evenflow.prefill_attention" in t for t in seen), seen
    assert torch.equal(got, eager)


def test_heads_per_block_packs_whole_powers_of_two_of_the_group():
    """PACK_HEADS' choice: the largest power of two dividing the group with the block at most 128 rows, D <= 128;
    nothing packed without the switch, at D 256, or for 128-row blocks."""
    from evenflow.attention.prefill import _heads_per_block

    assert [_heads_per_block(16, 128, g, True) for g in (1, 2, 3, 4, 6, 8, 12, 16)] == [1, 2, 1, 4, 2, 8, 4, 8]
    assert [_heads_per_block(64, 128, g, True) for g in (1, 2, 8, 16)] == [1, 2, 2, 2]
    assert _heads_per_block(32, 64, 8, True) == 4
    assert _heads_per_block(16, 256, 8, True) == 1
    assert _heads_per_block(128, 128, 8, True) == 1
    assert _heads_per_block(16, 128, 8, False) == 1
