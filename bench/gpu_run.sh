#!/usr/bin/env bash
# One GPU session: build with CUDA, run the suite, the benchmark (C128 ops per speculative step in the model's
# pattern, SGLang's and the launch floor), the engine serving paged caches (CAPACITY_ARGS), the decode loop's
# benchmark (device-only vs end-to-end, DECODE_ARGS), the command-buffer-free GPU tests, compute-sanitizer's
# memcheck, racecheck, initcheck and synccheck of the CUDA handlers and a kernel profile. Logs go to $OUT (the
# device tool) or ./gpu_out.
# STAGES picks what runs (default: all), e.g. STAGES="lane demo": the GPU lane (pytest -m gpu) and the demo.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_OC128_REQUIRE_GPU=1
JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q . \
  >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; (cd /tmp && python3 -m jax_oc128 info); } \
  | tee "$out/env.txt"
stage() { [ -z "${STAGES:-}" ] || [[ " $STAGES " == *" $1 "* ]]; }
# pytest on WORKERS processes sharing the GPU (tests/conftest.py turns preallocation off); every test's outcome
# is logged as it ends, so the failing ones are named even when the timeout stops the run
suite() {  # suite NAME TIMEOUT PYTEST_ARGS...
  local name=$1 limit=$2; shift 2
  (cd tests && timeout "$limit" python3 -m pytest -n "${WORKERS:-16}" -v -rfE -p no:cacheprovider --durations=15 "$@" \
    2>&1) >"$out/$name.log"
  echo "== $name: exit $?, $(grep -cE ' PASSED ' "$out/$name.log") passed"
  grep -E '^(FAILED|ERROR) |\] (FAILED|ERROR) ' "$out/$name.log" | sed -E 's/^.*(FAILED|ERROR) /\1 /' | sort -u
  grep -E '^=+ .*(passed|failed).* in ' "$out/$name.log" | tail -1
}
stage lane && suite pytest_gpu_lane "${LANE_TIMEOUT:-150}" -m gpu
stage suite && suite pytest_gpu "${TEST_TIMEOUT:-400}" ${TEST_ARGS:-.}
# the demo from a cold start (no compilation cache), its phases on stderr, then again from the cache it filled
stage demo && for run in cold warm; do
  start=$SECONDS
  (cd /tmp && XDG_CACHE_HOME=/tmp/demo_cache timeout "${DEMO_TIMEOUT:-240}" python3 -m jax_oc128 demo \
    2>"$out/demo_${run}_stderr.log") >"$out/demo_$run.txt"
  echo "== demo $run: exit $?, $((SECONDS - start)) s"; grep '^demo, ' "$out/demo_${run}_stderr.log"; tail -8 "$out/demo_$run.txt"
done
stage bench && timeout "${BENCH_TIMEOUT:-500}" python3 bench/bench_ops.py ${BENCH_ARGS:-} --out "$out/bench.json" 2>&1 | tee "$out/bench.log"
# the engine serving the requests paged caches fit where per-slot caches run out (CAPACITY_ARGS: e.g. V4-Flash's
# 64 query heads with the prompts prefilled in chunks)
stage capacity && timeout "${CAPACITY_TIMEOUT:-300}" python3 bench/serve_capacity.py ${CAPACITY_ARGS:-} \
  --out "$out/serve_capacity.json" 2>&1 | tee "$out/serve_capacity.log"
stage decode && timeout "${DECODE_TIMEOUT:-500}" python3 bench/bench_decode.py ${DECODE_ARGS:-} --out "$out/bench_decode.json" 2>&1 \
  | tee "$out/bench_decode.log"
# where a decode step's kernels go, by the model's named scopes (bench/step_kernels.py): the V4-Flash slice in the
# released precision traced with XLA's command buffers off (a CUDA graph shows as one kernel), PROFILE_ARGS as
# bench_decode's row (default: 8 slots plain)
stage profile && { rm -rf /tmp/prof /tmp/hlo; XLA_PYTHON_CLIENT_MEM_FRACTION=.95 \
  XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_decode" \
  timeout "${PROFILE_TIMEOUT:-300}" python3 bench/bench_decode.py --configs v4flash-slice --experts 256 --layers 6 \
  --weights released --backends online --steps-per-dispatch 16 --device-steps 32 --tokens 32 \
  ${PROFILE_ARGS:---modes plain --slots 8} --profile /tmp/prof --out "$out/profile.json" >"$out/profile.log" 2>&1
  for row in /tmp/prof/*; do python3 bench/step_kernels.py "$row" --steps 16 --hlo /tmp/hlo --detail - \
    target/attention target/hyper_connection target/attention/compressor; done 2>&1 | tee "$out/step_kernels.log"; }
stage nocmdbuf && (cd tests && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 80 python3 -m pytest -q -p no:cacheprovider \
  test_gpu.py test_verify_commit.py -k "gpu or case_matrix" 2>&1) | tee "$out/pytest_gpu_no_cmdbuf.log" | tail -3
# the sanitizers over the CUDA handlers of the GPU tests and of every on-device policy; synccheck with XLA's
# command buffers off (the tool crashes under them)
for tool in memcheck racecheck initcheck synccheck; do
  flags=""; [ "$tool" = synccheck ] && flags="--xla_gpu_enable_command_buffer="
  stage "$tool" && (cd tests && XLA_FLAGS="$flags" timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" \
    --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_misuse_ops.py \
    -k "gpu or (on_device_policy and float32)" 2>&1) | tee "$out/$tool.log" | tail -6
done
stage ncu && (cd bench && timeout 100 ncu --clock-control none -k 'regex:verify_kernel|commit_kernel' --metrics \
  gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
  python3 profile_kernels.py --batch 8 256 2>&1) | grep -vE '^==PROF==' | tee "$out/ncu.log" | tail -40
