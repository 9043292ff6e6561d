"""Probe: a module switch of choose_config on shapes no table tunes; ``--switch wide-down`` (the default): the exact
fp8 tiles with the down GEMM's N block 128 wide (``fused.WIDE_DOWN_N``); ``--switch deep-k``: bf16's 16- / 32-row
tiles with 128-deep K steps (``fused.DEEP_K_BF16``).

    python benchmarks/probe_moe_wide_down.py [--switch wide-down|deep-k]
                                             [--cases qwen3-235b-tp8,dsv3-tp8,hy3-tp2,hy3-ep2]
                                             [--variants V,...] [--batches T,...]   # defaults: the switch's
                                             [--passes 2] [--budget-s 300] [--out DIR]

wide-down: above 16 rows per expert the exact fp8 mode runs 32-row ``mma.sync`` tiles, and each down program
converts its whole intermediate tile from e4m3 every K step; a 128-wide N block halves that work per weight byte. On
the benchmark's three shapes the tuners timed it at 0.910-1.008 of the heuristic's time (median 0.951, 27 points on an
H200 and an H100; ``benchmarks/results/h100/history/round-cf/cpu/``). deep-k: at most 32 rows per expert, bf16 from
4 tokens, the tuners timed 128-deep K steps at 0.894-0.999 of the 64-deep tile's time (median 0.955, 31 points;
``benchmarks/results/h100/history/round-cg/cpu/``). On the benchmark's shapes most of those points have a table
entry, so a switch matters where none exists: other models and other shards. This probe times, at each point of
those (the benchmark's weights, routing draws and rotated weight copies, CUDA-graph replay, the two graphs
interleaved), ``choose_config``'s config with the switch off and on:

- wide-down: ``heuristic`` (off: what an untuned shape ran until round CG) and ``wide`` (on: 128-wide down N blocks
  where H allows; the default since round CG, on this probe's result: one H100, 0.919-1.012, median 0.956 / 0.958 in
  its two passes, ``benchmarks/results/h100/history/round-cg/``);
- deep-k: ``k64`` (off: what an untuned shape ran until round CG) and ``k128`` (on: the default since CG2, on this
  probe's result: one H100, 0.904-1.006, median 0.954 / 0.951 in its two passes);

each passed as ``config=`` (so no table entry interferes), checks both outputs against the tolerance rule of the
exact mode (``evenflow.reference.moe.moe_rule_terms``) and reports whether they agree bit for bit (each output
element's sequence of 16-deep MMA steps is the same either way: CG1 and CG2 found every output bitwise equal). Points
where the switch changes nothing are skipped. A diagnostic for the perf notes: its JSON is not a result file of
record.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as M  # noqa: E402  (benchmarks/moe.py: cases, weights, routing)

# Shards no committed table tunes (round AJ7 timed the first two, round S7 the last two).
SHARDS = {
    "qwen3-235b-tp8": M.MoECase("qwen3-235b-tp8", 128, 128, 8, 4096, 192,
                                skip_variants={"fp8-block": "I=192 is not a multiple of 128"}),
    "dsv3-tp8": M.MoECase("dsv3-tp8", 256, 256, 8, 7168, 256),
    "hy3-tp2": M.MoECase("hy3-tp2", 192, 192, 8, 4096, 768),
    "hy3-ep2": M.MoECase("hy3-ep2", 192, 96, 8, 4096, 1536, ep_rank=0),
}
MODES = {"bf16": 0, "fp8-tensor": 1, "fp8-block": 2}
# --switch: (module switch of evenflow.moe.fused, the formats it changes, default batches, row labels off / on, JSON)
SWITCHES = {
    "wide-down": ("WIDE_DOWN_N", ("fp8-tensor", "fp8-block"), [512, 1024, 4096], ("heuristic", "wide"),
                  "probe_moe_wide_down.json"),
    "deep-k": ("DEEP_K_BF16", ("bf16",), [4, 16, 64, 256, 512], ("k64", "k128"), "probe_moe_deep_k.json"),
}


def configs(case: M.MoECase, variant: str, t: int, sms: int = 132, switch: str = "WIDE_DOWN_N"):
    """(off, on) configs of one point on a GPU of ``sms`` SMs, ``switch`` (a module switch of evenflow.moe.fused) off
    and on, or None where the switch changes nothing there. The switch is left as it was found."""
    from evenflow.bench.harness import with_switches
    from evenflow.moe import fused

    def choose():
        return fused.choose_config(t, case.top_k, case.num_local, case.hidden, case.inter, MODES[variant],
                                   num_experts_total=case.num_experts_total, sms=sms)

    off, on = (with_switches(fused, {switch: v}, choose) for v in (False, True))
    return None if on == off else (off, on)


def main(argv=None) -> None:
    import evenflow
    from evenflow._runtime import num_sms
    from evenflow.bench import harness as H
    from evenflow.reference.moe import moe_rule_terms
    from evenflow.testing import rule_check

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(SHARDS), help="comma list of " + ",".join(list(SHARDS) + list(M.CASES)))
    p.add_argument("--switch", default="wide-down", choices=sorted(SWITCHES),
                   help="wide-down: fused.WIDE_DOWN_N (fp8); deep-k: fused.DEEP_K_BF16 (bf16)")
    p.add_argument("--variants", default=None, help="comma list (default: the formats the switch changes)")
    p.add_argument("--batches", type=H.positive_ints, default=None, help="comma list (default: the switch's)")
    p.add_argument("--passes", type=int, default=2, help="interleaved timings of the two graphs a point")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new points after this many seconds")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    H.check_out(p, a.out)
    for name in a.cases.split(","):
        if name not in SHARDS and name not in M.CASES:
            raise SystemExit(f"--cases: unknown case {name!r} (known: {', '.join(list(SHARDS) + list(M.CASES))})")
    switch, formats, batches, labels, json_name = SWITCHES[a.switch]
    a.variants = a.variants or ",".join(formats)
    a.batches = a.batches or batches
    for v in a.variants.split(","):
        if v not in formats:
            raise SystemExit(f"--variants: {v!r} is not a format --switch {a.switch} changes ({', '.join(formats)})")
    if a.passes < 1:
        raise SystemExit(f"--passes must be >= 1, got {a.passes}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_moe_wide_down.py needs a CUDA GPU")
    M.CASES.update({k: v for k, v in SHARDS.items() if k not in M.CASES})
    dev, t0, rows = "cuda", time.time(), []
    sms = num_sms(torch.device(dev))  # fused_moe's heuristic reads the device's count
    for case_name, case, variant, gen, bias, copies in M.rotated_series(a.cases, a.variants, dev):
        holders = [c.holder() for c in copies]
        kw = dict(ep_rank=case.ep_rank, num_experts_total=case.num_experts_total)
        for t in a.batches:
            pair = configs(case, variant, t, sms, switch)
            if pair is None:
                print(f"{case_name}/{variant} T={t}: the switch changes nothing here", flush=True)
                continue
            if time.time() - t0 > a.budget_s:
                print(f"{case_name}/{variant} T={t}: budget spent, not timed", flush=True)
                continue
            inputs = [M.draw_call(t, case, gen, bias, dev) for _ in copies]
            ref, bl, allow = moe_rule_terms(*inputs[0], holders[0], **kw)
            named, outs, checks = {}, {}, {}
            for impl, cfg in zip(labels, pair):
                named[impl] = [(lambda ew=ew, inp=inp, c=cfg: evenflow.fused_moe(*inp, ew, config=c, **kw))
                               for ew, inp in zip(holders, inputs)]
                outs[impl] = named[impl][0]()
                msg, err, bound = rule_check(outs[impl], ref, bl, allowance=allow)
                checks[impl] = (msg, err, bound)
            passes = [H.time_graphs(named) for _ in range(a.passes)]
            same = torch.equal(outs[labels[0]], outs[labels[1]])
            for impl, cfg in zip(labels, pair):
                msg, err, bound = checks[impl]
                rows.append(dict(case=case_name, variant=variant, batch=t, impl=impl,
                                 us=round(statistics.median(q[impl] for q in passes), 3),
                                 passes_us=[round(q[impl], 3) for q in passes], config=cfg.as_list(),
                                 max_abs_err=err, rule_bound=bound, rule_ok=not msg, bitwise_same=same))
            off, on = labels
            ratio = " ".join(f"{q[on] / q[off]:.3f}" for q in passes)
            fails = [impl for impl, c in checks.items() if c[0]]
            print(f"{case_name}/{variant} T={t}: {off} " + " ".join(f"{q[off]:8.2f}" for q in passes) + f" us, {on} "
                  + " ".join(f"{q[on]:8.2f}" for q in passes) + f" us; {on} / {off} {ratio}; bitwise {same}"
                  + (f"; RULE FAILED: {', '.join(fails)}" if fails else ""), flush=True)
            if a.out:  # after every point: a call's time limit must not lose the points already timed
                H.write_rows(a.out, json_name, rows)
            del named, outs, inputs, ref, bl, allow
        # drop every reference to the series' weights: rotated_series frees their memory before the next
        del copies, holders


if __name__ == "__main__":
    main()
