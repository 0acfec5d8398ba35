#!/usr/bin/env bash
# The twelfth session's fifth GPU call: the Mosaic GPU grouped matmul's probe (its dense reference fixed) at
# 2048 and 8192 tokens, on main with idxdecode and gmmwgmma laid over it. Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout "${PROBE_TIMEOUT:-200}" python3 \
  bench/results/2026-12-07/s11_gmm_mosaic_probe.py 2048 8192 >"$out/gmm_mosaic_probe.log" 2>&1
echo "== probe: exit $?, $((SECONDS - start)) s"; tail -40 "$out/gmm_mosaic_probe.log"
