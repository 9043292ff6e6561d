"""Paged decode attention: evenflow (dynamic plan, static split-KV) beside FlashInfer and the floor.

Standard cases of BENCH.md: 64 q / 8 kv heads (the ``tp8:`` slice: 8 q / 1 kv),
head_dim 128, page 64, bf16 and fp8 e4m3 KV (per-tensor scales), q and output bf16.
``AxB`` = A requests with B cached tokens; ``K`` = 1024.

Inputs: random q and KV (never zeros); each case's pages are drawn from a random
permutation of a pool larger than needed, so no request's pages are contiguous. A
case whose KV is smaller than 3x L2 gets several rotations (disjoint page sets and
their own q) so consecutive calls in the timed graph do not hit L2.

Per impl: output checked against a plain fp32 PyTorch reference before timing, then
``us`` = CUDA-graph replay (one call per rotation in one graph), ``eager_us`` beside it.
``floor_us`` = (KV bytes of the live tokens + q + o bytes) / measured copy bandwidth.
The dynamic plan's own cost (``plan.update``, once per decode step, shared by all
layers) is ``plan_us`` on the ``evenflow`` rows; FlashInfer's host-side ``plan()`` is
``plan_host_us`` (wall clock) on its rows. Neither is in ``us``.

``read-once`` rows (a default row since round AN): the case's floor bytes, one buffer a rotation, read once by
the read-bound kernel (benchmarks/read_bound.py) in this run; every evenflow row carries ``vs_read_once`` = that
time / its own, a ratio to what this machine's memory gives a plain read, which does not move with the machine as
``frac_of_floor`` does (the copy ceiling does not follow the kernels' speed from machine to machine, rounds AN1 /
AN3).

FlashInfer JIT-builds its kernels on first use (minutes): every impl is built once on
a small problem first (progress printed), then reused by every case.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

from evenflow import _runtime
from evenflow.bench import harness as H
from evenflow.bench.peers import flashinfer as fi_peer
from evenflow.reference.attention import shuffled_page_tables

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import read_bound as rb  # noqa: E402  (benchmarks/read_bound.py: the read kernel of the read-once rows)

PAGE_SIZE = 64
HEAD_DIM = 128
FULL_HEADS = (64, 8)  # (q heads, kv heads) of the unsliced model
L2_ROTATE_FACTOR = 3  # rotate until one graph pass touches >= 3x L2
MAX_ROTATIONS = 16

CASES = ["64x512", "32x4K", "8x32K", "1x32K+63x512", "2x64K+30x1K", "1x128K+31x4K",
         "64x4K", "32x128+32x4K", "2x32K+30x4K", "1x64K+15x4K", "tp8:1x128K+31x4K"]
QUICK_CASES = ["8x32K", "1x32K+63x512", "1x128K+31x4K", "tp8:1x128K+31x4K"]
VARIANTS = {"bf16-kv": torch.bfloat16, "fp8-kv": torch.float8_e4m3fn, "fp8-kv-fp8-q": torch.float8_e4m3fn}
# q's dtype by variant (bf16 elsewhere): fp8-kv-fp8-q is the fp8 KV cache with an fp8 e4m3 q and its per-token-per-head
# dequant scale (DESIGN.md's q_scale, HPC-Ops' decode API); not a BENCH.md variant, so not run by default and not
# among issue 3's targets (round AO)
Q_DTYPES = {"fp8-kv-fp8-q": torch.float8_e4m3fn}
DEFAULT_VARIANTS = ["bf16-kv", "fp8-kv"]
TARGET_VARIANTS = ("bf16-kv", "fp8-kv")
# evenflow-n128: the dynamic plan with two 64-token tiles per loop iteration (block_n=128)
# at 2 programs/SM (its sm_90 build needs ~250 registers/thread); a candidate for fp8 KV
# measured beside the default (docs/perf-notes/decode.md).
# evenflow-pps3: the plan at 3 persistent programs/SM (the default until round E2, whose
# evenflow-pps2 rows made 2 the default), measured beside the default. Round N6: bf16 within
# -10..+1%; fp8 2-2.5x slower (the warp-split loop spills under its 168-register cap).
# evenflow-nopdl: the default without programmatic dependent launch (round F), so the
# launch gap it hides is measured (between the attention and combine kernels until round N;
# with the fused combine, between the kernel before the attention and the attention kernel).
# evenflow-cost1 / -cost2 (rows of rounds G-J2 files, no longer run): the plan charging 1 / 2
# tiles of work per non-empty item (round G), so bins of many short items hold fewer of them.
# evenflow-ws: each warp runs its own online softmax over its 16 tokens of every step, merged
# once per chunk (round H); -ws-n128: 8 warps over 128-token steps, 1 program/SM; -ws-pps3: at
# 3 programs/SM. The default (round H4) runs it on fp8 chunks of >= 24 tiles; -ws turns it on for
# bf16 too, -nows off for fp8. (In the H2/H3 runs the -ws rows split every chunk; since H4 they
# split chunks of >= 24 tiles only, so those rows and later ones measure different things.)
# evenflow-noprefetch: the persistent loop loads the next item's metadata after the current
# item's work, as before round I4 (the default loads it before).
# evenflow-cost0 / -cost4: no item cost / 4 units per short item (default: 2 units per item of
# at most 4 tiles, round J); evenflow-cost2all: 2 units on every item. (In round-J2 files and
# before, evenflow-cost1/2/4 charged every non-empty item.)
# evenflow-noalignup: the plan without align_longer (the budget raised to a shortest item <= 1/16
# longer than it; default since round I1, where it ran as the row evenflow-alignup).
# evenflow-over2 / -over4: 2x / 4x as many bins as resident programs (4 / 8 per SM, registers
# uncapped, so 2 per SM are resident): the hardware hands the next bin to whichever program
# slot frees up, i.e. the bins are balanced at run time as well as by the plan (round K);
# -over2c0: the same without the short-item cost. Measured in round K1: slower than the default on
# every bf16 case (0.4-16%), so not a default.
# evenflow-pps4 / -pps4s2 / -pps5s2 / -pps3-nows: the plain loop only (no warp split) at 4, 4, 5
# and 3 resident programs/SM (registers capped at 128 / 128 / 96 / 168 by the launcher), with 3,
# 2, 2 and the launcher's stages: the sm_90 build of the fp8 plain loop needs no spill at 128
# registers, so twice the warps per scheduler of the default fit (round L).
# Measured in round L1: -pps4 faster than the default on 3 fp8 cases (2x32K+30x4K +16%),
# slower on 2 (32x4K -16%) and on every bf16 case, the others below it on most cases, so not a
# default. (Round L2's -alu-v / -alu-kv rows, fp8 K or V converted by integer bit moves, were
# measured and the option withdrawn: history/round-l2.)
# evenflow-s4: the default plan with 4 pipeline stages (3 K/V buffers per program; bf16 d128 at 2
# programs/SM: 102 KB of shared memory each, both fit) instead of bf16's 3. Measured in round M4: no
# faster on any bf16 case (2x32K+30x4K -7.5%), so not a default.
# evenflow-ckernel: split items merged by a second, combine kernel (launched with PDL), the
# default until round N; the default now merges them inside the attention kernel (the last
# chunk of each group of an item to finish), with no second kernel.
# evenflow-grow150: align_items rounding the budget up to whole short items whenever that grows it by
# at most 1.5x (round E's bound, the default until round O2; now 1.25). Round O1's timeline: at 1.5,
# 2x32K+30x4K gets 184 bins of 128 tiles (90 rounded up to two 4K items) for 264 programs, so 80
# SMs run one program. (The round-o2 files' evenflow-grow125 rows measured 1.25 beside the 1.5 default.)
# knob row -> DecodePlan keyword arguments, given the GPU's SM count
PLAN_KNOBS = {
    "evenflow-n128": lambda sms: dict(block_n=128, num_programs=2 * sms, num_warps=4, num_stages=2),
    "evenflow-pps3": lambda sms: dict(num_programs=3 * sms),
    "evenflow-nopdl": lambda sms: dict(pdl=False),
    "evenflow-cost0": lambda sms: dict(item_cost=0),
    "evenflow-cost4": lambda sms: dict(item_cost=4),
    "evenflow-cost2all": lambda sms: dict(item_cost=2, item_cost_max_tiles=None),
    "evenflow-ws": lambda sms: dict(warp_split=True),
    "evenflow-ws-n128": lambda sms: dict(warp_split=True, block_n=128, num_warps=8, num_stages=2, num_programs=sms),
    "evenflow-ws-pps3": lambda sms: dict(warp_split=True, num_programs=3 * sms),
    "evenflow-nows": lambda sms: dict(warp_split=False),
    "evenflow-noalignup": lambda sms: dict(align_longer=False),
    "evenflow-noprefetch": lambda sms: dict(prefetch=False),
    "evenflow-over2": lambda sms: dict(num_programs=4 * sms, max_registers=0),
    "evenflow-over4": lambda sms: dict(num_programs=8 * sms, max_registers=0),
    "evenflow-over2c0": lambda sms: dict(num_programs=4 * sms, max_registers=0, item_cost=0),
    "evenflow-pps4": lambda sms: dict(num_programs=4 * sms, warp_split=False, num_stages=3),
    "evenflow-pps4s2": lambda sms: dict(num_programs=4 * sms, warp_split=False, num_stages=2),
    "evenflow-pps5s2": lambda sms: dict(num_programs=5 * sms, warp_split=False, num_stages=2),
    "evenflow-pps3-nows": lambda sms: dict(num_programs=3 * sms, warp_split=False),
    "evenflow-s4": lambda sms: dict(num_stages=4),
    "evenflow-ckernel": lambda sms: dict(combine="kernel"),
    "evenflow-grow150": lambda sms: dict(align_growth=1.5),
    # the plan without its KV dtype: the Triton kernel at 2 programs an SM for fp8 too (the default
    # before round AB); and the fp8 Gluon kernel's own knobs (``typed``: built with the KV dtype; those that need
    # one warp a program, as measured before round AL, pin it: 6 two-warp programs fit no SM, and at two warps the
    # output buffer (or, since round AM, the third ring slot) caps an SM whatever resident_cap says)
    "evenflow-triton": lambda sms: dict(),
    "evenflow-g-pps3": lambda sms: dict(typed=True, num_programs=3 * sms, gluon_warps=1),
    "evenflow-g-pps6": lambda sms: dict(typed=True, num_programs=6 * sms, gluon_warps=1),
    "evenflow-g-s3": lambda sms: dict(typed=True, num_stages=3, gluon_warps=1),
    "evenflow-g-ckernel": lambda sms: dict(typed=True, combine="kernel"),
    # round AC: 2 programs an SM (longer chunks: the TP8 slice); 512 programs (8x32K's budget of 64
    # tiles, so its items' cuts line up across heads and each item is one merge group of 8 chunks);
    # the default plan over an HND copy of the cache (each head's page contiguous)
    "evenflow-g-pps2": lambda sms: dict(typed=True, num_programs=2 * sms),
    # round AU: 4 programs an SM, the Gluon plan's default at every KV-head count before round AU made it 2 at one KV
    # head (two warps); at 2-4 KV heads with an fp8 q, the default before round AX
    "evenflow-g-pps4": lambda sms: dict(typed=True, num_programs=4 * sms, gluon_warps=2),
    # round AV: deeper rings for the one-KV-head plan's 2 programs an SM (4, 5, 6 slots of 16 KB: still 2 an SM; at
    # more KV heads, whose default 4 an SM these rings do not fit, the rows run 2 an SM too)
    **{f"evenflow-g2-s{n}": (lambda sms, n=n: dict(typed=True, num_stages=n, num_programs=2 * sms)) for n in (4, 5, 6)},
    "evenflow-g-np512": lambda sms: dict(typed=True, num_programs=512),
    "evenflow-g-hnd": lambda sms: dict(typed=True),
    # the fp8 plan without align_longer (round AC2's rule off: fp8 8x32K and 1x64K+15x4K get their old budgets)
    "evenflow-g-noalignup": lambda sms: dict(typed=True, align_longer=False),
    # the Gluon kernel without the next item's metadata loaded ahead (round AC6)
    "evenflow-g-noprefetch": lambda sms: dict(typed=True, prefetch=False),
    # round AE: the Gluon kernel without PDL (launched plainly, as until round AE); with PDL but reading
    # nothing before its wait (the next launch let go at once, the SM capped at the plan's programs); with
    # the early reads but without that cap (an early-launched next call may take more slots on an SM)
    "evenflow-g-nopdl": lambda sms: dict(typed=True, pdl=False),
    "evenflow-g-late": lambda sms: dict(typed=True, early_reads=False),
    "evenflow-g-nocap": lambda sms: dict(typed=True, resident_cap=False, gluon_warps=1),
    # round AE5: under PDL, program i on bin i (no stride)
    "evenflow-g-nospread": lambda sms: dict(typed=True, spread_bins=False),
    # round AF: the Triton kernel (bf16 KV; fp8 KV on a plan without its dtype) under PDL as launched until
    # round AF (waiting at its top, the next launch let go as its programs exit, bin i for program i); with
    # the next launch let go at its top and the bins strided but its first item's metadata read after the
    # wait; without the stride; without the early trigger
    "evenflow-t-wait": lambda sms: dict(launch_next=False, early_reads=False, spread_bins=False),
    "evenflow-t-late": lambda sms: dict(early_reads=False),
    "evenflow-t-nospread": lambda sms: dict(spread_bins=False),
    "evenflow-t-notrigger": lambda sms: dict(launch_next=False),
    # round AF5: the Gluon kernel at one KV head too (then an fp8 plan took it from 2 KV heads; since round AL2, at two
    # warps a program, at any count, so this row is the default's there)
    "evenflow-g-force": lambda sms: dict(typed=True, gluon=True),
    # round AG4: an fp8 plan on the Triton kernel whatever the KV heads (the tp2: / tp4: slices' A/B)
    "evenflow-t-force": lambda sms: dict(typed=True, gluon=False),
    # round AK: the default plan (typed: fp8 on the Gluon kernel from 2 KV heads) with whole short items per bin only
    # where that grows the budget by at most 1/8, or not at all (align_growth 1.125 / 1.0; the default 1.25 gives fp8
    # 2x64K+30x1K a budget of 48 for its raw 39, 106 of 528 programs without a bin), and with 4 units per short item
    "evenflow-grow112": lambda sms: dict(typed=True, align_growth=1.125),
    "evenflow-grow100": lambda sms: dict(typed=True, align_growth=1.0),
    "evenflow-g-cost4": lambda sms: dict(typed=True, item_cost=4),
    # round AZ: the default plan (typed) with align_longer raising the budget to a shortest item longer than it (or
    # that item in n equal chunks) within a growth of 1.5 / 2 instead of 17/16: Qwen3-30B-A3B's 4 KV heads at
    # 1x32K+31x2K take a budget of 32 instead of 23 (no 2K item cut, 188 of 264 bins busy); fp8 2x32K+30x4K at 8
    # KV heads 64 instead of 45 (368 of 528 busy); only 2 reaches 2x64K+30x1K's 1K items (at 1-2 KV heads); the
    # budgets each case takes: docs/perf-notes/decode.md, round AZ
    "evenflow-longer150": lambda sms: dict(typed=True, align_longer_growth=1.5),
    "evenflow-longer200": lambda sms: dict(typed=True, align_longer_growth=2.0),
    # since round AZ2 a Gluon plan at 4 programs an SM takes 2 by default: this row keeps the bound before it (17/16)
    "evenflow-longer106": lambda sms: dict(typed=True, align_longer_growth=1.0625),
    # round BA: a budget of at least 64 tiles (one 4K item): fp8 32x128+32x4K at 8 KV heads cuts no item on 272 of
    # 528 bins (the default: 36 tiles, every 4K item cut, 484 bins), 32x4K none on 256 (the default: aligned halves on
    # 512), 1x64K+15x4K 8 on 248 (the default: 128 on 496); the same with every chunk read 2 tiles ahead
    # (``deep_ring_tiles=64``: at ~2 busy programs an SM, twice the bytes in flight a program). BA1: 0.75-0.84x the
    # default's speed, the deeper reads level with it: ~2 busy programs an SM read at ~0.78 of 4's rate
    "evenflow-min64": lambda sms: dict(typed=True, min_tiles=64),
    "evenflow-min64-d64": lambda sms: dict(typed=True, min_tiles=64, deep_ring_tiles=64),
    # round BB: the plan without ``pack_short`` (the default since BB1: items padded to a multiple of a quantum so the
    # shortest sit whole in bins of a budget the alignment rules do not reach; fp8 2x64K+30x1K at 8 KV heads 42
    # tiles, two 1K items (21 units) a bin, 512 busy bins, where the rules alone take 48, three a bin, 422;
    # tp2:2x64K+30x1K and tp2: / tp4:32x128+32x4K change too by kernel; no other standard case). BB1 measured the
    # option as the row evenflow-pack against the default of then: 0.7-5.3% faster where it changes the plan
    "evenflow-nopack": lambda sms: dict(typed=True, pack_short=False),
    # round AL: the Gluon kernel at two warps a program, each taking half of every tile (the default since AL1); the
    # same at 3 ring slots at 3 programs an SM, every chunk 2 tiles ahead (in round AL beside a 16 KB output buffer,
    # since round AM with the outputs in the ring: 48 KB, padded to 64 under PDL), and forced at one KV head too; the
    # one-warp kernel of rounds AB-AK
    "evenflow-g-w2": lambda sms: dict(typed=True, gluon_warps=2),
    "evenflow-g-w1": lambda sms: dict(typed=True, gluon_warps=1),
    "evenflow-g-w1-force": lambda sms: dict(typed=True, gluon_warps=1, gluon=True),
    "evenflow-g-w2-s3": lambda sms: dict(typed=True, gluon_warps=2, num_stages=3, num_programs=3 * sms,
                                         deep_ring_tiles=0),
    # round AM: the default of rounds AL-AM1 (two warps beside 2 ring slots and a 16 KB output buffer); two warps
    # beside 3 ring slots at 4 programs an SM (their outputs meet in K's idle slots 0-1), every chunk 2 tiles ahead
    # (AM1); chunks of at most 8 / 16 tiles 2 tiles ahead, longer ones 1 (AM2; 16: the default since AM2). On a bf16
    # cache (no Gluon kernel) these rows are the default plan (``deep_ring_tiles`` dropped, as ``merge_chunks`` below).
    # At one KV head those without num_programs take that count's default: 2 an SM since round AU
    "evenflow-g-w2-s2": lambda sms: dict(typed=True, gluon_warps=2, num_stages=2),
    "evenflow-g-w2-s3-pps4": lambda sms: dict(typed=True, gluon_warps=2, num_stages=3, deep_ring_tiles=0,
                                              num_programs=4 * sms),
    "evenflow-g-w2-s3-d8": lambda sms: dict(typed=True, gluon_warps=2, num_stages=3, deep_ring_tiles=8),
    "evenflow-g-w2-s3-d16": lambda sms: dict(typed=True, gluon_warps=2, num_stages=3, deep_ring_tiles=16),
    "evenflow-g-w2-force": lambda sms: dict(typed=True, gluon_warps=2, gluon=True),
    # round AQ: no work units for short items (fp8 32x128+32x4K: budget 32, every 4K item cut in two halves that line
    # up, all 528 programs busy, where the default's units round the budget to 36: 484 bins, items in up to 3 chunks);
    # 16 programs more than the SMs hold at 4 an SM (544 on an H200's 132: the budget of 32 with the units)
    "evenflow-g-cost0": lambda sms: dict(typed=True, item_cost=0),
    "evenflow-g-np544": lambda sms: dict(typed=True, num_programs=4 * sms + 16),
    # round AR: the warpgroup form (``gluon_warps=4``): an fp8 q's scores on wgmma, a warp's softmax over 16 tokens of
    # each tile; the plan's bins as the default's at 8 KV heads (4 programs an SM, 3 ring slots; at one KV head 2 since
    # round AV, where it is the default plan since round AW; at 2-4 KV heads 2 since round AX, the default there with
    # a told fp8 q). Calls it does not take (a bf16 q) run the two-warp form on those bins, so on the other variants
    # this row is the default plan at 1 and 8 KV heads, and two warps at 2 an SM at 2-4 (the default: 4 an SM)
    "evenflow-g-wg": lambda sms: dict(typed=True, gluon_warps=4),
    # round AX: the same at 4 programs an SM (the count evenflow-g-wg ran at 2-8 KV heads before round AX made a
    # four-warp plan's default 2 an SM at up to 4 KV heads)
    "evenflow-g-wg-pps4": lambda sms: dict(typed=True, gluon_warps=4, num_programs=4 * sms),
    # round AX3: two warps at 3 and 2 programs an SM (at 2-4 KV heads, between the default's 4 and the 2 that gained
    # on the short mixes and lost on the long ones, AX1), and the warpgroup form at 3 (capped at 168 registers)
    "evenflow-g-w2-pps3": lambda sms: dict(typed=True, gluon_warps=2, num_programs=3 * sms),
    "evenflow-g-w2-pps2": lambda sms: dict(typed=True, gluon_warps=2, num_programs=2 * sms),
    "evenflow-g-wg-pps3": lambda sms: dict(typed=True, gluon_warps=4, num_programs=3 * sms),
    # (Since round AS every two-warp row above with 3 or more ring slots merges 12 chunks a round trip, the default's
    # batch, where it ran 8 when it was measured: the rows compare one knob against today's default.)
    # round AR: the fused merge reading 12 chunks a round trip, in groups of 12 (the two-warp default since round AS,
    # 8 in the warpgroup form), at two warps and in the warpgroup form; round AS: 8 at two warps (rounds AB-AR)
    "evenflow-g-mb12": lambda sms: dict(typed=True, merge_chunks=12),
    "evenflow-g-wg-mb12": lambda sms: dict(typed=True, gluon_warps=4, merge_chunks=12),
    # round AV: the warpgroup form at 2 programs an SM (its fp8-q calls: 4 warps a program, each with half the two-warp
    # form's chain a tile), the one-KV-head count of the two-warp default
    "evenflow-g-wg-pps2": lambda sms: dict(typed=True, gluon_warps=4, num_programs=2 * sms),
    # round AW: the same with the 12-chunk merge (the two-warp default's batch on 3 ring slots). Since round AW the
    # default at one KV head is four warps (fp8-q calls in the warpgroup form, 2 an SM, its 8-chunk merge): the
    # evenflow-g-wg-pps2 row's program there; evenflow-g-w2 (gluon_warps=2) is the two-warp default before it. Rows
    # above that leave gluon_warps unset take four warps at one KV head now where they ran two when measured.
    "evenflow-g-wg-pps2-mb12": lambda sms: dict(typed=True, gluon_warps=4, num_programs=2 * sms, merge_chunks=12),
    # four warps a program on mma.sync for every call (bf16 q and fp8 q, exact products), 2 an SM, the 12-chunk merge
    "evenflow-g-mma4-pps2": lambda sms: dict(typed=True, gluon_warps=4, warpgroup_mma=False, num_programs=2 * sms,
                                             merge_chunks=12),
    # (at one KV head, since round AW a four-warp plan, and at 2-4 with a told fp8 q since round AX: merge_chunks
    # there sets the warpgroup form's batch too, so
    # evenflow-g-mb8's fp8-q calls are the default's and evenflow-g-mb12 is evenflow-g-wg-pps2-mb12)
    "evenflow-g-mb8": lambda sms: dict(typed=True, merge_chunks=8),
}
# knob rows that run on an HND copy of the cache ([pages, Hkv, page, D] in memory, viewed as NHD)
HND_IMPLS = {"evenflow-g-hnd"}
# knob rows that run the default plan with module switches of evenflow.attention.decode set around their calls (so
# around the CUDA graph's capture too): evenflow-twopassmerge (the Triton kernel's fused merge steps in two passes,
# the default until round BQ: decode.MERGE_ONE_PASS off; the fp8 Gluon kernel's calls run as the default's)
MODULE_KNOBS = {"evenflow-twopassmerge": {"MERGE_ONE_PASS": False}}
EVENFLOW_IMPLS = ["evenflow", "evenflow-static", *PLAN_KNOBS, *MODULE_KNOBS]
# read-once: the case's floor bytes (as many copies as its rotations) read once by the read-bound kernel
# (benchmarks/read_bound.py, its 16 KB and 64 KB block shapes, launched as the attention kernels are), in this run:
# the machine's own read rate beside the kernels. Every evenflow row then carries ``vs_read_once`` (that read's time
# over the row's: 1.0 = as fast as the plain read). Why: the memory-bound kernels' speed differs by ~5% between the
# machines a run lands on while the copy ceiling does not follow (rounds AN1 / AN3), so `frac_of_floor` moves with
# the machine and this ratio should not.
READ_IMPL = "read-once"
READ_SHAPES = tuple(sh for sh in rb.SHAPES if sh[0] in ("block16k", "block64k"))
IMPLS = EVENFLOW_IMPLS + list(fi_peer.DECODE_IMPLS) + [READ_IMPL]
# The rows of record (issue 3 / BENCH.md) and the read-once reference; the knob rows above run when named in --impls.
DEFAULT_IMPLS = ["evenflow", "evenflow-static"] + list(fi_peer.DECODE_IMPLS) + [READ_IMPL]
# Issue 3's named mixed cases where bf16 must beat the best FlashInfer by >= 2.5x.
BF16_2P5X_CASES = {"1x32K+63x512", "2x64K+30x1K", "1x128K+31x4K", "2x32K+30x4K"}


# ----------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def mixed(self) -> bool:
        return len(set(self.lengths)) > 1


_PART = re.compile(r"^(\d+)x(\d+)([kK]?)$")


def parse_case(name: str) -> Case:
    """``"1x128K+31x4K"`` -> lengths (131072, 4096 x 31), 64/8 heads; ``"tp8:..."`` -> 8/1 heads."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"case must be a non-empty string, got {name!r}")
    body, hq, hkv = name, *FULL_HEADS
    if ":" in name:
        prefix, body = name.split(":", 1)
        m = re.fullmatch(r"tp(\d+)", prefix)
        tp = int(m.group(1)) if m else 0
        if not m or tp < 1 or hkv % tp:
            raise ValueError(f"case {name!r}: prefix must be tpN with N dividing {hkv}, got {prefix!r}")
        hq, hkv = hq // tp, hkv // tp
    lengths: list[int] = []
    for part in body.split("+"):
        m = _PART.match(part.strip())
        if not m:
            raise ValueError(f"case {name!r}: part {part!r} is not AxB (A requests of B tokens, B may end in K)")
        count, tokens = int(m.group(1)), int(m.group(2)) * (1024 if m.group(3) else 1)
        if count < 1 or tokens < 1:
            raise ValueError(f"case {name!r}: part {part!r} needs at least one request of at least one token")
        lengths += [tokens] * count
    return Case(name, tuple(lengths), hq, hkv)


def floor_bytes(case: Case, kv_dtype: torch.dtype, head_dim: int = HEAD_DIM,
                q_dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a decode step must move: K and V of every live token once, q read (and an fp8 q's fp32 scale per token
    and head), o written.

    Live tokens, not whole pages (a partly filled last page is not charged in full); the page table (its used
    entries, 4 bytes a page: 1/65,536 of a bf16 page's K and V bytes at 8 KV heads, 1/8,192 at one) and the
    per-tensor K / V scales are left out.
    """
    kv = 2 * case.tokens * case.num_kv_heads * head_dim * kv_dtype.itemsize
    qo = case.batch * case.num_q_heads * head_dim * (q_dtype.itemsize + out_dtype.itemsize)
    q_scales = case.batch * case.num_q_heads * 4 if q_dtype == torch.float8_e4m3fn else 0
    return kv + qo + q_scales


def rotations_for(bytes_per_copy: int, l2_bytes: int, factor: int = L2_ROTATE_FACTOR,
                  max_rotations: int = MAX_ROTATIONS) -> int:
    """Input copies so that one pass over them touches >= ``factor`` x L2 (1 when one copy does)."""
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be positive, got {bytes_per_copy}")
    return max(1, min(max_rotations, math.ceil(factor * l2_bytes / bytes_per_copy)))


# ----------------------------------------------------------------------------- inputs & reference

@dataclass
class Inputs:
    case: Case
    kv_dtype: torch.dtype
    qs: list  # [rotations] of [B, Hq, D] bf16, or fp8 e4m3 with q_scales
    page_tables: list  # [rotations] of [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    k_cache: torch.Tensor  # [pool_pages, P, Hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # one-element fp32 (fp8 KV only)
    v_scale: torch.Tensor | None
    sm_scale: float
    q_scales: list | None = None  # [rotations] of [B, Hq] fp32 (fp8 q only)

    @property
    def rotations(self) -> int:
        return len(self.qs)


def _random_cache(pages: int, hkv: int, dtype: torch.dtype, device, gen) -> torch.Tensor:
    cache = torch.empty(pages, PAGE_SIZE, hkv, HEAD_DIM, dtype=dtype, device=device)
    chunk = 1024
    for p0 in range(0, pages, chunk):
        x = torch.randn(min(chunk, pages - p0), PAGE_SIZE, hkv, HEAD_DIM, generator=gen, device=device,
                        dtype=torch.float32)
        # fp8: N(0, 2^2) uses most of e4m3's range without saturating; the scales bring it back.
        cache[p0:p0 + chunk] = (x * 2).to(dtype) if dtype == torch.float8_e4m3fn else x.to(dtype)
    return cache


def make_inputs(case: Case, kv_dtype: torch.dtype, device, seed: int, l2_bytes: int,
                q_dtype: torch.dtype = torch.bfloat16) -> Inputs:
    """Random inputs of ``case``, ``rotations_for`` copies of q and the page tables; an fp8 ``q_dtype`` quantises
    each (token, head) row of the same random q by its max |q| / 448 (the row's scale in ``q_scales``)."""
    if q_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"q_dtype must be bfloat16 or float8_e4m3fn, got {q_dtype}")
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    rot = rotations_for(floor_bytes(case, kv_dtype, q_dtype=q_dtype), l2_bytes)
    tables, pool = shuffled_page_tables(case.lengths, PAGE_SIZE, rot, cpu_gen)
    k = _random_cache(pool, case.num_kv_heads, kv_dtype, device, gen)
    v = _random_cache(pool, case.num_kv_heads, kv_dtype, device, gen)
    q32 = [torch.randn(case.batch, case.num_q_heads, HEAD_DIM, generator=gen, device=device,
                       dtype=torch.float32) for _ in range(rot)]
    q_scales = None
    if q_dtype == torch.float8_e4m3fn:
        q_scales = [q.abs().amax(-1).clamp_min(1e-12) / 448.0 for q in q32]
        qs = [(q / s[..., None]).to(q_dtype) for q, s in zip(q32, q_scales)]
    else:
        qs = [q.to(torch.bfloat16) for q in q32]
    ks = vs = None
    if kv_dtype == torch.float8_e4m3fn:
        s = 0.25 + 0.5 * torch.rand(2, generator=cpu_gen)
        ks = s[:1].to(device=device, dtype=torch.float32)
        vs = s[1:].to(device=device, dtype=torch.float32)
    return Inputs(case, kv_dtype, qs, [t.to(device) for t in tables.unbind(0)],
                  torch.tensor(case.lengths, dtype=torch.int32, device=device), k, v, ks, vs,
                  1.0 / math.sqrt(HEAD_DIM), q_scales)


def q_scale_of(inp: Inputs, r: int):
    """Rotation ``r``'s q scales (None for a bf16 q)."""
    return inp.q_scales[r] if inp.q_scales is not None else None


def reference_decode(q, k_cache, v_cache, page_table, seq_lens, *, sm_scale: float, k_scale=None,
                     v_scale=None, q_scale=None) -> torch.Tensor:
    """Plain fp32 decode attention over a paged cache, one request at a time: ``[B, Hq, D]`` fp32.

    Deliberately simple (gather the request's pages, softmax(q K^T * scale) V); the
    benchmark's sanity check, not the operator's test oracle. It runs on the GPU at
    real sizes; ``evenflow.reference.attention.decode_attention_ref`` (fp64 on the
    host, a loop per head) is the oracle and would take minutes per case here.
    ``tests/test_bench_decode.py`` checks the two agree.
    """
    B, hq, d = q.shape
    P, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    ks = float(k_scale) if k_scale is not None else 1.0
    vs = float(v_scale) if v_scale is not None else 1.0
    out = torch.zeros(B, hq, d, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()

    def gather(cache, pages, n):
        if cache.dtype == torch.float8_e4m3fn:  # index through bytes: fp8 indexing is not on every backend
            rows = cache.view(torch.uint8)[pages].view(torch.float8_e4m3fn)
        else:
            rows = cache[pages]
        return rows.reshape(-1, hkv, d)[:n].float()

    for b, n in enumerate(lens):
        if n == 0:
            continue
        pages = page_table[b, :(n + P - 1) // P].long()
        kk, vv = gather(k_cache, pages, n) * ks, gather(v_cache, pages, n) * vs
        qb = q[b].float() * (q_scale[b][:, None] if q_scale is not None else 1.0)
        qb = qb.view(hkv, g, d)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", qb, kk) * sm_scale, dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, vv).reshape(hq, d)
    return out


# ----------------------------------------------------------------------------- impls

def as_hnd(cache: torch.Tensor) -> torch.Tensor:
    """The same [pages, page, Hkv, D] values with each head's page contiguous in memory (a strided
    view of an HND copy), as an engine with an HND cache passes it."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


# plan keywords of the Gluon fp8 kernel alone, which a plan for another kernel refuses: a knob row drops them for a
# bf16 cache
GLUON_ONLY_KNOBS = ("deep_ring_tiles", "merge_chunks", "warpgroup_mma")


def knob_inputs(impl: str, inp: Inputs) -> Inputs:
    """``inp`` as the knob row ``impl`` runs it: over an HND copy of the caches for ``HND_IMPLS``."""
    if impl in HND_IMPLS:
        return dataclasses.replace(inp, k_cache=as_hnd(inp.k_cache), v_cache=as_hnd(inp.v_cache))
    return inp


def evenflow_plan(impl: str, inp: Inputs):
    """The DecodePlan of ``evenflow`` (built with the cache's and q's dtypes, so fp8 runs the Gluon kernel where the
    call is in its scope: with a bf16 q, or an fp8 q where ``decode.GLUON_FP8_Q``) or one of its knob rows
    (``PLAN_KNOBS``; ``typed`` ones get the dtype too), updated for ``inp``'s lengths; None for
    ``evenflow-static``."""
    from evenflow import DecodePlan

    if impl == "evenflow-static":
        return None
    c = inp.case
    from evenflow._runtime import num_sms

    knobs = PLAN_KNOBS[impl](num_sms(inp.seq_lens.device)) if impl in PLAN_KNOBS else {"typed": True}
    if knobs.pop("typed", False):
        # as an engine that knows its cache's and its q's dtypes builds it (the q dtype since round AX: at 2-4 KV heads
        # a plan told an fp8 q takes four warps at 2 programs an SM, so there typed rows that leave gluon_warps unset
        # run the warpgroup form where, measured before round AX, they ran two warps)
        knobs["kv_dtype"] = inp.kv_dtype
        knobs["q_dtype"] = inp.qs[0].dtype
    if knobs.get("kv_dtype") != torch.float8_e4m3fn:
        for gluon_only in GLUON_ONLY_KNOBS:  # the Gluon fp8 kernel's knobs: refused elsewhere
            knobs.pop(gluon_only, None)
    return DecodePlan(c.batch, inp.page_tables[0].shape[1] * PAGE_SIZE, c.num_kv_heads, page_size=PAGE_SIZE,
                      q_len=1, device=inp.seq_lens.device, **knobs).update(inp.seq_lens)


def evenflow_calls(inp: Inputs, plan, switches: dict | None = None) -> list:
    """One ``decode_attention`` call per rotated input copy (``plan`` None: the static split), each with the module
    switches ``switches`` (a ``MODULE_KNOBS`` row's) set around it."""
    from evenflow import decode_attention

    c = inp.case
    out = torch.empty(c.batch, c.num_q_heads, HEAD_DIM, dtype=torch.bfloat16, device=inp.seq_lens.device)

    def bind(r):
        q, qs, pt = inp.qs[r], q_scale_of(inp, r), inp.page_tables[r]
        return lambda: decode_attention(q, inp.k_cache, inp.v_cache, pt, inp.seq_lens, plan=plan, q_scale=qs,
                                        k_scale=inp.k_scale, v_scale=inp.v_scale, sm_scale=inp.sm_scale,
                                        out=out)

    from evenflow.attention import decode

    return H.switched(decode, switches, [bind(r) for r in range(inp.rotations)])


def _evenflow_fns(impl: str, inp: Inputs):
    """(fns, extra) for ``evenflow`` and its knob rows (``PLAN_KNOBS``: dynamic plan) or ``evenflow-static``."""
    try:
        import evenflow
        from evenflow import DecodePlan, decode_attention  # noqa: F401 (the API the helpers call)
    except ImportError as e:
        raise H.PeerUnavailable(f"evenflow decode attention not available: {e}") from e
    extra: dict = {}
    inp = knob_inputs(impl, inp)
    plan = evenflow_plan(impl, inp)
    validate = getattr(evenflow, "validate_inputs", None)  # the launcher's debug check (syncs; set-up only)
    if validate is not None:
        for r in range(inp.rotations):
            validate(inp.qs[r], inp.k_cache, inp.v_cache, inp.page_tables[r], inp.seq_lens, plan=plan,
                     q_scale=q_scale_of(inp, r))
    extra["kernel"] = kernel_of(inp, plan)
    if plan is not None:
        extra["plan_us"] = H.time_graph([lambda: plan.update(inp.seq_lens)])
        extra["plan_eager_us"] = H.time_eager([lambda: plan.update(inp.seq_lens)])
    return evenflow_calls(inp, plan, MODULE_KNOBS.get(impl)), extra


def kernel_of(inp: Inputs, plan) -> str:
    """Which attention kernel an evenflow row's calls run: ``gluon`` (the fp8 Gluon kernel), ``gluon-wg`` (its
    warpgroup form: an fp8 q on a four-warp plan, sm_90; the default at one KV head since round AW), ``triton`` (the
    plan's Triton kernel) or ``static`` (no plan)."""
    from evenflow.attention.decode import gluon_call_form, gluon_fp8_supported

    if plan is None:
        return "static"
    rows = inp.case.num_q_heads // inp.case.num_kv_heads
    if not gluon_fp8_supported(inp.qs[0], inp.k_cache, plan, rows):
        return "triton"
    warps = gluon_call_form(plan, inp.qs[0], rows)[0]
    return "gluon-wg" if warps == 4 and plan.warpgroup_mma else "gluon"


FI_FP8_Q = ("not run: this benchmark drives FlashInfer's decode with a bf16 q only (an fp8 q with a scale per token "
            "and head is not passed to it)")


def _flashinfer_fns(impl: str, inp: Inputs):
    c = inp.case
    if inp.q_scales is not None:
        raise H.PeerUnavailable(FI_FP8_Q)
    fns, extra = [], {}
    for r in range(inp.rotations):
        w = fi_peer.FlashInferDecode(impl, inp.page_tables[r], inp.seq_lens, num_q_heads=c.num_q_heads,
                                     num_kv_heads=c.num_kv_heads, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                                     q_dtype=torch.bfloat16, kv_dtype=inp.kv_dtype,
                                     out_dtype=torch.bfloat16, sm_scale=inp.sm_scale)
        if r == 0:
            extra["plan_host_us"] = w.plan_host_us()
            extra["resolved_backend"] = str(w.resolved_backend)
        fns.append(w.runner(inp.qs[r], inp.k_cache, inp.v_cache, k_scale=inp.k_scale, v_scale=inp.v_scale))
    return fns, extra


def measure_read_once(nbytes: int, copies: int, device) -> dict:
    """The read-once row's fields: µs of the fastest READ_SHAPES read of ``copies`` buffers of ``nbytes`` each (graph
    replay, one read a copy, as the case's rotations), launched with PDL where the GPU has it (the attention kernels'
    launch), and which read that was."""
    bufs = rb.buffers(nbytes, copies, device)
    us, how = rb.fastest_read([[b] for b in bufs], READ_SHAPES, _runtime.num_sms(device), _read_pdls(device))
    return {"us": us, "read": how}


def _read_pdls(device) -> tuple[bool, ...]:
    return (True,) if _runtime.pdl_supported(device) else (False,)


def build_fns(impl: str, inp: Inputs):
    return _evenflow_fns(impl, inp) if impl in EVENFLOW_IMPLS else _flashinfer_fns(impl, inp)


def _reason(e: BaseException) -> str:
    if isinstance(e, H.PeerUnavailable):
        return str(e)
    return f"{type(e).__name__}: {H.error_line(e)}"


def measure(impl: str, inp: Inputs, refs: list) -> dict:
    """Build, check every rotation against its reference, time; a dict of row fields."""
    fns, extra = build_fns(impl, inp)
    worst = None
    for r, fn in enumerate(fns):
        chk = H.check_output(fn(), refs[r], f"{inp.case.name} {impl} rotation {r}")
        if worst is None or chk["max_abs_err"] > worst["max_abs_err"]:
            worst = chk
    torch.cuda.synchronize()
    us = H.time_graph(fns)
    eager_us = H.time_eager(fns)
    return {"us": us, "eager_us": eager_us, **extra, **(worst or {})}


def warm_up(impls, variants, device, seed: int) -> dict:
    """Build (JIT-compile) and check every FlashInfer impl once per KV dtype; {(impl, variant): error}."""
    failed: dict = {}
    case = Case("warm-up 2x(100,700)", (100, 700), *FULL_HEADS)
    peers = [(i, v) for v in variants for i in impls if i not in EVENFLOW_IMPLS and i != READ_IMPL]
    failed.update({t: FI_FP8_Q for t in peers if q_dtype_of(t[1]) != torch.bfloat16})  # nothing to build for these
    todo = [t for t in peers if t not in failed]
    for impl, variant in H.progress(todo, "decode warm-up (FlashInfer JIT build)"):
        t0 = time.time()
        try:
            inp = make_inputs(case, VARIANTS[variant], device, seed, l2_bytes=0, q_dtype=q_dtype_of(variant))
            ref = reference_decode(inp.qs[0], inp.k_cache, inp.v_cache, inp.page_tables[0], inp.seq_lens,
                                   sm_scale=inp.sm_scale, k_scale=inp.k_scale, v_scale=inp.v_scale,
                                   q_scale=q_scale_of(inp, 0))
            fns, _ = build_fns(impl, inp)
            H.check_output(fns[0](), ref, f"warm-up {impl} {variant}")
            print(f"    built {impl} {variant} in {time.time() - t0:.0f}s", flush=True)
        except Exception as e:  # a peer that fails to build is a row, not a crash
            failed[(impl, variant)] = _reason(e)
            print(f"    {impl} {variant} unavailable ({time.time() - t0:.0f}s): {failed[(impl, variant)]}",
                  flush=True)
    return failed


# ----------------------------------------------------------------------------- main

def _add_args(p) -> None:
    p.add_argument("--cases", default=None,
                   help="comma-separated cases: BENCH.md's, tpN: slices of them, or any mix like tp2:1x32K+31x2K "
                        "(default: BENCH.md's, or --quick's)")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {list(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rescore", default=None, metavar="JSON",
                   help="no run: the table and issue 3's targets of a results file (e.g. decode.json), each "
                        "with the read-once row's floor fraction and each ratio target with the one it needs "
                        "(CPU only)")
    p.add_argument("--triton-fp8-q", action="store_true",
                   help="run fp8 q on the Triton kernel (decode.GLUON_FP8_Q off for this process): the fp8-kv-fp8-q "
                        "variant's evenflow rows then run it on the plan sized for the Gluon kernel (capped, two "
                        "rounds an SM, one warning); evenflow-t-force rows run it on its own plan. By default those "
                        "evenflow rows run the Gluon fp8 kernel where a call is in its scope")


def q_dtype_of(variant: str) -> torch.dtype:
    return Q_DTYPES.get(variant, torch.bfloat16)


def _split(arg: str, allowed, what: str) -> list[str]:
    items = [s.strip() for s in arg.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: unknown {bad or 'empty list'}; choose from {list(allowed)}")
    return items


def case_names(arg: str) -> list[str]:
    """``--cases``: the cases of BENCH.md (``CASES``), the TP8 / TP4 / TP2 slice of any of them (``tp8:64x4K``: 8 q /
    1 kv heads; ``tp4:`` 16 / 2, ``tp2:`` 32 / 4), or any other mix ``parse_case`` reads (``tp2:1x32K+31x2K``:
    Qwen3-30B-A3B's 4 KV heads); a name it refuses exits naming it and why."""
    names = [s.strip() for s in arg.split(",") if s.strip()]
    if not names:
        raise SystemExit(f"--cases: empty list; the standard cases are {CASES}")
    for n in names:
        try:
            parse_case(n)
        except ValueError as e:
            raise SystemExit(f"--cases: {e} (the standard cases: {CASES})") from None
    return names


def read_once_frac(ours: dict) -> dict:
    """``read_once_frac_of_floor`` of one evenflow row: the same run's read-once row's ``frac_of_floor`` (the case's
    floor bytes read once by the read kernel: what a kernel that reads each byte once can expect), from the row's
    own fraction and ``vs_read_once``; empty where the row lacks either."""
    frac, ro = ours.get("frac_of_floor"), ours.get("vs_read_once")
    if isinstance(frac, (int, float)) and isinstance(ro, (int, float)) and ro > 0:
        return {"read_once_frac_of_floor": round(frac / ro, 4)}
    return {}


def ratio_reach(ours: dict, ratio: float) -> dict:
    """What a ``ratio``-times-the-best-peer target asks of the floor: the peer's time over ``ratio`` is a
    ``frac_of_floor`` of ``ratio`` x the peer's own (``needs_frac_of_floor``), beside :func:`read_once_frac`. A need
    above the read-once fraction cannot be met by reading faster; only a peer that slows down would meet it."""
    frac, x = ours.get("frac_of_floor"), ours.get("speedup_vs_best_peer")
    need = ({"needs_frac_of_floor": round(ratio * frac / x, 4)}
            if isinstance(frac, (int, float)) and isinstance(x, (int, float)) and x > 0 else {})
    return {**need, **read_once_frac(ours)}


def print_targets(targets: list[dict]) -> None:
    """issue 3's target count, then each missed target with its value, the read-once row's fraction and, for a
    ratio target, the fraction of the floor it asks."""
    def detail(t: dict) -> str:
        ro = t.get("read_once_frac_of_floor")
        if "needs_frac_of_floor" in t:
            return (f" (needs {t['needs_frac_of_floor']:.3f} of the floor"
                    + (f"; read-once reads at {ro:.3f})" if ro is not None else ")"))
        return f" (read-once reads at {ro:.3f})" if ro is not None else ""

    H.report_targets("issue 3", targets, detail)


def rescore(path: str, flag: str = "--rescore") -> tuple[str, list[dict]]:
    """:func:`rescore_rows` of a results file: a recorded run's table and targets, re-derived without a GPU;
    ``SystemExit`` naming ``flag`` where the file is not a decode results file."""
    return H.rescore_file(path, rescore_rows, "a decode", flag)


def rescore_rows(rows: list[dict]) -> tuple[str, list[dict]]:
    """``summarize`` over a run's rows (cases and variants as the rows hold them, in their order); ``ValueError``
    where a case is not one :func:`parse_case` reads (rows that are not decode's)."""
    names = list(dict.fromkeys(r["case"] for r in rows if "case" in r))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r.get("variant")))
    return summarize(rows, [parse_case(n) for n in names], variants)


def summarize(rows: list[dict], cases: list[Case], variants: list[str]) -> tuple[str, list[dict]]:
    """Markdown table of evenflow vs static vs best FlashInfer per case, and issue 3's target checks."""
    by = {(r["case"], r.get("variant"), r["impl"]): r for r in rows}
    lines = ["| case | variant | evenflow µs | frac_of_floor | vs read-once | static µs | best FlashInfer | µs | "
             "x vs best peer | x vs static | plan µs |", "|" + "---|" * 11]
    targets: list[dict] = []
    target = functools.partial(H.target, targets)
    for v in variants:
        for c in cases:
            ours = by.get((c.name, v, "evenflow"), {})
            static = by.get((c.name, v, "evenflow-static"), {})
            peers = [by[(c.name, v, i)] for i in fi_peer.DECODE_IMPLS if "us" in by.get((c.name, v, i), {})]
            best = min(peers, key=lambda r: r["us"]) if peers else {}

            def f(x, fmt="{:.1f}"):
                return fmt.format(x) if isinstance(x, (int, float)) else "-"
            lines.append(f"| {c.name} | {v} | {f(ours.get('us'))} | {f(ours.get('frac_of_floor'), '{:.2f}')} | "
                         f"{f(ours.get('vs_read_once'), '{:.2f}')} | {f(static.get('us'))} | "
                         f"{best.get('impl', '-')} | {f(best.get('us'))} | "
                         f"{f(ours.get('speedup_vs_best_peer'), '{:.2f}')} | "
                         f"{f(ours.get('speedup_vs_static'), '{:.2f}')} | {f(ours.get('plan_us'), '{:.2f}')} |")
            if v not in TARGET_VARIANTS:  # issue 3's targets are for bf16 q over bf16 and fp8 KV
                continue
            if "us" not in ours:
                target(f"{c.name} {v}: evenflow ran", False, ours.get("error", "not run"), "ran")
                continue
            need = 0.85 if c.tokens >= 128 * 1024 else 0.75
            target(f"{c.name} {v}: frac_of_floor >= {need}", ours["frac_of_floor"] >= need, ours["frac_of_floor"],
                   "frac_of_floor >= 0.85 (>= 128K tokens) / 0.75", **read_once_frac(ours))
            if best:
                x = ours["speedup_vs_best_peer"]
                target(f"{c.name} {v}: not slower than {best['impl']}", x >= 1.0, x,
                       "not slower than the fastest FlashInfer path")
                if (v == "bf16-kv" and c.name in BF16_2P5X_CASES) or (v == "fp8-kv" and c.mixed):
                    target(f"{c.name} {v}: >= 2.5x {best['impl']}", x >= 2.5, x,
                           ">= 2.5x the fastest FlashInfer path (bf16 long-tail mixes, fp8 mixed)",
                           **ratio_reach(ours, 2.5))
            if c.name == "1x128K+31x4K" and "speedup_vs_static" in ours:
                target(f"{c.name} {v}: >= 2x evenflow-static", ours["speedup_vs_static"] >= 2.0,
                       ours["speedup_vs_static"], ">= 2x evenflow-static on 1x128K+31x4K")
    return "\n".join(lines), targets


def main(argv=None) -> None:
    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_add_args)
    if args.rescore:
        table, targets = rescore(args.rescore)
        print("## evenflow vs FlashInfer vs static\n\n" + table)
        print_targets(targets)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode.py times on a CUDA GPU; on a CPU there is nothing to measure")
    device = torch.device("cuda")
    sweep(args, device, int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20)))


def sweep(args, device, l2: int) -> None:
    t_start = time.time()
    names = case_names(args.cases) if args.cases else (QUICK_CASES if args.quick else CASES)
    cases = [parse_case(n) for n in names]
    impls = _split(args.impls, IMPLS, "impls")
    variants = _split(args.variants, VARIANTS, "variants")
    from evenflow.attention import decode as decode_launcher

    if getattr(args, "triton_fp8_q", False):
        decode_launcher.GLUON_FP8_Q = False  # for this process: the run's rows say which kernel ran (``kernel``)

    ceil = H.measure_ceilings()
    meta = {"heads": "64 q / 8 kv (tpN: 64 / N q, 8 / N kv)", "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
            "q_dtype": "bf16 (fp8-kv-fp8-q: fp8 e4m3, an fp32 scale per token and head)", "out_dtype": "bf16",
            "flashinfer": fi_peer.version() or "not installed",
            "us": "CUDA-graph replay, median per call", "eager_us": "eager, L2 flushed, median",
            "gluon_fp8_q": bool(decode_launcher.GLUON_FP8_Q),
            "floor": "(2 * live tokens * Hkv * D * kv bytes + B * Hq * D * (q bytes + 2) [+ B * Hq * 4 for an fp8 "
                     "q's scales]) / copy_TBps"}
    res = H.Results("decode", ceilings=ceil, out=args.out, meta=meta)

    failed = warm_up(impls, variants, device, args.seed)
    meta["peer_build_failures"] = {f"{i} {v}": e for (i, v), e in failed.items()}
    if READ_IMPL in impls:
        try:  # every read shape sums a buffer exactly before it is timed; a failure makes error rows, as a peer's
            rb.check_read(_runtime.num_sms(device), device, _read_pdls(device), READ_SHAPES)
        except Exception as e:
            failed.update({(READ_IMPL, v): f"read check: {_reason(e)}" for v in variants})
        meta[READ_IMPL] = ("the case's floor bytes read once (int32 loads summed in registers; the faster of "
                           + ", ".join(sh[0] for sh in READ_SHAPES) + ", launched with PDL where there is PDL), "
                           "graph replay cycling its rotations; vs_read_once = that time / the row's")

    work = {f"{c.name} {v}": (c, v) for v in variants for c in cases}
    for label in H.progress(list(work), "decode"):
        c, v = work[label]
        kv_dtype, q_dtype = VARIANTS[v], q_dtype_of(v)
        try:
            inp = make_inputs(c, kv_dtype, device, args.seed, l2, q_dtype=q_dtype)
            refs = [reference_decode(inp.qs[r], inp.k_cache, inp.v_cache, inp.page_tables[r], inp.seq_lens,
                                     sm_scale=inp.sm_scale, k_scale=inp.k_scale, v_scale=inp.v_scale,
                                     q_scale=q_scale_of(inp, r))
                    for r in range(inp.rotations)]
        except Exception as e:
            for impl in impls:
                res.add_error(case=c.name, variant=v, impl=impl, error=f"inputs: {_reason(e)}")
            continue
        fb = floor_bytes(c, kv_dtype, q_dtype=q_dtype)
        fl = H.floor_us(bytes_moved=fb, ceilings=ceil)
        common = {"batch": c.batch, "tokens": c.tokens, "q_heads": c.num_q_heads, "kv_heads": c.num_kv_heads,
                  "rotations": inp.rotations, "floor_bytes": fb}
        got: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for impl in impls:
            if (impl, v) in failed:
                why = failed[(impl, v)]
                errors[impl] = why if why.startswith("not run") else f"build failed: {why}"
                continue
            try:
                got[impl] = (measure_read_once(fb, inp.rotations, device) if impl == READ_IMPL
                             else measure(impl, inp, refs))
                print(f"    {impl:16s} {got[impl]['us']:9.2f} us  ({fl / got[impl]['us']:.2f} of floor)", flush=True)
                torch.cuda.synchronize()
            except Exception as e:  # incl. a CUDA fault: later cases then fail fast, results still written
                errors[impl] = _reason(e)
        peer_us = {i: m["us"] for i, m in got.items() if i in fi_peer.DECODE_IMPLS}
        best_peer = min(peer_us, key=peer_us.get) if peer_us else None
        for impl in impls:  # rows in impl order, errors included
            if impl in errors:
                res.add_error(case=c.name, variant=v, impl=impl, error=errors[impl], **common)
                continue
            extra = dict(got[impl])
            us = extra.pop("us")
            if impl in EVENFLOW_IMPLS and best_peer:
                extra["best_peer"] = best_peer
                extra["speedup_vs_best_peer"] = peer_us[best_peer] / us
            if impl == "evenflow" and "evenflow-static" in got:
                extra["speedup_vs_static"] = got["evenflow-static"]["us"] / us
            if impl in EVENFLOW_IMPLS and READ_IMPL in got:
                extra["vs_read_once"] = got[READ_IMPL]["us"] / us
            res.add(case=c.name, variant=v, impl=impl, us=us, floor_us=fl, **common, **extra)
        del inp, refs
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()

    res.settle_copy()  # the floors at the higher of the run's two copy readings, before the targets read them
    table, targets = summarize(res.rows, cases, variants)
    meta["targets"] = targets
    meta["wall_s"] = round(time.time() - t_start, 1)
    res.finish(x="case", group="variant", plot=not args.no_plot,
               columns=["case", "variant", "impl", "us", "eager_us", "floor_us", "frac_of_floor",
                        "speedup_vs_best_peer", "speedup_vs_static", "vs_read_once", "plan_us", "plan_host_us",
                        "rotations", "read", "kernel", "error"])
    print("\n## evenflow vs FlashInfer vs static\n\n" + table)
    print_targets(targets)
    print(f"\n(wall {time.time() - t_start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
