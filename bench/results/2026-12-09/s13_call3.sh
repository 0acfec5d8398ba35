#!/usr/bin/env bash
# The thirteenth session's third GPU call (the H200 of call 2, warm): the MoE layer as issue 42's targets table
# measures it: FP4 at 8 and 64 tokens in a loop of 8 calls, FP4 and float (bf16) experts at 512-8192 tokens.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
moe() {  # $1: a name for the logs, the rest: bench_moe's arguments
  name=$1; shift; start=$SECONDS
  timeout 150 python3 bench/bench_moe.py "$@" --dispatches grouped --rounds 2 --out "$out/moe_$name.json" \
    >"$out/moe_$name.log" 2>&1
  echo "== moe $name: exit $?, $((SECONDS - start)) s"; grep "copy bandwidth" "$out/moe_$name.log" | cut -c1-60
  sed -n '/^ms per MoE/,$p' "$out/moe_$name.log" | grep -v "^wrote" | grep -v "  us  " | head -12
}
moe fp4_loop --experts-format fp4 --tokens 8 64 --loop 8
moe float --experts-format float --tokens 512 2048 8192
