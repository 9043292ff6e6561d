"""The route benchmark's pure parts (``benchmarks/route.py``): the engine-native peer selects as the fp64 reference,
the selection check counts flips and aligns weights by expert, the floor's bytes and the speedup columns; and the
script's calls at a tiny shape, ours and the peer's, pass its own check in the interpreter."""
import sys

import pytest
import torch

from evenflow.reference import router as R
from tests_support_bench import load_script


@pytest.fixture(scope="module")
def bench():
    mod = load_script("route")
    yield mod
    for name in ("router", "tune_router"):  # the script's imports from benchmarks/
        sys.modules.pop(name, None)


@pytest.mark.parametrize("scoring,scaling", [("softmax", 1.0), ("sigmoid", 2.5)])
def test_torch_route_selects_as_the_reference(bench, scoring, scaling):
    torch.manual_seed(0)
    m, n, k, top_k = 64, 96, 256, 8
    x = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k) * 0.02
    bias = torch.randn(n) * 0.1 if scoring == "sigmoid" else None
    ids, weights = bench.torch_route(x, w, top_k, scoring, bias, scaling)
    ref_ids, ref_w = R.route_ref(R.router_logits_fp64(x, w), top_k, scoring, bias, routed_scaling=scaling)
    flips, err = bench.selection_errors(ids, weights, ref_ids, ref_w)
    assert flips == 0 and err < 1e-5
    assert weights.sum(-1).sub(scaling).abs().max() < 1e-5  # renormalised, then scaled


def test_selection_errors_count_flips_and_align_weights_by_expert(bench):
    ref_ids = torch.tensor([[3, 1, 7], [0, 2, 5]], dtype=torch.int32)
    ref_w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], dtype=torch.float64)
    ids = torch.tensor([[7, 3, 1], [0, 2, 4]])  # row 0: the same set in another order; row 1: 5 -> 4
    weights = torch.tensor([[0.2, 0.5, 0.25], [0.6, 0.3, 0.1]])
    flips, err = bench.selection_errors(ids, weights, ref_ids, ref_w)
    assert flips == 1
    assert err == pytest.approx(0.05, abs=1e-7)  # row 0's expert 1: 0.25 against 0.3; row 1 (a flip) not compared
    assert bench.selection_errors(ids[1:], weights[1:], ref_ids[1:], ref_w[1:]) == (1, 0.0)
    with pytest.raises(ValueError, match="selection shapes"):
        bench.selection_errors(ids[:, :2], weights[:, :2], ref_ids, ref_w)


def test_floor_bytes_and_speedups(bench):
    assert bench.route_bytes(4, 128, 2048, 8) == 128 * 2048 * 4 + 4 * 2048 * 2 + 4 * 8 * 8
    rows = [{"case": "c", "M": 1, "impl": "evenflow", "us": 2.0, "eager_us": 10.0},
            {"case": "c", "M": 1, "impl": "torch-fp32", "us": 6.0, "eager_us": 40.0},
            {"case": "c", "M": 4, "impl": "evenflow", "us": 3.0, "eager_us": 12.0},
            {"case": "c", "M": 1, "impl": "evenflow-gemm", "error": "x"}]
    bench.add_speedups(rows)
    assert rows[0]["vs_torch"] == 3.0 and rows[0]["vs_torch_eager"] == 4.0
    assert "vs_torch" not in rows[1] and "vs_torch" not in rows[2] and "vs_torch" not in rows[3]


def test_every_case_is_one_route_takes(bench):
    """No case is an error row on every run: each is within route's expert and top-k bounds (LongCat-Chat's 768
    experts are not, which is why the router benchmark's fourth shape has no case here)."""
    from evenflow.router import topk

    for name, (_, n, top_k, scoring, scaling) in bench.CASES.items():
        assert 1 <= n <= topk.MAX_EXPERTS and 1 <= top_k <= min(topk.MAX_TOP_K, n), name
        assert scoring in ("softmax", "sigmoid") and scaling > 0, name


def test_unknown_case_or_impl_is_refused_before_any_measuring(bench):
    with pytest.raises(SystemExit, match="--cases: unknown"):
        bench.main(["--cases", "nope"])
    with pytest.raises(SystemExit, match="--impls: unknown"):
        bench.main(["--impls", "evenflow,cublas"])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_the_scripts_calls_select_as_the_reference(bench, device, scoring):
    torch.manual_seed(1)
    m, n, k, top_k, scaling = 5, 24, 64, 4, 2.0
    ws = [torch.randn(n, k, device=device) * 0.02 for _ in range(2)]
    xs = [torch.randn(m, k, device=device).to(torch.bfloat16) for _ in range(2)]
    bias = torch.randn(n, device=device) * 0.1 if scoring == "sigmoid" else None
    ref_ids, ref_w = R.route_ref(R.router_logits_fp64(xs[1], ws[1]), top_k, scoring, bias, routed_scaling=scaling)
    for impl in ("evenflow", "torch-fp32"):
        fns = bench._calls(impl, ws, xs, bias, top_k, scoring, scaling)
        assert len(fns) == 2
        flips, err = bench.selection_errors(*fns[1](), ref_ids, ref_w)  # each call reads its own copy
        assert flips == 0 and err < 1e-5, impl
    logits = bench._calls("evenflow-gemm", ws, xs, bias, top_k, scoring, scaling)[1]()
    assert (logits.double() - R.router_logits_fp64(xs[1], ws[1])).abs().max() < 1e-4


def test_a_whole_run_writes_checked_rows_and_floors(bench, monkeypatch, tmp_path):
    """main() end to end at tiny shapes in the interpreter, the GPU-only timing and ceilings stood in for: every case,
    M and impl gets a row, ours with no flip against fp64, the floor from the route's bytes plus the lowest launch
    reading, and the speedups from the peer's row of the point."""
    import json

    from evenflow.bench import harness as H

    monkeypatch.setattr(bench, "CASES", {"tiny-softmax": (64, 24, 4, "softmax", 1.0),
                                         "tiny-sigmoid": (64, 40, 6, "sigmoid", 2.5)})
    monkeypatch.setattr(bench.router_bench, "rotated_copies", lambda m, n, k: (
        [torch.randn(n, k) * 0.02 for _ in range(2)], [torch.randn(m, k).to(torch.bfloat16) for _ in range(2)]))
    ceil = {"copy_TBps": 2.0, "bf16_TFLOPs": 500.0, "launch_us": 0.9}
    monkeypatch.setattr(H, "measure_ceilings", lambda: dict(ceil))
    monkeypatch.setattr(H, "empty_launch_us", lambda pdl=False: 0.8)
    times = {"evenflow": 2.0, "evenflow-gemm": 1.0, "torch-fp32": 5.0}
    monkeypatch.setattr(H, "time_graph", lambda fns: times[bench._timing_impl])
    monkeypatch.setattr(H, "time_eager", lambda fns: 10 * times[bench._timing_impl])
    real_calls = bench._calls
    monkeypatch.setattr(bench, "_timing_impl", None, raising=False)  # the impl whose calls were made last

    def calls(impl, *a):
        bench._timing_impl = impl
        return real_calls(impl, *a)

    monkeypatch.setattr(bench, "_calls", calls)
    assert bench.main(["--ms", "1,3", "--out", str(tmp_path), "--no-plot"]) == 0
    rows = json.loads((tmp_path / "route.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 3 and not any("error" in r for r in rows)
    for r in rows:
        k, n, top_k = r["K"], r["N"], r["top_k"]
        moved = (bench.router_bench._call_bytes(r["M"], n, k) if r["impl"] == "evenflow-gemm"  # the logits written
                 else bench.route_bytes(r["M"], n, k, top_k))
        assert r["floor_us"] == pytest.approx(moved / 2.0e6 + 0.8, abs=1e-3)
        if r["impl"] == "evenflow":
            assert r["id_flips"] == 0 and r["max_abs_err"] < 1e-5
            assert r["vs_torch"] == 2.5 and r["vs_torch_eager"] == 2.5
        elif r["impl"] == "evenflow-gemm":
            assert r["max_abs_err"] < 1e-4 and r["vs_torch"] == 5.0
        else:
            assert r["id_flips"] == 0 and "vs_torch" not in r
