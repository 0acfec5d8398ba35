#!/usr/bin/env bash
# The fifth session's last GPU call: the indexer op's GPU tests and its cost against the jnp path's key chunks,
# the slice's prefill with the attention and indexer kernels at 8k and 128k, the FP4 MoE layer. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q . \
  >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/env.txt"
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -n 4 -p no:cacheprovider test_indexer_op.py \
  test_csa_indexer.py test_attention_op.py 2>&1) >"$out/tests.log"
echo "== tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -15
L=8192 E=32768 timeout "${PROBE_TIMEOUT:-60}" python3 bench/results/2026-12-06/s5_indexer_op_probe.py 2>&1 | tee "$out/indexer_op_probe.log"
start=$SECONDS
timeout "${PREFILL_TIMEOUT:-190}" python3 bench/bench_prefill.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --prompt-lens ${PROMPT_LENS:-8192 131072} --chunks 8192 --attention-impl kernel --reps 2 \
  --out "$out/prefill_kernel.json" >"$out/prefill_kernel.log" 2>&1
echo "== prefill kernel: exit $?, $((SECONDS - start)) s"; grep -v "^ *$" "$out/prefill_kernel.log" | tail -14
[ -n "${SKIP_MOE:-}" ] && exit 0
timeout 70 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 512 2048 8192 \
  --dispatches grouped_pallas grouped --rounds 2 --out "$out/bench_moe.json" >"$out/bench_moe.log" 2>&1
echo "== bench_moe: exit $?"; grep -A8 "^tokens" "$out/bench_moe.log"
