"""Tuned MoE config table: lookup rules (largest bucket <= T, fallbacks) and the tuner's candidates."""
import json
import os
import sys

import pytest

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


def test_invalid_entry_is_ignored_loudly(tmp_path):
    bad = MoEConfig(16, 96, 64, 64, 64)  # 96 is not a power of two
    path = _write(tmp_path, {"1": bad.as_list()})
    with pytest.warns(UserWarning, match="ignoring tuned MoE config"):
        assert _get(path, 4) is None


def test_no_table_on_cpu():
    assert tuned_config(4, 2, 8, 256, 128, 0, num_experts_total=8, device=None) is None


def test_shipped_tables_are_valid():
    # every entry of every shipped table tiles its own shape (the key names it)
    for name in os.listdir(CONFIG_DIR) if os.path.isdir(CONFIG_DIR) else []:
        if not name.endswith(".json"):
            continue
        data = json.load(open(os.path.join(CONFIG_DIR, name)))
        for key, buckets in data["configs"].items():
            h = int(key.split("-H")[1].split("-")[0])
            i = int(key.split("-I")[1].split("-")[0])
            mode = int(key.split("-m")[1])
            for cfg in buckets.values():
                check_config(MoEConfig.from_list(cfg), h, i, mode)


def test_tuner_candidates_are_valid():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe as B
    import tune_moe

    for case in B.CASES.values():
        for variant, (_, mode) in tune_moe.FORMATS.items():
            if variant in case.skip_variants:
                continue
            for t in tune_moe.BUCKETS:
                cands = tune_moe.candidates(case, mode, t)
                assert cands[0][0] == "default"
                assert cands[0][1] == choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, mode,
                                                    num_experts_total=case.num_experts_total)
                assert len(cands) >= 5 and len({c for _, c in cands}) == len(cands)
