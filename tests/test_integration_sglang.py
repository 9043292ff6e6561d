"""The SGLang attention backend (evenflow.integrations.sglang) driven as SGLang's model runner drives it, on SGLang's
own classes: its request-to-token pool, its MHA KV pool (which stores the K / V rows, bf16 or fp8), its ForwardBatch
and forward modes, its RadixAttention layer called in its forward context, its backend registry. A small scheduler
in the test plays the engine's part over several steps (prefills, a prompt in two chunks, MIXED batches of a chunk
beside decodes, decode steps, pages handed out in random order with page 0 kept as SGLang's padding page, stale
entries in the request-to-token rows past each request). Each step's output is checked under the tolerance rule
(evenflow.testing) against the fp64 oracle over the K / V rows the test kept for every request: the page table's
derivation from SGLang's slots, the lengths, the decode / extend paths and the plan all have to be right for it to
pass. (SGLang's import chain loads its multimodal configs, which import torchvision; where torchvision is not
installed, tests_support_engines.import_sglang serves it as an inert placeholder during that import only, and
likewise SGLang's CUDA kernel package on a GPU machine without it.)"""
import math
from types import SimpleNamespace

import pytest
import torch

from tests_support_engines import BF16, FP8, RowLog, import_sglang, step_oracle

if not import_sglang():
    pytest.skip("the SGLang adapter's tests need sglang (make test installs it)", allow_module_level=True)

from sglang.srt.configs.model_config import AttentionArch  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402

import evenflow  # noqa: E402
import evenflow.integrations.sglang as ev_sglang  # noqa: E402
from evenflow.testing import assert_within_rule  # noqa: E402


def sglang_quantised(x, scale, kv_dtype, device="cpu"):
    """The rows as SGLang's pool stores an fp8 cache: divided by a float32 scale tensor in the activations' dtype (in
    place, on the rows it is handed), then cast; done on the cache's device, as SGLang does it (BV3: with the rows
    rounded on the host, the fp8 cases missed the rule on an H100 by about one e4m3 step of V, 0.17 at v_scale 1/48,
    where a row attends to one key)."""
    if kv_dtype != FP8:
        return x
    t = x.to(device=device, dtype=BF16).clone()
    t.div_(torch.tensor(scale, dtype=torch.float32, device=device))
    return t.to(FP8).cpu()


class Engine(RowLog):
    """SGLang's bookkeeping for a few requests: a request-to-token row each (rows 1..; row 0 is SGLang's padding
    row), pages in random order from 1 (page 0, slots 0..P-1, is the pool's padding page), each layer's K / V rows
    of each request so far (the oracle's), and a ForwardBatch a step."""

    def __init__(self, hq, hkv, d, page, kv_dtype, device, num_pages=24, max_context=256, layers=2, seed=0,
                 k_scale=1.0, v_scale=1.0, scales_from="checkpoint", rows=8):
        super().__init__()
        self.page, self.device, self.hq, self.hkv, self.d = page, device, hq, hkv, d
        self.g = torch.Generator().manual_seed(seed)
        self.rtp = ReqToTokenPool(size=rows, max_context_len=max_context, device=device, enable_memory_saver=False)
        # stale slots in every row, as requests that held the row before left them
        self.rtp.req_to_token.copy_(torch.randint(0, num_pages * page, self.rtp.req_to_token.shape, generator=self.g))
        self.pool = MHATokenToKVPool(size=(num_pages - 1) * page, page_size=page, dtype=kv_dtype, head_num=hkv,
                                     head_dim=d, layer_num=layers, device=device, enable_memory_saver=False,
                                     enable_alt_stream=False)
        for buf in self.pool.k_buffer + self.pool.v_buffer:  # stale contents, as a reused pool has
            buf.copy_(torch.randn(buf.shape, generator=self.g).to(BF16).to(kv_dtype).view(buf.dtype))
        self.free = (torch.randperm(num_pages - 1, generator=self.g) + 1).tolist()
        self.layers = [RadixAttention(hq, d, 1 / math.sqrt(d) * 1.5, hkv, layer_id=i) for i in range(layers)]
        for layer in self.layers:
            if kv_dtype == FP8 and scales_from == "checkpoint":  # SGLang's kv-cache quant method: tensor and float
                layer.k_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
                layer.v_scale = torch.tensor(v_scale, dtype=torch.float32, device=device)
                layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
            elif kv_dtype == FP8:  # --quantization-param-path: plain floats in the tensors' attributes, no _float
                layer.k_scale, layer.v_scale = k_scale, v_scale
        self.k_scale, self.v_scale, self.kv_dtype = k_scale, v_scale, kv_dtype
        self.row: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}

    def runner(self, page=None):
        """What the backend reads of SGLang's ModelRunner."""
        return SimpleNamespace(
            model_config=SimpleNamespace(attention_arch=AttentionArch.MHA, is_encoder_decoder=False, dtype=BF16),
            token_to_kv_pool=self.pool, req_to_token_pool=self.rtp, page_size=page or self.page, device=self.device,
            sliding_window_size=None, model=torch.nn.ModuleList(self.layers))

    def step(self, sched, mode):
        """``sched``: [(request, new tokens)]. Allocates the new tokens' slots (whole pages), writes the request's
        row as SGLang's allocator does, and returns the step's ForwardBatch."""
        P, dev = self.page, self.device
        slots, lens, prefix, rows = [], [], [], []
        for r, n in sched:
            old = self.length(r)
            row = self.row.setdefault(r, len(self.row) + 1)
            pages = self.pages.setdefault(r, [])
            while len(pages) * P < old + n:
                pages.append(self.free.pop())
            new = [pages[p // P] * P + p % P for p in range(old, old + n)]
            self.rtp.req_to_token[row, old:old + n] = torch.tensor(new, dtype=torch.int32)
            slots += new
            lens.append(old + n)
            prefix.append(old)
            rows.append(row)
        ext = [n for _, n in sched]
        kw = {}
        if mode != ForwardMode.DECODE:
            kw = dict(extend_seq_lens=torch.tensor(ext, dtype=torch.int32, device=dev),
                      extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
                      extend_start_loc=torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist()[:-1], dtype=torch.int32,
                                                    device=dev),
                      extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=prefix, extend_num_tokens=sum(ext))
        return ForwardBatch(forward_mode=mode, batch_size=len(sched),
                            input_ids=torch.zeros(len(slots), dtype=torch.int64, device=dev),
                            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
                            seq_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
                            out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev), seq_lens_sum=sum(lens),
                            seq_lens_cpu=torch.tensor(lens, dtype=torch.int64), **kw)

    def expected(self, sched, q, layer):
        return step_oracle([self.kv[layer, r] for r, _ in sched], [n for _, n in sched], q, self.page, self.kv_dtype,
                           self.k_scale, self.v_scale, self.layers[layer].scaling,
                           store=lambda x, s, dt: sglang_quantised(x, s, dt, self.device))


# The steps of one run: (request, new tokens, forward mode). Request a's 37-token prompt comes in two chunks, the
# second in a MIXED batch beside b and c's decodes (SGLang's chunked prefill); then decode steps, and d's long
# prompt.
STEPS = [
    ([("a", 21), ("b", 9), ("c", 1)], ForwardMode.EXTEND),
    ([("b", 1), ("c", 1), ("a", 16)], ForwardMode.MIXED),
    ([("a", 1), ("b", 1), ("c", 1)], ForwardMode.DECODE),
    ([("d", 150)], ForwardMode.EXTEND),  # d runs past two of the plan's 64-token tiles
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], ForwardMode.DECODE),
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], ForwardMode.DECODE),
]


def run_steps(steps, hq, hkv, d, page, kv_dtype, device, seed=0, through_layer=True, plan_batch=None, **engine_kw):
    """The steps through the backend as SGLang's model runner drives it: one init_forward_metadata a step, then each
    layer called in SGLang's forward context (its own pool buffers and rows, the plan shared), every layer's output
    checked against the oracle and the pool checked unchanged outside the step's slots."""
    k_scale, v_scale = (1 / 32, 1 / 48) if kv_dtype == FP8 else (1.0, 1.0)
    eng = Engine(hq, hkv, d, page, kv_dtype, device, seed=seed, k_scale=k_scale, v_scale=v_scale, **engine_kw)
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    if plan_batch is not None:  # a plan smaller than the step's batches (as SGLang's request table can outgrow it)
        backend._plan_batch = plan_batch
    g = torch.Generator().manual_seed(seed + 1)
    plans = []
    for i, (sched, mode) in enumerate(steps):
        fb = eng.step(sched, mode)
        T = fb.out_cache_loc.shape[0]
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            backend.init_forward_metadata(fb)
            plan = backend.forward_metadata.plan
            plans.append(plan is not None)
            if plan is not None:  # the schedule of this step's lengths: a plan of the same build updated with them
                lens = torch.tensor([eng.length(r) for r, _ in sched], dtype=torch.int32, device=device)
                ref = evenflow.DecodePlan(plan.max_batch, plan.max_seq_len, hkv, page_size=page, device=device,
                                          kv_dtype=kv_dtype, num_q_heads=hq, head_dim=d,
                                          q_dtype=BF16).update(lens + 1)  # the rows are appended below
                assert all(torch.equal(a, b) for a, b in zip(plan.as_dict().values(), ref.as_dict().values()))
            for li, layer in enumerate(eng.layers):
                q = torch.randn(T, hq * d, generator=g).to(BF16).to(device)  # flat, as the model's projection gives
                k = (torch.randn(T, hkv * d, generator=g) * 2).to(BF16).to(device)
                v = torch.randn(T, hkv * d, generator=g).to(BF16).to(device)
                eng.append(sched, k.view(T, hkv, d), v.view(T, hkv, d), li)
                before = [b.clone() for b in (eng.pool.k_buffer[li], eng.pool.v_buffer[li])]
                out = layer(q, k, v, fb) if through_layer else backend.forward(q, k.view(T, hkv, d),
                                                                              v.view(T, hkv, d), layer, fb)
                assert out.shape == (T, hq * d)
                ref, base = eng.expected(sched, q.view(T, hq, d), li)
                assert_within_rule(out.view(T, hq, d).cpu(), ref, base, what=f"step {i} layer {li} {sched}")
                # the pool changed at this step's slots only
                for buf, old in zip((eng.pool.k_buffer[li], eng.pool.v_buffer[li]), before):
                    changed = set((buf != old).flatten(1).any(1).nonzero().flatten().tolist())
                    assert changed <= set(fb.out_cache_loc.tolist()), f"step {i}: a slot outside it changed"
    return eng, backend, plans


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (4, 4, 128, 32)], ids=["g4-d64-p16", "g1-d128-p32"])
def test_engine_steps(shape, kv, device):
    hq, hkv, d, page = shape
    kv_dtype = FP8 if kv == "fp8" else BF16
    eng, backend, plans = run_steps(STEPS, hq, hkv, d, page, kv_dtype, device)
    assert plans == [False, False, True, False, True, True]  # the decode steps on the plan, the rest on prefill
    assert backend.plan.num_q_heads == hq  # told from the model's RadixAttention layers
    # every request's rows sit at its pages' slots in SGLang's pool, in order (SGLang's radix cache and its other
    # backends read them there): bf16 bit for bit, fp8 as SGLang's store quantises them
    for (li, r), (kk, vv) in eng.kv.items():
        pos = torch.arange(kk.shape[0])
        slots = torch.tensor(eng.pages[r])[pos // page] * page + pos % page
        for buf, want, s in ((eng.pool.k_buffer[li], kk, eng.k_scale), (eng.pool.v_buffer[li], vv, eng.v_scale)):
            got = buf[slots.to(device)].cpu()
            assert torch.equal(got, sglang_quantised(want, s, kv_dtype, device).view(buf.dtype)), r


def test_direct_backend_calls(device):
    """The base class's forward (what RadixAttention ends in) called directly with [T, Hkv, D] K / V."""
    run_steps(STEPS[:4], 8, 2, 64, 16, BF16, device, through_layer=False)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_graph_protocol(kv, device):
    """SGLang's decode-graph protocol, as its runner calls it: init_cuda_graph_state, then for a padded batch of
    static buffers (padding rows: request row 0, length get_cuda_graph_seq_len_fill_value(), slot 0)
    init_forward_metadata_out_graph(in_capture=True) and init_forward_metadata_in_graph before the layers; a replay
    rewrites the static buffers in place and calls out_graph then the recorded in_graph part again. The real rows
    are the oracle's at both steps; the padding rows are finite."""
    kv_dtype = FP8 if kv == "fp8" else BF16
    hq, hkv, d, page = 8, 2, 64, 16
    ks, vs = (1 / 32, 1 / 48) if kv_dtype == FP8 else (1.0, 1.0)
    eng = Engine(hq, hkv, d, page, kv_dtype, device, layers=1, k_scale=ks, v_scale=vs)
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    backend.init_cuda_graph_state(max_bs=12, max_num_tokens=12)
    assert backend.plan.max_batch >= 12
    fill = backend.get_cuda_graph_seq_len_fill_value()
    g = torch.Generator().manual_seed(3)
    layer = eng.layers[0]
    for sched, mode in STEPS[:2]:  # prompts, eagerly
        fb = eng.step(sched, mode)
        backend.init_forward_metadata(fb)
        T = fb.out_cache_loc.shape[0]
        k, v = (torch.randn(T, hkv, d, generator=g).to(BF16).to(device) for _ in range(2))
        eng.append(sched, k, v, 0)
        backend.forward(torch.randn(T, hq * d, generator=g).to(BF16).to(device), k, v, layer, fb)
    bs, static = 6, None
    for step in range(2):  # capture, then a replay with other lengths
        sched = [("a", 1), ("b", 1), ("c", 1)] if step == 0 else [("c", 1), ("a", 1), ("b", 1)]
        fb = eng.step(sched, ForwardMode.DECODE)
        n = len(sched)
        if static is None:  # the runner's static buffers, padded to the graph's batch size
            static = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                                  input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
                                  req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=device),
                                  seq_lens=torch.full((bs,), fill, dtype=torch.int64, device=device),
                                  out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=device), seq_lens_sum=0)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(static, name)[:n].copy_(getattr(fb, name))
        backend.init_forward_metadata_out_graph(static, in_capture=step == 0)
        backend.init_forward_metadata_in_graph(static)
        q = torch.randn(bs, hq * d, generator=g).to(BF16).to(device)
        k, v = (torch.randn(bs, hkv, d, generator=g).to(BF16).to(device) for _ in range(2))
        eng.append(sched, k[:n], v[:n], 0)
        out = backend.forward(q, k, v, layer, static)
        ref, base = eng.expected(sched, q[:n].view(n, hq, d), 0)
        assert_within_rule(out[:n].view(n, hq, d).cpu(), ref, base, what=f"graph step {step}")
        assert torch.isfinite(out[n:].float()).all()


def test_plan_bound(device):
    """SGLang's request table is often larger than a plan's bound (MAX_BATCH): the plan is sized to the bound, graphs
    beyond it are refused naming the flag, and an eager decode of more requests than the plan holds runs the static
    schedule, within the rule like the rest."""
    eng = Engine(8, 2, 64, 16, BF16, "cpu", rows=ev_sglang.MAX_BATCH + 50, max_context=64)
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    assert backend._plan_batch == ev_sglang.MAX_BATCH
    with pytest.raises(NotImplementedError, match="--cuda-graph-max-bs"):
        backend.init_cuda_graph_state(max_bs=ev_sglang.MAX_BATCH + 1, max_num_tokens=ev_sglang.MAX_BATCH + 1)
    _, _, plans = run_steps(STEPS[:3], 8, 2, 64, 16, BF16, device, plan_batch=2)
    assert plans == [False, False, False]  # the 3-request decode step on the static schedule


def test_scales_from_a_param_path(device):
    """--quantization-param-path sets a layer's k_scale / v_scale as plain floats and no k_scale_float: the backend
    reads the scales SGLang's store divided by."""
    run_steps(STEPS[:3], 8, 2, 64, 16, FP8, device, scales_from="param_path")


def test_prefill_graph_modes(monkeypatch):
    """SGLang's breakable prefill graphs (attention eager between segments) are taken; whole prefill graphs, which
    would replay the extend metadata of their capture, are declined step by step (the step runs eagerly)."""
    eng = Engine(8, 2, 64, 16, BF16, "cpu")
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    fb = eng.step([("a", 5)], ForwardMode.EXTEND)
    assert backend.can_run_prefill_cuda_graph(fb)  # no published config: not a whole-graph prefill
    monkeypatch.setattr(ev_sglang, "_full_prefill_graphs", lambda: True)
    assert not backend.can_run_prefill_cuda_graph(fb)


def test_registration():
    """register() adds the backend to SGLang's registry and its --attention-backend choices; SGLang's own
    factory builds it for a model runner."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        _build_full_attention_backend_from_str,
    )

    ev_sglang.register()
    ev_sglang.register()  # idempotent
    assert ATTENTION_BACKENDS["evenflow"] is ev_sglang.EvenflowSGLangBackend
    assert ATTENTION_BACKEND_CHOICES.count("evenflow") == 1
    eng = Engine(8, 2, 64, 16, BF16, "cpu")
    backend = _build_full_attention_backend_from_str(model_runner=eng.runner(), backend_str="evenflow",
                                                     init_new_workspace=False)
    assert isinstance(backend, ev_sglang.EvenflowSGLangBackend)
    # SGLang's command line takes the name (its launcher loads the plugins before it parses)
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "evenflow", "--page-size", "64",
                              "--decode-attention-backend", "evenflow"])
    assert (args.attention_backend, args.decode_attention_backend, args.page_size) == ("evenflow", "evenflow", 64)


def test_plugin_entry_point():
    """SGLang's plugin loader finds evenflow's entry point in the package's metadata."""
    import importlib.metadata

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    try:
        importlib.metadata.distribution("evenflow")
    except importlib.metadata.PackageNotFoundError:  # sources on PYTHONPATH (the GPU machine): no package metadata
        pytest.skip("evenflow is not installed as a package here (make env installs it): no entry points to find")
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert plugins["evenflow"][0] is ev_sglang.register


def _refusal(match, **changes):
    eng = Engine(8, 2, 64, 16, BF16, "cpu")
    runner = eng.runner()
    for k, v in changes.items():
        setattr(runner, k, v)
    with pytest.raises(NotImplementedError, match=match):
        ev_sglang.EvenflowSGLangBackend(runner)


def test_refusals(monkeypatch):
    _refusal("page size 1", page_size=1)
    _refusal("page size 64.0", page_size=64.0)  # (round CL: passed, then failed slicing with a TypeError)
    _refusal("MLA", model_config=SimpleNamespace(attention_arch=AttentionArch.MLA, is_encoder_decoder=False))
    _refusal("sliding-window", sliding_window_size=128)
    _refusal("float16 models", model_config=SimpleNamespace(attention_arch=AttentionArch.MHA, is_encoder_decoder=False,
                                                           dtype=torch.float16))
    _refusal("KV pool", token_to_kv_pool=object())
    pool = MHATokenToKVPool(size=64, page_size=16, dtype=torch.float8_e5m2, head_num=2, head_dim=64, layer_num=1,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    _refusal("float8_e5m2", token_to_kv_pool=pool)
    eng = Engine(8, 2, 64, 16, BF16, "cpu")
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    fb = eng.step([("a", 5)], ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    q, k, v = torch.zeros(5, 8 * 64, dtype=BF16), torch.zeros(5, 2, 64, dtype=BF16), torch.zeros(5, 2, 64, dtype=BF16)
    for attr, value, match in (("sliding_window_size", 64, "sliding window"), ("logit_cap", 30.0, "logit capping"),
                               ("is_cross_attention", True, "attention type"),
                               ("xai_temperature_len", 1024, "xAI attention temperature")):
        layer = RadixAttention(8, 64, 0.125, 2, layer_id=0)
        setattr(layer, attr, value)
        with pytest.raises(NotImplementedError, match=match):
            backend.forward(q, k, v, layer, fb)
    with pytest.raises(NotImplementedError, match="sinks"):
        backend.forward(q, k, v, eng.layers[0], fb, sinks=torch.zeros(8))
    verify = eng.step([("a", 2)], ForwardMode.TARGET_VERIFY)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(verify)
    with monkeypatch.context() as mp:
        mp.setattr(ev_sglang, "_dcp_size", lambda: 2)
        _refusal("decode context parallelism")
    fresh = ev_sglang.EvenflowSGLangBackend(eng.runner())
    with pytest.raises(RuntimeError, match="before a decode step"):
        fresh.forward_decode(q[:1], k[:1], v[:1], eng.layers[0], eng.step([("a", 1)], ForwardMode.DECODE))


@pytest.mark.parametrize("layer_kw, match", [
    (dict(num_kv_heads=4, layer_id=1), "tp_k_head_num 4 differs from the KV pool's head_num 2"),
    (dict(num_kv_heads=0, layer_id=1), "tp_k_head_num must be a positive int"),
    (dict(num_kv_heads=2, layer_id=-1), "layer_id -1 is outside the KV pool's layers"),
    (dict(num_kv_heads=2, layer_id=2), "layer_id 2 is outside the KV pool's layers"),
], ids=["kv-heads-unlike-pool", "zero-kv-heads", "negative-layer-id", "layer-id-past-pool"])
def test_layer_must_fit_pool(layer_kw, match):
    """A layer unlike SGLang's pool is refused by name at its call, before anything is stored or read: kv heads the
    pool does not hold (the kernels would attend over the pool's heads, another GQA grouping than the model's, where
    the call stores nothing), none at all, or a layer_id outside the pool (-1 would index the last layer's buffers
    and overwrite them)."""
    eng = Engine(8, 2, 64, 16, BF16, "cpu", layers=2)
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    fb = eng.step([("a", 5)], ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    layer = RadixAttention(8, 64, 0.125, **layer_kw)
    hkv = max(layer_kw["num_kv_heads"], 1)
    q = torch.randn(5, 8 * 64).to(BF16)
    k, v = torch.randn(5, hkv, 64).to(BF16), torch.randn(5, hkv, 64).to(BF16)
    before = [b.clone() for b in eng.pool.k_buffer + eng.pool.v_buffer]
    for save in (False, True):
        with pytest.raises(ValueError, match=match):
            backend.forward(q, k, v, layer, fb, save_kv_cache=save)
    assert all(torch.equal(b, old) for b, old in zip(eng.pool.k_buffer + eng.pool.v_buffer, before))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_steps_qwen3_dims(kv, device):
    """Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128) at page 64: a 2000-token prompt in two chunks beside
    short requests, then decode steps: the plan and the kernels the GPU picks, through SGLang's pool and layer."""
    steps = [([("s1", 3), ("s2", 200), ("long", 1200)], ForwardMode.EXTEND),
             ([("s1", 1), ("s2", 1), ("long", 800)], ForwardMode.MIXED),
             ([("long", 1), ("s1", 1), ("s2", 1)], ForwardMode.DECODE),
             ([("long", 1), ("s1", 1), ("s2", 1), ("s3", 700)], ForwardMode.MIXED),
             ([("long", 1), ("s1", 1), ("s2", 1), ("s3", 1)], ForwardMode.DECODE)]
    _, _, plans = run_steps(steps, 32, 4, 128, 64, FP8 if kv == "fp8" else BF16, device, num_pages=80,
                            max_context=4096)
    assert plans == [False, False, True, False, True]


@pytest.mark.gpu
def test_decode_graph_capture_replay(device):
    """A real CUDA graph, captured and replayed as SGLang's decode runner does: the in-graph metadata part (page
    table, plan update) and two layers recorded once, replayed after the static buffers take the next step's batch;
    each replay is the oracle's within the rule."""
    hq, hkv, d, page = 32, 4, 128, 64
    eng = Engine(hq, hkv, d, page, BF16, device, num_pages=80, max_context=4096)
    backend = ev_sglang.EvenflowSGLangBackend(eng.runner())
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    g = torch.Generator().manual_seed(5)
    prompts = [("a", 1500), ("b", 90), ("c", 700)]
    fb = eng.step(prompts, ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    T = fb.out_cache_loc.shape[0]
    for li, layer in enumerate(eng.layers):
        k, v = (torch.randn(T, hkv, d, generator=g).to(BF16).to(device) for _ in range(2))
        eng.append(prompts, k, v, li)
        backend.forward(torch.randn(T, hq * d, generator=g).to(BF16).to(device), k, v, layer, fb)
    bs, fill = 4, backend.get_cuda_graph_seq_len_fill_value()
    static = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                          input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
                          req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=device),
                          seq_lens=torch.full((bs,), fill, dtype=torch.int64, device=device),
                          out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=device), seq_lens_sum=0)
    q = torch.zeros(bs, hq * d, dtype=BF16, device=device)
    kv = [(torch.zeros(bs, hkv, d, dtype=BF16, device=device), torch.zeros(bs, hkv, d, dtype=BF16, device=device))
          for _ in eng.layers]
    sched = [("a", 1), ("b", 1), ("c", 1)]

    def load(step_fb):
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(static, name)[:3].copy_(getattr(step_fb, name))
        q.copy_(torch.randn(bs, hq * d, generator=g).to(BF16))
        for li, (k, v) in enumerate(kv):
            k.copy_(torch.randn(bs, hkv, d, generator=g).to(BF16))
            v.copy_(torch.randn(bs, hkv, d, generator=g).to(BF16))
            eng.append(sched, k[:3], v[:3], li)

    load(eng.step(sched, ForwardMode.DECODE))
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    backend.init_forward_metadata_in_graph(static)  # SGLang's warm-up pass before capture (compiles the kernels)
    for layer, (k, v) in zip(eng.layers, kv):
        backend.forward(q, k, v, layer, static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(static)
        outs = [backend.forward(q, k, v, layer, static) for layer, (k, v) in zip(eng.layers, kv)]
    for step in range(3):
        if step:
            load(eng.step(sched, ForwardMode.DECODE))
            backend.init_forward_metadata_out_graph(static)
        graph.replay()
        for li, out in enumerate(outs):
            ref, base = eng.expected(sched, q[:3].view(3, hq, d), li)
            assert_within_rule(out[:3].view(3, hq, d).cpu(), ref, base, what=f"replay {step} layer {li}")
