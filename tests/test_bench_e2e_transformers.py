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


def _whole_sequence_logits(model, lens, vocab, nxt):
    """The stock model's last-position logits over each prompt and its next token read whole (no cache), at
    generate's positions: what a decode step after the prefill must give."""
    from evenflow.integrations.demo import left_padded

    ids, mask = left_padded(lens, vocab, nxt.device, seed=3)
    seq, mask = torch.cat([ids, nxt], 1), torch.cat([mask, mask.new_ones(len(lens), 1)], 1)
    pos = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    with torch.no_grad():
        return model(seq, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -1]


def test_graph_step_is_a_steady_decode_step(bench, device):
    """Each graph impl's step (the one a CUDA graph captures) is a decode step of the mix after its prefill: its
    logits agree with the stock model reading each prompt and the next token whole, and every call leaves the cache's
    lengths where the prefill left them (StaticCache: each layer's device length; PagedCache: the requests' lengths
    and its position count), so two calls give the same logits (the GPU test replays it in a graph)."""
    import copy

    base = bench.build_model(2, device=device, **{**SMALL, "head_dim": 64})
    lens = bench.parse_mix("1x9+2x3+1x1")
    g = torch.Generator().manual_seed(4)  # (graph_step's next tokens)
    nxt = torch.randint(1, 96, (len(lens), 1), generator=g).to(device)
    want = _whole_sequence_logits(base, lens, 96, nxt).float()
    for impl in bench.GRAPH_IMPLS:
        model = copy.deepcopy(base)
        bench.set_gen_impl(model, impl)
        step = bench.graph_step(model, impl, lens, 96, page_size=16)
        first = step()
        assert first.shape == (len(lens), 1, 96)
        H.check_output(first[:, 0].float(), want, impl, rtol=5e-2, atol=5e-2, min_cos=0.999)
        assert torch.equal(step(), first), impl
        cache = step.cache
        if impl in bench.PAGED_IMPLS:
            assert cache.seq_lens.tolist() == lens and cache.seen == max(lens), impl
            pages = sum(-(-(n + 1) // 16) for n in lens) + 1  # each request's tokens and the next one, the spare
            assert bench.cache_bytes(cache) == 2 * 2 * pages * 16 * 2 * 64 * 2
        else:
            assert [int(layer.cumulative_length) for layer in cache.layers] == [max(lens)] * 2, impl
            assert bench.cache_bytes(cache) == 2 * 2 * len(lens) * (max(lens) + 1) * 2 * 64 * 2  # the padded rectangle
    with pytest.raises(ValueError, match="impl must be one of"):
        bench.graph_step(copy.deepcopy(base), "transformers-sdpa", lens, 96)


def test_experts_hit_counts_each_routers_distinct_picks(bench, device):
    """``experts_hit`` gives, per MoE layer, the number of distinct experts in the top-k of the router's softmax over
    the tokens it saw (recomputed here from each router's input and weight)."""
    import copy

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    base = bench.build_model(2, device=device, **{**SMALL, "head_dim": 64})
    model = copy.deepcopy(base)
    step = bench.graph_step(model, "transformers-sdpa-static", bench.parse_mix("1x9+3x3"), 96, page_size=16)
    seen = []
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    hooks = [r.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].detach().clone())))
             for r in routers]
    got = bench.experts_hit(model, step)
    for h in hooks:
        h.remove()
    assert len(got) == 2 and len(seen) == 2
    want = [int(torch.topk(torch.softmax(x.float() @ r.weight.float().T, -1), r.top_k, -1).indices.unique().numel())
            for r, x in seen]
    assert got == want and all(2 <= n <= 8 for n in got)  # 4 tokens x top-2 over 8 experts
    with pytest.raises(TypeError, match="no Qwen3MoeTopKRouter"):
        bench.experts_hit(torch.nn.Linear(2, 2), lambda: None)


def test_step_floor_bytes_from_the_models_own_tensors(bench, device):
    """The step's floor bytes equal the model's own parameters a decode step reads (every layer's attention, norms
    and router, the experts hit: each a 1/E share of the experts' tensors; the final norm and the vocabulary
    projection; not the embedding table, of which a step reads a row a request), plus K and V of every real cached
    token and of the new ones (written and read), all bf16."""
    base = bench.build_model(3, device=device, **{**SMALL, "head_dim": 64})
    cfg, lens, hit = base.config, [9, 3, 3], [5, 8, 1]
    want = 0
    for layer, n in zip(base.model.layers, hit):
        want += sum(p.numel() for name, p in layer.named_parameters() if "experts" not in name)
        want += sum(p.numel() for p in layer.mlp.experts.parameters()) * n // cfg.num_experts
        want += 2 * cfg.num_key_value_heads * cfg.head_dim * (sum(lens) + 2 * len(lens))
    want += base.model.norm.weight.numel() + base.lm_head.weight.numel()
    assert bench.step_floor_bytes(cfg, lens, hit) == 2 * want
    with pytest.raises(ValueError, match="hit: 2 layers' counts for a 3-layer model"):
        bench.step_floor_bytes(cfg, lens, hit[:2])


def test_graph_rows_with_the_steps_floor(bench, device, monkeypatch):
    """``_graph_rows`` with the graph timer replaced (it needs CUDA): one row per graph impl, each with the case's
    floor (counted on the stock impl's step) and its fraction, ``vs_default`` against the StaticCache row; an impl
    that fails is an error row; with the stock impl failing before its count, no floor on any row."""
    import copy

    base = bench.build_model(2, device=device, **{**SMALL, "head_dim": 64})
    ceilings = {"copy_TBps": 2.0}
    stock = copy.deepcopy(base)  # the floor is the stock step's: its experts, at the run's copy rate
    lens = bench.parse_mix("1x6+2x2")
    hit = bench.experts_hit(stock, bench.graph_step(stock, "transformers-sdpa-static", lens, 96, page_size=16))
    floor = round(float(H.floor_us(bench.step_floor_bytes(stock.config, lens, hit), ceilings=ceilings)), 3)
    times = {"transformers-sdpa-static": 400.0, "evenflow-moe": 300.0, "evenflow-unfused": 250.0, "evenflow": 200.0}
    current = {}
    real_set = bench.set_gen_impl

    def set_impl(model, impl):
        current["impl"] = impl
        real_set(model, impl)

    def fake_time_graph(fn, reps, min_calls):
        fn()
        return times[current["impl"]]

    monkeypatch.setattr(bench, "set_gen_impl", set_impl)
    monkeypatch.setattr(bench.H, "time_graph", fake_time_graph)
    monkeypatch.setattr(bench, "graph_step", lambda model, impl, lens, vocab, real=bench.graph_step:
                        real(model, impl, lens, vocab, page_size=16))
    res = H.Results("e2e_transformers", ceilings=ceilings)
    bench._graph_rows(res, base, "1x6+2x2", 96, 2)
    bench._speedups(res)
    assert [r["impl"] for r in res.rows] == list(bench.GRAPH_IMPLS)
    floors = {r["floor_us"] for r in res.rows}
    assert floors == {floor} and floor > 0
    for r in res.rows:
        assert r["case"] == "graph-1x6+2x2" and r["us"] == times[r["impl"]] and r["us_per_layer"] == r["us"] / 2
        assert r["frac_of_floor"] == round(floor / r["us"], 4) and r["cosine"] >= 0.999
        assert r["vs_default"] == round(400.0 / r["us"], 3)

    def broken(model, impl):
        if impl == "transformers-sdpa-static":
            raise RuntimeError("no static cache")
        set_impl(model, impl)

    monkeypatch.setattr(bench, "set_gen_impl", broken)
    res = H.Results("e2e_transformers", ceilings=ceilings)
    bench._graph_rows(res, base, "1x6+2x2", 96, 2)
    assert [r["impl"] for r in res.rows if "error" in r] == ["transformers-sdpa-static"]
    assert sum("us" in r for r in res.rows) == 3 and not any("floor_us" in r for r in res.rows)


@pytest.mark.gpu
def test_graph_step_replays_in_a_cuda_graph(bench):
    """On a GPU, each graph impl's step captured in a CUDA graph (after one call, as ``harness.time_graph`` captures
    it) replays as a decode step: the replayed logits agree with the stock model reading the sequences whole, and
    three replays leave the cache's lengths where the prefill left them; at Qwen3-30B-A3B's attention dimensions (32
    q / 4 kv heads of 128) and a mix whose requests end inside a page, on a page's last slot and on a page boundary."""
    import copy

    dims = dict(SMALL, hidden_size=256, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=16,
                num_experts_per_tok=4)
    base = bench.build_model(2, device="cuda", **dims)
    lens = [200, 63, 64, 1]
    nxt = torch.randint(1, 96, (len(lens), 1), generator=torch.Generator().manual_seed(4)).cuda()
    want = _whole_sequence_logits(base, lens, 96, nxt).float()
    for impl in bench.GRAPH_IMPLS:
        model = copy.deepcopy(base)
        bench.set_gen_impl(model, impl)
        step = bench.graph_step(model, impl, lens, 96)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a call before the capture, as harness.capture_graph makes (builds, pages)
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()  # (holds nothing computed until a replay)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        H.check_output(out[:, 0].float(), want, impl, rtol=5e-2, atol=5e-2, min_cos=0.999)
        cache = step.cache
        if impl in bench.PAGED_IMPLS:  # (the device lengths: a replay runs no host code)
            assert cache.seq_lens.tolist() == lens, impl
        else:
            assert [int(layer.cumulative_length) for layer in cache.layers] == [max(lens)] * 2, impl
