#!/usr/bin/env bash
# One call on the GPU machine: install carried wheels, run the GPU tests of the named
# operators, then their benchmarks; copy logs, results and plots to $OUT.
#
#   benchmarks/device.sh [--tests-only|--bench-only] [--quick] [--gpu-marked-only] NAME...
#   NAME: ceilings decode router moe ... (tests: every test in tests/test_<name>*.py, the small
#   interpreter-sized ones too, so the GPU compiler sees them; --gpu-marked-only: just -m gpu)
#   PYTEST_ARGS is passed to pytest: PYTEST_ARGS="--shard 1/3" runs a third of each suite's test functions
#   (tests/conftest.py; the decode GPU suite has 234 tests (round BB), of which 100 took 530 s on an H200 in round BA2);
#   PYTEST_ARGS="-n 8" (pytest-xdist, in the test extra) runs each suite on 8 workers sharing the GPU: the whole
#   GPU-marked suite, 517 tests, took 295 s that way in round BC2
#
# Carried wheels: every folder .whl* in the repo root is installed to a temporary folder
# (--no-deps, no registry needed) and put on PYTHONPATH.
# Everything is written under a scratch folder and packed into $OUT/bundle.tgz at the
# end (one file comes back, however many results and logs were written).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
FINAL_OUT=$OUT
OUT=$(mktemp -d)
mkdir -p "$FINAL_OUT"
trap 'tar -C "$OUT" -czf "$FINAL_OUT/bundle.tgz" . ; echo "[device] bundle: $(tar -tzf "$FINAL_OUT/bundle.tgz" | tr "\n" " ")"' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
tests=1 bench=1 quick=() marker=""
names=()
for a in "$@"; do
  case "$a" in
    --tests-only) bench=0 ;;
    --bench-only) tests=0 ;;
    --quick) quick=(--quick) ;;
    --gpu-marked-only) marker="-m gpu" ;;
    *) names+=("$a") ;;
  esac
done
shopt -s nullglob
whls=(.whl*/*.whl)
SITE=$(mktemp -d)
if [ ${#whls[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whls[@]}" \
    && export PYTHONPATH="$PYTHONPATH:$SITE" || echo "[device] wheel install failed"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
status=0
run_tests() {  # $1 = name; every test in tests/test_<name>*.py
  local n=$1 files=(tests/test_$1*.py)
  [ ${#files[@]} -gt 0 ] || return 0
  python3 -m pytest -q $marker ${PYTEST_ARGS:-} -p no:cacheprovider "${files[@]}" > "$OUT/test_$n.log" 2>&1
}
if [ $tests = 1 ]; then
  # Test files run side by side: they are mostly Triton compiles (CPU-bound, 16 cores);
  # the GPU is only lightly shared. Benchmarks run afterwards, alone.
  pids=()
  for n in "${names[@]}"; do
    [ "$n" = ceilings ] && continue
    run_tests "$n" & pids+=("$!:$n")
  done
  for pn in "${pids[@]}"; do
    wait "${pn%%:*}" || status=1
    echo "== GPU tests: ${pn#*:}: $(tail -1 "$OUT/test_${pn#*:}.log")"
  done
  for n in "${names[@]}"; do
    [ -f "$OUT/test_$n.log" ] && grep -E "^(FAILED|ERROR)" "$OUT/test_$n.log" | head -15
  done
fi
if [ $bench = 1 ]; then
  for n in "${names[@]}"; do
    [ -f "benchmarks/$n.py" ] || continue
    echo "== benchmark: $n"
    python3 "benchmarks/$n.py" "${quick[@]}" --out "$OUT/results" > "$OUT/bench_$n.log" 2>&1 || status=1
    tail -40 "$OUT/bench_$n.log"
  done
fi
exit $status
