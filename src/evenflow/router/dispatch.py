"""Config choice for the router GEMM: a measured table (data) first, a heuristic otherwise.

The table lives in ``configs/<gpu>.json`` (``<gpu>`` as ``evenflow._runtime.gpu_slug``
names it, e.g. ``h200``) and is written by ``benchmarks/tune_router.py`` on that GPU:

    {"gpu": "NVIDIA H200", "entries": [
        {"K": 4096, "N": 192, "terms": 3, "m_max": 16,
         "config": {"path": "triton", "block_m": 16, "block_n": 32, "block_k": 128,
                    "split_k": 16, "num_warps": 4, "num_stages": 4}}, ...],
     "batch_invariant": [{"K": 4096, "N": 192, "terms": 3, "config": {...}}]}

An entry covers the M values above the previous entry's ``m_max`` (for the same K, N)
up to its own; M beyond the last entry uses the last one. ``path`` is ``triton`` (our
split-weight kernel), ``fp32-simt`` (our CUDA-core kernel on the original fp32 weight, for
small M, one program per column tile streams all of K), ``fp32-splitk`` (the same math with K
split over the GPU and the partials summed in split order inside the same launch; the
untuned default for M <= 16), ``fp32-tc`` (the split-weight kernel reading the fp32 weight and
splitting each tile in registers: the same configs and output bits as ``triton``, 4 bytes a
weight read instead of 2 per term; round AH), ``torch-fp32`` (cuBLAS FP32 on the source weight) or
``torch-split2`` (two or three torch bf16 products of the split, one per term) — the last
two are "plain paths" kept for shapes where the tuner measured them faster.
Batch-invariant mode uses one config per (K, N) for every M and never a plain path
(cuBLAS picks its own kernels by M); ``triton``, ``fp32-tc`` and ``fp32-splitk`` qualify (with a
fixed config, a row's arithmetic depends neither on M nor on the other rows).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from evenflow._runtime import cdiv, interpreting, num_sms, tuned_table_path

PATHS = ("triton", "fp32-tc", "fp32-simt", "fp32-splitk", "torch-fp32", "torch-split2")
# Paths of the split-weight tensor-core kernel: from the stored bf16 parts, or from the fp32 weight split in
# registers (round AH); the same configs, products and output bits, 4 bytes a weight read instead of 2 x terms.
TC_PATHS = ("triton", "fp32-tc")
# Paths that launch a kernel of ours (the others are cuBLAS): launch modes, config checks, tuning.
KERNEL_PATHS = ("triton", "fp32-tc", "fp32-simt", "fp32-splitk")
# Paths whose kernels pipeline K through shared memory and may split it (a split-K workspace).
SPLIT_K_PATHS = ("triton", "fp32-tc", "fp32-splitk")
# How a kernel of ours is launched (round AD, docs/perf-notes/router.md): "plain"; "pdl", with programmatic
# dependent launch (it waits at its top for the kernel ahead, its launch overlapping that kernel's end);
# "pdl-prefetch", the same with the first row tile's programs asking L2 for the weight lines before the
# wait. A tuned choice per table entry: in AD1's run PDL took 0.34-1.2 us off most points at M <= 512 and
# slowed LongCat-Chat M = 1, 16 and LongCat-Lite M = 4 by 3-26%; the prefetch helped small weights at one or
# two row tiles and hurt large ones (docs/perf-notes/router.md). Where supported (compiled kernels on sm_90+);
# elsewhere every launch is plain.
# "pdl-preload" (round BM, the CUDA-core ``fp32-simt`` tile only): each program loads its weight's first K block into
# registers before the wait, so that block's bytes cross into the SM while the kernel ahead runs (BM2's probe: the
# best one-row tile with it at 0.85-0.92 of the best with the prefetch; BM5: every M = 1 entry takes it, BN: the M = 4
# entries of K4096 and Qwen3, whose one-block tiles load a program's whole weight before the wait). Unlike the
# prefetch, a load before the wait would see old data if the kernel ahead wrote the weight: ``router_gemm`` takes it
# only where the table says so and ``prefetch_weights`` is left at None, and a RouterWeight's in-place updates always
# put its split's kernels between the write and the call (see ``router_gemm``).
# Since round BW also on ``fp32-tc`` where every K slice is one BLOCK_K step (the tuner's atomic wide splits): the
# slice's fp32 weight is loaded and split in registers before the wait. Where a slice has more steps the launch
# runs as "pdl-prefetch" (the preload build has no K loop), and the tuner offers the mode only where it applies.
LAUNCHES = ("plain", "pdl", "pdl-prefetch", "pdl-preload")
PRELOAD_PATHS = ("fp32-simt", "fp32-tc")
# How a split-K launch sums its K slices: "counter", every program stores its partial and bumps the tile's
# counter, the last one reloads the partials and sums them in split order (deterministic: a fence, an atomic and
# a reload, three dependent L2 round trips); "atomic" (round BW), a small kernel zeroes the output first and
# every program adds its partial into it with fp32 atomic adds (no chain; the slices meet in arrival order, so
# from three slices the last bits may differ from call to call). A tuned choice per table entry; batch-invariant
# mode never takes "atomic", and under ``torch.use_deterministic_algorithms(True)`` a table entry's "atomic" runs
# as "counter" (the same tile and split).
REDUCES = ("counter", "atomic")


def launches_for(path: str) -> tuple[str, ...]:
    """The launch modes a kernel path takes (``LAUNCHES``; ``pdl-preload`` on ``PRELOAD_PATHS`` only)."""
    return tuple(m for m in LAUNCHES if m != "pdl-preload" or path in PRELOAD_PATHS)
# Paths whose one fixed config gives bitwise batch-invariant rows (see the module docstring).
INVARIANT_PATHS = ("triton", "fp32-tc", "fp32-splitk")
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
    launch: str = "pdl"
    reduce: str = "counter"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"config.{name} must be an int, got {type(v).__name__} {v!r}")
        for name in ("path", "launch", "reduce"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"config.{name} must be a str, got {getattr(self, name)!r}")
        if self.path not in PATHS:
            raise ValueError(f"config.path must be one of {PATHS}, got {self.path!r}")
        if self.launch not in LAUNCHES:
            raise ValueError(f"config.launch must be one of {LAUNCHES}, got {self.launch!r}")
        if self.reduce not in REDUCES:
            raise ValueError(f"config.reduce must be one of {REDUCES}, got {self.reduce!r}")
        if self.reduce != "counter" and self.path not in SPLIT_K_PATHS:
            raise ValueError(f"config.reduce={self.reduce!r} needs a split-K path {SPLIT_K_PATHS}, "
                             f"got path {self.path!r}")
        if self.launch == "pdl-preload" and self.path not in PRELOAD_PATHS:
            raise ValueError(f"config.launch 'pdl-preload' needs a path of {PRELOAD_PATHS}, got {self.path!r}")
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
        if self.path == "fp32-splitk":
            # CUDA-core kernel on the fp32 weight, split-K reduced in the same launch. The
            # register block BLOCK_M x BLOCK_N x BLOCK_K holds one fp32 accumulator per
            # element: more than 128 of them per thread would spill.
            for name, lo in (("block_m", 1), ("block_n", 1), ("block_k", 16)):
                v = getattr(self, name)
                if v < lo or v & (v - 1):
                    raise ValueError(f"config.{name} must be a power of two >= {lo} for fp32-splitk, got {v}")
            self._check_launch_knobs()
            per_thread = self.block_m * self.block_n * self.block_k // (32 * self.num_warps)
            if per_thread > 128:
                raise ValueError(
                    f"fp32-splitk register block {self.block_m}x{self.block_n}x{self.block_k} at "
                    f"{self.num_warps} warps is {per_thread} fp32 accumulators a thread (at most 128)")
            return
        if self.path not in TC_PATHS:
            return
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two >= 16 (tl.dot minimum), got {v}")
        self._check_launch_knobs()

    def _check_launch_knobs(self) -> None:
        # split-K, warps and stages: the same limits for every Triton path
        if self.split_k < 1 or self.split_k > 256:
            raise ValueError(f"config.split_k must be in [1, 256], got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"config.num_stages must be >= 1, got {self.num_stages}")

    def stage_bytes(self, terms: int) -> int:
        """Shared memory of one pipeline stage: the x tile and ``terms`` weight tiles, bf16
        (fp32-splitk, fp32-tc: the x tile, bf16, and one fp32 weight tile)."""
        if self.path in ("fp32-splitk", "fp32-tc"):
            return self.block_m * self.block_k * 2 + self.block_n * self.block_k * 4
        return (self.block_m * self.block_k + terms * self.block_n * self.block_k) * 2

    def smem_bytes(self, terms: int, num_stages: int | None = None) -> int:
        """Shared memory the kernel needs at ``num_stages`` (default: this config's), an upper bound.

        Measured on the sm_90 compile with a real launch's divisibility hints (perf notes,
        round 4): the wgmma tiles (BLOCK_M >= 64) take num_stages x stage_bytes, the mma.sync
        tiles (num_stages - 1) x stage_bytes; the epilogue's scratch reuses the same space.
        The estimate is num_stages x stage_bytes for both (1 stage: one set of tiles), plus for
        fp32-tc the staging tile of its converted weight (BLOCK_N x BLOCK_K bf16, one term at a time):
        wgmma reads its second operand from shared memory, so from BLOCK_M = 64 the split terms go
        through it (sm_90 build, round AH: 4-16 KB above the stages).
        """
        stages = self.num_stages if num_stages is None else num_stages
        return max(1, stages) * self.stage_bytes(terms) + self._staging_bytes()

    def _staging_bytes(self) -> int:
        return self.block_n * self.block_k * 2 if self.path == "fp32-tc" else 0

    def fit_smem(self, terms: int, limit: int = SMEM_LIMIT) -> GemmConfig:
        """This config with ``num_stages`` lowered until its shared memory fits ``limit`` bytes.

        Raises ValueError when even one stage does not fit (the tile itself is too big).
        Plain paths and fp32-simt are returned unchanged.
        """
        if self.path not in SPLIT_K_PATHS:
            return self
        if self.smem_bytes(terms, 1) > limit:
            raise ValueError(
                f"config {self.block_m}x{self.block_n}x{self.block_k} with {terms} weight terms needs "
                f"{self.smem_bytes(terms, 1)} B of shared memory for one stage, more than {limit} B")
        stages = min(self.num_stages, (limit - self._staging_bytes()) // self.stage_bytes(terms))
        return self if stages == self.num_stages else replace(self, num_stages=stages)

    def red_chunk(self, splits: int | None = None) -> int:
        """Split-K partials the last program loads per round trip: up to 16, as many as keep them within 64
        registers a thread (each partial in flight holds BLOCK_M x BLOCK_N fp32 over the program's threads).
        Until round AH at most 8 (and counted for 4 warps): 16 x 32 tiles at 9-16 splits, the M = 16 kind,
        paid a second dependent L2 round trip. The order of the sum, and so its bits, does not depend on it.
        ``splits`` (a launch's effective split count) caps it at that count rounded up to a power of two (8
        splits: 8, not 16 with eight masked-off loads, 1% faster in round AH5; 11 splits still take 16)."""
        if self.path == "fp32-splitk":
            return splitk_red_chunk(self.block_m, self.block_n, self.num_warps)
        return split_red_chunk(self.block_m, self.block_n, self.num_warps, splits)

    def workspace_sizes(self, m: int, n: int, k: int) -> tuple[int, int]:
        """(fp32 partials, int32 counters) one launch at ``m`` rows needs; (0, 0) without split-K or with
        ``reduce="atomic"`` (the partials go straight into the output)."""
        if self.path not in SPLIT_K_PATHS or self.reduce == "atomic":
            return 0, 0
        _, split, (tiles, _) = launch_shape(m, n, k, self.block_m, self.block_n, self.block_k, self.split_k)
        if split <= 1:
            return 0, 0
        if self.path == "fp32-splitk":  # tile-major, padded to whole tiles
            return tiles * split * self.block_m * self.block_n, tiles
        return split * m * n, tiles

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(**{k: d[k] for k in d if k in cls.__dataclass_fields__})


def launch_shape(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                 split_k: int) -> tuple[int, int, tuple[int, int]]:
    """(K slice per program, effective number of K slices, grid) of one launch.

    The effective split can be below ``split_k``: slices are whole BLOCK_K steps and no
    program gets an empty K range (e.g. K=6144, BLOCK_K=256, split_k=16 -> 12 slices).
    """
    k_split = cdiv(cdiv(k, split_k), block_k) * block_k
    split = cdiv(k, k_split)
    return k_split, split, (cdiv(m, block_m) * cdiv(n, block_n), split)


def split_red_chunk(block_m: int, block_n: int, num_warps: int, splits: int | None = None) -> int:
    """:meth:`GemmConfig.red_chunk` of a split (bf16-term) path's tile, from plain ints: what a launch passes its
    kernel, without building a config (a validated dataclass: 4.5 us of host a call against 0.8 on the CI machine's
    CPU, round CO's ``cpu/bookkeeping_timeit.txt``)."""
    chunk = max(1, min(16, 64 * 32 * num_warps // (block_m * block_n)))
    return chunk if splits is None else min(chunk, 1 << max(0, splits - 1).bit_length())


def splitk_red_chunk(block_m: int, block_n: int, num_warps: int) -> int:
    """fp32-splitk partials loaded per round trip by the last program: its tiles are small
    (BLOCK_M x BLOCK_N <= 2x the thread count: 1-2 registers a partial), so up to 32, and one
    L2 round trip covers the usual 5-32 splits; at most 64 registers a thread in flight (the
    K loop's accumulators are dead by then)."""
    regs = max(1, block_m * block_n // (32 * num_warps))
    return max(1, min(32, 64 // regs))


@lru_cache(maxsize=16)
def smem_limit(device: torch.device) -> int:
    """Shared memory per block the device allows (sm_90's 227 KB off a GPU or when unknown)."""
    if device.type == "cuda" and not interpreting():
        v = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
        if v:
            return int(v)
    return SMEM_LIMIT


def heuristic_config(m: int, n: int, k: int, sms: int | None = None) -> GemmConfig:
    """Untuned default: small M splits K until every SM reads a slice of W.

    M <= 16: ``fp32-splitk`` (``heuristic_splitk_config``): 4 bytes a weight instead of the
    three-term split's 6, at full fp32 fidelity; tensor cores buy nothing at these M.
    M = 17-64 and beyond: the split-weight tensor-core kernel, as follows.

    Small M is bound by reading W (2-3 bf16 parts of N*K); only ~cdiv(N, BLOCK_N)
    output tiles exist, so K is split until there are about two programs per SM,
    each keeping at least two BLOCK_K steps. Larger M tiles 64 x 64 (128 x 64 from
    M > 1024) and splits K toward two programs per SM while every slice keeps at least
    8 BLOCK_K steps: the round-1 H200 run measured 64x64x128/split-8 at 14.8 us
    against 23.0 us for 128x64x64/split-22 at M=512 (K=4096, N=192).
    """
    sms = num_sms() if sms is None else sms
    if m <= 16:
        return heuristic_splitk_config(m, n, k, sms)
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn, bk, warps, stages = 32, 128, 4, 4
        min_steps = 2
    else:
        bm = 64 if m <= 1024 else 128
        bn, bk, warps, stages = 64, 64, (4 if bm == 64 else 8), (4 if bm == 64 else 3)
        min_steps = 8
    tiles = cdiv(max(m, 1), bm) * cdiv(n, bn)
    k_blocks = cdiv(k, bk)
    split = 1
    if tiles < sms:
        split = max(1, min(cdiv(2 * sms, tiles), k_blocks // min_steps, 64))
    return GemmConfig(bm, bn, bk, split, warps, stages)


def heuristic_splitk_config(m: int, n: int, k: int, sms: int | None = None) -> GemmConfig:
    """Untuned fp32-splitk config: about 1.5-3 programs per SM, each reading whole K steps.

    Register block BLOCK_M x BLOCK_N x BLOCK_K at 4 warps: 32 fp32 accumulators a thread at
    M <= 2, 64 at M <= 8 (the 128 aimed for from M = 8 needs BLOCK_N 32; it is capped at 16),
    128 at M = 16. Every thread holds all BLOCK_M rows of its k-lanes,
    so each x value it reads from shared memory (and widens) feeds BLOCK_N/(warps along N)
    FMAs: the sm_90 SASS of the K loop is 30% FFMA at 32 accumulators, 48% at 64 and 64% at
    128 (166 registers, no spill), which matters from M = 16 (CUDA-core time ~ the byte time
    at LongCat-Chat). BLOCK_N <= 16; every column tile reads all of x (M x K bf16, from L2),
    i.e. M / (2 BLOCK_N) of the weight's bytes. BLOCK_N halves until (column tiles x K blocks)
    reaches 1.5 programs per SM, then K blocks are grouped so the programs number about
    1.5-3 per SM (with <= 2 steps each, all loads are issued in the pipeline prologue).
    Small M is bound by reading W and by the latency chain (docs/perf-notes/router.md, round F).
    """
    sms = num_sms() if sms is None else sms
    bm = min(16, 1 << max(0, m - 1).bit_length())
    bk = 256 if bm <= 2 else (128 if bm <= 4 else 64)
    acc = 32 if bm <= 2 else (64 if bm <= 4 else 128)
    warps = 4
    bn = max(1, min(16, acc * 32 * warps // (bm * bk)))
    m_tiles, k_blocks = cdiv(max(m, 1), bm), cdiv(k, bk)
    want = max(1, (3 * sms) // 2)
    while bn > 1 and m_tiles * cdiv(n, bn) * k_blocks < want:
        bn //= 2
    tiles = m_tiles * cdiv(n, bn)
    steps = max(1, (tiles * k_blocks) // want)
    split = max(1, min(cdiv(k_blocks, steps), 256))
    return GemmConfig(bm, bn, bk, split, warps, 3 if steps <= 2 else 5, "fp32-splitk")


def heuristic_invariant_config(n: int, k: int) -> GemmConfig:
    """One config for every M (batch-invariant mode): fixed tiles and a fixed K split.

    A split of K into 512-wide slices keeps small M spread over the GPU at a cost of
    ``split`` fp32 partial planes of M x N at large M (deterministic, no atomics on floats).
    """
    split = max(1, min(cdiv(k, 512), 16))
    return GemmConfig(64, 64, 64, split, 4, 4)


def _table_dir() -> Path:
    return Path(os.environ.get("EVENFLOW_ROUTER_CONFIGS", Path(__file__).parent / "configs"))


@lru_cache(maxsize=8)
def load_table(gpu_name: str) -> dict:
    """The tuned table for ``gpu_name`` ({} if none is committed for it)."""
    path = tuned_table_path(_table_dir(), gpu_name)
    return json.loads(path.read_text()) if path else {}


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
        if cfg.path not in INVARIANT_PATHS or cfg.reduce != "counter":
            raise ValueError(f"batch-invariant table entries must use a path in {INVARIANT_PATHS} and the counter's "
                             f"reduction, got {cfg.path!r} / {cfg.reduce!r}")
        return cfg
    cfg = _lookup(table.get("entries", []), m, n, k, terms)
    return cfg if cfg is not None else heuristic_config(m, n, k, sms)
