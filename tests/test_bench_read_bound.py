"""Tests of the read-bound benchmark (interpreted on the CPU, compiled on a GPU): its read kernel sums every
element once, its launcher rejects what it cannot read, and the bytes it times are the result files' floors."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name, alias):
    spec = importlib.util.spec_from_file_location(alias, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


rb = _load("read_bound", "bench_read_bound")
bm = sys.modules.get("bench_moe") or _load("moe", "bench_moe")


@pytest.mark.parametrize("shape", rb.SHAPES, ids=[s[0] for s in rb.SHAPES])
@pytest.mark.parametrize("n", [1, 4095, 2 * 4096 + 17, 3 * 16384 + 5])
def test_read_kernel_sums_every_element_once(shape, n, device):
    sms = 2
    g = torch.Generator().manual_seed(n)
    # values small enough that no partial overflows int32 (the GPU wraps; the interpreter raises)
    buf = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32, generator=g).to(device)
    grid = rb.read_grid(n, shape[1], shape[2], sms)
    out = torch.full((grid + 3,), 12345, dtype=torch.int32, device=device)
    rb.launch_read(buf, out, shape, False, sms)
    assert int(out[:grid].long().sum()) == int(buf.long().sum())
    assert out[grid:].tolist() == [12345] * 3, "a program past the grid wrote"


@pytest.mark.parametrize("n", [1, 100, 4096, 4097, 10**6])
@pytest.mark.parametrize("block,per_sm", [(4096, 0), (16384, 0), (4096, 2), (2048, 8)])
def test_read_grid_reaches_every_element_and_no_program_is_idle(n, block, per_sm):
    # the programs' blocks (block i, i + grid, ...) cover [0, n) and every program has a block of its own
    sms = 132
    grid = rb.read_grid(n, block, per_sm, sms)
    steps = math.ceil(n / (grid * block))
    starts = [p * block + j * grid * block for p in range(grid) for j in range(steps)
              if p * block + j * grid * block < n] if per_sm else [p * block for p in range(grid)]
    assert sorted(starts) == list(range(0, n, block))
    assert grid <= math.ceil(n / block)


def test_read_grid_and_offsets_reject_what_cannot_be_read():
    with pytest.raises(ValueError, match="n must be"):
        rb.read_grid(0, 4096, 0, 132)
    rb.check_int32_offsets(2**31 - 1 - 4096, 1, 4096)
    with pytest.raises(ValueError, match="buf"):
        rb.check_int32_offsets(2**31 - 4096, 1, 4096)
    with pytest.raises(ValueError, match="buf"):
        rb.check_int32_offsets(2**31 - 10 * 4096, 528, 4096)  # a strided grid's step past n


def test_launch_read_rejects_bad_buffers(device):
    buf = torch.ones(3 * 4096, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="out"):
        rb.launch_read(buf, torch.empty(2, dtype=torch.int32, device=device), rb.SHAPES[0], False, 4)
    with pytest.raises(TypeError, match="buf"):
        rb.launch_read(buf.float(), torch.empty(8, dtype=torch.int32, device=device), rb.SHAPES[0], False, 4)
    with pytest.raises(ValueError, match="buf"):
        rb.launch_read(torch.ones(1, dtype=torch.int32, device=device).expand(4096), buf, rb.SHAPES[0], False, 4)
    with pytest.raises(TypeError, match="out"):
        rb.launch_read(buf, torch.empty(8, dtype=torch.int64, device=device), rb.SHAPES[0], False, 4)


def _write(tmp_path, decode_rows, moe_rows, copy=4.0, bf16=800.0, fp8=1600.0):
    hdr = {"source_sha1": "abc"}
    (tmp_path / "decode.json").write_text(json.dumps({"header": hdr, "ceilings": {"copy_TBps": copy},
                                                      "rows": decode_rows}))
    (tmp_path / "moe.json").write_text(json.dumps({"header": hdr, "ceilings": {
        "copy_TBps": copy, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8}, "rows": moe_rows}))


def test_points_take_each_files_bytes_copies_and_skip_compute_bound_rows(tmp_path):
    case = bm.MoECase("tiny", 8, 8, 2, 1024, 512)
    dec = [{"case": "64x512", "variant": "bf16-kv", "impl": "evenflow", "us": 40.0, "floor_us": 32.0,
            "frac_of_floor": 0.8, "floor_bytes": 128_000_000, "rotations": 2},
           {"case": "64x512", "variant": "bf16-kv", "impl": "flashinfer-tc", "us": 50.0, "floor_us": 32.0},
           {"case": "64x512", "variant": "fp8-kv", "impl": "evenflow", "error": "n/a"}]
    # 2 MB of weights at 4 TB/s is 0.5 us; 6 H I x pairs at the rate decides the bound
    moe = [{"case": "tiny", "variant": "bf16", "impl": "evenflow", "batch": 1, "us": 2.0, "floor_us": 0.5,
            "frac_of_floor": 0.25, "mean_local_pairs": 2.0, "rotated": 4},
           {"case": "tiny", "variant": "fp8-tensor", "impl": "evenflow", "batch": 4096, "us": 900.0,
            "floor_us": 6 * 1024 * 512 * 8192 / 1600e12 * 1e6, "frac_of_floor": 0.5,
            "mean_local_pairs": 8192.0, "rotated": 1},
           {"case": "tiny", "variant": "bf16", "impl": "sglang-triton", "batch": 1, "us": 3.0, "floor_us": 0.5}]
    _write(tmp_path, dec, moe)
    pts = rb.points_from_results(tmp_path, moe_cases={"tiny": case})
    assert [(p["op"], p["variant"]) for p in pts] == [("decode", "bf16-kv"), ("moe", "bf16"), ("moe", "fp8-tensor")]
    d, m1, m2 = pts
    assert d["bytes"] == 128_000_000 and d["copies"] == 2 and d["batch"] is None and d["record_frac"] == 0.8
    assert m1["bytes"] == 2_000_000 and m1["copies"] == 4 and m1["batch"] == 1 and "skip" not in m1
    assert "compute-bound" in m2["skip"] and m2["bytes"] is None
    assert rb.points_from_results(tmp_path, ops=("decode",)) == [d]
    with pytest.raises(ValueError, match="moe_cases"):
        rb.points_from_results(tmp_path)
    with pytest.raises(ValueError, match="ops"):
        rb.points_from_results(tmp_path, ops=("router",), moe_cases={"tiny": case})


def test_points_time_a_row_just_below_the_compute_floor(tmp_path):
    # FLOPs at 0.99 of the floor: the bytes set it, the row is timed; a row without its pair count is an error
    case = bm.MoECase("tiny", 8, 8, 2, 1024, 512)
    pairs = 1000.0
    flops_us = 6 * 1024 * 512 * pairs / 1600e12 * 1e6
    row = {"case": "tiny", "variant": "fp8-block", "impl": "evenflow", "batch": 512, "us": 9.0,
           "floor_us": flops_us / 0.99, "frac_of_floor": 0.5, "mean_local_pairs": pairs, "rotated": 1}
    _write(tmp_path, [], [row])
    (pt,) = rb.points_from_results(tmp_path, moe_cases={"tiny": case})
    assert "skip" not in pt and pt["bytes"] == round(flops_us / 0.99 * 4.0e6)
    del row["mean_local_pairs"]
    _write(tmp_path, [], [row])
    with pytest.raises(ValueError, match="mean_local_pairs"):
        rb.points_from_results(tmp_path, moe_cases={"tiny": case})


def test_points_reject_a_case_the_moe_benchmark_does_not_know(tmp_path):
    _write(tmp_path, [], [{"case": "other", "variant": "bf16", "impl": "evenflow", "batch": 1, "us": 2.0,
                           "floor_us": 0.5, "frac_of_floor": 0.25, "mean_local_pairs": 2.0}])
    with pytest.raises(ValueError, match="other"):
        rb.points_from_results(tmp_path, moe_cases=bm.CASES)


def test_points_of_the_committed_records_reproduce_their_floors():
    res = _BENCH / "results" / "h200"
    pts = rb.points_from_results(res, moe_cases=bm.CASES)
    moe = json.loads((res / "moe.json").read_text())
    dec = json.loads((res / "decode.json").read_text())
    n_dec = sum(1 for r in dec["rows"] if r["impl"] == "evenflow" and "us" in r)
    n_moe = sum(1 for r in moe["rows"] if r["impl"] == "evenflow" and "us" in r)
    assert len(pts) == n_dec + n_moe and n_dec > 0 and n_moe > 0
    # independent of the floor's arithmetic: on rows timed on one routing draw, the bytes are the hit experts'
    # weights (benchmarks/moe.py's expert_bytes) plus between T and 2T token rows of H bf16 and the routing
    rows = {(r["case"], r["variant"], r["batch"]): r for r in moe["rows"] if r["impl"] == "evenflow" and "us" in r}
    one_draw = 0
    for p in pts:
        if p["op"] != "moe" or p["bytes"] is None:
            continue
        r = rows[(p["case"], p["variant"], p["batch"])]
        if r.get("draws") != 1:
            continue
        one_draw += 1
        case, t = bm.CASES[p["case"]], p["batch"]
        low = r["distinct_experts"] * bm.expert_bytes(case, p["variant"]) + t * case.hidden * 2 + t * case.top_k * 8
        slack = 0.0005 * moe["ceilings"]["copy_TBps"] * 1e6 + 1  # floor_us is rounded to 1 ns
        assert low - slack <= p["bytes"] <= low + t * case.hidden * 2 + slack, (p, low)
    assert one_draw >= 20
    # the decode floors are bytes at the decode file's copy rate
    dcopy = dec["ceilings"]["copy_TBps"]
    for p in (p for p in pts if p["op"] == "decode"):
        r = next(r for r in dec["rows"]
                 if r["impl"] == "evenflow" and (r["case"], r["variant"]) == (p["case"], p["variant"]))
        assert p["bytes"] / (dcopy * 1e6) == pytest.approx(r["floor_us"], rel=2e-3)
    # batch <= 512 MoE floors are bytes-bound (only large batches may be compute-bound)
    assert all("skip" not in p for p in pts if p["op"] == "moe" and p["batch"] <= 512)


@pytest.mark.parametrize("n", [1, 2, 3, 4096 * 3 + 1])
def test_chain_parts_split_the_buffer_two_to_one_with_nothing_lost(n):
    buf = torch.arange(n, dtype=torch.int32)
    parts = rb.chain_parts(buf)
    assert torch.equal(torch.cat(parts), buf), "the parts are the buffer, in order, once"
    assert all(p.numel() > 0 for p in parts) and len(parts) == (1 if n < 2 else 2)
    if n > 3:
        assert abs(parts[0].numel() / n - rb.CHAIN_SPLIT) <= 1 / n
