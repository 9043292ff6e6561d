"""Memory round trips of every benchmark launch's sm_90 build, as built and as the data allow (CPU, no GPU needed).

    TRITON_INTERPRET=1 python benchmarks/sass_load_waves.py [--families router,moe,decode] [--all]

A kernel that loads several independent tiles before it computes is written for one round trip to memory: every load
issued, then one wait. ptxas may still put a load after an instruction that reads an earlier load's result; the warp
waits there, and the later load's latency runs after the first instead of beside it. Round BO found this in the
router's one-block simt tile (a thread's second x load behind its first products: by inference BM8's 1.086x) and in
the MoE top-k reduce (4 round trips where its ids and rows need 2; 10 at four down K splits). This script records the
launches the benchmarks make (router: every case and M of ``benchmarks/router.py`` through the H200 table; MoE: every
case, format and batch of ``benchmarks/moe.py`` through the tuned table; decode: its standard slice and TP8 slice,
bf16 and fp8 KV, with the plans an engine builds), compiles each distinct one for sm_90 and reads its SASS with
``evenflow._compile_check.load_waves``: for each global load outside loops, the dependent round trips its address
needs and those its place in the code costs; and each loop's body on its own, for one trip's. It prints one line a
kernel build (and one a loop) with a load issued behind a wait it does not depend on (every one with ``--all``):
``needed`` / ``issued`` the most of either over its loads, ``late`` the loads issued behind such a wait, and the
benchmark points that run it. Outside loops, a load after a loop counts the loop's reads as waits, which the source
order may force (a GEMM's epilogue loads). A diagnostic: no result file.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _router():
    import evenflow
    import router as R
    from evenflow.router import dispatch

    facts = (dispatch.load_table("NVIDIA H200"), 132)  # the table an H200 reads (a CPU device reads none)
    for name, (k, n) in R.CASES.items():
        w = evenflow.RouterWeight(torch.randn(n, k) * 0.02)
        for m in R.MS:
            cfg = dispatch.choose_config(m, n, k, torch.device("cpu"), facts=facts)
            yield f"router {name} M={m}", lambda w=w, m=m, k=k, cfg=cfg: evenflow.router_gemm(
                torch.empty(m, k, dtype=torch.bfloat16), w, config=cfg)


def _moe():
    import evenflow
    import moe as B
    from evenflow.moe import fused as F
    from evenflow.reference.moe import random_moe_weights

    table = os.path.join(F.CONFIG_DIR, "h200.json")
    e_loc = 4  # the expert count sets no constexpr the tables choose; real weights would take gigabytes
    for case in B.CASES.values():
        h, i = case.hidden, case.inter
        for fmt, mode in (("bf16", 0), ("fp8_per_tensor", 1), ("fp8_block", 2)):
            if mode == 2 and i % 128:
                continue
            ew = random_moe_weights(fmt, e_loc, h, i)
            for t in B.BATCHES:
                kw = dict(num_experts_total=case.num_experts_total)
                cfg = (F.tuned_config(t, case.top_k, case.num_local, h, i, mode, device=None, path=table, **kw)
                       or F.choose_config(t, case.top_k, case.num_local, h, i, mode, **kw))
                yield f"moe {case.name} {fmt} T={t}", lambda t=t, h=h, k=case.top_k, ew=ew, cfg=cfg: evenflow.fused_moe(
                    torch.randn(t, h).bfloat16(), torch.randint(0, e_loc, (t, k), dtype=torch.int32),
                    torch.rand(t, k), ew, config=cfg)


def _decode():
    import evenflow

    fp8 = torch.float8_e4m3fn
    lens = [32 * 1024] + [512] * 15
    page, d, b = 64, 128, len(lens)
    max_pages = (max(lens) + page - 1) // page
    num_pages = sum((n + page - 1) // page for n in lens) + 1
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    table = torch.arange(b * max_pages, dtype=torch.int32).reshape(b, max_pages) % num_pages
    for hq, hkv, kv_dtype in ((64, 8, torch.bfloat16), (64, 8, fp8), (8, 1, torch.bfloat16), (8, 1, fp8)):
        k = torch.empty(num_pages, page, hkv, d, dtype=kv_dtype)
        kw = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) if kv_dtype == fp8 else {}
        plan = evenflow.DecodePlan(b, max(lens), hkv, page_size=page, device="cpu", kv_dtype=kv_dtype,
                                   q_dtype=torch.bfloat16).update(seq_lens)
        yield f"decode {hq}/{hkv} {kv_dtype}", lambda hq=hq, k=k, plan=plan, kw=kw: evenflow.decode_attention(
            torch.empty(b, hq, d, dtype=torch.bfloat16), k, torch.empty_like(k), table, seq_lens, plan=plan, **kw)


FAMILIES = {"router": _router, "moe": _moe, "decode": _decode}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="router,moe,decode")
    p.add_argument("--all", action="store_true", help="print every build, not only those that lose a round trip")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=1 (the launches are recorded by the interpreter, compiled for sm_90)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from evenflow._compile_check import compile_stats, emulate_gpu, record_launches

    families = [f for f in args.families.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        sys.exit(f"--families: unknown {sorted(unknown)}; choose from {sorted(FAMILIES)}")
    builds: dict = {}  # launch -> the benchmark points that make it
    with emulate_gpu(132):
        for fam in families:
            for label, call in FAMILIES[fam]():
                with record_launches() as launches:
                    call()
                for la in launches:
                    builds.setdefault(la, []).append(label)
    distinct = list(builds)
    print(f"{len(distinct)} distinct launches; compiling them for sm_90 ...", flush=True)
    stats = compile_stats(distinct)

    def row_head(la):
        consts = ", ".join(f"{k}={v}" for k, v in la.constexprs)
        pts = sorted(set(builds[la]))
        return f"| {la.name} | {consts[:90]} ", "; ".join(pts[:4]) + (f"; +{len(pts) - 4} more" if len(pts) > 4 else "")

    print("\nOutside loops:\n\n| kernel | build | loads | needed | issued | late | points |\n"
          "|---|---|---|---|---|---|---|")
    for la, s in zip(distinct, stats):
        if "error" in s:
            print(f"| {la.name} | {la.describe()[:60]} | error: {s['error'][:100]} | | | | |")
            continue
        waves = [w for w in s["load_waves"] if not w["in_loop"]]
        late = [w for w in waves if w["issued"] > w["needed"]]
        if late or args.all:
            head, where = row_head(la)
            print(f"{head}| {len(waves)} | {max((w['needed'] for w in waves), default=0)} | "
                  f"{max((w['issued'] for w in waves), default=0)} | {len(late)} | {where} |")
    print("\nOne loop trip, each loop on its own (a loop nested in another counts in both):\n\n"
          "| kernel | build | loop (addresses, instructions) | loads | needed | issued | late | points |\n"
          "|---|---|---|---|---|---|---|---|")
    for la, s in zip(distinct, stats):
        for lp in s.get("loop_load_waves", []):
            if lp["late"] or args.all:
                head, where = row_head(la)
                print(f"{head}| {lp['start']:#x}-{lp['end']:#x}, {lp['instructions']} | {lp['loads']} | "
                      f"{lp['needed']} | {lp['issued']} | {lp['late']} | {where} |")


if __name__ == "__main__":
    main()
