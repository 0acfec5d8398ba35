#!/usr/bin/env bash
# The eighth session's serving call (issue 41): (1) the released V4-Flash slice on a shared 3840-token prefix with
# the prefix cache off and on (its TTFT ratio, the >= 3x target); (2) the shipped text model served on the online
# and the offline C128 state at a saturating rate, plain and with a chain of 2 (offline_c128_over_online). Logs to
# $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
start=$SECONDS
timeout "${SLICE_PREFIX_TIMEOUT:-420}" python3 bench/bench_serving.py --model v4flash-slice --pages 320 --slots 8 \
  --dataset shared-prefix --prefix-len 3840 --input-len 128 --output-len 32 --num-prompts 32 \
  --sweep-prefix-cache 0 8 --rates 2 >"$out/slice_prefix.log" 2>&1
echo "== slice shared prefix: exit $?, $((SECONDS - start)) s"; tail -6 "$out/slice_prefix.log"
for draft in "" "--draft 2"; do
  start=$SECONDS
  timeout "${BACKEND_TIMEOUT:-60}" python3 bench/bench_serving.py --sweep-backend online offline $draft --slots 8 \
    --rates inf --num-prompts 128 --input-len 128 --output-len 64 >"$out/backend${draft// /}.log" 2>&1
  echo "== backends ${draft:-plain}: exit $?, $((SECONDS - start)) s"; tail -4 "$out/backend${draft// /}.log"
done
