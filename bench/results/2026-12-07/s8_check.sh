#!/usr/bin/env bash
# The eighth session's short GPU call: the engine's memory checks on a GPU (the tests, then a served run whose
# every dispatch goes through them): the shipped text model served on the online and the offline C128 state at a
# saturating rate (offline_c128_over_online). Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
start=$SECONDS
timeout "${TEST_TIMEOUT:-60}" python3 -m pytest -n 0 -q -p no:cacheprovider tests/test_engine_memory.py \
  >"$out/test_engine_memory.log" 2>&1
echo "== test_engine_memory: exit $?, $((SECONDS - start)) s"; tail -3 "$out/test_engine_memory.log"
start=$SECONDS
timeout "${BACKEND_TIMEOUT:-90}" python3 bench/bench_serving.py --sweep-backend online offline --slots 8 \
  --rates inf --num-prompts 128 --input-len 128 --output-len 64 >"$out/backend.log" 2>&1
echo "== backends: exit $?, $((SECONDS - start)) s"; tail -4 "$out/backend.log"
