"""Split-K summed with float atomics (``GemmConfig.reduce="atomic"``, round BW).

What is checked, and why:

* Values: both split-K kernels (tensor-core ``triton`` / ``fp32-tc`` and CUDA-core ``fp32-splitk``) under atomics,
  against the fp64 product by the tolerance rule and the analytic bound of any fp32 summation order (the slices
  meet in arrival order, so only a bound holds on a GPU), into NaN-poisoned outputs (the zeroing kernel must
  reach every element).
* The interpreter runs the programs one after another in split order, so there the atomic sum is the counter's
  in-order sum, bit for bit: a wrong partial, a missed slice or a slice added twice would show.
* No workspace: an atomic launch reads and writes no partials or counters; a one-slice launch stores directly
  (no zeroing kernel).
* Determinism policy: a table entry's ``atomic`` runs as ``counter`` under ``torch.use_deterministic_algorithms``
  (the same bits as the counter config); a forced atomic config there, or in batch-invariant mode, raises; a
  batch-invariant table entry may not be atomic; ``reserve`` sizes the counter twin's workspace.
* Config validation, opcheck of both custom ops with the new argument, the tuner's twins.
* The fp32-tc one-step build with its weight loaded before the PDL wait (launch ``pdl-preload``): the loop's
  bits in the interpreter, chosen by ``router_gemm`` exactly where every slice is one step.
* sm_90: the atomic builds compile without spills; the GEMMs wait for the kernel ahead before their first
  atomic and store nothing plainly, and load before the wait only in the preload build; the zeroing kernel lets
  the next launch go before it waits, and writes only after the wait.
* GPU (``@pytest.mark.gpu``): real shapes, repeated calls (every call within the bound, calls within the bound of
  two summation orders of each other), CUDA-graph capture and replay with changing inputs, the deterministic
  fallback bitwise the counter's.
* ``route``'s logits buffer (round CN): all zero between calls, its top-k kernel writing zeros back over what it
  read, so an atomic GEMM adds into it with no zeroing kernel: every call's selection equals the zeroing path's
  (``router_gemm`` into its own output, then ``select_experts``) over a sequence of row counts and paths on one
  weight, the buffer zero after each; the zeroing kernel launched by ``router_gemm`` and never by ``route``; the
  zeros load-bearing (a poisoned buffer poisons the next atomic call); every argument checked before the GEMM
  launches; a failed top-k launch leaves zeros; the sm_90 build puts a barrier between the top-k's loads and its
  zeros; a call captured in a CUDA graph zeroes first, clears nothing and ends the kept zeros (every later call zeroes
  first); on the GPU, a graph of routes replayed over changing inputs with eager calls between the replays.
"""

import dataclasses
import re

import pytest
import torch

import evenflow
from evenflow import _runtime
from evenflow.reference import router as R
from evenflow.router import dispatch
from evenflow.router.dispatch import GemmConfig
from evenflow.router.gemm import launch_shape
from evenflow.testing import assert_fp32_gemm_within_bound, assert_within_rule, poisoned
from tests_support_router import load_tuner, router_inputs

_inputs = router_inputs


def _atomic(cfg: GemmConfig) -> GemmConfig:
    return dataclasses.replace(cfg, reduce="atomic")


def _check(out, x, rw, w, cfg, what):
    """fp32-splitk: the fp32 product's bound; the tensor-core paths: the rule against the split's fp32 math and
    the split's analytic bound (2^-17 representation at two terms is covered: three terms by default)."""
    if cfg.path == "fp32-splitk":
        return assert_fp32_gemm_within_bound(out, x, w, what)
    ref = R.router_logits_fp64(x.cpu(), w.cpu())
    base = R.split_logits_fp32(x.cpu(), *(t.cpu() for t in rw.parts))
    err = assert_within_rule(out, ref, base, what=what)
    mag = x.cpu().double().abs() @ w.cpu().double().abs().t()
    bound = (2.0**-17 + (x.shape[1] + 2) * 2.0**-24) * mag
    assert ((out.cpu().double() - ref).abs() - bound).max().item() <= 0, f"{what}: analytic bound exceeded"
    return err


CASES = [
    # (M, N, K, config): why
    (5, 40, 256, GemmConfig(16, 16, 32, 4, 4, 2, "triton")),      # stored split, 4 slices, masked rows
    (3, 24, 192, GemmConfig(16, 16, 32, 3, 4, 2, "fp32-tc")),     # split in registers, N one tile and a half
    (20, 33, 320, GemmConfig(16, 32, 64, 5, 4, 2, "fp32-tc")),    # two row tiles, N tail
    (16, 17, 200, GemmConfig(16, 16, 32, 7, 2, 2, "triton")),     # K tail in the last slice, 2 warps
    (7, 33, 320, GemmConfig(8, 4, 32, 5, 4, 3, "fp32-splitk")),   # CUDA cores, N tail
    (16, 10, 384, GemmConfig(4, 2, 32, 12, 4, 3, "fp32-splitk")),  # 12 slices, four row tiles
    (2, 12, 100, GemmConfig(2, 4, 16, 7, 1, 3, "fp32-splitk")),   # K tail, 1 warp
]


@pytest.mark.parametrize("m,n,k,cfg", CASES,
                         ids=[f"{c[3].path}-M{c[0]}-N{c[1]}-K{c[2]}-s{c[3].split_k}" for c in CASES])
def test_atomic_split_matches_fp64_and_writes_every_element(device, m, n, k, cfg):
    x, w = _inputs(m, n, k, device, seed=m * 31 + k)
    rw = evenflow.RouterWeight(w)
    cfg = _atomic(cfg)
    assert launch_shape(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)[1] > 1
    out = poisoned((m, n), torch.float32, device)
    assert evenflow.router_gemm(x, rw, out, config=cfg) is out
    _check(out, x, rw, w, cfg, f"{cfg}")
    assert rw._part.numel() == 0 and rw._count.numel() == 0  # no workspace touched or grown
    counter = evenflow.router_gemm(x, rw, config=dataclasses.replace(cfg, reduce="counter"))
    if _runtime.interpreting():
        # programs run one at a time in split order: the same additions as the counter's in-order sum
        assert torch.equal(out, counter)
    else:
        _check(counter, x, rw, w, cfg, "counter twin")


def test_one_slice_stores_directly_without_the_zeroing_kernel(device, monkeypatch):
    calls = []
    import evenflow.router.gemm as G

    real = G._zero_out
    monkeypatch.setattr(G, "_zero_out", lambda out, pdl: (calls.append(out.shape), real(out, pdl)))
    x, w = _inputs(4, 16, 128, device, seed=5)
    rw = evenflow.RouterWeight(w)
    one = GemmConfig(16, 16, 128, 1, 4, 2, "triton", reduce="atomic")  # K is one slice
    _check(evenflow.router_gemm(x, rw, poisoned((4, 16), torch.float32, device), config=one), x, rw, w, one, "one")
    assert calls == []
    two = dataclasses.replace(one, block_k=64, split_k=2)
    evenflow.router_gemm(x, rw, config=two)
    assert calls == [(4, 16)]


def test_zeroing_kernel_takes_any_row_count_in_one_build():
    # M is not specialised (as in the GEMM kernels): a CUDA graph captured at a new batch size must not compile and
    # load another build of the zeroing kernel inside the capture
    import os
    import subprocess
    import sys

    code = ("from evenflow.router.kernels import zero_out_kernel as z; "
            "print([p.name for p in z.params if p.do_not_specialize])")  # (the interpreter's kernels keep no params)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "0"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "['M']"


# ----------------------------------------------------------------------------- fp32-tc one-step preload


@pytest.mark.parametrize("m,n,k,bk,split,atomic", [
    (5, 40, 256, 64, 4, True),     # four one-step slices, atomics
    (3, 24, 200, 64, 4, False),    # K tail in the last step (200 = 3 x 64 + 8), the counter
    (20, 33, 128, 32, 4, True),    # two row tiles, N tail
    (4, 16, 64, 64, 1, False),     # one slice of one step: no split at all
])
def test_fp32_tc_one_step_preload_build_matches_the_loop(device, m, n, k, bk, split, atomic):
    # Round BW: the fp32-tc kernel's loop-free PRELOAD_W build, its slice's weight loaded and split before the PDL wait
    # (launch "pdl-preload"), computes what the loop's one trip does: within the rule, and bit for bit the loop
    # build in the interpreter (no PDL there: the place of the loads is the only difference; the sm_90 test
    # checks where they sit).
    from evenflow.router.gemm import _launch_split

    x, w = _inputs(m, n, k, device, seed=k + m)
    rw = evenflow.RouterWeight(w)
    assert launch_shape(m, n, k, 16, 16, bk, split)[0] == bk  # every slice one step
    cfg = GemmConfig(16, 16, bk, split, 4, 2, "fp32-tc", reduce="atomic" if atomic else "counter")
    part, count = rw.workspace(m, dataclasses.replace(cfg, reduce="counter"))
    outs = []
    for pre in (False, True):
        out = poisoned((m, n), torch.float32, device)
        _launch_split(x, w, w, w, out, part, count, 3, 16, 16, bk, split, 4, 2, False, False, True, atomic, pre)
        _check(out, x, rw, w, cfg, f"preload={pre}")
        outs.append(out)
    if _runtime.interpreting():
        # the same operations; on a GPU the two builds may take the MMA's K steps in another order (within the
        # rule, checked above), and the atomic sums meet in arrival order (BW2 saw both)
        assert torch.equal(outs[0], outs[1])
    assert int(count.abs().sum()) == 0


def test_split_launch_refuses_a_preload_of_the_stored_split(device):
    from evenflow.router.gemm import _launch_split

    x, w = _inputs(2, 16, 64, device)
    rw = evenflow.RouterWeight(w)
    with pytest.raises(ValueError, match="preload_w needs the fp32 weight"):
        _launch_split(x, rw.w_hi, rw.w_lo, rw.parts[-1], torch.empty(2, 16, device=device), rw._part, rw._count, 3,
                      16, 16, 64, 1, 4, 2, False, False, False, False, True)


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_router_gemm_preloads_fp32_tc_exactly_where_every_slice_is_one_step():
    CC = pytest.importorskip("evenflow._compile_check")
    k = 1024
    one = GemmConfig(16, 16, 128, 8, 2, 4, "fp32-tc", "pdl-preload", "atomic")     # 8 slices of one step
    two = dataclasses.replace(one, split_k=4)                                       # 4 slices of two steps
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(64, k) * 0.02)
        x = torch.empty(16, k, dtype=torch.bfloat16)
        evenflow.router_gemm(x, rw, config=one)
        evenflow.router_gemm(x, rw, config=two)
        evenflow.router_gemm(x, rw, config=one, prefetch_weights=False)
        evenflow.router_gemm(x, rw, config=dataclasses.replace(one, reduce="counter"))
    gemms = [dict(la.constexprs) for la in launches if la.name == "router_gemm_kernel"]
    # (PRELOAD_W is also the loop-free one-step build)
    got = [(c["PRELOAD_W"], c["PREFETCH_W"], c["RED_ATOMIC"]) for c in gemms]
    assert got == [(True, False, True), (False, True, True), (False, False, True), (True, False, False)], got


# ----------------------------------------------------------------------------- determinism policy


@pytest.fixture
def deterministic():
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)


def _table_says(monkeypatch, cfg):
    monkeypatch.setattr("evenflow.router.gemm.choose_config", lambda *a, **kw: cfg)


def test_table_entry_atomic_runs_as_counter_under_deterministic_algorithms(device, monkeypatch, deterministic):
    m, n, k = 9, 24, 256
    x, w = _inputs(m, n, k, device, seed=8)
    cfg = GemmConfig(16, 16, 32, 8, 4, 2, "fp32-tc", reduce="atomic")
    _table_says(monkeypatch, cfg)
    rw = evenflow.RouterWeight(w)
    got = evenflow.router_gemm(x, rw)
    assert rw._count.numel() > 0 and int(rw._count.abs().sum()) == 0  # the counter's workspace ran (and reset)
    want = evenflow.router_gemm(x, evenflow.RouterWeight(w), config=dataclasses.replace(cfg, reduce="counter"))
    assert torch.equal(got, want)


def test_forced_atomic_config_refused_where_bits_must_not_move(device, deterministic):
    x, w = _inputs(4, 16, 128, device)
    rw = evenflow.RouterWeight(w)
    cfg = GemmConfig(16, 16, 32, 4, reduce="atomic")
    with pytest.raises(RuntimeError, match="reduce='atomic'.*use_deterministic_algorithms"):
        evenflow.router_gemm(x, rw, config=cfg)


def test_forced_atomic_config_warns_under_warn_only_deterministic_algorithms(device):
    # PyTorch's convention: under use_deterministic_algorithms(True, warn_only=True) a nondeterministic op warns and
    # runs
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        x, w = _inputs(4, 16, 128, device)
        rw = evenflow.RouterWeight(w)
        cfg = GemmConfig(16, 16, 32, 4, reduce="atomic")
        with pytest.warns(UserWarning, match="reduce='atomic'"):
            out = evenflow.router_gemm(x, rw, config=cfg)
        _check(out, x, rw, w, cfg, "warn_only")
        assert rw._count.numel() == 0  # it ran the atomic launch
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def test_forced_atomic_config_refused_in_batch_invariant_mode(device):
    x, w = _inputs(4, 16, 128, device)
    with pytest.raises(RuntimeError, match="reduce='atomic'.*batch-invariant"):
        evenflow.router_gemm(x, evenflow.RouterWeight(w), batch_invariant=True,
                             config=GemmConfig(16, 16, 32, 4, reduce="atomic"))


def test_batch_invariant_table_entry_may_not_be_atomic():
    cfg = GemmConfig(16, 16, 32, 4, reduce="atomic").to_dict()
    table = {"batch_invariant": [{"K": 128, "N": 16, "terms": 3, "config": cfg}]}
    with pytest.raises(ValueError, match="counter's reduction"):
        dispatch.choose_config(4, 16, 128, torch.device("cpu"), True, (table, 132))


def test_table_entry_reads_its_reduce_and_old_entries_default_to_the_counter():
    cfg = GemmConfig(16, 16, 64, 8, 2, 4, "fp32-tc", reduce="atomic")
    entry = {"K": 512, "N": 16, "terms": 3, "m_max": 16, "config": cfg.to_dict()}
    old = {**entry, "m_max": 64, "config": {k: v for k, v in cfg.to_dict().items() if k != "reduce"}}
    facts = ({"entries": [entry, old]}, 132)
    assert dispatch.choose_config(16, 16, 512, torch.device("cpu"), facts=facts) == cfg
    assert dispatch.choose_config(64, 16, 512, torch.device("cpu"), facts=facts).reduce == "counter"


def test_reserve_sizes_the_counter_twin_of_an_atomic_entry(device, monkeypatch):
    n, k = 24, 256
    cfg = GemmConfig(16, 16, 32, 8, 4, 2, "triton", reduce="atomic")
    _table_says(monkeypatch, cfg)
    rw = evenflow.RouterWeight(_inputs(1, n, k, device)[1])
    rw.reserve(16)
    part, count = dataclasses.replace(cfg, reduce="counter").workspace_sizes(16, n, k)
    assert rw._part.numel() >= part > 0 and rw._count.numel() >= count > 0


def test_reduce_config_validation():
    assert GemmConfig(16, 16, 32, 4, reduce="atomic").workspace_sizes(16, 64, 128) == (0, 0)
    with pytest.raises(ValueError, match="config.reduce must be one of"):
        GemmConfig(reduce="exchange")
    with pytest.raises(ValueError, match="needs a split-K path"):
        GemmConfig(4, 2, 64, 1, 4, 1, "fp32-simt", reduce="atomic")
    with pytest.raises(ValueError, match="needs a split-K path"):
        GemmConfig(path="torch-fp32", reduce="atomic")
    c = GemmConfig(16, 32, 64, 8, 4, 3, "fp32-tc", reduce="atomic")
    assert GemmConfig.from_dict(c.to_dict()) == c


def test_opcheck_both_split_ops_with_atomics(device):
    x, w = _inputs(3, 16, 128, device)
    rw = evenflow.RouterWeight(w)
    out = torch.empty(3, 16, device=device)
    empty_f, empty_i = torch.empty(0, device=device), torch.zeros(0, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.evenflow.router_gemm_split.default,
                          (x, rw.w_hi, rw.w_lo, rw.parts[-1], out, empty_f, empty_i, 3, 16, 16, 32, 4, 4, 2,
                           False, False, False, True))
    torch.library.opcheck(torch.ops.evenflow.router_gemm_fp32_splitk.default,
                          (x, w, out, empty_f, empty_i, 4, 4, 32, 4, 4, 3, False, False, True))


# ----------------------------------------------------------------------------- tuner


def test_tuner_offers_atomic_twins_of_tensor_core_splits_at_16_and_64_rows_only():
    tuner = load_tuner()
    for case, (k, n) in tuner.CASES.items():
        for m in (1, 4, 128):
            assert not [c for c in tuner.candidates(m, n, k, 132) if c.reduce == "atomic"], (case, m)
        for m in (16, 64):
            cands = tuner.candidates(m, n, k, 132)
            atomic = [c for c in cands if c.reduce == "atomic"]
            assert atomic and all(c.path in dispatch.TC_PATHS for c in atomic), (case, m)
            for i, c in enumerate(cands):
                split = launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1]
                if c.path in dispatch.TC_PATHS and c.reduce == "counter" and split > 1:
                    assert cands[i + 1] == _atomic(c), (case, m, c)  # the twin right after its original
            # and the wide atomic splits, one and two K steps a slice, after the list
            steps = {-(-k // (c.block_k * launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1]))
                     for c in atomic}
            assert 1 in steps, (case, m)
            pre = [c for c in atomic if c.launch == "pdl-preload"]
            assert pre and all(c.path == "fp32-tc" and tuner._one_step(c, m, n, k) for c in pre), (case, m)


# ----------------------------------------------------------------------------- sm_90 builds


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_atomic_builds_compile_for_sm90_and_wait_before_their_atomics():
    CC = pytest.importorskip("evenflow._compile_check")
    cfgs = [(16, GemmConfig(16, 16, 128, 16, 2, 4, "triton", "pdl-prefetch", "atomic")),
            (16, GemmConfig(16, 32, 128, 8, 4, 4, "fp32-tc", "pdl-prefetch", "atomic")),
            (64, GemmConfig(64, 32, 128, 8, 4, 4, "fp32-tc", "pdl", "atomic")),
            (16, GemmConfig(16, 16, 128, 32, 2, 4, "fp32-tc", "pdl-preload", "atomic")),  # one step a slice
            (16, GemmConfig(4, 4, 256, 8, 4, 3, "fp32-splitk", "pdl", "atomic"))]
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(192, 4096) * 0.02)
        for m, cfg in cfgs:
            evenflow.router_gemm(torch.empty(m, 4096, dtype=torch.bfloat16), rw, config=cfg)
    names = [la.name for la in launches]
    assert names == ["zero_out_kernel", "router_gemm_kernel"] * 4 + ["zero_out_kernel",
                                                                     "router_gemm_fp32_splitk_kernel"], names
    stats = CC.compile_stats(launches)
    errors = [s["error"] for s in stats if "error" in s]
    assert not errors, "\n\n".join(errors)
    assert len(stats) == 6  # one zeroing build (the same for all five calls) and the five GEMM builds
    for s in stats:
        pre = "PRELOAD_W=True" in s["describe"]
        assert s["spill_bytes"] == 0, s["describe"]
        mk = s["marks"]
        wait, go = mk["griddepcontrol.wait"], mk["griddepcontrol.launch_dependents"]
        if "zero_out_kernel" in s["describe"]:
            # the next launch may start first; the zeros only after the kernel ahead has finished
            assert 0 <= go < wait < mk["st.global"], s["describe"]
        else:
            first_atomic = min(v for v in (mk["red.global"], mk["atom.global"]) if v >= 0)
            assert 0 <= wait < first_atomic, s["describe"]
            # the preload build's first load (the weight) comes before the wait; every other build loads after it
            assert (0 <= mk["ld.global"] < wait) == pre, s["describe"]
            assert mk["st.global"] == -1, s["describe"]  # every output element goes through the atomics


# ----------------------------------------------------------------------------- GPU, real shapes

SHAPES = {"K4096-N192": (4096, 192), "longcat-lite": (3072, 384), "qwen3-30b-a3b": (2048, 128)}
GPU_CFGS = [GemmConfig(16, 16, 128, 16, 2, 4, "triton", "pdl-prefetch", "atomic"),
            GemmConfig(16, 32, 128, 8, 4, 4, "fp32-tc", "pdl-prefetch", "atomic"),
            GemmConfig(16, 16, 64, 32, 2, 4, "fp32-tc", "pdl", "atomic"),
            GemmConfig(16, 16, 128, 32, 2, 4, "fp32-tc", "pdl-preload", "atomic"),  # one step a slice up to K 4096
            GemmConfig(4, 4, 256, 8, 4, 3, "fp32-splitk", "plain", "atomic")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SHAPES))
def test_gpu_atomic_real_shapes_repeated_calls(case):
    k, n = SHAPES[case]
    x, w = _inputs(16, n, k, "cuda", seed=21)
    rw = evenflow.RouterWeight(w)
    ref = R.router_logits_fp64(x, w)
    for cfg in GPU_CFGS:
        first = evenflow.router_gemm(x, rw, config=cfg)
        _check(first, x, rw, w, cfg, f"{case} {cfg}")
        assert (first.double() - ref).abs().max().item() <= 1e-4
        counter = evenflow.router_gemm(x, rw, config=dataclasses.replace(cfg, reduce="counter"))
        # the same S partials summed in two orders: each sum within (S - 1) u of the partials' magnitude (bounded by
        # |x| . |w|) of the exact sum of the partials, so the two within twice that
        splits = launch_shape(16, n, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)[1]
        slack = 2 * splits * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        for _ in range(50):
            again = evenflow.router_gemm(x, rw, config=cfg)
            assert torch.all((again.double() - counter.double()).abs() <= slack), cfg


@pytest.mark.gpu
def test_gpu_atomic_cuda_graph_replay_changing_inputs():
    k, n = SHAPES["K4096-N192"]
    _, w = _inputs(1, n, k, "cuda", seed=4)
    rw = evenflow.RouterWeight(w)
    cfgs = {16: GPU_CFGS[0], 9: GPU_CFGS[1], 12: GPU_CFGS[3], 4: GPU_CFGS[4]}
    xs = {m: torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for m in cfgs}
    outs = {m: torch.empty(m, n, device="cuda") for m in cfgs}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m, c in cfgs.items():
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=m)[0])
            evenflow.router_gemm(xs[m], rw, outs[m], config=c)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the four calls back to back in one graph, each zeroing its own output
        for m, c in cfgs.items():
            evenflow.router_gemm(xs[m], rw, outs[m], config=c)
    for step in range(6):
        for m in cfgs:
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=100 + 7 * step + m)[0])
            outs[m].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for m, c in cfgs.items():
            _check(outs[m], xs[m], rw, w, c, f"replay {step} M={m}")


@pytest.mark.gpu
def test_gpu_deterministic_fallback_is_the_counters_bits(monkeypatch, deterministic):
    k, n = SHAPES["longcat-lite"]
    x, w = _inputs(16, n, k, "cuda", seed=2)
    cfg = GPU_CFGS[1]
    _table_says(monkeypatch, cfg)
    rw = evenflow.RouterWeight(w)
    want = evenflow.router_gemm(x, rw, config=dataclasses.replace(cfg, reduce="counter"))
    for _ in range(20):
        assert torch.equal(evenflow.router_gemm(x, rw), want)


# ----------------------------------------------------------------------------- route's logits buffer (round CN)

ROUTE_SEQ = [  # (M, config) one after another on one weight (N 40, K 256): atomic paths between stored ones
    (5, GemmConfig(16, 16, 32, 4, 4, 2, "triton", reduce="atomic")),
    (3, GemmConfig(4, 4, 64, 1, 4, 2, "fp32-simt")),                      # stores every logit
    (7, GemmConfig(8, 4, 32, 5, 4, 3, "fp32-splitk", reduce="atomic")),
    (9, GemmConfig(16, 16, 32, 4, 4, 2, "triton")),                       # the counter's reduction
    (2, GemmConfig(16, 32, 64, 4, 4, 2, "fp32-tc", reduce="atomic")),
    (6, GemmConfig(path="torch-fp32")),                                    # cuBLAS writes through out=
    (4, GemmConfig(16, 16, 32, 4, 4, 2, "fp32-tc", reduce="atomic")),
]


def _zero_out_calls(monkeypatch) -> list:
    import evenflow.router.gemm as G

    calls, real = [], G._zero_out
    monkeypatch.setattr(G, "_zero_out", lambda out, pdl: (calls.append(tuple(out.shape)), real(out, pdl)))
    return calls


def _zeroings(m: int, cfg: GemmConfig) -> list:
    """The zeroing kernel's launches (output shapes) ``router_gemm`` makes for ``cfg`` at ``m`` rows of the N 40, K 256
    weight: one where the K slices meet through atomics, none elsewhere."""
    atomic_split = cfg.reduce == "atomic" and launch_shape(m, 40, 256, cfg.block_m, cfg.block_n, cfg.block_k,
                                                           cfg.split_k)[1] > 1
    return [(m, 40)] if atomic_split else []


def _same_selection(got, want, what):
    if _runtime.interpreting():  # the atomic sums in split order: the zeroing path's bits
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), what
    else:  # slices meet in arrival order: the last bits of a logit may differ
        assert torch.equal(got[0], want[0]), what
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_keeps_its_logits_zero_and_runs_atomic_gemms_without_the_zeroing_kernel(device, monkeypatch,
                                                                                      scoring):
    _, w = _inputs(1, 40, 256, device, seed=3)
    rw = evenflow.RouterWeight(w)
    bias = torch.randn(40, device=device) * 0.1 if scoring == "sigmoid" else None
    calls = _zero_out_calls(monkeypatch)
    for step, (m, cfg) in enumerate(ROUTE_SEQ * 2):
        x = _inputs(m, 40, 256, device, seed=100 + step)[0]
        got = evenflow.route(x, rw, 4, scoring, bias, config=cfg)
        assert calls == [], f"route launched the zeroing kernel at M={m} {cfg}"
        assert torch.count_nonzero(rw._logits).item() == 0, f"route left logits in its buffer at M={m} {cfg}"
        want = evenflow.select_experts(evenflow.router_gemm(x, rw, config=cfg), 4, scoring, bias)
        assert calls == _zeroings(m, cfg), cfg  # router_gemm's own output is zeroed first
        calls.clear()
        _same_selection(got, want, f"step {step} M={m} {cfg}")


def test_route_logits_zeros_are_what_its_atomic_gemm_adds_into(device):
    """The zeros are load-bearing: a buffer someone wrote into (what the docstring forbids) shows in the next
    atomic call's weights, and the call leaves zeros again."""
    x, w = _inputs(5, 40, 256, device, seed=9)
    rw = evenflow.RouterWeight(w)
    cfg = ROUTE_SEQ[0][1]
    good = evenflow.route(x, rw, 4, config=cfg)
    rw.logits_buffer(5).fill_(float("nan"))
    bad = evenflow.route(x, rw, 4, config=cfg)
    assert torch.isnan(bad[1]).all() and not torch.isnan(good[1]).any()
    assert torch.count_nonzero(rw._logits).item() == 0
    _same_selection(evenflow.route(x, rw, 4, config=cfg), good, "after the poisoned call")


def test_route_logits_view_follows_a_resplit_to_a_new_expert_count(device):
    """``logits_buffer`` hands back its last view while M repeats (host time); a re-split to another N (auto_refresh
    after the source was resized in place) must not get the old N's view: the selection is the new weight's."""
    x, w = _inputs(3, 40, 256, device, seed=21)
    rw = evenflow.RouterWeight(w, auto_refresh=True)
    assert rw.logits_buffer(3) is rw.logits_buffer(3)  # the repeat is the same view
    evenflow.route(x, rw, 4)
    w2 = _inputs(1, 56, 256, device, seed=22)[1]
    with torch.no_grad():
        w.resize_(56, 256).copy_(w2)
    ids, weights = evenflow.route(x, rw, 4)
    assert rw.shape == (56, 256) and rw.logits_buffer(3).shape == (3, 56)
    want = R.route_ref(R.router_logits_fp64(x, w2), 4)
    assert torch.equal(ids.sort(-1).values, want[0].sort(-1).values)
    assert torch.count_nonzero(rw._logits).item() == 0


def test_route_checks_every_argument_before_its_gemm_launches(device, monkeypatch):
    import evenflow.router.gemm as G

    launched = []
    for name in ("_launch_split", "_launch_fp32", "_launch_fp32_splitk"):
        monkeypatch.setattr(G, name, lambda *a, name=name, **k: launched.append(name))
    x, w = _inputs(5, 40, 256, device, seed=2)
    rw = evenflow.RouterWeight(w)
    ids = torch.empty(5, 4, dtype=torch.int32, device=device)
    wts = torch.empty(5, 4, dtype=torch.float32, device=device)
    bad = [
        (dict(out=(ids, wts.double())), "out[1] (weights)"),
        (dict(out=(ids[:4], wts)), "out[0] (ids)"),
        (dict(out=(ids, ids.view(torch.float32))), "out[0] (ids)"),  # the two outputs share bytes
        (dict(out=ids), "pair"),
        (dict(pdl="yes"), "pdl"),
        (dict(renormalize=1), "renormalize"),
    ]
    for kw, name in bad:
        with pytest.raises((TypeError, ValueError), match=re.escape(name)):
            evenflow.route(x, rw, 4, config=ROUTE_SEQ[0][1], **kw)
    with pytest.raises(ValueError, match="x"):
        evenflow.route(x[0], rw, 4)
    assert launched == []


def test_route_zeroes_its_logits_when_the_topk_launch_fails(device, monkeypatch):
    import evenflow.router.topk as K

    x, w = _inputs(5, 40, 256, device, seed=4)
    rw = evenflow.RouterWeight(w)

    def fail(*a, **k):
        raise RuntimeError("top-k launch failed")

    monkeypatch.setattr(K, "_launch_topk", fail)
    with pytest.raises(RuntimeError, match="top-k launch failed"):
        evenflow.route(x, rw, 4, config=ROUTE_SEQ[0][1])
    assert torch.count_nonzero(rw._logits).item() == 0
    monkeypatch.undo()
    want = evenflow.select_experts(evenflow.router_gemm(x, rw, config=ROUTE_SEQ[0][1]), 4)
    _same_selection(evenflow.route(x, rw, 4, config=ROUTE_SEQ[0][1]), want, "after the failed call")


@pytest.mark.skipif(not _runtime.interpreting(), reason="records launches through the interpreter")
def test_route_topk_build_puts_a_barrier_between_its_loads_and_its_zeros():
    CC = pytest.importorskip("evenflow._compile_check")
    with CC.emulate_gpu(132), CC.record_launches() as launches:
        rw = evenflow.RouterWeight(torch.randn(128, 2048) * 0.02)
        evenflow.route(torch.zeros(16, 2048, dtype=torch.bfloat16), rw, 8,
                       config=GemmConfig(16, 32, 64, 32, 4, 6, "fp32-tc", "pdl-preload", "atomic"))
        evenflow.select_experts(torch.zeros(16, 128), 8)
    assert [la.name for la in launches] == ["router_gemm_kernel", "route_topk_kernel", "route_topk_kernel"]
    stats = CC.compile_stats(launches[1:])
    assert not [s["error"] for s in stats if "error" in s]
    clear, plain = sorted(stats, key=lambda s: "CLEAR_LOGITS=True" not in s["describe"])
    assert "CLEAR_LOGITS=True" in clear["describe"] and "CLEAR_LOGITS=False" in plain["describe"]
    for s in stats:
        assert s["spill_bytes"] == 0, s["describe"]
        mk = s["marks"]
        assert 0 <= mk["griddepcontrol.wait"] < mk["ld.global"], s["describe"]  # PDL: the loads after the wait
    ops = clear["sequence"]  # SASS opcodes in address order

    def where(seq, kind):
        return [i for i, op in enumerate(seq) if op.startswith(kind)]

    stores = where(ops, "STG")
    zeros = stores[len(where(plain["sequence"], "STG")):]  # the stores the clear adds: the build's last ones
    assert zeros, ops
    assert any(max(where(ops, "LDG")) < b < zeros[0] for b in where(ops, "BAR")), ops  # after every thread's loads


def test_a_captured_route_zeroes_first_and_ends_the_kept_zeros(device, monkeypatch):
    """A call captured in a CUDA graph launches the zeroing kernel and no clear (a graph's replays leave logits in the
    buffer), and every eager call of the weight after it zeroes first too (stood in for on the CPU by the capture
    test ``topk._capturing``)."""
    import evenflow.router.topk as K

    _, w = _inputs(1, 40, 256, device, seed=8)
    rw = evenflow.RouterWeight(w)
    calls = _zero_out_calls(monkeypatch)
    cfg = ROUTE_SEQ[0][1]
    x = _inputs(5, 40, 256, device, seed=80)[0]
    want = evenflow.select_experts(evenflow.router_gemm(x, rw, config=cfg), 4)
    calls.clear()
    evenflow.route(x, rw, 4, config=cfg)
    assert calls == [] and rw.zeros_kept
    monkeypatch.setattr(K, "_capturing", lambda dev: True)
    got = evenflow.route(x, rw, 4, config=cfg)
    assert calls == [(5, 40)] and not rw.zeros_kept
    assert torch.count_nonzero(rw._logits).item() > 0  # the logits stay: no clear
    _same_selection(got, want, "captured")
    monkeypatch.setattr(K, "_capturing", lambda dev: False)
    for step, (m, c) in enumerate(ROUTE_SEQ):
        x = _inputs(m, 40, 256, device, seed=90 + step)[0]
        calls.clear()
        got = evenflow.route(x, rw, 4, config=c)
        assert calls == _zeroings(m, c), c
        _same_selection(got, evenflow.select_experts(evenflow.router_gemm(x, rw, config=c), 4), f"after {c}")


@pytest.mark.gpu
def test_gpu_route_in_a_cuda_graph_and_eager_calls_after_it():
    k, n = SHAPES["qwen3-30b-a3b"]
    _, w = _inputs(1, n, k, "cuda", seed=6)
    rw = evenflow.RouterWeight(w)
    rw.reserve(64)
    cfgs = {16: GPU_CFGS[2], 9: GPU_CFGS[1], 12: GPU_CFGS[3], 4: GPU_CFGS[4], 64: None}
    xs = {m: torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for m in cfgs}
    outs = {m: (torch.empty(m, 8, dtype=torch.int32, device="cuda"), torch.empty(m, 8, device="cuda")) for m in cfgs}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m, c in cfgs.items():
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=m)[0])
            evenflow.route(xs[m], rw, 8, out=outs[m], config=c)
    torch.cuda.current_stream().wait_stream(s)
    assert rw.zeros_kept
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # five routes back to back through the one buffer
        for m, c in cfgs.items():
            evenflow.route(xs[m], rw, 8, out=outs[m], config=c)
    assert not rw.zeros_kept
    for step in range(6):
        for m in cfgs:
            xs[m].copy_(_inputs(m, n, k, "cuda", seed=200 + 7 * step + m)[0])
            outs[m][1].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for m, c in cfgs.items():
            want = evenflow.select_experts(evenflow.router_gemm(xs[m], rw, config=c), 8)
            _same_selection(outs[m], want, f"replay {step} M={m} {c}")
            got = evenflow.route(xs[m], rw, 8, config=c)  # eager, between replays: zeroes first
            _same_selection(got, want, f"eager after replay {step} M={m} {c}")
