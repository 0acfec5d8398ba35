#!/usr/bin/env bash
# The GPU call the eleventh session could not run (its device time ended), for a tree with branches `fp4pipe`
# (the FP4/FP8 decode kernel's cp.async pipeline) and `hcfuse` (the hyper-connections' contractions elementwise)
# laid over main: the quantized grouped matmul's GPU tests, the FP4 MoE layer at 8 and 64 tokens as the decode
# loop runs it (profiled: each kernel's time), the released slice's plain decode step at a 4k context, 8 slots,
# device-only (issue 42: 1.5x its weight-read floor), and with PROFILE4K=1 that step by scope. DECODE=0 stops
# after the MoE layer. ~420 s on an H100 (PROFILE4K: ~240 s more, a call of its own). Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -n 4 -q -p no:cacheprovider \
  test_quant_gmm_op.py test_moe.py -k "quant or fp4" >"$out/tests.log" 2>&1)
echo "== tests: exit $?, $((SECONDS - start)) s"; tail -4 "$out/tests.log"
start=$SECONDS
timeout "${MOE_TIMEOUT:-120}" python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --dispatches grouped \
  --loop 8 --rounds 2 --profile /tmp/moe_prof --out "$out/moe_loop.json" >"$out/moe_loop.log" 2>&1
echo "== moe loop: exit $?, $((SECONDS - start)) s"; sed -n '/^ms per MoE/,$p' "$out/moe_loop.log" | grep -v "^wrote" | head -40
[ "${DECODE:-1}" = 1 ] || exit 0  # DECODE=0: the tests and the MoE layer only
start=$SECONDS
timeout "${ROW_TIMEOUT:-240}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots 8 --steps-per-dispatch 16 --prompt-len 3072 \
  --device-only --device-steps 64 --max-len 4096 --out "$out/decode_3072.json" >"$out/decode_3072.log" 2>&1
echo "== decode 4k: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_3072.log" | tail -1
grep -E "s$" "$out/decode_3072.log" | grep -v "^|" | tail -5
[ "${PROFILE4K:-0}" = 1 ] || exit 0  # PROFILE4K=1: the same step profiled by scope (command buffers off: a compile of its own)
rm -rf /tmp/prof4k; start=$SECONDS
XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "${PROFILE_TIMEOUT:-240}" python3 bench/bench_decode.py \
  --configs v4flash-slice --layers 6 --experts 256 --weights released --backends online --modes plain --slots 8 \
  --steps-per-dispatch 16 --prompt-len 3072 --device-only --device-steps 32 --max-len 4096 --profile /tmp/prof4k \
  --out "$out/profile_4k.json" >"$out/profile_4k.log" 2>&1
echo "== profile 4k: exit $?, $((SECONDS - start)) s"
for row in /tmp/prof4k/*; do python3 bench/step_kernels.py "$row" --steps 16 --detail - target/attention \
  target/hyper_connection target/mlp/routed_experts target/mlp/route; done 2>&1 | tee "$out/step_kernels_4k.log" | head -90
