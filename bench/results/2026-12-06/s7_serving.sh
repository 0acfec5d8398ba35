#!/usr/bin/env bash
# The seventh session's serving call (issue 41), three parts, each under its own limit: (1) the shipped text model
# served against Engine.generate at a saturating rate, 8 and 32 slots (the 1.15x target; section 32's command),
# (2) the prefix cache on a shared 3840-token prefix (its 4096 positions; TTFT with and without), (3) the released
# V4-Flash slice served against Engine.generate, (4) the slice on the shared prefix with and without the cache (its
# TTFT ratio; ~400 s, a call of its own). PARTS narrows them (default "1 2 3"). Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
for part in ${PARTS:-1 2 3}; do
  start=$SECONDS
  case $part in
  1) timeout "${SHIPPED_TIMEOUT:-200}" python3 bench/bench_serving.py --sweep-slots 8 32 --steps-per-dispatch 16 \
       --rates inf --num-prompts 128 --input-len 128 --output-len 64 --offline >"$out/shipped_saturating.log" 2>&1
     echo "== shipped, saturating: exit $?, $((SECONDS - start)) s"; tail -7 "$out/shipped_saturating.log" ;;
  2) timeout "${PREFIX_TIMEOUT:-200}" python3 bench/bench_serving.py --pages 320 --slots 8 --dataset shared-prefix \
       --prefix-len 3840 --input-len 128 --output-len 64 --num-prompts 64 --sweep-prefix-cache 0 8 --rates 2 inf \
       >"$out/shared_prefix.log" 2>&1
     echo "== shared prefix: exit $?, $((SECONDS - start)) s"; tail -8 "$out/shared_prefix.log" ;;
  3) timeout "${SLICE_TIMEOUT:-300}" python3 bench/bench_serving.py --model v4flash-slice --slots 8 --rates inf \
       --num-prompts 64 --input-len 512 --output-len 64 --offline >"$out/slice_serving.log" 2>&1
     echo "== slice serving: exit $?, $((SECONDS - start)) s"; tail -8 "$out/slice_serving.log" ;;
  4) timeout "${SLICE_PREFIX_TIMEOUT:-480}" python3 bench/bench_serving.py --model v4flash-slice --pages 320 --slots 8 \
       --dataset shared-prefix --prefix-len 3840 --input-len 128 --output-len 32 --num-prompts 32 \
       --sweep-prefix-cache 0 8 --rates 2 >"$out/slice_prefix.log" 2>&1
     echo "== slice shared prefix: exit $?, $((SECONDS - start)) s"; tail -6 "$out/slice_prefix.log" ;;
  esac
done
