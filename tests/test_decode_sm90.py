"""Every decode-attention kernel configuration the launchers pick compiles for sm_90.

The launches are recorded at real shapes with CPU tensors (nothing executes) and each
distinct one is compiled with Triton's GPU compiler (PTX + ptxas cubin), no GPU needed.
The interpreter cannot catch GPU compile errors (round 1: a non-constexpr global broke
every kernel), so this runs in CI. A representative set; the exhaustive product of
dtypes x head dims x pages x q_len x groups was compiled once by hand (perf notes).
"""
import pytest
import torch

import evenflow
from evenflow import _runtime

CC = pytest.importorskip("evenflow._compile_check")
FP8 = torch.float8_e4m3fn
K = 1024

pytestmark = pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")


def _new_plan(lens, hkv, page, q_len, plan_kw):
    """The plan ``_call`` runs on: ``lens``' batch, pages of ``page`` tokens up to its longest request."""
    mp = max(1, max(-(-n // page) for n in lens))
    return evenflow.DecodePlan(len(lens), mp * page, hkv, page_size=page, q_len=q_len, device="cpu", **plan_kw)


def _call(lens, hq=64, hkv=8, d=128, page=64, q_len=1, kv=torch.bfloat16, qdt=torch.bfloat16, hnd=False,
          static=False, timeline=False, calls=1, **plan_kw):
    B = len(lens)
    mp = max(1, max(-(-n // page) for n in lens))
    shape = (B * mp, hkv, page, d) if hnd else (B * mp, page, hkv, d)
    k, v = torch.empty(shape, dtype=kv), torch.empty(shape, dtype=kv)
    if hnd:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    pt = torch.zeros(B, mp, dtype=torch.int32)
    q = torch.empty(B * q_len, hq, d, dtype=qdt)
    qs = torch.empty(B * q_len, hq) if qdt == FP8 else None
    sl = torch.tensor(lens, dtype=torch.int32)
    sc = dict(k_scale=torch.ones(1), v_scale=0.5) if kv == FP8 else {}
    plan = None
    if not static:
        plan = _new_plan(lens, hkv, page, q_len, plan_kw)
        plan.update(sl)
        plan.record_timeline(timeline)
    for _ in range(calls):
        evenflow.decode_attention(q, k, v, pt, sl, plan=plan, q_scale=qs, return_lse=True, **sc)


BIG = [128 * K] + [4 * K] * 31
SCENARIOS = {
    "bf16": dict(lens=BIG),
    "fp8-kv": dict(lens=BIG, kv=FP8),
    "fp8-kv-fp8-q": dict(lens=BIG, kv=FP8, qdt=FP8),
    "tp8-slice": dict(lens=BIG, hq=8, hkv=1),
    "static-bf16": dict(lens=BIG, static=True),
    "static-fp8-q_len2": dict(lens=[300, 5000], kv=FP8, qdt=FP8, q_len=2, static=True),
    "d64-p16-g1": dict(lens=[300, 5000], hq=2, hkv=2, d=64, page=16),
    "d256-p128-g16-q4": dict(lens=[300, 5000], hq=32, hkv=2, d=256, page=128, q_len=4),
    "d256-fp8": dict(lens=[300, 5000], hq=8, hkv=2, d=256, page=32, kv=FP8),
    "hnd-q3": dict(lens=[300, 5000], hq=16, hkv=2, page=64, q_len=3, hnd=True),
    "sweep-w8-s1": dict(lens=BIG, num_warps=8, num_stages=1),
    "sweep-fp8-w8-s3": dict(lens=BIG, kv=FP8, num_warps=8, num_stages=3),
    "fp8-block_n128": dict(lens=BIG, kv=FP8, block_n=128),
    "fp8-q-block_n128-tiny": dict(lens=[300, 64, 0, 77], hq=16, hkv=2, d=128, kv=FP8, qdt=FP8, block_n=128),
    "fp8-block_n128-d64-tiny": dict(lens=[300, 64, 0, 77, 129], hq=8, hkv=2, d=64, kv=FP8, block_n=128),
    "bf16-block_n128-p16-q2": dict(lens=[300, 5000], hq=8, hkv=2, d=64, page=16, q_len=2, block_n=128),
    "bf16-warp_split-align_longer": dict(lens=BIG, warp_split=True, align_longer=True),
    "fp8-no-warp_split": dict(lens=BIG, kv=FP8, warp_split=False),
    "bf16-no-prefetch": dict(lens=BIG, prefetch=False),
    "fp8-d256-p128-g16-q4": dict(lens=[300, 5000], hq=32, hkv=2, d=256, page=128, q_len=4, kv=FP8),
    "fp8-d128-g16-q4-static": dict(lens=[300, 5000], hq=32, hkv=2, q_len=4, kv=FP8, static=True),
    # the two-kernel combine (the default merges inside the attention kernel)
    "bf16-ckernel": dict(lens=BIG, combine="kernel"),
    "tp8-slice-ckernel": dict(lens=BIG, hq=8, hkv=1, combine="kernel"),
    "d256-p128-g16-q4-ckernel": dict(lens=[300, 5000], hq=32, hkv=2, d=256, page=128, q_len=4, combine="kernel"),
    "fp8-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8),
    # an fp8 plan at one KV head with one warp a Gluon program: the Triton kernel (round AF5; DecodePlan.takes_gluon;
    # at the default two warps the Gluon kernel runs there, round AL2)
    "fp8-tp8-slice-typed-w1": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, gluon_warps=1),
    # the diagnostic timeline build (DecodePlan.record_timeline)
    "bf16-timeline": dict(lens=BIG, timeline=True),
    "fp8-timeline": dict(lens=BIG, kv=FP8, timeline=True),
    "tp8-slice-timeline": dict(lens=BIG, hq=8, hkv=1, timeline=True),
}
# plans built for an fp8 cache: the Gluon kernel (attention/gluon_kernels.py) + the combine kernel
GLUON = {
    "gluon-fp8": dict(lens=BIG, kv=FP8, kv_dtype=FP8),
    "gluon-fp8-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8),  # any KV-head count at 2 warps
    "gluon-fp8-p128-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, page=128, q_len=4, kv=FP8, kv_dtype=FP8),
    "gluon-fp8-g1-s3": dict(lens=[300, 5000], hq=2, hkv=2, kv=FP8, kv_dtype=FP8, num_stages=3),
    "gluon-fp8-ckernel": dict(lens=BIG, kv=FP8, kv_dtype=FP8, combine="kernel"),
    "gluon-fp8-noprefetch": dict(lens=[300, 5000, 0, 65], hq=16, hkv=2, kv=FP8, kv_dtype=FP8, prefetch=False),
    # its timeline build (DecodePlan.record_timeline): the same tile loop, still resident at 4 an SM
    "gluon-fp8-timeline": dict(lens=BIG, kv=FP8, kv_dtype=FP8, timeline=True),
    "gluon-fp8-tp8-slice-timeline": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, gluon=True,
                                         timeline=True),
    # the default's two warps a program without PDL (no resident pad), and the one-warp kernel (round AL)
    "gluon-fp8-nopdl": dict(lens=BIG, kv=FP8, kv_dtype=FP8, pdl=False),
    "gluon-fp8-w1": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=1),
    "gluon-fp8-w1-s3": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=1, num_stages=3),
    "gluon-fp8-w1-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, gluon=True, gluon_warps=1),
    "gluon-fp8-w1-p128-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, page=128, q_len=4, kv=FP8, kv_dtype=FP8,
                                    gluon_warps=1),
    # two warps beside 3 ring slots, their outputs meeting in the idle ring, every chunk 2 tiles ahead (one tile
    # loop; the default since round AM has two, for short and long chunks); two warps beside 2 slots and a 16 KB
    # output buffer (the default of round AL): still 4 an SM
    "gluon-fp8-w2-s3-deep": dict(lens=BIG, kv=FP8, kv_dtype=FP8, deep_ring_tiles=0),
    "gluon-fp8-w2-s2": dict(lens=BIG, kv=FP8, kv_dtype=FP8, num_stages=2),
    "gluon-fp8-w2-s2-p128-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, page=128, q_len=4, kv=FP8,
                                       kv_dtype=FP8, num_stages=2),
    # fp8 q with its per-token-per-head scale (decode.GLUON_FP8_Q, round AO: the scale folded into the row's score
    # scale before the tile loop, which stays as it is)
    "gluon-fp8-fp8-q": dict(lens=BIG, kv=FP8, kv_dtype=FP8, qdt=FP8),
    # the default at one KV head since round AW: four warps, so an fp8 q of 8 rows runs the warpgroup form
    "gluon-fp8-fp8-q-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, qdt=FP8),
    # a plan told an fp8 q at 2 and 4 KV heads since round AX: four warps at 2 an SM, the form uncapped
    "gluon-fp8-fp8-q-tp4-slice-told": dict(lens=BIG, hq=16, hkv=2, kv=FP8, kv_dtype=FP8, qdt=FP8, q_dtype=FP8),
    "gluon-fp8-fp8-q-tp2-slice-told": dict(lens=BIG, hq=32, hkv=4, kv=FP8, kv_dtype=FP8, qdt=FP8, q_dtype=FP8),
    "gluon-fp8-fp8-q-p128-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, page=128, q_len=4, kv=FP8,
                                       kv_dtype=FP8, qdt=FP8),
    # the warpgroup form (gluon_warps=4, round AR): an fp8 q of at most 8 rows a KV head on wgmma scores; the plan's
    # other calls (a bf16 q, 16 rows) run two warps a program on its bins
    "gluon-fp8-wg-fp8-q": dict(lens=BIG, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4),
    "gluon-fp8-wg-fp8-q-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4),
    "gluon-fp8-wg-fp8-q-p128-g2-q2": dict(lens=[300, 5000, 0, 65], hq=8, hkv=4, page=128, q_len=2, kv=FP8,
                                          kv_dtype=FP8, qdt=FP8, gluon_warps=4),
    # the form capped at 128 registers (4 an SM), 128-token pages, q_len 2: 2 an SM at 4 KV heads since round AX
    "gluon-fp8-wg-fp8-q-p128-g2-q2-pps4": dict(lens=[300, 5000, 0, 65], hq=8, hkv=4, page=128, q_len=2, kv=FP8,
                                               kv_dtype=FP8, qdt=FP8, gluon_warps=4, num_programs=4 * 132),
    "gluon-fp8-wg-fp8-q-ckernel": dict(lens=BIG, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4, combine="kernel"),
    "gluon-fp8-wg-fp8-q-timeline": dict(lens=BIG, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4, timeline=True),
    "gluon-fp8-wg-bf16-q": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=4),
    "gluon-fp8-wg-fp8-q-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, q_len=4, kv=FP8, kv_dtype=FP8, qdt=FP8,
                                     gluon_warps=4),
    # the fused merge reading 12 chunks a round trip (DecodePlan(merge_chunks=12), round AR; the two-warp default
    # since round AS, so the scenarios above build it) and 8 (the default of rounds AB-AR, kept for the other forms)
    "gluon-fp8-mb8": dict(lens=BIG, kv=FP8, kv_dtype=FP8, merge_chunks=8),
    "gluon-fp8-mb8-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, merge_chunks=8),
    "gluon-fp8-mb8-p128-g4-q4": dict(lens=[300, 5000, 0, 65], hq=16, hkv=4, page=128, q_len=4, kv=FP8,
                                     kv_dtype=FP8, merge_chunks=8),
    "gluon-fp8-wg-fp8-q-mb12": dict(lens=BIG, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4, merge_chunks=12),
    "gluon-fp8-wg-fp8-q-noprefetch": dict(lens=[300, 5000, 0, 65], hq=16, hkv=2, kv=FP8, kv_dtype=FP8, qdt=FP8,
                                          gluon_warps=4, prefetch=False),
    "gluon-fp8-w1-s3-mb12": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=1, num_stages=3, merge_chunks=12),
    # deeper rings at one KV head (round AV: 2 programs an SM leave room for 4-6 slots; the knob rows
    # evenflow-g2-s4 / -s5 / -s6 of benchmarks/decode.py)
    **{f"gluon-fp8-tp8-slice-s{n}": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, num_stages=n) for n in (4, 5, 6)},
    # four warps a program on mma.sync (DecodePlan(gluon_warps=4, warpgroup_mma=False), round AV), 2 an SM at every
    # KV-head count, bf16 q and fp8 q (both take it); without PDL its 3-slot ring is padded to the 4 slots where the
    # warps' outputs meet
    "gluon-fp8-mma4-tp8-slice": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, gluon=True, gluon_warps=4,
                                     warpgroup_mma=False, merge_chunks=12),
    "gluon-fp8-mma4-tp8-slice-fp8-q": dict(lens=BIG, hq=8, hkv=1, kv=FP8, kv_dtype=FP8, qdt=FP8, gluon=True,
                                           gluon_warps=4, warpgroup_mma=False, merge_chunks=12),
    "gluon-fp8-mma4": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=4, warpgroup_mma=False),
    "gluon-fp8-mma4-nopdl": dict(lens=BIG, kv=FP8, kv_dtype=FP8, gluon_warps=4, warpgroup_mma=False, pdl=False),
}
SMS = 132  # CC.emulate_gpu's SMs


def _scenario_plan(kw):
    """The plan a GLUON scenario's call runs on, as ``_call`` builds it for an H200's SMs (its warps and programs an
    SM: the plan's rules, which tests/test_decode.py checks)."""
    call_args = ("lens", "hq", "hkv", "d", "page", "q_len", "kv", "qdt", "hnd", "static", "timeline", "calls")
    with CC.emulate_gpu():
        return _new_plan(kw["lens"], kw.get("hkv", 8), kw.get("page", 64), kw.get("q_len", 1),
                         {k: v for k, v in kw.items() if k not in call_args})


def _gluon_warps(kw):
    """Warps of the Gluon program a GLUON scenario launches: its plan's, but two where a warpgroup plan's call is not
    the form's (a bf16 q, or more than 8 q rows a KV head)."""
    from evenflow.attention.plan import GLUON_FP8_WG_ROWS

    w = _scenario_plan(kw).gluon_warps
    rows = kw.get("hq", 64) // kw.get("hkv", 8) * kw.get("q_len", 1)
    if w == 4 and kw.get("warpgroup_mma", True) and not (kw.get("qdt") == FP8 and rows <= GLUON_FP8_WG_ROWS):
        return 2
    return w


def test_decode_kernels_compile_for_sm90():
    launches = []
    with CC.emulate_gpu():
        for name, kw in SCENARIOS.items():
            with CC.record_launches() as rec:
                _call(**kw)
            assert {la.name for la in rec} >= {"decode_kernel"}, name
            launches += rec
    failures = CC.compile_launches(launches)
    assert not failures, "\n\n".join(failures)


def _gluon_stats(name):
    # an fp8 q takes the Gluon kernel by default (decode.GLUON_FP8_Q, on since round AP; the flag is not set here, so
    # the fp8-q builds below also check that default)
    with CC.emulate_gpu(), CC.record_launches() as rec:
        _call(**GLUON[name])
    assert [la.name for la in rec if la.gluon] == ["decode_fp8_kernel"], [la.describe() for la in rec]
    assert "decode_kernel" not in {la.name for la in rec}
    # split items merged inside the kernel by default, by the combine kernel when the plan says so
    assert ("combine_kernel" in {la.name for la in rec}) == (GLUON[name].get("combine") == "kernel")
    stats = CC.compile_stats([la for la in rec if la.gluon])
    assert stats and all("error" not in st for st in stats), stats
    return stats[0]


@pytest.mark.parametrize("name", list(GLUON))
def test_gluon_fp8_kernel_is_resident_and_stages_no_operand_through_shared_memory(name):
    """What round AB measured the one-warp kernel for: per 64-token tile, each thread reads K and V
    from shared memory in 16-byte loads (32 LDS.128: 8 KB each of K and V over 32 lanes), runs 128
    mma.sync (64 for S, 64 for P V) on f16 values converted in registers (256 F2FP of two e4m3 each),
    and stores nothing to shared memory (no converted operand goes back); GLUON_FP8_PROGRAMS_PER_SM
    programs fit an SM (registers, shared memory, no spill), and (under PDL, ``resident_pad``) no more.
    At W warps a program (``gluon_warps``) each warp does 1 / W of that per tile. The warpgroup form (W = 4, round
    AR) instead runs the tile's scores as 4 ``QGMMA.64`` (e4m3 K and q from shared memory, no conversion of K) and
    each warp its 16 tokens' P V as 8 ``mma.sync`` on V converted in registers (32 F2FP, 4 LDS.128): under its cap
    of 128 registers at 4 programs an SM (16 warps) ptxas spills a few bytes outside the tile loops (12-48 in round
    AR's builds, 48 the timeline build's: the bound here), none inside them; at 2 an SM (round AW: uncapped) none.
    A two-warp plan at one KV head holds GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM an SM (round AU; a four-warp one since
    round AV, and at 2-4 KV heads since round AX), and its pad keeps the SM to that many."""
    kw = GLUON[name]
    w = _gluon_warps(kw)
    wg = w == 4 and kw.get("warpgroup_mma", True)  # the warpgroup form (else mma.sync at any W)
    PPS = _scenario_plan(kw).per_sm  # the programs an SM the plan counts on
    st = _gluon_stats(name)
    assert st["num_warps"] == w and st["spill_bytes"] <= (48 if wg and PPS > 2 else 0), st
    assert st["regs"] * 32 * w * PPS <= 65536 and (st["shared"] + 1024) * PPS <= 233472, st
    if kw.get("pdl", True):
        assert (st["shared"] + 1024) * (PPS + 1) > 233472, st
    # the innermost loops with MMAs are the tile loops (since round AM the default has two: short and long chunks);
    # every other loop with MMAs (a SASS loop body holds the loops nested in it) holds all of them
    loops = sorted((lp for lp in st["loops"] if lp["ops"].get("HMMA.16816.F32")), key=lambda lp: lp["instructions"])
    deep = kw.get("deep_ring_tiles", 16 if w > 1 and kw.get("num_stages", 3) >= 3 else 0)
    n_tile = 2 if deep else 1
    tile_loops = [lp["ops"] for lp in loops[:n_tile]]
    per_tile = 8 if wg else 128 // w
    assert len(tile_loops) == n_tile and all(lp["ops"]["HMMA.16816.F32"] >= n_tile * per_tile for lp in loops[n_tile:])
    if wg:
        for tile_loop in tile_loops:
            assert tile_loop["QGMMA.64"] == 4 and tile_loop["HMMA.16816.F32"] == 8, tile_loop
            assert tile_loop["LDS.128"] == 4 and tile_loop["F2FP.F16.E4M3.UNPACK_B"] == 32, tile_loop
            assert not [op for op in tile_loop if op.startswith(("STS", "LDSM", "LDL", "STL"))], tile_loop
            assert tile_loop.get("LDGSTS.E.BYPASS.128", 0) == 8, tile_loop
        return
    for tile_loop in tile_loops:
        assert tile_loop["HMMA.16816.F32"] == 128 // w, tile_loop
        assert tile_loop["LDS.128"] == 32 // w and tile_loop["F2FP.F16.E4M3.UNPACK_B"] == 256 // w, tile_loop
        assert not [op for op in tile_loop if op.startswith(("STS", "LDSM"))], tile_loop
        assert tile_loop.get("LDGSTS.E.BYPASS.128", 0) == 32 // w, tile_loop


def test_warpgroup_form_runs_only_where_wgmma_is_compiled(monkeypatch):
    """``gluon_warps=4``'s fp8-q calls take the warpgroup form only in a build for sm_90 (``wgmma`` is Hopper's): at
    another compiled capability with e4m3 conversions (sm_89, sm_100) the plan's calls run two warps on its bins."""
    from evenflow import _runtime as R

    got = {}
    for cap in ((9, 0), (8, 9), (10, 0)):
        monkeypatch.setattr(R, "compiled_capability", lambda device=None, cap=cap: cap)
        with CC.emulate_gpu(), CC.record_launches() as rec:
            _call(lens=[300, 5000], kv=FP8, kv_dtype=FP8, qdt=FP8, gluon_warps=4)
        got[cap] = [dict(la.constexprs)["WARPS"] for la in rec if la.gluon]
    assert got == {(9, 0): [4], (8, 9): [2], (10, 0): [2]}, got


def test_one_kv_head_default_launches_the_warpgroup_form_for_fp8_q_and_the_two_warp_default_otherwise(monkeypatch):
    """Round AW: an fp8 plan at one KV head takes four warps by default. Its fp8-q calls of at most 8 q rows a KV head
    launch the warpgroup form with the 8-chunk merge (the launch of an explicit ``gluon_warps=4, merge_chunks=8``
    plan), every other call (a bf16 q; 16 rows a KV head) the two-warp default's launch (an explicit
    ``gluon_warps=2`` plan's: same ring, pad, read-ahead and 12-chunk merge); a plan told more than 8 rows, or given
    another ring than the default 3 slots, takes two warps. The form's register cap follows the programs an SM holds
    at once (none at 2; 128 at 4, also where the plan asks for 5 an SM that shared memory keeps to 4)."""
    from evenflow import _runtime as R

    monkeypatch.setattr(R, "compiled_capability", lambda device=None: (9, 0))

    def gluon_launches(**kw):
        with CC.emulate_gpu(), CC.record_launches() as rec:
            _call(lens=[300, 5000, 70000], hkv=1, kv=FP8, kv_dtype=FP8, **kw)
        launches = [(la.constexprs, la.options) for la in rec if la.gluon]
        assert len(launches) == 1, kw
        return launches[0]

    for hq, q_len, qdt in ((8, 1, FP8), (4, 2, FP8), (8, 1, torch.bfloat16), (16, 1, FP8)):
        wg = qdt == FP8 and hq * q_len <= 8
        got = gluon_launches(hq=hq, q_len=q_len, qdt=qdt)
        want = dict(gluon_warps=4, merge_chunks=8) if wg else dict(gluon_warps=2)
        assert got == gluon_launches(hq=hq, q_len=q_len, qdt=qdt, **want), (hq, q_len, qdt)
        c = dict(got[0])
        assert (c["WARPS"], c["WG"], c["FUSED_C"]) == ((4, True, 8) if wg else (2, False, 12)), c
        # the warpgroup form uncapped at 2 programs an SM (its build fits 2 an SM unspilled), capped at 4
        assert "maxnreg" not in dict(got[1]), got[1]
    for n in (4 * SMS, 4 * SMS + 16):
        capped = gluon_launches(hq=8, qdt=FP8, gluon_warps=4, num_programs=n)
        assert dict(capped[1])["maxnreg"] == 128 and dict(capped[0])["WG"], (n, capped)
    from evenflow.attention.plan import gluon_wg_max_regs
    assert [gluon_wg_max_regs(n) for n in (1, 2, 3, 4, 5)] == [0, 0, 168, 128, 96]
    for kw in (dict(num_q_heads=16), dict(num_stages=2, num_programs=2 * SMS), dict(num_stages=4)):
        plan = evenflow.DecodePlan(4, 1024, 1, device="cpu", kv_dtype=FP8, **kw)
        assert plan.gluon_warps == 2 and plan.takes_gluon, kw


def test_plan_told_an_fp8_q_at_two_to_four_kv_heads_launches_the_uncapped_warpgroup_form(monkeypatch):
    """Round AX: a plan told ``q_dtype=torch.float8_e4m3fn`` at 2 and 4 KV heads launches what an explicit
    ``gluon_warps=4, num_programs=2 * SMs, merge_chunks=8`` plan launches (the warpgroup form, no register cap); at 8
    KV heads, or told a bf16 q, or not told, the two-warp default at 4 an SM (an untold plan's launch). A call whose q
    dtype is not the told one raises, naming it."""
    from evenflow import _runtime as R

    monkeypatch.setattr(R, "compiled_capability", lambda device=None: (9, 0))

    def gluon_launch(hkv, qdt, **kw):
        with CC.emulate_gpu(), CC.record_launches() as rec:
            _call(lens=[300, 5000, 70000], hq=8 * hkv, hkv=hkv, kv=FP8, kv_dtype=FP8, qdt=qdt, **kw)
        launches = [(la.constexprs, la.options) for la in rec if la.gluon]
        assert len(launches) == 1, kw
        return launches[0]

    for hkv in (2, 4):
        with CC.emulate_gpu():
            told = evenflow.DecodePlan(4, 1024, hkv, device="cpu", kv_dtype=FP8, q_dtype=FP8)
        assert (told.gluon_warps, told.num_programs, told.wg_max_regs) == (4, 2 * SMS, 0), told
        got = gluon_launch(hkv, FP8, q_dtype=FP8)
        assert got == gluon_launch(hkv, FP8, gluon_warps=4, num_programs=2 * SMS, merge_chunks=8), hkv
        c = dict(got[0])
        assert (c["WARPS"], c["WG"], c["FUSED_C"]) == (4, True, 8) and "maxnreg" not in dict(got[1]), got
        # told a bf16 q: the two-warp default (4 an SM), as a plan not told
        assert gluon_launch(hkv, torch.bfloat16, q_dtype=torch.bfloat16) == gluon_launch(hkv, torch.bfloat16), hkv
        assert dict(gluon_launch(hkv, FP8)[0])["WARPS"] == 2, hkv
    got = gluon_launch(8, FP8, q_dtype=FP8)
    assert got == gluon_launch(8, FP8) and dict(got[0])["WARPS"] == 2, got
    with pytest.raises(ValueError, match=r"q_dtype torch.float8_e4m3fn, q is torch.bfloat16"):
        gluon_launch(2, torch.bfloat16, q_dtype=FP8)


@pytest.mark.parametrize("name", ["bf16", "fp8-kv", "fp8-kv-fp8-q", "tp8-slice", "fp8-tp8-slice",
                                  "fp8-tp8-slice-typed-w1", "bf16-ckernel", "bf16-timeline", "fp8-timeline",
                                  "tp8-slice-timeline"])
def test_default_programs_are_resident_on_sm90(name):
    """The persistent grid is sized as DEFAULT_PROGRAMS_PER_SM programs per SM, and the plan
    assumes they all run at once: registers, shared memory (plus the 1 KB the hardware
    reserves per block) and spills of the default build must allow that on an H100/H200 SM
    (64 K registers, 228 KB shared memory). Round E1 measured what breaking it costs: fp8 at
    224 registers fitted 2 programs where 3 were planned. The timeline build (diagnostics)
    must fit the same way, or its timelines would describe another schedule."""
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM as PPS

    with CC.emulate_gpu(), CC.record_launches() as rec:
        _call(**SCENARIOS[name])
    stats = CC.compile_stats([la for la in rec if la.name == "decode_kernel"])
    assert stats and all("error" not in s for s in stats), stats
    for s in stats:
        threads = 32 * s["num_warps"]
        assert s["regs"] * threads * PPS <= 65536, s
        assert (s["shared"] + 1024) * PPS <= 233472, s
        assert s["spill_bytes"] <= 32, s


@pytest.mark.parametrize("name", ["bf16-ckernel", "tp8-slice-ckernel", "d256-p128-g16-q4-ckernel", "static-bf16"])
def test_combine_is_resident_three_per_sm_without_spilling(name):
    """The combine's grid has a program per (bin, column block), most of which exit at once:
    its register cap (168) lets 3 of them share an SM. The cap must not cost more than a few
    bytes of spill (sm_90 build of round F: <= 4 bytes; 185 registers uncapped)."""
    from evenflow.attention.decode import _COMBINE_MAX_REGS

    with CC.emulate_gpu(), CC.record_launches() as rec:
        _call(**SCENARIOS[name])
    stats = CC.compile_stats([la for la in rec if la.name == "combine_kernel"])
    assert stats and all("error" not in s for s in stats), stats
    for s in stats:
        assert s["regs"] <= _COMBINE_MAX_REGS and s["regs"] * 32 * s["num_warps"] * 3 <= 65536, s
        assert s["spill_bytes"] <= 16, s


def test_resident_pad_keeps_an_sm_to_the_plans_programs():
    """Unused ring slots (16 KB each) for the Gluon kernel under PDL: the fewest that let an sm_90 SM
    (228 KB, 1 KB reserved a program) hold the plan's programs per SM and not one more; none where no
    count does both (5 an SM), where the ring alone does (6 an SM, or 3 slots at 4) or where they do not fit (7)."""
    from evenflow.attention.plan import _GLUON_RING_SLOT
    from evenflow.attention.plan import resident_pad as _resident_pad

    with CC.emulate_gpu(132):
        for per_sm, stages, want in ((4, 2, 1), (3, 2, 2), (2, 2, 3), (4, 3, 0), (5, 2, 0), (6, 2, 0), (7, 2, 0)):
            pad = _resident_pad(per_sm * 132 - 7, stages, torch.device("cpu"))
            assert pad == want, (per_sm, stages, pad)
            block = (stages + pad) * _GLUON_RING_SLOT + 1024
            if pad:
                assert per_sm * block <= 233472 < (per_sm + 1) * block, (per_sm, stages, pad)


@pytest.mark.parametrize("warps,stages", [(1, 2), (2, 2), (2, None), (4, None)], ids=["w1s2", "w2s2", "w2", "wg"])
def test_gluon_fp8_kernel_pdl_waits_before_what_the_kernel_ahead_writes(warps, stages):
    """Round AE: under PDL the Gluon kernel lets the next launch go at once, and waits for the kernel
    ahead before its first memory operation in the first call after ``plan.update`` (that kernel may be
    the update); in later calls it loads the plan's metadata and issues its first chunk's first tiles
    (cp.async) before the wait, and no store, atomic or reduction precedes it. At one warp a program its
    unused ring slot keeps an SM to the plan's 4 programs (5 would fit without it) at 2 ring slots; at two (round AL)
    the warps' output buffer does beside 2 slots, and since round AM the third slot (the default), with or without
    PDL; without PDL nothing else of this. The warpgroup form (round AR, an fp8 q) the same, its q beside the ring."""
    from evenflow.attention.plan import GLUON_FP8_PROGRAMS_PER_SM as PPS

    B, page = len(BIG), 64
    mp = max(-(-n // page) for n in BIG)
    with CC.emulate_gpu(), CC.record_launches() as rec:
        k = torch.empty(B * mp, page, 8, 128, dtype=FP8)
        pt, sl = torch.zeros(B, mp, dtype=torch.int32), torch.tensor(BIG, dtype=torch.int32)
        q = torch.empty(B, 64, 128, dtype=FP8 if warps == 4 else torch.bfloat16)
        qs = torch.ones(B, 64) if warps == 4 else None
        for kw in ({}, dict(early_reads=False), dict(resident_cap=False), dict(pdl=False)):
            plan = evenflow.DecodePlan(B, mp * page, 8, device="cpu", kv_dtype=FP8, gluon_warps=warps,
                                       num_stages=stages, **kw).update(sl)
            for _ in range(2):
                evenflow.decode_attention(q, k, k, pt, sl, plan=plan, q_scale=qs, k_scale=torch.ones(1), v_scale=0.5)
    assert {dict(la.constexprs)["WARPS"] for la in rec if la.gluon} == {warps}
    got = [(c["PDL"], c["EARLY"], c["PAD"]) for c in (dict(la.constexprs) for la in rec if la.gluon)]
    pad = 1 if warps == 1 else 0
    assert got == [(True, False, pad), (True, True, pad), (True, False, pad), (True, False, pad), (True, False, 0),
                   (True, True, 0), (False, False, 0), (False, False, 0)], got
    stats = {s["describe"]: s for s in CC.compile_stats([la for la in rec if la.gluon])}
    assert len(stats) == (5 if pad else 3) and all("error" not in s for s in stats.values()), stats
    for s in stats.values():
        m, desc = s["marks"], s["describe"]
        memory = [m[op] for op in ("ld.global", "cp.async", "atom.", "red.", "st.global") if m[op] >= 0]
        wait, launch = m["griddepcontrol.wait"], m["griddepcontrol.launch_dependents"]
        block = s["shared"] + 1024
        if "PDL=False" in desc:
            assert wait < 0 and launch < 0, desc
        elif "EARLY=False" in desc:
            assert 0 <= launch < wait < min(memory), desc
        else:
            assert 0 <= launch < wait and m["cp.async"] < wait and m["ld.global"] < wait, desc
            assert min(m[op] for op in ("atom.", "st.global") if m[op] >= 0) > wait, desc
        if "PAD=1" in desc or warps > 1:
            assert PPS * block <= 233472 < (PPS + 1) * block, desc
        else:
            assert (PPS + 1) * block <= 233472, desc


def test_bin_stride_spreads_consecutive_programs_and_an_sms_programs_over_the_batch():
    """Round AE5: under PDL the Gluon kernel's program i drains bin i * stride mod programs. The stride is a
    bijection (prime to the program count) that sends consecutive programs, and the programs a plain launch
    deals to one SM (i, i + SMs, ...), to bins in different quarters of the batch at 4 programs an SM."""
    from evenflow.attention.plan import bin_stride as _bin_stride

    with CC.emulate_gpu(132):
        cpu = torch.device("cpu")
        assert _bin_stride(264, cpu) == 1 + 132 and _bin_stride(132, cpu) == 1 and _bin_stride(100, cpu) == 1
        for programs in (528, 527, 396, 1 << 16):
            a = _bin_stride(programs, cpu)
            bins = [i * a % programs for i in range(programs)]
            assert sorted(bins) == list(range(programs)), programs
        bins = [i * _bin_stride(528, cpu) % 528 for i in range(528)]
        quarter = [b // 132 for b in bins]
        assert all(quarter[i] != quarter[i + 1] for i in range(527))
        assert all(sorted(quarter[s + 132 * j] for j in range(4)) == [0, 1, 2, 3] for s in range(132))


def test_triton_kernel_pdl_lets_the_next_launch_go_only_where_it_holds_an_sm_to_the_plan():
    """Round AF: under PDL the Triton kernel's fused plan path lets the next kernel launch at its top
    (``DecodePlan.launch_next``) and, except in the first call after ``plan.update``, loads its first item's
    metadata before waiting for the kernel ahead; no store, atomic or reduction precedes the wait, and in
    the first call nothing does. It lets go only where its build keeps an SM to the plan's 2 programs:
    the default build at head_dim 128 and a 16-row tile (2 programs fit an SM, 3 do not); not with a
    launch option of the plan, at head_dim 64 or 256, at a 64-row tile, or without PDL."""
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM as PPS

    B, page = len(BIG), 64
    mp = max(-(-n // page) for n in BIG)
    with CC.emulate_gpu(), CC.record_launches() as rec:
        pt, sl = torch.zeros(B, mp, dtype=torch.int32), torch.tensor(BIG, dtype=torch.int32)
        for kv in (torch.bfloat16, FP8):
            k = torch.empty(B * mp, page, 8, 128, dtype=kv)
            q = torch.empty(B, 64, 128, dtype=torch.bfloat16)
            sc = dict(k_scale=torch.ones(1), v_scale=0.5) if kv == FP8 else {}
            kws = ({}, dict(early_reads=False), dict(launch_next=False), dict(pdl=False), dict(num_stages=3))
            for kw in kws if kv == torch.bfloat16 else ({},):
                plan = evenflow.DecodePlan(B, mp * page, 8, device="cpu", **kw).update(sl)
                for _ in range(2):
                    evenflow.decode_attention(q, k, k, pt, sl, plan=plan, **sc)
        # the timeline build reads early too; head dims 64 / 256 and a 64-row tile (group 16 x q_len 4) never let go
        # group 1 at page 16 and group 4 x q_len 4 at page 128 (16 rows) let go too, held at 2 an SM
        for hq, hkv, d, q_len, timeline, page in ((64, 8, 128, 1, True, 64), (16, 2, 64, 1, False, 64),
                                                  (16, 2, 256, 1, False, 64), (32, 2, 128, 4, False, 64),
                                                  (16, 16, 128, 1, False, 16), (16, 4, 128, 4, False, 128)):
            k = torch.empty(2 * 80 * 64 // page, page, hkv, d, dtype=torch.bfloat16)
            q = torch.empty(2 * q_len, hq, d, dtype=torch.bfloat16)
            plan = evenflow.DecodePlan(2, 80 * 64, hkv, page_size=page, q_len=q_len,
                                       device="cpu").update(sl[:2].clamp(max=5000))
            plan.record_timeline(timeline)
            for _ in range(2):
                evenflow.decode_attention(q, k, k, pt[:2, :80 * 64 // page], sl[:2].clamp(max=5000), plan=plan)
    got = [(c["PDL"], c["EARLY"], c["TRIGGER"]) for c in (dict(la.constexprs) for la in rec
                                                         if la.name == "decode_kernel")]
    T, F = True, False
    assert got == [(T, F, T), (T, T, T), (T, F, T), (T, F, T), (T, F, F), (T, T, F), (F, F, F), (F, F, F),
                   (T, F, F), (T, T, F),  # num_stages set: no trigger
                   (T, F, T), (T, T, T),  # fp8 KV on the Triton kernel (a plan without its KV dtype)
                   (T, F, T), (T, T, T), (T, F, F), (T, T, F), (T, F, F), (T, T, F), (T, F, F), (T, T, F),
                   (T, F, T), (T, T, T), (T, F, T), (T, T, T)], got
    stats = CC.compile_stats([la for la in rec if la.name == "decode_kernel"])
    assert all("error" not in s for s in stats), stats
    for s in stats:
        m, desc = s["marks"], s["describe"]
        memory = [m[op] for op in ("ld.global", "cp.async", "atom.", "red.", "st.global") if m[op] >= 0]
        wait, launch = m["griddepcontrol.wait"], m["griddepcontrol.launch_dependents"]
        if "PDL=False" in desc:
            assert wait < 0 and launch < 0, desc
            continue
        assert (launch >= 0) == ("TRIGGER=True" in desc) and launch < wait, desc
        if "EARLY=False" in desc:
            assert 0 <= wait < min(memory), desc
        else:
            assert 0 <= m["ld.global"] < wait, desc
            assert min(m[op] for op in ("atom.", "st.global", "cp.async") if m[op] >= 0) > wait, desc
        if "TRIGGER=True" in desc:
            threads = 32 * s["num_warps"]
            fits = min(65536 // (s["regs"] * threads), 233472 // (s["shared"] + 1024))
            assert fits == PPS, (desc, s["regs"], s["shared"])


# calls a plan built for the Gluon fp8 kernel cannot run it on (DecodePlan(kv_dtype=FP8) at 8 KV heads): fp8 q,
# head_dim 64, GQA group x q_len 32
TRITON_ON_GLUON_PLAN = {
    "fp8-q": dict(qdt=FP8),
    "d64": dict(d=64),
    "g16-q2": dict(hq=128, q_len=2),
}


@pytest.mark.parametrize("name", list(TRITON_ON_GLUON_PLAN))
def test_triton_kernel_on_a_plan_built_for_gluon_warns_once_and_builds_unspilled(name, monkeypatch):
    """Such a call runs the Triton kernel on bins sized for 4 programs an SM. Round AO's compile found it capped for
    4 an SM (128 registers: 532 bytes of spill a thread with fp8 q); it now builds as on its own plan (capped for 2
    an SM, no spill), and the first call on the plan says so once, naming the reason and ``gluon=False``; a plan
    built with ``gluon=False`` runs the same call without a word."""
    import warnings

    from evenflow.attention import decode
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM as PPS

    monkeypatch.setattr(decode, "GLUON_FP8_Q", False)  # the switch off: an fp8 q runs the Triton kernel
    kw = dict(lens=[8 * K, 300, 0, 65], kv=FP8, kv_dtype=FP8, **TRITON_ON_GLUON_PLAN[name])
    # the reason, and what the plan could have been told instead of gluon=False (nothing, for a q dtype)
    reason, told = {
        "fp8-q": (r"q is torch.float8_e4m3fn, not bfloat16 \(decode.GLUON_FP8_Q is off\)", r"gluon=False for"),
        "d64": ("head_dim is 64", r"gluon=False \(or told the calls' head_dim=64\) for"),
        "g16-q2": ("GQA group x q_len is 32", r"gluon=False \(or told the calls' num_q_heads=128\) for")}[name]
    with CC.emulate_gpu(), CC.record_launches() as rec:
        with pytest.warns(RuntimeWarning, match=f"built for the Gluon fp8 kernel.*{reason}.*{told}") as got:
            _call(**kw, calls=2)
        assert len([w for w in got if w.category is RuntimeWarning]) == 1  # two calls, one plan
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _call(**kw, gluon=False)
    names = [la.name for la in rec]
    assert "decode_fp8_kernel" not in names and names.count("decode_kernel") == 3, names
    on_gluon, again, on_own = [la for la in rec if la.name == "decode_kernel"]
    assert again.options == on_gluon.options  # (the second call reads early: other constexprs)
    assert dict(on_gluon.options).get("maxnreg") == dict(on_own.options).get("maxnreg"), (on_gluon, on_own)
    (st,) = CC.compile_stats([on_gluon])
    assert "error" not in st and st["spill_bytes"] == 0, st
    assert st["regs"] * 32 * st["num_warps"] * PPS <= 65536, st


@pytest.mark.parametrize("name", ["d64", "g16-q2"])
def test_plan_told_a_shape_outside_gluon_runs_the_triton_kernel_as_on_its_own_plan(name):
    """Round AP: told the calls' head_dim and q heads, an fp8 plan whose calls the Gluon kernel does not take is the
    Triton kernel's own plan: the same launch as ``gluon=False`` builds, and no warning."""
    import warnings

    kw = dict(lens=[8 * K, 300, 0, 65], kv=FP8, kv_dtype=FP8, **TRITON_ON_GLUON_PLAN[name])
    told = dict(head_dim=kw.get("d", 128), num_q_heads=kw.get("hq", 64))
    with CC.emulate_gpu(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with CC.record_launches() as rec_told:
            _call(**kw, **told)
        with CC.record_launches() as rec_own:
            _call(**kw, gluon=False)
    assert [la.describe() for la in rec_told] == [la.describe() for la in rec_own]
    assert [la.name for la in rec_told].count("decode_kernel") == 1


def test_plan_kernel_pack_pass_calls_no_division_routine():
    """Round BB: the plan kernel's sm_90 build with ``pack_short`` (the default) prices its 32 quanta a request in
    int32. Its first build divided in int64, which sm_90 runs as a subroutine call a quotient (32 calls a trip of the
    pricing loop, 162 registers), and the record measured that plan at 9.2-9.9 us an update against 3.7-4.2 without
    it (BB2). No loop of the build may call a routine, and it keeps the register count of the build without the
    option (55-56, history/round-bb-cpu/)."""
    lens = torch.tensor([64 * K] * 2 + [K] * 30, dtype=torch.int32)
    builds = {}
    for pack in (False, True):
        with CC.emulate_gpu(), CC.record_launches() as rec:
            evenflow.DecodePlan(32, 128 * K, 8, device="cpu", num_programs=528, pack_short=pack).update(lens)
        (st,) = CC.compile_stats([la for la in rec if la.name == "plan_kernel"])
        assert "error" not in st, st
        builds[pack] = st
    assert len(builds[True]["loops"]) > len(builds[False]["loops"]), "the pack pass adds a loop"
    for loop in builds[True]["loops"]:
        assert not any(op.startswith("CALL") for op in loop["ops"]), loop["ops"]
    assert builds[True]["regs"] <= builds[False]["regs"] + 8, (builds[True]["regs"], builds[False]["regs"])


def _innermost_loops(loops):
    """The loop trips of ``loop_load_waves`` that hold no other loop (a merge step, a tile step)."""
    return [lp for lp in loops
            if not any(o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"] for o in loops)]


@pytest.mark.parametrize("name", ["bf16", "tp8-slice", "hnd-q3", "d256-fp8", "d256-p128-g16-q4"])
def test_one_pass_fused_merge_issues_each_step_in_one_round_trip(name, monkeypatch):
    """Round BP: with ``decode.MERGE_ONE_PASS`` every innermost loop of the Triton kernel's sm_90 build (the fused
    merge's steps, both levels, and the tile loops) issues its loads in the round trips their addresses need
    (``_compile_check.loop_load_waves``), and the build stays resident at the plan's programs an SM with no more
    spill than the two-pass build's. On the record's shapes (64 / 8 and the TP8 slice, bf16) the two-pass step (the
    default until round BQ) does not: some step's loads wait behind reads of others (3 round trips where 1 is
    needed, round BO), which is what the switch is for. Merges of 64 rows (``decode.MERGE_ONE_PASS_MAX_ROWS``) keep
    the two-pass build."""
    from evenflow.attention import decode
    from evenflow.attention.plan import DEFAULT_PROGRAMS_PER_SM as PPS

    builds = {}
    for one_pass in (False, True):
        monkeypatch.setattr(decode, "MERGE_ONE_PASS", one_pass)
        with CC.emulate_gpu(), CC.record_launches() as rec:
            _call(**SCENARIOS[name])
        (la,) = [la for la in rec if la.name == "decode_kernel"]
        c = dict(la.constexprs)
        assert c["FUSED"] and c["MERGE_ONE_PASS"] == (one_pass and c["FUSED_M"] <= decode.MERGE_ONE_PASS_MAX_ROWS)
        builds[one_pass] = (c["MERGE_ONE_PASS"], la)
    if not builds[True][0]:
        assert name == "d256-p128-g16-q4"  # 64 rows: the same launch either way
        assert builds[True][1].describe() == builds[False][1].describe()
        return
    off, on = CC.compile_stats([builds[False][1], builds[True][1]])
    assert "error" not in off and "error" not in on, (off, on)
    steps = _innermost_loops(on["loop_load_waves"])
    # both merge levels' steps are among them (20-32 loads a step at these shapes; a tile loop has at most 8)
    assert sum(lp["loads"] >= 16 for lp in steps) == 2, steps
    assert all(lp["issued"] == lp["needed"] for lp in steps), steps
    assert on["regs"] * 32 * on["num_warps"] * PPS <= 65536, on["regs"]
    assert on["spill_bytes"] <= off["spill_bytes"], (on["spill_bytes"], off["spill_bytes"])
    if name in ("bf16", "tp8-slice"):
        assert any(lp["issued"] > lp["needed"] for lp in _innermost_loops(off["loop_load_waves"]))
