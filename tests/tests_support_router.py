"""Shared by the router GEMM tests: inputs, one checked call of a forced fp32 path, the tuner module."""
import importlib.util
import pathlib

import torch

import evenflow
from evenflow.testing import assert_fp32_gemm_within_bound, poisoned


def router_inputs(m, n, k, device, std=0.02, seed=None):
    """bf16 activations [m, k] and an fp32 weight [n, k] of router scale."""
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    w = torch.randn(n, k, device=device, generator=g) * std
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    return x, w


def run_fp32_config(x, w, cfg, what):
    """router_gemm with ``cfg`` forced: writes the given ``out``, is within the fp32 bound
    (the rule plus K u |x|.|w|), and a second call is bitwise the same. Returns the weight."""
    rw = evenflow.RouterWeight(w)
    out = poisoned((x.shape[0], w.shape[0]), torch.float32, x.device)
    assert evenflow.router_gemm(x, rw, out, config=cfg) is out
    assert_fp32_gemm_within_bound(out, x, w, what)
    assert torch.equal(out, evenflow.router_gemm(x, rw, config=cfg)), f"{what}: not deterministic"
    return rw


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_tuner():
    """``benchmarks/tune_router.py`` as a module (its candidate lists are what the tests build and compile)."""
    return load_benchmark("tune_router")


def one_block_table_entries() -> list[tuple[int, int, int, dict]]:
    """(M bucket, N, K, config) of every committed table entry (each GPU's ``configs/*.json``) that ``router_gemm``
    runs as the fp32-simt one-block build (K within one block), without repeats. Every table must have at least
    five: its K4096, LongCat-Lite and Qwen3 entries at M = 1 and 4 have been one-block tiles on each GPU tuned."""
    import json

    from evenflow.router import dispatch

    seen, out = set(), []
    tables = sorted(dispatch._table_dir().glob("*.json"))
    assert tables, "no committed router table"
    for path in tables:
        table = json.loads(path.read_text())
        rows = [(e["m_max"], e["N"], e["K"], e["config"]) for e in table["entries"]
                if e["config"]["path"] == "fp32-simt" and e["K"] <= e["config"]["block_k"]]
        assert len(rows) >= 5, (path.name, rows)
        for m, n, k, c in rows:
            key = (m, n, k, tuple(sorted(c.items())))
            if key not in seen:
                seen.add(key)
                out.append((m, n, k, c))
    return out
