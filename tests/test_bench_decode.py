"""CPU tests of the decode benchmark's pure-Python parts and the FlashInfer adapter's layout conversion.

Timings are not tested here (they run only on a GPU); these check that the cases,
floors, inputs and peer layouts the timings rest on are right.
"""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from evenflow import _runtime
from evenflow.bench.harness import PeerUnavailable, floor_us
from evenflow.bench.peers import flashinfer as fi_peer
from evenflow.reference.attention import POOL_SLACK, shuffled_page_tables
from tests_support_bench import load_script as _load

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
# where the tests that launch kernels run them: the interpreter's CPU tensors, or a GPU's
_DEV = "cpu" if _runtime.interpreting() else "cuda"


D = _load("decode")

# BENCH.md's standard decode cases, spelled as the result rows must spell them.
BENCH_CASES = ["64x512", "32x4K", "8x32K", "1x32K+63x512", "2x64K+30x1K", "1x128K+31x4K",
               "64x4K", "32x128+32x4K", "2x32K+30x4K", "1x64K+15x4K", "tp8:1x128K+31x4K"]


# ----------------------------------------------------------------------------- case parsing

def test_standard_case_names_match_bench_md():
    assert D.CASES == BENCH_CASES
    assert set(D.QUICK_CASES) <= set(D.CASES)
    assert set(D.VARIANTS) == {"bf16-kv", "fp8-kv", "fp8-kv-fp8-q"}
    # BENCH.md's two variants run by default and carry issue 3's targets; the fp8-q one (round AO) is extra
    assert D.DEFAULT_VARIANTS == ["bf16-kv", "fp8-kv"] and D.TARGET_VARIANTS == ("bf16-kv", "fp8-kv")
    assert [D.q_dtype_of(v) for v in D.VARIANTS] == [torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("name,lengths,heads", [
    ("64x512", [512] * 64, (64, 8)),
    ("8x32K", [32768] * 8, (64, 8)),
    ("1x128K+31x4K", [131072] + [4096] * 31, (64, 8)),
    ("32x128+32x4K", [128] * 32 + [4096] * 32, (64, 8)),
    ("2x64K+30x1K", [65536] * 2 + [1024] * 30, (64, 8)),
    ("tp8:1x128K+31x4K", [131072] + [4096] * 31, (8, 1)),
    ("tp2:3x100+1x1k", [100] * 3 + [1024], (32, 4)),
])
def test_parse_case(name, lengths, heads):
    c = D.parse_case(name)
    assert c.name == name
    assert list(c.lengths) == lengths
    assert (c.num_q_heads, c.num_kv_heads) == heads
    assert c.batch == len(lengths) and c.tokens == sum(lengths)
    assert c.mixed == (len(set(lengths)) > 1)


def test_every_standard_case_parses_with_the_group_of_eight():
    for name in BENCH_CASES:
        c = D.parse_case(name)
        assert c.num_q_heads // c.num_kv_heads == 8 and c.num_q_heads % c.num_kv_heads == 0


@pytest.mark.parametrize("bad", ["", "x4K", "4K", "0x512", "8x0", "8x32M", "8x32K+", "tp3:8x32K",
                                 "tq8:8x32K", "8*32K", "-1x512"])
def test_parse_case_rejects_malformed(bad):
    with pytest.raises(ValueError, match="case"):
        D.parse_case(bad)


def test_cases_option_takes_any_mix_and_names_a_bad_one():
    """``--cases``: BENCH.md's names, their slices and any other mix parse_case reads (the demo's Qwen3 slice); a
    name it refuses exits naming it, before any GPU work."""
    assert D.case_names("64x512, tp2:1x32K+31x2K,tp8:2x64K+30x1K") == ["64x512", "tp2:1x32K+31x2K",
                                                                        "tp8:2x64K+30x1K"]
    c = D.parse_case("tp2:1x32K+31x2K")
    assert (c.num_q_heads, c.num_kv_heads, c.lengths) == (32, 4, (32768,) + (2048,) * 31)
    for bad, why in (("64x512,tp3:8x32K", "tp3:8x32K"), ("8x32K+", "8x32K+"), (" , ", "empty list")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            D.case_names(bad)


# ----------------------------------------------------------------------------- floor arithmetic

def test_floor_bytes_by_hand():
    # 8x32K, bf16 KV: K and V of 262144 tokens x 8 heads x 128 x 2 bytes = 1 GiB; q + o: 8 x 64 x 128 x (2 + 2).
    c = D.parse_case("8x32K")
    assert D.floor_bytes(c, torch.bfloat16) == (1 << 30) + 262144
    # fp8 KV halves the KV bytes only (q and o stay bf16).
    assert D.floor_bytes(c, torch.float8_e4m3fn) == (1 << 29) + 262144
    # TP8 slice: 258048 tokens x 1 kv head x 128 x 2 (K, V) x 2 bytes + 32 x 8 x 128 x 4.
    t = D.parse_case("tp8:1x128K+31x4K")
    assert D.floor_bytes(t, torch.bfloat16) == 258048 * 128 * 4 + 32 * 8 * 128 * 4
    # Live tokens, not pages: 100 tokens are charged as 100, not as 2 pages of 64.
    odd = D.parse_case("1x100")
    assert D.floor_bytes(odd, torch.bfloat16) == 100 * 8 * 128 * 4 + 64 * 128 * 4
    # an fp8 q: one byte a value, and its fp32 scale per token and head
    assert D.floor_bytes(odd, torch.float8_e4m3fn, q_dtype=torch.float8_e4m3fn) == \
        100 * 8 * 128 * 2 + 64 * 128 * 3 + 64 * 4


def test_floor_us_from_bytes():
    c = D.parse_case("8x32K")
    fl = floor_us(bytes_moved=D.floor_bytes(c, torch.bfloat16), ceilings={"copy_TBps": 4.0})
    assert fl == pytest.approx(((1 << 30) + 262144) / 4.0e12 * 1e6)  # ~268.5 µs at 4 TB/s
    assert 268 < fl < 269


def test_rotations_for():
    l2 = 60 << 20
    # 64x512 bf16 = 128 MiB KV + 2 MiB q/o: 3 x 60 MiB needs two copies.
    assert D.rotations_for(D.floor_bytes(D.parse_case("64x512"), torch.bfloat16), l2) == 2
    # fp8 halves it: 66 MiB -> three copies.
    assert D.rotations_for(D.floor_bytes(D.parse_case("64x512"), torch.float8_e4m3fn), l2) == 3
    assert D.rotations_for(1 << 30, l2) == 1  # far beyond L2: one copy
    assert D.rotations_for(1, l2) == D.MAX_ROTATIONS  # capped
    assert D.rotations_for(5, 0) == 1
    with pytest.raises(ValueError, match="bytes_per_copy"):
        D.rotations_for(0, l2)


# ----------------------------------------------------------------------------- page tables & inputs

@pytest.mark.parametrize("lengths,rotations", [([100, 64, 1, 700], 3), ([131072 // 16, 4096 // 16] * 4, 2),
                                               ([0, 65, 128], 4)])
def test_page_tables_are_a_permutation_without_reuse(lengths, rotations):
    g = torch.Generator().manual_seed(1)
    tables, pool = shuffled_page_tables(lengths, 64, rotations, g)
    n_pages = [math.ceil(n / 64) for n in lengths]
    assert tables.dtype == torch.int32
    assert tables.shape == (rotations, len(lengths), max(1, max(n_pages)))
    used = sum(n_pages) * rotations
    assert pool >= used * (1 + POOL_SLACK) and pool <= used * (1 + POOL_SLACK) + 1
    live = torch.cat([tables[r, b, :n] for r in range(rotations) for b, n in enumerate(n_pages)])
    assert live.numel() == used
    assert live.unique().numel() == used, "a page is used twice"
    assert int(live.min()) >= 0 and int(live.max()) < pool
    for r in range(rotations):  # padding past a request's pages is page 0, a valid id
        for b, n in enumerate(n_pages):
            assert (tables[r, b, n:] == 0).all()
    if used > 8:  # random order: not the identity layout a contiguous allocator would give
        assert not torch.equal(live, live.sort().values)


def test_page_tables_deterministic_per_seed():
    a, _ = shuffled_page_tables([300, 50], 64, 2, torch.Generator().manual_seed(7))
    b, _ = shuffled_page_tables([300, 50], 64, 2, torch.Generator().manual_seed(7))
    c, _ = shuffled_page_tables([300, 50], 64, 2, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_page_tables_reject_bad_arguments():
    with pytest.raises(ValueError):
        shuffled_page_tables([], 64, 1)
    with pytest.raises(ValueError):
        shuffled_page_tables([10, -1], 64, 1)
    with pytest.raises(ValueError):
        shuffled_page_tables([10], 0, 1)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_make_inputs_small(kv_dtype):
    case = D.Case("t", (100, 700, 64), 16, 2)
    inp = D.make_inputs(case, kv_dtype, "cpu", seed=3, l2_bytes=4 << 20)
    assert inp.rotations == D.rotations_for(D.floor_bytes(case, kv_dtype), 4 << 20) > 1
    assert inp.seq_lens.tolist() == [100, 700, 64] and inp.seq_lens.dtype == torch.int32
    assert inp.k_cache.dtype == kv_dtype and inp.k_cache.shape[1:] == (64, 2, 128)
    for q in inp.qs:
        assert q.shape == (3, 16, 128) and q.dtype == torch.bfloat16 and (q != 0).float().mean() > 0.99
    assert not torch.equal(inp.qs[0], inp.qs[1]), "rotations must carry different q"
    for cache in (inp.k_cache, inp.v_cache):
        f = cache.float()
        assert torch.isfinite(f).all() and (f != 0).float().mean() > 0.95 and f.std() > 0.5
    assert not torch.equal(inp.k_cache.float(), inp.v_cache.float())
    if kv_dtype == torch.float8_e4m3fn:
        for s in (inp.k_scale, inp.v_scale):
            assert s.dtype == torch.float32 and s.numel() == 1 and 0.25 <= float(s) <= 0.75
    else:
        assert inp.k_scale is None and inp.v_scale is None
    assert inp.sm_scale == pytest.approx(128 ** -0.5)


def test_make_inputs_fp8_q_quantises_the_same_q_per_row():
    """The fp8-kv-fp8-q variant's q: the bf16 variant's random q (same seed), each (token, head) row scaled by its
    max |q| / 448 into e4m3, so every row's largest value is 448 and q x scale is the bf16 q within e4m3's
    rounding (half an ulp: 2^-4 of the value)."""
    case = D.Case("t", (100, 700, 64), 16, 2)
    fp8 = torch.float8_e4m3fn
    a = D.make_inputs(case, fp8, "cpu", seed=3, l2_bytes=4 << 20)
    b = D.make_inputs(case, fp8, "cpu", seed=3, l2_bytes=4 << 20, q_dtype=fp8)
    assert a.q_scales is None and D.q_scale_of(a, 0) is None and b.rotations == a.rotations > 1
    assert torch.equal(a.k_cache.float(), b.k_cache.float()) and torch.equal(a.page_tables[1], b.page_tables[1])
    for r in range(b.rotations):
        q, s = b.qs[r], D.q_scale_of(b, r)
        assert q.dtype == fp8 and q.shape == (3, 16, 128) and s.dtype == torch.float32 and s.shape == (3, 16)
        assert (q.float().abs().amax(-1) == 448).all()
        deq, want = q.float() * s[..., None], a.qs[r].float()
        assert ((deq - want).abs() <= want.abs() * 2 ** -4 + want.abs().amax(-1, keepdim=True) * 2 ** -9).all()
    with pytest.raises(ValueError, match="q_dtype"):
        D.make_inputs(case, fp8, "cpu", seed=3, l2_bytes=0, q_dtype=torch.float16)


# ----------------------------------------------------------------------------- the benchmark's reference

@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_reference_decode_matches_dense_fp64_attention(kv_dtype):
    """The benchmark's paged reference equals fp64 SDPA over each request's keys laid out densely."""
    case = D.Case("t", (1, 63, 64, 65, 200), 8, 2)
    inp = D.make_inputs(case, kv_dtype, "cpu", seed=5, l2_bytes=0)
    q, pt = inp.qs[0], inp.page_tables[0]
    ks = float(inp.k_scale) if inp.k_scale is not None else 1.0
    vs = float(inp.v_scale) if inp.v_scale is not None else 1.0
    out = D.reference_decode(q, inp.k_cache, inp.v_cache, pt, inp.seq_lens, sm_scale=0.3,
                             k_scale=inp.k_scale, v_scale=inp.v_scale)
    assert out.dtype == torch.float32 and out.shape == (5, 8, 128)
    for b, n in enumerate(case.lengths):
        # token t of request b lives at page pt[b, t // 64], slot t % 64
        tok = torch.arange(n)
        pages, slots = pt[b, tok // 64].long(), tok % 64
        k = inp.k_cache.float()[pages, slots].double() * ks  # [n, Hkv, D]
        v = inp.v_cache.float()[pages, slots].double() * vs
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)  # GQA: 4 q heads per kv head
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].double()[:, None, :], k.transpose(0, 1), v.transpose(0, 1), scale=0.3)[:, 0, :]
        assert (out[b].double() - ref).abs().max() < 1e-5


# ----------------------------------------------------------------------------- FlashInfer layout

def _brute_layout(page_table, seq_lens, page_size):
    indptr, indices, last = [0], [], []
    for b, n in enumerate(seq_lens.tolist()):
        k = -(-n // page_size)
        indices += page_table[b, :k].tolist()
        indptr.append(indptr[-1] + k)
        last.append(n - (k - 1) * page_size)
    return indptr, indices, last


@pytest.mark.parametrize("lengths,page_size", [([1, 64, 65, 700], 64), ([16, 17, 5], 16), ([128], 128)])
def test_paged_kv_layout(lengths, page_size):
    tables, _ = shuffled_page_tables(lengths, page_size, 1, torch.Generator().manual_seed(2))
    pt, sl = tables[0], torch.tensor(lengths, dtype=torch.int32)
    indptr, indices, last = fi_peer.paged_kv_layout(pt, sl, page_size)
    want = _brute_layout(pt, sl, page_size)
    assert [t.dtype for t in (indptr, indices, last)] == [torch.int32] * 3
    assert indptr.tolist() == want[0] and indices.tolist() == want[1] and last.tolist() == want[2]
    assert ((last >= 1) & (last <= page_size)).all()


def test_paged_kv_layout_rejects_bad_input():
    pt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="length 0"):
        fi_peer.paged_kv_layout(pt, torch.tensor([5, 0], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="pages"):
        fi_peer.paged_kv_layout(pt, torch.tensor([5, 4 * 64], dtype=torch.int32), 64)
    with pytest.raises(TypeError, match="page_table"):
        fi_peer.paged_kv_layout(pt.long(), torch.tensor([5, 6], dtype=torch.int32), 64)
    with pytest.raises(TypeError, match="seq_lens"):
        fi_peer.paged_kv_layout(pt, torch.tensor([5, 6]), 64)
    with pytest.raises(ValueError, match="seq_lens"):
        fi_peer.paged_kv_layout(pt, torch.tensor([5], dtype=torch.int32), 64)


def test_flashinfer_missing_becomes_peer_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(PeerUnavailable, match="not importable"):
        fi_peer.import_flashinfer()
    assert fi_peer.version() is None
    pt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(PeerUnavailable):
        fi_peer.FlashInferDecode("flashinfer-tc", pt, torch.ones(1, dtype=torch.int32), num_q_heads=8,
                                 num_kv_heads=1, head_dim=128, page_size=64, q_dtype=torch.bfloat16,
                                 kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="impl"):
        fi_peer.FlashInferDecode("flashinfer-nope", pt, torch.ones(1, dtype=torch.int32), num_q_heads=8,
                                 num_kv_heads=1, head_dim=128, page_size=64, q_dtype=torch.bfloat16,
                                 kv_dtype=torch.bfloat16)


def test_flashinfer_fa3_unsupported_dtypes_are_refused_before_any_build(monkeypatch):
    """The fa3 row asks FlashInfer's own ``utils.is_fa3_backend_supported`` first: where it says no (fp8 KV with a
    bf16 q in 0.7.2), the row is unavailable at once with that reason, and no wrapper is built (no 50-80 s JIT build
    that fails); the other rows and a FlashInfer without the function go on to build."""
    import types

    asked, built = [], []

    def supported(pos, fp16_qk, custom_mask, dtype_q, dtype_kv):
        asked.append((dtype_q, dtype_kv))
        return not (dtype_kv == torch.float8_e4m3fn and dtype_q != torch.float8_e4m3fn)

    class Wrapper:
        def __init__(self, *a, **kw):
            built.append(kw["backend"])
            raise RuntimeError("no GPU kernels here")

    fake = types.SimpleNamespace(utils=types.SimpleNamespace(is_fa3_backend_supported=supported),
                                 BatchDecodeWithPagedKVCacheWrapper=Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fi_peer, "WORKSPACE_BYTES", 1024)
    pt, sl = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    kw = dict(num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=64, q_dtype=torch.bfloat16)
    with pytest.raises(PeerUnavailable, match="flashinfer-fa3: FlashInfer's is_fa3_backend_supported is False"):
        fi_peer.FlashInferDecode("flashinfer-fa3", pt, sl, kv_dtype=torch.float8_e4m3fn, **kw)
    assert asked == [(torch.bfloat16, torch.float8_e4m3fn)] and built == []
    for impl, kv in (("flashinfer-fa3", torch.bfloat16), ("flashinfer-tc", torch.float8_e4m3fn)):
        with pytest.raises(PeerUnavailable, match="build/plan failed"):  # went on to build (the fake fails)
            fi_peer.FlashInferDecode(impl, pt, sl, kv_dtype=kv, **kw)
    assert built == ["fa3", "fa2"]
    fake.utils = types.SimpleNamespace()  # no such function: built as before
    with pytest.raises(PeerUnavailable, match="build/plan failed"):
        fi_peer.FlashInferDecode("flashinfer-fa3", pt, sl, kv_dtype=torch.float8_e4m3fn, **kw)


# ----------------------------------------------------------------------------- target summary

def test_summarize_targets():
    cases = [D.parse_case("1x128K+31x4K"), D.parse_case("64x512")]
    rows = [
        {"case": "1x128K+31x4K", "variant": "bf16-kv", "impl": "evenflow", "us": 100.0, "frac_of_floor": 0.9,
         "speedup_vs_best_peer": 3.0, "speedup_vs_static": 2.5, "vs_read_once": 0.96},
        {"case": "1x128K+31x4K", "variant": "bf16-kv", "impl": "read-once", "us": 96.0},
        {"case": "1x128K+31x4K", "variant": "bf16-kv", "impl": "evenflow-static", "us": 250.0},
        {"case": "1x128K+31x4K", "variant": "bf16-kv", "impl": "flashinfer-tc", "us": 300.0},
        {"case": "1x128K+31x4K", "variant": "bf16-kv", "impl": "flashinfer-fa3", "error": "build failed"},
        {"case": "64x512", "variant": "bf16-kv", "impl": "evenflow", "us": 50.0, "frac_of_floor": 0.7,
         "speedup_vs_best_peer": 0.9},
        {"case": "64x512", "variant": "bf16-kv", "impl": "flashinfer-cuda", "us": 45.0},
    ]
    table, targets = D.summarize(rows, cases, ["bf16-kv"])
    got = {t["target"]: t["ok"] for t in targets}
    assert got == {
        "1x128K+31x4K bf16-kv: frac_of_floor >= 0.85": True,
        "1x128K+31x4K bf16-kv: not slower than flashinfer-tc": True,
        "1x128K+31x4K bf16-kv: >= 2.5x flashinfer-tc": True,
        "1x128K+31x4K bf16-kv: >= 2x evenflow-static": True,
        "64x512 bf16-kv: frac_of_floor >= 0.75": False,
        "64x512 bf16-kv: not slower than flashinfer-cuda": False,
    }
    assert "| 1x128K+31x4K | bf16-kv | 100.0 | 0.90 | 0.96 | 250.0 | flashinfer-tc | 300.0 | 3.00 | 2.50 |" in table
    assert "| 64x512 | bf16-kv | 50.0 | 0.70 | - | - | flashinfer-cuda | 45.0 | 0.90 | - |" in table


def test_ratio_target_reach_and_rescore(tmp_path, capsys):
    """A 2.5x target carries what it asks of the floor: the peer's time over 2.5, as a fraction of the floor
    (floor µs = frac x our µs), beside the read-once row's fraction (floor µs / its µs), which a frac_of_floor
    target carries too. Checked here from the rows' times, not the fields the helper reads; then ``--rescore``
    re-derives a written file's table and targets and prints each missed target with its fractions."""
    floor, ours_us, peer_us, read_us = 90.0, 100.0, 200.0, 96.0
    rows = [
        {"case": "2x32K+30x4K", "variant": "bf16-kv", "impl": "evenflow", "us": ours_us,
         "frac_of_floor": floor / ours_us, "speedup_vs_best_peer": peer_us / ours_us,
         "vs_read_once": read_us / ours_us},
        {"case": "2x32K+30x4K", "variant": "bf16-kv", "impl": "read-once", "us": read_us},
        {"case": "2x32K+30x4K", "variant": "bf16-kv", "impl": "flashinfer-tc", "us": peer_us},
    ]
    table, targets = D.summarize(rows, [D.parse_case("2x32K+30x4K")], ["bf16-kv"])
    (ratio,) = [t for t in targets if "2.5x" in t["target"]]
    assert not ratio["ok"] and ratio["value"] == pytest.approx(2.0)
    assert ratio["needs_frac_of_floor"] == pytest.approx(floor / (peer_us / 2.5), abs=1e-4)  # 1.125
    assert ratio["read_once_frac_of_floor"] == pytest.approx(floor / read_us, abs=1e-4)  # 0.9375
    assert all("needs_frac_of_floor" not in t for t in targets if t is not ratio)
    (frac,) = [t for t in targets if "frac_of_floor >=" in t["target"]]  # the read-once fraction, no need
    assert frac["read_once_frac_of_floor"] == ratio["read_once_frac_of_floor"]
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"header": {}, "meta": {}, "rows": rows}))
    assert D.rescore(str(path)) == (table, targets)
    D.main(["--rescore", str(path)])
    out = capsys.readouterr().out
    assert "## issue 3 targets: 2/3 met" in out
    assert "- MISSED 2x32K+30x4K bf16-kv: >= 2.5x flashinfer-tc: 2.000 (needs 1.125 of the floor; read-once " \
           "reads at 0.938)" in out
    slower = floor / 0.8  # ours at 0.8 of the floor: the floor target missed, printed with the read-once fraction
    rows[0].update(us=slower, frac_of_floor=0.8, speedup_vs_best_peer=peer_us / slower, vs_read_once=read_us / slower)
    path.write_text(json.dumps({"header": {}, "meta": {}, "rows": rows}))
    D.main(["--rescore", str(path)])
    out = capsys.readouterr().out
    assert "- MISSED 2x32K+30x4K bf16-kv: frac_of_floor >= 0.85: 0.800 (read-once reads at 0.938)" in out
    path.write_text("{}")
    with pytest.raises(SystemExit, match="--rescore: .*decode.json is not a results file"):
        D.rescore(str(path))


def test_read_once_reads_every_byte_of_every_rotation(monkeypatch):
    """The read-once row (round AN): measure_read_once reads ``copies`` buffers that hold the case's floor bytes, each
    whole, one read a copy, and reports the fastest of its shapes. Here the graph timer runs each call once (the
    interpreted kernel on the CPU, the compiled one on a GPU) and hands out a time by shape; the partials it wrote
    must sum to the elements read."""
    nbytes, copies = 3 * 16384 * 4 + 4 * 17 + 2, 3  # not a whole number of int32 elements or of blocks
    seen = []

    def fake_time_graph(fns):
        for fn in fns:
            fn()
        seen.append(len(fns))
        return 10.0 - len(seen)  # the later shape reads faster here

    launched = []
    real_launch = D.rb.launch_read

    def spy_launch(buf, out, shape, pdl, sms):
        real_launch(buf, out, shape, pdl, sms)
        grid = D.rb.read_grid(buf.numel(), shape[1], shape[2], sms)
        launched.append((buf.numel(), shape[0], int(out[:grid].long().sum())))

    monkeypatch.setattr(D.rb.H, "time_graph", fake_time_graph)
    monkeypatch.setattr(D.rb, "launch_read", spy_launch)
    got = D.measure_read_once(nbytes, copies, torch.device(_DEV))
    n = math.ceil(nbytes / 4)
    assert seen == [copies] * len(D.READ_SHAPES)
    assert [s[0] for s in D.READ_SHAPES] == ["block16k", "block64k"]
    assert launched == [(n, s[0], n) for s in D.READ_SHAPES for _ in range(copies)]  # buffers of ones: sum = n
    assert got["us"] == 10.0 - len(D.READ_SHAPES) and got["read"].startswith(D.READ_SHAPES[-1][0])
    assert "read-once" in D.DEFAULT_IMPLS and "read-once" not in fi_peer.DECODE_IMPLS


@pytest.mark.skipif(not torch.cuda.is_available() or _runtime.interpreting(), reason="times on a GPU")
def test_sweep_writes_read_once_rows_and_the_ratio_to_them(tmp_path):
    """On a GPU the sweep's read-once row times the case's floor bytes and every evenflow row carries its time over
    the row's (``vs_read_once``)."""
    import json

    D.main(["--cases", "64x512", "--impls", "evenflow,read-once", "--variants", "bf16-kv", "--out", str(tmp_path),
            "--no-plot"])
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    by = {r["impl"]: r for r in rows}
    ours, read = by["evenflow"], by["read-once"]
    assert read["floor_bytes"] == ours["floor_bytes"] == D.floor_bytes(D.parse_case("64x512"), torch.bfloat16)
    assert read["read"].split()[0] in {s[0] for s in D.READ_SHAPES} and read["us"] > 0
    assert ours["vs_read_once"] == pytest.approx(read["us"] / ours["us"], rel=1e-3)
    # a plain read of the bytes is not slower than a kernel that also computes on them (1.2: room for the run's noise)
    # and not absurdly faster
    assert 0.3 < ours["vs_read_once"] < 1.2


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.bfloat16, torch.bfloat16),
                                             (torch.float8_e4m3fn, torch.bfloat16),
                                             (torch.float8_e4m3fn, torch.float8_e4m3fn)])
def test_reference_decode_agrees_with_project_oracle(kv_dtype, q_dtype):
    from evenflow.reference.attention import decode_attention_ref

    case = D.Case("t", (130, 1, 64), 16, 2)
    inp = D.make_inputs(case, kv_dtype, "cpu", seed=9, l2_bytes=0, q_dtype=q_dtype)
    args = (inp.qs[0], inp.k_cache, inp.v_cache, inp.page_tables[0], inp.seq_lens)
    qs = D.q_scale_of(inp, 0)
    ours = D.reference_decode(*args, sm_scale=inp.sm_scale, k_scale=inp.k_scale, v_scale=inp.v_scale, q_scale=qs)
    oracle, _ = decode_attention_ref(*args, q_scale=qs, k_scale=inp.k_scale, v_scale=inp.v_scale,
                                     sm_scale=inp.sm_scale)
    assert (ours.double() - oracle).abs().max() < 1e-5


@pytest.mark.parametrize("impl", ["evenflow", "evenflow-grow150", "evenflow-longer150", "evenflow-static"])
def test_evenflow_calls_compute_the_benchmark_reference(impl):
    """The calls the benchmark (and decode_timeline.py) time: one per rotated copy, each writing
    the case's attention, as the benchmark's reference computes it; the plan is the row's (the
    knob row's align_growth, none for the static split)."""
    case = D.Case("t", (130, 1, 640, 0), 16, 2)
    inp = D.make_inputs(case, torch.bfloat16, _DEV, seed=4, l2_bytes=1 << 20)
    plan = D.evenflow_plan(impl, inp)
    if impl == "evenflow-static":
        assert plan is None
    else:
        assert plan.batch == 4 and plan.align_growth == (1.5 if impl == "evenflow-grow150" else 1.25)
        assert plan.align_longer_growth == (1.5 if impl == "evenflow-longer150" else 17 / 16)
    calls = D.evenflow_calls(inp, plan)
    assert len(calls) == inp.rotations > 1
    from evenflow.reference.attention import decode_attention_ref
    from evenflow.testing import assert_within_rule

    for r, call in enumerate(calls):
        got = call()
        args = (inp.qs[r], inp.k_cache, inp.v_cache, inp.page_tables[r], inp.seq_lens)
        # the rule of every decode test: within twice the error of a bf16-probability baseline of the fp64 oracle
        ref, _ = decode_attention_ref(*args, sm_scale=inp.sm_scale)
        base, _ = decode_attention_ref(*args, sm_scale=inp.sm_scale, dtype=torch.float32, p_dtype=torch.bfloat16,
                                       out_dtype=torch.bfloat16)
        assert_within_rule(got, ref, base, what=f"{impl} rotation {r}")
        # and the benchmark's own fp32 reference, which the benchmark checks every row against, agrees
        want = D.reference_decode(*args, sm_scale=inp.sm_scale)
        assert (want.double().cpu() - ref.cpu()).abs().max() < 1e-5, (impl, r)


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the Triton interpreter")
def test_module_knob_rows_switch_their_calls_and_put_the_switch_back():
    """A ``MODULE_KNOBS`` row (evenflow-twopassmerge: decode.MERGE_ONE_PASS off) runs the default plan with its module
    switches set around each call, so the attention kernel is launched with them (as it is, on a GPU, while a graph
    is captured around the call); after each call the module holds its value again; the row's output is the
    default's, bit for bit, on a case whose long item is merged across bins."""
    from evenflow._compile_check import record_launches
    from evenflow.attention import decode

    assert set(D.MODULE_KNOBS) <= set(D.EVENFLOW_IMPLS) and not set(D.MODULE_KNOBS) & set(D.PLAN_KNOBS)
    case = D.Case("t", (64 * 20 + 5, 1, 130, 0), 8, 1)
    inp = D.make_inputs(case, torch.bfloat16, _DEV, seed=5, l2_bytes=1 << 20)
    for impl, switches in D.MODULE_KNOBS.items():
        plan = D.evenflow_plan(impl, inp)
        default = D.evenflow_plan("evenflow", inp)
        assert repr(plan) == repr(default)
        assert int(plan.meta[1]) < 21  # the budget cuts the 21-tile item: its chunks are merged
        before = {name: getattr(decode, name) for name in switches}
        assert all(before[name] != value for name, value in switches.items()), impl  # else the row measures nothing
        with record_launches(execute=True) as rec:
            got = D.evenflow_calls(inp, plan, switches)[0]().clone()
        assert {name: getattr(decode, name) for name in switches} == before, impl
        seen = [dict(la.constexprs) for la in rec if la.name == "decode_kernel"]
        assert seen and all(c[name] == value for c in seen for name, value in switches.items()), (impl, seen)
        want = D.evenflow_calls(inp, default)[0]()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), impl


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_every_knob_row_builds_the_plan_it_names(kv_dtype):
    """Every knob row (``PLAN_KNOBS``) builds a plan for both cache dtypes (a row the plan refuses would only fail
    on the GPU, mid-run), the plan holds each of the row's keywords as given (``deep_ring_tiles``, ``merge_chunks`` and
    ``warpgroup_mma``, the Gluon fp8 kernel's, are dropped for a bf16 cache) and a ``typed`` row's plan the cache's
    dtype."""
    from evenflow._runtime import num_sms
    from evenflow.attention.plan import DEFAULT_ITEM_COST

    case = D.Case("t", (130, 1, 640, 0), 16, 2)
    inp = D.make_inputs(case, kv_dtype, _DEV, seed=4, l2_bytes=1 << 20)
    for impl, knobs in D.PLAN_KNOBS.items():
        kw = knobs(num_sms(inp.seq_lens.device))
        plan = D.evenflow_plan(impl, inp)
        assert plan.batch == case.batch, impl
        assert plan.kv_dtype == (kv_dtype if kw.pop("typed", False) else None), impl
        if kv_dtype != torch.float8_e4m3fn:
            assert {"deep_ring_tiles", "merge_chunks"} <= set(D.GLUON_ONLY_KNOBS)
            for name in D.GLUON_ONLY_KNOBS:
                kw.pop(name, None)
        assert {k: getattr(plan, k) for k in kw} == kw, impl
        assert plan.item_cost == kw.get("item_cost", DEFAULT_ITEM_COST), impl


def test_ab_table_gives_each_passs_speed_ups_within_that_pass(tmp_path, capsys):
    """benchmarks/ab_table.py over the files of an A/B run's passes: per point of the first, each impl's µs and
    frac_of_floor there, then its speed-up over the first impl within each pass; a point a pass holds as an error
    shows "—"; an impl the first file does not have is refused by name."""
    from evenflow.bench.harness import Results

    ab = _load("ab_table")
    paths = []
    for i, (base_us, knob_us) in enumerate(((20.0, 16.0), (25.0, 50.0))):
        res = Results("decode", ceilings={}, out=tmp_path / f"p{i + 1}")
        for variant in ("bf16-kv", "fp8-kv"):
            res.add(case="64x512", variant=variant, impl="evenflow", us=base_us, floor_us=10.0)
            if variant == "bf16-kv" or i == 0:
                res.add(case="64x512", variant=variant, impl="evenflow-g-wg", us=knob_us, floor_us=10.0)
            else:
                res.add_error(case="64x512", variant=variant, impl="evenflow-g-wg", error="boom")
        paths.append(str(res.finish(plot=False)))
    capsys.readouterr()
    ab.main(paths)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| speed-up of evenflow-g-wg over evenflow (p1) | speed-up of evenflow-g-wg over "
                             "evenflow (p2) |")
    bf16 = next(ln for ln in lines if "bf16-kv" in ln).strip("| ").split(" | ")
    assert bf16[3:] == ["20.0 (0.50)", "16.0 (0.62)", "1.250", "0.500"]
    fp8 = next(ln for ln in lines if "fp8-kv" in ln).strip("| ").split(" | ")
    assert fp8[5:] == ["1.250", "—"]  # pass 2's knob row is an error
    ab.main(paths[:1])  # one file: one speed-up column, no pass tags
    assert capsys.readouterr().out.splitlines()[0].endswith("| speed-up of evenflow-g-wg over evenflow |")
    with pytest.raises(SystemExit):
        ab.main(paths + ["--impls", "evenflow,evenflow-x"])
    assert "impls: evenflow-x not in" in capsys.readouterr().err


def test_replot_draws_a_result_file_again_on_its_benchmarks_axes(tmp_path, capsys):
    """benchmarks/replot.py: a decode result file plotted again beside it, and a file of no known benchmark refused
    by name."""
    from evenflow.bench.harness import Results

    rp = _load("replot")
    res = Results("decode", ceilings={}, out=tmp_path)
    for variant in ("bf16-kv", "fp8-kv"):
        res.add(case="64x512", variant=variant, impl="evenflow", us=20.0, floor_us=17.0)
    path = res.finish(plot=False)
    assert not (tmp_path / "decode.png").exists()
    assert rp.main([str(path)]) == 0
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "sweep.json"
    other.write_text(path.read_text())
    (tmp_path / "decode.png").unlink()
    with pytest.raises(SystemExit):
        rp.main([str(path), str(other)])  # every name is checked before anything is drawn
    assert "no plot axes known for 'sweep'" in capsys.readouterr().err
    assert not (tmp_path / "decode.png").exists()
    (tmp_path / "moe.json").write_text('{"header": {}, "rows": [{"case": "a"}]}')
    with pytest.raises(SystemExit):
        rp.main([str(tmp_path / "moe.json")])
    assert "row 0 has no 'impl'" in capsys.readouterr().err


def test_replot_axes_are_the_scripts_own():
    """replot.AXES against each benchmark script's ``Results("<name>", ...)`` and the ``.finish(x=, group=)`` call after
    it (``Results.finish``'s defaults where a keyword is left out); scripts that write no plot (``plot=False``) need
    no entry."""
    import ast
    import inspect

    from evenflow.bench.harness import Results

    rp = _load("replot")
    sig = inspect.signature(Results.finish).parameters
    found = {}
    for script in sorted(_SCRIPT.parent.glob("*.py")):
        names, finishes = [], []
        for node in ast.walk(ast.parse(script.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname == "Results" and node.args and isinstance(node.args[0], ast.Constant):
                names.append((node.lineno, node.args[0].value))
            elif fname == "finish":
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("plot"), ast.Constant) and kw["plot"].value is False:
                    continue
                axes = tuple(kw[a].value if a in kw else sig[a].default for a in ("x", "group"))
                finishes.append((node.lineno, axes))
        for line, axes in finishes:
            name = max((n for n in names if n[0] < line), default=(0, None))[1]
            if name is not None:
                found[name] = axes
    assert found and set(found) <= set(rp.AXES), (found, rp.AXES)
    assert all(rp.AXES[n] == axes for n, axes in found.items()), (found, rp.AXES)


def test_plan_model_reads_every_tile_once_under_every_option():
    """The plan cost model (benchmarks/plan_model.py) prices the tiles the kernel reads: over all
    bins they are each item's ceil(len / 64) tiles, whatever item_cost or align_longer shifts
    between bins; the modelled time is at least the longest bin and at least the roof; its
    fit recovers parameters that generated the times."""
    plan_model = _load("plan_model")
    lens, hkv = [128] * 5 + [4096] * 3 + [0, 700], 2
    want = hkv * sum(-(-n // 64) for n in lens)
    shapes = {}
    for name, (kw, *_) in plan_model.OPTIONS.items():
        budget, shape, _ = plan_model.plan_bins(lens, hkv, 12, min_tiles=1, **kw)
        assert sum(r for r, _ in shape) == want, name
        t, _ = plan_model.price(shape, tile_us=1.0, chunk_us=0.0, base_us=0.0)
        assert t == max(r for r, _ in shape) >= want / 12
        assert plan_model.price(shape, 1.0, 0.0, 0.0, roof_us=1.0)[0] == want
        shapes[("c", name)] = (budget, shape, [])
    truth = dict(tile_us=1.5, chunk_us=2.0, base_us=5.0, roof_us=0.008)
    measured = {k: plan_model.price(v[1], **truth)[0] for k, v in shapes.items()}
    err, *_ = plan_model.fit(shapes, measured)
    assert err < 0.02


# ----------------------------------------------------------------------------- fixed-cost diagnosis

def test_fixed_cost_fit_and_cases():
    """The diagnosis' least-squares fit recovers a line exactly and ranks a noisy one's intercept
    right; its sweep cases all parse (TP8 slices have 8 q / 1 kv heads); bad input is refused."""
    F = _load("decode_fixed_cost")
    a, s = F.fit([(x, 12.5 + 0.9 * x) for x in (16.0, 33.0, 65.0, 130.0)])
    assert a == pytest.approx(12.5) and s == pytest.approx(0.9)
    a2, _ = F.fit([(16.0, 27.0), (33.0, 43.0), (65.0, 75.5), (130.0, 134.0)])
    assert 10.0 < a2 < 13.0
    for cases in F.SWEEPS.values():
        for name in cases:
            c = D.parse_case(name)
            assert (c.num_q_heads, c.num_kv_heads) == ((8, 1) if name.startswith("tp8:") else (64, 8))
    with pytest.raises(SystemExit, match="--variants"):
        F.main(["--out", "unused", "--variants", "bf16,int4"])


def test_timeline_summary_reads_a_known_timeline():
    """benchmarks/decode_timeline.py's summary of one call, on a hand-made three-program timeline
    (ns): two busy programs on SM 0 (one ran a merge), one program with no work on SM 1."""
    T = _load("decode_timeline")
    from evenflow.attention.kernels import STAMP_FIELDS

    st = {name: [0, 0, 0] for name in STAMP_FIELDS}
    st.update(entry=[1000, 1500, 2000], after_wait=[1100, 1500, 2000], meta=[1600, 2000, 2600],
              first_end=[5600, 6000, 0], last_end=[9600, 10000, 0], program_end=[10600, 10000, 2800],
              sm=[0, 0, 1], chunks=[2, 1, 0], merges=[1, 0, 0], merge_ns=[1000, 0, 0], tiles=[8, 8, 0])
    s = T.summarize(st)
    assert s["busy_programs"] == 2 and s["span"] == 9.6 and s["entry_spread"] == 1.0
    assert s["wait"] == 0.0 and s["chain"] == 0.5 and s["first_chunk"] == 4.0 and s["us_per_tile"] == 1.0
    assert s["attn_end_max"] == 9.0 and s["end_max"] == 9.6 and s["tail"] == 0.6
    assert s["merges"] == 1 and s["merge_us_med"] == 1.0
    # idle slot time: 0 + (9.6 - 8.5) + (9.6 - 0.8) of 3 x 9.6
    assert s["idle_frac"] == pytest.approx((1.1 + 8.8) / 28.8, abs=1e-4)
    assert s["programs_per_sm"] == [(1, 1), (2, 1)]
    assert T._median_summary([s, dict(s, span=10.0), dict(s, span=11.0)])["span"] == 10.0


def _synthetic_raw(sm_rate, tiles_per_program=10, programs_per_sm=2):
    """Timeline stamps of a kernel whose programs all start at t=0.5 us and whose time per tile
    is their SM's (ns stamps, as decode_timeline.py stores them)."""
    sm = [s for s in range(len(sm_rate)) for _ in range(programs_per_sm)]
    meta = [500] * len(sm)
    end = [500 + round(1e3 * tiles_per_program * sm_rate[s]) for s in sm]
    return {"sm": sm, "tiles": [tiles_per_program] * len(sm), "entry": [0] * len(sm), "meta": meta,
            "last_end": end}


def test_sm_speed_what_if_on_known_rates():
    """With per-SM rates that are the same in two cases, a plan calibrated on one balances the other
    (its calibrated end equals the in-sample ideal, below the measured one); with unrelated rates it
    is no better than the ideal and is checked against the hand-computed end."""
    S = _load("decode_sm_speed")
    fast_slow = [1.0, 1.0, 2.0, 2.0]  # us per tile; SMs 2, 3 take twice as long
    rows = [{"case": "a", "variant": "bf16", "raw_last_replay": _synthetic_raw(fast_slow)},
            {"case": "b", "variant": "bf16", "raw_last_replay": _synthetic_raw(fast_slow, 20)},
            {"case": "c", "variant": "bf16", "raw_last_replay": _synthetic_raw([2.0, 2.0, 1.0, 1.0])}]
    res = S.analyse(rows)
    a = res["what_if"][("a", "bf16")]
    # now: 10 tiles at 2 us on the slow SMs -> 0.5 + 20 us. Balanced: 80 tiles over rates 1,1,1,1,2,2,2,2
    # in proportion to 1/rate: each fast program 80 * 1 / 6 tiles at 1 us -> 0.5 + 13.33 us.
    assert a["now"] == pytest.approx(20.5)
    assert a["ideal"] == pytest.approx(0.5 + 80 / 6)
    assert a["cal:b"] == pytest.approx(a["ideal"])
    # calibrated on the opposite speeds: the slow SMs get the most tiles: 80 * 1/6 at 2 us
    assert a["cal:c"] == pytest.approx(0.5 + 2 * 80 / 6)
    assert res["corr"][(("a", "bf16"), ("b", "bf16"))] == pytest.approx(1.0)
    assert res["corr"][(("a", "bf16"), ("c", "bf16"))] == pytest.approx(-1.0)
    # shrink 0: every SM at the mean rate, i.e. the even split the kernel has now
    assert S.analyse(rows, shrink=0.0)["what_if"][("a", "bf16")]["cal:c"] == pytest.approx(a["now"])


def test_hnd_knob_row_reads_the_same_values_with_each_heads_page_contiguous():
    """``evenflow-g-hnd`` (round AC): the cache as an engine with an HND layout passes it, the same
    [pages, page, Hkv, D] values, each head's page one contiguous block; and a decode call on it
    gives what the NHD cache gives (the interpreter's Triton kernel, a plan without its KV dtype)."""
    import evenflow

    assert "evenflow-g-hnd" in D.HND_IMPLS and "evenflow-g-hnd" in D.PLAN_KNOBS
    inp = D.Inputs(None, torch.bfloat16, [], [], torch.zeros(1), torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64),
                   None, None, 1.0)
    assert D.knob_inputs("evenflow", inp) is inp  # the timeline script and the benchmark take the same inputs
    assert D.knob_inputs("evenflow-g-hnd", inp).k_cache.stride(2) == 16 * 64
    x = torch.randn(5, 16, 4, 32)
    h = D.as_hnd(x)
    assert torch.equal(h, x) and h.shape == x.shape and h.data_ptr() != x.data_ptr()
    assert h.stride() == (16 * 4 * 32, 32, 16 * 32, 1)  # [pages, Hkv, page, D] in memory
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(6, 16, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    k, v, q = k.to(_DEV), v.to(_DEV), q.to(_DEV)
    pt = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=_DEV)
    sl = torch.tensor([40, 33], dtype=torch.int32, device=_DEV)
    plan = evenflow.DecodePlan(2, 48, 2, page_size=16, device=_DEV, num_programs=3, min_tiles=1).update(sl)
    a = evenflow.decode_attention(q, k, v, pt, sl, plan=plan)
    b = evenflow.decode_attention(q, D.as_hnd(k), D.as_hnd(v), pt, sl, plan=plan)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_multigpu_attention_runs_the_plan_a_user_builds(kv, monkeypatch):
    """benchmarks/multigpu.py's evenflow attention rows (round AP): the plan is told the cache's dtype and the calls'
    shape, as README's API shows, and the output is within the tolerance rule of the fp64 oracle."""
    import evenflow
    from evenflow.testing import assert_within_rule

    M = _load("multigpu")
    built = []

    class Recorded(evenflow.DecodePlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(evenflow, "DecodePlan", Recorded)
    q, k, v, table, lens, scales = M.attention_inputs([300, 5, 0, 130], M.TINY, _DEV, seed=1, kv=kv)
    got = M.attention_bind("evenflow", q, k, v, table, lens, M.TINY, scales)()
    (plan,) = built
    assert (plan.kv_dtype, plan.num_q_heads, plan.head_dim) == (k.dtype, q.shape[1], q.shape[2])
    ref, base = M.attention_ref(q, k, v, table, lens, scales)
    assert_within_rule(got, ref, base, what=f"multigpu attention {kv}")


@pytest.mark.parametrize("gluon_fp8_q", [True, False])
def test_fp8_q_variant_calls_compute_the_reference_and_skip_flashinfer(gluon_fp8_q, monkeypatch):
    """The fp8-kv-fp8-q variant (round AO): evenflow's calls pass each rotation's q scales and match the fp64
    oracle under the decode tests' rule, on the Gluon kernel (``decode.GLUON_FP8_Q``, the default since round AP)
    where it can run and on the Triton kernel with the switch off (in the interpreter both cases run the Triton
    kernel: the switch's effect is checked on a GPU); FlashInfer's rows are refused as not run (it is driven with a
    bf16 q only); the summary lists the variant's rows without counting them in issue 3's targets.
    The benchmark's plan is told the fp8 q (round AX): at 2 KV heads and 8 q rows a KV head that makes it the
    warpgroup form's (four warps, 2 programs an SM), whose calls run ``wgmma`` scores on sm_90. Such a plan is sized
    for 2 programs an SM, as the Triton kernel is, so with the switch off its calls run the Triton kernel and say
    nothing; a plan not told the q dtype is sized for the two-warp form (4 an SM), and there the first such call
    warns. (Round BC4 found this test's GPU branch still expecting the two-warp form's kernel and warning on the
    told plan, as before round AX.)"""
    import warnings

    import evenflow
    from evenflow.attention import decode
    from evenflow.reference.attention import decode_attention_ref
    from evenflow.testing import assert_within_rule

    monkeypatch.setattr(decode, "GLUON_FP8_Q", gluon_fp8_q)
    fp8 = torch.float8_e4m3fn
    case = D.Case("t", (130, 1, 640, 0), 16, 2)
    inp = D.make_inputs(case, fp8, _DEV, seed=4, l2_bytes=1 << 20, q_dtype=fp8)
    plan = D.evenflow_plan("evenflow", inp)
    gluon_here = decode.gluon_fp8_machine_refusal(inp.k_cache.device) is None  # (the interpreter runs no Gluon)
    cap = _runtime.compiled_capability(inp.k_cache.device)
    if gluon_here:
        assert (plan.gluon_warps, plan.per_sm) == (4, 2)
    # the row says which kernel ran: wgmma scores need sm_90 (on sm_89 the plan's calls run two warps on its bins)
    want = "triton" if not (gluon_here and gluon_fp8_q) else ("gluon-wg" if cap[0] == 9 else "gluon")
    assert D.kernel_of(inp, plan) == want
    assert D.kernel_of(inp, None) == "static"
    untold = evenflow.DecodePlan(case.batch, inp.page_tables[0].shape[1] * D.PAGE_SIZE, case.num_kv_heads,
                                 page_size=D.PAGE_SIZE, device=inp.seq_lens.device, kv_dtype=fp8).update(inp.seq_lens)
    if gluon_here:
        assert (untold.gluon_warps, untold.per_sm) == (2, 4)
    calls = D.evenflow_calls(inp, plan)
    untold_calls = D.evenflow_calls(inp, untold)
    assert len(calls) == inp.rotations > 1
    for r, call in enumerate(calls):
        args = (inp.qs[r], inp.k_cache, inp.v_cache, inp.page_tables[r], inp.seq_lens)
        kw = dict(q_scale=D.q_scale_of(inp, r), k_scale=inp.k_scale, v_scale=inp.v_scale, sm_scale=inp.sm_scale)
        ref, _ = decode_attention_ref(*args, **kw)
        base, _ = decode_attention_ref(*args, **kw, dtype=torch.float32, p_dtype=torch.bfloat16,
                                       out_dtype=torch.bfloat16)
        for p, got_fn in ((plan, call), (untold, untold_calls[r])):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                got = got_fn()
            # the switch off on a GPU: the plan sized for the two-warp Gluon form runs the Triton kernel and says so,
            # once a plan; the told plan, sized for 2 an SM, says nothing
            said = [w for w in said if "built for the Gluon fp8 kernel" in str(w.message)]
            warns = p is untold and gluon_here and not gluon_fp8_q and r == 0
            assert len(said) == warns, [str(w.message) for w in said]
            assert_within_rule(got, ref, base, what=f"fp8 q rotation {r}, {'told' if p is plan else 'untold'} plan")
    with pytest.raises(D.H.PeerUnavailable, match="bf16 q only"):
        D.build_fns("flashinfer-tc", inp)
    # the warm-up builds nothing for the variant and hands the reason on (rows: "not run: ...", not "build failed")
    assert D.warm_up(["flashinfer-tc", "evenflow"], ["fp8-kv-fp8-q"], _DEV, 0) == {
        ("flashinfer-tc", "fp8-kv-fp8-q"): D.FI_FP8_Q}
    assert D.FI_FP8_Q.startswith("not run")
    cases = [D.parse_case("64x512")]
    rows = [{"case": "64x512", "variant": "fp8-kv-fp8-q", "impl": "evenflow", "us": 20.0, "frac_of_floor": 0.5},
            {"case": "64x512", "variant": "fp8-kv-fp8-q", "impl": "flashinfer-tc", "error": "not run"}]
    table, targets = D.summarize(rows, cases, ["fp8-kv-fp8-q"])
    assert targets == [] and "| 64x512 | fp8-kv-fp8-q | 20.0 | 0.50 |" in table
