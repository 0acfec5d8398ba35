#!/usr/bin/env bash
# The thirteenth session's first GPU call, on main: the FP4 decode kernel's constants swept on their own
# (quant_gmm_probe.sh, no JAX), the indexer's products four ways at a 32k decode's shapes (64 rows, 9216 keys),
# and the released slice's 32k decode profiled by scope at 8 slots. ~450 s on an H100. Logs to $OUT.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
here=$(dirname "$0")
start=$SECONDS
timeout 150 bash "$here/../2026-12-08/quant_gmm_probe.sh" 2>&1 | grep -vE "^\s*$" | tail -60
echo "== kernel probe: $((SECONDS - start)) s"
source "$here/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
timeout 100 python3 "$here/../2026-12-08/indexer_products_probe.py" >"$out/indexer_products.log" 2>&1
echo "== indexer products: exit $?, $((SECONDS - start)) s"; tail -12 "$out/indexer_products.log"
SLOTS=8 PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-300} bash "$here/../2026-12-07/s10_profile_32k.sh" 2>&1 | tail -100
