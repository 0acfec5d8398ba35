#!/usr/bin/env bash
# The twelfth session's fourth GPU call, on main with branches idxdecode and gmmwgmma (bf44e4e, which holds the
# probe bench/results/2026-12-07/s11_gmm_mosaic_probe.py) laid over it: the Mosaic GPU grouped matmul's GPU tests
# and its probe against the Pallas one at 2048 and 8192 tokens (jax 0.11.2's Mosaic API: the branch was lowered
# under 0.10.2 only), then the 4k decode step profiled (XLA's command buffers off), last, as the device time
# allows. Without the HLO dump of s10_profile_32k.sh (--hlo), step_kernels.py names no scope: kernels only.
# Logs to $OUT.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider \
  test_gmm_mosaic.py >"$out/tests_gmm_mosaic.log" 2>&1)
echo "== gmm_mosaic tests: exit $?, $((SECONDS - start)) s"; grep -E "Error|error:|passed|failed" "$out/tests_gmm_mosaic.log" | head -12
start=$SECONDS
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout "${PROBE_TIMEOUT:-150}" python3 \
  bench/results/2026-12-07/s11_gmm_mosaic_probe.py 2048 8192 >"$out/gmm_mosaic_probe.log" 2>&1
echo "== probe: exit $?, $((SECONDS - start)) s"; tail -30 "$out/gmm_mosaic_probe.log"
rm -rf /tmp/prof4k; start=$SECONDS
XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "${PROFILE_TIMEOUT:-230}" python3 bench/bench_decode.py \
  --configs v4flash-slice --layers 6 --experts 256 --weights released --backends online --modes plain --slots 8 \
  --steps-per-dispatch 16 --prompt-len 3072 --device-only --device-steps 32 --max-len 4096 --profile /tmp/prof4k \
  --out "$out/profile_4k.json" >"$out/profile_4k.log" 2>&1
echo "== profile 4k: exit $?, $((SECONDS - start)) s"
for row in /tmp/prof4k/*; do python3 bench/step_kernels.py "$row" --steps 16 --detail - target/attention \
  target/hyper_connection target/mlp/routed_experts target/mlp/shared_expert; done 2>&1 | tee "$out/step_kernels_4k.log" | head -70
