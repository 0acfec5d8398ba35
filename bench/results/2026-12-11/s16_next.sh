#!/usr/bin/env bash
# Issue 42's rows not measured with the FP4 kernel of RESULTS section 43, for the next GPU session; PART picks:
#   a (~350 s on an H100): the kernel alone and its constants' variants (quant_gmm_probe.sh: with fewer
#     registers than section 41's kernel, larger blocks or fewer warps may now win); the op's GPU tests; the FP4
#     MoE layer in a loop of 8 at 8 and 64 tokens; the FP4 layer at 128-1024 tokens by the Pallas kernel and by
#     the op (whether the op should take more than 1.5 pairs an expert); the FP8 linears at 8 and 64 tokens each
#     way (bench_linear.py);
#   b (~500 s): the released slice's plain decode step at a 4k context, device-only, 8 slots and 64 (the
#     engine's default chunk at 64 slots is now 256: a 3072-token prompt in each of 64 rows at 2048 a forward
#     needed ~83 GiB of temporaries);
#   c (~300 s): N = 4 at 8 slots, online and offline.
# On an H200, a and b are issue 42's H200 rows. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
slice="--configs v4flash-slice --layers 6 --experts 256 --weights released --steps-per-dispatch 16 --prompt-len 3072
  --device-only --device-steps 64 --max-len 4096"
step() {  # $1: a name for the logs, the rest: bench_decode's arguments
  name=$1; shift; start=$SECONDS
  # shellcheck disable=SC2086
  timeout "${ROW_TIMEOUT:-300}" python3 bench/bench_decode.py $slice "$@" --out "$out/decode_$name.json" \
    >"$out/decode_$name.log" 2>&1
  echo "== decode $name: exit $?, $((SECONDS - start)) s"; grep -E "^\| v4" "$out/decode_$name.log" | tail -4
}
if [ "${PART:-a}" = a ]; then
  OUT=$out/probe timeout 150 bash "$here/../2026-12-08/quant_gmm_probe.sh" 2>&1 | grep -vE "^\s*$"
  source "$here/../2026-12-06/s5_build.sh"
  export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
  start=$SECONDS
  (cd tests && JAX_OC128_REQUIRE_GPU=1 timeout 100 python3 -m pytest -n 4 -q -p no:cacheprovider test_quant_gmm_op.py \
    >"$out/tests.log" 2>&1)
  echo "== tests: exit $?, $((SECONDS - start)) s"; tail -1 "$out/tests.log"
  start=$SECONDS
  timeout 100 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --loop 8 --dispatches grouped --rounds 3 \
    --out "$out/moe_loop.json" >"$out/moe_loop.log" 2>&1
  echo "== moe loop: exit $?, $((SECONDS - start)) s"; sed -n '/^device:/p;/^ms per MoE/,$p' "$out/moe_loop.log" | head -9
  # where the op could take over from the Pallas kernel (quant_gmm.PAIRS_PER_EXPERT, 1.5: 64 tokens): tiles of 16
  # rows up to 512 tokens (12 pairs an expert), one pass of the op's kernel a tile; 1024: 32, two passes
  start=$SECONDS
  timeout 150 python3 bench/bench_moe.py --experts-format fp4 --tokens 128 256 512 1024 --dispatches grouped_pallas \
    grouped_quant_op --rounds 3 --out "$out/moe_op_range.json" >"$out/moe_op_range.log" 2>&1
  echo "== moe op range: exit $?, $((SECONDS - start)) s"; sed -n '/^device:/p;/^ms per MoE/,$p' "$out/moe_op_range.log" | head -9
  # the FP8 linears (the same kernel's FP8 path): the op against the Pallas kernel per projection, which the
  # model's rule (linear.linear) should pick now
  start=$SECONDS
  timeout 120 python3 bench/bench_linear.py --tokens 8 64 --out "$out/linear.json" >"$out/linear.log" 2>&1
  echo "== linear: exit $?, $((SECONDS - start)) s"; tail -30 "$out/linear.log"
else
  source "$here/../2026-12-06/s5_build.sh"
  export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
  if [ "$PART" = b ]; then
    step plain8 --backends online --modes plain --slots 8  # its first compile took 130-250 s on an H100
    step plain64 --backends online --modes plain --slots 64
  else
    step n4 --backends online offline --modes 4 --slots 8
  fi
fi
