"""fused_moe: index build -> gate-up GEMM (+SiLU*mul, +FP8 requant) -> down GEMM -> top-k reduce.

Launcher only: argument checks, workspace allocation, deterministic tile-size
choice from host-known shapes (no sync), and the ``evenflow::fused_moe_``
custom op that torch.compile and CUDA graphs see.
"""
import functools
import json
import math
import os
import warnings
from dataclasses import MISSING, dataclass, fields, replace

import torch

from evenflow._checks import (
    check_bool,
    check_int,
    check_out,
    check_pdl,
    check_same_device,
    check_scaling,
    check_tensor,
    checked_op,
)
from evenflow._runtime import (
    cdiv,
    dot_needs_fp32,
    fp8_cast_needs_rounding,
    host_sync_allowed,
    next_power_of_2,
    num_sms,
    pdl_kwargs,
    pdl_supported,
    tuned_table_path,
)
from evenflow.moe.kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_reduce_kernel,
    moe_tensor_quant_kernel,
    moe_zero_kernel,
)
from evenflow.moe.quant import (
    MIN_GU_BLOCK_N,
    MODE,
    PAIR_TILE_MAX_PAIRS,
    MoEWeights,
    group_quant_buffers,
    launch_group_quant,
)
from evenflow.moe.routing import MAX_BLOCK_M, MAX_EXPERTS, MAX_TOP_K, build_moe_index, max_tiles

__all__ = ["fused_moe", "MoEConfig", "choose_config", "check_config", "tuned_config"]

# Tuned tile configs (written by benchmarks/tune_moe.py), read as data; one file per GPU, named by its slug.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Programmatic dependent launch chains the layer's 4-6 kernels (each launched while the one
# before it drains, waiting for it before its first load) up to this many (token, slot)
# pairs. Round G set 512 (measured at T = 1-64 only: faster at 37 of 40 points); round AD6
# measured 1024-8192 pairs (T = 128-1024 at top-8, both row orders): less time at 27 of 32
# points, 2.2-5.5% on every fp8 layer at T = 128-256, at most 0.8% more at three bf16 points
# in both orders (docs/perf-notes/moe.md). Not measured beyond.
PDL_MAX_PAIRS = 8192
# With PDL, the activation quantisation kernel runs beside the index (or zeroing) kernel ahead of it and waits
# for it only before exiting (round U). False: it waits at its top like every other kernel of the layer (the A/B
# of benchmarks/moe.py's evenflow-serialquant row).
QUANT_OVERLAP = True
# bf16 weights and per-tensor fp8 in the fp8-MMA modes ("fast", "promoted"; one scale for gate and up): the gate-up
# GEMM takes the gate and up n-blocks of a task as one MMA of twice the width a K step (kernels._gate_up_tile's
# ONE_DOT; round AT) on index tiles of at least GU_ONE_DOT_MIN_ROWS rows. AT7's A/B on every bf16 point of the three
# shapes, two passes: 1.00-1.05x at T >= 512 (64- and 128-row tiles), none under 0.999; on the 16-row tiles of
# T <= 256 no gain and a few points 1-3% slower (Hy3 TP8 T = 128 0.979 in both passes), so those keep the two dots.
# AT8, the fp8-MMA modes at T = 512-4096: fast 0.998-1.037x, promoted 0.997-1.020x. Block mode keeps two dots (gate
# and up scales differ), and so does the exact fp8 mode, whose tiles stop at 32 rows (not measured at 64).
# False: two dots everywhere, as before round AT (benchmarks/moe.py's evenflow-gu2dot rows).
GU_ONE_DOT = True
GU_ONE_DOT_MIN_ROWS = 64
GU_ONE_DOT_PROMOTED_MAX_ACC = 64  # accumulator values a thread (see _gate_up_one_dot: larger promoted builds spill)
# fused_moe(fp8_accum=...): "exact" (default) takes f16 products of the e4m3 values with fp32
# accumulation; "fast" (opt-in, FP8 weights) feeds e4m3 tiles to fp8 wgmma with the hardware's
# reduced-precision accumulation (kernels.py, FAST_ACC); "promoted" (opt-in) the same fp8 MMAs with
# each K step's sum (<= 128 products) added to an fp32 accumulator, in per-tensor mode too (FAST_ACC == 2).
# fp8 tl.dot needs K-steps >= 32. Both fp8-MMA modes share choose_config's rules; each has its table keys.
FP8_ACCUM = ("exact", "promoted", "fast")
# per mode: kernels.FAST_ACC and the tuned table's key suffix
_ACC_KIND = {"exact": 0, "fast": 1, "promoted": 2}
_KEY_SUFFIX = {"exact": "", "fast": "-fast", "promoted": "-prom"}
FAST_ACC_MIN_BLOCK_K = 32
# The GEMMs a persistent count applies to (MoEConfig.persistent, fused_moe(persistent=)): both (rounds T, AT); a
# module switch for the down GEMM alone (round AU's knob rows: the probe's persistent loop kept its gain on the down's
# one-accumulator shape and lost it on the gate-up's, AT5), and the down loop's task order (n-blocks of a tile in
# turn: PERSIST_DOWN_N_FASTEST; AT4's kernel split read that order's down GEMM 1.15x faster at Qwen3 bf16 T = 4096).
PERSIST_GEMMS = ("gate_up", "down")
PERSIST_DOWN_N_FASTEST = False
# MoEConfig.persistent / fused_moe(persistent=): programs per SM, capped here (a chosen bound: the GEMM tiles'
# registers and shared memory leave room for 1-5 resident programs per SM at the measured configs).
MAX_PERSISTENT = 8
# Round BK: on pair tiles under PDL the GEMMs that MoEConfig.prefetch names ask L2 for their own weight lines before
# waiting for the kernel ahead (kernels.PREFETCH), so a program's first copies are in flight while the kernel ahead
# (the activation quantisation for the gate-up, the gate-up for the down GEMM) still runs. The gate-up takes it only
# where a kernel of the layer that waited for the layer's inputs runs ahead of it (an fp8 quantisation or the
# zeroing kernel): it reads the pair's expert from topk_ids before its own wait. Results bit for bit the same (a
# hint). PAIR_PREFETCH (module switch; benchmarks/moe.py's evenflow-pf* / -nopf rows): None, the config's choice; a
# tuple of GEMM names forces those. PAIR_PREFETCH_STEPS: the K steps of lines a program asks for, 0 its whole K range
# (BK1: slower at every fp8 point and 21 of 24 for the down GEMM, as round AD3's form, the gate-up asking for the
# down's weights, had been), 1 its first step (BK2; docs/perf-notes/moe.md, "Round BK").
PAIR_PREFETCH: tuple | None = None
PAIR_PREFETCH_STEPS = 1
# Round BO: the top-k reduce with two branches that keep its loads in the two round trips its ids and rows need
# (kernels.moe_reduce_kernel's FENCED: the sm_90 build without them takes 4 round trips a program, 10 at four down
# K splits). The same bits. On since round BQ: 0.9964 of the unfenced build's time over every shape and format at
# T = 1-4 (the median of BQ5's four passes; 0.976 at Hy3 EP8 bf16 T = 1; BQ2 / BQ5; benchmarks/moe.py's
# evenflow-unfencedreduce rows switch it off).
REDUCE_FENCED = True
# Round CF, on since round CG (benchmarks/moe.py's evenflow-narrowdown rows switch it off): in the exact fp8 mode
# above 16 rows per expert (choose_config's 32-row mma.sync tiles) the down GEMM takes 128-wide N blocks where H
# allows. Every down program converts its 32-row intermediate tile from e4m3 each K step, so half as many n-blocks
# should halve that conversion per weight byte (the likely cause; the sm_90 builds issue 0.71x the loop instructions
# and 0.67x the conversions a column; not profiled). The tuners' timings of the 64-wide tile and of that tile with
# down_block_n = 128 ("default-dn128" in configs/*.json) put the wide tile at 0.910-1.008 of the narrow one's time,
# median 0.951, over the 27 such points of the benchmark shapes on the two cards that hold that timing
# (benchmarks/results/h100/history/round-cf/cpu/wide_down_from_tuner_timings.txt); round CG1's probe of four shards no
# table tunes (benchmarks/probe_moe_wide_down.py, one H100, two interleaved passes, 19 points) 0.919-1.012, median
# 0.956 / 0.958 in its two passes, every output bitwise the narrow tile's (docs/perf-notes/moe.md, "Round CG").
WIDE_DOWN_N = True
# Round CG, on since CG2 (benchmarks/probe_moe_wide_down.py --switch deep-k times it off and on): bf16 weights on
# choose_config's 16- and 32-row tiles (at most 32 rows per expert) from 4 tokens a call take 128-deep K steps in both
# GEMMs, where H and I are multiples of 128 times the K splits the heuristic derived for 64-deep steps (kept). The
# tuners time that tile ("gk128" in configs/*.json: the default's tile with both K steps 128 deep): at the 31 bf16
# points of Qwen3-30B-A3B and Hy3 EP8 with 4-512 tokens on both cards that hold both timings it ran 0.894-0.999 of the
# 64-deep tile's time, median 0.955, never slower; at 1-2 tokens 0.871-1.035 (Qwen3 slower at all four), so those stay
# 64 deep (benchmarks/results/h100/history/round-cg/cpu/deep_k_from_tuner_timings.txt). CG2's probe of three shards no
# table tunes (Hy3 TP2 / EP2, DeepSeek-V3 TP8; T = 4-512, 15 points, one H100): 0.904-1.006, median 0.954 / 0.951 in
# its two passes, every output bitwise the 64-deep tile's (docs/perf-notes/moe.md, "Round CG"). Half as many K steps
# halve the per-step loop overhead and barrier waits of a GEMM whose tile has few rows (the likely cause; not
# profiled).
DEEP_K_BF16 = True
DEEP_K_MIN_TOKENS = 4
# Pair tiles under expert parallelism pack the rank's own pairs' programs first (round Y): every program loads
# all the pairs' ids to find its task; past this many pairs (pair tiles forced at larger batches) they do not.
LOCAL_FIRST_MAX_PAIRS = 256


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of one fused_moe call. ``choose_config`` picks them; tests may force one."""
    block_m: int
    gu_block_n: int
    gu_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int = 4
    num_stages: int = 3
    gu_split_k: int = 1
    down_split_k: int = 1
    # 1: a K-split gate-up on pair tiles leaves its partials to the down GEMM (round P: a win only
    # where the down GEMM has few K steps and wide N blocks; the tuner decides per point, the
    # heuristic never defers). Tables written before it have 9 values: 0.
    gu_defer: int = 0
    # > 0: each GEMM that runs index tiles without a K split (larger batches) is launched as this many
    # programs per SM, which take the used (tile, n-block) tasks in turn in one flattened loop (kernels.py,
    # PERSIST); 0: one program per task of the upper-bound task map (unused ones exit at once). Pair tiles
    # and K-split GEMMs always take one program per task. Tables written before it: 0. Not faster than one
    # program per task but at 3 of 96 benchmark points (rounds T3, T6, docs/perf-notes/moe.md): never the default.
    persistent: int = 0
    # The down GEMM's n-blocks a program takes in one loop (power of two dividing H / down_block_n; round AJ):
    # at few K steps a program (Hy3 TP8: K = I = 192, three 64-deep steps) each program is mostly prologue and
    # epilogue, and the grid is several waves of such programs. 1: one n-block a program (tables written before
    # it).
    down_n_group: int = 1
    # 1: index tiles (the index build) where the launcher's rule takes pair tiles (at most PAIR_TILE_MAX_PAIRS pairs on
    # 16-row tiles): the tuner's choice per point (round AK: at 32 pairs pair tiles were faster on 6 of the 8 benchmark
    # series, not on Qwen3 fp8-tensor). 0: the rule (tables written before it).
    index_tiles: int = 0
    # Pair tiles under PDL (round BK): the GEMMs whose programs ask L2 for their first K step's weight lines before
    # their PDL wait, bit 1 the gate-up (only behind a kernel of the layer that waited: fp8 layers), bit 2 the down
    # GEMM; 0 none (tables written before it). The same bits either way (a hint); the tuner's choice per point: BK2's
    # A/B read 0.93-1.08x over the pair-tile points, gains at Hy3 EP8 and Qwen3 fp8-block, losses at Hy3 TP8 bf16.
    prefetch: int = 0

    def __post_init__(self):
        # checked once, where a config is made (table load, heuristic, a caller's replace), not per call
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"config.{f.name} must be an int, got {type(v).__name__}")

    def as_list(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, v) -> "MoEConfig":
        return cls(*(int(x) for x in v))


def _largest_divisor(n: int, options) -> int:
    for b in options:
        if n % b == 0:
            return b
    raise ValueError(f"no tile size in {options} divides {n}")


def _split_k(k_dim: int, block_k: int, programs: int, target: int, elem_bytes: int = 2) -> int:
    """Smallest power-of-two K split that gives ``target`` programs, keeping each split >= 2 K-steps and
    >= 512 bytes of every weight row deep (bf16: 256 deep, as measured in round B; fp8: 512 deep = 4 steps
    of 128, where the 256-deep 16-way split left each program two steps and a pipeline that never fills)."""
    min_depth = max(2 * block_k, 512 // elem_bytes)
    s = 1
    while (programs * s < target and s < 16 and k_dim % (2 * s * block_k) == 0
           and k_dim // (2 * s) >= min_depth):
        s *= 2
    return s


def _gate_up_one_dot(cfg: MoEConfig, mode: int, acc_kind: int, pair_tiles: bool) -> bool:
    """Whether the gate-up runs as one MMA of twice the width (``GU_ONE_DOT``, above): index tiles of
    ``GU_ONE_DOT_MIN_ROWS`` rows and more, bf16 or per-tensor fp8 in an fp8-MMA mode. Pair tiles (16 rows; a caller's
    wider ones) and the exact fp8 mode keep two dots (unmeasured). The promoted mode sums each K step apart from the
    accumulator, so one dot doubles that partial too: past ``GU_ONE_DOT_PROMOTED_MAX_ACC`` accumulator values a
    thread its build spills (436 B on the heuristic's 128 x (128 + 128) tile on 8 warps) and it keeps two dots."""
    if not GU_ONE_DOT or pair_tiles or cfg.block_m < GU_ONE_DOT_MIN_ROWS:
        return False
    if not (mode == 0 or (mode == 1 and acc_kind != 0)):
        return False
    acc_values = cfg.block_m * 2 * cfg.gu_block_n // (32 * cfg.num_warps)
    return acc_kind != 2 or acc_values <= GU_ONE_DOT_PROMOTED_MAX_ACC


def choose_config(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, mode: int, *,
                  num_experts_total: int | None = None, sms: int = 132, fast_acc: bool = False) -> MoEConfig:
    """Deterministic heuristic from shapes only (see docs/perf-notes/moe.md).

    BLOCK_M follows the expected rows per expert (T*k/E): 16 (tl.dot's minimum) at
    decode, larger when experts see many tokens. N-blocks stay narrow (64) so that
    each expert's weights are streamed by many programs at once. In FP8 block mode the
    heuristic keeps the gate-up N-block at 128 (one program owns a whole activation group
    of the intermediate; narrower blocks, a tuned choice, requantise each group in its
    last program) and K-blocks at 128 (one weight scale per K step).

    When the expected busy (tile, n-block) programs are fewer than 2 per SM (decode,
    or EP ranks that see a pair or two), K is split so the weights of the few hit
    experts are streamed by enough programs at once.

    FP8 weights in the default (exact) mode take 32-row tiles (4 warps, 4 stages) above 16 rows
    per expert, whatever the batch: the tile class the tuner chose at every such point of the tuned
    table (round S8; since round T4 most of those entries widen the down GEMM's N block, and so does this
    function since round CG where H allows: 128 wide, the module switch ``WIDE_DOWN_N``).

    ``fast_acc`` (FP8 weights, ``fp8_accum="fast"`` or ``"promoted"``): K-steps of at least 32 (fp8 dots), and
    above 16 rows per expert fp8-wgmma tiles (64 rows; 128 past 128 rows in per-tensor mode).

    Where the down GEMM has few K steps (a tensor-parallel shard's small I), a down program takes several n-blocks
    of its tile from 8 rows per expert (:func:`_down_n_group`, round AJ).
    """
    return _heuristic(num_tokens, top_k, num_local, hidden, inter, mode, num_experts_total, sms, bool(fast_acc),
                      (WIDE_DOWN_N, DEEP_K_BF16, DEEP_K_MIN_TOKENS, FEW_DOWN_K_STEPS))


# choose_config's result per shape, batch and module switch (its key's last tuple: the switches the heuristic reads,
# and none it reads otherwise, which a test checks): a call made it again from a dozen dataclass copies, 17% of an
# eager fused_moe call's host time at T = 1 in round CM's profile (docs/perf-notes/moe.md, "Round CM").
@functools.lru_cache(maxsize=4096)
def _heuristic(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, mode: int,
               num_experts_total: int | None, sms: int, fast_acc: bool, switches: tuple) -> MoEConfig:
    wide_down_n, deep_k_bf16, deep_k_min_tokens, few_down_k_steps = switches
    e_tot = num_experts_total or num_local
    local_pairs = num_tokens * top_k * num_local / e_tot  # expected pairs routed to this rank
    rows = local_pairs / max(num_local, 1)
    fp8 = mode != 0
    # FP8 in the exact mode: every dot is an f16 product of exact e4m3 values (rounds F, G). On 64/128-row
    # tiles (wgmma on sm_90) the upcast operand makes a register -> shared-memory round trip each K step;
    # 32-row tiles (mma.sync, operands in registers) avoid it. Round S8: the tuner had chosen 32 x 64
    # (per-tensor) / 32 x 128 (block) gate-up tiles on 4 warps, 4 stages at every fp8 point above 16 rows per
    # expert of all three benchmark shapes (T = 512, 1024, 4096); round S7 measured them 1.59-1.78x faster
    # than this function's former 64-row choice on the untuned Hy3 TP2 / EP2 shards
    # (benchmarks/results/h200/history/round-s7). Round T4's re-tune kept mma.sync-sized tiles on 4 warps at
    # every such point (32 rows at all but one, 16 there; a down N block of 128 or 256 at 10 of 15, null
    # (this function's tile) at 4). Fast accumulation keeps its fp8-wgmma tiles below.
    exact_fp8 = fp8 and not fast_acc
    block_m = 16 if rows <= 16 else 32 if exact_fp8 or rows <= 32 else 64
    if mode == 2:
        cfg = MoEConfig(block_m, 128, 128, 64, 128)
    else:
        # fp8 per-tensor: deeper K steps first (half the bytes of a bf16 step); 16 only where
        # nothing larger divides (the dots are f16 MMAs of exact e4m3 values, K-steps >= 16).
        k_opts = (128, 64, 32) if fast_acc else (128, 64, 32, 16) if fp8 else (64, 32, 16)
        cfg = MoEConfig(
            block_m,
            _largest_divisor(inter, (64, 32, 16)),
            _largest_divisor(hidden, k_opts),
            _largest_divisor(hidden, (64, 32, 16)),
            _largest_divisor(inter, k_opts),
        )
    if exact_fp8 and rows > 16:
        cfg = replace(cfg, num_stages=4)
        if wide_down_n and hidden % 128 == 0:
            cfg = replace(cfg, down_block_n=128)
    elif rows > 32 or (fp8 and rows > 16):
        # Fast accumulation (fp8 weights) takes these fp8-wgmma tiles from 16 rows per expert up:
        # 64 rows (one wgmma M per warpgroup) up to 128 rows, 128 past it (per-tensor; block mode
        # stays at 64: each K block's fresh product tile doubles its accumulator registers, and its
        # 128-wide gate-up spilled 1.5 KB per thread at 128 rows, ptxas -v in round 5); sm_90 compile
        # facts in docs/perf-notes/moe.md, round J.
        # Prefill-sized expert groups (round B: 0.39-0.69x SGLang at T >= 512 with 64-wide N and 4
        # warps): 128-wide N blocks halve the activation re-reads per weight byte, 8 warps give the
        # wgmma M=64 per warpgroup pair enough rows; BLOCK_M 128 once experts see >= 128 rows.
        cfg = replace(
            cfg,
            block_m=128 if rows > 128 and mode != 2 else 64,
            gu_block_n=128 if inter % 128 == 0 else cfg.gu_block_n,
            down_block_n=128 if hidden % 128 == 0 else cfg.down_block_n,
            num_warps=8,
        )
        block_m = cfg.block_m
    busy_tiles = max(1, min(num_local, math.ceil(local_pairs)), math.ceil(local_pairs / block_m))
    target = 2 * sms
    eb = 1 if fp8 else 2
    cfg = replace(
        cfg,
        gu_split_k=_split_k(hidden, cfg.gu_block_k, busy_tiles * (inter // cfg.gu_block_n), target, eb),
        down_split_k=_split_k(inter, cfg.down_block_k, busy_tiles * (hidden // cfg.down_block_n), target, eb),
    )
    cfg = replace(cfg, down_n_group=_down_n_group(cfg, rows, hidden, inter, fast_acc, few_down_k_steps))
    if deep_k_bf16 and mode == 0 and cfg.block_m <= 32 and num_tokens >= deep_k_min_tokens \
            and hidden % (128 * cfg.gu_split_k) == 0 and inter % (128 * cfg.down_split_k) == 0:
        # only the K depth changes, as the tuners' "gk128" and CG2's probe measured it: the n-group stays the one
        # derived for 64-deep steps (re-deriving it at 3-4 down K steps, I in (256, 512], is not measured)
        cfg = replace(cfg, gu_block_k=128, down_block_k=128)
    return cfg


# Round AJ (docs/perf-notes/moe.md): where the down GEMM has at most this many K steps a task (a tensor-parallel
# shard's small I), choose_config gives a program several n-blocks of its tile (MoEConfig.down_n_group).
FEW_DOWN_K_STEPS = 4


def down_k_steps(cfg: MoEConfig, inter: int) -> int:
    """K steps a down-GEMM task runs under ``cfg`` (K = I, split down_split_k ways, down_block_k deep)."""
    return inter // (cfg.down_block_k * cfg.down_split_k)


def _down_n_group(cfg: MoEConfig, rows: float, hidden: int, inter: int, fast_acc: bool, few_k_steps: int) -> int:
    """The heuristic's down n-group: 8 n-blocks a program above 16 rows per expert, 4 from 8 rows, where the down GEMM
    has at most ``few_k_steps`` K steps (the heuristic passes FEW_DOWN_K_STEPS) and no K split (the largest power of
    two up to that dividing the n-blocks); else 1. Round AJ7 measured it on the heuristic's tiles of two untuned
    shards (Qwen3-235B-A22B and DeepSeek-V3 at TP8, two to four K steps), as layer time over R = 1's: fp8 0.83-0.90
    above 16 rows per expert and 0.87-0.98 at 8-16 (R = 4), bf16 0.92-1.01 above 16 and 0.93-1.00 at 8-16; R = 8 at 8
    rows 0.89-1.02 (Qwen3-235B 1.01-1.02, so 4 there); AJ3 at Hy3 TP8 (three steps) 0.90-0.99 above 16 rows. Not on
    the fp8-MMA modes' wgmma tiles (above 16 rows: not measured with it); at 8-16 rows those modes take the exact
    mode's config, R included (the same mma.sync tiles, choose_config's docstring)."""
    if (fast_acc and rows > 16) or cfg.down_split_k > 1 or rows < 8 or down_k_steps(cfg, inter) > few_k_steps:
        return 1
    g = 8 if rows > 16 else 4
    while (hidden // cfg.down_block_n) % g:
        g //= 2
    return g


def tuned_key(num_local: int, num_experts_total: int, top_k: int, hidden: int, inter: int, mode: int,
              accum: str = "exact") -> str:
    """Key of one shape and format in the tuned table for ``fused_moe(fp8_accum=accum)``; the fp8-MMA modes
    have their own keys (suffix ``-fast``: formats fp8-tensor-fast / fp8-block-fast of benchmarks/tune_moe.py;
    ``-prom``: fp8-tensor-prom / fp8-block-prom)."""
    if accum not in _KEY_SUFFIX:
        raise ValueError(f"accum must be one of {FP8_ACCUM}, got {accum!r}")
    return f"E{num_local}/{num_experts_total}-k{top_k}-H{hidden}-I{inter}-m{mode}" + _KEY_SUFFIX[accum]


class _Table(dict):
    """A loaded table: tuned key -> sorted (batch bucket, config or None) rows; ``lookups`` keeps
    :func:`tuned_config`'s answers from it (a table loaded again starts with none)."""

    def __init__(self):
        super().__init__()
        self.lookups: dict[tuple, MoEConfig | None] = {}


@functools.lru_cache(maxsize=8)
def _load_tuned(path: str) -> _Table:
    table = _Table()
    if not os.path.exists(path):
        return table
    with open(path) as f:
        data = json.load(f)
    for key, buckets in data.get("configs", {}).items():
        # null: tuned, and the heuristic was not beaten by the tuner's margin (or the bucket was
        # not measured): calls in this bucket take choose_config, not a smaller bucket's entry.
        rows = []
        for t, c in buckets.items():
            try:
                rows.append((int(t), None if c is None else MoEConfig.from_list(c)))
            except (TypeError, ValueError) as e:  # a hand-edited entry: the heuristic there, not a failing call
                warnings.warn(f"ignoring malformed tuned MoE entry {key!r}[{t!r}] = {c!r} in {path}: {e}",
                              stacklevel=2)
        table[key] = sorted(rows, key=lambda tc: tc[0])
    return table


@functools.lru_cache(maxsize=16)
def _table_of(index: int) -> str | None:
    """GPU ``index``'s tuned table, ``configs/<gpu slug>.json`` (``evenflow._runtime.gpu_slug``: ``h200``,
    ``h100-80gb``, as benchmarks/tune_moe.py writes it), or None where none is committed for that GPU."""
    path = tuned_table_path(CONFIG_DIR, torch.cuda.get_device_name(index))
    return str(path) if path else None


def _gpu_table(device) -> str | None:
    if not (isinstance(device, torch.device) and device.type == "cuda"):
        return None
    return _table_of(device.index if device.index is not None else torch.cuda.current_device())


def tuned_config(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, mode: int, *,
                 num_experts_total: int, device, path: str | None = None, accum: str = "exact") -> MoEConfig | None:
    """The tuned config for this shape at the largest tuned batch bucket <= num_tokens, or None
    (no file for this GPU, shape not tuned, num_tokens below every bucket, or that bucket's entry
    is null: the heuristic was measured and not beaten). An entry that no longer passes
    ``check_config`` is ignored with a warning (the heuristic takes over). ``accum`` (an ``fp8_accum``
    value) looks up that mode's keys only (an fp8-MMA mode never reads the default mode's entries)."""
    if path is None:
        path = _gpu_table(device)
        if path is None:
            return None
    table = _load_tuned(path)
    # each answer kept with the table it read: the key's string, the bucket search and check_config ran on every
    # eager call (round CM; docs/perf-notes/moe.md)
    memo = table.lookups
    at = (num_tokens, top_k, num_local, hidden, inter, mode, num_experts_total, accum)
    if at not in memo:
        if len(memo) >= 4096:  # (prefill batches of every length: bounded)
            memo.clear()
        memo[at] = _tuned_lookup(table, path, *at)
    return memo[at]


def _tuned_lookup(table: _Table, path: str, num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int,
                  mode: int, num_experts_total: int, accum: str) -> MoEConfig | None:
    rows = table.get(tuned_key(num_local, num_experts_total, top_k, hidden, inter, mode, accum))
    if not rows:
        return None
    best = None
    for t, cfg in rows:
        if t <= num_tokens:
            best = cfg
    if best is None:
        return None
    try:
        check_config(best, hidden, inter, mode, fast_acc=accum != "exact")
    except (TypeError, ValueError) as e:
        warnings.warn(f"ignoring tuned MoE config from {path}: {e}", stacklevel=4)
        return None
    return best


def check_config(cfg: MoEConfig, hidden: int, inter: int, mode: int, fast_acc: bool = False) -> None:
    """A forced config must tile the shapes exactly (the kernels have no K/N masks); with
    ``fast_acc`` (fp8 dots) its K-steps must be >= 32 deep."""
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(cfg).__name__}")
    for name in ("block_m", "gu_block_n", "gu_block_k", "down_block_n", "down_block_k", "gu_split_k",
                 "down_split_k"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")
    if cfg.block_m > MAX_BLOCK_M:  # the task map's tiles (build_moe_index) are at most this many rows
        raise ValueError(f"config.block_m must be <= {MAX_BLOCK_M}, got {cfg.block_m}")
    if cfg.block_m < 16 or cfg.gu_block_n < MIN_GU_BLOCK_N or cfg.gu_block_k < 16 or cfg.down_block_n < 16 \
            or cfg.down_block_k < 16:
        raise ValueError(f"config tiles must be >= 16 (tl.dot), got {cfg}")
    if inter % cfg.gu_block_n or hidden % (cfg.gu_block_k * cfg.gu_split_k):
        raise ValueError(f"config gate-up tiles do not divide I={inter}, H={hidden}: {cfg}")
    if hidden % cfg.down_block_n or inter % (cfg.down_block_k * cfg.down_split_k):
        raise ValueError(f"config down tiles do not divide H={hidden}, I={inter}: {cfg}")
    if mode == 2 and (cfg.gu_block_n > 128 or cfg.gu_block_k != 128 or cfg.down_block_k != 128):
        raise ValueError(f"fp8 block mode needs gate-up BLOCK_K and down BLOCK_K of 128 and a gate-up BLOCK_N of "
                         f"at most 128, got {cfg}")
    if mode == 2 and cfg.down_block_n > 128:
        # the down GEMM applies one 128x128 weight block's scale to a whole N block (kernels.py, _down_tile)
        raise ValueError(f"fp8 block mode needs config.down_block_n of at most 128 (one weight-scale block), got "
                         f"{cfg.down_block_n}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config.num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"config.num_stages must be >= 1, got {cfg.num_stages}")
    if cfg.gu_defer not in (0, 1):
        raise ValueError(f"config.gu_defer must be 0 or 1, got {cfg.gu_defer}")
    if cfg.index_tiles not in (0, 1):
        raise ValueError(f"config.index_tiles must be 0 or 1, got {cfg.index_tiles}")
    if cfg.prefetch not in (0, 1, 2, 3):
        raise ValueError(f"config.prefetch must be 0-3 (bit 1 the gate-up, bit 2 the down GEMM), got {cfg.prefetch}")
    if cfg.down_n_group < 1 or cfg.down_n_group & (cfg.down_n_group - 1) \
            or (hidden // cfg.down_block_n) % cfg.down_n_group:
        raise ValueError(f"config.down_n_group must be a power of two dividing H / down_block_n = "
                         f"{hidden // cfg.down_block_n}, got {cfg.down_n_group}")
    if not 0 <= cfg.persistent <= MAX_PERSISTENT:
        raise ValueError(f"config.persistent (programs per SM, 0 = one per task) must lie in [0, {MAX_PERSISTENT}], "
                         f"got {cfg.persistent}")
    if fast_acc and min(cfg.gu_block_k, cfg.down_block_k) < FAST_ACC_MIN_BLOCK_K:
        raise ValueError(f"fp8_accum='fast' / 'promoted' run fp8 dots, whose K-steps must be >= {FAST_ACC_MIN_BLOCK_K} "
                         f"deep; config has gu_block_k={cfg.gu_block_k}, down_block_k={cfg.down_block_k}")


def _launch(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, mode,
            ep_rank, num_experts_total, shared_output, routed_scaling, out, cfg: MoEConfig | None = None,
            pdl: int = -1, pair_tiles: int = -1, accum: str = "exact", defer_split: int = -1,
            persistent: int = -1, counters: torch.Tensor | None = None, local_first: int = -1):
    # pdl: 1 on, 0 off, -1 automatic (on where supported, up to PDL_MAX_PAIRS pairs)
    # pair_tiles: 1 on, 0 off, -1 automatic (up to PAIR_TILE_MAX_PAIRS pairs on 16-row tiles, unless the config says
    # index tiles: cfg.index_tiles)
    # accum: fp8_accum (FP8 weights for the fp8-MMA modes; checked by fused_moe): kernels.FAST_ACC, table keys
    # defer_split: a K-split gate-up on pair tiles leaves its partials to the down GEMM: 1 yes, 0 no,
    # -1 as the config says (cfg.gu_defer)
    # persistent: programs per SM of the GEMMs that run index tiles without a K split (0: one per task),
    # -1 as the config says (cfg.persistent)
    # counters: the weights' arrival counters (MoEWeights.counters: zero between calls, each put back by its
    # last arriver), or None: pair tiles zero a fresh buffer with moe_zero_kernel
    # local_first: pair tiles under expert parallelism (up to LOCAL_FIRST_MAX_PAIRS pairs) start the programs of
    # this rank's pairs first (moe.kernels._grid_task): 1 yes, 0 no (each pair's programs in place), -1 automatic (1)
    if defer_split not in (-1, 0, 1):
        raise ValueError(f"defer_split must be -1 (the config's choice), 0 or 1, got {defer_split!r}")
    if local_first not in (-1, 0, 1):
        raise ValueError(f"local_first must be -1 (automatic), 0 or 1, got {local_first!r}")
    t, h = x.shape
    k = topk_ids.shape[1]
    e_local, two_i, _ = w13.shape
    i = two_i // 2
    if t == 0:
        return
    dev = x.device
    fast_acc = accum != "exact"  # fp8 MMAs: choose_config's rules for them
    if cfg is None:
        cfg = tuned_config(t, k, e_local, h, i, mode, num_experts_total=num_experts_total, device=dev, accum=accum)
    if cfg is None:
        cfg = choose_config(t, k, e_local, h, i, mode, num_experts_total=num_experts_total, sms=num_sms(dev),
                            fast_acc=fast_acc)
    p = t * k
    by_pair = bool(pair_tiles) if pair_tiles >= 0 else (p <= PAIR_TILE_MAX_PAIRS and cfg.block_m == 16
                                                         and not cfg.index_tiles)
    n_tiles = p if by_pair else max_tiles(p, e_local, cfg.block_m)
    gu_nb = i // cfg.gu_block_n
    # Deferred reduction (pair tiles, K-split gate-up): the down GEMM adds the gate-up's partials
    # as it loads its operand, so the gate-up has no arrival counter, no last-split round trips
    # (partial stores, fence, atomic, partial loads) and no inter store; block mode needs the
    # down's 128-deep K steps to be whole activation groups.
    # Its cost: every down N-block program re-reads and re-activates the pair's partials in its K
    # loop (round P1: slower wherever the down GEMM has many K steps; docs/perf-notes/moe.md).
    defer = (cfg.gu_defer if defer_split < 0 else defer_split) == 1 and by_pair and cfg.gu_split_k > 1
    # Block mode on gate-up N blocks narrower than an activation group (128): the group's last program
    # requantises it from the fp32 activations its programs left in a buffer (one counter per tile and group)
    group_split = mode == 2 and cfg.gu_block_n < 128 and not defer
    n_split_counts = n_tiles * gu_nb if cfg.gu_split_k > 1 and not defer else 0
    n_group_counts = n_tiles * (i // 128) if group_split else 0
    gu_count = gu_part = None
    n_counts = n_split_counts + n_group_counts
    # Pair tiles count in the weights' own counters where they hold enough (no zeroing kernel: round X); else
    # one workspace, zeroed by one kernel (or, on index tiles, by the index build): the split counters, then
    # the group counters
    kept_counts = by_pair and n_counts > 0 and counters is not None and counters.numel() >= n_counts
    if kept_counts:
        gu_count = counters[:n_counts]
    elif n_counts:
        gu_count = torch.empty(n_counts, dtype=torch.int32, device=dev)
    if cfg.gu_split_k > 1:
        part_rows = p if by_pair else n_tiles * cfg.block_m  # pair tiles: one row per pair
        gu_part = torch.empty(cfg.gu_split_k, part_rows, 2 * i, dtype=torch.float32, device=dev)
    h_buf = torch.empty(p, i, dtype=torch.float32, device=dev) if group_split else None
    use_pdl = bool(pdl) if pdl >= 0 else (pdl_supported(dev) and p <= PDL_MAX_PAIRS)
    pk = pdl_kwargs(use_pdl)
    # The activation quantisation's outputs are allocated before any kernel of the layer is launched: with
    # PDL its kernel runs beside the index (or zeroing) kernel ahead of it (``overlap``), so its buffers must
    # not be memory that kernel still uses (the multi-program index build frees a histogram after launching)
    zero_kernel = by_pair and gu_count is not None and not kept_counts
    overlap = QUANT_OVERLAP and use_pdl and (zero_kernel or not by_pair)  # a kernel of ours runs first
    # PAIR_PREFETCH: elements a 128-byte weight line, 0 off (the gate-up only behind a kernel of ours that waited);
    # use_pdl holds only where compiled kernels run on sm_90+ (fused_moe and the op refuse pdl=True elsewhere)
    pf_line = 128 // w13.element_size() if use_pdl and by_pair else 0
    pf_bits = cfg.prefetch if PAIR_PREFETCH is None else ("gate_up" in PAIR_PREFETCH) | 2 * ("down" in PAIR_PREFETCH)
    pf_gu = pf_line if pf_bits & 1 and (mode != 0 or zero_kernel) else 0
    pf_down = pf_line if pf_bits & 2 else 0
    dummy = topk_weights  # stands in for pointers a mode does not read
    if mode == 2:
        xq, xs = group_quant_buffers(x)
    elif mode == 1:
        xq, xs = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=dev), dummy
    else:
        xq, xs = x, dummy
    if by_pair:
        idx = None
        if zero_kernel:
            moe_zero_kernel[(min(8, cdiv(gu_count.numel(), 1024)),)](gu_count, gu_count.numel(), num_warps=4,
                                                                             **pk)
    else:
        idx = build_moe_index(topk_ids, e_local, ep_rank, cfg.block_m, zero=gu_count, pdl=use_pdl)
    dot_f32, fp8_round = dot_needs_fp32(), fp8_cast_needs_rounding()
    # Passed under the interpreter too (it ignores them), so the sm_90 compile check records them.
    gpu_kw = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    if mode == 2:
        launch_group_quant(x, xq, xs, use_pdl, overlap=overlap)
    elif mode == 1:
        block_q = min(1024, next_power_of_2(h))
        moe_tensor_quant_kernel[(t, cdiv(h, block_q))](
            x, xq, a13_scale, h, x.stride(0), xq.stride(0), BLOCK_H=block_q, FP8_ROUND=fp8_round, OVERLAP=overlap,
            num_warps=4, **pk)
    # the intermediate (and block mode's group scales), unless the down GEMM builds its operand itself
    inter = inter_s = dummy
    if not defer:
        inter = torch.empty(p, i, dtype=torch.bfloat16 if mode == 0 else torch.float8_e4m3fn, device=dev)
        if mode == 2:
            inter_s = torch.empty(p, i // 128, dtype=torch.float32, device=dev)
    ws13 = w13_scale if w13_scale is not None else dummy
    ws2 = w2_scale if w2_scale is not None else dummy
    as13 = a13_scale if a13_scale is not None else dummy
    as2 = a2_scale if a2_scale is not None else dummy
    # the index tensors (pair tiles: topk_ids stands in, the kernels do not read them)
    ix = (topk_ids,) * 4 if idx is None else (idx.sorted_pairs, idx.offsets, idx.tile_expert, idx.tile_row)
    ws13_strides = (ws13.stride(0), ws13.stride(1)) if mode == 2 else (0, 0)
    ws2_strides = (ws2.stride(0), ws2.stride(1)) if mode == 2 else (0, 0)

    per_sm = cfg.persistent if persistent < 0 else persistent
    sms = num_sms(dev) if per_sm > 0 else 0
    # the rank's own pairs' programs first (round Y): pair tiles, only where some pairs may be another rank's
    packed = local_first != 0 and by_pair and num_experts_total > e_local and p <= LOCAL_FIRST_MAX_PAIRS
    max_pairs = max(16, next_power_of_2(p)) if packed else 1

    def gemm_launch(split_k: int, nb: int, gemm: str) -> tuple[tuple[int, ...], bool, int]:
        """(grid, PERSIST, E_PAD) of one GEMM: persistent (index tiles, no K split, a GEMM of ``PERSIST_GEMMS``)
        as per_sm programs per SM, at most one per task of the upper-bound map, each reading the used tile count
        from the index and looping over the used tasks; else one program per (tile, n-block, K split) task, on a
        flat grid when the rank's own pairs are packed first (``packed``)."""
        if per_sm > 0 and not by_pair and split_k == 1 and gemm in PERSIST_GEMMS:
            return (min(n_tiles * nb, per_sm * sms),), True, next_power_of_2(e_local)
        return ((n_tiles * nb * split_k,) if packed else (n_tiles, nb, split_k)), False, 1

    down_nb = h // (cfg.down_block_n * cfg.down_n_group)  # tasks along N: groups of down_n_group n-blocks
    gu_grid, gu_persist, gu_e_pad = gemm_launch(cfg.gu_split_k, gu_nb, "gate_up")
    acc_kind = _ACC_KIND[accum]
    moe_gate_up_kernel[gu_grid](
        xq, xs, w13, ws13, topk_ids, *ix,
        inter, inter_s, as13, as2,
        gu_part if gu_part is not None else dummy, gu_count if gu_count is not None else dummy,
        h_buf if group_split else dummy, gu_count[n_split_counts:] if group_split else dummy,
        k, i, h, ep_rank * e_local, e_local, gu_nb,
        xq.stride(0), xs.stride(0) if mode == 2 else 0, w13.stride(0), w13.stride(1), *ws13_strides,
        inter.stride(0), inter_s.stride(0) if mode == 2 else 0,
        MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.gu_block_n, BLOCK_K=cfg.gu_block_k,
        SPLIT_K=cfg.gu_split_k, DOT_F32=dot_f32, FP8_ROUND=fp8_round, PAIR_TILES=by_pair, FAST_ACC=acc_kind,
        DEFER=defer, PERSIST=gu_persist, E_PAD=gu_e_pad, LOCAL_FIRST=packed, MAX_PAIRS=max_pairs,
        ONE_DOT=_gate_up_one_dot(cfg, mode, acc_kind, by_pair), PREFETCH=pf_gu,
        PREFETCH_STEPS=PAIR_PREFETCH_STEPS if pf_gu else 0, **gpu_kw, **pk,
    )
    # The per-pair products (times their top-k weight) are stored in bf16 unless the down GEMM is
    # K-split (its partial sums stay fp32): at T=4096 an fp32 buffer is 268 MB (Qwen3) / 537 MB
    # (Hy3 TP8) written and read again. bf16 weights since round 4; fp8 modes since round K: one
    # bf16 rounding of each pair, measured to about double the fp8-tensor rows' error against the
    # oracle (which quantises as the kernels do), still within the rule of the fp32-pair baseline
    # the tests keep (docs/perf-notes/moe.md, "cost in accuracy").
    pair_dtype = torch.bfloat16 if cfg.down_split_k == 1 else torch.float32
    pair_out = torch.empty(cfg.down_split_k, p, h, dtype=pair_dtype, device=dev)
    down_grid, down_persist, down_e_pad = gemm_launch(cfg.down_split_k, down_nb, "down")
    moe_down_kernel[down_grid](
        inter, inter_s, w2, ws2, topk_ids, *ix, topk_weights,
        pair_out, as2, gu_part if defer else dummy, ws13, as13,
        k, i, ep_rank * e_local, e_local, down_nb,
        inter.stride(0), inter_s.stride(0) if mode == 2 else 0, w2.stride(0), w2.stride(1), *ws2_strides,
        pair_out.stride(0), pair_out.stride(1), gu_part.stride(0) if defer else 0,
        MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        SPLIT_K=cfg.down_split_k, DOT_F32=dot_f32, PAIR_TILES=by_pair, FAST_ACC=acc_kind,
        GU_SPLIT=cfg.gu_split_k if defer else 0, FP8_ROUND=fp8_round, PERSIST=down_persist,
        E_PAD=down_e_pad, LOCAL_FIRST=packed, MAX_PAIRS=max_pairs, N_GROUP=cfg.down_n_group,
        N_FASTEST=down_persist and PERSIST_DOWN_N_FASTEST, PREFETCH=pf_down,
        PREFETCH_STEPS=PAIR_PREFETCH_STEPS if pf_down else 0, **gpu_kw, **pk,
    )
    # reduce: all of a token's (slot, split) rows in flight at once; <= 8192 values per program
    # while top_k * down_split_k <= 256 (top-k <= 16, split <= 16), more past that (BLOCK_H >= 32)
    block_k = next_power_of_2(k)
    block_h = min(1024, next_power_of_2(h), max(32, 8192 // (block_k * cfg.down_split_k)))
    shared = shared_output if shared_output is not None else out
    moe_reduce_kernel[(t, cdiv(h, block_h))](
        pair_out, topk_ids, shared, out, k, h, ep_rank * e_local, e_local, float(routed_scaling),
        pair_out.stride(0), pair_out.stride(1), shared.stride(0), out.stride(0),
        HAS_SHARED=shared_output is not None, BLOCK_H=block_h, BLOCK_K=block_k, SPLIT_K=cfg.down_split_k,
        FENCED=REDUCE_FENCED, num_warps=4, **pk,
    )


def _check_layer(x, topk_ids, topk_weights, w13, inter, mode, ep_rank, num_experts_total, routed_scaling,
                 fp8_accum, shared_output, counters, counters_name):
    """The checks of a layer's call that :func:`fused_moe` and a direct call of its op share: (T, H, the total of
    experts, whether fp8 MMAs run, the device)."""
    e_local, h = w13.shape[0], w13.shape[2]
    check_tensor("x", x, dtypes=[torch.bfloat16], ndim=2, last_dim_contiguous=True)
    if x.shape[1] != h:
        raise ValueError(f"x has hidden size {x.shape[1]} but the weights have {h}")
    t = x.shape[0]
    check_tensor("topk_ids", topk_ids, dtypes=[torch.int32, torch.int64], ndim=2, contiguous=True)
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must have {t} rows (one per token of x), got {topk_ids.shape[0]}")
    check_int("top_k (topk_ids.shape[1])", k, 1, MAX_TOP_K)
    check_tensor("topk_weights", topk_weights, dtypes=[torch.float32], shape=[t, k], contiguous=True)
    check_int("ep_rank", ep_rank, 0)
    if num_experts_total is None:
        if ep_rank != 0:
            raise ValueError("num_experts_total is required when ep_rank > 0")
        num_experts_total = e_local
    check_int("num_experts_total", num_experts_total, 1, MAX_EXPERTS)
    if (ep_rank + 1) * e_local > num_experts_total:
        raise ValueError(f"ep_rank {ep_rank} with {e_local} local experts needs num_experts_total >= "
                         f"{(ep_rank + 1) * e_local}, got {num_experts_total}")
    if num_experts_total % e_local:
        raise ValueError(f"num_experts_total ({num_experts_total}) must be a multiple of the {e_local} local experts "
                         "(every rank holds the same number: rank r keeps experts [r * E_local, (r + 1) * E_local))")
    check_scaling("routed_scaling", routed_scaling, fp32=True)
    if not isinstance(fp8_accum, str) or fp8_accum not in FP8_ACCUM:
        raise ValueError(f"fp8_accum must be one of {FP8_ACCUM}, got {fp8_accum!r}")
    fast_acc = fp8_accum != "exact"
    if fast_acc and mode == 0:
        raise ValueError(f"fp8_accum={fp8_accum!r} applies to FP8 weights only; these are bf16 (use the default "
                         "'exact')")
    if fast_acc and (h % FAST_ACC_MIN_BLOCK_K or inter % FAST_ACC_MIN_BLOCK_K):
        raise ValueError(f"fp8_accum={fp8_accum!r} needs hidden ({h}) and intermediate ({inter}) sizes "
                         f"that are multiples of {FAST_ACC_MIN_BLOCK_K} (fp8 dots take K-steps >= "
                         f"{FAST_ACC_MIN_BLOCK_K}); use fp8_accum='exact'")
    if shared_output is not None:
        check_tensor("shared_output", shared_output, dtypes=[torch.bfloat16, torch.float32], shape=[t, h],
                     last_dim_contiguous=True)
    dev = check_same_device(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13,
                            shared_output=shared_output)
    if counters is not None:
        check_tensor(counters_name, counters, dtypes=[torch.int32], ndim=1, contiguous=True, device=dev)
    return t, h, num_experts_total, fast_acc, dev


def _check_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): the weights and scales as the :class:`MoEWeights` builders check
    them (for ``weight_mode``), then what :func:`fused_moe` checks of a call."""
    mode = check_int("weight_mode", a["weight_mode"], 0, 2)
    fmt = next(f for f, m in MODE.items() if m == mode)
    (_, h, i), _ = MoEWeights.check_format(fmt, a["w13"], a["w2"], a["w13_scale"], a["w2_scale"], a["a13_scale"],
                                           a["a2_scale"])  # (contiguity and one device too)
    dev = a["w13"].device
    t, _, _, fast_acc, _ = _check_layer(
        a["x"], a["topk_ids"], a["topk_weights"], a["w13"], i, mode, a["ep_rank"], a["num_experts_total"],
        a["routed_scaling"], a["fp8_accum"], a["shared_output"], a["counters"], "counters")
    check_out("out", a["out"], (t, h), torch.bfloat16, dev)
    if a["config"] is not None:
        required = sum(f.default is MISSING for f in fields(MoEConfig))  # the rest have defaults (older rows)
        if not required <= len(a["config"]) <= len(fields(MoEConfig)):
            raise ValueError(f"config must list {required}-{len(fields(MoEConfig))} of MoEConfig's fields in order, "
                             f"got {len(a['config'])} values")
        check_config(MoEConfig.from_list(a["config"]), h, i, mode, fast_acc=fast_acc)
    for name in ("pdl", "pair_tiles", "defer_split", "local_first"):
        check_int(name, a[name], -1, 1)
    if a["persistent"] != -1:
        check_int("persistent", a["persistent"], 0, MAX_PERSISTENT)
    if a["pdl"] == 1:
        check_pdl(True, dev)


def _fused_moe_op_launch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
    a13_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
    weight_mode: int, ep_rank: int, num_experts_total: int, shared_output: torch.Tensor | None,
    routed_scaling: float, out: torch.Tensor, counters: torch.Tensor | None, config: list[int] | None = None,
    pdl: int = -1, pair_tiles: int = -1, fp8_accum: str = "exact", defer_split: int = -1, persistent: int = -1,
    local_first: int = -1,
) -> None:
    # counters (MoEWeights.counters): written, each back to 0 by its last arriver, so declared mutated; passed
    # always (no default: some torch versions index a mutated argument the caller left to its default)
    _launch(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, weight_mode,
            ep_rank, num_experts_total, shared_output, routed_scaling, out,
            None if config is None else MoEConfig.from_list(config), pdl, pair_tiles, fp8_accum,
            defer_split, persistent, counters, local_first)


_fused_moe_op = torch.library.custom_op("evenflow::fused_moe_", mutates_args=("out", "counters"))(
    checked_op(_fused_moe_op_launch, _check_op))


@_fused_moe_op.register_fake
def _(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, weight_mode,
      ep_rank, num_experts_total, shared_output, routed_scaling, out, counters, config=None, pdl=-1, pair_tiles=-1,
      fp8_accum="exact", defer_split=-1, persistent=-1, local_first=-1):
    return None


def fused_moe(x, topk_ids, topk_weights, ew, ep_rank=0, num_experts_total=None, shared_output=None,
              routed_scaling=1.0, out=None, *, check_ids=True, config: MoEConfig | None = None,
              pdl: bool | None = None, pair_tiles: bool | None = None, fp8_accum: str = "exact",
              defer_split: bool | None = None, persistent: int | None = None, local_first: bool | None = None):
    """Fused MoE layer of this rank: ``routed_scaling * sum_k w * expert(x) + shared_output``.

    x [T, H] bf16; topk_ids [T, k] int32 (int64 accepted) global expert ids in
    [0, num_experts_total); topk_weights [T, k] fp32; ``ew`` an :class:`MoEWeights`
    holding this rank's E_local experts, which are global ids
    [ep_rank*E_local, (ep_rank+1)*E_local); pairs routed to other ranks contribute
    nothing (the caller all-reduces across EP/TP ranks). Returns y [T, H] bf16. Calls on one
    ``ew`` must run one at a time (it keeps the decode path's arrival counters; see
    :class:`MoEWeights` and its ``sharing_weights`` for two streams at once).

    ``check_ids`` verifies the id range on the host when that is allowed (eager
    mode: one sync); under CUDA-graph capture or torch.compile (or ``check_ids=False``) it is skipped and
    out-of-range ids are dropped by the kernels, never read or written out of bounds: a pair an engine marks
    dropped with id -1 adds nothing, as if its weight were 0.
    ``config`` forces the tile sizes (tuning sweeps, tests); by default
    :func:`choose_config` picks them from the shapes. ``pdl``: chain the kernels with
    programmatic dependent launch; default (None): on sm_90+ up to ``PDL_MAX_PAIRS``
    token-expert pairs, ``False`` to compare; ``True`` is refused where it cannot run.
    ``pair_tiles``: each (token, slot) pair a GEMM task of its own, with no index build;
    default (None): up to ``PAIR_TILE_MAX_PAIRS`` (32) pairs on 16-row tiles, unless the tuned config keeps index
    tiles there (``MoEConfig.index_tiles``); ``True`` / ``False`` force it (same results: one row per tile instead
    of an expert's rows together).
    ``fp8_accum`` (FP8 weights only): ``"exact"`` (default) computes every fp8 product exactly
    (f16 MMAs of the e4m3 values) and accumulates in fp32, within the tolerance rule of an
    fp32-accumulation baseline. ``"fast"`` (opt-in) runs fp8 tensor-core MMAs with the
    hardware's reduced-precision accumulation, the numerics of SGLang's Triton fused MoE and
    ``torch._scaled_mm(use_fast_accum=True)``: per-tensor weights accumulate the whole K loop
    that way, block-128 weights promote to fp32 once per 128-deep block (DeepSeek-V3). It
    matters at large batches (MMA-bound: on sm_90, 64/128-row tiles at twice the f16 rate);
    tiles of 16/32 rows (decode) compute as ``"exact"`` does. Its results are not the default's
    bit for bit (requantisation of the intermediate can round differently). ``"promoted"`` (opt-in)
    runs the same fp8 MMAs but adds each K step's sum (at most 128 products, summed by the tensor
    core) to an fp32 accumulator in per-tensor mode too (block-128 weights: as ``"fast"``): the
    precision class of DeepSeek-V3's recipe, tested against a baseline that sums 128-deep
    fast-accumulation products in fp32. Both fp8-MMA modes need K-steps of at least 32: with
    per-tensor weights, hidden and intermediate sizes that are multiples of 32.
    ValueError for another value, for bf16 weights, or such sizes.
    ``defer_split``: where pair tiles split the gate-up GEMM along K (decode batches), who adds
    its partial sums and applies the activation: ``True``, the down GEMM as it loads its
    operand (no arrival counter, no last-split round trips, no intermediate buffer, but every
    down N-block program redoes it); ``False``, the gate-up's last split, counting arrivals in
    ``ew.counters`` (see :class:`MoEWeights`; with none kept, a fresh buffer zeroed by one more kernel);
    ``None`` (default), the config's ``gu_defer`` (the tuned table's choice per shape and
    batch; the heuristic's is ``False``). Same results bit for bit either way.
    ``persistent``: programs per SM of the gate-up and down GEMMs wherever they run index tiles
    without a K split (larger batches): that many programs per SM are launched and take the used
    (tile, n-block) tasks in turn, in one flattened loop over tasks and K steps; ``0``: one program per
    task of the upper-bound task map, the unused ones exiting at once; ``None`` (default): the config's
    ``persistent``. Same results bit for bit either way. A count above what fits on an SM at once
    (shared memory, registers) is not refused: the programs that do not fit wait for a slot and run
    their tasks after the others, which is slower, never wrong. On the H200 it was faster than the
    default by more than 1% at only 3 of 96 benchmark points and slower at 83, with or without the
    loop's flattening (docs/perf-notes/moe.md, rounds T3, T6). The module switch ``PERSIST_GEMMS``
    (``("down",)``) applies the count to the down GEMM alone, and ``PERSIST_DOWN_N_FASTEST`` walks its
    tasks a tile's n-blocks first: slower still but at one benchmark point (round AU2).
    ``local_first``: on pair tiles under expert parallelism (``num_experts_total`` above the holder's experts;
    up to ``LOCAL_FIRST_MAX_PAIRS`` pairs), the GEMMs' grids start the programs of the pairs routed to this
    rank first and the grid's surplus programs (as many as other ranks' pairs have tasks) exit at once at its end;
    ``True`` and the default (None) do, ``False`` keeps each pair's programs in place (before round Y). No effect
    elsewhere. Same results bit for bit either way (docs/perf-notes/moe.md, round Y).
    """
    if not isinstance(ew, MoEWeights):
        raise TypeError(f"ew must be an evenflow.MoEWeights, got {type(ew).__name__}")
    if not torch.compiler.is_compiling():
        ew.recheck_scales()
    counters = ew.counters  # the holder's own buffer; checked since the kernels write it
    t, h, num_experts_total, fast_acc, dev = _check_layer(
        x, topk_ids, topk_weights, ew.w13, ew.intermediate_size, ew.mode, ep_rank, num_experts_total, routed_scaling,
        fp8_accum, shared_output, counters, "ew.counters")
    check_bool("check_ids", check_ids)
    if out is None:
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    else:
        check_out("out", out, (t, h), torch.bfloat16, dev)
    if check_ids and t > 0 and host_sync_allowed(topk_ids):
        # one reduction and one copy to the host (a compare, an or and an any-reduce before)
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()
        if lo < 0 or hi >= num_experts_total:
            bad = (topk_ids < 0) | (topk_ids >= num_experts_total)
            raise ValueError(f"topk_ids must lie in [0, num_experts_total={num_experts_total}); "
                             f"found {topk_ids[bad][:4].tolist()}")
    if config is not None:
        check_config(config, h, ew.intermediate_size, ew.mode, fast_acc=fast_acc)
    check_pdl(pdl, dev)
    check_bool("pair_tiles", pair_tiles, allow_none=True)
    check_bool("defer_split", defer_split, allow_none=True)
    if persistent is not None:
        check_int("persistent", persistent, 0, MAX_PERSISTENT)
    check_bool("local_first", local_first, allow_none=True)
    pdl_arg = -1 if pdl is None else int(pdl)
    defer_arg = -1 if defer_split is None else int(defer_split)
    pt_arg = -1 if pair_tiles is None else int(pair_tiles)
    persist_arg = -1 if persistent is None else persistent
    local_arg = -1 if local_first is None else int(local_first)
    args = (x, topk_ids, topk_weights, ew.w13, ew.w2, ew.w13_scale, ew.w2_scale, ew.a13_scale, ew.a2_scale,
            ew.mode, ep_rank, num_experts_total, shared_output, float(routed_scaling), out)
    if torch.compiler.is_compiling():
        _fused_moe_op(*args, counters, None if config is None else config.as_list(), pdl_arg, pt_arg, fp8_accum,
                      defer_arg, persist_arg, local_arg)
    else:  # eager: launch directly, torch.library's dispatch costs tens of us per call on the host
        _launch(*args, config, pdl_arg, pt_arg, fp8_accum, defer_arg, persist_arg, counters, local_arg)
    return out
