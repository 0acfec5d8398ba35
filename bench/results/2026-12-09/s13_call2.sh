#!/usr/bin/env bash
# The thirteenth session's second GPU call (an H200): issue 42's rows on the H200. The MoE layer, FP4 experts,
# 8-8192 tokens (against this run's copy rate), then the released slice's plain decode step at a 4k context, 8
# slots, device-only. Logs to $OUT. Its bf16 row exited at once: bench_moe.py names bf16 experts "float" (with
# the model's bfloat16 dtype); s13_call3.sh ran it.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
for fmt in fp4 bf16; do
  start=$SECONDS
  timeout 150 python3 bench/bench_moe.py --experts-format $fmt --tokens 8 64 512 2048 8192 --dispatches grouped \
    --rounds 2 --out "$out/moe_$fmt.json" >"$out/moe_$fmt.log" 2>&1
  echo "== moe $fmt: exit $?, $((SECONDS - start)) s"; sed -n '/^ms per MoE/,$p' "$out/moe_$fmt.log" | grep -v "^wrote" | head -20
done
start=$SECONDS
timeout 220 python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots 8 --steps-per-dispatch 16 --prompt-len 3072 \
  --device-only --device-steps 64 --max-len 4096 --out "$out/decode_3072.json" >"$out/decode_3072.log" 2>&1
echo "== decode 4k: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_3072.log" | tail -3
