#!/usr/bin/env bash
# Issue 40's "the step at 32k within 1.3x of the step at 4k" and issue 42's decode step with the FP8 linears on
# the native op: the released slice's plain decode step, 8 slots, device-only (one prefill, no e2e), at a 4k
# and at a 32k context, in one call (the ratio needs both on one machine). ~400 s on an H100. Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
slice="--configs v4flash-slice --layers 6 --experts 256 --weights released --backends online --modes plain"
for ctx in 4096:3072 36864:32768; do
  max_len=${ctx%%:*} prompt=${ctx##*:} start=$SECONDS
  timeout "${ROW_TIMEOUT:-270}" python3 bench/bench_decode.py $slice --slots 8 --steps-per-dispatch 16 \
    --prompt-len "$prompt" --device-only --device-steps 64 --max-len "$max_len" \
    --out "$out/decode_$prompt.json" >"$out/decode_$prompt.log" 2>&1
  echo "== decode, prompts of $prompt: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_$prompt.log" | tail -1
  grep -E "s$" "$out/decode_$prompt.log" | grep -v "^|" | tail -8
done
# issue 42's FP4 MoE layer at 8 and 64 tokens as the decode loop runs it (the slope of 8 calls in one fori_loop)
timeout "${MOE_TIMEOUT:-120}" python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --dispatches grouped \
  --loop 8 --rounds 2 --out "$out/moe_loop.json" >"$out/moe_loop.log" 2>&1
echo "== moe loop: exit $?"; tail -6 "$out/moe_loop.log"
