#!/usr/bin/env bash
# One GPU session: build with CUDA, run the suite, the benchmark, the command-buffer-free GPU tests and
# a memcheck of the CUDA handlers. Logs go to $OUT (the device tool) or ./gpu_out.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_OC128_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q . \
  >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
(cd /tmp && python3 -m jax_oc128 info) | tee "$out/info.txt"
(cd tests && timeout "${TEST_TIMEOUT:-250}" python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-.} 2>&1) \
  | tee "$out/pytest_gpu.log" | tail -15
timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_ops.py ${BENCH_ARGS:-} --out "$out/bench.json" 2>&1 | tee "$out/bench.log"
(cd tests && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 80 python3 -m pytest -q -p no:cacheprovider \
  test_gpu.py test_verify_commit.py -k "gpu or case_matrix" 2>&1) | tee "$out/pytest_gpu_no_cmdbuf.log" | tail -3
(cd tests && timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider test_gpu.py 2>&1) | tee "$out/memcheck.log" | tail -6
