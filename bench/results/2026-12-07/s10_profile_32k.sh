#!/usr/bin/env bash
# Issue 40's "the attention + indexer share of the slice's step at 8 and 64 slots at 32k context" (and issue 42's
# step by scope: what is left of the 1.5x): the released slice's plain decode at a 32k context, device-only,
# traced with XLA's command buffers off (the profiler then lists each kernel), attributed to the model's scopes by
# bench/step_kernels.py. SLOTS=8 (default; ~300 s) or SLOTS=64 (a call of its own). --context-floor 36864 puts
# every prefill chunk in one context bucket: one scan to compile (section 38: five buckets' scans took ~180 s to
# compile, 223 s in the profiled run, which has its own compile), at the cost of a longer prefill run; the decode
# reads that bucket anyway. Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
rm -rf /tmp/prof /tmp/hlo
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
slots=${SLOTS:-8}; chunk=$((slots > 8 ? 128 : 2048))
XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_decode" \
  timeout "${PROFILE_TIMEOUT:-480}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots "$slots" --steps-per-dispatch 16 --prompt-len 32768 \
  --max-len 36864 --context-floor 36864 --device-only --device-steps 32 --prefill-chunk "$chunk" --profile /tmp/prof \
  --out "$out/profile_32k_$slots.json" >"$out/profile_32k_$slots.log" 2>&1
echo "== profile: exit $?"; grep -E "^\|" "$out/profile_32k_$slots.log" | tail -1; grep -E " s$" "$out/profile_32k_$slots.log" | tail -6
for row in /tmp/prof/*; do python3 bench/step_kernels.py "$row" --steps 16 --hlo /tmp/hlo --detail - \
  target/attention target/attention/compressor target/hyper_connection target/mlp/routed_experts target/mlp/route; done 2>&1 \
  | tee "$out/step_kernels_32k_$slots.log" | head -150
