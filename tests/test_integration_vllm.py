"""The vLLM attention backend (evenflow.integrations.vllm) driven as vLLM's v1 engine drives it, with vLLM's own
classes: its config, KV cache spec and layout descriptor, CommonAttentionMetadata, its decode / prefill split and its
backend registry. A small scheduler in the test plays the engine's part over several steps (chunked prefill, decodes
beside prefills, a one-token extend counted as a decode, uniform multi-row decodes as a speculative verification
sends them, blocks handed out in random order with block 0 held back as vLLM's null block, a captured batch's
padding rows). Each step's output is checked under the tolerance rule (evenflow.testing) against the fp64 oracle
over the K / V rows the test itself kept for every request, in order: the paging, the slots, the decode / prefill
split and the plan all have to be right for it to pass."""
import math

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM adapter's tests need vllm (make test installs it)")

from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import evenflow.integrations.vllm as ev_vllm  # noqa: E402
from evenflow.testing import assert_within_rule  # noqa: E402
from tests_support_engines import BF16, FP8, FP8_MAX, RowLog, quantised, step_oracle  # noqa: E402


class Layer:
    """What vLLM's Attention layer hands the impl: its K / V scales (0-d fp32 tensors, as vLLM makes them)."""

    def __init__(self, k_scale=1.0, v_scale=1.0, device="cpu"):
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
        self._v_scale = torch.tensor(v_scale, dtype=torch.float32, device=device)
        self._k_scale_float, self._v_scale_float = float(k_scale), float(v_scale)


def layer_cache(num_blocks, block, hkv, d, dtype, device, layout=KVCacheLayout.LBNHC):
    """One layer's KV cache as vLLM 0.34 hands it to a backend: the logical [num_blocks, Hkv, block, 2 * D] view of
    a buffer laid out as ``layout`` says (LBNHC, the backend's ask: a block's slots, then heads), fp8 allocated as
    bytes."""
    order = layout.layer_view_order
    logical = (num_blocks, hkv, block, 2 * d)
    phys = torch.randn([logical[i] for i in order], device=device).to(BF16)  # stale contents, as a reused pool has
    if dtype == FP8:
        phys = phys.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return phys.permute([order.index(i) for i in range(4)])


class Engine(RowLog):
    """The engine's bookkeeping for a few requests: blocks (random order, block 0 never used), each layer's K / V
    rows of each request so far (the oracle's), and one CommonAttentionMetadata a step (its block table's unused
    entries stale block ids, its slot mapping ``pad`` entries of -1 longer than the step's tokens, as vLLM pads it)."""

    def __init__(self, cfg, spec, num_blocks, max_blocks, device, seed=0):
        super().__init__()
        self.cfg, self.spec, self.device = cfg, spec, device
        self.g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=self.g) + 1).tolist()
        self.num_blocks = num_blocks
        self.max_blocks = max_blocks
        self.blocks: dict[str, list[int]] = {}

    def step(self, sched, pad=0):
        """``sched``: [(request, new tokens)], decodes first as vLLM's reorder leaves them. Returns the metadata."""
        P = self.spec.block_size
        starts, slots, lens, table = [0], [], [], []
        for r, n in sched:
            old = self.length(r)
            blocks = self.blocks.setdefault(r, [])
            while len(blocks) * P < old + n:
                blocks.append(self.free.pop())
            slots += [blocks[p // P] * P + p % P for p in range(old, old + n)]
            starts.append(starts[-1] + n)
            lens.append(old + n)
            stale = torch.randint(0, self.num_blocks, (self.max_blocks - len(blocks),), generator=self.g).tolist()
            table.append(blocks + stale)
        dev = self.device
        qsl = torch.tensor(starts, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32,
                                                                                          device=dev),
            num_reqs=len(sched), num_actual_tokens=starts[-1], max_query_len=max(n for _, n in sched),
            max_seq_len=max(lens), block_table_tensor=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=dev))

def expected(engine, sched, q, kv_dtype, k_scale, v_scale, sm_scale, layer=0):
    """The step's fp64 oracle and fp32 baseline from the test's own rows of each request (tests_support_engines)."""
    return step_oracle([engine.kv[layer, r] for r, _ in sched], [n for _, n in sched], q, engine.spec.block_size,
                       kv_dtype, k_scale, v_scale, sm_scale)


def config(max_num_seqs=8, device="cpu"):
    return VllmConfig(device_config=DeviceConfig(device=device),
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024,
                                                       max_num_batched_tokens=1024, is_encoder_decoder=False))


def backend_parts(hq, hkv, d, block, kv_cache_dtype="auto", device="cpu"):
    cfg = config(device=device)
    kv_dtype = FP8 if kv_cache_dtype in ("fp8", "fp8_e4m3") else BF16
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=d, dtype=kv_dtype)
    builder = ev_vllm.EvenflowMetadataBuilder(spec, ["layers.0.attn"], cfg, torch.device(device))
    impl = ev_vllm.EvenflowAttentionImpl(hq, d, 1 / math.sqrt(d) * 1.5, hkv, None, None, kv_cache_dtype)
    return cfg, spec, builder, impl, kv_dtype


# The steps of one run: (request, new tokens) in the order vLLM's reorder leaves a batch (decodes first). Request a's
# 37-token prompt comes in two chunks; c's one-token prompt counts as a decode (vLLM's short-extend rule).
STEPS = [
    [("c", 1), ("b", 9), ("a", 21)],
    [("b", 1), ("c", 1), ("a", 16)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("c", 1), ("d", 40)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
]


def run_steps(steps, hq, hkv, d, block, kv_cache_dtype="auto", device="cpu", pad=0, threshold=None, seed=0,
              num_blocks=24, max_blocks=8, layers=2, layout=KVCacheLayout.LBNHC, max_batch=None):
    """The steps through the backend as vLLM's model runner drives it: one build a step, then each layer's forward
    (its own cache and rows, the plan shared), every layer's output checked against the oracle."""
    cfg, spec, builder, impl, kv_dtype = backend_parts(hq, hkv, d, block, kv_cache_dtype, device)
    if threshold is not None:  # as a speculative config makes it (1 + num_speculative_tokens)
        builder.reorder_batch_threshold = threshold
    if max_batch is not None:  # a plan bound below the step's decodes (as max_num_seqs above MAX_BATCH makes it)
        builder.max_batch = max_batch
    k_scale, v_scale = (1 / 40, 1 / 56) if kv_dtype == FP8 else (1.0, 1.0)
    layer = Layer(k_scale, v_scale, device)
    caches = [layer_cache(num_blocks, block, hkv, d, kv_dtype, device, layout) for _ in range(layers)]
    engine = Engine(cfg, spec, num_blocks, max_blocks, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    splits = []
    for i, sched in enumerate(steps):
        cm = engine.step(sched, pad)
        m = builder.build(0, cm)
        splits.append((m.num_decodes, m.num_prefills, m.decode_query_len))
        assert (m.plan is not None) == (0 < m.num_decodes <= builder.max_batch), f"step {i}: plan {m.plan}"
        T = cm.num_actual_tokens
        for li, kv_cache in enumerate(caches):
            q = torch.randn(T + pad, hq, d, generator=g).to(BF16).to(device)
            k = (torch.randn(T + pad, hkv, d, generator=g) * 2).to(BF16).to(device)
            v = torch.randn(T + pad, hkv, d, generator=g).to(BF16).to(device)
            engine.append(sched, k, v, li)
            out = torch.full((T + pad, hq, d), float("nan"), dtype=BF16, device=device)
            before = kv_cache.clone()
            res = impl.forward(layer, q, k, v, kv_cache, m, output=out)
            assert res is out
            ref, base = expected(engine, sched, q[:T], kv_dtype, k_scale, v_scale, impl.scale, li)
            assert_within_rule(out[:T].cpu(), ref, base, what=f"step {i} layer {li} {sched}")
            # the cache changed in this step's blocks only (padding rows, slot -1, stored nowhere)
            changed = (kv_cache.view(torch.uint8) != before.view(torch.uint8)).flatten(1).any(1)  # per block
            touched = set((cm.slot_mapping[:T] // block).tolist())
            assert set(changed.nonzero().flatten().tolist()) <= touched, f"step {i}: a block outside it changed"
            if pad:
                assert torch.isnan(out[T:].float()).all(), f"step {i}: padding rows of the output were written"
    return splits, engine, caches, impl


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (4, 4, 128, 32)], ids=["g4-d64-b16", "g1-d128-b32"])
def test_engine_steps(shape, kv_cache_dtype, device):
    hq, hkv, d, block = shape
    splits, engine, caches, impl = run_steps(STEPS, hq, hkv, d, block, kv_cache_dtype, device)
    # vLLM's split, as the kernels took it: step 0 a's 21-token chunk and b's 9 are prefills, c's 1-token prompt a
    # decode; step 1 a's second chunk a prefill beside two decodes; step 3 d's 40-token prompt beside two
    assert splits == [(1, 2, 1), (2, 1, 1), (3, 0, 1), (2, 1, 1), (4, 0, 1)]
    # every request's rows sit at its blocks' slots, in order, where vLLM's layout puts them (the layer cache
    # [block, head, slot, K then V]: other engine parts, a KV connector or another backend, read them there); bf16
    # bit for bit the rows given, fp8 as quantised at the scales
    for (li, r), (kk, vv) in engine.kv.items():
        raw = caches[li].view(torch.uint8) if kv_cache_dtype != "auto" else caches[li]
        pos = torch.arange(kk.shape[0])
        blk = torch.tensor(engine.blocks[r])[pos // block]
        rows = raw[blk.to(device), :, (pos % block).to(device)].cpu()  # [L, Hkv, 2 * D]
        want_k, want_v = (kk, vv) if kv_cache_dtype == "auto" else (
            quantised(kk, 1 / 40, FP8).view(torch.uint8), quantised(vv, 1 / 56, FP8).view(torch.uint8))
        assert torch.equal(rows[..., :d], want_k) and torch.equal(rows[..., d:], want_v), r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_steps_qwen3_dims(kv_cache_dtype, device):
    """Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128) at vLLM's block 64, a 3000-token prompt in two chunks
    beside short requests' decodes, then mixed decodes: the decode plan and the Gluon / Triton kernels the GPU
    picks, through the adapter."""
    steps = [[("s1", 1), ("s2", 200), ("long", 2048)],
             [("s1", 1), ("s2", 1), ("long", 952)],
             [("long", 1), ("s1", 1), ("s2", 1), ("s3", 700)],
             [("long", 1), ("s1", 1), ("s2", 1), ("s3", 1)]]
    splits, *_ = run_steps(steps, 32, 4, 128, 64, kv_cache_dtype, device, pad=5, num_blocks=96, max_blocks=64)
    assert splits == [(1, 2, 1), (2, 1, 1), (3, 1, 1), (4, 0, 1)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_through_vllms_attention_layer(kv_cache_dtype, device):
    """vLLM's own Attention layer built on the backend (as a model's attention module builds it) and called as the
    model runner calls it: the flat [T, heads * D] q / k / v, the step's metadata and slot mapping in vLLM's forward
    context, the cache bound to the layer. Its output is the oracle's within the rule, step after step."""
    from vllm.config import CacheConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention

    hq, hkv, d, block = 8, 2, 64, 16
    cfg = VllmConfig(device_config=DeviceConfig(device=device),
                     cache_config=CacheConfig(block_size=block, cache_dtype=kv_cache_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024,
                                                      is_encoder_decoder=False))
    name = "model.layers.0.self_attn.attn"
    with set_current_vllm_config(cfg):
        attn = Attention(hq, d, 0.2, hkv, cache_config=cfg.cache_config, prefix=name,
                         attn_backend=ev_vllm.EvenflowAttentionBackend).to(device)
        kv_dtype = FP8 if kv_cache_dtype == "fp8" else BF16
        spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=d, dtype=kv_dtype)
        builder = ev_vllm.EvenflowMetadataBuilder(spec, [name], cfg, torch.device(device))
    assert isinstance(attn.impl, ev_vllm.EvenflowAttentionImpl) and builder.num_q_heads == hq  # from the layer
    attn.kv_cache = layer_cache(24, block, hkv, d, kv_dtype, device)
    k_scale, v_scale = (0.05, 0.03) if kv_dtype == FP8 else (1.0, 1.0)  # as a checkpoint's scales set them
    attn._k_scale.fill_(k_scale)
    attn._v_scale.fill_(v_scale)
    engine = Engine(cfg, spec, 24, 8, device)
    g = torch.Generator().manual_seed(5)
    for i, sched in enumerate(STEPS[:4]):
        cm = engine.step(sched, pad=2)
        T = cm.num_actual_tokens
        q, k, v = (torch.randn(T + 2, h * d, generator=g).to(BF16).to(device) for h in (hq, hkv, hkv))
        engine.append(sched, k.view(-1, hkv, d), v.view(-1, hkv, d))
        with set_forward_context({name: builder.build(0, cm)}, cfg, slot_mapping={name: cm.slot_mapping}):
            out = attn(q, k, v)
        assert out.shape == (T + 2, hq * d)
        ref, base = expected(engine, sched, q[:T].view(T, hq, d), kv_dtype, k_scale, v_scale, 0.2)
        assert_within_rule(out[:T].view(T, hq, d).cpu(), ref, base, what=f"step {i} {sched}")


def test_uniform_multirow_decodes(device):
    """Decodes of 3 rows each (a verification of 2 speculative tokens): one plan at q_len 3; a batch whose short
    requests differ in length sends the odd one to the prefill kernel (vLLM's require_uniform split)."""
    steps = [[("a", 30), ("b", 12)], [("a", 3), ("b", 3)], [("a", 3), ("b", 2), ("c", 5)]]
    splits, *_ = run_steps(steps, 8, 2, 64, 16, device=device, threshold=3)
    assert splits == [(0, 2, 1), (2, 0, 3), (1, 2, 3)]


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LHBNC], ids=lambda x: x.name)
def test_other_cache_layouts(layout, device):
    """A layout set on vLLM's cache config over the backend's ask (heads before slots: HND-like K / V views; heads
    outermost, blocks inside them): the same schedule, the same checks."""
    run_steps(STEPS[:4], 8, 2, 64, 16, "fp8_e4m3", device, layout=layout, layers=1)


def test_plan_bound(device):
    """max_num_seqs above the plan's bound (MAX_BATCH): the plan is sized to it, and a step with more decodes than it
    holds runs the static schedule, within the rule like the rest."""
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     scheduler_config=SchedulerConfig(max_num_seqs=ev_vllm.MAX_BATCH + 100, max_model_len=1024,
                                                      max_num_batched_tokens=4096, is_encoder_decoder=False))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    assert ev_vllm.EvenflowMetadataBuilder(spec, ["layers.0.attn"], cfg, torch.device("cpu")).max_batch == \
        ev_vllm.MAX_BATCH
    splits, *_ = run_steps(STEPS, 8, 2, 64, 16, device=device, max_batch=2, layers=1)
    assert splits[2] == (3, 0, 1) and splits[4] == (4, 0, 1)  # decodes past the bound: no plan (checked per step)


def test_padding_rows(device):
    """A captured batch's padding rows (past num_actual_tokens, their slots -1) are neither stored nor written."""
    run_steps(STEPS[:3], 8, 2, 64, 16, pad=3, device=device)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_dummy_batch(kv_cache_dtype, device):
    """vLLM's warm-up and idle-rank dummy runs: a built batch whose every slot is -1 (vLLM's dummy slot mapping).
    It runs, stores nothing, and gives finite rows (whatever the cache held)."""
    cfg, spec, builder, impl, kv_dtype = backend_parts(8, 2, 64, 16, kv_cache_dtype, device)
    engine = Engine(cfg, spec, 8, 4, device)
    cm = engine.step([("a", 1), ("b", 1), ("c", 6)])
    cm.slot_mapping.fill_(-1)
    m = builder.build(0, cm)
    kv_cache = layer_cache(8, 16, 2, 64, kv_dtype, device)
    before = kv_cache.clone()
    q = torch.randn(8, 8, 64, device=device).to(BF16)
    k, v = torch.randn(2, 8, 2, 64, device=device).to(BF16)
    out = impl.forward(Layer(1 / 40, 1 / 56, device), q, k, v, kv_cache, m, output=torch.empty_like(q))
    assert torch.equal(kv_cache.view(torch.uint8), before.view(torch.uint8))
    assert torch.isfinite(out.float()).all()


def test_plugin_entry_point():
    """vLLM's plugin loader finds evenflow's entry point (the package's metadata), and calling it makes the CUSTOM
    backend a config names evenflow's."""
    import importlib.metadata

    from vllm.config.attention import AttentionConfig
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    try:
        importlib.metadata.distribution("evenflow")
    except importlib.metadata.PackageNotFoundError:  # sources on PYTHONPATH (the GPU machine): no package metadata
        pytest.skip("evenflow is not installed as a package here (make env installs it): no entry points to find")
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins["evenflow"] is ev_vllm.register
    plugins["evenflow"]()
    assert AttentionConfig(backend="CUSTOM").backend.get_class() is ev_vllm.EvenflowAttentionBackend


def test_config_crosses_a_spawned_process():
    """A config naming the backend pickles into a process started by spawn (vLLM's engine core and workers) and
    reads there before anything of evenflow's is imported: the CUSTOM member exists in every process."""
    import pickle
    import subprocess
    import sys

    from vllm.config.attention import AttentionConfig

    ev_vllm.register()
    blob = pickle.dumps(AttentionConfig(backend="CUSTOM"))
    code = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
            "assert 'evenflow' not in sys.modules; print(c.backend.name)")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.decode().split()[-1] == "CUSTOM"


def test_registry_and_validation():
    ev_vllm.register()
    ev_vllm.register()  # idempotent
    be = AttentionBackendEnum["CUSTOM"]
    assert be.get_class() is ev_vllm.EvenflowAttentionBackend
    cls = ev_vllm.EvenflowAttentionBackend
    assert cls.get_name() == "CUSTOM"  # the layer looks its backend up by this name
    assert not cls.supports_device_cpu_query_lens_mismatch()
    from vllm.platforms.interface import DeviceCapability

    ok = dict(head_size=128, dtype=BF16, kv_cache_dtype="auto", block_size=64, use_mla=False, has_sink=False,
              use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=DeviceCapability(9, 0), attn_type="decoder")
    assert cls.validate_configuration(**ok) == []
    for change, reason in [(dict(head_size=96), "head_size"), (dict(dtype=torch.float16), "dtype"),
                           (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"), (dict(block_size=8), "block_size"),
                           (dict(block_size=48), "block_size"), (dict(use_mla=True), "MLA"),
                           (dict(has_sink=True), "sink"),
                           (dict(device_capability=DeviceCapability(10, 0)), "compute capability"),
                           (dict(device_capability=DeviceCapability(8, 0)), "compute capability")]:
        reasons = cls.validate_configuration(**{**ok, **change})
        assert any(reason in r for r in reasons), (change, reasons)


@pytest.mark.parametrize("kwargs, named", [
    (dict(sliding_window=128), "sliding window"),
    (dict(alibi_slopes=[0.5] * 8), "ALiBi"),
    (dict(logits_soft_cap=30.0), "softcapping"),
    (dict(attn_type="encoder_only"), "attention type"),
    (dict(head_size=96), "head_size 96"),
    (dict(num_kv_heads=3), "GQA"),
    (dict(num_heads=64, num_kv_heads=2), "GQA"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
    (dict(sinks=torch.zeros(8)), "sinks"),
])
def test_impl_refusals(kwargs, named):
    args = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    args.update(kwargs)
    with pytest.raises(NotImplementedError, match=named):
        ev_vllm.EvenflowAttentionImpl(**args)


@pytest.mark.parametrize("kwargs, error, named", [
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    (dict(num_kv_heads=-2), ValueError, "num_kv_heads must be >= 1"),
    (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
    (dict(num_heads=-8), ValueError, "num_heads must be >= 1"),
    (dict(num_heads=8.0), TypeError, "num_heads must be an int"),
    (dict(head_size=64.0), TypeError, "head_size must be an int"),
    (dict(scale=None), TypeError, "scale must be a float"),
    (dict(scale=0.0), ValueError, "scale must be > 0"),
    (dict(scale=-0.125), ValueError, "scale must be > 0"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
])
def test_impl_bad_arguments(kwargs, error, named):
    """Malformed head counts, head size or scale are refused by name when the layer is built (before: a
    ZeroDivisionError, or taken and failing, or not, deep in a later call)."""
    args = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    args.update(kwargs)
    with pytest.raises(error, match=named):
        ev_vllm.EvenflowAttentionImpl(**args)


@pytest.mark.parametrize("case", ["kv-heads", "head-size", "bf16-under-fp8", "fp8-under-auto", "3d"])
def test_forward_refuses_a_cache_unlike_the_layer(case, device):
    """A layer cache whose kv heads, head size or dtype are not the layer's is refused naming kv_cache, before
    anything is stored (before: a layer that stores nothing, as one sharing another's KV, attended over the cache's
    heads with another GQA grouping, and an fp8 cache under kv_cache_dtype 'auto' was read at scale 1 whatever the
    layer's scales, both silently; the rest failed naming k / v_cache views vLLM never passed)."""
    kv_cache_dtype = "fp8" if case == "bf16-under-fp8" else "auto"
    cfg, spec, builder, impl, _ = backend_parts(8, 2, 64, 16, kv_cache_dtype, device)
    share = case == "kv-heads"
    if share:  # a layer reading another's cache: it stores nothing, so nothing else looks at the cache's heads
        impl = ev_vllm.EvenflowAttentionImpl(8, 64, 0.125, 2, kv_sharing_target_layer_name="layers.0.attn")
    engine = Engine(cfg, spec, 8, 4, device)
    m = builder.build(0, engine.step([("a", 5), ("b", 5)]))  # prefills only: no plan to catch the cache
    hkv, d, dtype = {"kv-heads": (4, 64, BF16), "head-size": (2, 128, BF16), "bf16-under-fp8": (2, 64, BF16),
                     "fp8-under-auto": (2, 64, FP8), "3d": (2, 64, BF16)}[case]
    kv_cache = layer_cache(8, 16, hkv, d, dtype, device)
    if case == "fp8-under-auto":
        kv_cache = kv_cache.view(FP8)
    if case == "3d":
        kv_cache = kv_cache[0]
    before = kv_cache.clone()
    q = torch.randn(10, 8, 64, device=device).to(BF16)
    k, v = torch.randn(2, 10, 2, 64, device=device).to(BF16)
    error = TypeError if "under" in case else ValueError
    with pytest.raises(error, match="kv_cache"):
        impl.forward(Layer(1 / 40, 1 / 56, device), q, k, v, kv_cache, m, output=torch.empty_like(q))
    assert torch.equal(kv_cache.view(torch.uint8), before.view(torch.uint8))


def test_builder_and_forward_refusals(device):
    cfg = config(device=device)
    with pytest.raises(ValueError, match="block sizes"):
        ev_vllm.EvenflowMetadataBuilder(FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=BF16),
                                        ["l"], cfg, torch.device(device))
    for dt in (torch.float16, torch.float8_e5m2):  # (round CL: had planned a bf16 cache, with no error)
        with pytest.raises(ValueError, match=r"kv_cache_spec\.dtype"):
            ev_vllm.EvenflowMetadataBuilder(FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=dt),
                                            ["l"], cfg, torch.device(device))
    _, spec, builder, impl, _ = backend_parts(8, 2, 64, 16, device=device)
    engine = Engine(cfg, spec, 8, 4, device)
    cm = engine.step([("a", 1), ("b", 0)])  # a full graph's zero-length padding request
    with pytest.raises(ValueError, match="one query length"):
        builder.build(0, cm)
    cm = engine.step([("c", 5)])
    cm.causal = False
    with pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, cm)
    q = torch.zeros(1, 8, 64, dtype=BF16, device=device)
    with pytest.raises(NotImplementedError, match="output quantisation"):
        impl.forward(Layer(), q, None, None, None, None, output=q, output_scale=torch.ones(1))
    out = torch.full_like(q, float("nan"))
    assert impl.forward(Layer(), q, None, None, None, None, output=out) is out  # the profiling run: no batch
    assert (out == 0).all()  # zeros, as vLLM's own backends give, not the buffer's garbage
