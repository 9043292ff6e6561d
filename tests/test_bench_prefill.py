"""The prefill benchmark's pieces on the CPU: its floor's terms, its sampled check, its speed-ups."""
import pytest
import torch

from evenflow.bench import harness as H
from tests_support_bench import load_script, switches_at_launch


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("prefill")
    monkeypatch.setitem(mod.CASES, "2x20+30", (2, 20, 30))
    monkeypatch.setitem(mod.CASES, "1x200+70", (1, 200, 70))  # 128-row blocks, unmasked steps, two row blocks
    monkeypatch.setitem(mod.CASES, "2x40+30", (2, 40, 30))  # 64-row blocks: two heads of 64 rows where packed
    monkeypatch.setitem(mod.HEADS, "small", (4, 1))
    return mod


def test_floor_terms_count_visible_pairs_and_each_kv_once(bench, device):
    pt = bench.build("2x20+30", "small", "bf16-kv", device=device)
    byt, flops = bench.floor_terms(pt)
    # each request: 20 rows after 30 cached tokens see 31..50 keys
    pairs = 2 * sum(30 + i + 1 for i in range(20))
    assert flops == 4 * 128 * 4 * pairs
    assert byt == 2 * (40 * 4 * 128 * 2) + 2 * (2 * 50 * 1 * 128 * 2)
    _, flops8 = bench.floor_terms(bench.build("2x20+30", "small", "fp8-kv", device=device))
    assert flops8 == flops


@pytest.mark.parametrize("variant", ["bf16-kv", "fp8-kv"])
def test_sampled_check_passes_ours_and_catches_a_wrong_row(bench, variant, device):
    pt = bench.build("2x20+30", "small", variant, device=device)
    fns = bench.calls("evenflow", pt)
    out = fns[0]()
    bench.sample_check(pt, out)
    out[25] *= -1  # a sampled row (request 1's 6th)
    with pytest.raises(AssertionError, match="sampled rows"):
        bench.sample_check(pt, out)


def test_speedups_take_the_fastest_flashinfer(bench):
    res = H.Results("prefill", ceilings={"copy_TBps": 4.0})
    for impl, us in (("evenflow", 10.0), ("flashinfer-fa2", 15.0), ("flashinfer-fa3", 12.0)):
        res.add(case="qwen3-30b-a3b:4x2K", variant="bf16-kv", impl=impl, us=us)
    res.add_error(case="qwen3-30b-a3b:4x2K", variant="fp8-kv", impl="flashinfer-fa3", error="no fp8 q")
    bench._speedups(res)
    assert res.rows[0]["vs_best_flashinfer"] == 1.2


def test_knob_rows_run_their_form_and_put_the_switches_back(bench, device, monkeypatch):
    """A knob row's calls run with its switches set (a switch read at launch shows it) and restore them after each
    call; its output is the form of record's (the loop forms compute the same sums in the interpreter) and passes
    the sampled check. The cases take every form's own path: 200 rows (two 128-row blocks where wide), after 70
    cached tokens (unmasked steps in every block); 40-row chunks at group 4 (two heads a block where packed)."""
    from evenflow.attention import prefill as P

    names = ("SPLIT_LOOP", "WIDE_ROWS", "PACK_HEADS")
    defaults = {name: getattr(P, name) for name in names}
    seen = switches_at_launch(monkeypatch, P, "_prefill_launch", names)
    for case in ("1x200+70", "2x40+30"):
        pt = bench.build(case, "small", "bf16-kv", device=device)
        ref = bench.calls("evenflow", pt)[0]()
        for impl, switches in bench.KNOBS.items():
            assert any(defaults[name] != value for name, value in switches.items()), f"{impl} changes no switch"
            out = bench.calls(impl, pt)[0]()
            assert seen[-1] == {**defaults, **switches}, impl
            assert {name: getattr(P, name) for name in names} == defaults, f"{impl} left a switch changed"
            bench.sample_check(pt, out)
            if device == "cpu":
                assert torch.equal(out, ref), (case, impl)


def test_knob_rows_speedup_is_over_the_form_of_record(bench):
    res = H.Results("prefill", ceilings={"copy_TBps": 4.0})
    for impl, us in (("evenflow", 10.0), ("evenflow-masked", 8.0), ("flashinfer-fa3", 12.0)):
        res.add(case="qwen3-30b-a3b:4x2K", variant="bf16-kv", impl=impl, us=us)
    bench._speedups(res)
    by = {r["impl"]: r for r in res.rows}
    assert by["evenflow-masked"]["vs_evenflow"] == 1.25
    assert by["evenflow-masked"]["vs_best_flashinfer"] == 1.5
    assert "vs_evenflow" not in by["evenflow"]


def test_impls_option_refuses_an_unknown_impl(bench, monkeypatch):
    monkeypatch.setattr("sys.argv", ["prefill.py", "--impls", "evenflow,evenflow-nonesuch"])
    monkeypatch.setattr(bench.H, "_require_cuda", lambda name: None)
    with pytest.raises(SystemExit, match="--impls: unknown"):
        bench.main()
