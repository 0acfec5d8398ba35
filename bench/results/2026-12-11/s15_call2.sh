#!/usr/bin/env bash
# The fifteenth session's second GPU call: the FP4 MoE layer in the decode loop's form (a loop of 8 at 8 and 64
# tokens) with main's kernel (MAIN_CU: `git show 3d12249:ffi/quant_gmm_cuda.cu`) and with this tree's (pairs, one multiply, 4
# blocks a multiprocessor), one machine; the op's GPU tests on this tree's; the released slice's plain decode
# step at a 4k context, 8 slots, device-only. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
build() {  # $1: the source tree
  start=$SECONDS
  (cd "$1" && JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -q .) \
    >"$out/build_$2.log" 2>&1 || { tail -30 "$out/build_$2.log"; exit 1; }
  echo "== build $2: $((SECONDS - start)) s"
}
moe() {  # $1: a name for the logs
  start=$SECONDS
  timeout 100 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --loop 8 --dispatches grouped --rounds 3 \
    --out "$out/moe_loop_$1.json" >"$out/moe_loop_$1.log" 2>&1
  echo "== moe loop $1: exit $?, $((SECONDS - start)) s"; grep "copy bandwidth" "$out/moe_loop_$1.log" | cut -c1-60
  sed -n '/^ms per MoE/,$p' "$out/moe_loop_$1.log" | grep -v "^wrote" | grep -v "  us  " | head -8
}
if [ -f "${MAIN_CU:-}" ]; then
  rm -rf /tmp/maintree; mkdir -p /tmp/maintree
  git ls-files -z 2>/dev/null | xargs -0 -I{} cp --parents {} /tmp/maintree/ 2>/dev/null || cp -r . /tmp/maintree
  cp "$MAIN_CU" /tmp/maintree/ffi/quant_gmm_cuda.cu
  build /tmp/maintree main; moe main
fi
build . tree; moe tree
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout 100 python3 -m pytest -n 4 -q -p no:cacheprovider test_quant_gmm_op.py \
  >"$out/tests.log" 2>&1)
echo "== tests: exit $?, $((SECONDS - start)) s"; tail -2 "$out/tests.log"
start=$SECONDS
timeout "${ROW_TIMEOUT:-220}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots 8 --steps-per-dispatch 16 --prompt-len 3072 \
  --device-only --device-steps 64 --max-len 4096 --out "$out/decode_3072.json" >"$out/decode_3072.log" 2>&1
echo "== decode 4k: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_3072.log" | tail -3
grep -iE "floor|step" "$out/decode_3072.log" | grep -v "^|" | tail -6
