#!/usr/bin/env bash
# A device call's work in lanes, one GPU each, on the GPU box (the `device` tool), from the repo root:
#   bash e2e/gpu_lanes.sh LIMIT_S "LANE0 STEPS" ["LANE1 STEPS" ...]
# A step is KIND:VERSION[:ARGS], run on Triton VERSION (3.6: the box's own; another one as staged by
# ../shared/gpu-stack's unpack.sh in /tmp/triton-VERSION.0, earlier in the same call or lease):
#   suite:V[:WORKERS[:CAP_S[:TESTS]]]  the GPU test suite (e2e/gpu_check.sh, 15 workers), taken up where
#                              an earlier call of the same warm machine stopped (its finished-tests list);
#                              TESTS: comma-separated test paths instead of every test
#   host:V                     host time per call (e2e/triton_versions.py --tables), on 4 pinned cores
#   table:V:OPS:TABLES         main-job tables, comma-separated (python -m fk_runtime --no-check --no-host)
#   rows:V:FN                  e2e/row_variants.py with the arguments that bash function FN puts in the
#                              array ARGS (defined in $FK_LANES_JOBS, a file sourced here); tuning cache empty
#   first:V                    e2e/first_call.py
#   sh:V:FN                    bash function FN of $FK_LANES_JOBS (a probe; its output in the step's log)
# Each step gets what is left of LIMIT_S (the call's own limit less the staging), so that every result
# comes back. Results stay in $FK_LANES_DIR (default /tmp/lanes: a later call on the warm machine
# resumes there); this call's go back under $OUT as one archive (the device tool returns a few files
# a call), logs printed. A rows step tunes into an empty cache (FK_CACHE_DIR), so that row_variants
# lists every pick the tuner made.
# FK_LANES_DRY=1: print each step's command instead of running it.
set -u
limit=${1:?usage: gpu_lanes.sh LIMIT_S "LANE0 STEPS" ["LANE1 STEPS" ...]}; shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
runs=${FK_LANES_DIR:-/tmp/lanes}; mkdir -p "$runs"  # (the dry-mode test keeps out of a real call's folder)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "${FK_LANES_JOBS:-}" ] && source "$FK_LANES_JOBS"
from_src=(bash shared/from-source.sh python3)

step() {
  local gpu=$1 spec=$2 kind version args dir left site cmd
  IFS=: read -r kind version args <<< "$spec"
  dir=$runs/${spec//[:,]/_}
  left=$(( limit - ($(date +%s) - start) - 10 ))
  if [ "$left" -lt 30 ]; then echo "skipped $spec: ${left} s left"; return; fi
  site=""; [ "$version" != 3.6 ] && site=/tmp/triton-$version.0
  case $kind in
    suite) local workers=${args%%:*} cap=${args#*:} tests=""
           [[ $args == *:* ]] || cap=$left; workers=${workers:-15}
           [[ $cap == *:* ]] && { tests=${cap#*:}; cap=${cap%%:*}; }
           [ "$cap" -gt "$left" ] && cap=$left
           dir=$runs/suite-$version  # one folder per version: a later call resumes from its list
           cmd=(env FK_GPU_RESUME=1 FK_GPU_WORKERS="$workers" bash e2e/gpu_check.sh "$dir" "$cap" 0 ${tests//,/ });;
    host)  cmd=(timeout -s INT "$left" taskset -c $(( 8 + 4 * gpu ))-$(( 11 + 4 * gpu ))
                "${from_src[@]}" e2e/triton_versions.py --out "$dir" --tables);;
    table) local tables=${args#*:}
           cmd=(timeout -s INT "$left" "${from_src[@]}" -m fk_runtime --ops "${args%%:*}" --no-check --no-host
                --out "$dir" --tables ${tables//,/ });;
    rows)  local ARGS=(); "$args"
           cmd=(env FK_CACHE_DIR="$dir/tuned" timeout -s INT "$left" "${from_src[@]}" e2e/row_variants.py
                --out "$dir" "${ARGS[@]}");;
    first) cmd=(timeout -s INT "$left" "${from_src[@]}" e2e/first_call.py --out "$dir");;
    sh)    cmd=(timeout -s INT "$left" bash -c "source \"\$FK_LANES_JOBS\" && $args");;
    *) echo "unknown step $spec"; return;;
  esac
  if [ "${FK_LANES_DRY:-0}" = 1 ]; then echo "gpu$gpu ${site:-box} ${cmd[*]}"; return; fi
  if [ -n "$site" ] && [ ! -f "$site/.ready" ]; then echo "skipped $spec: Triton $version is not staged"; return; fi
  rm -rf "$dir/tuned"; mkdir -p "$dir"
  echo "== $(date +%T) gpu$gpu $spec (${left} s left)"
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$site "${cmd[@]}" > "$dir/log" 2>&1
  echo "   $(date +%T) $spec: rc $?"; grep -aE "^(tests:|FAILED|ERROR|wrote|\| )" "$dir/log" | tail -n 40 | cut -c1-240
}

lane=0
for steps in "$@"; do
  ( for s in $steps; do step "$lane" "$s"; done ) > "$runs/lane$lane.log" 2>&1 &
  lane=$(( lane + 1 ))
done
wait
for (( i = 0; i < lane; i++ )); do cat "$runs/lane$i.log"; done
if [ "${FK_LANES_DRY:-0}" != 1 ] && [ -n "${OUT:-}" ]; then
  (cd "$runs" && find . -newermt "@$start" -type f ! -name '*.before' | tar -czf "$OUT/lanes.tgz" -T -)
  echo "$(( $(date +%s) - start )) s; results in \$OUT/lanes.tgz"
fi
