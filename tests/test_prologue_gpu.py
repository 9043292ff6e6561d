"""qk_norm_rope_store_kv at real shapes on a GPU: Qwen3-30B-A3B and Hy3-style heads, decode steps and prefill
chunks, every dtype pair, CUDA-graph replays with positions, routing of tokens to requests and page tables changed
between them, torch.compile(fullgraph=True), and a cache past 2^31 elements (64-bit slot offsets)."""
import pytest
import torch

import evenflow
from test_prologue import check, make_inputs

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16

# (new tokens per request, cached prefix, Hq, Hkv, D, page)
REAL = {
    "qwen3-decode-64": ([1] * 64, [int(x) for x in torch.randint(1, 32768, (64,), generator=torch.Generator()
                                                                  .manual_seed(0))], 32, 4, 128, 64),
    "qwen3-prefill-2x2048": ([2048, 2048], [0, 1000], 32, 4, 128, 64),
    "hy3-spec-32x4": ([4] * 32, [4096 + 37 * i for i in range(32)], 64, 8, 128, 64),
    "tp8-extend": ([300, 1, 17], [5000, 0, 128], 8, 1, 128, 16),
}


@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("kv_dtype,q_dtype", [(BF16, BF16), (FP8, BF16), (FP8, FP8)])
def test_real_shapes(shape, kv_dtype, q_dtype):
    new, prefix, hq, hkv, d, page = REAL[shape]
    args, qw, kw = make_inputs(new, prefix, hq, hkv, d, page, kv_dtype, pad=3, device="cuda")
    scales = dict(k_scale=0.05, v_scale=torch.tensor([0.04], device="cuda")) if kv_dtype == FP8 else {}
    check(args, qw, kw, q_dtype=q_dtype, what=f"{shape} {kv_dtype} {q_dtype}", **scales)


def test_cuda_graph_replays_follow_changed_inputs():
    """One captured call; before each replay the step's tokens, positions, request boundaries and page table are
    rewritten in place (as an engine's graph runner does). Each replay must equal an eager call on the same inputs
    and the same cache before it, bit for bit."""
    hq, hkv, d, page, T = 32, 4, 128, 64, 16
    args, qw, kw = make_inputs([4, 4, 4, 4], [100, 0, 500, 63], hq, hkv, d, page, FP8, device="cuda")
    max_pages = args["page_table"].shape[1]
    for name in ("k_cache", "v_cache"):  # a pool of 4 x max_pages pages: room for a page table of distinct pages
        args[name] = (torch.randn(4 * max_pages, page, hkv, d, device="cuda") * 50).to(FP8)
    q_out = torch.empty(T, hq, d, dtype=FP8, device="cuda")
    s_out = torch.empty(T, hq, device="cuda")
    kw_call = dict(q_norm_weight=qw, k_norm_weight=kw, q_dtype=FP8, k_scale=0.05, v_scale=0.05, q_out=q_out,
                   q_scale_out=s_out)
    evenflow.qk_norm_rope_store_kv(**args, **kw_call)  # compiled before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        evenflow.qk_norm_rope_store_kv(**args, **kw_call)
    gen = torch.Generator().manual_seed(1)
    pool = args["k_cache"].shape[0]
    for step in range(4):
        live = T - step  # some steps end with padding rows
        counts = torch.multinomial(torch.ones(4), live, replacement=True, generator=gen).bincount(minlength=4)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
        # positions inside the page table and the rotary table (a position past either is refused by check_inputs)
        cap = min(max_pages * page, args["cos_sin"].shape[0])
        pos = torch.cat([torch.randint(0, cap - int(n), (1,), generator=gen) + torch.arange(int(n))
                         for n in counts] + [torch.zeros(step, dtype=torch.long)])
        args["cu_seqlens_q"].copy_(cu)
        args["positions"].copy_(pos)
        args["qkv"].copy_(torch.randn(T, args["qkv"].shape[1], generator=gen).to(BF16))
        # every entry a page of its own, so no two tokens share a slot (two writers of one slot may land in
        # either order, and the comparison below is bit for bit)
        args["page_table"].copy_(torch.randperm(pool, generator=gen)[:4 * max_pages].view(4, max_pages))
        kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
        q_e, s_e = evenflow.qk_norm_rope_store_kv(**{**args, "k_cache": kc, "v_cache": vc},
                                                  **{**kw_call, "q_out": None, "q_scale_out": None})
        evenflow.validate_prologue_inputs(**{k: v for k, v in args.items()})
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_out.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s_out, s_e), step
        assert torch.equal(args["k_cache"].view(torch.uint8), kc.view(torch.uint8)), step
        assert torch.equal(args["v_cache"].view(torch.uint8), vc.view(torch.uint8)), step


def test_torch_compile_fullgraph():
    args, qw, kw = make_inputs([1] * 8, list(range(8)), 32, 4, 128, 64, device="cuda")
    kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
    eager = evenflow.qk_norm_rope_store_kv(**{**args, "k_cache": kc, "v_cache": vc}, q_norm_weight=qw,
                                           k_norm_weight=kw)[0]

    @torch.compile(fullgraph=True)
    def step(qkv, positions):
        return evenflow.qk_norm_rope_store_kv(qkv, positions, args["cos_sin"], args["k_cache"], args["v_cache"],
                                              args["page_table"], args["cu_seqlens_q"], q_norm_weight=qw,
                                              k_norm_weight=kw)[0]

    assert torch.equal(step(args["qkv"], args["positions"]), eager)
    assert torch.equal(args["k_cache"], kc) and torch.equal(args["v_cache"], vc)


def test_slot_offsets_past_2_31_elements():
    """A cache of 40,000 pages of [64, 8, 128] bf16 (2.6e9 elements, 5.2 GB each): tokens land on pages whose
    first element is past 2^31, which 32-bit offsets would wrap."""
    pages, page, hkv, d = 40_000, 64, 8, 128
    kc = torch.zeros(pages, page, hkv, d, dtype=BF16, device="cuda")
    vc = torch.zeros_like(kc)
    pt = torch.tensor([[39_999, 3], [35_000, 0]], dtype=torch.int32, device="cuda")
    pos = torch.tensor([5, 64, 63], device="cuda")
    cu = torch.tensor([0, 2, 3], dtype=torch.int32, device="cuda")
    qkv = torch.randn(3, (64 + 2 * hkv) * d, device="cuda").to(BF16)
    cs = evenflow.rope_cos_sin(128, d, device="cuda")
    evenflow.qk_norm_rope_store_kv(qkv, pos, cs, kc, vc, pt, cu, check_inputs=True)
    v = qkv.view(3, 64 + 2 * hkv, d)[:, 64 + hkv:]
    assert torch.equal(vc[39_999, 5], v[0]) and torch.equal(vc[3, 0], v[1]) and torch.equal(vc[35_000, 63], v[2])
    assert int((vc != 0).any(-1).any(-1).sum()) == 3  # nothing else written
    assert int((kc != 0).any(-1).any(-1).sum()) == 3
