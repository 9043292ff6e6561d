"""The end-to-end transformers benchmark's pieces on the CPU, on a small Qwen3-MoE: every impl form it times runs a
decode step (its cache cropped back each call) and a prefill, and agrees with transformers' default forward."""
import pytest
import torch

from evenflow.bench import harness as H
from tests_support_bench import load_script

pytest.importorskip("transformers", minversion="5.24")
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def bench():
    mod = load_script("e2e_transformers")
    return mod


def test_every_impl_runs_a_step_and_agrees(bench, device):
    import copy

    base = bench.build_model(2, device=device, **SMALL)
    outs = {}
    for impl in ("transformers-eager", "evenflow-experts", "evenflow"):
        model = copy.deepcopy(base)
        bench.set_impl(model, impl)
        step = bench.decode_step(model, 3, 10, 96)
        first = step()
        again = step()  # the cache was cropped back: the same step, the same logits
        assert torch.equal(first, again)
        outs[impl] = (first.float(), bench.prefill(model, 2, 7, 96)().float())
    for impl in ("evenflow-experts", "evenflow"):
        for got, want in zip(outs[impl], outs["transformers-eager"]):
            H.check_output(got, want, impl, rtol=5e-2, atol=5e-2, min_cos=0.999)
    with pytest.raises(ValueError, match="impl must be one of"):
        bench.set_impl(copy.deepcopy(base), "vllm")


def test_speedups_against_the_default(bench):
    res = H.Results("e2e_transformers", ceilings=None)
    for impl, us, gpu in (("transformers-grouped_mm", 300.0, 120.0), ("evenflow", 200.0, 40.0)):
        res.add(case="decode-b8", impl=impl, us=us, gpu_us=gpu)
    res.add(case="decode-b8", impl="transformers-eager", us=600.0)  # no device time: no ratio of it
    bench._speedups(res)
    assert res.rows[1]["vs_default"] == 1.5 and res.rows[0]["vs_default"] == 1.0
    assert res.rows[1]["gpu_vs_default"] == 3.0 and "gpu_vs_default" not in res.rows[2]


def test_generate_impls_run_and_agree(bench, device):
    """Every generate impl form runs ``generate`` over a left-padded mix (head_dim 64: the paged kernels' smallest)
    and its first step's logits agree with the stock model's; a mix string is parsed or refused by name."""
    import copy

    base = bench.build_model(2, device=device, **{**SMALL, "head_dim": 64})
    lens = bench.parse_mix("1x9+2x3")
    assert lens == [9, 3, 3]
    ref = None
    for impl in bench.GEN_IMPLS:
        model = copy.deepcopy(base)
        bench.set_gen_impl(model, impl)
        run = bench.generate_case(model, impl, lens, 96, page_size=16)
        first = run(1).float()
        assert first.shape == (3, 96)
        if ref is None:
            ref = first
        H.check_output(first, ref, impl, rtol=5e-2, atol=5e-2, min_cos=0.999)
        if impl in ("evenflow-unfused", "evenflow"):
            again = run(3).float()  # the paged cache is reset each call: the same first step
            assert torch.equal(again, first)
            # its pool: each request's real tokens and the new ones in 16-token pages, plus the spare page
            pages = sum(-(-(n + bench.NEW + 1) // 16) for n in lens) + 1
            assert run.kv_bytes == 2 * 2 * pages * 16 * 2 * 64 * 2  # layers x (K, V) x tokens x kv heads x D x 2 B
        else:
            assert run.kv_bytes == 3 * (9 + bench.NEW) * 2 * 2 * 64 * 2 * 2  # the padded rectangle
    with pytest.raises(ValueError, match="expected parts like 1x4096"):
        bench.parse_mix("4096")
    with pytest.raises(ValueError, match="impl must be one of"):
        bench.set_gen_impl(copy.deepcopy(base), "vllm")


def test_generate_rows_one_per_impl_and_errors_as_rows(bench, device, monkeypatch):
    """``_generate_rows`` with the timers replaced (they need CUDA): one row per generate impl, its decode step
    (t(1 + NEW) - t(1)) / NEW from the two timings, the same of the two device times, and its KV size; an impl that
    fails is an error row and the others still run."""
    base = bench.build_model(2, device=device, **{**SMALL, "head_dim": 64})
    times = iter([100.0, 100.0 + 5 * bench.NEW] * len(bench.GEN_IMPLS))
    gpu_times = iter([40.0, 40.0 + 2 * bench.NEW] * 2 * len(bench.GEN_IMPLS))

    def fake_time(fn, reps, warmup):
        fn()
        return next(times)

    def fake_kernel_times(fn, reps, warmup):
        fn()
        return [], next(gpu_times)

    monkeypatch.setattr(bench.H, "time_eager", fake_time)
    monkeypatch.setattr(bench.H, "kernel_times", fake_kernel_times)
    monkeypatch.setattr(bench, "generate_case", lambda model, impl, lens, vocab, real=bench.generate_case:
                        real(model, impl, lens, vocab, page_size=16))
    res = H.Results("e2e_transformers", ceilings=None)
    bench._generate_rows(res, base, "1x6+2x2", 96, 2)
    assert [r["impl"] for r in res.rows] == list(bench.GEN_IMPLS)
    for r in res.rows:
        assert r["us"] == 5.0 and r["us_per_layer"] == 2.5 and r["gpu_us"] == 2.0 and r["kv_mb"] > 0 \
            and r["cosine"] >= 0.999, r
    real_set = bench.set_gen_impl

    def broken(model, impl):
        if impl == "evenflow-moe":
            raise RuntimeError("no such kernel")
        real_set(model, impl)

    monkeypatch.setattr(bench, "set_gen_impl", broken)
    times = iter([100.0, 100.0 + 5 * bench.NEW] * len(bench.GEN_IMPLS))
    res = H.Results("e2e_transformers", ceilings=None)
    bench._generate_rows(res, base, "1x6+2x2", 96, 2)
    errs = [r for r in res.rows if "error" in r]
    assert [r["impl"] for r in errs] == ["evenflow-moe"] and "no such kernel" in errs[0]["error"]
    assert sum("us" in r for r in res.rows) == len(bench.GEN_IMPLS) - 1
