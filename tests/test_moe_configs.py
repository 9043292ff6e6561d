"""Tuned MoE config table: lookup rules (largest bucket <= T, fallbacks) and the tuner's candidates."""
import dataclasses
import json
import math
import os
import re
import sys

import pytest
import torch

from evenflow import _runtime
from evenflow.moe.fused import CONFIG_DIR, MoEConfig, _load_tuned, check_config, choose_config, tuned_config, tuned_key

KEY = dict(num_local=8, num_experts_total=8, top_k=2, hidden=256, inter=128)


def _write(tmp_path, entries):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"configs": {tuned_key(8, 8, 2, 256, 128, 0): entries}}))
    _load_tuned.cache_clear()
    return str(p)


def _get(path, t, mode=0):
    return tuned_config(t, KEY["top_k"], KEY["num_local"], KEY["hidden"], KEY["inter"], mode,
                        num_experts_total=KEY["num_experts_total"], device=None, path=path)


def test_bucket_lookup(tmp_path):
    a = MoEConfig(16, 64, 64, 64, 64, 4, 3, 2, 1)
    b = MoEConfig(32, 128, 64, 128, 64, 8, 4, 1, 1)
    path = _write(tmp_path, {"2": a.as_list(), "64": b.as_list()})
    assert _get(path, 1) is None  # below every bucket: the heuristic decides
    assert _get(path, 2) == a and _get(path, 63) == a
    assert _get(path, 64) == b and _get(path, 100000) == b
    assert _get(path, 64, mode=1) is None  # another format is another key
    assert _get(str(tmp_path / "missing.json"), 64) is None


def test_null_bucket_means_the_heuristic(tmp_path):
    # a tuned bucket where the default was not beaten is null: calls there take choose_config,
    # not the entry of a smaller bucket
    a = MoEConfig(16, 64, 64, 64, 64, 4, 3, 2, 1)
    path = _write(tmp_path, {"2": a.as_list(), "8": None, "64": a.as_list()})
    assert _get(path, 7) == a
    assert _get(path, 8) is None and _get(path, 63) is None
    assert _get(path, 64) == a


def test_invalid_entry_is_ignored_loudly(tmp_path):
    bad = MoEConfig(16, 96, 64, 64, 64)  # 96 is not a power of two
    path = _write(tmp_path, {"1": bad.as_list()})
    with pytest.warns(UserWarning, match="ignoring tuned MoE config"):
        assert _get(path, 4) is None


def test_malformed_entry_is_ignored_loudly_at_load(tmp_path):
    """Round CP's review: an entry of the wrong length (or a non-number) raised TypeError on every call on that GPU
    from the table's load; it is now dropped with a warning naming it, and the rest of the table stands."""
    a = MoEConfig(16, 64, 64, 64, 64)
    path = _write(tmp_path, {"1": [16, 64, 64], "4": ["x"] * 5, "8": a.as_list()})
    with pytest.warns(UserWarning, match=r"ignoring malformed tuned MoE entry .*\['1'\] = \[16, 64, 64\]"):
        assert _get(path, 4) is None  # neither bad bucket is an entry: the heuristic decides
    assert _get(path, 8) == a


def test_check_config_caps_block_m_at_the_task_maps_tile():
    """Round CP's review: a block_m over 256 passed check_config and then failed inside build_moe_index as
    "block_m" (an internal argument's name), or, from a table, on every call; it is refused here, by name."""
    for bm in (512, 1024):
        with pytest.raises(ValueError, match=f"config.block_m must be <= 256, got {bm}"):
            check_config(MoEConfig(bm, 64, 64, 64, 64), 256, 128, 0)
    check_config(MoEConfig(256, 64, 64, 64, 64), 256, 128, 0)


def test_check_config_names_bad_warps_and_stages():
    good = MoEConfig(16, 64, 64, 64, 64)
    for nw in (1, 2, 4, 8, 16):
        check_config(dataclasses.replace(good, num_warps=nw), 256, 128, 0)
    for nw in (0, 3, 32):
        with pytest.raises(ValueError, match="config.num_warps must be 1, 2, 4, 8 or 16"):
            check_config(dataclasses.replace(good, num_warps=nw), 256, 128, 0)
    with pytest.raises(ValueError, match="config.num_stages must be >= 1"):
        check_config(dataclasses.replace(good, num_stages=0), 256, 128, 0)


def test_no_table_on_cpu():
    assert tuned_config(4, 2, 8, 256, 128, 0, num_experts_total=8, device=None) is None


def test_each_gpu_reads_the_table_named_by_its_slug(monkeypatch):
    # A GPU reads configs/<gpu_slug>.json, the file benchmarks/tune_moe.py writes on it (round CE: the lookup knew
    # the H200 only, so a table tuned on another card would have been written and never read); a GPU with no
    # file gets None (the heuristic), never another card's table.
    from evenflow.bench.harness import gpu_slug
    from evenflow.moe import fused

    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3", 2: "NVIDIA B300 SXM6 AC"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    fused._table_of.cache_clear()
    try:
        for index, name in names.items():
            path = os.path.join(CONFIG_DIR, f"{gpu_slug(name)}.json")
            want = path if os.path.exists(path) else None
            assert fused._table_of(index) == want, name
        assert fused._table_of(0).endswith("h200.json")
        assert fused._table_of(1).endswith("h100-80gb.json")  # round CE5's table
        assert fused._table_of(2) is None
    finally:
        fused._table_of.cache_clear()


def test_shipped_tables_are_valid():
    # every entry of every shipped table tiles its own shape (the key names it; "-fast" / "-prom": the
    # fp8_accum="fast" / "promoted" modes' keys, with those modes' rules)
    for name in os.listdir(CONFIG_DIR) if os.path.isdir(CONFIG_DIR) else []:
        if not name.endswith(".json"):
            continue
        data = json.load(open(os.path.join(CONFIG_DIR, name)))
        for key, buckets in data["configs"].items():
            m = re.fullmatch(r"E(\d+)/(\d+)-k(\d+)-H(\d+)-I(\d+)-m(\d)(-fast|-prom)?", key)
            assert m, f"{name}: unknown key {key!r}"
            h, i, mode, fast = int(m[4]), int(m[5]), int(m[6]), m[7] is not None
            accum = {None: "exact", "-fast": "fast", "-prom": "promoted"}[m[7]]
            assert key == tuned_key(int(m[1]), int(m[2]), int(m[3]), h, i, mode, accum)
            for cfg in buckets.values():
                if cfg is not None:  # null: the heuristic
                    check_config(MoEConfig.from_list(cfg), h, i, mode, fast_acc=fast)


def test_tuner_candidates_are_valid():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe

    for case in B.CASES.values():
        for variant, f in tune_moe.FORMATS.items():
            if f.variant in case.skip_variants:
                continue
            for t in tune_moe.BUCKETS:
                cands = tune_moe.candidates(case, f.mode, t, f.fast_acc)
                assert cands[0][0] == "default"
                assert cands[0][1] == choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, f.mode,
                                                    num_experts_total=case.num_experts_total, fast_acc=f.fast_acc)
                assert len(cands) >= 5 and len({c for _, c in cands}) == len(cands)
                for _, c in cands:
                    check_config(c, case.hidden, case.inter, f.mode, fast_acc=f.fast_acc)
                if f.fast_acc and t * case.top_k / case.num_experts_total > 16:
                    # the fp8-wgmma tiles are timed: 64 and 128 rows on 8 warps
                    rows = {c.block_m for _, c in cands if c.num_warps == 8}
                    assert {64, 128} <= rows, (case.name, variant, t, rows)


def test_tuner_offers_down_n_groups_of_the_default_and_the_entry():
    """Past the pair-tile range, from 8 rows per expert and where a config's down GEMM has at most FEW_DOWN_K_STEPS K
    steps, the tuner times the default's and the table entry's down GEMM over each other group of 1, 2, 4 and 8
    n-blocks a program (where they tile H); on pair tiles, with the same K-step rule, over each other of 1, 2 and 4
    (round AK9);
    elsewhere (round AJ1 / AJ2: no gain) it offers none."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS

    case = B.CASES["hy3-tp8"]
    entry = MoEConfig(32, 64, 128, 256, 64)  # 16 n-blocks of 256 over H = 4096
    for t in (512, 4096):
        cands = dict(tune_moe.candidates(case, 1, t, incumbent=entry))
        d = cands["default"]
        assert d.down_n_group == 8  # the heuristic's own group here (round AJ7)
        for g in (1, 2, 4, 8):  # every other group of the entry and of the default
            assert (f"incumbent-dg{g}" in cands) == (g != 1) and (f"default-dg{g}" in cands) == (g != 8)
            if g != 1:
                assert cands[f"incumbent-dg{g}"] == dataclasses.replace(entry, down_n_group=g)
            if g != 8:
                assert cands[f"default-dg{g}"] == dataclasses.replace(d, down_n_group=g)
        assert not any(label.startswith("incumbent") for label in dict(tune_moe.candidates(case, 1, t)))
    # on pair tiles (round AK9): groups of 2 and 4, never 8, of the default and the entry, after every other candidate;
    # a K-split one with its own +defer twin after it
    for t in (tt for tt in tune_moe.BUCKETS if tt * case.top_k <= PAIR_TILE_MAX_PAIRS):
        for mode in (0, 1):
            cands = tune_moe.candidates(case, mode, t, incumbent=entry)
            by = dict(cands)
            d = by["default"]
            for who, base in (("default", d), ("incumbent", entry)):
                for g in (2, 4, 8):
                    assert (f"{who}-dg{g}" in by) == (g != 8), (t, mode, who, g)
                    if g != 8:
                        assert by[f"{who}-dg{g}"] == dataclasses.replace(base, down_n_group=g)
            labels = [label for label, _ in cands]
            first = min(i for i, x in enumerate(labels) if "-dg" in x)
            assert all("-dg" in x for x in labels[first:]), labels
            for i, (label, c) in enumerate(cands):
                if "-dg" in label and c.gu_split_k > 1 and c.block_m == 16 and not c.gu_defer:
                    assert cands[i + 1] == (f"{label}+defer", dataclasses.replace(c, gu_defer=1)), label
    # an entry already grouped at pair tiles is offered at the other groups, 1 and 2, never 8
    t4 = max(tt for tt in tune_moe.BUCKETS if tt * case.top_k <= PAIR_TILE_MAX_PAIRS)
    by4 = dict(tune_moe.candidates(case, 0, t4, incumbent=dataclasses.replace(entry, down_n_group=4)))
    assert [g for g in (1, 2, 4, 8) if f"incumbent-dg{g}" in by4] == [1, 2]
    assert by4["incumbent-dg1"] == entry
    # none below 8 rows per expert past the pair tiles (Hy3 TP8 T = 128: 5.3), or where the down GEMM has more than
    # FEW_DOWN_K_STEPS K steps (Qwen3-30B: I = 768, 12 of 64 in bf16, at pair tiles too)
    qwen = B.CASES["qwen3-30b-a3b"]
    small = next(t for t in tune_moe.BUCKETS if t * qwen.top_k <= PAIR_TILE_MAX_PAIRS)
    for c, t in ((case, 128), (qwen, 4096), (qwen, small)):
        assert not any("-dg" in label for label, _ in tune_moe.candidates(c, 0, t, incumbent=entry)), (c.name, t)
    # a group that does not divide H's n-blocks is never offered (check_config refuses it)
    narrow = dict(tune_moe.candidates(case, 0, 4096, incumbent=MoEConfig(128, 64, 64, 1024, 64)))  # 4 n-blocks
    assert "incumbent-dg4" in narrow and "incumbent-dg8" not in narrow


def test_tuner_pairs_each_split_pair_tile_config_with_its_deferred_twin():
    """At pair-tile batches (T * top_k <= PAIR_TILE_MAX_PAIRS) every K-split 16-row pair-tile candidate comes with its
    twin that
    leaves the gate-up's reduction to the down GEMM (gu_defer=1), right after it; nowhere else is a
    deferred candidate offered; a --max-candidates limit counts a config and its twin as one."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS

    case = B.CASES["hy3-tp8"]
    for t in tune_moe.BUCKETS:
        cands = tune_moe.candidates(case, 1, t)
        deferred = [(lab, c) for lab, c in cands if c.gu_defer]
        if t * case.top_k > PAIR_TILE_MAX_PAIRS:
            assert not deferred, t
            continue
        # (the prefetch twins of the known configs, round BK, keep those configs' deferral: no twin of their own)
        splits = [(lab, c) for lab, c in cands if c.gu_split_k > 1 and c.block_m == 16 and not c.gu_defer
                  and not c.index_tiles and "-pf" not in lab]
        assert splits and len([lab for lab, _ in deferred if "-pf" not in lab]) == len(splits), t
        for i, (lab, c) in enumerate(cands):
            if c in dict(splits).values():
                assert cands[i + 1] == (lab + "+defer", dataclasses.replace(c, gu_defer=1)), (t, lab)
        first = dict(tune_moe.first_candidates(cands, 3))
        bases = [lab for lab, _ in cands if not lab.endswith("+defer")]
        assert [lab for lab in first if not lab.endswith("+defer")] == bases[:3]
        twins = {lab for lab, _ in cands if lab.endswith("+defer")}
        assert {lab + "+defer" for lab in bases[:3]} & twins <= set(first), t  # each kept config's twin too
        assert tune_moe.first_candidates(cands, 0) == cands


def _bench_modules():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import sweep_moe
    import tune_moe

    return B, tune_moe, sweep_moe


def test_tuner_writes_an_entry_only_for_a_win_beyond_noise():
    _, T, _ = _bench_modules()
    assert T.decide({"default": 100.0, "a": 98.0}) == (None, "default within 3%")
    assert T.decide({"default": 100.0, "a": 96.0, "b": 99.0})[0] == "a"
    assert T.decide({"default": 100.0, "a": 96.0}, confirm=(100.0, 98.5))[0] is None  # not confirmed
    assert T.decide({"default": 100.0, "a": 96.0}, confirm=(101.0, 97.0))[0] == "a"
    # a default that fails the rule never wins; any passing candidate is better than it
    assert T.decide({"default": "AssertionError: ...", "a": 120.0, "b": "x"}) == ("a", "default fails the rule")
    assert T.decide({"default": "AssertionError: ...", "b": "x"})[0] is None


def test_tuner_seals_entries_to_their_bucket():
    _, T, _ = _bench_modules()
    cfg = [16, 64, 64, 64, 64, 4, 3, 1, 1]
    configs = {"k": {"1": cfg, "32": None, "128": cfg, "4096": None}}
    T.seal(configs)
    # the entry at 1 now ends at 2, the one at 128 at 256; nothing is added after a null
    assert configs["k"] == {"1": cfg, "2": None, "32": None, "128": cfg, "256": None, "4096": None}


def test_tuner_routes_like_the_benchmark():
    B, T, _ = _bench_modules()
    case = B.CASES["hy3-ep8"]
    gen = torch.Generator().manual_seed(0)
    bias = B.expert_bias(case.num_experts_total, gen)
    a = T.point_inputs(case, 64, 2, seed=0)
    b = T.point_inputs(case, 64, 2, seed=0)
    assert all(torch.equal(u, v) for pa, pb in zip(a, b) for u, v in zip(pa, pb))  # deterministic per point
    assert not torch.equal(a[0][1], a[1][1])  # rotated copies route differently
    # the same routing generator and bias as benchmarks/moe.py: redrawn from the same stream, identical
    g = torch.Generator().manual_seed(0 * 1_000_003 + 64)
    ids, tw = B.make_routing(64, case, g, bias)
    assert torch.equal(ids, a[0][1]) and torch.equal(tw, a[0][2])
    assert a[0][0].shape == (64, case.hidden) and a[0][0].dtype == torch.bfloat16


def test_tuner_covers_every_benchmark_shape():
    B, T, _ = _bench_modules()
    assert set(T.CASES) == set(B.CASES)  # Hy3 TP8 and EP8 are tunable, not only Qwen3
    # one compile shape serves every candidate of every case (kernels depend on config and format only)
    h, i = T.COMPILE_SHAPE
    for case in B.CASES.values():
        for f in T.FORMATS.values():
            if f.variant in case.skip_variants:
                continue
            for t in T.BUCKETS:
                for _, c in T.candidates(case, f.mode, t, f.fast_acc):
                    check_config(c, h, i, f.mode, fast_acc=f.fast_acc)


def test_index_sweep_builds_what_fused_moe_builds(device):
    from evenflow.moe.routing import max_tiles
    from evenflow.reference.moe import moe_index_reference
    from evenflow.testing import assert_exact

    B, _, S = _bench_modules()
    case = B.CASES["hy3-ep8"]
    gen = torch.Generator().manual_seed(0)
    ids, _ = B.make_routing(40, case, gen, B.expert_bias(case.num_experts_total, gen))
    ids = ids.to(device)
    bm = choose_config(40, case.top_k, case.num_local, case.hidden, case.inter, 0,
                       num_experts_total=case.num_experts_total).block_m
    ref = moe_index_reference(ids, case.num_local, case.ep_rank, bm, max_tiles(ids.numel(), case.num_local, bm))
    for _, multi in S.INDEX_BUILDS:
        idx = S.index_call(case, ids, 40, multi)()
        assert idx.block_m == bm
        for got, want in zip(idx[:5], ref):
            assert_exact(got, want)
    rows = [{"case": "hy3-ep8", "variant": "index-multi", "batch": 40, "us": 3.21, "default": True},
            {"case": "hy3-tp8", "variant": "index-1prog", "batch": 40, "error": "RuntimeError: x"}]
    table = S.index_table(rows).splitlines()
    assert table[0].count("|") == 2 * len(S.INDEX_CASES) + 2 and "3.2*" in table[2] and "RuntimeError" in table[2]


def _tiny_tuner_case(monkeypatch):
    """(harness module, tuner module) with a tiny case "tiny" (8 experts, top-2, H 256, I 128)
    registered in the MoE benchmark's cases and the tuner set to run on the CPU."""
    import dataclasses

    from evenflow.bench import harness as H

    B, T, _ = _bench_modules()
    tiny = dataclasses.replace(B.CASES["qwen3-30b-a3b"], name="tiny", num_experts_total=8, num_local=8, top_k=2,
                               hidden=256, inter=128)
    monkeypatch.setitem(B.CASES, "tiny", tiny)
    monkeypatch.setattr(T, "DEVICE", "cpu")
    return H, T


@pytest.mark.skipif(not _runtime.interpreting(), reason="drives the tuner on CPU tensors through the interpreter")
def test_tuner_dry_run_on_cpu(tmp_path, monkeypatch):
    # the whole tuning loop on a tiny case in the interpreter, with a stub timer under which the
    # 4-stage candidates are 10% faster: those win where timed, the rest is null, the table is sealed
    H, T = _tiny_tuner_case(monkeypatch)
    monkeypatch.setattr(H, "time_graph", lambda fns: 90.0 if fns[0].__defaults__[1].num_stages == 4 else 100.0)
    table = tmp_path / "t.json"
    # 5 candidates a point: the default, its prefetch twins (round BK: one in bf16, three in fp8), then st4
    assert T.main(["--cases", "tiny", "--formats", "bf16,fp8-tensor", "--buckets", "1,4", "--max-candidates", "5",
                   "--workers", "1", "--budget-s", "600", "--table", str(table)]) == 0
    data = json.loads(table.read_text())
    for mode in (0, 1):
        key = tuned_key(8, 8, 2, 256, 128, mode)
        entries, times = data["configs"][key], data["timings"][key]
        assert set(times) == {"1", "4"} and all(r["default_us"] == 100.0 for r in times.values())
        for t in ("1", "4"):
            assert MoEConfig.from_list(entries[t]).num_stages == 4 and times[t]["entry"] == "st4"
        assert entries["8"] is None  # sealed: the bucket-4 entry covers T = 4..7 only


def test_tuner_keeps_an_entry_unless_beaten_in_every_head_to_head_timing():
    _, T, _ = _bench_modules()
    assert T.keep_incumbent([(84.0, 87.9), (83.5, 88.0)])  # the entry faster: kept
    assert T.keep_incumbent([(84.0, 83.9), (83.5, 84.1)])  # one timing each way: kept (noise)
    assert T.keep_incumbent([(75.05, 74.69), (75.25, 74.87)])  # faster twice, by 0.5% (W1): inside the noise, kept
    assert not T.keep_incumbent([(90.0, 84.0), (89.0, 85.5)])  # the new choice faster both times: replaced


@pytest.mark.skipif(not _runtime.interpreting(), reason="drives the tuner on CPU tensors through the interpreter")
@pytest.mark.parametrize("scenario", ["entry-faster", "entry-slower", "null-entry-faster", "null-entry-slower",
                                      "nothing-passes", "sample-bias"])
def test_tuner_dry_run_keeps_or_replaces_an_existing_entry(tmp_path, monkeypatch, scenario):
    # A table with an entry (2 stages) at T = 1 and one the current code refuses at T = 4 (persistent = 9).
    # entry-*: the stub timer makes the 4-stage candidates 10% faster than the default (the new decision: st4)
    # and the existing entry faster still (kept, with its head-to-head timings) or slower (replaced);
    # null-*: every candidate as fast as the default (the new decision: null), the entry 1% faster (kept: it is
    # compared with the heuristic) or 3% slower (replaced by null: beyond the tuner's REPLACE_MARGIN);
    # nothing-passes: every candidate fails the rule and the entry passes it (kept, untimed); sample-bias (round
    # BK4): the entry is slower than the new decision on the point's first sample of draws and faster on its second,
    # which the second head-to-head timing takes (kept; timed twice on one sample it would have been replaced), and
    # the new decision's win over the default is confirmed on the second sample. The refused entry is dropped in
    # every scenario.
    import evenflow.testing

    H, T = _tiny_tuner_case(monkeypatch)
    old = [16, 64, 64, 64, 64, 4, 2, 1, 1]
    entry_us = {"entry-faster": 80.0, "entry-slower": 95.0, "null-entry-faster": 99.0,
                "null-entry-slower": 103.0, "nothing-passes": 100.0, "sample-bias": 95.0}[scenario]
    samples = set()

    def timer(fns):
        c, sample = fns[0].__defaults__[1:3]
        samples.add(sample)
        if c.num_stages == 2:
            return 85.0 if scenario == "sample-bias" and sample else entry_us
        return 90.0 if c.num_stages == 4 and scenario.startswith(("entry", "sample")) else 100.0
    monkeypatch.setattr(H, "time_graph", timer)
    if scenario == "nothing-passes":
        real = evenflow.testing.assert_within_rule

        def rule(out, ref, base, what="output", **kw):
            if not what.endswith(" incumbent"):  # the entry itself (not its twins, e.g. incumbent-pf2)
                raise AssertionError(f"{what}: stub rule failure")
            return real(out, ref, base, what=what, **kw)
        monkeypatch.setattr(evenflow.testing, "assert_within_rule", rule)
    table = tmp_path / "t.json"
    key = tuned_key(8, 8, 2, 256, 128, 0)
    table.write_text(json.dumps({"configs": {key: {"1": old, "4": [16, 64, 64, 64, 64, 4, 3, 1, 1, 0, 9]}}}))
    # 5 candidates a point: the default, the entry's and the default's prefetch twins (round BK), gk128, st4
    assert T.main(["--cases", "tiny", "--formats", "bf16", "--buckets", "1,4", "--max-candidates", "5",
                   "--workers", "1", "--budget-s", "600", "--table", str(table)]) == 0
    data = json.loads(table.read_text())
    row, got = data["timings"][key]["1"], data["configs"][key]["1"]
    assert row["incumbent"]["config"] == old, row
    if scenario == "nothing-passes":
        assert got == old and row["entry"] == "incumbent" and "head_to_head_us" not in row["incumbent"], row
    elif scenario == "sample-bias":
        assert got == old and row["entry"] == "incumbent", row
        assert row["incumbent"]["head_to_head_us"] == [[95.0, 90.0], [85.0, 90.0]], row
        assert row["confirm_us"] == [100.0, 90.0] and samples == {0, 1}, row
    else:
        assert len(row["incumbent"]["head_to_head_us"]) == 2, row
        if scenario in ("entry-faster", "null-entry-faster"):
            assert got == old and row["entry"] == "incumbent", row
        elif scenario == "entry-slower":
            assert MoEConfig.from_list(got).num_stages == 4 and row["entry"] == "st4", row
        else:
            assert got is None and row["entry"] is None, row
    # T = 4: the old entry (persistent = 9 programs per SM) is refused by check_config: dropped, the new decision stands
    assert "dropped" in data["timings"][key]["4"]["incumbent"], data["timings"][key]["4"]
    want4 = 4 if scenario in ("entry-faster", "entry-slower", "sample-bias") else None
    got4 = data["configs"][key]["4"]
    assert (got4 is None) if want4 is None else MoEConfig.from_list(got4).num_stages == 4, got4


def test_tuner_offers_index_tiles_at_pair_tile_batches():
    """In the part of the pair-tile range that round AK added (I3_PAIR_TILE_PAIRS < T * top_k <=
    PAIR_TILE_MAX_PAIRS, on 16-row tiles) the tuner times the default's and the table entry's twins on index tiles
    (``index_tiles``) right after the default (an entry that keeps index tiles: its pair-tile twin); below it (round
    I3's range) and past it none is offered."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS

    for name in ("hy3-tp8", "qwen3-30b-a3b"):
        case = B.CASES[name]
        for mode in (0, 1, 2) if name != "hy3-tp8" else (0, 1):  # Hy3 TP8's I = 192 has no 128-deep blocks
            for t in tune_moe.BUCKETS:
                d = dict(tune_moe.candidates(case, mode, t))["default"]
                entry = dataclasses.replace(d, num_stages=d.num_stages + 1)
                kept = dataclasses.replace(entry, index_tiles=1)
                for inc, label, twin in ((entry, "incumbent-index", kept), (kept, "incumbent-pairs", entry)):
                    cands = tune_moe.candidates(case, mode, t, incumbent=inc)
                    got = dict(cands)
                    labels = [lab for lab, _ in cands if not lab.endswith("+defer")]
                    if tune_moe.I3_PAIR_TILE_PAIRS < t * case.top_k <= PAIR_TILE_MAX_PAIRS and d.block_m == 16:
                        assert labels[:3] == ["default", label, "default-index"], (name, mode, t)
                        assert got[label] == twin and got["default-index"] == dataclasses.replace(d, index_tiles=1)
                    else:
                        assert not [lab for lab in labels if lab.endswith(("-index", "-pairs"))], (name, mode, t)
                if tune_moe.I3_PAIR_TILE_PAIRS < t * case.top_k <= PAIR_TILE_MAX_PAIRS and d.block_m == 16:
                    # an entry that defers its gate-up reduction (a pair-tile path): its index-tile twin defers nothing
                    deferring = dataclasses.replace(entry, gu_split_k=2, gu_defer=1)
                    got = dict(tune_moe.candidates(case, mode, t, incumbent=deferring))
                    assert got["incumbent-index"] == dataclasses.replace(deferring, index_tiles=1, gu_defer=0)


def test_tuner_offers_prefetch_twins_at_pair_tile_batches():
    """Round BK: at pair-tile batches the tuner times the known configs that run pair tiles (the default, the table's
    entry) with each other choice of ``prefetch`` (bf16: the down GEMM's bit alone, its gate-up being the layer's
    first kernel), after the default and its index-tile twins; past the pair-tile range none."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS

    for name in ("hy3-ep8", "qwen3-30b-a3b"):
        case = B.CASES[name]
        for mode in (0, 1, 2):
            for t in tune_moe.BUCKETS:
                d = dict(tune_moe.candidates(case, mode, t))["default"]
                entry = dataclasses.replace(d, num_stages=d.num_stages + 1, prefetch=2)
                cands = tune_moe.candidates(case, mode, t, incumbent=entry)
                got = dict(cands)
                pf = [lab for lab, _ in cands if "-pf" in lab]
                if t * case.top_k <= PAIR_TILE_MAX_PAIRS and d.block_m == 16 and not d.index_tiles:
                    bits = (0, 2) if mode == 0 else (0, 1, 2, 3)
                    assert pf == [f"incumbent-pf{b}" for b in bits if b != 2] + [f"default-pf{b}" for b in bits if b],\
                        (name, mode, t, pf)
                    assert got["incumbent-pf0"] == dataclasses.replace(entry, prefetch=0)
                    labels = [lab for lab, _ in cands if not lab.endswith("+defer")]
                    first = labels.index(pf[0])
                    assert labels[first:first + len(pf)] == pf and all(
                        not lab.startswith(("default-", "incumbent-")) or lab.endswith(("-index", "-pairs"))
                        for lab in labels[1:first]), (name, mode, t, labels)
                else:
                    assert not pf, (name, mode, t, pf)


def test_config_prefetch_is_checked():
    with pytest.raises(ValueError, match="config.prefetch"):
        check_config(MoEConfig(16, 64, 64, 64, 64, prefetch=4), 256, 128, 0)
    assert MoEConfig.from_list(MoEConfig(16, 64, 64, 64, 64, prefetch=3).as_list()).prefetch == 3
    assert MoEConfig.from_list([16, 64, 64, 64, 64, 4, 3, 1, 1, 0, 0, 1, 0]).prefetch == 0  # a table row before it


def test_config_index_tiles_is_checked():
    with pytest.raises(ValueError, match="index_tiles"):
        check_config(MoEConfig(16, 64, 64, 64, 64, index_tiles=2), 256, 128, 0)
    assert MoEConfig.from_list(MoEConfig(16, 64, 64, 64, 64, index_tiles=1).as_list()).index_tiles == 1
    assert MoEConfig.from_list([16, 64, 64, 64, 64, 4, 3, 1, 1, 0, 0, 1]).index_tiles == 0  # a table row before it


@pytest.mark.skipif(not _runtime.interpreting(), reason="drives the tuner on CPU tensors through the interpreter")
def test_tuner_dry_run_times_the_entrys_down_n_groups(tmp_path, monkeypatch):
    # Past the pair-tile range (from 8 rows per expert, the entry's down GEMM two K steps) the main loop hands
    # candidates() the point's entry: with --max-candidates 2 the
    # default and the entry over 2 n-blocks a program are timed; the stub timer makes the latter 10% faster than
    # the default and than the entry itself, so it is written (after beating the entry head to head)
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS

    H, T = _tiny_tuner_case(monkeypatch)
    t = PAIR_TILE_MAX_PAIRS  # top-2 over 8 experts: 2 * PAIR_TILE_MAX_PAIRS pairs (index tiles), 8 rows an expert
    old = [16, 64, 64, 64, 64, 4, 2, 1, 1]
    monkeypatch.setattr(H, "time_graph", lambda fns: 90.0 if fns[0].__defaults__[1].down_n_group == 2 else 100.0)
    table = tmp_path / "t.json"
    key = tuned_key(8, 8, 2, 256, 128, 0)
    table.write_text(json.dumps({"configs": {key: {str(t): old}}}))
    assert T.main(["--cases", "tiny", "--formats", "bf16", "--buckets", str(t), "--max-candidates", "2",
                   "--workers", "1", "--budget-s", "600", "--table", str(table)]) == 0
    data = json.loads(table.read_text())
    row, got = data["timings"][key][str(t)], data["configs"][key][str(t)]
    assert set(row["tried"]) == {"default", "incumbent-dg2"}, row
    assert row["entry"] == "incumbent-dg2" and len(row["incumbent"]["head_to_head_us"]) == 2, row
    assert MoEConfig.from_list(got) == dataclasses.replace(MoEConfig.from_list(old), down_n_group=2), got


@pytest.mark.skipif(not _runtime.interpreting(), reason="drives the tuner on CPU tensors through the interpreter")
def test_tuner_dry_run_fast_formats_write_their_own_keys(tmp_path, monkeypatch):
    # --formats fp8-tensor-fast,fp8-block-fast: fused_moe(fp8_accum="fast") is timed (the stub
    # timer sees the calls' keyword), checked against the fast-accumulation baseline, and written
    # under the "-fast" keys, next to (never over) the default mode's entries
    H, T = _tiny_tuner_case(monkeypatch)
    seen = []

    def timer(fns):
        fns[0]()
        return 100.0
    monkeypatch.setattr(H, "time_graph", timer)
    import evenflow

    real = evenflow.fused_moe
    monkeypatch.setattr(evenflow, "fused_moe", lambda *a, **kw: seen.append(kw.get("fp8_accum")) or real(*a, **kw))
    table = tmp_path / "t.json"
    keep = tuned_key(8, 8, 2, 256, 128, 1)
    table.write_text(json.dumps({"configs": {keep: {"1": [16, 64, 128, 64, 128, 4, 3, 1, 1]}}}))
    assert T.main(["--cases", "tiny", "--formats", "fp8-tensor-fast,fp8-block-fast", "--buckets", "1",
                   "--max-candidates", "2", "--workers", "1", "--budget-s", "600", "--table", str(table)]) == 0
    data = json.loads(table.read_text())
    for mode in (1, 2):
        key = tuned_key(8, 8, 2, 256, 128, mode, "fast")
        assert key.endswith("-fast") and data["timings"][key]["1"]["default_us"] == 100.0
        assert data["configs"][key]["1"] is None  # no win: the heuristic
    assert data["configs"][keep]["1"] == [16, 64, 128, 64, 128, 4, 3, 1, 1]  # the default mode's entry kept
    assert seen and set(seen) == {"fast"}
    assert "-fast" in data["rule"]
    with pytest.raises(SystemExit, match="unknown format"):
        T.main(["--cases", "tiny", "--formats", "fp8-fast", "--table", str(table)])


def test_benchmark_and_tuner_time_enough_routing_draws_at_small_batches():
    """At T <= 16 a point is timed over >= 8 routing draws, a multiple of the weight copies it cycles
    (so the graph's wrap-around reuses no copy sooner than the others); above, one draw per copy.
    Under EP one draw's pairs on the rank are far from their mean at such batches: the tuner's draws
    for Hy3 EP8 bf16 (weight copies as the tuner picks them) now average within 15% of the expected
    pairs at every T <= 16, where the draws it timed before (one per copy) missed T = 8 and 16 by 28%."""
    B, T, _ = _bench_modules()
    assert [B.routing_draws(t, 1) for t in (1, 2, 16, 32, 4096)] == [8, 8, 8, 1, 1]
    assert [B.routing_draws(2, n) for n in (2, 3, 4)] == [8, 9, 8] and B.routing_draws(64, 3) == 3
    case = B.CASES["hy3-ep8"]
    gen = torch.Generator().manual_seed(0)
    bias = B.expert_bias(case.num_experts_total, gen)
    many, _ = B.make_routing(20000, case, torch.Generator().manual_seed(1), bias)
    per_token = B.routing_stats(many, case).local_pairs / 20000  # 0.78 of a token's 8 pairs on rank 0
    misses_before = []
    for t in (1, 2, 4, 8, 16):
        probe = T.point_inputs(case, t, 1)
        n_rot = B.rotations(B.routing_stats(probe[0][1], case).distinct_experts * B.expert_bytes(case, "bf16"),
                            60 * 2**20)
        draws = T.point_inputs(case, t, B.routing_draws(t, n_rot))
        pairs = [B.routing_stats(ids, case).local_pairs for _, ids, _ in draws]
        expected = t * per_token
        assert abs(sum(pairs) / len(pairs) - expected) <= 0.15 * expected + 0.05, (t, pairs, expected)
        misses_before.append(abs(sum(pairs[:n_rot]) / n_rot - expected) / expected)
    assert max(misses_before) > 0.25  # the one-per-copy draws (T = 8, 16: 8 and 9 pairs against 6.3, 12.5)


def test_tuner_shares_its_budget_by_candidates():
    """The timing budget left is split over the points still to time in proportion to their candidates,
    so a decode point (a config and its deferred twin: ~2x the candidates) is not cut short while later
    points finish early; the shares of all remaining points add up to the time left."""
    _, T, _ = _bench_modules()
    left, cands = 300.0, [29, 15, 13, 11, 11]
    shares = [T.point_share(left * sum(cands[i:]) / sum(cands), cands[i:]) for i in range(len(cands))]
    assert math.isclose(sum(shares), left) and shares[0] > 2 * shares[3]
    assert math.isclose(T.point_share(10.0, [5]), 10.0) and T.point_share(10.0, [0, 0]) == 0.0


def test_wide_down_switch_widens_only_the_exact_fp8_32_row_tiles(monkeypatch):
    """``fused.WIDE_DOWN_N`` (round CF, on by default since round CG): on, choose_config gives the exact fp8 mode's
    32-row tiles (above 16 rows per expert) a 128-wide down N block where H is a multiple of 128, with the down K
    split and n-group re-derived from it by the heuristic's own rules, a valid config; every other point, bf16 and
    the fp8-MMA modes take the same config either way. The probe that times it (benchmarks/probe_moe_wide_down.py)
    offers exactly those pairs, and leaves the switch as it found it."""
    from evenflow.moe import fused

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import probe_moe_wide_down as probe

    assert fused.WIDE_DOWN_N is True
    shapes = [(c.num_experts_total, c.num_local, c.top_k, c.hidden, c.inter) for c in probe.SHARDS.values()]
    shapes += [(c.num_experts_total, c.num_local, c.top_k, c.hidden, c.inter) for c in probe.M.CASES.values()]
    shapes += [(8, 8, 2, 128, 256), (8, 8, 2, 160, 256)]  # H 128 (one 128 block); H 160 (not a multiple: stays)
    widened = 0
    for e_tot, e_loc, k, h, i in shapes:
        for mode in (0, 1, 2):
            if mode == 2 and (h % 128 or i % 128):
                continue
            for t in (1, 16, 64, 256, 512, 1024, 4096):
                for fast in (False, True) if mode else (False,):
                    args = (t, k, e_loc, h, i, mode)
                    kw = dict(num_experts_total=e_tot, sms=132, fast_acc=fast)
                    monkeypatch.setattr(fused, "WIDE_DOWN_N", False)
                    off = choose_config(*args, **kw)
                    monkeypatch.setattr(fused, "WIDE_DOWN_N", True)
                    on = choose_config(*args, **kw)
                    rows = t * k * (e_loc / e_tot) / e_loc
                    if mode and not fast and rows > 16 and h % 128 == 0:
                        assert off.block_m == 32 and on.down_block_n == 128, (args, off, on)
                        check_config(on, h, i, mode)
                        assert on == fused.replace(off, down_block_n=128, down_split_k=on.down_split_k,
                                                   down_n_group=on.down_n_group), (args, off, on)
                        # the down K split and n-group re-derived by the heuristic's own rules at the wider block
                        local_pairs = t * k * e_loc / e_tot
                        busy = max(1, min(e_loc, math.ceil(local_pairs)), math.ceil(local_pairs / 32))
                        assert on.down_split_k == fused._split_k(i, on.down_block_k, busy * (h // 128), 2 * 132, 1)
                        assert on.down_n_group == fused._down_n_group(on, rows, h, i, False,
                                                                      fused.FEW_DOWN_K_STEPS)
                        widened += off != on
                    else:
                        assert on == off, (args, fast, off, on)
    assert widened >= 20, widened  # most points above 16 rows per expert had the 64-wide default
    for before in (False, True):  # the probe leaves the switch as it found it
        monkeypatch.setattr(fused, "WIDE_DOWN_N", before)
        assert probe.configs(probe.SHARDS["hy3-tp2"], "fp8-tensor", 512) is not None
        assert fused.WIDE_DOWN_N is before
    monkeypatch.setattr(fused, "WIDE_DOWN_N", False)
    for name, case in probe.SHARDS.items():
        for variant in ("fp8-tensor", "fp8-block"):
            if variant in case.skip_variants:
                continue
            for t in (256, 512, 4096):
                pair = probe.configs(case, variant, t)
                assert fused.WIDE_DOWN_N is False
                rows = t * case.top_k / case.num_experts_total
                if rows <= 16:
                    assert pair is None, (name, variant, t)
                else:
                    assert pair[1].down_block_n == 128 and pair[0].down_block_n < 128, (name, variant, t, pair)


def test_deep_k_switch_deepens_only_bf16_small_row_tiles_from_four_tokens(monkeypatch):
    """``fused.DEEP_K_BF16`` (round CG, on by default since CG2): on, choose_config gives bf16's 16- and 32-row
    tiles (at most 32 rows per expert) 128-deep K steps in both GEMMs from DEEP_K_MIN_TOKENS tokens, where H and I
    take 128 times the K splits the 64-deep tile derived; those splits, the tile and every other field stay (the
    down n-group by the heuristic's own rule); the config is valid; fp8, 1-3 tokens, larger tiles and sizes 128 does
    not divide take the same config either way. The probe's deep-k mode offers exactly those pairs and leaves the
    switch as it found it; with the switch on, the tuner still offers the 64-deep tile (``gk64``)."""
    from evenflow.moe import fused

    B, T, _ = _bench_modules()  # puts benchmarks/ on the path
    import probe_moe_wide_down as probe

    assert fused.DEEP_K_BF16 is True and fused.DEEP_K_MIN_TOKENS == 4
    shapes = [(c.num_experts_total, c.num_local, c.top_k, c.hidden, c.inter) for c in probe.SHARDS.values()]
    shapes += [(c.num_experts_total, c.num_local, c.top_k, c.hidden, c.inter) for c in probe.M.CASES.values()]
    shapes += [(8, 8, 2, 128, 256), (8, 8, 2, 192, 256), (8, 8, 2, 256, 64)]  # 128 divides both / not H / not I
    deepened = 0
    for e_tot, e_loc, k, h, i in shapes:
        for mode in (0, 1, 2):
            if mode == 2 and (h % 128 or i % 128):
                continue
            for t in (1, 2, 3, 4, 8, 16, 64, 256, 512, 1024, 4096):
                args = (t, k, e_loc, h, i, mode)
                kw = dict(num_experts_total=e_tot, sms=132)
                monkeypatch.setattr(fused, "DEEP_K_BF16", False)
                off = choose_config(*args, **kw)
                monkeypatch.setattr(fused, "DEEP_K_BF16", True)
                on = choose_config(*args, **kw)
                if mode == 0 and t >= 4 and off.block_m <= 32 and h % (128 * off.gu_split_k) == 0 \
                        and i % (128 * off.down_split_k) == 0:
                    assert (on.gu_block_k, on.down_block_k) == (128, 128), (args, off, on)
                    check_config(on, h, i, mode)
                    assert on == fused.replace(off, gu_block_k=128, down_block_k=128), (args, off, on)
                    deepened += off != on
                else:
                    assert on == off, (args, off, on)
    assert deepened >= 30, deepened  # 35 of the points above
    # independent of the rule's expression: points written out (E, local, k, H, I, T -> gate-up / down BLOCK_K on)
    monkeypatch.setattr(fused, "DEEP_K_BF16", True)
    for e_tot, e_loc, k, h, i, t, want in (
            (128, 128, 8, 2048, 768, 64, 128), (128, 128, 8, 2048, 768, 512, 128),  # Qwen3-30B: 16 / 32 rows
            (128, 128, 8, 2048, 768, 4, 128), (128, 128, 8, 2048, 768, 2, 64),  # from 4 tokens only
            (128, 128, 8, 2048, 768, 1024, 64),  # 64 rows per expert: a wgmma tile, not deepened
            (192, 192, 8, 4096, 192, 64, 64),  # Hy3 TP8: I = 192 takes no 128-deep down step
            (256, 256, 8, 7168, 256, 256, 128), (192, 96, 8, 4096, 1536, 8, 128)):  # DeepSeek-V3 TP8, Hy3 EP2
        c = choose_config(t, k, e_loc, h, i, 0, num_experts_total=e_tot, sms=132)
        assert (c.gu_block_k, c.down_block_k) == (want, want), (e_tot, h, i, t, c)
    for before in (False, True):  # the probe leaves the switch as it found it
        monkeypatch.setattr(fused, "DEEP_K_BF16", before)
        pair = probe.configs(probe.SHARDS["hy3-tp2"], "bf16", 64, switch="DEEP_K_BF16")
        assert pair is not None and (pair[0].gu_block_k, pair[1].gu_block_k) == (64, 128), pair
        assert fused.DEEP_K_BF16 is before
        assert probe.configs(probe.SHARDS["hy3-tp2"], "bf16", 2, switch="DEEP_K_BF16") is None
    # the tuner times the 64-deep tile (the heuristic's with the switch off) wherever the switch made the default
    # 128 deep, and the 128-deep one wherever it did not
    case = B.CASES["qwen3-30b-a3b"]
    for t in (64, 512):
        args = (t, case.top_k, case.num_local, case.hidden, case.inter, 0)
        monkeypatch.setattr(fused, "DEEP_K_BF16", False)
        shallow = choose_config(*args, num_experts_total=case.num_experts_total)
        for on in (False, True):
            monkeypatch.setattr(fused, "DEEP_K_BF16", on)
            cands = dict(T.candidates(case, 0, t))
            assert (cands["default"] == shallow) is not on, (t, cands["default"])
            assert ("gk64" in cands) is on, (t, list(cands))
            if on:
                assert cands["gk64"] == shallow, (t, cands["gk64"], shallow)
            else:
                assert cands["gk128"].gu_block_k == cands["gk128"].down_block_k == 128, (t, cands["gk128"])


def test_the_memoised_heuristic_takes_every_switch_through_its_key(monkeypatch):
    """choose_config keeps its answers per shape, batch and module switch (``fused._heuristic``, round CM: 17% of an
    eager fused_moe call's host time at T = 1 in that round's profile). Its body reads no module-level value but
    through the key (a switch read otherwise would be served stale after a flip), and the helpers it calls read none
    (``_down_n_group`` takes FEW_DOWN_K_STEPS from it); a flip of each switch after a first call at a point it changes
    is seen, and flipping back gives the first answer again."""
    from evenflow.moe import fused

    def module_values(fn):
        return {n for n in fn.__code__.co_names if n in vars(fused) and not callable(getattr(fused, n))
                and not isinstance(getattr(fused, n), type(fused))}

    assert module_values(fused._heuristic.__wrapped__) == set()
    for helper in (fused._split_k, fused._largest_divisor, fused.down_k_steps, fused._down_n_group):
        assert module_values(helper) == set(), helper.__name__
    assert "few_down_k_steps" in fused._heuristic.__wrapped__.__code__.co_varnames
    # (switch, a point whose config it changes: T, k, E, H, I, mode)
    for name, on, off, point in (("WIDE_DOWN_N", True, False, (512, 8, 128, 2048, 768, 1)),
                                 ("DEEP_K_BF16", True, False, (64, 8, 128, 2048, 768, 0)),
                                 ("DEEP_K_MIN_TOKENS", 4, 128, (64, 8, 128, 2048, 768, 0)),
                                 ("FEW_DOWN_K_STEPS", 4, 1, (256, 8, 192, 4096, 192, 0))):
        monkeypatch.setattr(fused, name, on)
        first = choose_config(*point, sms=132)
        monkeypatch.setattr(fused, name, off)
        flipped = choose_config(*point, sms=132)
        assert flipped != first, name
        assert flipped == fused._heuristic.__wrapped__(*point, None, 132, False, (
            fused.WIDE_DOWN_N, fused.DEEP_K_BF16, fused.DEEP_K_MIN_TOKENS, fused.FEW_DOWN_K_STEPS)), name
        monkeypatch.setattr(fused, name, on)
        assert choose_config(*point, sms=132) is first, name


def test_a_tuned_lookup_is_kept_with_the_table_it_read(tmp_path):
    """tuned_config keeps each lookup's answer with the loaded table (round CM: the key's string, the bucket search
    and check_config cost tens of us of host time an eager call): the same answer again, and a table loaded again
    (``_load_tuned.cache_clear()``, a rewritten file) answers from its own entries."""
    path = _write(tmp_path, {"1": [16, 64, 64, 64, 64], "8": [32, 64, 64, 64, 64]})
    first = _get(path, 4)
    assert first == MoEConfig(16, 64, 64, 64, 64) and _get(path, 4) is first
    assert _get(path, 8) == MoEConfig(32, 64, 64, 64, 64)
    path = _write(tmp_path, {"1": [16, 32, 64, 64, 64]})
    assert _get(path, 4) == MoEConfig(16, 32, 64, 64, 64)
