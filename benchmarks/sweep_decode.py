"""Sweep the decode-attention launch knobs on five cases, bf16 and fp8 KV (about 2-3 min of GPU).

Knobs (all on :class:`evenflow.DecodePlan`): persistent programs per SM, ``num_warps``,
``num_stages`` (software pipelining depth of the K/V page loads), ``min_tiles``
(minimum work per program, 64-token tiles) and ``max_registers`` (per-thread cap; 0 =
none), ``align_items`` (budget rounded to whole short items). Cases: ``1x128K+31x4K``
(skewed, big), ``64x512`` (many short requests),
``8x32K`` (uniform, big), the TP8 head slice and ``1x32K+63x512``; inputs, page tables and the
floor are the ones of ``benchmarks/decode.py`` (shuffled page pool, L2 rotation).

Every configuration's output is checked against the fp32 reference before it is
timed (CUDA-graph replay, ``plan.update`` outside the timed graph as in decode.py).
Prints one table per (case, KV dtype) sorted by time, and writes
``benchmarks/results/<gpu>/sweep_decode.{json,md}``.

    python benchmarks/sweep_decode.py            # full grid
    python benchmarks/sweep_decode.py --quick    # stages x register cap only
"""
from __future__ import annotations

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode as D  # noqa: E402  (benchmarks/decode.py: cases, inputs, reference, floor)
import evenflow  # noqa: E402
from evenflow import _runtime  # noqa: E402
from evenflow.attention.plan import DEFAULT_MIN_TILES  # noqa: E402
from evenflow.bench import harness as H  # noqa: E402

CASES = ["1x128K+31x4K", "64x512", "8x32K", "tp8:1x128K+31x4K", "1x32K+63x512"]
AUTO = None  # the launcher's choice (stages by KV dtype, register cap that fits the programs/SM)


def configs(quick: bool) -> list[dict]:
    """Round E grid: pipelining depth x register cap x programs/SM x item alignment (perf notes, decode.md)."""
    def c(pps=3, w=AUTO, s=AUTO, mt=DEFAULT_MIN_TILES, regs=AUTO, align=True):
        return dict(pps=pps, num_warps=w, num_stages=s, min_tiles=mt, max_registers=regs, align_items=align)
    # c() is the default (2 programs/SM since round E2); the rest move one knob from it. Stages
    # 3 and 4 each equal the default for one KV dtype (bf16 3, fp8 4) and measure the other.
    out = [c(), c(align=False), c(pps=3), c(pps=3, regs=0), c(pps=4), c(s=2), c(s=3), c(s=4)]
    if not quick:
        out += [c(mt=2), c(mt=32), c(pps=3, align=False), c(pps=4, align=False),
                c(pps=3, s=2, regs=0, align=False)]  # the last: the round-D build
    return out


def label(c: dict) -> str:
    regs = "auto" if c["max_registers"] is None else c["max_registers"]
    return (f"pps={c['pps']} w={c['num_warps'] or 'auto'} s={c['num_stages'] or 'auto'} "
            f"mt={c['min_tiles']} regs={regs}{'' if c['align_items'] else ' no-align'}")


def main(argv=None) -> None:
    args = H.parse_args(__doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode needs a CUDA GPU")
    device = torch.device("cuda")
    sms = _runtime.num_sms(device)
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20))
    ceil = H.measure_ceilings(verbose=False)
    res = H.Results("sweep_decode", ceilings=ceil, out=args.out, meta={"sms": sms})
    t_start = time.time()
    variants = [(v, D.VARIANTS[v]) for v in D.DEFAULT_VARIANTS]  # bf16 q (the fp8-q variant: benchmarks/decode.py)
    for name, (variant, kv_dtype) in H.progress(list(itertools.product(CASES, variants)), "sweep"):
        case = D.parse_case(name)
        inp = D.make_inputs(case, kv_dtype, device, seed=0, l2_bytes=l2)
        refs = [D.reference_decode(inp.qs[r], inp.k_cache, inp.v_cache, inp.page_tables[r], inp.seq_lens,
                                   sm_scale=inp.sm_scale, k_scale=inp.k_scale, v_scale=inp.v_scale)
                for r in range(inp.rotations)]
        floor = H.floor_us(bytes_moved=D.floor_bytes(case, kv_dtype), ceilings=ceil)
        out = torch.empty(case.batch, case.num_q_heads, D.HEAD_DIM, dtype=torch.bfloat16, device=device)
        max_len = inp.page_tables[0].shape[1] * D.PAGE_SIZE
        rows = []
        for c in configs(args.quick) + [None]:
            impl = "static" if c is None else label(c)
            try:
                plan = None
                if c is not None:
                    plan = evenflow.DecodePlan(case.batch, max_len, case.num_kv_heads, page_size=D.PAGE_SIZE,
                                               device=device, num_programs=c["pps"] * sms, min_tiles=c["min_tiles"],
                                               num_warps=c["num_warps"], num_stages=c["num_stages"],
                                               max_registers=c["max_registers"], align_items=c["align_items"])
                    plan.update(inp.seq_lens)

                def bind(r, plan=plan, inp=inp):
                    q, pt = inp.qs[r], inp.page_tables[r]
                    return lambda: evenflow.decode_attention(q, inp.k_cache, inp.v_cache, pt, inp.seq_lens,
                                                             plan=plan, k_scale=inp.k_scale, v_scale=inp.v_scale,
                                                             sm_scale=inp.sm_scale, out=out)

                fns = [bind(r) for r in range(inp.rotations)]
                for r, f in enumerate(fns):
                    f()
                    H.check_output(out.float(), refs[r], f"{name} {variant} {impl} rotation {r}")
                us = H.time_graph(fns, reps=10)
                rows.append(res.add(case=name, variant=variant, impl=impl, us=us, floor_us=floor))
            except Exception as e:  # one bad config (compile, resources) must not end the sweep
                lines = str(e).strip().splitlines()
                res.add_error(case=name, variant=variant, impl=impl,
                              error=f"{type(e).__name__}: {lines[-1][:300] if lines else ''}")
        rows.sort(key=lambda r: r["us"])
        print(f"\n{name} {variant}: floor {floor:.1f} us")
        for r in rows:
            print(f"  {r['impl']:<34} {r['us']:9.1f} us  frac_of_floor {r['frac_of_floor']:.3f}")
        del inp, refs
        torch.cuda.empty_cache()
    print(f"\nsweep took {time.time() - t_start:.0f} s")
    res.finish(x="case", group="variant", plot=False)


if __name__ == "__main__":
    main()
