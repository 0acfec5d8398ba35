#!/usr/bin/env bash
# Eleventh session, first GPU call: the 32k profile at 8 slots (s10_profile_32k.sh, which builds), then jax's
# Mosaic GPU ragged dot probe (s10_ragged_probe.py). Logs to $OUT.
here=$(dirname "$0")
SLOTS=8 PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-360} bash "$here/s10_profile_32k.sh"
out=${OUT:-gpu_out}
timeout "${PROBE_TIMEOUT:-150}" python3 "$here/s10_ragged_probe.py" 2048 8192 >"$out/ragged_probe.log" 2>&1
echo "== probe: exit $?"; grep -v "^  mgpu" "$out/ragged_probe.log" | tail -30
