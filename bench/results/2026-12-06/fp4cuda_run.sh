#!/usr/bin/env bash
# The driver of branch fp4cuda's device call (issue 42, 2026-12-06; run as `cp -r .fp4cuda/. . && <build> && bash
# bench/results/2026-12-06/fp4cuda_run.sh` from a checkout of main with the branch's changed files in .fp4cuda/,
# after `JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q .`):
# bench_moe with FP4 experts at 8, 64 and 512 tokens, the Pallas kernel beside the FP4 op (its CUDA kernel) and the
# default dispatch, the
# floor measured in the same run, the device's span under the profiler; then the op's and the MoE's tests on the
# GPU. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee $OUT/env.txt
python3 -c "import jax_oc128_native.cuda as c; print(c.__file__, sorted(c.registrations()))" | tee -a $OUT/env.txt
el built
timeout ${BENCH_TIMEOUT:-150} python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 512 \
  --dispatches grouped_pallas grouped_fp4_op grouped --rounds 3 --profile /tmp/prof_fp4cuda \
  --out $OUT/bench_moe_fp4cuda.json >$OUT/bench_moe_fp4cuda.log 2>&1
el "bench rc $?"; grep -E "^ +(8|64|512) |device, per call|copy bandwidth|fp4_gmm|triton|Error" $OUT/bench_moe_fp4cuda.log | cut -c1-200
(cd tests && timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -n 8 -p no:cacheprovider test_fp4_gmm_op.py test_moe.py \
  >$OUT/tests.log 2>&1)
el "tests rc $?"; tail -4 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -20
