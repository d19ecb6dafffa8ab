#!/usr/bin/env bash
# One Triton version's GPU check, on the Triton that `python3` imports (a GPU box without network:
# run from source; another Triton is put first on PYTHONPATH by the caller):
#   bash e2e/gpu_check.sh OUT_DIR [TEST_SECONDS] [DEVICE_BUDGET_S] [TESTS...]
# 1. the test suite on the GPU, FK_GPU_WORKERS workers (default 10: compiles run in parallel), SIGINT after
#    TEST_SECONDS (default 330) so that pytest still prints its summary and slowest tests; every
#    worker left is killed before anything is timed; each finished test's id goes to
#    OUT_DIR/finished-<triton>.txt, and FK_GPU_RESUME=1 leaves out the tests that file already names
#    (a suite cut short by a call's time limit goes on in the next call);
# 2. e2e/triton_versions.py (host time per call, launches through Triton's dispatch, fk's device
#    time on the main tables' rows until DEVICE_BUDGET_S, default 120; 0 skips it).
# The defaults fit one 600-second device call on an H100 (the suite took about 300 s with 10
# workers on Triton 3.9, 2026-11-27; the host rows and their compiles about 100 s).
# Logs and results in OUT_DIR: tests-<triton>.log, versions-<triton>.json, versions-<triton>.log.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [TEST_SECONDS] [DEVICE_BUDGET_S] [TESTS...]}
test_s=${2:-330}
budget_s=${3:-120}
shift $(( $# < 3 ? $# : 3 ))
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(shared/tests packages tests)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
version=$(python3 -c "import triton; print(triton.__version__)")
# Triton 3.9 looks up its Blackwell ptxas on every compile: a staged copy without it (../shared/gpu-stack
# drops it) points that at its sm_90 ptxas, all an H100 or H200 run uses.
bin=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin'))")
if [ -z "${TRITON_PTXAS_BLACKWELL_PATH:-}" ] && [ -x "$bin/ptxas" ] && [ ! -e "$bin/ptxas-blackwell" ]; then
  export TRITON_PTXAS_BLACKWELL_PATH="$bin/ptxas"
fi
python3 -c "import torch, numpy; print('triton $version, torch', torch.__version__, 'numpy', numpy.__version__,
torch.cuda.get_device_name())"
if [ "$test_s" -gt 0 ]; then
  start=$(date +%s)
  export FK_TESTS_LOG="$out/finished-$version.txt"
  if [ "${FK_GPU_RESUME:-0}" = 1 ] && [ -s "$FK_TESTS_LOG" ]; then
    cp "$FK_TESTS_LOG" "$out/finished-$version.before"; export FK_TESTS_DONE="$out/finished-$version.before"
    [ -f "$out/tests-$version.log" ] && mv "$out/tests-$version.log" "$out/tests-$version.$(date +%H%M%S).log"
    echo "resuming: $(wc -l < "$FK_TESTS_DONE") tests finished before are left out"
  fi
  timeout -s INT -k 20 "$test_s" bash shared/from-source.sh python3 -m pytest -v -n "${FK_GPU_WORKERS:-10}" -p no:cacheprovider \
    -p no:benchmark -rfE --durations=25 "${tests[@]}" > "$out/tests-$version.log" 2>&1 &
  group=$!  # timeout leads a process group of its own: pytest and its xdist workers
  wait $group
  echo "tests: rc $?, $(( $(date +%s) - start )) s, $(grep -c ' PASSED ' "$out/tests-$version.log") passed," \
    "$(grep -c ' SKIPPED ' "$out/tests-$version.log") skipped, of $(grep -oE '\[[0-9]+ items\]' "$out/tests-$version.log")"
  grep -aE "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$out/tests-$version.log" | tail -30
  # every worker left, of this run only (a pattern kill ended another version's suite running beside it)
  kill -- -$group 2>/dev/null; sleep 2
fi
if [ "$budget_s" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 20 $(( budget_s + 150 )) bash shared/from-source.sh python3 e2e/triton_versions.py --out "$out" \
    --budget-s "$budget_s" > "$out/versions-$version.log" 2>&1
  echo "versions: rc $?, $(( $(date +%s) - start )) s"; grep -a "^wrote" "$out/versions-$version.log"
fi
