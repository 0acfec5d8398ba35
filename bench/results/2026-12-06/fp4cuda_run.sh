#!/usr/bin/env bash
# The driver of branch fp4cuda's device call (issue 42, 2026-12-06; run as `cp -r .fp4cuda/. . && <build> && bash
# bench/results/2026-12-06/fp4cuda_run.sh` from a checkout of main with the branch's changed files in .fp4cuda/,
# after `JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q .`):
# the op's and the MoE's tests on the GPU; then bench_moe with FP4 experts at 8, 64 and 512 tokens, the Pallas
# kernel beside the FP4 op (its CUDA kernel), the floor measured in the same run, the device's span under the
# profiler, within LIMIT s (default 280) of START (the call's start, epoch seconds). Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee $OUT/env.txt
python3 -c "import jax_oc128_native.cuda as c; print(c.__file__, sorted(c.registrations()))" | tee -a $OUT/env.txt
el built
# the tests first (the op's and the MoE's, their GPU cases included), then the bench in what is left of LIMIT s
(cd tests && timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -n 8 -p no:cacheprovider test_fp4_gmm_op.py test_moe.py \
  >$OUT/tests.log 2>&1)
el "tests rc $?"; tail -4 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -20
left=$(( ${LIMIT:-280} - ($(date +%s) - ${START:-$t0}) ))
timeout $left python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 512 \
  --dispatches grouped_pallas grouped_fp4_op --rounds 3 --profile /tmp/prof_fp4cuda \
  --out $OUT/bench_moe_fp4cuda.json >$OUT/bench_moe_fp4cuda.log 2>&1
el "bench rc $? (limit ${left} s)"; grep -E "^ +(8|64|512) |device, per call|copy bandwidth|fp4_gmm|triton|Error" $OUT/bench_moe_fp4cuda.log | cut -c1-200
