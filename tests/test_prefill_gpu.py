"""prefill_attention at real shapes on a GPU: Qwen3-30B-A3B chunks after a cached prefix, mixed extend batches, the
Hy3 heads, bf16 and fp8 caches; CUDA-graph replays with request boundaries and lengths changed in place between
them (the grid fixed by max_seqlen_q); torch.compile(fullgraph=True)."""
import pytest
import torch

import evenflow
from test_prefill import check, make_inputs

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16

# (new tokens per request, cached prefix, Hq, Hkv, D, page)
REAL = {
    "qwen3-chunk-2x2048": ([2048, 2048], [0, 3000], 32, 4, 128, 64),
    "qwen3-extend-mixed": ([1, 7, 300, 64, 1000, 2], [4000, 100, 0, 9000, 512, 70000], 32, 4, 128, 64),
    "hy3-chunk": ([1024], [15000], 64, 8, 128, 64),
    "tp8-d256-p16": ([129, 33], [17, 640], 8, 1, 256, 16),
}


@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("kv_dtype", [BF16, FP8])
def test_real_shapes(shape, kv_dtype):
    new, prefix, hq, hkv, d, page = REAL[shape]
    inputs = make_inputs(new, prefix, hq, hkv, d, page, kv_dtype, pad=5, device="cuda")
    scales = dict(k_scale=1 / 30, v_scale=torch.tensor([1 / 40], device="cuda")) if kv_dtype == FP8 else {}
    check(*inputs, what=f"{shape} {kv_dtype}", **scales)


def test_cuda_graph_replays_follow_changed_lengths():
    """One captured call (max_seqlen_q 256); before each replay the request boundaries and lengths change in place.
    Each replay equals an eager call on the same inputs bit for bit, including a step whose request has more rows
    than max_seqlen_q (its programs walk the extra blocks)."""
    q, k, v, cu, pt, sl = make_inputs([200, 100, 50, 30], [3000, 10, 500, 0], 32, 4, 128, 64, device="cuda")
    out = torch.empty_like(q)
    evenflow.prefill_attention(q, k, v, cu, pt, sl, 256, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        evenflow.prefill_attention(q, k, v, cu, pt, sl, 256, out=out)
    gen = torch.Generator().manual_seed(0)
    T = q.shape[0]
    cap = pt.shape[1] * 64
    for step, counts in enumerate(([380 - 2, 1, 1, 0], [0, 0, 0, 380], [95, 95, 95, 95], [10, 20, 30, 40])):
        cu.copy_(torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32))
        lens = [int(n) + int(torch.randint(0, cap - n, (1,), generator=gen)) for n in counts]
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(T, 32, 128, generator=gen).to(BF16))
        want = evenflow.prefill_attention(q, k, v, cu, pt, sl, 256)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), step


def test_torch_compile_fullgraph():
    q, k, v, cu, pt, sl = make_inputs([64, 3], [100, 900], 32, 4, 128, 64, device="cuda")
    eager = evenflow.prefill_attention(q, k, v, cu, pt, sl, 64)

    @torch.compile(fullgraph=True)
    def step(q, sl):
        return evenflow.prefill_attention(q, k, v, cu, pt, sl, 64)

    assert torch.equal(step(q, sl), eager)
