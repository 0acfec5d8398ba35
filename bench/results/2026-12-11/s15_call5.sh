#!/usr/bin/env bash
# The fifteenth session's fifth GPU call (a fresh start, asked for an H200, given an H100), on main at 0b36e58:
# the kept kernel alone (quant_gmm_probe.sh) and the FP4 MoE layer in a loop of 8 at 8 and 64 tokens, to see
# call 1's and 2's numbers again on a second start. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
OUT=$out/probe VARIANTS=base timeout 70 bash bench/results/2026-12-08/quant_gmm_probe.sh 2>&1 | grep -vE "^\s*$" | tail -6
JAX_OC128_CUDA=ON JAX_OC128_CUDA_ARCHS=90 timeout 100 python3 -m pip install --no-build-isolation --no-deps -q . \
  >"$out/build.log" 2>&1
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 timeout 80 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --loop 8 \
  --dispatches grouped --rounds 3 --out "$out/moe_loop.json" >"$out/moe_loop.log" 2>&1
sed -n '/^device:/p;/^ms per MoE/,$p' "$out/moe_loop.log" | head -9
