"""Does the small-M router tile gain from reading its weight into registers before its PDL wait? (round BM probe)

Rounds BH-BJ put the CUDA-core router tile's time at M <= 16 on ``t ~ t0 + (KB into the busiest SM) / ~50-60
GB/s``: an SM's intake from L2, shared by x and the weight. Under programmatic dependent launch the weight is
already asked of L2 before the wait (``pdl-prefetch``), but it still crosses into the SM after the wait, beside x.
The weight is no output of the kernel ahead in a forward pass, so a program may also *load* it into registers
before the wait, while the call ahead still runs; after the wait only x (bf16, M x K) crosses. This probe times one
fp32 FMA tile (bf16 x widened exactly, the fp32 weight as stored, one FMA chain a k-lane over the K steps, then a
fixed tree over the k-lanes: the ``fp32-splitk`` kernel's sums without its split) in two forms that differ only in
where the weight's loads sit (``pf``: after the wait, with the L2 prefetch before it, as the library's
``pdl-prefetch``; ``pre``: before the wait), beside the dispatch's own pick (``entry``), in graph replay of
back-to-back calls on rotated copies (as the router tuner and benchmark time), each output checked against the
fp64 product with the tests' rule.

    python benchmarks/probe_router_preload.py [--out DIR] [--points k4096-m4,...]
    python benchmarks/probe_router_preload.py --sm90-stats     # CPU: registers and spills of every variant

A program holds all M rows (M <= BLOCK_M <= 16), BLOCK_N weight rows and the whole K (STEPS x BLOCK_K, no split),
so K must be a multiple of BLOCK_K. A diagnostic: writes ``probe_router_preload.json`` (not a result of record).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evenflow._kernels.common import pdl_enter, prefetch_rows  # noqa: E402

# (label, M, N, K): the router benchmark's small-M points (the 2x-floor target's misses are M = 4 on K4096 and
# Qwen3, M = 16 on K4096, LongCat-Lite and Qwen3)
POINTS = (("k4096-m1", 1, 192, 4096), ("k4096-m4", 4, 192, 4096), ("k4096-m16", 16, 192, 4096),
          ("qwen3-m1", 1, 128, 2048), ("qwen3-m4", 4, 128, 2048), ("qwen3-m16", 16, 128, 2048),
          ("longcat-lite-m4", 4, 384, 3072), ("longcat-lite-m16", 16, 384, 3072))
MODES = ("pf", "pre")


@triton.jit
def _weight_steps(p_wb, stride_wn, m_first, m_second, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                  ROWS: tl.constexpr):
    """The weight's K steps as a tuple of register tiles: ``ROWS`` (1 or 2) row sets of ``p_wb``, ``stride_wn`` apart,
    masked by ``m_first`` / ``m_second``, STEPS tiles of BLOCK_K each, row set by row set. Called before or after
    ``pdl_enter``: where the loads sit is what the probe measures."""
    ws = ()
    for j in tl.static_range(ROWS * STEPS):
        m_w = m_first if j < STEPS else m_second
        ws = ws + (tl.load(p_wb + (j // STEPS) * stride_wn + (j % STEPS) * BLOCK_K, mask=m_w, other=0.0),)
    return ws


@triton.jit(do_not_specialize=["M"])
def preload_fma_kernel(p_x, p_w, p_out, M, N, stride_xm, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                       PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """out[:M, n0:n0+BLOCK_N] = x @ w[n0:n0+BLOCK_N].T in fp32 FMAs, K = STEPS * BLOCK_K, every row of x in the
    program. PRELOAD: the weight's K steps are loaded into registers before ``pdl_enter``; else after it, with
    its lines asked of L2 before it (PDL only)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    m_m = o_m < M
    p_wb = p_w + o_n.to(tl.int64)[:, None] * stride_wn + o_k[None, :]
    p_xb = p_x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :]
    if PRELOAD:
        ws = _weight_steps(p_wb, stride_wn, m_n[:, None], m_n[:, None], BLOCK_K, STEPS, 1)
    elif PDL:
        prefetch_rows(p_w, o_n, m_n, stride_wn, 0, STEPS * BLOCK_K, BLOCK_K, 32)
    pdl_enter(PDL)
    if not PRELOAD:
        ws = _weight_steps(p_wb, stride_wn, m_n[:, None], m_n[:, None], BLOCK_K, STEPS, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for s in tl.static_range(STEPS):
        b_x = tl.load(p_xb + s * BLOCK_K, mask=m_m[:, None], other=0.0).to(tl.float32)
        acc = tl.fma(b_x[:, None, :], ws[s][None, :, :], acc)
    b_out = tl.sum(acc, axis=2)
    tl.store(p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :], b_out, mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["M"])
def preload_rows_kernel(p_x, p_w, p_out, M, N, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                        PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """:func:`preload_fma_kernel`'s product row by row (round BM2), BLOCK_N (1 or 2) weight rows a program: every
    tensor is one row of K, so x and the weight load 16-byte vectors in one layout and no K step converts a
    tile through shared memory (BM1's 3-D tile: 30 shared-memory stores and 36 barriers in its sm_90 build at
    M = 4, 4 x 1024; this form 8 and 11); each output is one FMA chain a k-lane and a fixed tree, as there."""
    n0 = tl.program_id(0) * BLOCK_N
    o_k = tl.arange(0, BLOCK_K)
    p_wb = p_w + n0.to(tl.int64) * stride_wn + o_k[None, :]
    m_w1 = n0 + 1 < N  # the second weight row (BLOCK_N = 2)
    if PRELOAD:
        ws = _weight_steps(p_wb, stride_wn, n0 < N, m_w1, BLOCK_K, STEPS, BLOCK_N)
    elif PDL:
        o_n = n0 + tl.arange(0, BLOCK_N)
        prefetch_rows(p_w, o_n, o_n < N, stride_wn, 0, STEPS * BLOCK_K, BLOCK_K, 32)
    pdl_enter(PDL)
    if not PRELOAD:
        ws = _weight_steps(p_wb, stride_wn, n0 < N, m_w1, BLOCK_K, STEPS, BLOCK_N)
    for m in tl.static_range(BLOCK_M):
        p_xm = p_x + m * stride_xm + o_k[None, :]
        a0 = tl.zeros((1, BLOCK_K), dtype=tl.float32)
        a1 = a0
        for s in tl.static_range(STEPS):
            b_x = tl.load(p_xm + s * BLOCK_K, mask=m < M, other=0.0).to(tl.float32)
            a0 = tl.fma(b_x, ws[s], a0)
            if BLOCK_N > 1:
                a1 = tl.fma(b_x, ws[STEPS + s], a1)
        p_o = p_out + m * stride_om + n0 + tl.arange(0, 1)
        tl.store(p_o, tl.sum(a0, axis=1), mask=m < M)
        if BLOCK_N > 1:
            tl.store(p_o + 1, tl.sum(a1, axis=1), mask=(m < M) & m_w1)


KERNELS = {"tile": preload_fma_kernel, "rows": preload_rows_kernel}


def variants(m: int, n: int, k: int, form: str = "rows") -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, STEPS, warps) a point runs in ``form``: the weight's registers a thread (BLOCK_N x K fp32
    over the threads) at most 64, a K step's accumulator (BLOCK_M x BLOCK_N x BLOCK_K in the tile form, BLOCK_N x
    BLOCK_K a row in the row form) at most 64, at most 8 K steps, and the two fewest-step configs of each
    (BLOCK_N, warps). BM1 ran the tile form with the two *most*-step configs of each (the loop ran BLOCK_K up)."""
    bm = max(1, triton.next_power_of_2(m))
    out = []
    for bn in ((1, 2, 4) if form == "tile" else (1, 2)):
        for warps in (4, 8):
            threads = 32 * warps
            kept = 0
            for bk in (4096, 2048, 1024, 512, 256):
                steps = k // bk
                acc = (bm if form == "tile" else 1) * bn * bk
                if k % bk or steps > 8 or bn * k > 64 * threads or acc > 64 * threads or bn > n or kept == 2:
                    continue
                out.append((bn, bk, steps, warps))
                kept += 1
    return out


def preload_launcher(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bn: int, bk: int, warps: int,
                     preload: bool, pdl: bool = True, form: str = "rows"):
    """A zero-argument launch of the ``form`` kernel (``KERNELS``) on x [M, K] bf16 (M <= 16), w [N, K] fp32 into
    out [M, N] fp32."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(f"x must be bf16, w and out fp32; got {x.dtype}, {w.dtype}, {out.dtype}")
    if w.shape[1] != k or out.shape != (m, n):
        raise ValueError(f"shapes x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} do not agree")
    if not 1 <= m <= 16:
        raise ValueError(f"M={m}: the probe's tile holds 1-16 rows")
    if k % bk:
        raise ValueError(f"K={k} must be a multiple of BLOCK_K={bk}")
    if form not in KERNELS or (form == "rows" and bn > 2):
        raise ValueError(f"form {form!r} with BLOCK_N={bn}: 'tile' (any BLOCK_N) or 'rows' (BLOCK_N 1 or 2)")
    kernel = KERNELS[form]
    bm = triton.next_power_of_2(m)
    kw = {"launch_pdl": True} if pdl else {}
    grid = (triton.cdiv(n, bn),)

    def launch():
        kernel[grid](x, w, out, m, n, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm,
                     BLOCK_N=bn, BLOCK_K=bk, STEPS=k // bk, PRELOAD=preload, PDL=pdl, num_warps=warps, **kw)
        return out
    return launch


def sm90_stats(points=POINTS, forms=("rows",)) -> list[dict]:
    """Registers, spill bytes and the ``ld.global`` before the PDL wait of every variant's sm_90 build (CPU:
    Triton's compiler and ptxas, no GPU), the pointers and strides aligned as a GPU launch specialises them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from evenflow._compile_check import _ptxas_usage

    sig = {"p_x": "*bf16", "p_w": "*fp32", "p_out": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_om": "i32"}
    rows, done = [], {}
    for label, m, n, k in points:
        bm = triton.next_power_of_2(m)
        for form, (bn, bk, steps, warps) in ((f, v) for f in forms for v in variants(m, n, k, f)):
            for mode in MODES:
                key = (form, bm, bn, bk, steps, warps, mode)
                if key not in done:
                    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STEPS=steps, PRELOAD=mode == "pre", PDL=True)
                    src = ASTSource(KERNELS[form], signature={**sig, **{c: "constexpr" for c in consts}},
                                    constexprs=consts,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5, 6, 7)})
                    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": warps, "launch_pdl": True})
                    ptx = c.asm["ptx"]
                    body = ptx[ptx.index(".entry"):]
                    regs, spill = _ptxas_usage(ptx, 90)
                    done[key] = dict(regs=regs, spill_bytes=spill,
                                     loads_before_wait=body[:body.find("griddepcontrol.wait")].count("ld.global"))
                rows.append(dict(point=label, M=m, N=n, K=k, form=form, BN=bn, BK=bk, steps=steps, warps=warps,
                                 mode=mode, **done[key]))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--points", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--forms", default="rows", help="kernel forms to run: rows (BM2), tile (BM1), or both")
    p.add_argument("--sm90-stats", action="store_true", help="CPU: print the sm_90 builds' registers and spills")
    a = p.parse_args(argv)
    points = [pt for pt in POINTS if a.points is None or pt[0] in a.points.split(",")]
    forms = tuple(a.forms.split(","))
    if any(f not in KERNELS for f in forms):
        raise SystemExit(f"--forms: choose from {', '.join(KERNELS)}")
    if a.sm90_stats:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # kernels decorated for the interpreter
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
        for r in sm90_stats(points, forms):
            print(r, flush=True)
        return
    import router as bench  # the router benchmark's rotation of weight / activation copies
    from evenflow.bench import harness as H
    from evenflow.testing import rule_check

    if not torch.cuda.is_available():
        raise SystemExit("probe_router_preload.py needs a CUDA GPU (or --sm90-stats)")
    H.warm_graph_state()
    rows = []
    for label, m, n, k in points:
        ws, xs, rws, outs, ref, base, entry = bench.probe_point(m, n, k)
        named = {"entry": entry}
        for form, (bn, bk, _, warps) in ((f, v) for f in forms for v in variants(m, n, k, f)):
            for mode in MODES:
                named[f"{form}-{mode}-n{bn}-k{bk}-w{warps}"] = [
                    preload_launcher(x, w, o, bn, bk, warps, mode == "pre", form=form) for x, w, o in zip(xs, ws, outs)]
        res = {}
        for name, fns in named.items():
            out = fns[0]()
            msg, err, _ = rule_check(out, ref, base)
            res[name] = (H.time_graph(fns), err, not msg)
        entry_us = res["entry"][0]
        for name, (us, err, ok) in res.items():
            rows.append(dict(point=label, M=m, N=n, K=k, impl=name, us=round(us, 3), vs_entry=round(entry_us / us, 3),
                             max_abs_err=err, rule_ok=ok))
        best = sorted((v[0], k_) for k_, v in res.items() if k_ != "entry" and v[2])
        bests = {f"{f}-{md}": min(((u, k_) for u, k_ in best if k_.startswith(f"{f}-{md}")),
                                  default=(float("nan"), "-")) for f in forms for md in MODES}
        print(f"{label:18s} entry {entry_us:6.3f} | " + " | ".join(f"{md} {u:6.3f} ({k_})" for md, (u, k_)
                                                                   in bests.items())
              + f" | fails {[k_ for k_, v in res.items() if not v[2]]}", flush=True)
        del ws, xs, rws, outs
        torch.cuda.empty_cache()
    if a.out:
        H.write_rows(a.out, "probe_router_preload.json", rows)


if __name__ == "__main__":
    main()
