"""Measure fused_moe tile configs on this GPU and write the per-shape config table (data, not code).

    python benchmarks/tune_moe.py [--budget-s 200] [--cases qwen3-30b-a3b,hy3-tp8,hy3-ep8]
                                  [--formats bf16,fp8-tensor,fp8-block] [--buckets 1,8,32,...] [--quick]
                                  [--max-candidates N] [--seed 0] [--table PATH] [--precompile-only]
    python benchmarks/tune_moe.py --formats fp8-tensor-fast,fp8-block-fast   # fused_moe(fp8_accum="fast")
    python benchmarks/tune_moe.py --formats fp8-tensor-prom,fp8-block-prom   # fused_moe(fp8_accum="promoted")

Points: every case x weight format x batch bucket (default 1, 2, 4, ..., 1024, 4096; formats a
case does not have, e.g. Hy3 TP8 fp8-block, are left out). A call uses the entry of the largest
bucket <= its batch; below the first bucket, or where the entry is null, ``choose_config``
decides. The opt-in fast-accumulation mode (``fp8_accum="fast"``) is tuned as formats of its
own, ``fp8-tensor-fast`` and ``fp8-block-fast`` (not in the default ``--formats``): its own
table keys (``tuned_key(..., accum="fast")``, suffix ``-fast``), its own candidates (fp8-wgmma
tiles of 64 and 128 rows first, K-steps >= 32) and its own rule baseline (below). The opt-in
``fp8_accum="promoted"`` likewise: ``fp8-tensor-prom`` and ``fp8-block-prom``, keys suffixed ``-prom``,
the fast mode's candidates, its own baseline.

Workload = the benchmark's (benchmarks/moe.py, imported, not copied): routing from
``make_routing`` with the per-expert bias ``expert_bias`` draws first from a CPU generator seeded
``--seed`` (so the same experts are popular as in the benchmark run with that seed); each
point draws its rotated inputs (routing, then x, per copy, as the benchmark does) from its own
generator seeded from (seed, batch), so a point's inputs do not depend on which other points
ran. Weights are rotated through as many copies as the benchmark rotates (``B.rotations``), and
the calls through those copies timed as one CUDA graph (``harness.time_graph``), as the benchmark
times. At batches <= 16 a point times at least 8 routing draws (``B.routing_draws``), cycling the weight
copies: under expert parallelism one draw's count of pairs on this rank is far from its mean at such
batches (Hy3 EP8 T = 8: the one draw timed before had 8 pairs on rank 0, 6.3 expected with this
workload's bias), and a config tuned on a light or heavy draw is tuned for another workload (round Q).
These draws are the tuner's own; the benchmark draws its inputs separately, the same way (a held-out
sample). A second sample of as many draws (the same generator's next ones) takes the second timing of a win over the
heuristic and of a head-to-head against an existing entry: a config that wins on one sample's routing only does not
take the point (round BK4: Hy3 EP8 bf16 T = 2, ~2 pairs a draw on the rank).

A candidate counts only if its output passes the tests' tolerance rule
(``evenflow.testing.assert_within_rule`` against the fp64 oracle, PyTorch's own bf16/fp32 run as the
baseline, as in tests/test_moe_gpu.py; for the fast formats the baseline is the same layer with
fp8 fast accumulation, ``evenflow.reference.moe.moe_fast_accum_baseline``, with ``promoted=True`` for the
-prom formats). ``choose_config``'s
pick (``default``) is timed first. An entry is written only for a win beyond noise: the fastest
passing candidate must be at least ``WIN`` (3%) faster than the default, and again when both are
timed a second time; otherwise the bucket gets null (the heuristic). If the default fails the
rule, the fastest passing candidate is written. That decision then meets the table's existing entry for
the point, if any and if different: the two (the new choice being the heuristic where the decision is
null) are timed head to head twice, once in each order, and the entry stays unless the new choice is
faster both times by more than ``REPLACE_MARGIN`` (1%, :func:`keep_incumbent`); where nothing passed
the rule, the entry stays if it passes it; an entry the current code refuses (``check_config``) or
that fails the rule is dropped. Existing entries are not precompiled (they compile when first
timed). Buckets of the full list that this run did not measure and that follow an entry get null
too, so an entry never covers batches it was not measured near.

Budget (``--budget-s``, the whole run, compiles included, across every case): Triton kernels
depend on the config and format only (H and I are runtime arguments, all multiples of 16), so
each distinct (format, config) is compiled once, at one shape that every candidate tiles, by
``--workers`` processes, for at most ``PRECOMPILE_SHARE`` of the budget (then the rest is
compiled as timed). The timing pass gives each remaining point a share of the time left in proportion
to its candidates (``point_share``; the default is always timed; points reached after the budget is
spent are skipped and get no entry). ``--max-candidates`` keeps the first N candidates of each point
(most promising first; a K-split pair-tile config and its ``+defer`` twin, the same config with the
gate-up's reduction left to the down GEMM, count as one).

Writes ``src/evenflow/moe/configs/<gpu>.json`` (or ``--table``; an existing file is updated point
by point); when ``$OUT`` is set, also a copy under ``$OUT/moe-configs/``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as B  # noqa: E402  (benchmarks/moe.py: cases, routing generator, rotations)

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
QUICK_BUCKETS = [1, 16, 128, 512, 4096]


class TuneFormat(NamedTuple):
    fmt: str        # evenflow.MoEWeights format
    mode: int       # weight mode (tuned_key)
    variant: str    # benchmarks/moe.py variant: weight bytes, cases that lack the format
    accum: str = "exact"  # fused_moe(fp8_accum=...): "fast" / "promoted" have their own keys and rule baselines

    @property
    def fast_acc(self) -> bool:  # fp8 MMAs: the fp8-MMA modes' candidates and tile rules
        return self.accum != "exact"


FORMATS = {
    "bf16": TuneFormat("bf16", 0, "bf16"),
    "fp8-tensor": TuneFormat("fp8_per_tensor", 1, "fp8-tensor"),
    "fp8-block": TuneFormat("fp8_block", 2, "fp8-block"),
    "fp8-tensor-fast": TuneFormat("fp8_per_tensor", 1, "fp8-tensor", "fast"),
    "fp8-block-fast": TuneFormat("fp8_block", 2, "fp8-block", "fast"),
    "fp8-tensor-prom": TuneFormat("fp8_per_tensor", 1, "fp8-tensor", "promoted"),
    "fp8-block-prom": TuneFormat("fp8_block", 2, "fp8-block", "promoted"),
}
DEFAULT_FORMATS = "bf16,fp8-tensor,fp8-block"
# fast accumulation above 16 rows per expert: fp8-wgmma tiles (64/128 rows, 8 warps) first, then
# the 32-row mma.sync tiles (where Triton computes f16 products) to compare against;
# (BLOCK_M, gate-up N, down N, warps, stages); block mode takes a 128-wide gate-up N in these
FAST_TILES = ((64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 8, 4), (128, 128, 128, 8, 4),
              (128, 64, 128, 8, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (32, 128, 64, 4, 4),
              (32, 64, 64, 4, 4))
CASES = ("qwen3-30b-a3b", "hy3-tp8", "hy3-ep8")
WIN = 0.03  # an entry needs a win of at least 3% over the default, twice (graph-replay medians move ~1%)
REPLACE_MARGIN = 0.01  # a new choice replaces an existing entry only if faster by more than that ~1%, twice
PRECOMPILE_SHARE = 0.45
COMPILE_SHAPE = (4096, 1536)  # (H, I): every candidate of every case tiles it (multiples of 2048 / 768 / 192)
ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # a CPU dry run of the whole loop (tests) sets "cpu" and stubs the timer


# The pair-tile range of rounds I3-AJ (pairs); round AK extended it to PAIR_TILE_MAX_PAIRS, and past this the tuner also
# times index tiles (MoEConfig.index_tiles) at pair-tile batches.
I3_PAIR_TILE_PAIRS = 16


def candidates(case, mode: int, t: int, fast_acc: bool = False, incumbent=None) -> list[tuple[str, object]]:
    """(label, MoEConfig) to time at batch t, most promising first; all pass check_config
    (with ``fast_acc``: that mode's rules, K-steps >= 32). ``incumbent``: the table's entry for the point (a
    MoEConfig) or None; its down GEMM over several n-blocks a program is offered too."""
    from evenflow.moe.fused import PAIR_TILE_MAX_PAIRS, check_config, choose_config

    d = choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, mode,
                      num_experts_total=case.num_experts_total, fast_acc=fast_acc)
    r = dataclasses.replace
    rows = t * case.top_k / case.num_experts_total
    out = [("default", d)]
    # the two configs known best at the point, whose one-knob twins (index tiles, down n-groups) go next to the default
    known = [(label, b) for label, b in (("incumbent", incumbent), ("default", d)) if b is not None]
    if rows <= 16:
        # decode / small batch: bound by streaming the hit experts' weights
        if mode == 0:
            out += _k_depth_twins(d)
        out += [("st4", r(d, num_stages=4))]
        if mode != 2:
            out += [("gn32", r(d, gu_block_n=32))]
        else:
            # block mode on 64-wide gate-up N blocks (round U: twice the programs, each activation group
            # requantised by its last program; their +defer twins leave the activation to the down GEMM,
            # which takes whole groups); tried because per-tensor's 64-wide programs ran Qwen3 T = 4 faster than
            # block mode's 128-wide ones (T5's record); U1 measured it a win at T = 64 only
            gs = d.gu_split_k
            out += [("gn64", r(d, gu_block_n=64)),
                    (f"gn64-gs{max(1, gs // 2) if gs > 1 else 2}",
                     r(d, gu_block_n=64, gu_split_k=max(1, gs // 2) if gs > 1 else 2)),
                    ("gn64-st4", r(d, gu_block_n=64, num_stages=4))]
        for gs, ds in ((d.gu_split_k * 2, d.down_split_k), (max(1, d.gu_split_k // 2), d.down_split_k),
                       (d.gu_split_k, d.down_split_k * 2), (d.gu_split_k, max(1, d.down_split_k // 2))):
            out.append((f"gs{gs}-ds{ds}", r(d, gu_split_k=gs, down_split_k=ds)))
        out += [("w8", r(d, num_warps=8)), ("dn128", r(d, down_block_n=128)), ("st5", r(d, num_stages=5))]
        if mode != 2:
            out += [("gn32-st4", r(d, gu_block_n=32, num_stages=4))]
        if mode == 0:
            out += [("gk128-st4", r(d, gu_block_k=128, down_block_k=128, num_stages=4))]
        out += [("dn32", r(d, down_block_n=32)), ("bm32", r(d, block_m=32))]
        # 2 warps a program (round AA4): the down GEMM of a tensor-parallel shard (K = I = 192 at Hy3 TP8: three K
        # steps a program, 11-17 waves of 16-row tiles, round Z1) is a chain of dependent loads per program; at 2
        # warps its sm_90 build holds 14 programs an SM by registers instead of 9
        out += [("w2", r(d, num_warps=2)), ("w2-dn128", r(d, num_warps=2, down_block_n=128)),
                ("w2-st4", r(d, num_warps=2, num_stages=4))]
        if mode != 2:
            out += [("w2-gn32", r(d, num_warps=2, gu_block_n=32))]
        if t * case.top_k <= PAIR_TILE_MAX_PAIRS:
            # the down GEMM over 1, 2 or 4 n-blocks a program on pair tiles (round AK9, Hy3 TP8 T = 4, every output
            # bitwise one n-block's: 2 level in bf16 and fp8-tensor, 4 3.5-4% faster in bf16 and 16% slower in
            # fp8-tensor, 8 slower in both): a per-point choice, each known config at the other groups (an entry tuned
            # to 4 is timed at 1 and 2 again), after the other candidates (one point's gain so far: a --max-candidates
            # limit drops them first)
            out += _n_grouped(known, (1, 2, 4), case.inter)
            # pair tiles: each K-split candidate also with its partials left to the down GEMM (gu_defer)
            out = [lc for label, c in out for lc in ((label, c),) + (
                ((f"{label}+defer", r(c, gu_defer=1)),) if c.gu_split_k > 1 and c.block_m == 16 else ())]
            n_ix = 0  # index-tile twins inserted after the default
            at0 = 2 if len(out) > 1 and out[1][0] == "default+defer" else 1  # after the default (and its twin)
            if t * case.top_k > I3_PAIR_TILE_PAIRS:
                # the index build instead of pair tiles, in the range round AK gave pair tiles (at 32 pairs they were
                # slower on one benchmark series of eight; up to 16, round I3's range, faster), on the table's entry
                # and on the default's tiles, next to the default (and its +defer twin); an index-tile twin defers
                # nothing (the deferral is a pair-tile path), so it takes gu_defer = 0
                at = at0
                twins = [(f"{label}-pairs", r(b, index_tiles=0)) if b.index_tiles else
                         (f"{label}-index", r(b, index_tiles=1, gu_defer=0)) for label, b in known if b.block_m == 16]
                out[at:at] = twins
                n_ix = len(twins)
            # round BK: the known configs that run pair tiles, each with the other choices of which GEMMs ask L2 for
            # their first K step before their PDL wait (BK2: 0.93-1.08x the time by series; bf16's gate-up is the
            # layer's first kernel and never takes it, so bf16 offers the down's bit alone), after the default and
            # its index-tile twins
            at = at0 + n_ix
            out[at:at] = [(f"{label}-pf{bits}", r(b, prefetch=bits)) for label, b in known
                          if b.block_m == 16 and not b.index_tiles
                          for bits in ((0, 2) if mode == 0 else (0, 1, 2, 3)) if bits != b.prefetch]
    else:
        if not fast_acc:
            # wider down-GEMM N blocks on the default's tiles (round T): the down GEMM (K = I, a few K steps a
            # task) ran at 0.39 of the dense rate in bf16 at Qwen3 T = 4096 against the gate-up's 0.58, and a
            # wider N block reads each activation tile for more output columns
            for dn in (128, 256):
                if dn > d.down_block_n:
                    out.append((f"default-dn{dn}", r(d, down_block_n=dn)))
            if mode and d.block_m == 32 and d.down_block_n == 128:
                # the exact fp8 32-row tile's former 64-wide down N block (choose_config's until round CG; a point may
                # still prefer it: 1.008 at H100 Hy3 TP8 fp8-tensor T = 512, 1.012 at two probe shards)
                out.append(("default-dn64", r(d, down_block_n=64)))
            if mode == 2:  # block mode's 64-wide gate-up N blocks (round U), per-tensor's tile width
                out += [("default-gn64", r(d, gu_block_n=64)), ("default-gn64-dn128", r(d, gu_block_n=64,
                                                                                       down_block_n=128))]
        tiles = FAST_TILES if fast_acc else ((64, 128, 128, 8, 4), (32, 64, 64, 4, 4), (64, 64, 128, 4, 4),
                                             (128, 128, 128, 8, 3), (64, 64, 64, 4, 3), (128, 64, 128, 8, 3),
                                             (64, 128, 128, 8, 3), (32, 128, 64, 4, 3), (16, 64, 64, 4, 4),
                                             (128, 64, 64, 4, 3))
        for bm, gn, dn, nw, st in tiles:
            gn = 128 if mode == 2 else gn  # block mode's narrow gate-up N: the two default-gn64 rows above only
            if fast_acc and case.inter % gn:  # the wgmma tiles at I = 192 (Hy3 TP8): 64-wide gate-up N
                gn = 64
            out.append((f"bm{bm}-gn{gn}-dn{dn}-w{nw}-st{st}",
                        r(d, block_m=bm, gu_block_n=gn, down_block_n=dn, num_warps=nw, num_stages=st,
                          gu_split_k=1, down_split_k=1)))
        if mode == 0 and d.block_m <= 32:  # 128-deep bf16 K tiles at >= 64x128 exceed 227 KB of smem (sm_90)
            out += _k_depth_twins(d, num_stages=3)
    if t * case.top_k > PAIR_TILE_MAX_PAIRS and rows >= 8:
        # the down GEMM over 1, 2, 4 or 8 n-blocks a program (round AJ: where a config's down GEMM has few K steps
        # and experts see >= 8 rows, up to 17% off the layer, AJ3 / AJ7; no gain, or slower, with many K steps or
        # fewer rows, AJ1 / AJ2), on the table's entry and on the default's tiles, next to the default: one knob on
        # the two configs already known best here, so a --max-candidates limit keeps them (the default has its own
        # group since AJ7)
        out[1:1] = _n_grouped(known, (1, 2, 4, 8), case.inter)
    seen, valid = set(), []
    for label, c in out:
        try:
            check_config(c, case.hidden, case.inter, mode, fast_acc=fast_acc)
        except ValueError:
            continue
        if c not in seen:
            seen.add(c)
            valid.append((label, c))
    return valid


def _k_depth_twins(d, **gk128_fields) -> list[tuple[str, object]]:
    """bf16's default ``d`` with both GEMMs' K steps 128 deep (``gk128``, with ``gk128_fields`` changed too) and,
    where ``fused.DEEP_K_BF16`` already made the default 128 deep (then ``gk128`` is the default itself, unless
    ``gk128_fields`` change it), the 64-deep tile the switch replaced (``gk64``), which carries the comparison."""
    twins = [("gk128", dataclasses.replace(d, gu_block_k=128, down_block_k=128, **gk128_fields))]
    if d.gu_block_k == d.down_block_k == 128:
        twins.append(("gk64", dataclasses.replace(d, gu_block_k=64, down_block_k=64)))
    return twins


def _n_grouped(known, groups, inter: int) -> list[tuple[str, object]]:
    """Each known config's down GEMM over each other of ``groups`` n-blocks a program, where it has at most
    FEW_DOWN_K_STEPS K steps (``{label}-dg{g}``; groups that do not tile H are dropped later by check_config)."""
    from evenflow.moe.fused import FEW_DOWN_K_STEPS, down_k_steps

    return [(f"{label}-dg{g}", dataclasses.replace(b, down_n_group=g)) for label, b in known
            if down_k_steps(b, inter) <= FEW_DOWN_K_STEPS for g in groups if g != b.down_n_group]


def point_key(case, fm) -> str:
    """The tuned table's key of ``case`` in format ``fm`` (a FORMATS entry)."""
    from evenflow.moe.fused import tuned_key

    return tuned_key(case.num_local, case.num_experts_total, case.top_k, case.hidden, case.inter, fm.mode, fm.accum)


def first_candidates(cands: list[tuple[str, object]], n: int) -> list[tuple[str, object]]:
    """The first ``n`` candidates (0: all), counting a config and its ``+defer`` twin as one, so a
    limit keeps as many base configs as without deferral and times each one's twin beside it."""
    if n <= 0:
        return cands
    out, bases = [], 0
    for label, c in cands:
        if not label.endswith("+defer"):
            bases += 1
            if bases > n:
                break
        out.append((label, c))
    return out


def point_share(left: float, cands_left: list[int]) -> float:
    """Seconds of the ``left`` budget for the next point: in proportion to its candidates among those of
    every point still to time (``cands_left[0]`` is the next point's). An equal share per point starved
    the decode points, which time a config and its ``+defer`` twin (round Q2: 10 of 29 candidates timed
    at Hy3 EP8 bf16 T = 1 while later points of 11-15 candidates finished early)."""
    return left * cands_left[0] / max(1, sum(cands_left))


def point_inputs(case, t: int, copies: int, seed: int = 0):
    """``copies`` rotated inputs (x, ids, weights) at batch t from the benchmark's routing generator (CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bias = B.expert_bias(case.num_experts_total, gen)  # as benchmarks/moe.py: the first draw of seed `seed`
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + t)
    out = []
    for _ in range(copies):
        ids, tw = B.make_routing(t, case, g, bias)
        x = torch.randn(t, case.hidden, generator=g).to(torch.bfloat16)
        out.append((x, ids, tw))
    return out


def decide(tried: dict, confirm: tuple[float, float] | None = None) -> tuple[str | None, str]:
    """(label to write or None for null, why) from {label: us or error string}.

    ``confirm``: (default_us, best_us) of a second timing of the two (on the point's second sample of draws); a win
    must hold in both.
    """
    ok = {k: v for k, v in tried.items() if isinstance(v, float)}
    if not ok:
        return None, "no candidate passed the rule"
    best = min(ok, key=ok.get)
    d = tried.get("default")
    if not isinstance(d, float):
        return best, "default fails the rule" if d is not None else "default not timed"
    if best == "default" or ok[best] > (1 - WIN) * d:
        return None, f"default within {WIN:.0%}"
    if confirm is not None and confirm[1] > (1 - WIN) * confirm[0]:
        return None, f"win not confirmed ({confirm[1]:.1f} vs {confirm[0]:.1f} us)"
    return best, f"{1 - ok[best] / d:.1%} faster"


def keep_incumbent(head_to_head: list[tuple[float, float]]) -> bool:
    """Whether a point's existing entry stays: [(incumbent us, new choice us), ...] timed in turn. The new choice
    (another config, or the heuristic where the new decision is null) replaces it only if faster by more than
    REPLACE_MARGIN in every timing. Round V2: a pass read one config 5% slower than the pass that had chosen it
    (Qwen3 bf16 T = 8, 128-deep gate-up K steps, 84.0 -> 87.9 us), dropped that entry, and the benchmark then read
    10% slower there; round W1 replaced an entry on 0.5% (Hy3 EP8 fp8-block T = 64), inside the ~1% that
    graph-replay medians move between passes."""
    return not all(new < (1 - REPLACE_MARGIN) * old for old, new in head_to_head)


def meet_incumbent(old: list, new_cfg, fns_of, validate, time_graph, fresh_fns_of=None) -> tuple[bool, dict]:
    """(keep, record) for a point's existing entry ``old`` (a config list) against the new decision's config
    ``new_cfg`` (None where nothing passed the rule). ``validate(cfg, fns)`` raises where the current code refuses
    the config or its output fails the rule: such an entry is dropped. An entry equal to the new choice needs no
    comparison; where nothing passed the rule, a valid entry stays untimed; else the two are timed head to head
    twice, once in each order, and the entry stays unless :func:`keep_incumbent` says otherwise. ``fresh_fns_of``:
    the calls of a config on the point's second sample of routing draws, which the second timing takes (round BK4:
    Hy3 EP8 bf16 T = 2's replacement won both timings on one sample of 8 draws, ~2 pairs a draw on the rank, and read
    1.06x the entry's time on the benchmark's draws in two runs); None, both on ``fns_of``'s."""
    from evenflow.moe.fused import MoEConfig

    try:
        old_cfg = MoEConfig.from_list(old)
        if old_cfg == new_cfg:
            return False, None  # the new choice is the existing entry
        validate(old_cfg, fns_of(old_cfg))
    except Exception as e:
        return False, {"config": old, "dropped": f"{type(e).__name__}: {str(e)[:160]}"}
    if new_cfg is None:
        return True, {"config": old}
    first = (time_graph(fns_of(old_cfg)), time_graph(fns_of(new_cfg)))
    again = fresh_fns_of or fns_of
    new_us = time_graph(again(new_cfg))  # the second timing in the other order
    h2h = [first, (time_graph(again(old_cfg)), new_us)]
    return keep_incumbent(h2h), {"config": old, "head_to_head_us": [[round(x, 2), round(y, 2)] for x, y in h2h]}


def seal(configs: dict, buckets=BUCKETS) -> None:
    """Null every bucket of the full list that is absent and follows a config entry, so an entry
    only covers batches up to the next bucket (measured or not)."""
    for entries in configs.values():
        prev = None
        for t in buckets:
            k = str(t)
            if k in entries:
                prev = entries[k]
            elif prev is not None:
                entries[k] = prev = None


def write_table(table: dict, path: Path) -> str:
    seal(table["configs"])
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    path.write_text(text)
    return text


def _compile_one(job) -> bool:
    """Compile one (format, config, fp8_accum) of fused_moe launches into Triton's disk cache."""
    import evenflow
    from evenflow.moe.fused import MoEConfig
    from evenflow.reference.moe import random_moe_weights, random_routing

    fmt, cfg, accum = job
    h, i = COMPILE_SHAPE
    cache = _compile_one.__dict__.setdefault("ews", {})
    if fmt not in cache:
        cache[fmt] = random_moe_weights(fmt, 8, h, i, "cuda")
    x = torch.randn(16, h, device="cuda").bfloat16()
    ids, tw = random_routing(16, 8, 8, "cuda")
    try:
        evenflow.fused_moe(x, ids, tw, cache[fmt], config=MoEConfig.from_list(cfg), fp8_accum=accum)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001  (the timing pass reports it)
        return False


def precompile(jobs, workers: int, deadline: float) -> None:
    """Compile every job in parallel processes until ``deadline`` (time.time()); the rest is compiled as timed."""
    import multiprocessing

    if workers <= 1 or len(jobs) < 2 or time.time() >= deadline:
        return
    t0, done = time.time(), 0
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        it = pool.imap_unordered(_compile_one, jobs)
        while done < len(jobs):
            try:
                it.next(timeout=max(0.1, deadline - time.time()))
            except multiprocessing.TimeoutError:
                break
            done += 1
    finally:
        pool.terminate()
        pool.join()
    print(f"precompiled {done}/{len(jobs)} (format, config) pairs in {time.time() - t0:.0f}s on {workers} processes",
          flush=True)


def _extra(p):
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="wall-clock budget (seconds) of the whole run, compiles included, across all cases")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names of benchmarks/moe.py")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help="comma list of " + ",".join(FORMATS) + " (the -fast ones: fused_moe(fp8_accum='fast'); "
                        "-prom: fp8_accum='promoted')")
    p.add_argument("--buckets", default=None, help="comma-separated batch buckets (default: all; --quick: a few)")
    p.add_argument("--max-candidates", type=int, default=0, help="time at most N candidates per point (0: all)")
    p.add_argument("--seed", type=int, default=0, help="routing seed, as benchmarks/moe.py --seed")
    p.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                   help="processes compiling the candidates before the timing pass (1: compile as timed)")
    p.add_argument("--table", default=None, help="output JSON (default src/evenflow/moe/configs/<gpu>.json)")
    p.add_argument("--precompile-only", action="store_true",
                   help="only fill Triton's cache with every planned candidate (the whole budget), e.g. beside "
                        "other CPU-bound work; a later run then times them")


def main(argv=None) -> int:
    import evenflow
    from evenflow.bench import harness as H
    from evenflow.moe.fused import MoEConfig, check_config
    from evenflow.reference.moe import moe_rule_terms, random_moe_weights
    from evenflow.testing import assert_within_rule

    args = H.parse_args(__doc__.splitlines()[0], argv, extra=_extra)
    t0 = time.time()
    deadline = t0 + args.budget_s
    buckets = ([int(b) for b in args.buckets.split(",") if b] if args.buckets else
               QUICK_BUCKETS if args.quick else BUCKETS)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    table_path = Path(args.table) if args.table else ROOT / "src/evenflow/moe/configs" / f"{H.gpu_slug(name)}.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    table.update({"device": name, "torch": torch.__version__, "generated_by": "benchmarks/tune_moe.py",
                  "rule": f"fastest config passing evenflow.testing.assert_within_rule if >= {WIN:.0%} faster "
                          "than choose_config twice (the second time on a fresh sample of routing draws), else null "
                          "(heuristic); an existing entry stays unless that choice beats it by more than "
                          f"{REPLACE_MARGIN:.0%} in both of two head-to-head timings (the second on the fresh "
                          "sample) (or, nothing passing the rule, if it passes); keys ending -fast: "
                          "fp8_accum='fast', -prom: fp8_accum='promoted', "
                          "rule baseline evenflow.reference.moe.moe_fast_accum_baseline (promoted=True for -prom)",
                  "routing": f"benchmarks/moe.py make_routing + expert_bias, seed {args.seed}"})
    configs, timings = table.setdefault("configs", {}), table.setdefault("timings", {})
    for f in args.formats.split(","):
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown format {f!r} (choose from {', '.join(FORMATS)})")
    points = [(c, f, t) for c in args.cases.split(",") for f in args.formats.split(",") for t in buckets
              if FORMATS[f].variant not in B.CASES[c].skip_variants]
    plan = {}
    jobs, seen = [], set()
    for case_name, variant, t in points:
        fm = FORMATS[variant]
        cs = B.CASES[case_name]
        old = configs.get(point_key(cs, fm), {}).get(str(t))
        incumbent = None
        if isinstance(old, list):
            try:
                incumbent = MoEConfig.from_list(old)
            except (TypeError, ValueError):  # an entry the current code refuses: dropped when the point is timed
                pass
        cands = candidates(cs, fm.mode, t, fm.fast_acc, incumbent)
        plan[(case_name, variant, t)] = first_candidates(cands, args.max_candidates)
        for _, cfg in plan[(case_name, variant, t)]:
            if (fm.fmt, tuple(cfg.as_list()), fm.accum) not in seen:
                seen.add((fm.fmt, tuple(cfg.as_list()), fm.accum))
                jobs.append((fm.fmt, cfg.as_list(), fm.accum))
    print(f"{len(points)} points, {sum(map(len, plan.values()))} candidates, {len(jobs)} distinct (format, config)",
          flush=True)
    precompile(jobs, args.workers, deadline if args.precompile_only else t0 + PRECOMPILE_SHARE * args.budget_s)
    if args.precompile_only:
        return 0
    weights_cache: dict = {}
    measured: set = set()
    for n_done, (case_name, variant, t) in enumerate(points):
        case = B.CASES[case_name]
        fm = FORMATS[variant]
        fmt, mode = fm.fmt, fm.mode
        accum = fm.accum
        key = point_key(case, fm)
        left = deadline - time.time()
        if left <= 0:
            print(f"[{time.time() - t0:5.0f}s] {case_name} {variant} T={t}: budget spent, skipped", flush=True)
            continue
        share = point_share(left, [len(plan[pt]) for pt in points[n_done:]])
        start = time.time()
        if (case_name, fmt) not in weights_cache:
            weights_cache.clear()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            g = torch.Generator(device=DEVICE).manual_seed(0)
            weights_cache[(case_name, fmt)] = [random_moe_weights(fmt, case.num_local, case.hidden, case.inter,
                                                                  DEVICE, generator=g)]
        ews = weights_cache[(case_name, fmt)]
        probe = point_inputs(case, t, 1, args.seed)
        touched = B.routing_stats(probe[0][1], case).distinct_experts * B.expert_bytes(case, fm.variant)
        n_rot = B.rotations(touched, 60 * 2**20)
        while len(ews) < n_rot:
            g2 = torch.Generator(device=DEVICE).manual_seed(len(ews))
            ews.append(random_moe_weights(fmt, case.num_local, case.hidden, case.inter, DEVICE, generator=g2))
        draws = B.routing_draws(t, n_rot)
        # two samples of as many draws, the same generator's (the second: its next draws): a win's confirmation and
        # the second head-to-head timing against an existing entry take the second, so a config that wins on one
        # sample's routing only does not take the point (round BK4)
        both = [tuple(v.to(DEVICE) for v in inp) for inp in point_inputs(case, t, 2 * draws, args.seed)]
        inputs, fresh = both[:draws], both[draws:]
        kw = {"ep_rank": case.ep_rank, "num_experts_total": case.num_experts_total}
        x0, ids0, tw0 = inputs[0]
        # the oracle, the same math by PyTorch (with its fp8 fast-accumulation GEMMs for the fast formats) and
        # what fp8 requantisation at a rounding midpoint may move (round W: V4's draw failed on one such flip)
        ref, base, allow = (v.cpu() for v in moe_rule_terms(x0, ids0, tw0, ews[0],
                                                            fast_accum=accum if fm.fast_acc else False, **kw))

        def fns_of(cfg, sample=0):  # (``s``: the sample, which the tests' stub timers read)
            src = fresh if sample else inputs
            return [lambda j=j, c=cfg, s=sample, src=src: evenflow.fused_moe(*src[j], ews[j % n_rot], config=c,
                                                                             fp8_accum=accum, **kw)
                    for j in range(draws)]

        tried: dict = {}
        cands = plan[(case_name, variant, t)]
        for i, (label, cfg) in enumerate(cands):
            if i > 0 and (time.time() - start > share or time.time() > deadline):
                print(f"  {case_name} {variant} T={t}: share {share:.1f}s spent after {i}/{len(cands)} candidates")
                break
            fns = fns_of(cfg)
            try:
                assert_within_rule(fns[0](), ref, base, what=f"{case_name} {variant} T={t} {label}", allowance=allow)
                tried[label] = H.time_graph(fns)
            except Exception as e:  # a failing config is reported, never chosen
                tried[label] = f"{type(e).__name__}: {str(e)[:160]}"
        pick, why = decide(tried)
        confirm = None
        cfg_of = dict(cands)
        if pick is not None and isinstance(tried.get("default"), float):
            confirm = (H.time_graph(fns_of(cfg_of["default"], 1)), H.time_graph(fns_of(cfg_of[pick], 1)))
            pick, why = decide(tried, confirm)
        entry = None if pick is None else cfg_of[pick].as_list()
        old = configs.get(key, {}).get(str(t))
        if isinstance(old, list):
            new_label = pick if pick is not None else "default" if isinstance(tried.get("default"), float) else None
            kept, incumbent = meet_incumbent(
                old, None if new_label is None else cfg_of[new_label], fns_of,
                lambda c, fns: (check_config(c, case.hidden, case.inter, mode, fast_acc=fm.fast_acc),
                                assert_within_rule(fns[0](), ref, base, what=f"{case_name} {variant} T={t} incumbent",
                                                   allowance=allow)),
                H.time_graph, lambda c: fns_of(c, 1))
            if kept:
                pick, entry = "incumbent", old
                why = (f"incumbent kept ({why}; it passes the rule)" if new_label is None else
                       f"incumbent kept ({why}; the new choice was not faster in both head-to-head timings)")
        else:
            incumbent = None
        configs.setdefault(key, {})[str(t)] = entry
        measured.add((key, t))
        timings.setdefault(key, {})[str(t)] = {
            "entry": pick, "why": why, "default_us": tried.get("default"),
            "confirm_us": None if confirm is None else [round(v, 2) for v in confirm],
            "incumbent": incumbent,
            "tried": {k: round(v, 2) if isinstance(v, float) else v for k, v in tried.items()}}
        write_table(table, table_path)  # after every point: a run stopped from outside keeps what it measured
        best_ok = min((v for v in tried.values() if isinstance(v, float)), default=None)
        print(f"[{time.time() - t0:5.0f}s] {case_name} {variant} T={t}: {pick or 'null'} ({why}); default "
              f"{tried.get('default') if not isinstance(tried.get('default'), float) else round(tried['default'], 1)}"
              f" us, best {best_ok and round(best_ok, 1)} us over {len(tried)} candidates", flush=True)
    text = write_table(table, table_path)
    print(f"written: {table_path} ({time.time() - t0:.0f}s)")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "moe-configs"
        out.mkdir(parents=True, exist_ok=True)
        (out / table_path.name).write_text(text)
        print(f"copy: {out / table_path.name}")
    summary(timings, [(f"{c}/{f}", point_key(B.CASES[c], FORMATS[f]), t) for c, f, t in points], measured)
    return 0


def summary(timings: dict, points, measured: set) -> None:
    """One line per point of this run: default us, best us, the entry written and why (last output)."""
    print("\n| case/format | T | default us | best us | entry | why |\n|---|---|---|---|---|---|")
    for name, key, t in points:
        row = timings.get(key, {}).get(str(t)) if (key, t) in measured else None
        if row is None:
            print(f"| {name} | {t} | | | | not measured (budget) |")
            continue
        d = row.get("default_us")
        ok = [v for v in row["tried"].values() if isinstance(v, float)]
        print(f"| {name} | {t} | {round(d, 1) if isinstance(d, float) else 'fails'} | "
              f"{round(min(ok), 1) if ok else ''} | {row.get('entry') or 'null'} | {row.get('why', '')} |")


if __name__ == "__main__":
    raise SystemExit(main())
