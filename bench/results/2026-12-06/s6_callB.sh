#!/usr/bin/env bash
# The sixth session's serving call (issue 41): the prefix cache on a shared 3840-token prefix (the shipped text
# model: its 4096 positions), and the released V4-Flash slice behind the server against Engine.generate. Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
start=$SECONDS
timeout "${SLICE_TIMEOUT:-300}" python3 bench/bench_serving.py --model v4flash-slice --slots 8 --rates inf \
  --num-prompts 64 --input-len 512 --output-len 64 --offline >"$out/slice_serving.log" 2>&1
echo "== slice serving: exit $?, $((SECONDS - start)) s"; grep -E "^\||engine|prefills" "$out/slice_serving.log" | tail -12
start=$SECONDS
timeout "${PREFIX_TIMEOUT:-200}" python3 bench/bench_serving.py --pages 320 --slots 8 --dataset shared-prefix \
  --prefix-len 3840 --input-len 128 --output-len 64 --num-prompts 64 --sweep-prefix-cache 0 8 --rates 2 inf \
  >"$out/shared_prefix.log" 2>&1
echo "== shared prefix: exit $?, $((SECONDS - start)) s"; grep -E "^\||ttft|TTFT" "$out/shared_prefix.log" | tail -14
