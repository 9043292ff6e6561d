"""Config choice for the router GEMM: a measured table (data) first, a heuristic otherwise.

The table lives in ``configs/<gpu>.json`` (``<gpu>`` as ``evenflow.bench.harness.gpu_slug``
names it, e.g. ``h200``) and is written by ``benchmarks/tune_router.py`` on that GPU:

    {"gpu": "NVIDIA H200", "entries": [
        {"K": 4096, "N": 192, "terms": 3, "m_max": 16,
         "config": {"path": "triton", "block_m": 16, "block_n": 32, "block_k": 128,
                    "split_k": 16, "num_warps": 4, "num_stages": 4}}, ...],
     "batch_invariant": [{"K": 4096, "N": 192, "terms": 3, "config": {...}}]}

An entry covers the M values above the previous entry's ``m_max`` (for the same K, N)
up to its own; M beyond the last entry uses the last one. ``path`` is ``triton`` (our
split-weight kernel), ``fp32-simt`` (our CUDA-core kernel on the original fp32 weight, for
small M), ``torch-fp32`` (cuBLAS FP32 on the source weight) or ``torch-split2`` (two or
three torch bf16 products of the split, one per term) — the last two are "plain paths" kept for shapes
where the tuner measured them faster. Batch-invariant mode uses one config per (K, N)
for every M and never a plain path (cuBLAS picks its own kernels by M).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from evenflow._runtime import interpreting, num_sms

PATHS = ("triton", "fp32-simt", "torch-fp32", "torch-split2")
# Shared memory one block may use on sm_90 (H100/H200: 227 KB opt-in). The kernels are
# tuned and compile-checked for sm_90; other GPUs with less are capped by their own value
# (``smem_limit``).
SMEM_LIMIT = 232448


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the router GEMM (or a plain path)."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    path: str = "triton"

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"config.path must be one of {PATHS}, got {self.path!r}")
        if self.path == "fp32-simt":
            # CUDA-core kernel on the fp32 weight: any power-of-two row/column tile, no split-K.
            for name, lo in (("block_m", 1), ("block_n", 1), ("block_k", 16)):
                v = getattr(self, name)
                if v < lo or v & (v - 1):
                    raise ValueError(f"config.{name} must be a power of two >= {lo} for fp32-simt, got {v}")
            if self.split_k != 1:
                raise ValueError(f"config.split_k must be 1 for fp32-simt, got {self.split_k}")
            if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
                raise ValueError(f"bad num_warps/num_stages for fp32-simt: {self.num_warps}/{self.num_stages}")
            return
        if self.path != "triton":
            return
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two >= 16 (tl.dot minimum), got {v}")
        if self.split_k < 1 or self.split_k > 256:
            raise ValueError(f"config.split_k must be in [1, 256], got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"config.num_stages must be >= 1, got {self.num_stages}")

    def stage_bytes(self, terms: int) -> int:
        """Shared memory of one pipeline stage: the x tile and ``terms`` weight tiles, bf16."""
        return (self.block_m * self.block_k + terms * self.block_n * self.block_k) * 2

    def smem_bytes(self, terms: int, num_stages: int | None = None) -> int:
        """Shared memory the kernel needs at ``num_stages`` (default: this config's), an upper bound.

        Measured on the sm_90 compile with a real launch's divisibility hints (perf notes,
        round 4): the wgmma tiles (BLOCK_M >= 64) take num_stages x stage_bytes, the mma.sync
        tiles (num_stages - 1) x stage_bytes; the epilogue's scratch reuses the same space.
        The estimate is num_stages x stage_bytes for both (1 stage: one set of tiles).
        """
        stages = self.num_stages if num_stages is None else num_stages
        return max(1, stages) * self.stage_bytes(terms)

    def fit_smem(self, terms: int, limit: int = SMEM_LIMIT) -> GemmConfig:
        """This config with ``num_stages`` lowered until its shared memory fits ``limit`` bytes.

        Raises ValueError when even one stage does not fit (the tile itself is too big).
        Plain paths are returned unchanged.
        """
        if self.path != "triton":
            return self
        if self.smem_bytes(terms, 1) > limit:
            raise ValueError(
                f"config {self.block_m}x{self.block_n}x{self.block_k} with {terms} weight terms needs "
                f"{self.smem_bytes(terms, 1)} B of shared memory for one stage, more than {limit} B")
        stages = min(self.num_stages, limit // self.stage_bytes(terms))
        return self if stages == self.num_stages else replace(self, num_stages=stages)

    def red_chunk(self) -> int:
        """Split-K partials the last program loads per round trip: 8 for small tiles, fewer for
        large ones (each partial in flight holds BLOCK_M x BLOCK_N fp32 in registers; <= 64
        registers per thread at 4 warps)."""
        return max(1, min(8, 8192 // (self.block_m * self.block_n)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(**{k: d[k] for k in d if k in cls.__dataclass_fields__})


@lru_cache(maxsize=16)
def smem_limit(device: torch.device) -> int:
    """Shared memory per block the device allows (sm_90's 227 KB off a GPU or when unknown)."""
    if device.type == "cuda" and not interpreting():
        v = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
        if v:
            return int(v)
    return SMEM_LIMIT


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def heuristic_config(m: int, n: int, k: int, sms: int | None = None) -> GemmConfig:
    """Untuned default: small M splits K until every SM reads a slice of W.

    Small M is bound by reading W (2-3 bf16 parts of N*K); only ~cdiv(N, BLOCK_N)
    output tiles exist, so K is split until there are about two programs per SM,
    each keeping at least two BLOCK_K steps. Larger M tiles 64 x 64 (128 x 64 from
    M > 1024) and splits K toward two programs per SM while every slice keeps at least
    8 BLOCK_K steps: the round-1 H200 run measured 64x64x128/split-8 at 14.8 us
    against 23.0 us for 128x64x64/split-22 at M=512 (K=4096, N=192).
    """
    sms = num_sms() if sms is None else sms
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn, bk, warps, stages = 32, 128, 4, 4
        min_steps = 2
    else:
        bm = 64 if m <= 1024 else 128
        bn, bk, warps, stages = 64, 64, (4 if bm == 64 else 8), (4 if bm == 64 else 3)
        min_steps = 8
    tiles = _cdiv(max(m, 1), bm) * _cdiv(n, bn)
    k_blocks = _cdiv(k, bk)
    split = 1
    if tiles < sms:
        split = max(1, min(_cdiv(2 * sms, tiles), k_blocks // min_steps, 64))
    return GemmConfig(bm, bn, bk, split, warps, stages)


def heuristic_invariant_config(n: int, k: int) -> GemmConfig:
    """One config for every M (batch-invariant mode): fixed tiles and a fixed K split.

    A split of K into 512-wide slices keeps small M spread over the GPU at a cost of
    ``split`` fp32 partial planes of M x N at large M (deterministic, no atomics on floats).
    """
    split = max(1, min(_cdiv(k, 512), 16))
    return GemmConfig(64, 64, 64, split, 4, 4)


def _table_dir() -> Path:
    return Path(os.environ.get("EVENFLOW_ROUTER_CONFIGS", Path(__file__).parent / "configs"))


@lru_cache(maxsize=8)
def load_table(gpu_name: str) -> dict:
    """The tuned table for ``gpu_name`` ({} if none is committed for it)."""
    from evenflow.bench.harness import gpu_slug

    path = _table_dir() / f"{gpu_slug(gpu_name)}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _gpu_name(device: torch.device) -> str | None:
    if interpreting() or device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def _lookup(entries: list[dict], m: int, n: int, k: int, terms: int) -> GemmConfig | None:
    rows = sorted((e for e in entries if e["K"] == k and e["N"] == n and e.get("terms", 3) == terms),
                  key=lambda e: e["m_max"])
    if not rows:
        return None
    for e in rows:
        if m <= e["m_max"]:
            return GemmConfig.from_dict(e["config"])
    return GemmConfig.from_dict(rows[-1]["config"])


def device_facts(device: torch.device) -> tuple[dict, int]:
    """(tuned table or {}, SM count) for ``device``; looked up once per RouterWeight."""
    name = _gpu_name(device)
    return (load_table(name) if name else {}), num_sms(device)


def choose_config(m: int, n: int, k: int, device: torch.device, batch_invariant: bool = False,
                  facts: tuple[dict, int] | None = None, terms: int = 3) -> GemmConfig:
    """The config the launcher uses: tuned table entry for (K, N, terms, M range), else heuristic."""
    table, sms = facts if facts is not None else device_facts(device)
    if batch_invariant:
        rows = [e for e in table.get("batch_invariant", [])
                if e["K"] == k and e["N"] == n and e.get("terms", 3) == terms]
        cfg = GemmConfig.from_dict(rows[0]["config"]) if rows else heuristic_invariant_config(n, k)
        if cfg.path != "triton":
            raise ValueError("batch-invariant table entries must use the triton path")
        return cfg
    cfg = _lookup(table.get("entries", []), m, n, k, terms)
    return cfg if cfg is not None else heuristic_config(m, n, k, sms)
