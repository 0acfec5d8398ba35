#!/usr/bin/env bash
# The fifteenth session's first GPU call: the FP4/FP8 decode kernel with FP4 codes decoded in pairs and one
# multiply a pair (ffi/quant_gmm_cuda.cu) alone against main's (MAIN_CU: `git show 3d12249:ffi/quant_gmm_cuda.cu`)
# and at 4 blocks a multiprocessor (quant_gmm_probe.sh); the op's and the MoE's GPU tests; the FP4 MoE layer as
# issue 42's rows measure it (a loop of 8 at 8 and 64 tokens; one call at 512-8192). Logs to $OUT. It ran on
# the kernel at 3 blocks a multiprocessor (0eb5ebc), when the probe's mb4 was 4: today VARIANTS="mb3 base".
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
start=$SECONDS
OUT=$out/probe VARIANTS="base mb4" timeout 120 bash "$here/../2026-12-08/quant_gmm_probe.sh" 2>&1 | grep -vE "^\s*$" | tail -24
if [ -f "${MAIN_CU:-}" ]; then
  rm -rf /tmp/maintree; mkdir -p /tmp/maintree/ffi; cp ffi/*.h /tmp/maintree/ffi/; cp "$MAIN_CU" /tmp/maintree/ffi/quant_gmm_cuda.cu
  (cd /tmp/maintree && OUT=$out/probe_main VARIANTS="base mb4" timeout 120 bash "$here/../2026-12-08/quant_gmm_probe.sh" 2>&1 \
    | grep -vE "^\s*$" | sed 's/^== /== main /' | tail -24)
fi
echo "== kernel probe: $((SECONDS - start)) s"
start=$SECONDS
source "$here/../2026-12-06/s5_build.sh"
echo "== build: $((SECONDS - start)) s"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -n 4 -q -p no:cacheprovider \
  test_quant_gmm_op.py test_moe.py test_linear.py -k "quant or fp4 or fp8 or cuda" >"$out/tests.log" 2>&1)
echo "== tests: exit $?, $((SECONDS - start)) s"; tail -6 "$out/tests.log"
moe() {  # $1: a name for the logs, the rest: bench_moe's arguments
  name=$1; shift; start=$SECONDS
  timeout 150 python3 bench/bench_moe.py "$@" --dispatches grouped --rounds 2 --out "$out/moe_$name.json" \
    >"$out/moe_$name.log" 2>&1
  echo "== moe $name: exit $?, $((SECONDS - start)) s"; grep "copy bandwidth" "$out/moe_$name.log" | cut -c1-60
  sed -n '/^ms per MoE/,$p' "$out/moe_$name.log" | grep -v "^wrote" | grep -v "  us  " | head -12
}
moe fp4_loop --experts-format fp4 --tokens 8 64 --loop 8
[ -n "${SHORT:-}" ] || moe fp4 --experts-format fp4 --tokens 512 2048 8192
