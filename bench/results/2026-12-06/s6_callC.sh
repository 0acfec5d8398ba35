#!/usr/bin/env bash
# The sixth session's decode call (issues 40, 42): the released slice's decode step at a 3k context with max_len
# 4096 and 1M (cost follows the context), and at a 32k context (the step against the 4k one). Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
slice="--configs v4flash-slice --layers 6 --experts 256 --weights released --backends online --modes plain"
start=$SECONDS
timeout "${MAXLEN_TIMEOUT:-300}" python3 bench/bench_decode.py $slice --slots 8 --steps-per-dispatch 16 \
  --prompt-len 3072 --tokens 32 --device-steps 32 --max-len 4096 1048576 \
  --out "$out/decode_maxlen.json" >"$out/decode_maxlen.log" 2>&1
echo "== decode max_len 4k/1M: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_maxlen.log" | tail -4
start=$SECONDS
timeout "${CONTEXT_TIMEOUT:-240}" python3 bench/bench_decode.py $slice --slots 8 --steps-per-dispatch 16 \
  --prompt-len 32768 --tokens 32 --device-steps 32 --max-len 36864 \
  --out "$out/decode_32k.json" >"$out/decode_32k.log" 2>&1
echo "== decode 32k: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_32k.log" | tail -3
