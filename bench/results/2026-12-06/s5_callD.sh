#!/usr/bin/env bash
# The fifth session's third H100 call: serving (issue 41) with the prefix cache on a shared 3072-token prefix
# (the shipped text model) and the released V4-Flash slice behind the server against Engine.generate. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q . \
  >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/env.txt"
start=$SECONDS
timeout "${PREFIX_TIMEOUT:-200}" python3 bench/bench_serving.py --pages 256 --slots 8 --dataset shared-prefix \
  --prefix-len 3072 --input-len 128 --output-len 64 --num-prompts 64 --sweep-prefix-cache 0 8 --rates 2 inf \
  >"$out/shared_prefix.log" 2>&1
echo "== shared prefix: exit $?, $((SECONDS - start)) s"; grep -E "^\||ttft|TTFT" "$out/shared_prefix.log" | tail -12
start=$SECONDS
timeout "${SLICE_TIMEOUT:-280}" python3 bench/bench_serving.py --model v4flash-slice --slots 8 --rates inf \
  --num-prompts 64 --input-len 512 --output-len 64 --offline >"$out/slice_serving.log" 2>&1
echo "== slice serving: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/slice_serving.log" | tail -8
