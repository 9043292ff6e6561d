"""Measure this GPU's ceilings (copy bandwidth, bf16/fp8 matmul rate, empty-launch cost).

Every other benchmark measures them again in its own run; this file records them
on their own so a reader can see the machine's limits at a glance:
``benchmarks/results/<gpu>/ceilings.json``.
"""
from evenflow.bench import harness as H

COPY_MEASURES = (f"1 GiB device-to-device copy, read+write bytes, after {H.COPY_WARM_MS / 1000:g} s of copies, "
                 f"the best of {H.COPY_READINGS} medians of {H.COPY_REPS}")


def main(argv=None):
    args = H.parse_args(__doc__, argv)
    reps = 3 if args.quick else 5
    runs = [H.measure_ceilings(verbose=True) for _ in H.progress(range(reps), "ceilings")]
    med = {}
    for key in runs[0]:
        vals = sorted(r[key] for r in runs if r[key] is not None)
        med[key] = vals[len(vals) // 2] if vals else None
    res = H.Results("ceilings", ceilings=med, out=args.out)
    for key, unit in (("copy_TBps", "TB/s"), ("bf16_TFLOPs", "TFLOP/s"), ("fp8_TFLOPs", "TFLOP/s"),
                      ("launch_us", "us")):
        vals = sorted(r[key] for r in runs if r[key] is not None)
        if not vals:
            res.add_error(case=key, impl="torch", error="unavailable on this GPU")
            continue
        med = vals[len(vals) // 2]
        # The schema wants a time in `us`: for a rate we record the time of its unit of
        # work (1 GB moved, 1 TFLOP done) and keep the rate itself beside it.
        us = med if key == "launch_us" else 1e6 / (med * 1e3) if key == "copy_TBps" else 1e6 / med
        res.add(case=key, impl="torch", us=us, value=med, unit=unit, spread=[vals[0], vals[-1]],
                measures=("graph replay of an empty Triton kernel" if key == "launch_us" else
                          COPY_MEASURES if key == "copy_TBps" else
                          "8192^3 matmul (torch.mm / torch._scaled_mm)"))
    res.finish(plot=False)


if __name__ == "__main__":
    main()
