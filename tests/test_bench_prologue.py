"""The prologue benchmark's pieces on the CPU: its points, its floor's bytes, its check, and the unfused PyTorch
peer it times us against (the peer must compute the same prologue, or the speed-ups compare different work)."""
import pytest
import torch

from evenflow.bench import harness as H
from tests_support_bench import load_script

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def bench():
    mod = load_script("prologue")
    return mod


def test_layout_is_decode_then_prefill_chunks(bench):
    g = torch.Generator().manual_seed(0)
    new, prefix = bench.layout(64, g)
    assert new == [1] * 64 and all(1024 <= p < 4096 for p in prefix)
    new, prefix = bench.layout(1300, g)
    assert new == [512, 512, 276] and len(prefix) == 3 and all(0 <= p < 2048 for p in prefix)


def test_call_bytes_counts_each_tensor_once(bench):
    hq, hkv, d, t = 32, 4, 128, 10
    qkv, q, kv, rows = t * 40 * 128 * 2, t * 32 * 128 * 2, 2 * t * 4 * 128 * 2, t * (128 * 4 + 8)
    assert bench.call_bytes(hq, hkv, d, t, torch.bfloat16, torch.bfloat16) == qkv + q + kv + rows
    q8 = t * 32 * 128 + t * 32 * 4  # e4m3 values and their fp32 scales
    assert bench.call_bytes(hq, hkv, d, t, FP8, FP8) == qkv + q8 + kv // 2 + rows
    # requests sharing positions read each rotary row once
    assert bench.call_bytes(hq, hkv, d, t, torch.bfloat16, torch.bfloat16, 3) == qkv + q + kv + t * 8 + 3 * 128 * 4


@pytest.mark.parametrize("variant", ["bf16", "fp8-kv", "fp8-q-kv"])
def test_ours_and_the_unfused_peer_pass_the_check_and_agree(bench, variant, device):
    """On a Qwen3 decode step of 4 tokens: ours and the peer each pass the benchmark's check against the fp64
    oracle, write the same slots, and their q and cache values agree to the bf16 roundings the peer adds (it
    rounds after the norm and after each rotation term, as transformers does)."""
    pt = bench.build("qwen3-30b-a3b", 4, variant, device=device, copies=2)
    ours = bench.calls("evenflow", pt)
    assert len(ours) == 2
    out = ours[0]()
    bench.check(pt, out)
    k_ours, v_ours = pt["k_cache"].clone(), pt["v_cache"].clone()
    pt["k_cache"].zero_()
    pt["v_cache"].zero_()
    theirs = bench.calls("torch-unfused", pt)[0]()
    bench.check(pt, theirs)
    written = pt["k_cache"].float().abs().sum(-1).sum(-1) > 0
    assert int(written.sum()) == 4
    # a few bf16 roundings apart (the peer's; relative to each head's largest value), or one e4m3 step for fp8
    a, b = k_ours[written].float(), pt["k_cache"][written].float()
    tol = 2 ** -3 if variant != "bf16" else 2 ** -5
    assert ((a - b).abs() <= tol * torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True)).all()
    scale = (lambda o: o[1][..., None].double()) if variant == "fp8-q-kv" else (lambda o: 1.0)
    q_ours, q_theirs = out[0].double() * scale(out), theirs[0].double() * scale(theirs)
    q_tol = 2 ** -3 if variant == "fp8-q-kv" else 2 ** -5  # one e4m3 step at the head's largest value
    assert ((q_ours - q_theirs).abs() <= q_tol * q_ours.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(pt["v_cache"][written].view(torch.uint8), v_ours[written].view(torch.uint8))


def test_check_catches_a_wrong_cache(bench, device):
    pt = bench.build("qwen3-30b-a3b", 4, "bf16", device=device, copies=1)
    out = bench.calls("evenflow", pt)[0]()
    slot = bench.peer.slots(pt["positions"], pt["page_table"], pt["cu_seqlens_q"], bench.PAGE)
    pt["k_cache"].view(-1, 4, 128)[slot[1]] *= -1
    with pytest.raises(AssertionError, match="k_cache"):
        bench.check(pt, out)


def test_speedups_compare_the_same_point(bench):
    res = H.Results("prologue", ceilings={"copy_TBps": 4.0})
    for impl, us in (("evenflow", 2.0), ("torch-unfused", 10.0), ("torch-compile", 5.0)):
        res.add(case="qwen3-30b-a3b", variant="bf16", impl=impl, us=us, T=64)
    res.add(case="qwen3-30b-a3b", variant="bf16", impl="torch-unfused", us=99.0, T=8)
    bench._speedups(res)
    assert res.rows[0]["vs_unfused"] == 5.0 and res.rows[0]["vs_compile"] == 2.5


def test_option_lists_are_checked_by_name():
    known = {"a": 1, "b": 2}
    assert H.choices("--cases", None, known, ("b",)) == ("b",)
    assert H.choices("--cases", "a,b", known, known) == ("a", "b")
    with pytest.raises(SystemExit, match=r"--cases: unknown \['c'\] \(choose from a, b\)"):
        H.choices("--cases", "a,c", known, known)


def test_the_compiled_peer_builds_at_more_points_than_dynamos_recompile_limit(bench, monkeypatch):
    """Round BY's first run (an H100): every torch-compile row after the eighth point failed with Dynamo's recompile
    limit (one step function, a new shape a point). Each point now starts from a fresh Dynamo cache. Here the limit
    is 1 and the backend one that counts the graphs Dynamo builds and runs them as they are (no C++ build on the
    CPU): two points of different shapes must
    both build, and the second call of a point must not build again."""
    import torch._dynamo

    frames = []

    def backend(gm, _):  # one backend object: Dynamo builds again for a new one
        frames.append(gm)
        return gm

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    # (Dynamo's own patch: monkeypatch's undo deletes a config entry, which broke the next test that compiles)
    with torch._dynamo.config.patch(recompile_limit=1):
        for t in (3, 5):
            pt = bench.build("qwen3-30b-a3b", t, "bf16", device="cpu", copies=2)
            for call in bench.calls("torch-compile", pt):
                call()
    assert len(frames) == 2  # one build a point, the second copy of a point reusing it

