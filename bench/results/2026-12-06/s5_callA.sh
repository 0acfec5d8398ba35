#!/usr/bin/env bash
# The fifth session's first H100 call: the released V4-Flash slice's prefill against its FLOP floor (the
# attention kernel), and its decode step with the jnp path and the kernel. Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
slice="--configs v4flash-slice --layers 6 --experts 256 --weights released"
start=$SECONDS
timeout "${PREFILL_TIMEOUT:-300}" python3 bench/bench_prefill.py $slice --prompt-lens 8192 32768 131072 \
  --chunks 8192 --attention-impl kernel --reps 2 --out "$out/prefill_kernel.json" >"$out/prefill_kernel.log" 2>&1
echo "== prefill kernel: exit $?, $((SECONDS - start)) s"; cat "$out/prefill_kernel.log" | grep -v "^ *$" | tail -25
start=$SECONDS
timeout "${DECODE_TIMEOUT:-200}" python3 bench/bench_decode.py $slice --backends online --modes plain --slots 8 \
  --attention-impl jnp kernel --steps-per-dispatch 16 --device-steps 32 --tokens 32 \
  --out "$out/decode_attention.json" >"$out/decode_attention.log" 2>&1
echo "== decode jnp/kernel: exit $?, $((SECONDS - start)) s"; grep -E "^\||floor|met" "$out/decode_attention.log" | tail -12
