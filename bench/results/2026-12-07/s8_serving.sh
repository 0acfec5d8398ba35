#!/usr/bin/env bash
# The eighth session's serving call (issue 41): (1) the released V4-Flash slice on a shared 3840-token prefix with
# the prefix cache off and on (its TTFT ratio, the >= 3x target); (2) the shipped text model served on the online
# and the offline C128 state at a saturating rate (offline_c128_over_online); (3) the engine's memory
# checks on a GPU. Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
start=$SECONDS
timeout "${SLICE_PREFIX_TIMEOUT:-420}" python3 bench/bench_serving.py --model v4flash-slice --pages 320 --slots 8 \
  --dataset shared-prefix --prefix-len 3840 --input-len 128 --output-len 32 --num-prompts 32 \
  --sweep-prefix-cache 0 8 --rates 2 >"$out/slice_prefix.log" 2>&1
echo "== slice shared prefix: exit $?, $((SECONDS - start)) s"; tail -6 "$out/slice_prefix.log"
start=$SECONDS
timeout "${BACKEND_TIMEOUT:-90}" python3 bench/bench_serving.py --sweep-backend online offline --slots 8 \
  --rates inf --num-prompts 128 --input-len 128 --output-len 64 >"$out/backend.log" 2>&1
echo "== backends: exit $?, $((SECONDS - start)) s"; tail -4 "$out/backend.log"
start=$SECONDS
timeout "${TEST_TIMEOUT:-60}" python3 -m pytest -n 0 -q -p no:cacheprovider tests/test_engine_memory.py \
  >"$out/test_engine_memory.log" 2>&1
echo "== test_engine_memory: exit $?, $((SECONDS - start)) s"; tail -3 "$out/test_engine_memory.log"
