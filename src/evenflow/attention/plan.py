"""Decode schedules: the length-balanced plan (``DecodePlan``) and the static split-KV one.

The plan's data contract (tensors, bins, partial slots) is documented at the top of
``evenflow.attention.kernels``. In short: items (request b, kv head h) are ordered
request-outer, so a request's kv heads sit in neighbouring bins and read the same pages
(one NHD page row holds every head) at the same time; each item is cut into 64-token
tiles; program p drains the global tile range [p * budget, (p + 1) * budget) with
budget = max(ceil(total / num_programs), min_tiles).
"""
from __future__ import annotations

import math
import weakref

import torch

from evenflow import _runtime
from evenflow._checks import check_bool, check_int, check_pdl, check_sixteenths, check_tensor, checked_op
from evenflow.attention import kernels as K

TILE = 64
MAX_SEQ_LEN = 2 ** 31 - TILE  # a request's tile count, (len + TILE - 1) // TILE, is int32 in the plan's kernel
MAX_BATCH = 2048
DEFAULT_MIN_TILES = 8  # 512 tokens: HPC-Ops' minimum work per program
# Persistent programs per SM. Measured on H200 (round E: the E1 sweep and the E2 benchmark's
# evenflow-pps2 rows, docs/perf-notes/decode.md): with double-buffered K/V (3 stages) 2
# programs/SM beat 3 on all 11 bf16 cases (by 0.01-0.16 of the floor) and on 6 of 11 fp8
# cases; fewer, longer bins also mean fewer chunks to combine (the TP8 slice).
DEFAULT_PROGRAMS_PER_SM = 2
MAX_ITEM_COST = 8  # tiles; the combine relies on an item's first real tile lying in its first 32 chunks
# Work units the bins count per short item (at most DEFAULT_ITEM_COST_MAX_TILES tiles, 256
# tokens) on top of its tiles: its fixed cost (q load, first-page chain, pipeline fill, store)
# is not hidden behind a filled pipeline. Measured in round J2 (H200, graph replay): the case
# 32x128+32x4K went 175 -> 154 us (bf16) and 156 -> 119 us (fp8) at 2 units per item; charged
# to every item, the same cost made the long-tail cases 3.5-5% (bf16) and 8-14% (fp8) slower, and
# 1x32K+63x512 up to 12% / 15% (their long items' cuts move; history/round-j2).
DEFAULT_ITEM_COST = 2
# align_items rounds the budget up to a multiple of the shortest item's units when that grows
# it by at most this factor. Round E (combine kernel) set 1.5: 64x512 took 56 us at budget 11 and
# 44 us at 16. Round O2 (fused combine, whose cuts cost less): 1.25, since rounding 2x32K+30x4K's
# budget of 90 up to 128 left 80 of 264 programs without a bin (H200 graph replay: fp8 163.6 ->
# 135.4 us; bf16 moved between ~183 and ~195 us from run to run at 184 bins and 184.5-186.9 at
# 262; no other benchmark case's plan changes; docs/perf-notes/decode.md, O2 and O6).
DEFAULT_ALIGN_GROWTH = 1.25
# align_longer raises the budget to the shortest item's tiles over n (the item cut in n equal
# chunks) when that grows it by at most this factor: 17/16 since round I1 (32x4K: 63 -> 64 tiles)
# and round AC (fp8 8x32K: 63 -> 64). Round AY's CPU plan model found Qwen3-30B-A3B's slice (4 KV
# heads) at 1x32K+31x2K just past it: budget 23 at 264 programs, every 32-tile 2K item cut; a
# larger bound is a measured choice (docs/perf-notes/decode.md, round AZ).
DEFAULT_ALIGN_LONGER_GROWTH = 1.0625
# Round AZ (AZ1 / AZ2, H200 graph replay, two passes): a plan for the Gluon fp8 kernel at 4 or more programs an SM
# takes a bound of 2. There (two warps a program, 4 an SM) fewer busy bins cost nothing a program's SM neighbours
# do not give back, and every slice whose budget the bound changes ran faster in both passes: fp8 2x32K+30x4K at 8
# KV heads (45 -> 64 tiles, 524 -> 368 busy bins) 1.030-1.035x with a bf16 q, 1.030-1.031x with an fp8 q;
# 1x32K+31x2K at 8 KV heads 1.043-1.052x; at 4 KV heads (tp2:) 1x32K+31x2K 1.069-1.070x, 2x32K+30x4K
# 1.009-1.010x; at 2 (tp4:) 2x64K+30x1K (bound 2 only) 1.026-1.030x. At 2 programs an SM the bound lost: the
# warpgroup form 0.92-0.99x (tp2: / tp4:), the two-warp form at one KV head 0.89-0.92x (tp8:2x64K+30x1K); the
# Triton kernel (2 an SM) gained 0.1-2.4%, below the 2% a default change asked (AZ1's rule), so it keeps 17/16.
GLUON_SHARED_ALIGN_LONGER_GROWTH = 2.0
DEFAULT_ITEM_COST_MAX_TILES = 4
# pack_short (round BB): items padded to a multiple of a quantum so the shortest sit whole in bins of a budget the
# alignment rules do not reach, taken where it is at most 15/16 of theirs (see DecodePlan). Round BB1 (H200, graph
# replay, A/B in one run, two passes, every variant of the four standard slices whose plan it changes): never slower,
# 0.7-5.3% faster: the warpgroup form at 2 an SM 1.027-1.030x (tp2:2x64K+30x1K) and 1.046-1.053x
# (tp4:32x128+32x4K), the Triton kernel 1.007-1.009x and 1.024-1.026x on the same two, the two-warp form at 4 an SM
# 1.007-1.019x (2x64K+30x1K at 8 KV heads, both q dtypes) and 1.016-1.025x (tp2:32x128+32x4K); the rows whose plan
# it leaves alone moved 0.980-1.014x (docs/perf-notes/decode.md, BB1).
DEFAULT_PACK_SHORT = True
_NO_COST_LIMIT = 2**30
# Where split items are merged: "fused" (the attention kernel's programs, the last chunk of a
# group to arrive merging it) or "kernel" (a second, combine kernel). Round N1 (H200, graph
# replay): the combine kernel cost 5-6 us per call after the attention kernel even with nothing
# to merge, 8-18 us with split items (docs/perf-notes/decode.md).
COMBINE_MODES = ("fused", "kernel")
DEFAULT_COMBINE = "fused"
# Programs per SM of a plan built for an fp8 KV cache (``DecodePlan(kv_dtype=torch.float8_e4m3fn)``),
# whose bins the Gluon kernel drains (``attention/gluon_kernels.py``). Round AB1 (H200,
# graph replay, static split of the probe): ~3.4-3.9 programs an SM ran 8x32K / 64x4K at 0.96-0.97
# of the copy floor, ~7 an SM at 0.71-0.82; on the plan (AB2, rows evenflow-g-pps3 / -g-pps6) 3 and 6
# an SM took up to 1.63x and 1.08-1.46x the time of 4 (docs/perf-notes/decode.md).
GLUON_FP8_PROGRAMS_PER_SM = 4
# ... and of a two-warp Gluon plan at one KV head (the TP8 slice of most GQA models), round AU. AU3's A/B on the TP8
# slices of the 10 standard cases (H200, fp8 KV, two passes): 1.18-1.35x at four where the minimum-work floor leaves
# the same busy bins at either count, 1.04-1.05x on the record's 1x128K+31x4K (its long item in half the chunks),
# 1.00-1.03x on 2x64K+30x1K, level on three, 0.95-0.96x on 2x32K+30x4K (its budget rounds from 8 to 12 tiles at 264
# programs); docs/perf-notes/decode.md. Round AV2's timelines: at 4 an SM the dispatcher puts up to 4 busy programs
# on one SM while others hold none, and a program's tile time grows with the busy programs beside it; 2 an SM caps
# that at 2. The four-warp plans (``gluon_warps=4``) take the same count since round AV4 (the warpgroup form at 2 an
# SM ran the fp8-q TP8 slices 1.02-1.24x faster than at 4, every slice in both passes); one warp keeps 4 (not
# measured).
GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM = 2
# An fp8 plan takes the Gluon kernel from this many KV heads (``DecodePlan(gluon=None)``), by warps a program.
# One warp: round AF5 (H200, graph replay, seven cases at 8 q / 1 kv heads, the TP8 slice of each standard case):
# at one KV head the Triton kernel at 2 programs an SM took 0.85-0.95 of the Gluon kernel's time on five and
# 1.02 / 1.04 on two (8x32K, 64x4K); geometric mean 0.92. At 8 KV heads the Gluon kernel is 1.12-1.32x faster
# (AF3). Two warps: round AL2 (the same seven slices, two passes), the Gluon kernel took 0.77-0.99 of the
# Triton kernel's time on all seven in both, so every fp8 plan takes it.
GLUON_FP8_MIN_KV_HEADS = {1: 2, 2: 1, 4: 1}
# Page sizes the Gluon fp8 kernel reads (a 64-token tile from one page); an fp8 plan at other page sizes is built
# for the Triton kernel, which runs those calls (round AO: sized for Gluon, the Triton kernel ran its 4 programs an
# SM under a 128-register cap, 500 bytes of spill a thread in the sm_90 build).
GLUON_FP8_PAGE_SIZES = (64, 128)
# The head dim and the q rows a KV head (GQA group x q_len: one 16-row MMA tile) the Gluon fp8 kernel takes; a plan
# told its calls' shape outside them (``head_dim``, ``num_q_heads``) is built for the Triton kernel (round AP).
GLUON_FP8_HEAD_DIM = 128
GLUON_FP8_MAX_ROWS = 16
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
HEAD_DIMS = (64, 128, 256)
MAX_GQA_GROUP = 16

# Ring slots (tiles in flight + 1) of the Gluon fp8 kernel by warps a program, 16 KB each, 4 programs an SM.
# Measured on the H200 (docs/perf-notes/decode.md): at one warp, the probe's best split per case, round AB1, 2 and 3
# slots within 4% of each other; on the plan (row evenflow-g-s3) 3 slots were never more than 2.2% faster and took
# up to 8% (AB2) / 12.5% (AB3, the fused merge) more time: 2 slots. At two warps (round AM1, A/B in one run, two
# passes) a second tile in flight on every chunk took 3.6-4.1% off 64x512 and cost 1-5% on the cases of long
# chunks; so since round AM their ring has 3 slots and only chunks of at most GLUON_FP8_DEEP_TILES tiles read 2
# tiles ahead, longer ones 1 on two of the slots (``DecodePlan(deep_ring_tiles=)``; AM2, 16: 64x512 0.95,
# 1x32K+63x512 0.97, 2x64K+30x1K 0.99 of the 2-slot kernel's time, the long cases 1.004-1.014). At one warp two
# tile loops would spill (sm_90: 255 registers, 8-12 bytes): one loop there, every chunk the whole ring ahead.
GLUON_FP8_STAGES = {1: 2, 2: 3, 4: 3}
GLUON_FP8_DEEP_TILES = 16

# Warps of a Gluon fp8 program, each taking its half of every 64-token tile with its own online softmax
# (``DecodePlan(gluon_warps=)``). Round AL1 (H200, graph replay, two passes against the one-warp kernel in one
# run, docs/perf-notes/decode.md): 2 warps took 0.83-0.87 of the time on 64x512 and 1x32K+63x512, 0.92-0.95 on
# the other mixes and 32x4K, 0.98-1.01 on the long uniform cases, and on the TP8 slice (1 KV head, forced) 0.87
# of the Triton kernel's. 4 warps would make 16 warps an SM at 4 programs, at most 128 registers a thread (65,536 /
# (16 x 32)); the 2-warp build takes 184-231 (sm_90, history/round-al1/sm90_stats.log).
GLUON_FP8_WARPS = 2
# Four warps (round AR) are by default the warpgroup form: the scores of an fp8 q on ``wgmma`` (e4m3 from shared
# memory, N = 8, no conversion of K), each warp's softmax over 16 tokens of a tile, its P V on ``mma.sync`` (sm_90: see
# tests/test_decode_sm90.py for its registers and instructions); it takes calls with an fp8 q and at most
# GLUON_FP8_WG_ROWS q rows a KV head; the plan's other calls (bf16 q, more rows) run the two-warp form on its bins.
# With ``DecodePlan(warpgroup_mma=False)`` (round AV) every call runs four warps on ``mma.sync`` instead: 211-214
# registers a thread in its sm_90 builds (history/round-av-cpu/mma4_builds.json.txt), so 2 programs an SM at every
# KV-head count, and its warps' outputs [4, 16, 128] fp32 (32 KB) meet in K's ring, which then holds at least
# GLUON_FP8_MMA4_SLOTS slots (unused ones padding a 3-slot ring).
GLUON_FP8_WARP_COUNTS = (1, 2, 4)
# The Triton decode kernel's launch options a plan may set (the decode op's direct calls also take 0: the launcher's
# choice): warps a program, tokens a loop step, and a register cap a thread (0: none)
TRITON_WARP_COUNTS = (2, 4, 8)
BLOCK_NS = (TILE, 2 * TILE)
MIN_REGISTER_CAP = 24


def check_register_cap(name: str, v, none_allowed: bool = False) -> int:
    """A register cap a thread: 0 (none) or MIN_REGISTER_CAP-255, an int (``none_allowed``: the message says None is
    taken too, where the caller takes it)."""
    if check_int(name, v, 0, 255) and v < MIN_REGISTER_CAP:
        top = f"{MIN_REGISTER_CAP}-255"
        choices = f"0 (no cap), {top} or None" if none_allowed else f"0 (no cap) or {top}"
        raise ValueError(f"{name} must be {choices}, got {v}")
    return v
# A plan built for the Gluon kernel at one KV head takes four warps by default (``gluon_warps=None``, round AW): its
# fp8-q calls of at most GLUON_FP8_WG_ROWS rows a KV head run the warpgroup form, its other calls the two-warp form
# on the same bins (2 programs an SM, 3 ring slots, 16-tile read-ahead and 12-chunk merge: the two-warp default's
# program exactly). Rounds AV4 / AV5 / AW1 (H200, graph replay, A/B in one run, two passes each, fp8 KV and fp8 q,
# the ten TP8 slices): the warpgroup form at 2 an SM 1.03-1.30x faster than two warps on all ten. Its scores carry
# the tensor cores' fp8 accumulation (LSEs 7.5e-5 - 5.7e-4 off exact in round AR's tests): within DESIGN.md's rule
# against PyTorch's fp8 GEMM with fast accumulation, the same precision. Not where the plan is told more rows
# (``num_q_heads``), given another ring than the default 3 slots, or ``warpgroup_mma=False``; at 8 KV heads it ran
# 0.99-1.04x (round AR, 4 an SM): two warps stay the default there.
GLUON_FP8_ONE_HEAD_WARPS = 4
# ... and at up to this many KV heads where the plan is told its calls' q is fp8 (``DecodePlan(q_dtype=)``, round
# AX): such a plan's calls of at most GLUON_FP8_WG_ROWS rows a KV head run the warpgroup form (on sm_90; elsewhere, or
# with more rows, two warps on its bins), at 2 programs an SM (``default_programs_per_sm``); 3 KV heads follow 2 and
# 4 (not measured). Round AX1
# (H200, graph replay, A/B in one run, two passes, fp8 KV, the ten standard cases' slices): four warps at 2 an SM
# against the two-warp default at 4 ran fp8-q calls 1.028-1.567x at 2 KV heads (the tp4: slices) and 0.995-1.381x
# at 4 (tp2:), but 0.885-1.062x at 8 (64x512 0.885, 1x32K+63x512 0.955); with a bf16 q (two warps at 2 an SM) it
# ran 0.976-1.33x at 2 KV heads (1x128K+31x4K 0.980 / 0.976: past the 2% the rule allowed) and 0.904-1.31x at 4, so
# a plan not told an fp8 q keeps two warps at 4 an SM at 2 and more KV heads. Round AX2 (the rule's A/B): a told
# plan 1.026-1.569x the old default's speed at 2 KV heads, 0.998-1.407x at 4. docs/perf-notes/decode.md, AX1 / AX2.
GLUON_FP8_WG_MAX_KV_HEADS = 4
Q_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
GLUON_FP8_MMA4_PROGRAMS_PER_SM = 2
GLUON_FP8_MMA4_SLOTS = 4
GLUON_FP8_WG_ROWS = 8
# Registers of an SM (sm_90: 65,536 32-bit registers) and ptxas' most a thread: the warpgroup form is capped so the
# plan's programs an SM fit (``gluon_wg_max_regs``).
_SM90_REGS_PER_SM = 65536
_MAX_REGS_PER_THREAD = 255
# Chunks the Gluon kernel's fused merge reads together (one memory round trip) and merges as one group
# (``DecodePlan(merge_chunks=)``, round AR): 8, or 12 where the ring has 3 or more slots (12 outputs of 4 KB in its
# 48 KB). An item cut in n chunks is merged in groups of that many, then the groups: the last chunk to finish waits
# for ceil(c / m) + ceil(ceil(n / c) / m) round trips (c the group size, m the batch): 5 at 8 for the TP8 slice's
# 256 chunks, 3 at 12. Default (round AS): 12 on a two-warp plan with 3 or more slots and the fused merge (AR5, A/B
# in one run, two passes: 0.907-0.941 of the 8-chunk merge's time on the fp8 TP8 slice, 0.992-1.016 on 2x64K+30x1K
# and 64x512), 8 elsewhere (the warpgroup form took 0.97-1.10 of its 8-chunk time at 12, AR5; one warp unmeasured).
# The warpgroup form's calls merge GLUON_WG_MERGE_CHUNKS by default on every plan, its two-warp calls the two-warp
# default's batch (round AW1, 2 an SM, the ten fp8-q TP8 slices, two passes: at 12 the form took 1.027-1.144x its
# 8-chunk time on every slice; ``merge_chunks=`` sets both).
GLUON_MERGE_CHUNKS = 8
GLUON_MERGE_CHUNKS_DEEP = 12
GLUON_WG_MERGE_CHUNKS = 8
GLUON_MERGE_CHUNK_COUNTS = (8, 12)

# Shared memory an SM's resident programs share on sm_90 (228 KiB), of which each program reserves 1 KiB
# (CUDA C programming guide, compute capability 9.0); read from the device where torch reports it.
_SM90_SMEM_PER_SM = 233472
_SMEM_RESERVED_PER_BLOCK = 1024
_GLUON_RING_SLOT = 2 * TILE * 128  # one ring slot: a 64-token tile of K and of V, e4m3, d128


def programs_per_sm(programs: int, device: torch.device) -> int:
    """Programs an SM holds when ``programs`` persistent programs share the device's SMs (the last SMs may
    hold fewer)."""
    return -(-programs // _runtime.num_sms(device))


def bin_stride(programs: int, device: torch.device) -> int:
    """Program -> bin stride of the plan's programs under PDL (both kernels; see ``gluon_kernels.decode_fp8_kernel``):
    the first integer above ``programs / per_sm`` prime to ``programs`` (per_sm = programs an SM), so that consecutive
    programs, and the programs a plain launch deals to one SM, take bins ``programs / per_sm`` apart."""
    per_sm = programs_per_sm(programs, device)
    if per_sm < 2:
        return 1
    a = programs // per_sm + 1
    while math.gcd(a, programs) != 1:
        a += 1
    return a


def _smem_per_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", _SM90_SMEM_PER_SM)
    return _SM90_SMEM_PER_SM


def _gluon_block(slots: int) -> int:
    """Shared memory of one Gluon fp8 program at ``slots`` 16 KB slots, with the 1 KB each program reserves (the
    warpgroup form's 1 KB of q is not counted: at 2-5 slots it changes no count of programs an SM holds, and
    tests/test_decode_sm90.py checks the compiled builds' shared memory)."""
    return slots * _GLUON_RING_SLOT + _SMEM_RESERVED_PER_BLOCK


def gluon_programs_fit(ring: int, device: torch.device) -> int:
    """Gluon fp8 programs an SM holds at ``ring`` 16 KB slots of shared memory a program."""
    return _smem_per_sm(device) // _gluon_block(ring)


def resident_pad(programs: int, stages: int, device: torch.device, min_pad: int = 0) -> int:
    """Unused ring slots for the Gluon kernel under PDL: the fewest (at least ``min_pad``, the slots a form needs
    past its ring) that make one program more than an SM can hold beside the ``ceil(programs / SMs)`` it runs (so a
    next call's programs launched early take only the slots this call frees), ``min_pad`` where no slot count does
    both."""
    per_sm = programs_per_sm(programs, device)
    smem = _smem_per_sm(device)
    for pad in range(min_pad, 8):
        block = _gluon_block(stages + pad)
        if per_sm * block > smem:
            return min_pad
        if (per_sm + 1) * block > smem:
            return pad
    return min_pad


def takes_gluon(kv_dtype: torch.dtype | None, num_kv_heads: int, gluon: bool | None = None,
                warps: int = GLUON_FP8_WARPS, page_size: int = 64) -> bool:
    """Whether a plan is built for the Gluon fp8 kernel at ``warps`` warps a program: an fp8 ``kv_dtype``, a page
    size the kernel reads (GLUON_FP8_PAGE_SIZES) and, unless ``gluon`` says, at least GLUON_FP8_MIN_KV_HEADS[warps]
    KV heads (``gluon=False``: never; ``True``: at any count)."""
    if kv_dtype != torch.float8_e4m3fn or gluon is False or page_size not in GLUON_FP8_PAGE_SIZES:
        return False
    return gluon is True or num_kv_heads >= GLUON_FP8_MIN_KV_HEADS[warps]


def gluon_fp8_shape_misses(head_dim: int | None, rows: int | None) -> tuple[bool, bool]:
    """Whether a call's head dim, and its q rows a KV head (GQA group x q_len), lie outside the Gluon fp8 kernel's
    scope (GLUON_FP8_HEAD_DIM, GLUON_FP8_MAX_ROWS); None: not known, so not outside. The one place that scope is
    written: the plan (told a shape), the launcher's refusal and its warning all ask here."""
    return (head_dim is not None and head_dim != GLUON_FP8_HEAD_DIM,
            rows is not None and rows > GLUON_FP8_MAX_ROWS)


def default_gluon_warps(num_kv_heads: int, rows: int | None, num_stages: int | None, warpgroup_mma: bool,
                        q_dtype: torch.dtype | None = None) -> int:
    """Warps a program of a plan built for the Gluon kernel when ``gluon_warps`` is not given:
    GLUON_FP8_ONE_HEAD_WARPS (the warpgroup form for fp8-q calls, two warps for the others) at one KV head, or at up
    to GLUON_FP8_WG_MAX_KV_HEADS where the plan is told an fp8 ``q_dtype`` (round AX1), where the plan's calls may
    be the form's (``rows``, q rows a KV head, not told or at most GLUON_FP8_WG_ROWS), its ring is the default 3
    slots (deeper rings were measured at two warps only, round AV3) and ``warpgroup_mma`` is on; else
    GLUON_FP8_WARPS."""
    heads = num_kv_heads == 1 or (q_dtype == torch.float8_e4m3fn and num_kv_heads <= GLUON_FP8_WG_MAX_KV_HEADS)
    if (heads and warpgroup_mma and num_stages in (None, GLUON_FP8_STAGES[GLUON_FP8_ONE_HEAD_WARPS])
            and (rows is None or rows <= GLUON_FP8_WG_ROWS)):
        return GLUON_FP8_ONE_HEAD_WARPS
    return GLUON_FP8_WARPS


def gluon_wg_max_regs(per_sm: int) -> int:
    """Register cap (ptxas ``maxnreg``) of the warpgroup form's build at ``per_sm`` programs an SM of 4 warps: the
    SM's registers over its threads, rounded down to a multiple of 8 (the allocation unit); 0 (no cap) where that is
    ptxas' own limit or more. 4 an SM: 128 (rounds AR-AV); 2 an SM, the one-KV-head default since round AW: no cap
    (its sm_90 build then takes 182 registers with the 8-chunk merge and 202 with 12, no spill, and its tile loops 298
    instructions against 316-321 and 40-72 bytes of spill at 128: history/round-aw-cpu/)."""
    cap = _SM90_REGS_PER_SM // (32 * 4 * max(1, per_sm)) // 8 * 8
    return 0 if cap >= _MAX_REGS_PER_THREAD else cap


def default_programs_per_sm(gluon: bool, num_kv_heads: int, gluon_warps: int, warpgroup_mma: bool = True) -> int:
    """Persistent programs an SM of a plan: DEFAULT_PROGRAMS_PER_SM, GLUON_FP8_PROGRAMS_PER_SM for a plan built for
    the Gluon kernel (``takes_gluon``), GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM for one at one KV head and two or four
    warps, or at four warps (the warpgroup form) and up to GLUON_FP8_WG_MAX_KV_HEADS (round AX: at 2 KV heads
    the form ran 1.04-1.32x faster at 2 an SM than at 4, round AW4; AX2: 1.050-1.281x at 2, 0.990-1.297x at 4),
    GLUON_FP8_MMA4_PROGRAMS_PER_SM for four warps on mma.sync (``warpgroup_mma=False``) at any count."""
    if not gluon:
        return DEFAULT_PROGRAMS_PER_SM
    if gluon_warps == 4 and not warpgroup_mma:
        return GLUON_FP8_MMA4_PROGRAMS_PER_SM
    if (num_kv_heads == 1 and gluon_warps == 2) or (gluon_warps == 4 and num_kv_heads <= GLUON_FP8_WG_MAX_KV_HEADS):
        return GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM
    return GLUON_FP8_PROGRAMS_PER_SM


def default_num_programs(device) -> int:
    """Persistent programs of a plan for the Triton kernel: DEFAULT_PROGRAMS_PER_SM times the SMs."""
    return DEFAULT_PROGRAMS_PER_SM * _runtime.num_sms(device)


def _plan_update_launch(seq_lens: torch.Tensor, tiles: torch.Tensor, req_end: torch.Tensor,
                    prog_start: torch.Tensor, meta: torch.Tensor, num_kv_heads: int,
                    max_seq_len: int, min_tiles: int, max_batch: int, align_items: bool,
                    item_cost: int, align_longer: bool, cost_max: int, grow16: int, grow_longer16: int,
                    pack_short: bool) -> None:
    # every argument comes from DecodePlan.update (its options' defaults live on DecodePlan)
    B = seq_lens.shape[0]
    np_ = prog_start.shape[0] - 1
    K.plan_kernel[(1,)](
        seq_lens, tiles, req_end, prog_start, meta, B, max_seq_len, min_tiles, item_cost, cost_max, grow16,
        grow_longer16, NP=np_, HKV=num_kv_heads, BLOCK_B=1024, BLOCK_P=256,
        SEARCH_ITERS=max(1, math.ceil(math.log2(max_batch + 1)) + 1), ALIGN=align_items,
        ALIGN_LONGER=align_longer, PACK=pack_short, num_warps=4,
    )


# The most the budget's roundings (align_growth, align_longer_growth: each at most 2) grow a program's budget
_BUDGET_GROWTH = 4


def _check_tile_bound(max_batch: int, num_kv_heads: int, max_seq_len: int, item_cost: int, num_programs: int,
                      min_tiles: int) -> None:
    """The plan's int32 indices cannot wrap: every bin's start (``num_programs`` budgets on top of the tiles) with
    the budget grown by its roundings, and an item's tokens (``n * TILE`` in the kernels) with the item padded up to
    twice its units. The growth term is an assumed bound, not derived from the plan kernel: a budget of an item or
    less grown up to ``_BUDGET_GROWTH`` times, a larger one by at most ``_BUDGET_GROWTH - 1`` items (the tests hold
    it at the largest accepted ``max_seq_len`` and at round AZ's huge floors). Round CP's review: the bound left out
    both, so legal plans at a huge
    ``max_seq_len`` wrapped ``prog_start`` negative (bins undrained, a read before the plan's buffers) or an item's
    token count (an all-zero output where the static path attends)."""
    item = math.ceil(max_seq_len / TILE) + item_cost
    max_tiles = max_batch * num_kv_heads * item
    budget = math.ceil(max_tiles / num_programs) + min_tiles + 1
    grown = budget + (_BUDGET_GROWTH - 1) * min(budget, item)
    if max_tiles + num_programs * grown >= 2**31 or 2 * item * TILE >= 2**31:
        raise ValueError(f"max_batch ({max_batch}) * num_kv_heads ({num_kv_heads}) * max_seq_len ({max_seq_len}) "
                         f"with min_tiles ({min_tiles}) over {num_programs} programs is too large for the plan's "
                         f"int32 tile and token indices ({max_tiles} tiles of items up to {item}, a program's "
                         f"budget up to {grown})")


def _check_plan_update_op(a: dict) -> None:
    """A direct call's checks (``checked_op``): the plan's buffers hold what the kernel writes for this batch,
    and the options lie in the ranges ``DecodePlan`` allows."""
    seq_lens = check_tensor("seq_lens", a["seq_lens"], dtypes=[torch.int32], ndim=1, contiguous=True)
    dev = seq_lens.device
    check_int("max_batch", a["max_batch"], 1, MAX_BATCH)
    B = check_int("seq_lens.shape[0] (batch)", seq_lens.shape[0], 1, a["max_batch"])
    for name, least in (("tiles", B), ("req_end", B), ("prog_start", 2), ("meta", 6)):
        t = check_tensor(name, a[name], dtypes=[torch.int32], ndim=1, device=dev, contiguous=True)
        if t.numel() < least:
            raise ValueError(f"{name} must hold at least {least} entries, got {t.numel()}")
    check_int("num_kv_heads", a["num_kv_heads"], 1, 256)
    check_int("max_seq_len", a["max_seq_len"], 1, MAX_SEQ_LEN)
    check_int("min_tiles", a["min_tiles"], 1)
    check_int("item_cost", a["item_cost"], 0, MAX_ITEM_COST)
    _check_tile_bound(a["max_batch"], a["num_kv_heads"], a["max_seq_len"], a["item_cost"], a["prog_start"].numel() - 1,
                      a["min_tiles"])
    check_int("cost_max", a["cost_max"], 1, _NO_COST_LIMIT)
    check_int("grow16", a["grow16"], 16, 32)
    check_int("grow_longer16", a["grow_longer16"], 16, 32)
    for name in ("align_items", "align_longer", "pack_short"):
        check_bool(name, a[name])


# custom op for torch.compile; eager calls launch directly (see attention/decode.py)
_plan_update_op = torch.library.custom_op("evenflow::decode_plan_update",
                                          mutates_args=("tiles", "req_end", "prog_start", "meta"))(
    checked_op(_plan_update_launch, _check_plan_update_op))


@_plan_update_op.register_fake
def _(seq_lens, tiles, req_end, prog_start, meta, num_kv_heads, max_seq_len, min_tiles, max_batch, align_items,
      item_cost, align_longer, cost_max, grow16, grow_longer16, pack_short):
    return None


class DecodePlan:
    """Fixed-size workspace for the length-balanced decode schedule.

    ``DecodePlan(max_batch, max_seq_len, num_kv_heads, page_size=64, q_len=1, device="cuda",
    num_programs=None, min_tiles=None)``; then ``plan.update(seq_lens)`` once per decode
    step (one small device kernel: no host sync, no allocation, CUDA-graph capturable),
    and pass ``plan=`` to every layer's :func:`evenflow.decode_attention`.

    ``kv_dtype``: the KV cache dtype the plan serves (``None``: not said). With
    ``torch.float8_e4m3fn`` (``gluon``: ``None`` = the rule ``GLUON_FP8_MIN_KV_HEADS``: any KV-head count at 2 warps
    a program, round AL2; from 2 KV heads at 1, since at one KV head the Triton kernel was faster than the one-warp
    kernel on five of seven cases, round AF5; ``True`` = at any KV-head count, ``False`` = never), a page size of 64
    or 128 tokens and none of the Triton kernel's launch options (``num_warps``, ``block_n``, ``max_registers``,
    ``warp_split``, ``num_stages=1``: such a plan is built for the Triton kernel, and ``gluon=True`` with one of them
    or another page size raises), the plan is sized for the Gluon fp8 kernel
    (``attention/gluon_kernels.py``: default ``num_programs`` 4 x SMs (2 x SMs at one KV head and two or four warps,
    rounds AU / AV: ``GLUON_FP8_ONE_HEAD_PROGRAMS_PER_SM``, at four warps and 2-4 KV heads since round AX, and for
    four warps on mma.sync at any KV-head count: ``default_programs_per_sm``), ``gluon_warps`` warps a program
    (default 2, and 4 at one KV head since round AW and at 2-4 on a plan told an fp8 q since round AX:
    ``default_gluon_warps``, see below; two warps
    each taking half of every tile, their outputs merged after each chunk in the idle ring, or beside a 2-slot ring
    in a 16 KB buffer; 1 = the one-warp kernel of rounds AB-AK), a ring of ``num_stages`` tiles (default 3 at two
    warps, 2 at one: ``GLUON_FP8_STAGES``; more slots than leave an SM the default count of programs are refused unless
    ``num_programs`` is given), ``deep_ring_tiles``: chunks of at most that many tiles read ``num_stages`` - 1 tiles
    ahead, longer ones a tile fewer (default 16 at two warps and 3 or more slots, round AM2; 0 = every chunk the
    whole ring, the only choice at one warp; a positive value only on such a plan); ``gluon_warps=4`` (round AR;
    the default at one KV head since round AW, and at 2-4 KV heads on a plan told ``q_dtype=torch.float8_e4m3fn``
    since round AX, unless the plan is told more than 8 q rows a KV head, another ring than the default 3 slots or
    ``warpgroup_mma=False``: ``default_gluon_warps``; 2 programs an SM at up to 4 KV heads; sm_90 builds, 3 or more
    ring slots) is the warpgroup form: calls with an
    fp8 q of at most 8 rows a KV head get their scores from ``wgmma`` (the tensor cores' fp8 accumulation: LSEs
    7.5e-5 - 5.7e-4 off exact scores in round AR's tests, as PyTorch's fp8 GEMM with fast accumulation), the plan's
    other calls run two warps on the same bins; with ``warpgroup_mma=False`` (round AV, opt-in) every call runs four
    warps a program on ``mma.sync`` instead (exact f16 products, 16 tokens a warp a tile);
    ``merge_chunks`` (8, or 12 on 3 or more ring slots with the fused merge; default 12 there for two-warp calls,
    round AS, else 8; the warpgroup form's calls 8 unless given, ``wg_merge_chunks``, round AW1): chunks the fused
    merge reads in one round trip and merges as a group) and
    :func:`evenflow.decode_attention` runs that kernel where the call applies (bf16 q, or fp8 q with its scales
    where ``decode.GLUON_FP8_Q``, on since round AP; head_dim 128, GQA group x q_len <= 16; a timeline runs its own
    STAMPS build; ``combine`` as for the Triton kernel); other calls run the Triton kernel on the same bins, its
    register cap set for at most its own DEFAULT_PROGRAMS_PER_SM programs an SM (so an SM runs a plan of more in two
    rounds: round AP4 measured 1.02-1.21x the time of a plan built for the Triton kernel), and on such a plan of more
    than 2 programs an SM the first of those calls warns once (round AO: build the plan with ``gluon=False`` for them).
    ``num_q_heads`` / ``head_dim`` (optional, round AP): the calls' q heads and head dim. Where given, a call with
    others raises, and an fp8 plan whose calls the Gluon kernel does not take (head_dim other than 128, GQA group x
    ``q_len`` over 16) is built for the Triton kernel from the start (``gluon=True`` with them raises).
    A call whose cache dtype differs from a given ``kv_dtype`` raises; so does one whose q dtype differs from a given
    ``q_dtype`` (optional, round AX: ``torch.bfloat16`` or ``torch.float8_e4m3fn``; told an fp8 q, a plan for the
    Gluon kernel at 2-4 KV heads takes the warpgroup form, above).

    ``num_programs``: persistent programs of the attention kernel (default
    ``2 * SMs``; ``4 * SMs`` for the Gluon kernel, ``2 * SMs`` where ``default_programs_per_sm`` says). ``min_tiles``:
    the minimum work per program in 64-token tiles
    (default 8 = 512 tokens), so small batches are not over-split. The budget per program
    is ``max(ceil(total tiles / num_programs), min_tiles)``; with ``align_items`` (default)
    it is then rounded up to a multiple of the shortest non-empty item's tiles when that
    item fits in a bin and the rounding grows it by at most ``align_growth`` (default 1.25, a
    multiple of 1/16 in [1, 2]), so bins hold whole short items
    instead of cutting them (a cut costs a partial write and a combine merge: 64x512 took
    56 us with budget 11 and 44 us with 16, round E sweep); ``align_longer`` (default:
    as ``align_items``) also raises the budget, when the shortest item is longer than it, to
    that item cut in ``n = item // budget`` equal chunks, where ``n`` divides it and that grows the
    budget by at most ``align_longer_growth`` (a multiple of 1/16 in [1, 2]; default 2 for a plan of the Gluon fp8
    kernel at 4 or more programs an SM, 17/16 otherwise: round AZ's A/B, ``GLUON_SHARED_ALIGN_LONGER_GROWTH``):
    ``n = 1``, the item itself (32x4K: 63 -> 64 tiles, so no item is
    cut; round I1: 32x4K 150 -> 133 us bf16, 115 -> 91 us fp8, no other case moved by more than
    1%); ``n > 1`` (round AC), cuts that fall at the same tiles of every head's item, each item one
    merge group where ``n <= 8`` (fp8 8x32K at 4 programs an SM: 63 -> 64 tiles, 153.0 -> 140.1 us
    in AC4 against the plan without it).
    ``pack_short`` (default ``True`` since round BB1: ``DEFAULT_PACK_SHORT``; ``False`` = the rules alone): where
    the shortest non-empty item fits in the raw budget, the plan also prices a quantum ``q`` (32 candidates, 1-8 of
    the shortest items a bin: ``reference.attention.pack_quanta``): every item's units rounded up to a multiple of
    ``q`` (the added units carry no tokens and are not looped over, as ``item_cost``'s) and the budget the least
    multiple of ``q`` that holds them in the programs; the least such budget replaces the rules' where it is at most
    15/16 of theirs. Every item then starts on a multiple of ``q`` and no item of ``q`` units or fewer is cut, at a
    budget the rules' alignment would not reach (fp8 2x64K+30x1K at 8 KV heads and 528 programs: 42 tiles with two 1K
    items a bin, where ``align_items`` takes 48 with three and leaves 106 bins idle). The kernel skips the pricing
    where 16 x the raw budget exceeds 15 x the rules' (no quantum could be taken: a priced budget is never under the
    raw one). ``meta[5]`` holds the quantum of the last update (1: not packed).
    ``num_warps`` /
    ``num_stages`` / ``block_n`` (tokens per loop iteration, 64 or 128) / ``max_registers``
    (per-thread register cap, 0 = none): launch config of the attention kernel (default:
    the launcher's choice, which caps registers so ``num_programs / SMs`` programs fit on
    each SM); these exist so one GPU run can sweep them. ``pdl``: launch the attention
    and combine kernels with programmatic dependent launch (each starts while the kernel
    before it drains, then waits for it before reading memory); default: on where the GPU
    supports it (sm_90+), ``False`` to compare. ``item_cost`` (tiles, 0-8, default 2): work
    the bins count per non-empty item of at most ``item_cost_max_tiles`` tiles (default 4 =
    256 tokens; ``None``: every item) on top of its tiles (its prologue, first-load latency,
    output or partial write, which a pipeline of so few tiles does not hide), so bins of
    many short items hold fewer of them; the plan's ``tiles`` are then work units (see
    ``attention/kernels.py``); the kernel does not loop over the extra units. ``warp_split``: on chunks of
    at least 24 tiles, each warp runs its own online softmax over its 16 tokens of every step,
    merged once per chunk (``True``; needs ``block_n / num_warps >= 16``, GQA group x q_len
    <= 16 and head_dim <= 128, else ``decode_attention`` raises), or the warps share each
    step's softmax (``False``); default: on for fp8 KV where it can be built, off for bf16.
    ``prefetch`` (default on; both kernels): each program loads the next item's tiles, end and length
    before the current item's work (``False``: after it, to compare). ``combine``: where
    items cut across bins are merged: ``"fused"`` (default) in the attention kernel, by the
    last of each group of chunks to finish (one kernel per call); ``"kernel"`` in a second,
    combine kernel (launched with PDL; to compare).
    ``launch_next`` / ``early_reads`` / ``resident_cap`` (under PDL, all default on): the programs
    let the next kernel launch at once (``launch_next``; the Triton kernel only where its build holds
    an SM to the plan's programs: the default build at head_dim 128, GQA group x q_len <= 16, 2
    programs an SM, round AF) and, except in the first call after :meth:`update`, read before
    waiting for the kernel ahead what a decode step's kernels do not write: the plan, ``seq_lens``,
    the page table and, in the fp8 Gluon kernel, each request's K / V before its last ``q_len``
    tokens (the step's KV write adds those; they, q and the scales are read after the wait), so
    the first item's metadata (and, in the Gluon kernel, its first tiles) are in flight while that
    kernel drains (the Triton kernel: with the fused combine).
    So the kernels run between ``update`` and a later call (the attention prologue, other layers)
    must leave each request's cached K / V, its page-table row and ``seq_lens`` as they were
    (``early_reads=False``: everything after the wait). ``resident_cap`` (the Gluon kernel): unused ring
    slots make each program need more shared memory than an SM holds beside the plan's programs per SM,
    so the next call's programs take only the slots this call frees (``False``: to compare; where a program's
    ring and output buffer already fill an SM at the plan's programs, as at two warps or at 3 slots, it changes
    nothing).
    ``spread_bins``: program i drains bin ``i * stride mod programs`` (the first stride above programs /
    programs an SM that is prime to the program count: about a quarter of it at 4 programs an SM, half
    at 2), so the bins an SM gets do not follow the order the call ahead finished in (``False``: bin i,
    to compare).

    Lengths outside [0, max_seq_len] are clamped on the device (the kernels stay in
    bounds) and flagged; :meth:`clamped` (host sync),
    :func:`evenflow.attention.validate_inputs` or ``decode_attention(..., check_inputs=True)``
    reports them. A call given the very ``seq_lens`` tensor of the last update, written in place since
    (its version counter), is refused with no sync (:meth:`written_since_update`).

    Partial-output buffers (fp32, ``2 * num_programs`` slots) depend on the head count
    and head dim; they are allocated on the first ``decode_attention`` call with a new
    (group, head_dim) and reused after. Run one step before capturing a CUDA graph, as
    engines do for warm-up.
    """

    def __init__(self, max_batch: int, max_seq_len: int, num_kv_heads: int, page_size: int = 64,
                 q_len: int = 1, device="cuda", num_programs: int | None = None, min_tiles: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 block_n: int | None = None, max_registers: int | None = None, align_items: bool = True,
                 pdl: bool | None = None, item_cost: int = DEFAULT_ITEM_COST, warp_split: bool | None = None,
                 align_longer: bool | None = None, prefetch: bool = True,
                 item_cost_max_tiles: int | None = DEFAULT_ITEM_COST_MAX_TILES, combine: str = DEFAULT_COMBINE,
                 align_growth: float = DEFAULT_ALIGN_GROWTH, kv_dtype: torch.dtype | None = None,
                 early_reads: bool = True, resident_cap: bool = True, spread_bins: bool = True,
                 launch_next: bool = True, gluon: bool | None = None, gluon_warps: int | None = None,
                 deep_ring_tiles: int | None = None, num_q_heads: int | None = None, head_dim: int | None = None,
                 merge_chunks: int | None = None, warpgroup_mma: bool = True, q_dtype: torch.dtype | None = None,
                 align_longer_growth: float | None = None, pack_short: bool = DEFAULT_PACK_SHORT):
        check_int("max_batch", max_batch, 1, MAX_BATCH)
        check_bool("warpgroup_mma", warpgroup_mma)
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)} or None, got {kv_dtype!r}")
        if q_dtype is not None and q_dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype must be one of {list(Q_DTYPES)} or None, got {q_dtype!r}")
        check_int("max_seq_len", max_seq_len, 1, MAX_SEQ_LEN)
        check_int("num_kv_heads", num_kv_heads, 1, 256)
        if check_int("page_size", page_size) not in (16, 32, 64, 128):
            raise ValueError(f"page_size must be one of [16, 32, 64, 128], got {page_size!r}")
        check_int("q_len", q_len, 1, 4)
        if num_q_heads is not None:
            check_int("num_q_heads", num_q_heads, 1, 256 * MAX_GQA_GROUP)
            if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > MAX_GQA_GROUP:
                raise ValueError(f"num_q_heads must be num_kv_heads ({num_kv_heads}) times a GQA group of 1-"
                                 f"{MAX_GQA_GROUP}, got {num_q_heads}")
        if head_dim is not None:
            check_int("head_dim", head_dim, 1)
            if head_dim not in HEAD_DIMS:
                raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)} or None, got {head_dim!r}")
        dev = torch.device(device)
        if dev.type == "cuda" and _runtime.interpreting():
            raise ValueError("device: kernels run on the CPU here (Triton interpreter); pass device='cpu'")
        if dev.type == "cpu" and not _runtime.interpreting():
            raise ValueError("device: kernels run on CUDA here; pass a CUDA device")
        check_bool("gluon", gluon, allow_none=True)
        if num_stages is not None:
            check_int("num_stages", num_stages, 1, 6)
        warps_given = gluon_warps is not None
        if not warps_given:
            gluon_warps = GLUON_FP8_WARPS
        if type(gluon_warps) is not int:
            raise TypeError(f"gluon_warps must be an int or None, got {gluon_warps!r}")
        if gluon_warps not in GLUON_FP8_WARP_COUNTS:
            raise ValueError(f"gluon_warps must be one of {list(GLUON_FP8_WARP_COUNTS)}, got {gluon_warps!r}")
        # the Triton kernel's launch options: a plan given any is built for that kernel (round AO; before, sized for
        # the Gluon one at 4 programs an SM, the Triton kernel ran its bins under a register cap for 4)
        triton_options = [f"{n}={v!r}" for n, v in (("num_warps", num_warps), ("block_n", block_n),
                                                    ("max_registers", max_registers), ("warp_split", warp_split))
                          if v is not None] + (["num_stages=1"] if num_stages == 1 else [])
        other_page = [f"page_size={page_size}"] if page_size not in GLUON_FP8_PAGE_SIZES else []
        # the calls' shape, where the plan is told it (round AP): one the Gluon kernel does not take makes a plan
        # for the Triton kernel, so those calls do not run it on bins sized for the Gluon kernel's programs
        rows = None if num_q_heads is None else num_q_heads // num_kv_heads * q_len
        head_out, rows_out = gluon_fp8_shape_misses(head_dim, rows)
        other_shape = ([f"head_dim={head_dim}"] if head_out else []) + (
            [f"num_q_heads={num_q_heads} (GQA group x q_len {rows})"] if rows_out else [])
        if gluon is True and kv_dtype == torch.float8_e4m3fn and (other_page or triton_options or other_shape):
            raise ValueError(f"gluon=True asks for the Gluon fp8 kernel, which reads pages of "
                             f"{' or '.join(map(str, GLUON_FP8_PAGE_SIZES))} tokens, head_dim "
                             f"{GLUON_FP8_HEAD_DIM} and GQA group x q_len <= {GLUON_FP8_MAX_ROWS}, and takes none of "
                             f"the Triton kernel's launch options; got "
                             f"{', '.join(other_page + other_shape + triton_options)}")
        gluon_plan = (takes_gluon(kv_dtype, num_kv_heads, gluon, gluon_warps, page_size) and not triton_options
                      and not other_shape)
        if not warps_given and gluon_plan:
            gluon_warps = default_gluon_warps(num_kv_heads, rows, num_stages, warpgroup_mma, q_dtype)
            # (GLUON_FP8_MIN_KV_HEADS is the same at 2 and 4 warps: the kernel choice stands)
            assert takes_gluon(kv_dtype, num_kv_heads, gluon, gluon_warps, page_size)
        # the Gluon kernel's ring slots (its shared memory: 16 KB a slot, the two warps' 16 KB output buffer beside a
        # 2-slot ring; beside 3 or more their outputs meet in the idle ring)
        stages = num_stages or GLUON_FP8_STAGES[gluon_warps]
        if gluon_plan and gluon_warps == 4 and stages < 3:
            # the warpgroup form's outputs meet in K's idle slots, so 2 slots would let 6 programs onto an SM, while
            # the plan's other calls (two warps beside 2 slots) need a 16 KB buffer more: no pad fits both; the
            # mma.sync form's outputs meet in the ring too
            raise ValueError(f"gluon_warps=4 (four warps a program: the warpgroup form, or mma.sync with "
                             f"warpgroup_mma=False) needs a ring of 3 or more slots, got num_stages={num_stages}")
        ring = stages + (gluon_warps > 1 and stages <= 2)
        # the four-warp mma.sync form's outputs need GLUON_FP8_MMA4_SLOTS slots of K's ring: unused slots pad a
        # shorter ring, with PDL or without
        min_pad = max(0, GLUON_FP8_MMA4_SLOTS - ring) if gluon_plan and gluon_warps == 4 and not warpgroup_mma else 0
        fit = gluon_programs_fit(ring + min_pad, dev)
        default_per_sm = default_programs_per_sm(gluon_plan, num_kv_heads, gluon_warps, warpgroup_mma)
        if gluon_plan and num_programs is None and fit < default_per_sm:
            raise ValueError(f"num_stages={num_stages}: the Gluon kernel's {ring + min_pad} ring slots of 16 KB leave "
                             f"an SM {fit} programs, fewer than the default num_programs plans "
                             f"({default_per_sm} an SM); pass num_programs or a smaller num_stages")
        two_loops = gluon_plan and stages >= 3 and gluon_warps > 1  # where the kernel may read ahead by chunk length
        if deep_ring_tiles is None:
            deep_ring_tiles = GLUON_FP8_DEEP_TILES if two_loops else 0
        else:
            check_int("deep_ring_tiles", deep_ring_tiles, 0, 1 << 16)
            if deep_ring_tiles and not two_loops:
                raise ValueError(f"deep_ring_tiles={deep_ring_tiles} picks the chunks that the Gluon fp8 kernel's "
                                 f"ring reads num_stages - 1 tiles ahead (longer ones a tile fewer): it needs a plan "
                                 f"for that kernel (kv_dtype=torch.float8_e4m3fn) at gluon_warps=2 or 4 (at one warp "
                                 f"the second tile loop spills) with num_stages >= 3, pages of 64 or 128 tokens, no "
                                 f"Triton launch option and no told shape outside the kernel's (head_dim "
                                 f"{GLUON_FP8_HEAD_DIM}, GQA group x q_len <= {GLUON_FP8_MAX_ROWS}); got "
                                 f"kv_dtype={kv_dtype}, gluon={gluon}, gluon_warps={gluon_warps}, "
                                 f"num_stages={num_stages}, page_size={page_size}"
                                 + "".join(f", {o}" for o in other_shape + triton_options))
        if num_programs is None:
            num_programs = default_per_sm * _runtime.num_sms(dev)
        check_int("num_programs", num_programs, 1, 1 << 16)
        if min_tiles is None:
            min_tiles = DEFAULT_MIN_TILES
        check_int("min_tiles", min_tiles, 1)
        # ints (a float or bool refused: round CP's review found 4.0, 64.0 and False taken)
        if num_warps is not None and check_int("num_warps", num_warps) not in TRITON_WARP_COUNTS:
            raise ValueError(f"num_warps must be one of {list(TRITON_WARP_COUNTS)} or None, got {num_warps!r}")
        if block_n is not None and check_int("block_n", block_n) not in BLOCK_NS:
            raise ValueError(f"block_n must be one of {list(BLOCK_NS)} or None, got {block_n!r}")
        if max_registers is not None:
            check_register_cap("max_registers", max_registers, none_allowed=True)
        check_int("item_cost", item_cost, 0, MAX_ITEM_COST)
        if item_cost_max_tiles is not None:
            check_int("item_cost_max_tiles", item_cost_max_tiles, 1, _NO_COST_LIMIT - 1)
        _check_tile_bound(max_batch, num_kv_heads, max_seq_len, item_cost, num_programs, min_tiles)
        self.max_batch, self.max_seq_len, self.num_kv_heads = max_batch, max_seq_len, num_kv_heads
        self.page_size, self.q_len, self.device = page_size, q_len, dev
        self.kv_dtype, self.q_dtype = kv_dtype, q_dtype  # (None: not said)
        self.num_q_heads, self.head_dim = num_q_heads, head_dim  # the calls' shape, where given (None: not said)
        self.gluon = gluon
        self.takes_gluon = gluon_plan  # where the Gluon kernel applies (decode.gluon_fp8_supported)
        self.gluon_warps = gluon_warps
        self.deep_ring_tiles = deep_ring_tiles
        self.gluon_stages = stages  # the Gluon kernel's ring slots (num_stages, else its default at these warps)
        self.num_programs, self.min_tiles, self.item_cost = num_programs, min_tiles, item_cost
        self.item_cost_max_tiles = item_cost_max_tiles
        # kernel launch config of the attention kernel (None: the launcher's choice)
        self.num_warps, self.num_stages, self.block_n = num_warps, num_stages, block_n
        self.max_registers = max_registers
        self.align_items = check_bool("align_items", align_items)
        if align_longer is None:
            align_longer = align_items
        check_bool("align_longer", align_longer)
        if align_longer and not align_items:
            raise ValueError("align_longer=True extends align_items; it needs align_items=True")
        self.align_longer = align_longer
        check_sixteenths("align_growth", align_growth, 1.0, 2.0)
        self.align_growth = float(align_growth)
        if align_longer_growth is not None:
            check_sixteenths("align_longer_growth", align_longer_growth, 1.0, 2.0)
        self.prefetch = check_bool("prefetch", prefetch)
        if combine not in COMBINE_MODES:
            raise ValueError(f"combine must be one of {list(COMBINE_MODES)}, got {combine!r}")
        self.combine = combine
        deep_merge = gluon_plan and stages >= 3 and combine == "fused"  # the ring holds 12 chunks' outputs
        # the two-warp calls' batch (on a four-warp plan with warpgroup_mma: its calls outside the warpgroup form) and
        # the warpgroup form's
        wg_merge_chunks = merge_chunks if merge_chunks is not None else GLUON_WG_MERGE_CHUNKS
        if merge_chunks is None:
            two_warp_calls = gluon_warps == 2 or (gluon_warps == 4 and warpgroup_mma)
            merge_chunks = GLUON_MERGE_CHUNKS_DEEP if deep_merge and two_warp_calls else GLUON_MERGE_CHUNKS
        check_int("merge_chunks", merge_chunks, 1, 1 << 16)
        if merge_chunks not in GLUON_MERGE_CHUNK_COUNTS:
            raise ValueError(f"merge_chunks must be one of {list(GLUON_MERGE_CHUNK_COUNTS)}, got {merge_chunks}")
        if merge_chunks > GLUON_MERGE_CHUNKS and not deep_merge:
            raise ValueError(f"merge_chunks={merge_chunks} stages that many chunks' outputs (4 KB each) in the Gluon "
                             f"fp8 kernel's idle ring for its fused merge: it needs a plan for that kernel "
                             f"(kv_dtype=torch.float8_e4m3fn, pages of 64 or 128 tokens, from "
                             f"{GLUON_FP8_MIN_KV_HEADS[gluon_warps]} KV heads at gluon_warps={gluon_warps} unless "
                             f"gluon=True) with 3 or more ring slots and combine='fused'; got kv_dtype={kv_dtype}, "
                             f"gluon={gluon}, gluon_warps={gluon_warps}, num_kv_heads={num_kv_heads}, "
                             f"num_stages={num_stages} ({stages} slots), combine={combine!r}"
                             + "".join(f", {o}" for o in other_page + other_shape + triton_options))
        if not warpgroup_mma and (gluon_warps != 4 or not gluon_plan):
            raise ValueError(f"warpgroup_mma=False runs every call of a Gluon fp8 plan on four warps of mma.sync: it "
                             f"needs gluon_warps=4 and a plan for the Gluon kernel; got gluon_warps="
                             f"{gluon_warps if warps_given else f'None ({gluon_warps})'}, "
                             f"Gluon plan {gluon_plan}")
        if gluon_warps == 4 and warpgroup_mma and rows is not None and rows > GLUON_FP8_WG_ROWS:
            raise ValueError(f"gluon_warps=4 (the warpgroup form) takes calls of at most {GLUON_FP8_WG_ROWS} q rows a "
                             f"KV head; num_q_heads={num_q_heads} with q_len={q_len} gives {rows}")
        self.merge_chunks = merge_chunks
        # the warpgroup form's calls' batch (used where gluon_warps=4 and warpgroup_mma)
        self.wg_merge_chunks = wg_merge_chunks
        self.warpgroup_mma = warpgroup_mma
        self.warp_split = check_bool("warp_split", warp_split, allow_none=True)
        check_pdl(pdl, dev)
        self.pdl = pdl  # programmatic dependent launch; None: where the GPU supports it
        for name, flag in (("early_reads", early_reads), ("resident_cap", resident_cap), ("spread_bins", spread_bins),
                           ("launch_next", launch_next)):
            check_bool(name, flag)
        self.early_reads, self.resident_cap, self.spread_bins = early_reads, resident_cap, spread_bins
        self.launch_next = launch_next
        self.per_sm = programs_per_sm(num_programs, dev)
        if align_longer_growth is None:  # round AZ: by the kernel and its programs an SM
            align_longer_growth = (GLUON_SHARED_ALIGN_LONGER_GROWTH if gluon_plan and self.per_sm >= 4
                                   else DEFAULT_ALIGN_LONGER_GROWTH)
        self.align_longer_growth = float(align_longer_growth)
        self.pack_short = check_bool("pack_short", pack_short)
        # the programs the Triton kernel's register cap is set for (decode._plan_max_regs): the plan's, or on a plan
        # built for the Gluon kernel (a call that kernel does not take) at most its own DEFAULT_PROGRAMS_PER_SM an SM
        self.triton_programs = (min(num_programs, DEFAULT_PROGRAMS_PER_SM * _runtime.num_sms(dev)) if gluon_plan
                                else num_programs)
        # True until the first decode_attention after update(): that call's kernel may follow the
        # update's directly, so it reads nothing before its PDL wait (see early_reads)
        self.fresh = True
        # set by the first call that runs the Triton kernel on a plan built for the Gluon one (decode_attention
        # warns once a plan)
        self.warned_kernel = False
        # the Gluon fp8 kernel's layout under PDL, once per plan (device properties): unused ring slots and
        # the program -> bin stride (decode_attention passes them where its options keep them on)
        self.resident_pad = resident_pad(num_programs, ring, dev, min_pad)
        self.min_pad = min_pad  # the ring's pad without PDL (or with resident_cap off)
        # the warpgroup form's register cap for the programs an SM holds at once: the plan's count, or fewer where
        # shared memory keeps it to fewer (a padded ring holds exactly the plan's count where one can); none at 2
        self.wg_max_regs = (gluon_wg_max_regs(min(self.per_sm, gluon_programs_fit(ring + min_pad, dev)))
                            if gluon_plan and gluon_warps == 4 and warpgroup_mma else 0)
        self.bin_stride = bin_stride(num_programs, dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.tiles = torch.zeros(max_batch, **i32)
        self.req_end = torch.zeros(max_batch, **i32)
        self.prog_start = torch.zeros(num_programs + 1, **i32)
        self.meta = torch.zeros(6, **i32)
        # combine arrival counters, one per start bin; each merge puts its counter back to 0
        self.combine_count = torch.zeros(num_programs, **i32)
        # fused combine: arrival counters of the merge groups, one per partial slot
        self.group_count = torch.zeros(2 * num_programs, **i32)
        self.batch: int | None = None  # B of the last update (host-side shape, not a sync)
        self.stamps: torch.Tensor | None = None  # per-program timeline (record_timeline); off by default
        self._stamp_buffer: torch.Tensor | None = None  # kept once made: graphs may still write it
        self._partials: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lens_seen = None  # (weak reference, version counter) of the seq_lens the last update read

    def update(self, seq_lens: torch.Tensor) -> DecodePlan:
        """Rebuild the schedule from device-side ``seq_lens`` [B] int32 (B <= max_batch)."""
        check_tensor("seq_lens", seq_lens, dtypes=[torch.int32], ndim=1, contiguous=True)
        if seq_lens.device != self.prog_start.device:
            raise ValueError(f"seq_lens is on {seq_lens.device}, the plan on {self.prog_start.device}")
        B = seq_lens.shape[0]
        check_int("seq_lens.shape[0] (batch)", B, 1, self.max_batch)
        op = _plan_update_op if torch.compiler.is_compiling() else _plan_update_launch
        op(seq_lens, self.tiles, self.req_end, self.prog_start, self.meta,
           self.num_kv_heads, self.max_seq_len, self.min_tiles, self.max_batch, self.align_items, self.item_cost,
           self.align_longer, self.cost_max, int(self.align_growth * 16), int(self.align_longer_growth * 16),
           self.pack_short)
        self.batch = B
        self.fresh = True
        self._lens_seen = _version_stamp(seq_lens)
        return self

    def written_since_update(self, seq_lens: torch.Tensor) -> bool:
        """Whether ``seq_lens`` is the tensor the last :meth:`update` read and has been written in place
        since (its version counter moved): the plan then describes other lengths. Host-side, no sync;
        False where it cannot tell (another tensor, an inference-mode tensor, under torch.compile)."""
        seen = self._lens_seen  # the same tensor object: not an inference tensor, its counter readable
        if seen is None or seen[0]() is not seq_lens or torch.compiler.is_compiling():
            return False
        return seq_lens._version != seen[1]

    @property
    def cost_max(self) -> int:
        """Items of at most this many tiles are charged ``item_cost`` (a huge number: every item)."""
        return _NO_COST_LIMIT if self.item_cost_max_tiles is None else self.item_cost_max_tiles

    def item_units(self, seq_lens: torch.Tensor, quantum: int = 1) -> torch.Tensor:
        """Work units the plan gives each request's items (host arithmetic on ``seq_lens``, any
        integer dtype): ceil(len / 64) tiles, plus ``item_cost`` for a short non-empty item, rounded up to a
        multiple of ``quantum`` (the last update's is ``meta[5]``: 1 unless ``pack_short`` chose one)."""
        real = (seq_lens.clamp(0, self.max_seq_len) + TILE - 1) // TILE
        units = real + self.item_cost * ((seq_lens > 0) & (real <= self.cost_max)).to(real.dtype)
        return (units + quantum - 1) // quantum * quantum

    def partials(self, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output partials [slots, rows, D], their LSEs [slots, rows], the LSEs of merged
        groups of an item's chunks [slots, rows]), fp32, slots = 2 * num_programs."""
        key = (rows, head_dim)
        if key not in self._partials:
            slots = 2 * self.num_programs
            self._partials[key] = (
                torch.empty(slots, rows, head_dim, dtype=torch.float32, device=self.device),
                torch.empty(slots, rows, dtype=torch.float32, device=self.device),
                torch.empty(slots, rows, dtype=torch.float32, device=self.device),
            )
        return self._partials[key]

    def record_timeline(self, on: bool = True) -> torch.Tensor | None:
        """Diagnostics: with ``on``, every later ``decode_attention`` call on this plan runs
        the attention kernel's STAMPS build, which writes each program's timeline into the
        returned buffer [num_programs, STAMP_SLOTS] int64 (fields ``kernels.STAMP_FIELDS``:
        globaltimer ns, the SM, chunk / merge / tile counts); each call (every layer sharing
        the plan) overwrites it. A separate build: timings of it are not the default kernel's.
        ``on=False`` goes back to the default build for later calls. CUDA graphs keep the build
        they were captured with, so the plan keeps the one buffer (zeroed when turned on again)
        for as long as it lives: a graph captured with the timeline on never writes freed
        memory."""
        check_bool("on", on)
        if on:
            if self._stamp_buffer is None:
                self._stamp_buffer = torch.zeros(self.num_programs, K.STAMP_SLOTS, dtype=torch.int64,
                                                 device=self.device)
            else:
                self._stamp_buffer.zero_()
        self.stamps = self._stamp_buffer if on else None
        return self.stamps

    def clamped(self) -> bool:
        """True if the last update saw a length outside [0, max_seq_len] (syncs with the host)."""
        return bool(int(self.meta[3]) != 0)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The plan's tensors for the last update, trimmed to its batch (for tests and debugging)."""
        B = self.batch or 0
        return {"tiles": self.tiles[:B], "req_end": self.req_end[:B], "prog_start": self.prog_start,
                "meta": self.meta}

    def __repr__(self) -> str:
        return (f"DecodePlan(max_batch={self.max_batch}, max_seq_len={self.max_seq_len}, "
                f"num_kv_heads={self.num_kv_heads}, page_size={self.page_size}, q_len={self.q_len}, "
                f"num_programs={self.num_programs}, min_tiles={self.min_tiles}, item_cost={self.item_cost}, "
                f"item_cost_max_tiles={self.item_cost_max_tiles}, "
                f"align_items={self.align_items}, align_growth={self.align_growth}, align_longer={self.align_longer}, "
                f"align_longer_growth={self.align_longer_growth}, pack_short={self.pack_short}, "
                f"warp_split={self.warp_split}, "
                f"prefetch={self.prefetch}, combine={self.combine!r}, kv_dtype={self.kv_dtype}, "
                f"q_dtype={self.q_dtype}, gluon={self.gluon}, "
                f"gluon_warps={self.gluon_warps}, deep_ring_tiles={self.deep_ring_tiles}, "
                f"merge_chunks={self.merge_chunks}, wg_merge_chunks={self.wg_merge_chunks}, "
                f"warpgroup_mma={self.warpgroup_mma}, "
                f"num_q_heads={self.num_q_heads}, head_dim={self.head_dim}, "
                f"pdl={self.pdl}, "
                f"launch_next={self.launch_next}, early_reads={self.early_reads}, resident_cap={self.resident_cap}, "
                f"spread_bins={self.spread_bins}, "
                f"device={self.device})")


def _version_stamp(t: torch.Tensor):
    """(a weak reference to ``t``, its version counter), or None where the counter cannot be read:
    inference-mode tensors keep none, and torch.compile traces no Python-side state."""
    if torch.compiler.is_compiling() or t.is_inference():
        return None
    return weakref.ref(t), t._version


def static_splits(batch: int, num_kv_heads: int, device) -> int:
    """Split count of the static schedule: enough (item, chunk) programs to fill the
    persistent grid once, at most 64 chunks per item; chosen from the batch shape only
    (the host does not know the lengths), as a fixed-split-count static scheduler does."""
    items = batch * num_kv_heads
    return max(1, min(64, -(-default_num_programs(device) // items)))
