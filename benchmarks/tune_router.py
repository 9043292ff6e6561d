"""Measure router GEMM configs on this GPU and write the dispatch table (data, not code).

    python benchmarks/tune_router.py [--quick] [--budget-s 200] [--cases K4096-N192,...] [--terms 3] [--table PATH]
                                     [--buckets 1,4,16]
    python benchmarks/tune_router.py --compile-only      # no GPU: compile every candidate for sm_90

For every standard (K, N) and each M bucket (upper bounds 1, 4, 16, 64, 128, 256, 512,
1024, 2048, 4096, 8192; M above the last uses the last), times each candidate at M = the bucket's upper
bound as a CUDA-graph replay with rotated weight copies, after checking it against the
fp64 product; our CUDA-core kernels (``fp32-splitk`` at M <= 16, timed first there;
``fp32-simt`` at M <= 64) and the plain paths (``torch-fp32``, ``torch-split2``) compete
too and win a bucket only where they are measured faster and pass the tests' tolerance rule.
``--buckets`` re-tunes only the listed M buckets and keeps the table's other entries
(and its batch-invariant entries unless every M of the invariant score is tuned).
Batch-invariant mode gets one config per (K, N): the lowest geometric-mean time over M in
(1, 256, 8192). Entries are per term
count (``--terms``, default 3 = RouterWeight's default). Writes
``src/evenflow/router/configs/<gpu>.json`` (or ``--table``) and, when ``$OUT`` is set,
a copy under ``$OUT/router-configs/``.

Budget: a few hundred compiled kernel variants over the four shapes (the split count is a runtime argument,
only split/no-split is compiled; ~1 s of JIT each, cached across runs; `--compile-only` builds every one for
sm_90 on any machine) and ~3000 timings (round CE1 on an H100, one process a shape at ``--budget-s 70``: 631,
884, 762 and 715 timed candidates in 135, 66, 41 and 40 s, compiles included, for K4096, LongCat-Chat,
LongCat-Lite and Qwen3, the later shapes reusing variants the first had compiled;
benchmarks/results/h100/history/round-ce/ce1/). ``--budget-s`` bounds the timing, not the compiles: each
remaining bucket gets an equal share of the timing budget the buckets before it left (``bucket_share``; no
bucket's compiles count, so buckets after a long compile are not starved, as round CE1's were: 1 s shares from
the third bucket on) and stops timing candidates (best-first order, at least one; the table's current pick for
the bucket, fp32-simt and the plain paths always) when its share is spent. Every candidate's
``num_stages`` is capped by shared memory (``GemmConfig.fit_smem``) before it is timed.
The space is pruned by reasoning (docs/perf-notes/router.md): small M is bound by reading W and by latency, so
only split-K and the K step vary there; from a few hundred rows up the tile shape, the K
step (64, 128 or 256) and the split vary, with K slices of at least 256; 128x128 tiles are
out (three fp32 accumulators + the fresh product tile would spill at 8 warps).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__" and "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"  # must precede the first evenflow/triton import

import torch  # noqa: E402

import evenflow  # noqa: E402
from evenflow.bench import harness as H  # noqa: E402
from evenflow.reference import router as R  # noqa: E402
from evenflow.router.dispatch import (  # noqa: E402
    KERNEL_PATHS,
    REDUCES,
    SPLIT_K_PATHS,
    TC_PATHS,
    GemmConfig,
    launches_for,
)
from evenflow.testing import error_bound  # noqa: E402

CASES = {"K4096-N192": (4096, 192), "longcat-chat": (6144, 768), "longcat-lite": (3072, 384),
         "qwen3-30b-a3b": (2048, 128)}
BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_BUCKETS = (1, 16, 256, 4096)
INVARIANT_MS = (1, 256, 8192)
ROTATE_BYTES = 150 << 20
H200_SMS = 132
REPLACE_MARGIN = 0.01  # a challenger replaces a table entry only if faster by more than this, twice


def _splits(tiles: int, k: int, bk: int, min_steps: int, sms: int, keep: int, per_sm: float = 1.5) -> list[int]:
    """Split-K values worth trying: >= min_steps K steps per program, programs nearest ``per_sm``
    per SM (1/2 to 4 per SM where the K length allows); the ``keep`` nearest, ascending."""
    allowed = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s == 1 or s * bk * min_steps <= k]
    good = [s for s in allowed if sms / 2 <= tiles * s <= 4 * sms] or allowed
    good.sort(key=lambda s: abs(math.log(tiles * s / (per_sm * sms))))
    return sorted(good[:keep])


def candidates(m: int, n: int, k: int, sms: int, plain: bool = True, terms: int = 3) -> list[GemmConfig]:
    """Configs to time for ``m`` rows, most promising first (the budget may cut the tail),
    each with num_stages capped by shared memory for ``terms`` weight terms."""
    out = []
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        # Small M streams W once: many programs (split-K, 1-4 per SM; the reduction now loads
        # 8 partials per round trip, so wide splits pay) and a pipeline as deep as shared
        # memory allows, so a program's whole K slice is in flight at once.
        for bk, stages in ((128, 4), (64, 6), (256, 3)):
            for bn in (32, 64):
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                for split in _splits(tiles, k, bk, 1, sms, 4, per_sm=2.0):
                    out.append(GemmConfig(bm, bn, bk, split, 4, stages))
        if m <= 16:
            # Round AG1: 16-wide tiles on 2 warps (Qwen3 M = 16 3.55 -> 3.34 us at split 8, K4096 5.08 -> 4.97),
            # and fewer splits (LongCat-Chat M = 16: 11.58 -> 10.65 us at split 4, 96 programs).
            for bn, bk, warps, stages in ((16, 128, 2, 4), (16, 64, 2, 6), (32, 128, 4, 4), (16, 128, 4, 4)):
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                for per_sm in (2.0, 0.75):
                    for split in _splits(tiles, k, bk, 1, sms, 2, per_sm=per_sm):
                        out.append(GemmConfig(bm, bn, bk, split, warps, stages))
        # Round AH: at M <= 16 the same tiles on the fp32 weight split in registers (4 bytes a weight read, not
        # 6: small M streams W), timed first, and wider ones on 8 warps (a stage holds 4 bytes a weight, not 6);
        # <= 64 weights a thread a K step (16 x 64 x 256 on 4 warps, 128 of them, spilled 240 bytes on sm_90).
        if m <= 16:
            wide = []
            for bn, bk, warps, stages in ((64, 128, 8, 4), (128, 64, 8, 4)):
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                wide += [GemmConfig(bm, bn, bk, split, warps, stages)
                         for split in _splits(tiles, k, bk, 1, sms, 2, 2.0)]
            out = [replace(c, path="fp32-tc") for c in out + wide
                   if c.block_n * c.block_k <= 64 * 32 * c.num_warps] + _balanced_tc(m, n, k, sms) + out
    else:
        # Round L: K slices down to 256 deep (were >= 8 steps of 64), so a narrow shape at a few
        # hundred rows (Qwen3 2048x128 at M = 512: 16 tiles) can spread over more programs.
        # 128-deep K steps too: half the dependent steps per slice (round L4); and the 64x32 tile
        # with 256-deep steps that the M = 64 bucket picks (round L5), and its 64x64 / 128x32
        # neighbours (one 256-deep step per program at wide splits: the stage count then does
        # not matter; round L6); 64x32 tiles within 80 KB of shared memory, so two programs
        # share an SM and overlap their latency chains (round L9).
        for bm, bn, bk, warps, stages in ((64, 64, 64, 4, 4), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3),
                                          (64, 64, 128, 4, 3), (128, 64, 128, 8, 2), (64, 32, 256, 4, 2),
                                          (64, 64, 256, 4, 1), (128, 32, 256, 8, 2),
                                          (64, 32, 128, 4, 2), (64, 32, 256, 4, 1)):
            tiles = math.ceil(m / bm) * math.ceil(n / bn)
            for split in _splits(tiles, k, bk, 256 // bk, sms, 4):
                out.append(GemmConfig(bm, bn, bk, split, warps, stages))

    if 16 < m <= 512:
        # Round AH: the fp32 weight split in registers where small M streams W (at M = 64-256 LongCat-Chat's
        # stored split, 28 MB, against 19 MB); from BLOCK_M = 64 the converted terms go through shared memory for
        # wgmma. <= 32 weights a thread a K step (64 x 32 x 256 on 4 warps, 64 of them, spilled 248 bytes).
        out = [replace(c, path="fp32-tc") for c in out if c.block_n * c.block_k <= 32 * 32 * c.num_warps] + out
    out = splitk_candidates(m, n, k, sms, terms) + _distinct_launches(out, m, n, k, terms) + simt_candidates(m)
    if 4 < m <= 16 and k <= 4096:
        # Round BQ: where K is one block, the M = 4 bucket's one-block tiles (router_gemm runs the ONE_BLOCK build:
        # no K loop, half the registers of the loop build) over the grid's rows. In BQ3 at M = 16 the 4 x 2 x 2048
        # tile on 8 warps took Qwen3 in 2.21 us against its entry's 2.59 (K4096 5.46 against 4.55: not there).
        # Round BR (CPU; docs/perf-notes/router.md): 4 x 4 and 8 x 2 too. Every program reads its rows of x after the
        # wait, M K 2 N / BLOCK_N bytes over the grid (Qwen3: 4 MB at 2 columns, 2 MB at 4), and its weight rows
        # before it, M / BLOCK_M times over (4 MB at 4 rows, 2 at 8). sm_90, one-block with the preload: 48-128
        # registers, no spill, at K = 2048 and 4096 on 8 and 16 warps.
        bk = max(16, 1 << max(0, k - 1).bit_length())  # a block of at least 16 (GemmConfig's minimum)
        out += [GemmConfig(bm, bn, bk, 1, warps, 1, "fp32-simt") for bm, bn in ((4, 2), (4, 4), (8, 2))
                for warps in (8, 16)]
    if ATOMIC_MIN_M < m <= ATOMIC_MAX_M:
        out = with_atomic(out, m, n, k, terms)
    if plain:
        out += [GemmConfig(path="torch-fp32"), GemmConfig(path="torch-split2")]
    return out


# Round BW: the rows (ATOMIC_MIN_M, ATOMIC_MAX_M] at which the tuner offers split-K launches summed with float atomics
# (``reduce="atomic"``): the buckets of 16 and 64 rows, whose tensor-core and split-K entries pay the counter's chain.
# At M <= 4 the entries are unsplit CUDA-core tiles, which the zeroing kernel's launch would only slow.
ATOMIC_MIN_M, ATOMIC_MAX_M = 4, 64


def with_atomic(configs: list[GemmConfig], m: int, n: int, k: int, terms: int = 3) -> list[GemmConfig]:
    """``configs`` with, right after each tensor-core split-K launch of more than one slice, its twin under
    ``reduce="atomic"``
    (round BW: the output zeroed by a small kernel ahead, every slice's partial added into it with fp32 atomics;
    no partial store, counter or reload, the three dependent L2 round trips of the counter's chain, which BH3 / BI1
    measured at +1.2 us for two slices and ~4 us for sixteen), and at the end each distinct tensor-core tile of the
    list under atomics at one and two K steps a slice (with the chain gone, wider splits may pay: more programs
    to share the weight's reads). A twin follows its original, so a budget cut takes both or neither."""
    from evenflow.router.gemm import launch_shape

    out, tiles = [], []
    for c in configs:
        out.append(c)
        if c.path in TC_PATHS and launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[1] > 1:
            out.append(replace(c, reduce="atomic"))
            if replace(c, split_k=1) not in tiles:
                tiles.append(replace(c, split_k=1))
    wide = [replace(c, split_k=min(256, math.ceil(k / (steps * c.block_k))), reduce="atomic")
            for c in tiles for steps in (1, 2)]
    out += [c for c in _distinct_launches(wide, m, n, k, terms) if c not in out]
    # the atomic one-step fp32-tc slices again with their weight loaded before the PDL wait (launch "pdl-preload")
    return out + [replace(c, launch="pdl-preload") for c in out
                  if c.path == "fp32-tc" and c.reduce == "atomic" and _one_step(c, m, n, k)]


def _one_step(c: GemmConfig, m: int, n: int, k: int) -> bool:
    """Every K slice of ``c``'s launch is one BLOCK_K step (where launch "pdl-preload" applies on fp32-tc)."""
    from evenflow.router.gemm import launch_shape

    return launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[0] == c.block_k


def _balanced_tc(m: int, n: int, k: int, sms: int) -> list[GemmConfig]:
    """fp32-tc tiles at splits that make the programs a whole number (1-3) of them an SM, within a column tile
    of it (round AH1's LongCat-Chat M = 16 pick ran 192 programs, 1.45 an SM: an SM streamed one or two K
    slices; the split list of ``_splits`` has no 11 or 22)."""
    from evenflow.router.gemm import launch_shape

    out = []
    bm = 16
    for bn, bk, warps, stages in ((32, 64, 4, 6), (32, 128, 4, 4), (16, 128, 2, 4), (16, 64, 2, 6)):
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        for per_sm in (1, 2, 3):
            split = min(256, round(per_sm * sms / tiles))
            if split < 2:
                continue
            eff = launch_shape(m, n, k, bm, bn, bk, split)[1]
            if abs(tiles * eff - per_sm * sms) <= tiles:
                out.append(GemmConfig(bm, bn, bk, split, warps, stages, "fp32-tc"))
    return out


def simt_candidates(m: int) -> list[GemmConfig]:
    """fp32-simt configs for small M (always timed, like the plain paths): one program per
    BLOCK_N weight rows streams its whole K. The product tile BLOCK_M x BLOCK_N x BLOCK_K is
    kept at <= 64 fp32 values a thread (plus the prefetched next block), but for the one-block tiles of round BN
    at M <= 4 (up to 128; their sm_90 builds spill nothing)."""
    if m > 64:
        return []
    bm = min(16, 1 << max(0, m - 1).bit_length())
    # Few K steps matter most: each is one dependent DRAM round trip of a program (the next
    # block is prefetched one step ahead), so BLOCK_K is as wide as registers allow.
    # Round K: a whole 4096-deep row per step (one cross-warp reduction instead of two to four,
    # every load of the row in flight at once; sm_90 build 80 registers at 8 warps, 59-93 at 16, no spill).
    if bm == 1:
        shapes = ((1, 1024, 4), (1, 2048, 8), (2, 1024, 8), (1, 512, 4), (1, 4096, 8), (1, 4096, 16))
    elif bm <= 4:
        # Round BN: since x and the weight load in their product's layout (no per-block conversion through shared
        # memory), 2-row tiles at full and half K (96 programs at N = 192, as the fp32-splitk entry) and the whole
        # 4096-deep row on 8 warps build without spills (sm_90: 47-159 registers at BLOCK_M 2-4). After BN1: one
        # block of 2 x 4096 on 16 warps (a program's whole weight loaded before the wait, one program an SM), which
        # took K4096 M = 4 in BN2. Not offered: 4 x 4096 on 16 warps (half the programs reading x), 1.23x that
        # tile's time in BN3. Since round BO (the one-block build: no dead second block, 98 registers), 2 x 4096 on 8
        # warps too.
        shapes = ((1, 1024, 8), (1, 2048, 8), (2, 512, 8), (1, 4096, 16), (2, 1024, 8), (2, 2048, 8),
                  (2, 2048, 16), (1, 4096, 8), (2, 4096, 16), (2, 4096, 8))
    else:
        shapes = ((1, 512, 8), (1, 1024, 8), (2, 256, 8))
    out = [GemmConfig(bm, bn, bk, 1, warps, 1, "fp32-simt") for bn, bk, warps in shapes]
    # Round BM: at M <= 4 the same tiles with their first weight block loaded before the PDL wait, timed as
    # candidates of their own (the main pass times each candidate at its own launch mode; BM2's probe put the
    # best one-row tile with it at 0.85-0.92 of the best with the prefetch, and the best tile of each mode differs).
    if bm <= 4:
        out += [replace(c, launch="pdl-preload") for c in out]
    # Round AF: rows over the grid too (BLOCK_M below M: one program per BLOCK_M rows and BLOCK_N weight
    # rows). At M = 1 a program of the M = 1 shapes is 0.57-0.66 of the floor (AD2); at M = 4 and 16 the same
    # program, run once per row (tile), reads its weight rows again from L2, not DRAM.
    for sub in (1, 2, 4) if m <= 16 else ():
        if sub < bm:
            out += [GemmConfig(sub, bn, bk, 1, warps, 1, "fp32-simt")
                    for bn, bk, warps in ((1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 8))
                    if sub * bn * bk <= 32 * 32 * warps]
    return out


def splitk_candidates(m: int, n: int, k: int, sms: int, terms: int = 3) -> list[GemmConfig]:
    """fp32-splitk configs for M <= 16, the heuristic's first: register blocks of 32-128 fp32
    accumulators a thread, each at about 1.5 and 3 programs per SM (K blocks grouped into
    whole-step slices), pipelines 3 deep (<= 2 steps, all loads issued up front) or 5.
    Same effective K slice and tile = same launch: kept once."""
    if m > 16:
        return []
    from evenflow.router.dispatch import heuristic_splitk_config

    bm = min(16, 1 << max(0, m - 1).bit_length())
    # (BLOCK_N, BLOCK_K, warps): 32-128 accumulators a thread; more of them raise the FFMA share
    # of the K loop (sm_90 SASS: 30% at 32, 48% at 64, 64% at 128), which counts from M = 16.
    if bm <= 2:
        shapes = ((4, 256, 4), (8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 128, 4))
    elif bm <= 4:
        shapes = ((8, 128, 4), (16, 128, 4), (4, 256, 4), (16, 64, 4), (8, 256, 4))
    else:
        shapes = ((16, 64, 4), (8, 128, 4), (16, 128, 8), (8, 64, 4), (4, 128, 4))
    out = [heuristic_splitk_config(m, n, k, sms)]
    for bn, bk, warps in shapes:
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        k_blocks = math.ceil(k / bk)
        for per_sm in (1.5, 3.0):
            steps = max(1, int(tiles * k_blocks // (per_sm * sms)))
            split = min(256, math.ceil(k_blocks / steps))
            out.append(GemmConfig(bm, bn, bk, split, warps, 3 if steps <= 2 else 5, "fp32-splitk"))
    # Round AG1: at M <= 4, fat column tiles with deep K steps and no (or one) split, 16-64 accumulators a
    # thread. Every column tile reads all of x, so fewer, wider ones cut the L2-to-SM traffic that grows
    # with M; the split-K grid of 1.5-3 programs an SM above read 4.03 us at K4096 M = 4 where 4 x 2 x 512
    # at split 1 (96 programs, 8 pipelined steps) read 3.45 (LongCat-Lite 5.10 -> 3.79, LongCat-Chat
    # 9.17 -> 7.33; docs/perf-notes/router.md, round AG).
    # Round AU: the same tiles on 2 warps (AG2's tuner log: 4 x 2 x 1024 on 4 warps 3.31 against 3.52 us on 8 at K4096
    # M = 4, and fewer threads a tile were not yet tried), 2048-deep steps on 4 warps (Qwen3's K in one step), and a
    # pipeline as deep as a slice of 5-8 steps (every step's loads issued up front: steps + 1 stages, where 5 stages
    # leave some to later; LongCat-Lite's 4 x 2 x 512 pick has 6).
    # Round BG: at 4 < M <= 16 such fat tiles four rows high, the row tiles over the grid (at M = 16 four programs a
    # column tile, each reading its weight columns; the first to reach a line brings it to L2): M = 4's tiles ran
    # Qwen3 / K4096 / LongCat-Lite in 2.0 / 3.2 / 3.4 us where the M = 16 entries read 3.3 / 4.5 / 5.0 (BG4), and a
    # 16-row fat tile holds four times the accumulators (fp32-splitk at 16 x 16 x 64: 9.7-12.0 us at those three).
    # Round BH: BG5's four-row tiles lost at K4096 and LongCat-Lite, where their 384 / 768 programs read 25 / 38 MB
    # from L2 (x once a column tile, the weight once a row tile) against Qwen3's 8; tiles eight rows high halve the
    # weight's share, four or eight columns wide halve x's or more, each at 64 accumulators a thread (or 32).
    if bm <= 4:
        fat = {bm: ((1, 512, 4), (2, 512, 4), (1, 1024, 4), (2, 1024, 4), (2, 1024, 8), (4, 512, 8), (4, 1024, 8),
                    (1, 2048, 8), (2, 512, 2), (2, 1024, 2), (2, 2048, 4))}
    else:
        fat = {4: ((1, 1024, 4), (2, 1024, 4), (2, 512, 4), (2, 2048, 4), (2, 1024, 2), (4, 512, 8), (4, 256, 4),
                   (8, 256, 4))}
        if bm > 8:
            fat[8] = ((2, 1024, 8), (4, 256, 4), (4, 512, 8), (8, 128, 4), (8, 256, 8))
    for height, shapes in fat.items():
        for bn, bk, warps in shapes:
            # the widest tiles make the fewest programs (48 of 8 x 8 at K4096): a four-way K split too
            for split in (1, 2, 4) if height * bn >= 64 else (1, 2):
                steps = math.ceil(math.ceil(k / bk) / split)
                deeper = (steps + 1,) if height == bm and 5 <= steps <= 8 else ()
                for stages in (3 if steps <= 2 else 5,) + deeper:
                    out.append(GemmConfig(height, bn, bk, split, warps, stages, "fp32-splitk"))
    return _distinct_launches(out, m, n, k, terms)


def _short(c: GemmConfig) -> str:
    return (f"{c.path} {c.block_m}x{c.block_n}x{c.block_k} split {c.split_k} warps {c.num_warps} "
            f"stages {c.num_stages}" + (f" {c.launch}" if c.launch != GemmConfig().launch else "")
            + (f" {c.reduce}" if c.reduce != GemmConfig().reduce else "")
            if c.path in KERNEL_PATHS else c.path)


def _distinct_launches(configs, m, n, k, terms):
    """``configs`` capped to shared memory, one per distinct launch: two split counts that give
    the same K slice launch the same programs (e.g. K=4096, BLOCK_K=128: split 16 and 24 both
    make 256-wide slices); capping can also merge two."""
    from evenflow.router.gemm import launch_shape

    seen, kept = set(), []
    for c in (c.fit_smem(terms) for c in configs):
        key = (c.path, c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.reduce,
               launch_shape(m, n, k, c.block_m, c.block_n, c.block_k, c.split_k)[0])
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def invariant_candidates(n: int, k: int) -> list[GemmConfig]:
    out = []
    for bm, bn in ((64, 64), (32, 64)):
        for split in (1, 4, 8, 16):
            if split * 64 * 4 <= k:
                out.append(GemmConfig(bm, bn, 64, split, 4, 4))
    return out  # 4 stages x (64x64 + 3 x 64x64) x 2 B = 128 KB at most: fits


def compile_only() -> int:
    """Compile every (config, effective split, K tail, terms) the tuner and the heuristics can
    launch, for sm_90, on any machine (no GPU). Fails on the first that does not compile
    or needs more shared memory than an H100/H200 block may have."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from evenflow.router import dispatch
    from evenflow.router.gemm import launch_shape
    from evenflow.router.kernels import router_gemm_fp32_kernel, router_gemm_fp32_splitk_kernel, router_gemm_kernel

    sig = {"p_x": "*bf16", "p_whi": "*bf16", "p_wlo": "*bf16", "p_wlo2": "*bf16", "p_out": "*fp32",
           "p_part": "*fp32", "p_count": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32",
           "NUM_SPLITS": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_SPLIT", "EVEN_K", "NUM_TERMS", "DOT_F32", "RED_CHUNK", "PDL",
              "PREFETCH_W", "W_FP32"):
        sig[c] = "constexpr"
    # The divisibility hints a real launch gets (16-byte aligned pointers, N/K/strides multiples
    # of 16 at the BENCH shapes): without them the pipeliner makes no async copies and the
    # shared memory measured here would be that of an unpipelined loop.
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in
             ("p_x", "p_whi", "p_wlo", "p_wlo2", "p_out", "p_part", "p_count", "N", "K", "stride_xm",
              "stride_wn", "stride_om")}
    combos, simt, splitk = set(), set(), set()
    for k, n in CASES.values():
        for kk in (k, k + 4):  # K tail too (EVEN_K=False)
            for m in sorted(set(BUCKETS) | {2, 4, 8, 32, 128, 512, 2048}):
                for terms in (2, 3):
                    cfgs = candidates(m, n, kk, H200_SMS, plain=False, terms=terms) + invariant_candidates(n, kk)
                    cfgs += [dispatch.heuristic_config(m, n, kk, H200_SMS),
                             dispatch.heuristic_invariant_config(n, kk)]
                    simt |= {(c.block_m, c.block_n, c.block_k, kk % c.block_k == 0, kk <= c.block_k, c.num_warps,
                              c.num_stages) for c in cfgs if c.path == "fp32-simt"}
                    splitk |= {(c.block_m, c.block_n, c.block_k,
                                launch_shape(m, n, kk, c.block_m, c.block_n, c.block_k, c.split_k)[1] > 1,
                                kk % c.block_k == 0, c.num_warps, c.num_stages)
                               for c in cfgs if c.path == "fp32-splitk"}
                    for c in cfgs:
                        if c.path not in dispatch.TC_PATHS:
                            continue
                        c = c.fit_smem(terms)
                        _, split, _ = launch_shape(m, n, kk, c.block_m, c.block_n, c.block_k, c.split_k)
                        combos.add((c.block_m, c.block_n, c.block_k, split > 1, kk % c.block_k == 0, terms,
                                    c.num_warps, c.num_stages, c.path == "fp32-tc"))
    print(f"compiling {len(combos)} router GEMM variants for sm_90", flush=True)
    t0 = time.time()
    worst = 0
    for i, (bm, bn, bk, split, even, terms, warps, stages, w_fp32) in enumerate(sorted(combos)):
        cfg = GemmConfig(bm, bn, bk, 1, warps, stages, "fp32-tc" if w_fp32 else "triton")
        # PDL and PREFETCH_W: the build an H200 launches (router_gemm's default); RED_CHUNK uncapped, the largest
        # the launcher uses for this tile (red_chunk(split) caps it at the split count rounded up to a power of two)
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_SPLIT=split, EVEN_K=even, NUM_TERMS=terms, DOT_F32=False,
                  RED_CHUNK=cfg.red_chunk(), PDL=True, PREFETCH_W=True, W_FP32=w_fp32)
        sig_w = {**sig, "p_whi": "*fp32", "p_wlo": "*fp32", "p_wlo2": "*fp32"} if w_fp32 else sig
        ck = triton.compile(ASTSource(fn=router_gemm_kernel, signature=sig_w, constexprs=ce, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        smem = ck.metadata.shared
        worst = max(worst, smem)
        if smem > dispatch.SMEM_LIMIT or smem > cfg.smem_bytes(terms):
            raise SystemExit(f"{ce} warps={warps} stages={stages}: {smem} B of shared memory "
                             f"(limit {dispatch.SMEM_LIMIT}, estimate {cfg.smem_bytes(terms)})")
        if i % 20 == 0:
            print(f"  {i}/{len(combos)} ok (+{time.time() - t0:.0f}s)", flush=True)
    sig32 = {"p_x": "*bf16", "p_w": "*fp32", "p_out": "*fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    names = list(sig32)
    attrs32 = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a not in ("M",)}
    for (bm, bn, bk, even, one, warps, stages), pre in ((v, p) for v in sorted(simt) for p in (False, True)):
        # the prefetch build and the preload build (launch "pdl-preload", round BM); where K is one block, the
        # loop-free build router_gemm launches there (round BQ)
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, PDL=True, PREFETCH_W=not pre, PRELOAD_W=pre,
                  ONE_BLOCK=one)
        ck = triton.compile(ASTSource(fn=router_gemm_fp32_kernel, signature=sig32, constexprs=ce, attrs=attrs32),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        if ck.metadata.shared > dispatch.SMEM_LIMIT:
            raise SystemExit(f"fp32-simt {ce}: {ck.metadata.shared} B of shared memory")
    sigk = {"p_x": "*bf16", "p_w": "*fp32", "p_out": "*fp32", "p_part": "*fp32", "p_count": "*i32", "M": "i32",
            "N": "i32", "K": "i32", "K_SPLIT": "i32", "NUM_SPLITS": "i32", "stride_xm": "i32", "stride_wn": "i32",
            "stride_om": "i32"}
    names = list(sigk)
    attrsk = {(names.index(a),): [["tt.divisibility", 16]] for a in names
              if a not in ("M", "K_SPLIT", "NUM_SPLITS")}
    for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_SPLIT", "EVEN_K", "RED_CHUNK", "NUM_STAGES", "PDL", "PREFETCH_W"):
        sigk[c] = "constexpr"
    for bm, bn, bk, split, even, warps, stages in sorted(splitk):
        cfg = GemmConfig(bm, bn, bk, 2, warps, stages, "fp32-splitk")
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_SPLIT=split, EVEN_K=even, RED_CHUNK=cfg.red_chunk(),
                  NUM_STAGES=stages, PDL=True, PREFETCH_W=True)
        ck = triton.compile(ASTSource(fn=router_gemm_fp32_splitk_kernel, signature=sigk, constexprs=ce,
                                      attrs=attrsk),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        if ck.metadata.shared > dispatch.SMEM_LIMIT:
            raise SystemExit(f"fp32-splitk {ce}: {ck.metadata.shared} B of shared memory")
    print(f"all {len(combos)} split + {len(simt)} fp32-simt + {len(splitk)} fp32-splitk variants compiled for "
          f"sm_90; largest shared memory {worst} B", flush=True)
    return 0


def _time(cfg, xs, rws, outs, ref, bound, inv=False) -> float | None:
    """Median µs of ``cfg``, or None when it fails to build or is less accurate than the rule allows.

    ``bound`` is the tests' tolerance rule (``evenflow.testing.error_bound``: 2x PyTorch's
    fp32 error doing the same split math): a path may only win a bucket if the GPU tests
    would accept its output. (cuBLAS bf16 products accumulate on tensor cores without
    round-to-nearest, ~1e-5 at K=4096: the plain ``torch-split2`` path fails this.)
    """
    fns = _calls(cfg, xs, rws, outs, inv)
    try:
        out = fns[0]()
        err = (out.double() - ref).abs().max().item()
        if not math.isfinite(err) or err > bound:
            print(f"  reject {cfg}: max|err| {err:.2e} > rule bound {bound:.2e}", flush=True)
            return None
        return H.time_graph(fns, reps=10)
    except Exception as e:  # a config that fails to compile (e.g. shared memory) is skipped, and said so
        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def _calls(cfg: GemmConfig, xs, rws, outs, inv: bool = False) -> list:
    """One ``router_gemm`` call with ``cfg`` per rotated input copy (the graph the tuner and the benchmark time)."""
    return [lambda x=x, rw=rw, o=o: evenflow.router_gemm(x, rw, o, batch_invariant=inv, config=cfg)
            for x, rw, o in zip(xs, rws, outs)]


def _interleaved(configs: dict, xs, rws, outs, passes: int = 2) -> list[dict]:
    """Each named config's µs in ``passes`` passes of interleaved replays (``harness.time_graphs``)."""
    named = {name: _calls(c, xs, rws, outs) for name, c in configs.items()}
    return [H.time_graphs(named, rounds=20) for _ in range(passes)]


def table_incumbent(table: dict, k: int, n: int, terms: int, m: int) -> GemmConfig | None:
    """The table's current pick for the (K, N, terms, M) bucket as the tuner times it, or None.

    At the candidates' launch mode (GemmConfig's default): a tile is timed once, whatever mode its entry had, and
    the bucket's winner gets its mode from ``choose_launch`` afterwards. An entry on "pdl-preload" keeps it: its
    tiles are candidates of their own in that mode, and a challenger must beat the entry as it runs (round BN3:
    timed at "pdl", K4096 M = 4's entry read 3.60 us against its 3.00 with the preload). The contest is uneven the
    other way then: a split-K or tensor-core challenger is timed at "pdl", not its best mode (K4096 M = 4's
    fp32-splitk entry of BN1: 3.47 us at "pdl", 3.25 at "pdl-prefetch"), so a preload entry keeps its place unless
    beaten by more than the prefetch gives; a preload challenger had that edge over such entries since round BM."""
    old = [GemmConfig.from_dict(e["config"]).fit_smem(terms) for e in table.get("entries", [])
           if (e["K"], e["N"], e.get("terms", 3), e["m_max"]) == (k, n, terms, m)]
    if not old:
        return None
    return old[0] if old[0].launch == "pdl-preload" else replace(old[0], launch=GemmConfig().launch)


def confirm_challenger(incumbent: GemmConfig, best: tuple[GemmConfig, float], xs, rws, outs,
                       margin: float = REPLACE_MARGIN) -> tuple[GemmConfig, float]:
    """``best`` (config, µs) if it beats the table's ``incumbent`` again, timed beside it in interleaved replays
    (two passes, as ``choose_launch`` times), by more than ``margin`` both times; else the incumbent. One timing
    each ranks configs within ~3% of each other by chance: round AG3's re-tune replaced K4096 M = 4's entry on
    a 1.6% lead, and the record then read the new one 10% slower than the old one had read in AG2's."""
    passes = _interleaved({"old": incumbent, "new": best[0]}, xs, rws, outs)
    wins = sum(us["new"] < us["old"] * (1 - margin) for us in passes)
    print(f"    challenger {_short(best[0])} against the table's {_short(incumbent)}: "
          f"{'replaces it' if wins == 2 else 'kept out'} ({wins}/2 passes faster by > {margin:.0%})", flush=True)
    return best if wins == 2 else (incumbent, passes[-1]["old"])


def choose_launch(cfg: GemmConfig, xs, rws, outs, rounds: int = 2) -> tuple[GemmConfig, dict]:
    """``cfg`` with the launch mode (``dispatch.LAUNCHES``) measured fastest here, and each mode's µs.

    Same kernel and bits whatever the mode (PDL changes when a kernel starts, the L2 prefetch is a
    hint), so no accuracy check; each mode's graph (back-to-back calls on rotated copies, as the
    benchmark times them) is timed in ``rounds`` passes of interleaved replays
    (``harness.time_graphs``) and scored by the mean of its medians. Plain paths are returned as
    they are."""
    if cfg.path not in KERNEL_PATHS:
        return cfg, {}
    modes = launches_for(cfg.path)
    m, k = xs[0].shape
    if cfg.path == "fp32-tc" and not _one_step(cfg, m, rws[0].shape[0], k):
        modes = tuple(mode for mode in modes if mode != "pdl-preload")  # it would run as "pdl-prefetch"
    passes = _interleaved({mode: replace(cfg, launch=mode) for mode in modes}, xs, rws, outs, rounds)
    mean = {mode: sum(us[mode] for us in passes) / len(passes) for mode in modes}
    mode = min(modes, key=lambda m: mean[m])
    return replace(cfg, launch=mode), {m: round(v, 3) for m, v in mean.items()}


def kept_entries(table: dict, redo: set, buckets: tuple | None, tune_invariant: bool) -> tuple[list, list]:
    """(entries, batch-invariant entries) of ``table`` that a run re-tuning the (K, N, terms) in
    ``redo`` keeps: other shapes and term counts, and with ``buckets`` (``--buckets``) the
    other M buckets of the re-tuned shapes; invariant entries unless ``tune_invariant``."""
    def key(e):
        return e["K"], e["N"], e.get("terms", 3)

    entries = [e for e in table.get("entries", [])
               if key(e) not in redo or (buckets is not None and e["m_max"] not in buckets)]
    invariant = [e for e in table.get("batch_invariant", []) if key(e) not in redo or not tune_invariant]
    return entries, invariant


def bucket_share(budget_s: float, timed_s: float, buckets_left: int) -> float:
    """A bucket's share of ``--budget-s``: what the buckets before it did not spend timing (their compiles do not
    count), split evenly over the buckets left, this one included; at least 1 s."""
    return max(1.0, (budget_s - timed_s) / buckets_left)


def _extra(p):
    p.add_argument("--cases", default=None, help="comma-separated case names")
    p.add_argument("--terms", type=int, default=3, choices=(2, 3), help="RouterWeight terms to tune for")
    p.add_argument("--compile-only", action="store_true", help="no GPU: compile every candidate for sm_90")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="seconds of timing (compiles not counted); each bucket gets an equal share of what is left")
    p.add_argument("--table", default=None, help="table JSON, read first when it exists and rewritten "
                   "(default src/evenflow/router/configs/<gpu>.json)")
    p.add_argument("--launch-only", action="store_true",
                   help="keep every selected entry's config and re-time only its launch mode (plain / pdl / "
                        "pdl-prefetch, and pdl-preload on fp32-simt and on one-step fp32-tc tiles)")
    p.add_argument("--reduces", default=None,
                   help="comma-separated split-K reductions whose kernel candidates are offered (counter, atomic; "
                        "default both): e.g. 'atomic' times the table's entry against the atomic candidates alone")
    p.add_argument("--buckets", default=None,
                   help=f"comma-separated M buckets to re-tune (of {','.join(map(str, BUCKETS))}); the table's "
                        "other entries are kept")


def main() -> int:
    args = H.parse_args(__doc__.splitlines()[0], extra=_extra)
    if args.compile_only:
        return compile_only()
    terms = args.terms
    cases = args.cases.split(",") if args.cases else tuple(CASES)
    buckets = QUICK_BUCKETS if args.quick else BUCKETS
    if args.buckets:
        buckets = tuple(sorted({int(v) for v in args.buckets.split(",")}))
        bad = [b for b in buckets if b not in BUCKETS]
        if bad:
            raise SystemExit(f"--buckets: {bad} are not M buckets (choose from {BUCKETS})")
    if args.reduces and not set(args.reduces.split(",")) <= set(REDUCES):
        raise SystemExit(f"--reduces: choose from {REDUCES}, got {args.reduces!r}")
    # The batch-invariant score is a geomean over INVARIANT_MS: re-scored only when all are timed.
    tune_invariant = not args.buckets or all(m in buckets for m in INVARIANT_MS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name(0)
    table_path = Path(args.table) if args.table else (
        Path(evenflow.router.__file__).parent / "configs" / f"{H.gpu_slug(name)}.json")
    table = json.loads(table_path.read_text()) if table_path.is_file() else {}
    redo = {(*CASES[c], terms) for c in cases}
    if args.launch_only:
        return launch_only(table, table_path, redo, buckets, name, sms)
    entries, invariant = kept_entries(table, redo, buckets if args.buckets else None, tune_invariant)
    summary = []
    t0 = time.time()
    timed = 0.0  # seconds spent timing (the compiles not counted): what the budget bounds
    torch.manual_seed(0)
    todo = len(cases) * len(buckets)
    for case in cases:
        k, n = CASES[case]
        inv_times: dict[GemmConfig, list[float]] = {c: [] for c in invariant_candidates(n, k)}
        for m in H.progress(buckets, f"tune {case}"):
            share = bucket_share(args.budget_s, timed, todo)
            todo -= 1
            copies = max(1, min(16, math.ceil(ROTATE_BYTES / (n * k * 4 + m * k * 2))))
            ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
            rws = [evenflow.RouterWeight(w, terms=terms) for w in ws]
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            outs = [torch.empty(m, n, device="cuda") for _ in range(copies)]
            ref = R.router_logits_fp64(xs[0], ws[0])
            bound = error_bound(ref, R.split_logits_fp32(xs[0], *rws[0].parts), torch.float32)
            best = None
            cands = candidates(m, n, k, sms, terms=terms)
            if args.reduces:
                cands = [c for c in cands if c.path in KERNEL_PATHS and c.reduce in args.reduces.split(",")]
            # The table's current pick for this bucket is always re-timed (first), so a short
            # budget can only replace it by something measured faster in this run.
            incumbent = table_incumbent(table, k, n, terms, m)
            if incumbent is not None:
                cands = [incumbent] + [c for c in cands if c != incumbent]
            # JIT first (once per compiled variant, cached after), so a bucket's share of the
            # budget is spent on timings, not on compiling the candidates that come last.
            for cfg in cands:
                if cfg.path in KERNEL_PATHS:
                    try:
                        evenflow.router_gemm(xs[0], rws[0], outs[0], config=cfg)
                    except Exception:  # reported by _time below
                        pass
            torch.cuda.synchronize()
            t_bucket = time.time()
            skipped = 0
            for cfg in cands:
                # Over this bucket's share: no more kernel configs (best-first order, so the
                # likely winners were timed); the plain paths (last) are always timed.
                if (cfg.path in SPLIT_K_PATHS and cfg != incumbent and best is not None
                        and time.time() - t_bucket > share):
                    skipped += 1
                    continue
                us = _time(cfg, xs, rws, outs, ref, bound)
                if us is not None:  # every candidate's time, for the record (the winner is printed below)
                    print(f"    {us:7.3f} us  {_short(cfg)}", flush=True)
                if us is not None and (best is None or us < best[1]):
                    best = (cfg, us)
            for cfg in inv_times if tune_invariant and m in INVARIANT_MS else ():
                us = _time(cfg, xs, rws, outs, ref, bound, inv=True)
                inv_times[cfg].append(us if us is not None else float("inf"))
            if skipped:
                print(f"  {case} M={m}: budget share {share:.0f}s spent, {skipped}/{len(cands)} candidates "
                      "not timed", flush=True)
            timed += time.time() - t_bucket
            if best is None:
                old = [e for e in table.get("entries", []) if (e["K"], e["N"], e.get("terms", 3), e["m_max"])
                       == (k, n, terms, m)]
                entries += old  # keep the previous measurement rather than leave a hole
                print(f"  no working config for {case} M={m}" + (" (previous entry kept)" if old else ""),
                      flush=True)
                continue
            if incumbent is not None and best[0] != incumbent:
                best = confirm_challenger(incumbent, best, xs, rws, outs)
            cfg, launch_us = choose_launch(best[0], xs, rws, outs)
            best = (cfg, launch_us.get(cfg.launch, best[1]))
            entries.append({"K": k, "N": n, "terms": terms, "m_max": m, "us": round(best[1], 3),
                            "config": best[0].to_dict(), **({"launch_us": launch_us} if launch_us else {})})
            summary.append((case, m, best[0], best[1]))
            print(f"  best M={m}: {best[0]} {best[1]:.2f} us  (+{time.time() - t0:.0f}s)", flush=True)
            del ws, rws, xs, outs
            torch.cuda.empty_cache()
        scored = [(math.exp(sum(math.log(t) for t in ts) / len(ts)), c) for c, ts in inv_times.items()
                  if ts and all(math.isfinite(t) for t in ts)]
        if scored:
            g, cfg = min(scored, key=lambda s: s[0])
            invariant.append({"K": k, "N": n, "terms": terms, "geomean_us": round(g, 3), "config": cfg.to_dict()})
    entries.sort(key=lambda e: (list(CASES.values()).index((e["K"], e["N"])) if (e["K"], e["N"]) in CASES.values()
                                else len(CASES), e["K"], e["N"], e.get("terms", 3), e["m_max"]))
    table = {"gpu": name, "sms": sms, "header": H.header(), "entries": entries, "batch_invariant": invariant}
    _write_table(table, table_path)
    print("\n| case | M <= | path | BM | BN | BK | split | warps | stages | reduce | us |")
    print("|---" * 11 + "|")
    for case, m, c, us in summary:
        print(f"| {case} | {m} | {c.path} | {c.block_m} | {c.block_n} | {c.block_k} | {c.split_k} | "
              f"{c.num_warps} | {c.num_stages} | {c.reduce} | {us:.2f} |")
    print(f"\nwritten: {table_path}")
    return 0


def _write_table(table: dict, table_path: Path) -> None:
    text = json.dumps(table, indent=1) + "\n"
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(text)
    if os.environ.get("OUT"):
        extra = Path(os.environ["OUT"]) / "router-configs"
        extra.mkdir(parents=True, exist_ok=True)
        (extra / table_path.name).write_text(text)


def launch_only(table: dict, table_path: Path, redo: set, buckets: tuple, name: str, sms: int) -> int:
    """``--launch-only``: each selected entry keeps its config; its launch mode is re-timed (``choose_launch``)."""
    if not table.get("entries"):
        raise SystemExit(f"--launch-only: no table entries in {table_path}")
    torch.manual_seed(0)
    print("\n| K | N | M <= | path | each launch mode, us | chosen |")
    print("|---" * 6 + "|")
    for e in H.progress([e for e in table["entries"] if (e["K"], e["N"], e.get("terms", 3)) in redo
                         and e["m_max"] in buckets], "launch modes"):
        k, n, m = e["K"], e["N"], e["m_max"]
        cfg = GemmConfig.from_dict(e["config"])
        copies = max(1, min(16, math.ceil(ROTATE_BYTES / (n * k * 4 + m * k * 2))))
        ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
        rws = [evenflow.RouterWeight(w, terms=e.get("terms", 3)) for w in ws]
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        outs = [torch.empty(m, n, device="cuda") for _ in range(copies)]
        for rw in rws:
            rw.workspace(m, cfg.fit_smem(rw.terms))
        cfg, launch_us = choose_launch(cfg, xs, rws, outs)
        if launch_us:
            e["config"] = cfg.to_dict()
            e["launch_us"] = launch_us
            print(f"| {k} | {n} | {m} | {cfg.path} | " + " | ".join(f"{x} {launch_us[x]:.2f}" for x in launch_us)
                  + f" | {cfg.launch} |", flush=True)
        del ws, rws, xs, outs
        torch.cuda.empty_cache()
    table["header"] = H.header()
    table["gpu"], table["sms"] = name, sms
    _write_table(table, table_path)
    print(f"\nwritten: {table_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
